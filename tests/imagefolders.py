"""Image folders the tests write themselves: the embedded digits saved as image files."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ddp_utils.config import DigitsData
from ddp_utils.data.images.builtin import load_split


def write_digits_folder(root: Path, ext: str = "png", limit: int | None = None) -> Path:
    """``root/train/<digit>/NNNN.ext`` and ``root/val/...``: data=digits' own split as files,
    so the tensor path and the image-folder path train on the same images."""
    cfg = DigitsData()
    for split in ("train", "val"):
        ds = load_split(cfg, split)
        n = len(ds) if limit is None else min(limit, len(ds))
        for i in range(n):
            folder = root / split / str(int(ds.labels[i]))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(ds.images[i, 0].numpy(), mode="L").save(folder / f"{i:04d}.{ext}")
    return root


def folder_args(root: Path, *extra: str) -> tuple[str, ...]:
    """Overrides that read the digits folder at its own size with the digits' normalisation."""
    return (
        "data=imagefolder", f"data.root={root}", "data.in_channels=1", "data.image_size=8",
        "data.resize_size=8", "data.num_classes=10", "data.mean=[0.30]", "data.std=[0.38]",
        "data.batch_size=100", *extra,
    )  # fmt: skip


class _Digits(torch.utils.data.Dataset):
    """The digits as a user's data set might hold them: PIL images, or float tensors."""

    def __init__(self, split: str, as_pil: bool, limit: int | None) -> None:
        ds = load_split(DigitsData(), split)
        n = len(ds) if limit is None else min(limit, len(ds))
        self.images, self.labels, self.as_pil = ds.images[:n], ds.labels[:n], as_pil
        self.classes = [str(i) for i in range(10)]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = self.images[i, 0]
        if self.as_pil:
            return Image.fromarray(image.numpy(), mode="L"), int(self.labels[i])
        return image.float() / 255.0, int(self.labels[i])  # HW float in [0, 1]


def digits_datasets(limit: int | None = None):
    """A ``data=custom`` target: ``(train, val)`` of the digits, PIL images and float tensors."""
    return _Digits("train", True, limit), _Digits("val", False, limit)


def write_png16(path: Path, image: np.ndarray) -> Path:
    """A 16-bit PNG (grey, grey + alpha, RGB or RGBA: HW or HWC uint16), which PIL cannot
    write in colour: the format's chunks by hand."""
    h, w = image.shape[:2]
    channels = 1 if image.ndim == 2 else image.shape[2]
    color_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    rows = b"".join(b"\x00" + image[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))  # fmt: skip
    return path


class _Stalling(_Digits):
    """Validation digits whose item ``stall_at`` never arrives: the worker reading it blocks
    (as on a hung file system) until the process it serves is gone."""

    def __init__(self, stall_at: int) -> None:
        super().__init__("val", False, None)
        self.stall_at = stall_at

    def __getitem__(self, i: int):
        if i == self.stall_at:
            import os
            import time

            parent = os.getppid()
            while os.getppid() == parent:
                time.sleep(0.2)
        return super().__getitem__(i)


def stalling_datasets(stall_at: int, limit: int = 200):
    """A ``data=custom`` target: digits for training, and a validation set that stalls."""
    return _Digits("train", True, limit), _Stalling(stall_at)
