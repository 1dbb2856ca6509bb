"""The streamed path (``data=imagefolder``, ``data=custom``): images read and decoded in
DataLoader workers and transformed per sample with ``torchvision.transforms.v2`` under a seed
of (seed, epoch, index). ``build_data`` imports this module only for these sets, so the
in-memory sets start without loading torchvision."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset

from ddp_utils.config import ConfigError, DataConfig
from ddp_utils.data.custom import CustomSource, load_custom
from ddp_utils.data.imagefolder import ImageFolderSource, check_same_classes, load_index
from ddp_utils.data.loaders import eval_shard_loader, sharded_loaders
from ddp_utils.data.samplers import ResumableDistributedSampler
from ddp_utils.data.transforms import SeededTransform, eval_transform, train_transform
from ddp_utils.dist import Runtime


def streamed_sources(cfg: DataConfig, rt: Runtime, splits: tuple[str, ...]) -> dict[str, Dataset]:
    """``(uint8 CHW image, label)`` sources of an image folder or a user's data set."""
    if cfg.loader == "tensor":
        raise ConfigError(
            f"data={cfg.name} streams from disk through DataLoader workers: data.loader=tensor "
            "is for the built-in in-memory sets; use data.loader=auto."
        )
    if cfg.name == "imagefolder":
        return {s: ImageFolderSource(load_index(cfg, s, rt), cfg) for s in splits}
    train, val = load_custom(cfg)
    return {s: CustomSource(train if s == "train" else val, cfg, s) for s in splits}


def streamed_loaders(
    cfg: DataConfig, rt: Runtime, seed: int
) -> tuple[DataLoader, DataLoader, ResumableDistributedSampler, list[str]]:
    """The training and validation loaders, the training sampler, and the class names."""
    src = streamed_sources(cfg, rt, ("train", "val"))
    classes = src["train"].classes
    if cfg.name == "imagefolder":
        check_same_classes(classes, src["val"].classes, cfg)
    train_ds = SeededTransform(src["train"], train_transform(cfg), seed)
    val_ds = SeededTransform(src["val"], eval_transform(cfg), seed)
    return (*sharded_loaders(train_ds, val_ds, cfg, rt, seed), classes)


def streamed_eval_loader(cfg: DataConfig, rt: Runtime, seed: int) -> tuple[DataLoader, list[str]]:
    """The loader of ``data.split``, sharded exactly, and the class names."""
    source = streamed_sources(cfg, rt, (cfg.split,))[cfg.split]
    ds = SeededTransform(source, eval_transform(cfg), seed)
    return eval_shard_loader(ds, cfg, rt), source.classes
