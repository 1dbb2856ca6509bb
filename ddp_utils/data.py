"""Data sets as uint8 image tensors, loaders for DDP, and on-device preprocessing.

Every data set here fits in memory, so each is decoded once into an ``(N, C, H, W)`` uint8
tensor plus int64 labels. Batches stay uint8 until they reach the device, where
``Preprocess`` normalises (and, for training, augments) a whole batch at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from ddp_utils.checkpoint import atomic_save
from ddp_utils.config import ConfigError, DataConfig
from ddp_utils.dist import Runtime, local_main_first
from ddp_utils.samplers import EvalShardSampler, ResumableDistributedSampler

IGNORE_LABEL = -100  # cross_entropy's default ignore_index
TORCHVISION_SETS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10"}


class ImageTensorDataset(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        assert images.dtype == torch.uint8 and images.ndim == 4, "images must be uint8 NCHW"
        assert len(images) == len(labels)
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:  # a sampler's padding duplicate (pad_marker): computed, never counted
            return self.images[~i], torch.tensor(IGNORE_LABEL)
        return self.images[i], self.labels[i]


@dataclass
class DataBundle:
    train: TensorLoader | DataLoader
    val: TensorLoader | DataLoader
    preprocess_train: nn.Module
    preprocess_eval: nn.Module


def _digits(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    bunch = load_digits()
    # 17 grey levels (0..16) spread over the uint8 range.
    images = torch.from_numpy(bunch.images * (255.0 / 16.0)).round().to(torch.uint8)
    labels = torch.from_numpy(bunch.target).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(cfg.split_seed))
    n_val = round(len(labels) * cfg.val_fraction)
    idx = order[:n_val] if split == "val" else order[n_val:]
    return images[idx].unsqueeze(1).contiguous(), labels[idx]


def _synthetic(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = cfg.num_train if split == "train" else cfg.num_val
    g = torch.Generator().manual_seed(1 if split == "train" else 2)
    shape = (n, cfg.in_channels, cfg.image_size, cfg.image_size)
    images = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    labels = torch.randint(0, cfg.num_classes, (n,), generator=g)
    return images, labels


def _source_dir(cfg: DataConfig) -> Path:
    if cfg.name == "cifar10":
        return Path(cfg.root) / "cifar-10-batches-py"
    return Path(cfg.root) / TORCHVISION_SETS[cfg.name] / "raw"


def _fingerprint(folder: Path) -> str:
    """Names, sizes and modification times of the source files: a change rebuilds the cache."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    stats = [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha1(json.dumps(stats).encode()).hexdigest()


def cache_path(cfg: DataConfig, split: str) -> Path:
    """``data.root/.ddp_recipes_cache``, or a per-user cache when data.root is read-only."""
    name = f"{cfg.name}-{split}.pt"
    root = Path(cfg.root)
    # The write bits, not only access(): root may write anywhere, but a folder shipped
    # read-only (shared data) should stay as it is.
    if os.access(root, os.W_OK) and root.stat().st_mode & stat.S_IWUSR:
        return root / ".ddp_recipes_cache" / name
    digest = hashlib.sha1(str(Path(cfg.root).resolve()).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "ddp-recipes" / digest / name


def _decode_torchvision(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torchvision

    cls = getattr(torchvision.datasets, TORCHVISION_SETS[cfg.name])
    try:
        ds = cls(root=cfg.root, train=(split == "train"), download=cfg.download)
    except RuntimeError as e:
        hint = (
            "set data.download=true to fetch it"
            if not cfg.download
            else "check the network or place the files there by hand"
        )
        raise ConfigError(
            f"data={cfg.name}: no usable data under data.root={cfg.root} ({e}); {hint}, "
            f"or point data.root at the folder that holds {TORCHVISION_SETS[cfg.name]}/."
        ) from None
    images = torch.as_tensor(ds.data)
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    return images.contiguous(), torch.as_tensor(ds.targets).long()


def _torchvision(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode once into uint8 tensors, cached on disk and reused while the source is unchanged."""
    source = _source_dir(cfg)
    if not source.is_dir():
        return _decode_torchvision(cfg, split)  # downloads, or says how to get the data
    key, cache = _fingerprint(source), cache_path(cfg, split)
    if cache.is_file():
        try:
            cached = torch.load(cache, weights_only=True)
            if cached["key"] == key:
                return cached["images"], cached["labels"]
        except Exception:  # a torn or foreign cache file is rebuilt below
            pass
    images, labels = _decode_torchvision(cfg, split)
    with contextlib.suppress(OSError):  # nowhere writable: decode again next time
        atomic_save({"key": key, "images": images, "labels": labels}, cache)
    return images, labels


def load_split(cfg: DataConfig, split: str) -> ImageTensorDataset:
    """Decode one split of ``cfg.name`` into memory and check it against the declared shape."""
    if cfg.name == "digits":
        images, labels = _digits(cfg, split)
    elif cfg.name == "synthetic":
        images, labels = _synthetic(cfg, split)
    else:
        images, labels = _torchvision(cfg, split)
    declared = (cfg.in_channels, cfg.image_size, cfg.image_size)
    if tuple(images.shape[1:]) != declared:
        raise ConfigError(
            f"data={cfg.name} holds images of shape {tuple(images.shape[1:])} but the config "
            f"declares (data.in_channels, data.image_size) = {declared}; fix those keys."
        )
    if int(labels.max()) >= cfg.num_classes:
        raise ConfigError(
            f"data={cfg.name} has label {int(labels.max())} but data.num_classes="
            f"{cfg.num_classes}; raise data.num_classes."
        )
    return ImageTensorDataset(images, labels)


class Preprocess(nn.Module):
    """uint8 batch on the device -> normalised float, with batched augmentation for training."""

    def __init__(self, cfg: DataConfig, train: bool, channels_last: bool = False) -> None:
        super().__init__()
        self.augment = train and cfg.augment
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        mean = torch.tensor(cfg.mean).view(1, -1, 1, 1) * 255.0
        std = torch.tensor(cfg.std).view(1, -1, 1, 1) * 255.0
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("inv_std", 1.0 / std, persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float()
        if self.augment:
            x = random_crop_flip(x, padding=4)
        x = (x - self.mean) * self.inv_std
        return x.contiguous(memory_format=self.memory_format)


def random_crop_flip(x: torch.Tensor, padding: int) -> torch.Tensor:
    """Per-sample random crop (zero padding) and horizontal flip, for the whole batch at once."""
    n, _, h, w = x.shape
    padded = nn.functional.pad(x, (padding,) * 4)
    oy = torch.randint(0, 2 * padding + 1, (n, 1), device=x.device)
    ox = torch.randint(0, 2 * padding + 1, (n, 1), device=x.device)
    rows = (oy + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (ox + torch.arange(w, device=x.device))[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    out = padded[batch, chan, rows, cols]
    flip = torch.rand(n, device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


class TensorLoader:
    """Batches by indexing tensors that live on the training device: no workers, no collation.

    It takes the same sampler as a DataLoader would (so each rank gets the same indices in
    the same order) and turns the epoch's index list into one device tensor; each batch is
    then a gather on the device. Padding markers (negative indices) get the ignored label.
    """

    def __init__(self, ds: ImageTensorDataset, sampler: Sampler, batch_size: int, device) -> None:
        self.dataset, self.sampler, self.batch_size = ds, sampler, batch_size
        self.images = ds.images.to(device)
        self.labels = ds.labels.to(device)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        real = (order >= 0).to(self.images.device, non_blocking=True)
        index = torch.where(order >= 0, order, ~order).to(self.images.device, non_blocking=True)
        for start in range(0, len(order), self.batch_size):
            idx = index[start : start + self.batch_size]
            labels = torch.where(
                real[start : start + self.batch_size], self.labels[idx], IGNORE_LABEL
            )
            yield self.images[idx], labels


def make_loader(
    ds: ImageTensorDataset, sampler: Sampler, cfg: DataConfig, rt: Runtime
) -> TensorLoader | DataLoader:
    """``data.loader``: ``tensor`` (``auto`` here: every set of this project fits in memory)
    or ``torch``, the standard DataLoader with workers, pinned memory and prefetching."""
    if cfg.loader in ("auto", "tensor"):
        return TensorLoader(ds, sampler, cfg.batch_size, rt.device)
    workers = cfg.num_workers
    return DataLoader(
        ds,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=rt.device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )


def make_eval_loader(ds: ImageTensorDataset, cfg: DataConfig, rt: Runtime):
    return make_loader(ds, EvalShardSampler(len(ds), rt.world_size, rt.rank), cfg, rt)


def build_data(cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool = False) -> DataBundle:
    with local_main_first(rt):
        train_ds, val_ds = load_split(cfg, "train"), load_split(cfg, "val")
    sampler = ResumableDistributedSampler(len(train_ds), rt.world_size, rt.rank, seed=seed)
    return DataBundle(
        train=make_loader(train_ds, sampler, cfg, rt),
        val=make_eval_loader(val_ds, cfg, rt),
        preprocess_train=Preprocess(cfg, train=True, channels_last=channels_last).to(rt.device),
        preprocess_eval=Preprocess(cfg, train=False, channels_last=channels_last).to(rt.device),
    )
