"""The streamed path (``data=imagefolder``, ``data=custom``): images read and decoded in
DataLoader workers and transformed per sample with ``torchvision.transforms.v2`` under a seed
of (seed, epoch, index). ``build_data`` imports this module only for these sets, so the
in-memory sets start without loading torchvision."""

from __future__ import annotations

from torch.utils.data import Dataset

from ddp_utils.config import ConfigError, CustomData, DataConfig, ImageFolderData
from ddp_utils.data.bundle import DataBundle, EvalData, image_bundle, image_eval
from ddp_utils.data.images.custom import CustomSource, load_custom
from ddp_utils.data.images.imagefolder import ImageFolderSource, check_same_classes, load_index
from ddp_utils.data.images.transforms import SeededTransform, eval_transform, train_transform
from ddp_utils.data.loaders import eval_shard_loader, sharded_loaders
from ddp_utils.data.registry import by_schema
from ddp_utils.dist import Runtime


def imagefolder_sources(cfg: DataConfig, rt: Runtime, splits: tuple[str, ...]) -> dict:
    sources = {s: ImageFolderSource(load_index(cfg, s, rt), cfg) for s in splits}
    if len(splits) == 2:  # a model trained on one class list is scored on the same list
        check_same_classes(sources["train"].classes, sources["val"].classes, cfg)
    return sources


def custom_sources(cfg: DataConfig, rt: Runtime, splits: tuple[str, ...]) -> dict:
    train, val = load_custom(cfg)
    return {s: CustomSource(train if s == "train" else val, cfg, s) for s in splits}


SOURCES = {ImageFolderData: imagefolder_sources, CustomData: custom_sources}


def streamed_sources(cfg: DataConfig, rt: Runtime, splits: tuple[str, ...]) -> dict[str, Dataset]:
    """``(uint8 CHW image, label)`` sources of an image folder or a user's data set."""
    if cfg.loader == "tensor":
        raise ConfigError(
            f"data={cfg.name} streams from disk through DataLoader workers: data.loader=tensor "
            "is for the built-in in-memory sets; use data.loader=auto."
        )
    return by_schema(SOURCES, cfg)(cfg, rt, splits)


def build(cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str) -> DataBundle:
    """The training and validation loaders (augmented per sample in the workers)."""
    src = streamed_sources(cfg, rt, ("train", "val"))
    train_ds = SeededTransform(src["train"], train_transform(cfg), seed)
    val_ds = SeededTransform(src["val"], eval_transform(cfg), seed)
    loaders = (*sharded_loaders(train_ds, val_ds, cfg, rt, seed), src["train"].classes)
    return image_bundle(cfg, rt, loaders, False, channels_last)


def samples(cfg: DataConfig, rt: Runtime, split: str) -> Dataset:
    """``(uint8 CHW image, label)`` of a split (``python -m ddp_utils.shards write`` reads it)."""
    return streamed_sources(cfg, rt, (split,))[split]


def build_eval(cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str) -> EvalData:
    """The loader of ``data.split``, sharded exactly."""
    source = streamed_sources(cfg, rt, (cfg.split,))[cfg.split]
    ds = SeededTransform(source, eval_transform(cfg), seed)
    return image_eval(cfg, rt, eval_shard_loader(ds, cfg, rt), source.classes, channels_last)
