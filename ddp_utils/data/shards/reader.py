"""``data=shards``: WebDataset-layout tar shards from a folder or an object store.

The family reads ``data.root/<train_dir>/*.tar`` and ``<val_dir>/*.tar`` (``ddp_utils.data.shards
.store``), indexes every sample's byte range once (``tarindex``; the writer's ``index.pt``
beside the shards when it matches them, else built on the first read and cached), and reads
each sample by position, so the sampler's order and resume work as for an image folder. The
epoch's order shuffles the shards, then the samples within each window of
``data.shuffle_window`` shards, from (seed, epoch) alone: the same at any world size and worker
count, and a rank reads from a few shards at a time. Remote shards are kept in a per-node
cache and the next window's shards are fetched while the current one is read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler
from torchvision.io import ImageReadMode, decode_image

from ddp_utils.config import ConfigError, DataConfig
from ddp_utils.data.bundle import DataBundle, EvalData, image_bundle, image_eval
from ddp_utils.data.cache import shared_cache
from ddp_utils.data.images.imagefolder import BadImages, match_channels, to_uint8, unreadable_reason
from ddp_utils.data.images.transforms import SeededTransform, eval_transform, train_transform
from ddp_utils.data.loaders import eval_shard_loader, sharded_loaders
from ddp_utils.data.samplers import EpochTagged
from ddp_utils.data.shards.formats import format_of
from ddp_utils.data.shards.store import NodeCache, Store, default_cache_dir, is_pattern
from ddp_utils.data.shards.tarindex import IMAGE_KINDS, RAW, index_shard, join
from ddp_utils.dist import Runtime

INDEX_FILE = "index.pt"  # the writer's index of a split, beside its shards
CLASSES_FILE = "classes.txt"  # class names, one a line, in data.root (optional)
INDEX_VERSION = 3  # 2: the target member's byte range, the images' sizes; 3: raw arrays
OPEN_FILES = 16  # shards a reading process keeps open


def fingerprint(listing: list[tuple[str, int]], option: str) -> str:
    """What an index describes: these shards (names and sizes), read by this data option."""
    return hashlib.sha1(json.dumps([INDEX_VERSION, option, listing]).encode()).hexdigest()


def shard_windows(
    n_shards: int, seed: int, epoch: int, window: int
) -> tuple[list[list[int]], torch.Generator]:
    """The epoch's shards, permuted and cut into windows of ``window``; the generator goes on
    to draw the samples' order within each window (``window_order``)."""
    g = torch.Generator().manual_seed(seed + epoch)
    shards = torch.randperm(n_shards, generator=g).tolist()
    return [shards[w : w + window] for w in range(0, n_shards, window)], g


def window_order(counts: torch.Tensor, seed: int, epoch: int, window: int) -> list[int]:
    """The epoch's order: the shards permuted, then the samples within each run of ``window``
    shards of that permutation; a function of (counts, seed, epoch, window) alone."""
    windows, g = shard_windows(len(counts), seed, epoch, window)
    starts = torch.cumsum(counts, 0) - counts
    parts = []
    for chosen in windows:
        idx = torch.cat([torch.arange(int(starts[s]), int(starts[s] + counts[s])) for s in chosen])
        parts.append(idx[torch.randperm(len(idx), generator=g)])
    return torch.cat(parts).tolist() if parts else []


class ShardReader:
    """Bytes of one sample: from the shard in place (a local folder), from the node cache, or
    by a range request (``data.cache_bytes=0``). Each process keeps a few shards open."""

    def __init__(self, store: Store, cache: NodeCache | None, index: dict[str, Any]) -> None:
        self.store, self.cache = store, cache
        self.names, self.sizes = index["shards"], index["shard_bytes"]
        self.files: OrderedDict[int, int] = OrderedDict()

    def path(self, shard: int) -> Path:
        name = self.names[shard]
        if self.store.local:
            return self.store.local_path(name)
        assert self.cache is not None
        return self.cache.get(self.store, name, int(self.sizes[shard]))

    def read(self, shard: int, offset: int, size: int) -> bytes:
        if not self.store.local and self.cache is None:
            return self.store.read(self.names[shard], offset, size)
        fd = self.files.pop(shard, None)
        if fd is None:
            try:
                fd = os.open(self.path(shard), os.O_RDONLY)
            except FileNotFoundError:
                if self.store.local:
                    raise
                # the node cache's copy went between its lookup and this open (an eviction,
                # the folder removed): fetched again
                fd = os.open(self.path(shard), os.O_RDONLY)
            if len(self.files) >= OPEN_FILES:
                os.close(self.files.popitem(last=False)[1])
        self.files[shard] = fd
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise OSError(f"the shard {self.names[shard]} ends early")
        return data

    def __getstate__(self) -> dict[str, Any]:  # a worker opens its own files
        return {**self.__dict__, "files": OrderedDict()}


def decode_member(data: bytes, kind: int, shape: int, channels: int, where: str) -> torch.Tensor:
    if kind == RAW:
        c, h, w = shape >> 40, (shape >> 20) & 0xFFFFF, shape & 0xFFFFF
        image = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(c, h, w)
        return match_channels(image, channels, where)
    if IMAGE_KINDS[kind] == "npy":
        image = torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
        return match_channels(to_uint8(image, where), channels, where)
    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return match_channels(to_uint8(decode_image(buffer, mode=mode), where), channels, where)


class ShardSource(Dataset):
    """``(uint8 CHW image, target)`` of each sample of a split's shards, in shard order: the
    target as the data option's format makes it (a class, a mask, boxes). It also carries how
    its training epochs are read: the windowed order and the next window's prefetch."""

    def __init__(self, reader: ShardReader, index: dict[str, Any], cfg: DataConfig,
                 classes: list[str] | None) -> None:  # fmt: skip
        self.reader, self.channels = reader, cfg.in_channels
        # numpy views of the index's columns: a scalar read is ten times cheaper than a tensor's
        self.index = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in index.items()}
        self.format, self.window = format_of(cfg), cfg.shuffle_window
        self.counts = index["counts"]
        self.shard_of = torch.repeat_interleave(torch.arange(len(self.counts)), self.counts).numpy()
        self.bad, self.classes = BadImages(cfg), classes
        if self.format.sizes:
            self.sizes = torch.stack([index["height"], index["width"]], 1)  # (N, 2), as folders

    def __len__(self) -> int:
        return len(self.shard_of)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        shard, ix = int(self.shard_of[i]), self.index
        where = f"sample {i} of {self.reader.store.url(self.reader.names[shard])}"
        data = self.reader.read(shard, int(ix["offset"][i]), int(ix["size"][i]))
        member = None
        if self.format.reads_target:
            member = self.reader.read(shard, int(ix["target_offset"][i]), int(ix["target_size"][i]))
        try:
            image = decode_member(data, int(ix["kind"][i]), int(ix["shape"][i]), self.channels,
                                  where)  # fmt: skip
        except (RuntimeError, ValueError) as e:
            reason = unreadable_reason(e)
            stop = (f"cannot decode the {where} ({reason}): write the shard again, or set "
                    "data.skip_bad_images=true to skip unreadable images.")  # fmt: skip
            return self.bad.handle(where, stop, f"skipping the unreadable {where} ({reason})")
        return image, self.format.target(ix, i, member, where)

    def epoch_order(self, seed: int, epoch: int) -> list[int]:
        return window_order(self.counts, seed, epoch, self.window)

    def prefetching(self, keys: EpochTagged, seed: int) -> Sampler:
        return Prefetching(keys, self, self.window, seed)


class Prefetching(Sampler):
    """The training keys, drawn in the main process: on entering a window of shards, the next
    window's shards are fetched into the node cache in the background."""

    def __init__(self, keys: EpochTagged, source: ShardSource, window: int, seed: int) -> None:
        self.keys, self.source, self.window, self.seed = keys, source, window, seed
        self.pool: ThreadPoolExecutor | None = None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        windows, current = None, -1
        for epoch, i in self.keys:
            if windows is None:
                windows = shard_windows(len(self.source.counts), self.seed, epoch, self.window)[0]
                window_of = {s: w for w, ws in enumerate(windows) for s in ws}
            w = window_of[int(self.source.shard_of[i if i >= 0 else ~i])]
            if w != current and w + 1 < len(windows):
                current = w
                self.pool = self.pool or ThreadPoolExecutor(2, thread_name_prefix="prefetch")
                for s in windows[w + 1]:
                    self.pool.submit(self.source.reader.path, s)
            yield epoch, i

    def __len__(self) -> int:
        return len(self.keys)


def split_index(cfg: DataConfig, store: Store, cache: NodeCache | None, split: str,
                rt: Runtime) -> dict[str, Any]:  # fmt: skip
    """Every rank: the split's index, read or built by global rank 0 (``shared_cache``)."""

    def locate():
        listing = store.listing(split)
        key = fingerprint(listing, format_of(cfg).option)
        digest = hashlib.sha1(f"{store.root}/{split}".encode()).hexdigest()[:16]
        path = Path(cfg.cache_dir or default_cache_dir()) / "index" / f"{digest}.pt"

        def build() -> dict[str, Any]:
            folder = split if not is_pattern(split) else listing[0][0].rpartition("/")[0]
            written = writers_index(store, folder, key)
            if written is not None:
                return written
            names, sizes = [n for n, _ in listing], [s for _, s in listing]
            reader = ShardReader(store, cache, {"shards": names, "shard_bytes": sizes})
            parts = []
            for s, (name, _) in enumerate(listing):
                with open(reader.path(s), "rb") as f:
                    parts.append(index_shard(f, store.url(name), format_of(cfg)))
            return join([n for n, _ in listing], parts, key) | {
                "shard_bytes": torch.tensor([s for _, s in listing])}  # fmt: skip

        return path, key, build

    return shared_cache(rt, locate)


def writers_index(store: Store, split: str, key: str) -> dict[str, Any] | None:
    """The writer's ``index.pt`` of the split, if it describes these very shards."""
    name = f"{split}/{INDEX_FILE}"
    try:  # through the store's retries: one that does not answer is StoreUnavailable
        data = store.read(name, 0, store.size(name))
    except (FileNotFoundError, PermissionError):
        return None
    index = torch.load(io.BytesIO(data), weights_only=True)
    return index if index.get("fingerprint") == key else None


def read_classes(store: Store) -> list[str] | None:
    """``classes.txt``'s lines; None where there is none. A store that does not answer
    raises ``StoreUnavailable`` (one line, exit code 75), as it does mid-epoch."""
    try:
        return store.read(CLASSES_FILE, 0, store.size(CLASSES_FILE)).decode().splitlines()
    except (FileNotFoundError, PermissionError):  # listing the split names what is wrong
        return None


def class_names(cfg: DataConfig) -> list[str]:
    """``data.root/classes.txt``, for a ``data.num_classes=null`` that counts its lines."""
    store = Store(cfg.root, dict(cfg.storage_options), cfg.retries)
    classes = read_classes(store)
    if not classes:
        raise ConfigError(
            f"data.num_classes=null counts the lines of {store.url(CLASSES_FILE)}, which does not "
            "exist: set data.num_classes (the classes and the background), or write the shards "
            "with python -m ddp_utils.shards write, which writes it."
        )
    return classes


def checked_classes(cfg: DataConfig, store: Store) -> list[str] | None:
    """The class names of ``classes.txt`` if there, as many as ``data.num_classes``."""
    classes = read_classes(store)
    if classes is not None and len(classes) != cfg.num_classes:
        raise ConfigError(
            f"{store.url(CLASSES_FILE)} names {len(classes)} classes but data.num_classes="
            f"{cfg.num_classes}; set data.num_classes={len(classes)} or fix the file (one class "
            "name a line)."
        )
    return classes


def open_store(cfg: DataConfig) -> tuple[Store, NodeCache | None]:
    store = Store(cfg.root, dict(cfg.storage_options), cfg.retries)
    if store.local or cfg.cache_bytes == 0:
        return store, None
    return store, NodeCache(Path(cfg.cache_dir or default_cache_dir()), cfg.cache_bytes)


def check_cache(cfg: DataConfig, index: dict[str, Any]) -> None:
    """The cache must hold the window being read and the one being fetched."""
    need = 2 * cfg.shuffle_window * int(index["shard_bytes"].max())
    if cfg.cache_bytes < need:
        raise ConfigError(
            f"data.cache_bytes={cfg.cache_bytes} cannot hold two windows of "
            f"data.shuffle_window={cfg.shuffle_window} shards of up to "
            f"{int(index['shard_bytes'].max())} bytes: set data.cache_bytes={need} or more, or "
            "a smaller data.shuffle_window."
        )


def sources(cfg: DataConfig, rt: Runtime, splits: tuple[str, ...]) -> dict[str, ShardSource]:
    store, cache = open_store(cfg)
    classes = checked_classes(cfg, store)
    found = {}
    for split in splits:
        index = split_index(
            cfg, store, cache, cfg.train_dir if split == "train" else cfg.val_dir, rt
        )
        if cache is not None:
            check_cache(cfg, index)
        found[split] = ShardSource(ShardReader(store, cache, index), index, cfg, classes)
    return found


def samples(cfg: DataConfig, rt: Runtime, split: str) -> ShardSource:
    """``(uint8 CHW image, target)`` of a split: the segmentation and detection families'
    source, and what ``python -m ddp_utils.shards write`` reads."""
    return sources(cfg, rt, (split,))[split]


def build(cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str) -> DataBundle:
    src = sources(cfg, rt, ("train", "val"))
    train, val = (SeededTransform(src[s], t(cfg), seed) for s, t in
                  (("train", train_transform), ("val", eval_transform)))  # fmt: skip
    loaders = (*sharded_loaders(train, val, cfg, rt, seed, src["train"]), src["train"].classes)
    return image_bundle(cfg, rt, loaders, False, channels_last)


def build_eval(cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str) -> EvalData:
    source = sources(cfg, rt, (cfg.split,))[cfg.split]
    ds = SeededTransform(source, eval_transform(cfg), seed)
    return image_eval(cfg, rt, eval_shard_loader(ds, cfg, rt), source.classes, channels_last)
