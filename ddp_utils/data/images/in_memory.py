"""The in-memory family (``data=digits | synthetic | mnist | fashion_mnist | cifar10``): each
split decoded whole into uint8 tensors (``ddp_utils.data.images.builtin``), batches indexed on the
device (``data.loader=auto | tensor``) or through DataLoader workers (``torch``), augmentation
on the device."""

from __future__ import annotations

from torch.utils.data import DataLoader, Sampler

from ddp_utils.config import DataConfig
from ddp_utils.data.bundle import DataBundle, EvalData, image_bundle, image_eval
from ddp_utils.data.images.builtin import ImageTensorDataset, load_split
from ddp_utils.data.loaders import TensorLoader, worker_loader
from ddp_utils.data.samplers import eval_sampler, training_sampler
from ddp_utils.dist import Runtime, local_main_first


def in_memory_loader(
    ds: ImageTensorDataset, sampler: Sampler, cfg: DataConfig, rt: Runtime
) -> TensorLoader | DataLoader:
    """``data.loader``: ``tensor`` (``auto``: batches indexed on the device) or ``torch``."""
    if cfg.loader in ("auto", "tensor"):
        return TensorLoader(ds, sampler, cfg.batch_size, rt.device)
    return worker_loader(ds, sampler, cfg, rt)


def build(cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str) -> DataBundle:
    with local_main_first(rt):  # the first decode of a torchvision set writes its cache
        train_ds, val_ds = load_split(cfg, "train"), load_split(cfg, "val")
    sampler = training_sampler(len(train_ds), cfg, rt, seed)
    train = in_memory_loader(train_ds, sampler, cfg, rt)
    val = in_memory_loader(val_ds, eval_sampler(len(val_ds), cfg, rt), cfg, rt)
    return image_bundle(cfg, rt, (train, val, sampler, None), cfg.augment, channels_last)


def samples(cfg: DataConfig, rt: Runtime, split: str) -> ImageTensorDataset:
    """``(uint8 CHW image, label)`` of a split (``python -m ddp_utils.shards write`` reads it)."""
    with local_main_first(rt):
        return load_split(cfg, split)


def build_eval(cfg: DataConfig, rt: Runtime, seed: int, channels_last: bool | str) -> EvalData:
    with local_main_first(rt):
        ds = load_split(cfg, cfg.split)
    loader = in_memory_loader(ds, eval_sampler(len(ds), cfg, rt), cfg, rt)
    return image_eval(cfg, rt, loader, None, channels_last)
