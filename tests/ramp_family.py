"""A data family that lives outside the package: its schema names this module as its family,
and ``ddp_utils.data`` builds it with no edit (tests/test_data_units.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ddp_utils.config import DataConfig
from ddp_utils.data.bundle import DataBundle, EvalData, image_bundle, image_eval
from ddp_utils.data.images.builtin import ImageTensorDataset
from ddp_utils.data.loaders import TensorLoader
from ddp_utils.data.samplers import EvalShardSampler, training_sampler


@dataclass
class RampData(DataConfig):
    """Images whose every pixel is the sample's index; labels cycle through the classes."""

    family: ClassVar[str] = "ramp_family"
    name: str = "ramp"
    num_train: int = 30
    num_val: int = 11
    resolved: bool = False  # set by resolve(): what only the data knows


def ramp(n: int, cfg: RampData, start: int) -> ImageTensorDataset:
    index = torch.arange(start, start + n)
    images = index.to(torch.uint8).view(n, 1, 1, 1).expand(n, 1, cfg.image_size, cfg.image_size)
    return ImageTensorDataset(images.contiguous(), index % cfg.num_classes)


def resolve(cfg: RampData, rt) -> RampData:
    return replace(cfg, resolved=True)


def offered(cfg: RampData) -> dict:
    return {"ramp_length": cfg.num_train}


def build(cfg: RampData, rt, seed: int, channels_last) -> DataBundle:
    train_ds, val_ds = ramp(cfg.num_train, cfg, 0), ramp(cfg.num_val, cfg, 100)
    sampler = training_sampler(len(train_ds), cfg, rt, seed)
    val_sampler = EvalShardSampler(len(val_ds), rt.world_size, rt.rank, cfg.batch_size)
    train = TensorLoader(train_ds, sampler, cfg.batch_size, rt.device)
    val = TensorLoader(val_ds, val_sampler, cfg.batch_size, rt.device)
    return image_bundle(cfg, rt, (train, val, sampler, None), False, channels_last)


def build_eval(cfg: RampData, rt, seed: int, channels_last) -> EvalData:
    ds = ramp(cfg.num_val, cfg, 100)
    loader = TensorLoader(ds, EvalShardSampler(len(ds), rt.world_size, rt.rank, 4), 4, rt.device)
    return image_eval(cfg, rt, loader, None, channels_last)
