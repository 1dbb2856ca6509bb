"""Image folders streamed from disk: ``root/train/<class>/*.jpg``, ``root/val/<class>/*.png``.

The folder is listed once per job, by global rank 0; the index (relative paths, labels, file
sizes) is cached beside the data (or in the user cache when ``data.root`` is read-only),
keyed on the modification times of the split folder and its class folders, which change
whenever a file is added, removed or renamed in them. The other ranks read the cached index;
where they cannot see it, rank 0 sends it. Images are read and decoded in the DataLoader's
workers, one at a time, so nothing holds the whole set in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_image, read_file
from torchvision.transforms.v2 import functional as TF

from ddp_utils.config import ConfigError, DataConfig, UserError, skips_bad_images, whole_sentences
from ddp_utils.data.cache import cache_path, shared_cache
from ddp_utils.data.classes import class_difference
from ddp_utils.data.samplers import BAD_LABEL
from ddp_utils.dist import Runtime
from ddp_utils.logs import log

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")  # matched without regard to case
TORCHVISION_DECODES = (".jpg", ".jpeg", ".png", ".webp")  # others are decoded by PIL
INDEX_VERSION = 2  # 2: links followed once


class BadImageError(UserError):
    """An image file that cannot be read or decoded; only the rank that read it sees it."""

    def __init__(self, message: str) -> None:
        # A DataLoader worker's exception comes back wrapped in the worker's traceback text:
        # keep only this error's own paragraph.
        marker = f"{type(self).__name__}: "
        if marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message, rank_specific=True)


class PathTable:
    """Many paths as one byte buffer plus offsets: no per-path Python object, so forked
    workers do not copy the index page by page as reference counts are touched."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor) -> None:
        self.data, self.offsets = data.numpy(), offsets.numpy()

    @classmethod
    def build(cls, paths: list[str]) -> PathTable:
        encoded = [p.encode() for p in paths]
        offsets = np.cumsum([0] + [len(e) for e in encoded], dtype=np.int64)
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return cls(torch.from_numpy(data), torch.from_numpy(offsets))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes().decode()


@dataclass
class FolderIndex:
    """One split of an image folder: its class names and every image's path, label, size."""

    folder: Path
    classes: list[str]
    paths: PathTable
    labels: torch.Tensor
    sizes: torch.Tensor

    def to_dict(self) -> dict:
        return {
            "classes": self.classes, "paths": torch.from_numpy(self.paths.data),
            "offsets": torch.from_numpy(self.paths.offsets), "labels": self.labels,
            "sizes": self.sizes,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, folder: Path, d: dict) -> FolderIndex:
        paths = PathTable(d["paths"], d["offsets"])
        return cls(folder, list(d["classes"]), paths, d["labels"], d["sizes"])


def split_folder(cfg: DataConfig, split: str) -> Path:
    return Path(cfg.root) / (cfg.train_dir if split == "train" else cfg.val_dir)


def is_image(name: str) -> bool:
    return name.lower().endswith(EXTENSIONS) and not name.startswith(".")


def class_folders(folder: Path, key: str) -> list[os.DirEntry]:
    """The class sub-folders of a split folder, sorted by name; errors name the fix."""
    layout = "data.root/<train_dir>/<class>/<image> (and the same under <val_dir>)"
    if not folder.parent.is_dir():
        raise ConfigError(
            f"data.root={folder.parent} does not exist. Point data.root at the folder that "
            f"holds {folder.name}/, laid out as {layout}."
        )
    if not folder.is_dir():
        raise ConfigError(
            f"{key}: the folder {folder} does not exist. Create it ({layout}), or name the "
            f"folder you have with {key}=NAME."
        )
    with os.scandir(folder) as entries:
        dirs = sorted(
            (e for e in entries if e.is_dir() and not e.name.startswith(".")),
            key=lambda e: e.name,
        )
    if not dirs:
        raise ConfigError(
            f"{folder} has no class folders: put each class's images in a sub-folder "
            f"named after the class ({layout})."
        )
    return dirs


def folder_key(folder: Path, dirs: list[os.DirEntry]) -> str:
    """What the cached index depends on: the folder, its class folders and their mtimes."""
    stats = [str(folder.resolve()), folder.stat().st_mtime_ns, INDEX_VERSION, EXTENSIONS]
    stats += [(d.name, d.stat().st_mtime_ns) for d in dirs]
    return hashlib.sha1(json.dumps(stats).encode()).hexdigest()


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + os.sep)


class FolderWalk:
    """One pass over a split's class folders, listing each image file once.

    Links are where a naive walk goes wrong (a link to ``..`` never ends; a link to ``.`` lists
    a class once per level). So: real folders are listed first, in sorted order (a folder's
    files, then its sub-folders); links to folders are followed afterwards, each folder (by
    device and inode) at most once, so a link never takes images from the class they really
    are in. A link into a folder that holds it (a loop), to a folder already listed (another
    class's, say) or into another split is skipped with a warning; a link out of
    ``data.root`` is followed, with a warning. A file reached twice counts once.
    """

    def __init__(self, folder: Path, dirs: list[os.DirEntry]) -> None:
        self.split = os.path.realpath(folder)
        self.root = os.path.realpath(folder.parent)
        self.seen_dirs = {_key(os.stat(folder))} | {_key(d.stat()) for d in dirs}
        self.seen_files: set[tuple[int, int]] = set()
        self.found: list[list[tuple[str, int]]] = [[] for _ in dirs]  # (path, size) per class
        # Followed once every real folder is listed, first found first.
        self.dir_links: deque[tuple[int, str]] = deque()
        self.file_links: list[tuple[int, os.DirEntry]] = []
        self.duplicates = 0
        self.warnings: list[str] = []
        for label, d in enumerate(dirs):
            self._list(label, d.path)
        while self.dir_links:
            label, path = self.dir_links.popleft()
            if self._follow(path):
                self._list(label, path)
        for label, entry in self.file_links:
            self._add(label, entry)

    def _list(self, label: int, top: str) -> None:
        stack = [top]
        while stack:
            with os.scandir(stack.pop()) as it:
                entries = sorted(
                    (e for e in it if not e.name.startswith(".")), key=lambda e: e.name
                )
            subdirs = []
            for e in entries:
                try:
                    if e.is_dir():
                        if e.is_symlink():
                            self.dir_links.append((label, e.path))
                        elif (key := _key(e.stat())) not in self.seen_dirs:  # bind mounts
                            self.seen_dirs.add(key)
                            subdirs.append(e.path)
                    elif is_image(e.name):
                        if e.is_symlink():
                            self.file_links.append((label, e))
                        else:
                            self._add(label, e)
                except OSError as err:  # a broken link, or a file gone while listing
                    self.warnings.append(f"skipping {e.path}: {err.strerror or err}")
            stack.extend(reversed(subdirs))

    def _add(self, label: int, entry: os.DirEntry) -> None:
        try:
            st = entry.stat()
        except OSError as err:
            self.warnings.append(f"skipping {entry.path}: {err.strerror or err}")
            return
        if _key(st) in self.seen_files:
            self.duplicates += 1
            return
        self.seen_files.add(_key(st))
        self.found[label].append((entry.path, st.st_size))

    def _follow(self, link: str) -> bool:
        """Whether to list the folder ``link`` leads to; a warning says why not (or where)."""
        try:
            target, key = os.path.realpath(link), _key(os.stat(link))
        except OSError as err:
            self.warnings.append(f"skipping the link {link}: {err.strerror or err}")
            return False
        why = None
        if _inside(os.path.realpath(os.path.dirname(link)), target):
            why = "a loop: it leads to a folder that holds it"
        elif key in self.seen_dirs:
            why = "that folder is listed already (another class's folder, or a second link)"
        elif _inside(target, self.root) and not _inside(target, self.split):
            why = "it leads into another folder of data.root (another split?)"
        if why:
            self.warnings.append(f"skipping the link {link} -> {target}: {why}")
            return False
        self.seen_dirs.add(key)
        if not _inside(target, self.root):
            self.warnings.append(f"following the link {link} out of data.root, to {target}")
        return True


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def scan(folder: Path, dirs: list[os.DirEntry]) -> FolderIndex:
    """List every image under each class folder (``FolderWalk``); refuse empty classes."""
    start = time.perf_counter()
    walk = FolderWalk(folder, dirs)
    for message in walk.warnings:
        log.warning("image folder scan: %s", message)
    if walk.duplicates:
        log.warning("image folder scan: %d files reached twice (through links or hard links) "
                    "were counted once", walk.duplicates)  # fmt: skip
    paths, labels, sizes = [], [], []
    for label, (d, found) in enumerate(zip(dirs, walk.found, strict=True)):
        if not found:
            raise ConfigError(
                f"the class folder {d.path} holds no images ({', '.join(EXTENSIONS)}, any "
                "case): add its images, or remove the folder."
            )
        paths += [os.path.relpath(path, folder) for path, _ in found]
        sizes += [size for _, size in found]
        labels += [label] * len(found)
    log.info(
        "scanned %s: %d images in %d classes (%.1f s); index cached",
        folder, len(paths), len(dirs), time.perf_counter() - start,
    )  # fmt: skip
    return FolderIndex(
        folder, [d.name for d in dirs], PathTable.build(paths),
        torch.tensor(labels, dtype=torch.long), torch.tensor(sizes, dtype=torch.long),
    )  # fmt: skip


def load_index(cfg: DataConfig, split: str, rt: Runtime) -> FolderIndex:
    """Every rank: the split's index, scanned (or read from the cache) by global rank 0 only."""
    folder = split_folder(cfg, split)

    def locate() -> tuple[Path, str, Callable[[], dict]]:
        dirs = class_folders(folder, f"data.{split}_dir")
        path = cache_path(cfg.root, f"imagefolder-{folder.name}.pt")
        return path, folder_key(folder, dirs), lambda: scan(folder, dirs).to_dict()

    return FolderIndex.from_dict(folder, shared_cache(rt, locate))


def match_channels(image: torch.Tensor, channels: int, where: str) -> torch.Tensor:
    """A uint8 CHW image with ``channels`` channels (1 grey or 3 RGB); alpha is dropped."""
    if image.ndim == 2:
        image = image.unsqueeze(0)
    if image.ndim != 3:
        raise ConfigError(
            f"{where}: expected an image of shape (C, H, W), got {tuple(image.shape)}"
        )
    c = image.shape[0]
    if c in (2, 4):  # grey + alpha, RGB + alpha
        image, c = image[: c - 1], c - 1
    if c == channels:
        return image
    if c == 3 and channels == 1:
        return TF.rgb_to_grayscale(image)
    if c == 1 and channels == 3:
        return image.expand(3, -1, -1).contiguous()
    raise ConfigError(
        f"{where}: an image with {c} channels cannot be read as data.in_channels={channels}; "
        "use data.in_channels=1 (grey) or 3 (RGB)."
    )


# PIL's modes of more than 8 bits a channel: .convert("L") would clip them, not scale them.
WIDE_PIL_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
FLOAT_SLACK = 1e-3  # resampling can overshoot [0, 1] by a rounding error


def to_uint8(image: torch.Tensor, where: str) -> torch.Tensor:
    """8 bits a channel: uint16 (16-bit PNGs) scaled by 255/65535, floats in [0, 1] by 255,
    other integer types taken as 8-bit values; anything else is refused, naming it."""
    if image.dtype == torch.uint8:
        return image
    if image.is_floating_point():
        lo, hi = (float(v) for v in image.aminmax()) if image.numel() else (0.0, 0.0)
        if not (lo >= -FLOAT_SLACK and hi <= 1 + FLOAT_SLACK):
            raise ConfigError(
                f"{where}: a float image with values in [{lo:g}, {hi:g}]; float images must lie "
                "in [0, 1] (scale them, or store 8- or 16-bit images)"
            )
        return (image * 255.0).round().clamp(0, 255).to(torch.uint8)
    wide = image.to(torch.int64)
    top = 65535 if image.dtype == torch.uint16 else 255
    lo, hi = (int(v) for v in wide.aminmax()) if image.numel() else (0, 0)
    if lo < 0 or hi > top:
        raise ConfigError(
            f"{where}: an image of dtype {str(image.dtype).removeprefix('torch.')} with values "
            f"in [{lo}, {hi}]; integer images must hold 8-bit values (0-255), or be uint16"
        )
    if top == 255:
        return wide.to(torch.uint8)
    return torch.div(wide * 255 + 32767, 65535, rounding_mode="floor").to(torch.uint8)


def pil_to_uint8(im, channels: int, where: str) -> torch.Tensor:
    """A PIL image as a uint8 CHW tensor of ``channels`` channels; 16-bit and float modes are
    scaled to 8 bits (mode I, 32-bit integers, holds 16-bit data when PIL reads it)."""
    if im.mode in WIDE_PIL_MODES:
        array = np.array(im)
        array = array.astype(array.dtype.newbyteorder("="), copy=False)  # I;16B is big-endian
        if im.mode == "I" and array.size and array.min() >= 0 and array.max() <= 65535:
            array = array.astype(np.uint16)
        image = to_uint8(torch.from_numpy(array), f"{where} (mode {im.mode})")
    else:
        image = TF.pil_to_tensor(im.convert("L" if channels == 1 else "RGB"))
    return match_channels(image, channels, where)


def decode(path: str, channels: int) -> torch.Tensor:
    """Read and decode one image file into a uint8 CHW tensor of ``channels`` channels."""
    if path.lower().endswith(TORCHVISION_DECODES):
        mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
        image = to_uint8(decode_image(read_file(path), mode=mode), path)  # 16-bit PNGs: uint16
        return match_channels(image, channels, path)
    from PIL import Image

    with Image.open(path) as im:
        return pil_to_uint8(im, channels, path)


def unreadable_reason(e: Exception) -> str:
    """A decoder's error in a few words: its last line, without the C++ file and line."""
    last_line = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    last_line = re.sub(r"^\S+\(\), \S+:\d+, ", "", last_line)
    return whole_sentences(last_line) or type(e).__name__


class BadImages:
    """What a source does with an image it cannot use: stop, naming it, or with
    ``data.skip_bad_images`` return a blank image labelled ``BAD_LABEL`` (left out of the loss
    and the metrics), warning once per item in each worker process."""

    def __init__(self, cfg: DataConfig) -> None:
        self.skip = skips_bad_images(cfg)  # masks, boxes: no key (no blank stands in for them)
        self.channels, self.size = cfg.in_channels, cfg.image_size
        self.warned: set[object] = set()

    def handle(self, item: object, stop: str, warning: str) -> tuple[torch.Tensor, int]:
        if not self.skip:
            raise BadImageError(stop) from None  # the paragraph, not the decoder's traceback
        if item not in self.warned:
            self.warned.add(item)
            log.warning("%s", warning)
        return torch.zeros(self.channels, self.size, self.size, dtype=torch.uint8), BAD_LABEL


class ImageFolderSource(Dataset):
    """``(uint8 CHW image, label)`` for each file of a ``FolderIndex``, decoded on access."""

    def __init__(self, index: FolderIndex, cfg: DataConfig) -> None:
        self.index, self.channels = index, cfg.in_channels
        self.bad = BadImages(cfg)
        self.classes = index.classes

    def __len__(self) -> int:
        return len(self.index.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path = str(self.index.folder / self.index.paths[i])
        try:
            return decode(path, self.channels), int(self.index.labels[i])
        except (RuntimeError, OSError, ValueError) as e:
            reason = unreadable_reason(e)
            stop = (f"cannot read the image {path} ({reason}). Replace or delete the file, or "
                    "set data.skip_bad_images=true to skip unreadable images.")  # fmt: skip
            return self.bad.handle(path, stop, f"skipping the unreadable image {path} ({reason})")


def check_same_classes(train: list[str], val: list[str], cfg: DataConfig) -> None:
    """The val folder's classes must be the train folder's, and as many as data.num_classes."""
    if val != train:
        diff = class_difference(train, val, f"{cfg.train_dir}/", f"{cfg.val_dir}/")
        raise ConfigError(
            f"the class folders of {cfg.val_dir}/ differ from {cfg.train_dir}/ under "
            f"data.root={cfg.root} ({diff}). Give both the same class folders."
        )
    if len(train) != cfg.num_classes:
        raise ConfigError(
            f"data.root={cfg.root} has {len(train)} class folders but data.num_classes="
            f"{cfg.num_classes}; set data.num_classes={len(train)}."
        )
