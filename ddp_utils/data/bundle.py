"""What a data family hands the trainer and the evaluator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import nn
from torch.utils.data import DataLoader

from ddp_utils.config import DataConfig, skips_bad_images
from ddp_utils.data.images.preprocess import Preprocess
from ddp_utils.data.loaders import TensorLoader, close_loader
from ddp_utils.data.samplers import ResumableDistributedSampler
from ddp_utils.dist import Runtime


@dataclass(frozen=True)
class Unit:
    """What a sample counts as in progress lines and metrics: images by default; token
    windows count their tokens (``key`` names the metrics' ``<key>`` and ``<key>_per_s``)."""

    short: str = "img"
    per_sample: int = 1
    key: str | None = None


@dataclass
class DataBundle:
    train: TensorLoader | DataLoader
    val: TensorLoader | DataLoader
    train_sampler: ResumableDistributedSampler
    preprocess_train: nn.Module
    preprocess_eval: nn.Module
    classes: list[str] | None = None  # class names, where the source has them
    unit: Unit = field(default_factory=Unit)
    # What the data adds to a checkpoint for inference (token data: its tokenizer spec).
    checkpoint_extras: dict[str, Any] = field(default_factory=dict)
    # Whether an unreadable image is skipped (and counted) rather than ending the run: the
    # families that read image files one by one offer it (``data.skip_bad_images``).
    skips_bad_images: bool = False

    def close(self) -> None:
        """Stop the loaders' worker processes (a loader iterated again starts new ones)."""
        close_loader(self.train)
        close_loader(self.val)


class EvalData(NamedTuple):
    loader: TensorLoader | DataLoader
    preprocess: nn.Module
    classes: list[str] | None
    skips_bad_images: bool = False


def image_bundle(
    cfg: DataConfig,
    rt: Runtime,
    loaders: tuple[Any, Any, ResumableDistributedSampler, list[str] | None],
    augment_on_device: bool,
    channels_last: bool | str,
) -> DataBundle:
    """Image loaders with their on-device normalisation (augmented for training where the
    family leaves augmentation to the device)."""
    train, val, sampler, classes = loaders
    return DataBundle(
        train=train,
        val=val,
        train_sampler=sampler,
        preprocess_train=Preprocess(cfg, augment_on_device, channels_last).to(rt.device),
        preprocess_eval=Preprocess(cfg, False, channels_last).to(rt.device),
        classes=classes,
        skips_bad_images=skips_bad_images(cfg),
    )


def image_eval(
    cfg: DataConfig,
    rt: Runtime,
    loader: TensorLoader | DataLoader,
    classes: list[str] | None,
    channels_last: bool | str,
) -> EvalData:
    preprocess = Preprocess(cfg, False, channels_last).to(rt.device)
    return EvalData(loader, preprocess, classes, skips_bad_images(cfg))
