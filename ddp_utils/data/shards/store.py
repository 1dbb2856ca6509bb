"""Shards on a store: a local folder or any fsspec URL, read through a per-node cache.

``Store`` lists a split's ``*.tar`` and reads byte ranges; remote reads are retried with
backoff, and a store still not answering after ``data.retries`` attempts raises
``StoreUnavailable`` (exit code 75: relaunch once the store is back; the run resumes exactly).
``NodeCache`` keeps whole shards on the node's disk: each shard is downloaded once per node
(a lock file lets one process download it while the node's others wait for it), written under
a temporary name and renamed when complete (a killed download leaves nothing that is read),
and the least recently used shards are removed past ``data.cache_bytes``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from ddp_utils.config import ConfigError, UserError
from ddp_utils.urls import fs_options

T = TypeVar("T")
FOLDER_RETRIES = 3  # a cache folder removed again while it is made anew
RETRY_EXIT = 75  # EX_TEMPFAIL: the store was unreachable; the same command resumes
CHUNK = 8 << 20


_INHERITED: list[Any] = []  # store clients a forked process got from its parent


class StoreUnavailable(UserError):
    """The store did not answer within the retries; raised where it happened (a DataLoader
    worker re-raises it in its rank with the message alone)."""

    exit_code = RETRY_EXIT

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if marker in message:  # a DataLoader worker's traceback text around it
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message, rank_specific=True)


def retrying(what: str, attempt: Callable[[], T], retries: int) -> T:
    """``attempt()``, again after 1, 2, 4, ... s (at most 30) while the store fails."""
    for n in range(retries):
        try:
            return attempt()
        except (FileNotFoundError, PermissionError, UserError):
            raise
        except Exception as e:  # noqa: BLE001 - any transport error of any fsspec backend
            if n + 1 == retries:
                raise StoreUnavailable(
                    f"the data store did not answer {what} after {retries} attempts ({e}). "
                    "Once it is back, relaunch the same command: the run resumes from its "
                    "last checkpoint."
                ) from None
            time.sleep(min(30.0, 2.0**n))
    raise AssertionError("unreachable")


class Store:
    """``data.root`` as an fsspec file system and a base path."""

    def __init__(self, root: str, storage_options: dict[str, Any], retries: int) -> None:
        self.root, self.retries = root.rstrip("/"), retries
        protocol = fsspec.utils.get_protocol(root)
        self.options = fs_options(root, storage_options)
        self._fs: Any = None
        self._pid = -1
        try:
            self.base = fsspec.core.url_to_fs(self.root, **self.options)[1]
        except (ImportError, ValueError) as e:
            raise ConfigError(f"data.root={root}: {e} (S3 needs s3fs: pip install s3fs; GCS "
                              "gcsfs).") from None  # fmt: skip
        self.local = protocol in ("file", "local")

    @property
    def fs(self) -> Any:
        """The file system of this process: an object store's client is not fork-safe, so a
        DataLoader worker (a fork) makes its own."""
        if self._pid != os.getpid():
            if self._fs is not None:
                # The parent's client, kept from collection: closing it here would run on the
                # parent's event loop, which this process does not have (asyncio errors).
                _INHERITED.append(self._fs)
            self._fs = fsspec.core.url_to_fs(self.root, skip_instance_cache=True,
                                             **self.options)[0]  # fmt: skip
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1}

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def listing(self, split: str, suffix: str = "tar") -> list[tuple[str, int]]:
        """``(name relative to data.root, bytes)`` of each shard of a split: the ``*.tar`` (or
        ``*.<suffix>``) of the folder ``split``, by name, or the shards a brace pattern names,
        in its order (``train/shard-{000000..000099}.tar``, ``{a,b}/part-{0..9}.tar``)."""
        names = expand_braces(split) if is_pattern(split) else None
        folders = sorted({n.rpartition("/")[0] for n in names}) if names else [split]
        found: dict[str, Any] = {}
        for folder in folders:
            pattern = f"{self.base.rstrip('/')}/{folder}/*.{suffix}"
            try:
                glob = lambda p=pattern: self.fs.glob(p, detail=True)  # noqa: E731
                found |= retrying(f"listing {self.url(folder)}", glob, self.retries)
            except (PermissionError, OSError) as e:
                raise ConfigError(self.access_error(folder, e)) from None
        start = len(self.base.rstrip("/")) + 1
        sizes = {n[start:]: int(info["size"]) for n, info in found.items()}
        if not sizes:
            self.refuse_empty(split, suffix)
        if names is None:
            return sorted(sizes.items())
        missing = [n for n in names if n not in sizes]
        if missing:
            raise ConfigError(f"{len(missing)} shard(s) of the pattern {split} are not under "
                              f"{self.root}: {', '.join(missing[:5])}. Fix the pattern, or "
                              "write the missing shards.")  # fmt: skip
        return [(n, sizes[n]) for n in names]

    def refuse_empty(self, split: str, suffix: str = "tar") -> None:
        if not self.exists(""):
            raise ConfigError(
                f"data.root={self.root} does not exist (no such folder, bucket or prefix): "
                "check its spelling, or write the shards there first."
            )
        how = (f"write them with python -m ddp_utils.shards write --out {self.root} ...",
               "python -m ddp_utils.prepare_text writes token files")[suffix == "bin"]  # fmt: skip
        raise ConfigError(f"{self.url(split)}/ holds no *.{suffix} shards: {how}, or set "
                          "data.root (data.train_dir / data.val_dir).")  # fmt: skip

    def exists(self, name: str) -> bool:
        path = f"{self.base.rstrip('/')}/{name}".rstrip("/")
        return retrying(f"reading {self.url(name)}", lambda: self.fs.exists(path), self.retries)

    def size(self, name: str) -> int:
        path = f"{self.base.rstrip('/')}/{name}"
        return retrying(f"reading {self.url(name)}", lambda: int(self.fs.size(path)),
                        self.retries)  # fmt: skip

    def access_error(self, split: str, e: Exception) -> str:
        return (f"cannot list {self.url(split)} ({type(e).__name__}: {e}). Check data.root, the "
                "bucket's name, and the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                "AWS_ENDPOINT_URL, or data.storage_options).")  # fmt: skip

    def read(self, name: str, start: int, size: int) -> bytes:
        """Bytes ``[start, start + size)`` of a file, by a range request."""
        path = f"{self.base.rstrip('/')}/{name}"
        return retrying(f"reading {self.url(name)}",
                        lambda: self.fs.cat_file(path, start=start, end=start + size),
                        self.retries)  # fmt: skip

    def download(self, name: str, dest: Path, size: int) -> None:
        """The whole file into ``dest`` (complete, or an error)."""
        path = f"{self.base.rstrip('/')}/{name}"

        def attempt() -> None:
            with self.fs.open(path, "rb", block_size=CHUNK) as src, open(dest, "wb") as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
            if dest.stat().st_size != size:
                raise OSError(f"{dest.stat().st_size} of {size} bytes arrived")

        retrying(f"downloading {self.url(name)}", attempt, self.retries)

    def local_path(self, name: str) -> Path:
        return Path(self.base) / name


BRACES = re.compile(r"\{([^{}]*)\}")


def is_pattern(split: str) -> bool:
    """A split given as shards (a brace pattern or one ``.tar``), not as a folder."""
    return "{" in split or split.endswith(".tar")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace patterns: ``{000..012}`` (a numeric range, zero-padded as written)
    and ``{a,b,c}`` (alternatives), as many groups as the pattern has, left to right."""
    m = BRACES.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[: m.start()], pattern[m.end() :]
    if ".." in body:
        lo, _, hi = body.partition("..")
        if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
            raise ConfigError(f"{{{body}}} in {pattern} is not a range like {{000..099}}")
        choices = [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    return [name for c in choices for name in expand_braces(head + c + tail)]


def default_cache_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ddp-recipes" / "shards"


class NodeCache:
    """Whole shards on this node's disk, shared by its ranks and their loader workers."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        (folder / ".locks").mkdir(parents=True, exist_ok=True)

    def file(self, store: Store, name: str, size: int) -> Path:
        digest = hashlib.sha1(json.dumps([store.root, name, size]).encode()).hexdigest()[:16]
        return self.folder / f"{digest}-{Path(name).name}"

    def get(self, store: Store, name: str, size: int) -> Path:
        """The shard's local copy, downloaded by one process of the node if it is missing. A
        cache folder removed while the run reads through it (a tmp cleaner on a long job) is
        made again, and its shards downloaded again from the store."""
        path = self.file(store, name, size)
        if path.exists():
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used
            return path
        for attempt in range(FOLDER_RETRIES):
            self.ensure_folder(store)
            try:
                return self.fetch(store, name, size, path)
            except FileNotFoundError:
                # The store's own "no such file", or the folder went while this wrote into it
                if attempt + 1 == FOLDER_RETRIES or (self.folder / ".locks").is_dir():
                    raise
        raise AssertionError("unreachable")

    def fetch(self, store: Store, name: str, size: int, path: Path) -> Path:
        lock = self.folder / ".locks" / f"{path.name}.lock"
        with open(lock, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # the node's other processes wait here
            if not path.exists():
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                try:
                    store.download(name, tmp, size)
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
                self.evict(keep=path)
        return path

    def ensure_folder(self, store: Store) -> None:
        """Make the cache folder again if it is gone; the one process of the node that makes
        it says so, once."""
        locks = self.folder / ".locks"
        if locks.is_dir():
            return
        try:
            locks.mkdir(parents=True)
        except FileExistsError:
            return  # another process of the node made it first
        print(f"warning: the shard cache {self.folder} was removed while the run read through "
              f"it; made again, and its shards are downloaded again from {store.root}",
              file=sys.stderr, flush=True)  # fmt: skip

    def evict(self, keep: Path) -> None:
        """Remove the least recently used shards until the cache fits ``limit``."""
        files = [p for p in self.folder.iterdir() if p.is_file() and not p.name.startswith(".")]
        stats = []
        for p in files:
            with contextlib.suppress(FileNotFoundError):
                st = p.stat()
                stats.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in stats)
        for _, size, p in sorted(stats):
            if total <= self.limit:
                break
            if p != keep:
                p.unlink(missing_ok=True)  # a reader's open file stays readable
                total -= size
