"""Where each sample of a WebDataset-layout tar shard lies: its members' byte ranges.

A sample is the run of consecutive members sharing a key (``dir/000123.png`` and
``dir/000123.cls`` form sample ``dir/000123``; the extension is everything after the first dot
of the file name), as webdataset, img2dataset and ``python -m ddp_utils.shards write`` lay
them out. A split's index holds, for every sample in shard order: its shard, the byte range of
its image (``png``, ``jpg``, ``jpeg``, ``webp``, ``bmp``, or ``npy``: a uint8 array, decoded
already) and its class (the ``cls`` member's integer), as tensors: no Python object a sample.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from typing import IO, Any

import torch

from ddp_utils.config import ConfigError

IMAGE_KINDS = ("png", "jpg", "jpeg", "webp", "bmp", "npy")
LABEL_KIND = "cls"


def split_name(name: str) -> tuple[str, str]:
    """``dir/000123.seg.png`` -> (``dir/000123``, ``seg.png``)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def samples_of(tar: IO[bytes], shard: str) -> Iterator[tuple[str, dict[str, tuple[int, int]],
                                                              bytes | None]]:  # fmt: skip
    """``(key, {ext: (offset, size)}, cls bytes)`` for each sample of an open tar file."""
    key, members, label = None, {}, None
    try:
        with tarfile.open(fileobj=tar, mode="r:") as archive:
            for info in archive:
                if not info.isfile():
                    continue
                k, ext = split_name(info.name)
                if k != key:
                    if key is not None:
                        yield key, members, label
                    key, members, label = k, {}, None
                members[ext] = (info.offset_data, info.size)
                if ext == LABEL_KIND:
                    label = archive.extractfile(info).read()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ConfigError(
            f"the shard {shard} is not a readable tar file ({e}): write it again "
            "(python -m ddp_utils.shards write), or remove it."
        ) from None
    if key is not None:
        yield key, members, label


def index_shard(tar: IO[bytes], shard: str, num_classes: int) -> dict[str, torch.Tensor]:
    """One shard's samples: image offset, size and kind, and label, as int64 tensors."""
    offsets, sizes, kinds, labels = [], [], [], []
    for key, members, label in samples_of(tar, shard):
        image = next((k for k in IMAGE_KINDS if k in members), None)
        if image is None or label is None:
            missing = f"an image ({', '.join(IMAGE_KINDS)})" if image is None else "a .cls label"
            raise ConfigError(f"the sample {key} of the shard {shard} has no {missing}: each "
                              f"sample needs {key}.<image> and {key}.cls.")  # fmt: skip
        try:
            value = int(label.decode().strip())
        except ValueError:
            raise ConfigError(f"{key}.cls in the shard {shard} holds {label[:20]!r}, not a class "
                              "index") from None  # fmt: skip
        if not 0 <= value < num_classes:
            raise ConfigError(f"{key}.cls in the shard {shard} is class {value}, outside "
                              f"data.num_classes={num_classes}; set data.num_classes to the "
                              "number of classes.")  # fmt: skip
        offsets.append(members[image][0])
        sizes.append(members[image][1])
        kinds.append(IMAGE_KINDS.index(image))
        labels.append(value)
    if not labels:
        raise ConfigError(f"the shard {shard} holds no samples: remove it, or write it again.")
    return {name: torch.tensor(values, dtype=torch.long) for name, values in
            (("offset", offsets), ("size", sizes), ("kind", kinds), ("label", labels))}  # fmt: skip


def join(
    shards: list[str], parts: list[dict[str, torch.Tensor]], fingerprint: str
) -> dict[str, Any]:
    """A split's index from its shards' (in shard order)."""
    counts = [len(p["label"]) for p in parts]
    return {
        "shards": shards,
        "counts": torch.tensor(counts, dtype=torch.long),
        **{k: torch.cat([p[k] for p in parts]) for k in ("offset", "size", "kind", "label")},
        "fingerprint": fingerprint,
    }
