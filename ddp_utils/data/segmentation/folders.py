"""Image/mask folders on disk: ``data=segfolder`` (``<split>/images`` + ``<split>/masks``) and
``data=voc`` (Pascal VOC's layout, listed by torchvision's ``VOCSegmentation``).

A split is listed once per job by global rank 0, which also reads every image's and mask's
header (PIL opens a file without decoding it) to refuse, before training, an image without a
mask (or the reverse), a mask of another size than its image and a colour (RGB) mask; the
index (paths and sizes) is cached as for ``data=imagefolder``. A mask's values are checked
when it is read, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch

from ddp_utils.config import VOC_CLASSES as VOC_OBJECTS
from ddp_utils.config import ConfigError, SegmentationData
from ddp_utils.data.cache import cache_path, shared_cache
from ddp_utils.data.images.imagefolder import (
    BadImageError,
    PathTable,
    decode,
    is_image,
    unreadable_reason,
)
from ddp_utils.data.images.voc import open_voc
from ddp_utils.dist import Runtime
from ddp_utils.logs import log

INDEX_VERSION = 1
MASK_MODES = ("L", "P", "1", "I;16", "I")  # one value a pixel (a palette image: its index)
SHOWN = 5  # files named in an error
VOC_CLASSES = ["background", *VOC_OBJECTS]


@dataclass
class PairIndex:
    """One split: each image's and mask's path (relative to ``folder``) and (h, w)."""

    folder: Path
    images: PathTable
    masks: PathTable
    sizes: torch.Tensor  # (N, 2)

    def to_dict(self) -> dict:
        return {
            "images": torch.from_numpy(self.images.data),
            "image_offsets": torch.from_numpy(self.images.offsets),
            "masks": torch.from_numpy(self.masks.data),
            "mask_offsets": torch.from_numpy(self.masks.offsets), "sizes": self.sizes,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, folder: Path, d: dict) -> PairIndex:
        return cls(folder, PathTable(d["images"], d["image_offsets"]),
                   PathTable(d["masks"], d["mask_offsets"]), d["sizes"])  # fmt: skip


def _few(items: list[str]) -> str:
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def check_headers(folder: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """Each pair's (h, w) from the files' headers; one paragraph for the first few pairs
    whose sizes differ or whose mask has colours instead of class ids."""
    from PIL import Image

    sizes, misfits, colour = [], [], []
    for image, mask in pairs:
        try:
            with Image.open(folder / image) as im:
                w, h = im.size
            with Image.open(folder / mask) as m:
                mask_size, mode = m.size, m.mode
        except OSError as e:
            raise ConfigError(
                f"cannot read the header of {folder / image} or {folder / mask} ({e}). Replace "
                "or delete the pair."
            ) from None
        if mode not in MASK_MODES:
            colour.append(f"{mask} (mode {mode})")
        elif mask_size != (w, h):
            misfits.append(f"{mask} is {mask_size[0]}x{mask_size[1]}, {image} {w}x{h}")
        sizes.append((h, w))
    if colour:
        raise ConfigError(
            f"{len(colour)} masks under {folder} hold colours, not class ids: {_few(colour)}. "
            "A mask is a single-channel PNG whose pixel value is the class id (or a palette "
            "PNG, whose palette index is); convert colour masks to class ids first."
        )
    if misfits:
        raise ConfigError(
            f"{len(misfits)} masks under {folder} differ in size from their images: "
            f"{_few(misfits)}. A mask has its image's size; fix or remove those pairs."
        )
    return torch.tensor(sizes, dtype=torch.long).reshape(-1, 2)


def pair_folder(cfg: SegmentationData, split: str) -> Path:
    return Path(cfg.root) / (cfg.train_dir if split == "train" else cfg.val_dir)


LAYOUT = "<split>/images/<stem>.<jpg|png|...> with <split>/masks/<stem>.png"


def check_layout(split_dir: Path, key: str) -> None:
    for d in (split_dir / "images", split_dir / "masks"):
        if not d.is_dir():
            raise ConfigError(
                f"{key}: the folder {d} does not exist. data=segfolder reads {LAYOUT} under "
                f"data.root={split_dir.parent}; create it, or point {key} at your folder."
            )


def list_pairs(split_dir: Path) -> list[tuple[str, str]]:
    """``images/<stem>.<ext>`` with ``masks/<stem>.png``, sorted by stem; unmatched files of
    either side are one error."""
    images_dir, masks_dir = split_dir / "images", split_dir / "masks"
    images = {Path(n).stem: n for n in os.listdir(images_dir) if is_image(n)}
    masks = {Path(n).stem: n for n in os.listdir(masks_dir)
             if n.lower().endswith(".png") and not n.startswith(".")}  # fmt: skip
    no_mask = sorted(images.keys() - masks.keys())
    no_image = sorted(masks.keys() - images.keys())
    if no_mask or no_image:
        parts = []
        if no_mask:
            parts.append(f"{len(no_mask)} images without a mask in {masks_dir}: "
                         f"{_few([images[s] for s in no_mask])}")  # fmt: skip
        if no_image:
            parts.append(f"{len(no_image)} masks without an image in {images_dir}: "
                         f"{_few([masks[s] for s in no_image])}")  # fmt: skip
        raise ConfigError(
            f"{'; '.join(parts)}. Every image needs its mask of the same stem ({LAYOUT}); add "
            "the missing files or remove the unmatched ones."
        )
    if not images:
        raise ConfigError(f"{images_dir} holds no images ({LAYOUT}).")
    return [(f"images/{images[s]}", f"masks/{masks[s]}") for s in sorted(images)]


def folder_key(*paths: Path) -> str:
    stats = [INDEX_VERSION] + [(str(p.resolve()), p.stat().st_mtime_ns) for p in paths]
    return hashlib.sha1(json.dumps(stats).encode()).hexdigest()


def scan_pairs(folder: Path, pairs: list[tuple[str, str]]) -> dict:
    start = time.perf_counter()
    sizes = check_headers(folder, pairs)
    log.info("scanned %s: %d images with masks (%.1f s); index cached",
             folder, len(pairs), time.perf_counter() - start)  # fmt: skip
    images = PathTable.build([p for p, _ in pairs])
    masks = PathTable.build([m for _, m in pairs])
    return PairIndex(folder, images, masks, sizes).to_dict()


def segfolder_index(cfg: SegmentationData, split: str, rt: Runtime) -> PairIndex:
    """Every rank: the split's pairs, listed and checked by global rank 0 only."""
    folder = pair_folder(cfg, split)
    key_name = f"data.{split}_dir"

    def locate():
        if not Path(cfg.root).is_dir():
            raise ConfigError(f"data.root={cfg.root} does not exist; point it at the folder "
                              "that holds train/ and val/.")  # fmt: skip
        check_layout(folder, key_name)
        # Keyed on the two folders' mtimes, which change whenever a file is added, removed or
        # renamed: a later job lists nothing.
        key = folder_key(folder / "images", folder / "masks")
        path = cache_path(cfg.root, f"segfolder-{folder.name}.pt")
        return path, key, lambda: scan_pairs(folder, list_pairs(folder))

    return PairIndex.from_dict(folder, shared_cache(rt, locate))


def voc_index(cfg: SegmentationData, split: str, rt: Runtime) -> PairIndex:
    """Every rank: the pairs torchvision's ``VOCSegmentation`` lists for the split's set."""
    image_set = cfg.train_set if split == "train" else cfg.val_set

    def locate():
        from torchvision.datasets import VOCSegmentation

        contents = f"JPEGImages, SegmentationClass, ImageSets/Segmentation/{image_set}.txt"
        voc = open_voc(VOCSegmentation, cfg, image_set, contents)
        folder = Path(voc.images[0]).parent.parent if voc.images else Path(cfg.root)
        pairs = [(os.path.relpath(i, folder), os.path.relpath(m, folder))
                 for i, m in zip(voc.images, voc.masks, strict=True)]  # fmt: skip
        missing = [p for pair in pairs for p in pair if not (folder / p).is_file()]
        if missing:
            raise ConfigError(f"data=voc: {len(missing)} files listed in {image_set}.txt are "
                              f"missing under {folder}: {_few(missing)}.")  # fmt: skip

        def build() -> dict:  # the folder too: the other ranks do not call VOCSegmentation
            return scan_pairs(folder, pairs) | {"folder": str(folder)}

        split_file = folder / "ImageSets" / "Segmentation" / f"{image_set}.txt"
        return cache_path(cfg.root, f"voc{cfg.year}-{image_set}.pt"), folder_key(split_file), build

    contents = shared_cache(rt, locate)
    return PairIndex.from_dict(Path(contents["folder"]), contents)


def read_mask(
    path: str | IO[bytes], cfg: SegmentationData, name: str | None = None
) -> torch.Tensor:
    """A mask file (or a file object, ``name`` saying what it is: a shard's member) as uint8
    (H, W) class ids; a value that is no class and not ``data.ignore_index`` stops the run,
    naming the file."""
    from PIL import Image

    shown = name or str(path)
    try:
        with Image.open(path) as m:
            array = np.array(m)
    except OSError as e:
        raise BadImageError(f"cannot read the mask {shown} ({e}). Replace or delete it.") from None
    if array.ndim != 2:
        raise BadImageError(f"the mask {shown} has {array.shape[-1]} channels: a mask holds one "
                            "class id a pixel.")  # fmt: skip
    # A histogram, not np.unique: no sort of every pixel in the workers' per-sample path.
    present = np.flatnonzero(np.bincount(array.ravel(), minlength=cfg.num_classes))
    bad = present[(present >= cfg.num_classes) & (present != cfg.ignore_index)]
    if bad.size:
        raise BadImageError(
            f"the mask {shown} holds the values {bad[:SHOWN].tolist()}, not class ids of "
            f"data.num_classes={cfg.num_classes} nor data.ignore_index={cfg.ignore_index}. "
            "Raise data.num_classes, set data.ignore_index, or fix the mask."
        )
    return torch.from_numpy(array.astype(np.uint8))


class PairSource:
    """``(uint8 CHW image, uint8 HW mask)`` for each pair of a ``PairIndex``, read on access."""

    def __init__(self, index: PairIndex, cfg: SegmentationData, classes: list[str] | None):
        self.index, self.cfg, self.classes = index, cfg, classes
        self.sizes = index.sizes

    def __len__(self) -> int:
        return len(self.index.sizes)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image_path = str(self.index.folder / self.index.images[i])
        try:
            image = decode(image_path, self.cfg.in_channels)
        except (RuntimeError, OSError, ValueError) as e:
            raise BadImageError(f"cannot read the image {image_path} ({unreadable_reason(e)}). "
                                "Replace or delete the file.") from None  # fmt: skip
        return image, read_mask(str(self.index.folder / self.index.masks[i]), self.cfg)


def folder_classes(cfg: SegmentationData) -> list[str]:
    """``data.root/classes.txt`` (one name a line) if there, else the class ids."""
    path = Path(cfg.root) / "classes.txt"
    if not path.is_file():
        return [str(c) for c in range(cfg.num_classes)]
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if len(names) != cfg.num_classes:
        raise ConfigError(
            f"{path} names {len(names)} classes but data.num_classes={cfg.num_classes}; set "
            f"data.num_classes={len(names)} or fix the file (one class name a line)."
        )
    return names
