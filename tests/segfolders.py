"""Segmentation folders the tests write themselves: images with index masks, in the
``data=segfolder`` layout and in Pascal VOC's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

# (h, w) of the validation images: sizes differ, and 7 divides by no world size of 2 or 3.
VAL_SIZES = [(20, 24), (24, 20), (16, 16), (28, 22), (20, 20), (18, 26), (24, 24)]


def pair(rng: np.random.Generator, h: int, w: int, num_classes: int) -> tuple[np.ndarray, ...]:
    """An RGB image of blocks whose colour says the class, its mask, a 255 border between."""
    mask = np.zeros((h, w), dtype=np.uint8)
    for _ in range(3):
        c = int(rng.integers(1, num_classes))
        y, x = int(rng.integers(0, h - 6)), int(rng.integers(0, w - 6))
        mask[y : y + 6, x : x + 6] = c
    colours = np.array([[20, 20, 20], [200, 40, 40], [40, 200, 40], [40, 40, 200]], np.uint8)
    image = colours[mask % len(colours)] + rng.integers(0, 30, (h, w, 3)).astype(np.uint8)
    mask[0, :] = 255  # an ignored row, as VOC's borders
    return image, mask


def write_seg_folder(root: Path, num_classes: int = 4, n_train: int = 12, seed: int = 0,
                     val_sizes: list[tuple[int, int]] = VAL_SIZES) -> Path:  # fmt: skip
    """``root/{train,val}/{images,masks}`` and ``root/classes.txt``."""
    rng = np.random.default_rng(seed)
    splits = {"train": [(24, 24)] * n_train, "val": val_sizes}
    for split, sizes in splits.items():
        for d in ("images", "masks"):
            (root / split / d).mkdir(parents=True, exist_ok=True)
        for i, (h, w) in enumerate(sizes):
            image, mask = pair(rng, h, w, num_classes)
            Image.fromarray(image).save(root / split / "images" / f"{i:03d}.png")
            Image.fromarray(mask, mode="L").save(root / split / "masks" / f"{i:03d}.png")
    names = ["background", "red", "green", "blue"][:num_classes]
    (root / "classes.txt").write_text("\n".join(names) + "\n")
    return root


def write_voc(root: Path, n_train: int = 5, n_val: int = 3, seed: int = 0) -> Path:
    """``root/VOCdevkit/VOC2012`` with JPEG images and palette PNG masks (VOC's own format:
    mode P, the palette index is the class, 255 the border)."""
    rng = np.random.default_rng(seed)
    voc = root / "VOCdevkit" / "VOC2012"
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (voc / d).mkdir(parents=True, exist_ok=True)
    palette = [0] * 768
    for c in range(21):
        palette[3 * c : 3 * c + 3] = [(c * 37) % 256, (c * 91) % 256, (c * 53) % 256]
    palette[765:768] = [224, 224, 192]
    names = {"train": [f"2007_{i:06d}" for i in range(n_train)],
             "val": [f"2008_{i:06d}" for i in range(n_val)]}  # fmt: skip
    for split, stems in names.items():
        for stem in stems:
            image, mask = pair(rng, 20 + 2 * len(stem) % 5, 24, 21)
            Image.fromarray(image).save(voc / "JPEGImages" / f"{stem}.jpg", quality=95)
            m = Image.fromarray(mask, mode="P")
            m.putpalette(palette)
            m.save(voc / "SegmentationClass" / f"{stem}.png")
        (voc / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(stems) + "\n")
    return root


def seg_args(root: Path, *extra: str) -> tuple[str, ...]:
    """A small, fast segmentation run on a test folder."""
    return (
        "task=segmentation", "model=seg_convnet", "model.channels=[8,16]", "data=segfolder",
        f"data.root={root}", "data.num_classes=4", "data.base_size=24", "data.crop_size=24",
        "data.batch_size=4", "data.num_workers=0", "sched=poly", "optim.lr=0.05", *extra,
    )  # fmt: skip
