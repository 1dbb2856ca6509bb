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

import tarfile
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch

from ddp_utils.config import ConfigError
from ddp_utils.data.shards.formats import SampleFormat, image_size

IMAGE_KINDS = ("png", "jpg", "jpeg", "webp", "bmp", "npy")
BASE_COLUMNS = ("offset", "size", "kind", "target_offset", "target_size")
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
    wanted = lambda ext: ext in fmt.kinds or (fmt.sizes and ext in IMAGE_KINDS)  # noqa: E731
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
        for name, (offset, length) in (("", members[image]), ("target_", members[target])):
            values[f"{name}offset"].append(offset)
            values[f"{name}size"].append(length)
        values["kind"].append(IMAGE_KINDS.index(image))
        for name in fmt.columns:
            values[name].append(own[name])
    if not values["offset"]:
        raise ConfigError(f"the shard {shard} holds no samples: remove it, or write it again.")
    return {name: torch.tensor(v, dtype=torch.long) for name, v in values.items()}


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
