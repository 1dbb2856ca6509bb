"""On-disk caches of derived data (decoded tensors, folder indexes), keyed on their source."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp_utils.files import atomic_save


def cache_path(root: str | Path, name: str) -> Path:
    """``root/.ddp_recipes_cache/name``, or a per-user cache when ``root`` is read-only."""
    root = Path(root)
    # The write bits, not only access(): root may write anywhere, but a folder shipped
    # read-only (shared data) should stay as it is.
    if os.access(root, os.W_OK) and root.stat().st_mode & stat.S_IWUSR:
        return root / ".ddp_recipes_cache" / name
    digest = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "ddp-recipes" / digest / name


def read_cache(path: Path, key: str) -> dict[str, Any] | None:
    """The cached dict at ``path`` if it was built from the source state ``key``."""
    if not path.is_file():
        return None
    try:
        cached = torch.load(path, weights_only=True)
    except Exception:  # a torn or foreign cache file is rebuilt by the caller
        return None
    return cached if isinstance(cached, dict) and cached.get("key") == key else None


def cached(path: Path, key: str, build: Callable[[], dict[str, Any]]) -> tuple[dict, bool]:
    """``(contents, built)``: the cache at ``path`` for ``key``, or ``build()`` written there."""
    hit = read_cache(path, key)
    if hit is not None:
        return hit, False
    contents = {**build(), "key": key}
    with contextlib.suppress(OSError):  # nowhere writable: build again next time
        atomic_save(contents, path)
    return contents, True
