"""Where each sample of a WebDataset-layout tar shard lies: its members' byte ranges.

A sample is the run of consecutive members sharing a key (``dir/000123.png`` and
``dir/000123.cls`` form sample ``dir/000123``; the extension is everything after the first dot
of the file name), as webdataset, img2dataset and ``python -m ddp_utils.shards write`` lay
them out. A split's index holds, for every sample in shard order: the byte range of its image
(``png``, ``jpg``, ``jpeg``, ``webp``, ``bmp``, or ``npy``: a uint8 array, decoded already) and
of its target member, and what its format keeps (the ``cls`` member's integer; the image's
size), as tensors: no Python object a sample.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch

from ddp_utils.config import ConfigError
from ddp_utils.data.shards.formats import SampleFormat, image_size

IMAGE_KINDS = ("png", "jpg", "jpeg", "webp", "bmp", "npy")
# An index "kind" past IMAGE_KINDS: the raw bytes of a uint8 ``npy`` array, its header skipped
# at indexing and its shape in the "shape" column (c << 40 | h << 20 | w): read as it lies,
# with no header to parse a sample (numpy's parser costs 80 us, the read itself 5).
RAW = len(IMAGE_KINDS)
NPY_HEADER = re.compile(
    rb"^\{'descr': '\|u1', 'fortran_order': False, 'shape': \((\d+), (\d+)(?:, (\d+))?\), \}\s*$"
)
BASE_COLUMNS = ("offset", "size", "kind", "shape", "target_offset", "target_size")
SIZE_COLUMNS = ("height", "width")


def split_name(name: str) -> tuple[str, str]:
    """``dir/000123.seg.png`` -> (``dir/000123``, ``seg.png``)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def samples_of(
    tar: IO[bytes], shard: str, wanted: Callable[[str], bool]
) -> Iterator[tuple[str, dict[str, tuple[int, int]], dict[str, bytes]]]:
    """``(key, {ext: (offset, size)}, {ext: bytes})`` for each sample of an open tar file; the
    bytes of the members whose extension is ``wanted``."""
    key, members, data = None, {}, {}
    try:
        with tarfile.open(fileobj=tar, mode="r:") as archive:
            for info in archive:
                if not info.isfile():
                    continue
                k, ext = split_name(info.name)
                if k != key:
                    if key is not None:
                        yield key, members, data
                    key, members, data = k, {}, {}
                members[ext] = (info.offset_data, info.size)
                if wanted(ext):
                    data[ext] = archive.extractfile(info).read()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ConfigError(
            f"the shard {shard} is not a readable tar file ({e}): write it again "
            "(python -m ddp_utils.shards write), or remove it."
        ) from None
    if key is not None:
        yield key, members, data


def index_shard(tar: IO[bytes], shard: str, fmt: SampleFormat) -> dict[str, torch.Tensor]:
    """One shard's samples: the image's offset, size and kind, the target member's offset and
    size, the image's height and width where the format needs them, and the format's own
    columns (the class), as int64 tensors."""
    columns = [*BASE_COLUMNS, *(SIZE_COLUMNS if fmt.sizes else ()), *fmt.columns]
    values: dict[str, list[int]] = {c: [] for c in columns}
    wanted = lambda ext: ext in fmt.kinds or ext == "npy" or (fmt.sizes and ext in IMAGE_KINDS)  # noqa: E731
    for key, members, data in samples_of(tar, shard, wanted):
        image = next((k for k in IMAGE_KINDS if k in members), None)
        target = next((k for k in fmt.kinds if k in members), None)
        if image is None or target is None:
            missing = f"image ({', '.join(IMAGE_KINDS)})" if image is None else \
                f".{fmt.kinds[0]} member"  # fmt: skip
            raise ConfigError(f"the sample {key} of the shard {shard} has no {missing}: each "
                              f"sample needs {key}.<image> and {key}.{fmt.kinds[0]}.")  # fmt: skip
        size = None
        if fmt.sizes:
            try:
                size = image_size(data[image], image)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{key}.{image} in the shard {shard} is not a readable image "
                                  f"({e}): write the shard again.") from None  # fmt: skip
            values["height"].append(size[0])
            values["width"].append(size[1])
        own = fmt.index_sample(key, data[target], size, shard)
        (offset, length), kind, shape = members[image], IMAGE_KINDS.index(image), 0
        if image == "npy" and (raw := raw_array(data.get(image))):
            skip, shape = raw
            offset, length, kind = offset + skip, length - skip, RAW
        for name, (at, n) in (("", (offset, length)), ("target_", members[target])):
            values[f"{name}offset"].append(at)
            values[f"{name}size"].append(n)
        values["kind"].append(kind)
        values["shape"].append(shape)
        for name in fmt.columns:
            values[name].append(own[name])
    if not values["offset"]:
        raise ConfigError(f"the shard {shard} holds no samples: remove it, or write it again.")
    return {name: torch.tensor(v, dtype=torch.long) for name, v in values.items()}


def raw_array(data: bytes | None) -> tuple[int, int] | None:
    """(header bytes, packed C/H/W shape) of a C-ordered uint8 ``npy`` member of 2 or 3
    dimensions (version 1 header); None for any other array (read through numpy)."""
    if data is None or data[:8] != b"\x93NUMPY\x01\x00":
        return None
    skip = 10 + int.from_bytes(data[8:10], "little")
    m = NPY_HEADER.match(data[10:skip])
    if m is None:
        return None
    dims = [int(d) for d in m.groups() if d is not None]
    c, h, w = dims if len(dims) == 3 else [1, *dims]
    if len(data) - skip != c * h * w or max(h, w) >= 1 << 20:
        return None
    return skip, c << 40 | h << 20 | w


def join(
    shards: list[str], parts: list[dict[str, torch.Tensor]], fingerprint: str
) -> dict[str, Any]:
    """A split's index from its shards' (in shard order)."""
    return {
        "shards": shards,
        "counts": torch.tensor([len(p["offset"]) for p in parts], dtype=torch.long),
        **{k: torch.cat([p[k] for p in parts]) for k in parts[0]},
        "fingerprint": fingerprint,
    }
