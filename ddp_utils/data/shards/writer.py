"""Writing a data option's splits as tar shards, in parallel processes, with the index and
class names beside them (the command is ``python -m ddp_utils.shards write``)."""

from __future__ import annotations

import argparse
import io
import math
import multiprocessing
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch

from ddp_utils.config import DataConfig
from ddp_utils.data.registry import family_of
from ddp_utils.data.shards.formats import format_of
from ddp_utils.data.shards.reader import CLASSES_FILE, INDEX_FILE, fingerprint
from ddp_utils.data.shards.tarindex import index_shard, join
from ddp_utils.dist import Runtime

SPLITS = {"train": "train", "val": "val"}
RUNTIME = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")  # the writer is one process
_job: dict[str, Any] = {}  # the forked writers' source and options


def encode(image: torch.Tensor, decoded: bool, resize: int | None) -> tuple[str, bytes]:
    """A uint8 CHW image as a shard member, its shorter side ``resize`` if given: ``npy``
    (decoded) or ``png``."""
    if resize is not None:
        from torchvision.transforms.v2 import functional as TF

        image = TF.resize(image, resize, antialias=True)
    if decoded:
        buffer = io.BytesIO()
        np.save(buffer, image.contiguous().numpy(), allow_pickle=False)
        return "npy", buffer.getvalue()
    from torchvision.io import encode_png

    return "png", encode_png(image).numpy().tobytes()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shard(k: int) -> tuple[int, str, dict[str, torch.Tensor], int]:
    """Shard ``k`` of the split into the temporary folder; its index part and size."""
    src, per, folder, tmp = _job["source"], _job["per"], _job["folder"], _job["tmp"]
    fmt = _job["format"]
    name = f"{folder}/shard-{k:06d}.tar"
    path = Path(tmp) / name
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(k * per, min(len(src), (k + 1) * per)):
            image, target = src[i]
            if fmt.skipped(target):
                continue
            for kind, data in (encode(image, _job["decoded"], _job["resize"]), fmt.encode(target)):
                add(tar, f"{i:09d}.{kind}", data)
    with open(path, "rb") as f:
        part = index_shard(f, name, fmt)
    return k, name, part, path.stat().st_size


def write_split(cfg: DataConfig, split: str, out: str, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    rt = RUNTIME
    source, fmt = family_of(cfg).samples(cfg, rt, split), format_of(cfg)
    folder = SPLITS[split]
    n_shards = math.ceil(len(source) / args.samples_per_shard)
    fs, base = fsspec.core.url_to_fs(out)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / folder).mkdir()
        _job.update(source=source, per=args.samples_per_shard, folder=folder, tmp=tmp,
                    decoded=args.decoded, resize=args.resize, format=fmt)  # fmt: skip
        results = []
        with multiprocessing.get_context("fork").Pool(args.workers) as pool:
            for result in tqdm(pool.imap_unordered(write_shard, range(n_shards)), total=n_shards,
                               desc=f"{split} shards", file=sys.stderr):  # fmt: skip
                k, name, _, _ = result
                fs.makedirs(f"{base}/{folder}", exist_ok=True)
                fs.put_file(str(Path(tmp) / name), f"{base}/{name}")
                results.append(result)
        results.sort()
        listing = [(name, size) for _, name, _, size in results]
        key = fingerprint(listing, fmt.option)
        index = join([n for n, _ in listing], [p for _, _, p, _ in results], key)
        index["shard_bytes"] = torch.tensor([s for _, s in listing])
        buffer = io.BytesIO()
        torch.save(index, buffer)
        fs.pipe_file(f"{base}/{folder}/{INDEX_FILE}", buffer.getvalue())
    classes = getattr(source, "classes", None)
    if classes:
        fs.pipe_file(f"{base}/{CLASSES_FILE}", "\n".join(classes).encode())
    return len(index["offset"])


def training_command(cfg: DataConfig, out: str, resize: int | None) -> str:
    """train.py with what reading the shards needs that they do not say themselves: the
    classes, channels and size, and the source's normalisation (a shard holds uint8 pixels)."""
    numbers = lambda xs: "[" + ",".join(f"{x:g}" for x in xs) + "]"  # noqa: E731
    keys = {"data": format_of(cfg).option, "data.root": out, "data.num_classes": cfg.num_classes,
            "data.in_channels": cfg.in_channels, "data.image_size": cfg.image_size,
            "data.mean": numbers(cfg.mean), "data.std": numbers(cfg.std)}  # fmt: skip
    if type(cfg).holds == "labels":
        # evaluation resizes to this before its centre crop: the size stored (a source of
        # fixed-size images, as the built-in sets, is stored at data.image_size)
        keys["data.resize_size"] = resize or getattr(cfg, "resize_size", None) or cfg.image_size
    return "train.py " + " ".join(f"{k}={v}" for k, v in keys.items() if v is not None)
