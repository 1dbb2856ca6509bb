"""The built-in data sets, decoded whole into memory as uint8 image tensors.

digits (scikit-learn's bundled 8x8 digits), synthetic, and torchvision's MNIST, FashionMNIST
and CIFAR-10 are small: each is decoded once into an ``(N, C, H, W)`` uint8 tensor plus int64
labels (cached on disk for torchvision's sets), which the tensor loader indexes on the device.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_utils.config import ConfigError, DataConfig, DigitsData, SyntheticData, TorchvisionData
from ddp_utils.data.cache import cache_path, cached
from ddp_utils.data.registry import by_schema
from ddp_utils.data.samplers import IGNORE_LABEL

# data=NAME -> (its torchvision.datasets class, the folder under data.root of its files)
TORCHVISION_SETS = {
    "mnist": ("MNIST", "MNIST/raw"),
    "fashion_mnist": ("FashionMNIST", "FashionMNIST/raw"),
    "cifar10": ("CIFAR10", "cifar-10-batches-py"),
}


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


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (no download): 1,797 8x8 images of grey levels 0..16 and
    their labels, as ``sklearn.datasets.load_digits`` returns them. Read from the file it ships
    when it is there: importing sklearn.datasets loads scipy, slow in every process."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


def _digits(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    pixels, target = digits_arrays()
    # 17 grey levels (0..16) spread over the uint8 range.
    images = torch.from_numpy(pixels * (255.0 / 16.0)).round().to(torch.uint8)
    labels = torch.from_numpy(target).long()
    images, labels = holdout(images.unsqueeze(1), labels, cfg, split,
                             n_val=round(len(labels) * cfg.val_fraction))  # fmt: skip
    return images.contiguous(), labels


def holdout(
    images: torch.Tensor, labels: torch.Tensor, cfg: DataConfig, split: str, n_val: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``data.val_slice`` (0 when null) of ``n_val`` samples of a ``data.split_seed``
    permutation is the validation set, the rest the training set: disjoint validation slices
    for measuring a recipe on data it was not tuned on."""
    k = cfg.val_slice or 0
    if (k + 1) * n_val > len(labels):
        raise ConfigError(
            f"data.val_slice={k}: data={cfg.name} has {len(labels)} samples, room for "
            f"{len(labels) // n_val} validation slices of {n_val} (0 to "
            f"{len(labels) // n_val - 1})."
        )
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(cfg.split_seed))
    val = torch.zeros(len(labels), dtype=torch.bool)
    val[order[k * n_val : (k + 1) * n_val]] = True
    idx = order[val[order]] if split == "val" else order[~val[order]]
    return images[idx], labels[idx]


def _synthetic(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = cfg.num_train if split == "train" else cfg.num_val
    g = torch.Generator().manual_seed(1 if split == "train" else 2)
    shape = (n, cfg.in_channels, cfg.image_size, cfg.image_size)
    images = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    labels = torch.randint(0, cfg.num_classes, (n,), generator=g)
    return images, labels


def _source_dir(cfg: DataConfig) -> Path:
    return Path(cfg.root) / TORCHVISION_SETS[cfg.name][1]


def _fingerprint(folder: Path) -> str:
    """Names, sizes and modification times of the source files: a change rebuilds the cache."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    stats = [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha1(json.dumps(stats).encode()).hexdigest()


def _decode_torchvision(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torchvision

    class_name = TORCHVISION_SETS[cfg.name][0]
    cls = getattr(torchvision.datasets, class_name)
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
            f"or point data.root at the folder that holds {class_name}/."
        ) from None
    images = torch.as_tensor(ds.data)
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    return images.contiguous(), torch.as_tensor(ds.targets).long()


def _torchvision(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The official split, or with ``data.val_slice`` a slice of the pooled train + test
    images as the validation set (of the test set's size) and the rest as the training set."""
    if cfg.val_slice is None:
        return _decoded(cfg, split)
    train, test = _decoded(cfg, "train"), _decoded(cfg, "val")
    images, labels = torch.cat([train[0], test[0]]), torch.cat([train[1], test[1]])
    return holdout(images, labels, cfg, split, n_val=len(test[1]))


def _decoded(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode once into uint8 tensors, cached on disk and reused while the source is unchanged."""
    source = _source_dir(cfg)
    if not source.is_dir():
        return _decode_torchvision(cfg, split)  # downloads, or says how to get the data

    def decode() -> dict[str, torch.Tensor]:
        images, labels = _decode_torchvision(cfg, split)
        return {"images": images, "labels": labels}

    contents, _ = cached(
        cache_path(cfg.root, f"{cfg.name}-{split}.pt"), _fingerprint(source), decode
    )
    return contents["images"], contents["labels"]


DECODERS = {DigitsData: _digits, SyntheticData: _synthetic, TorchvisionData: _torchvision}


def decode(cfg: DataConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One split of an in-memory set: uint8 (N, C, H, W) images and int64 labels."""
    return by_schema(DECODERS, cfg)(cfg, split)


def load_split(cfg: DataConfig, split: str) -> ImageTensorDataset:
    """Decode one split of ``cfg.name`` into memory and check it against the declared shape."""
    images, labels = decode(cfg, split)
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
