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

from ddp_utils.config import ConfigError, UserError
from ddp_utils.dist import Runtime, any_rank, broadcast_object, main_rank_runs
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


def shared_cache(
    rt: Runtime, locate: Callable[[], tuple[Path, str, Callable[[], dict[str, Any]]]]
) -> dict[str, Any]:
    """Every rank: a cache built (or read) by global rank 0 only; ``locate()`` gives its
    path, its source key and how to build it. The other ranks read the file rank 0 wrote;
    where one cannot see it, rank 0 sends the contents. A ConfigError of rank 0's (a bad
    folder) is raised on every rank."""

    def build_on_main() -> tuple[dict[str, Any] | None, tuple[str, str] | None, str | None]:
        try:
            path, key, build = locate()
            return cached(path, key, build)[0], (str(path), key), None
        except UserError as e:
            return None, None, str(e)

    # No collective waits on the build: it may take longer than trainer.timeout_s.
    contents, where, error = main_rank_runs(rt, build_on_main) or (None, None, None)
    where, error = broadcast_object((where, error))
    if error:
        raise ConfigError(error)
    if not rt.is_main:
        contents = read_cache(Path(where[0]), where[1])
    if any_rank(contents is None):
        sent = broadcast_object(contents if rt.is_main else None)
        contents = contents if contents is not None else sent
    return contents
