"""The keys every data option has (``DataConfig``), and the checks and constants the
families' schemas share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ddp_utils.config.errors import (
    ConfigError,
    check_choice,
    check_positive,
)

SPLITS = ("train", "val")
LOADERS = ("auto", "tensor", "torch")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
AUTO_AUGMENTS = ("ta_wide", "ra", "augmix")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
VOC_CLASSES = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
    "train", "tvmonitor",
)  # fmt: skip  # Pascal VOC's 20 object classes; the background is class 0


def check_read_channels(in_channels: int) -> None:
    """Files are decoded as grey or RGB images."""
    if in_channels not in (1, 3):
        raise ConfigError(
            f"data.in_channels={in_channels}: images are read as grey (1) or RGB (3); "
            "set data.in_channels=1 or 3."
        )


def check_holdout(val_fraction: float, val_slice: int | None) -> None:
    """The in-memory sets' held-out validation share and slice."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={val_fraction} must lie strictly between 0 and 1.")
    check_positive("data.val_slice", val_slice, allow_zero=True)


def check_canvas(cfg: Any) -> None:
    """What the digit-canvas options (segmentation's and detection's) share."""
    check_positive("data.max_digits", cfg.max_digits)
    if not cfg.digit_scales or min(cfg.digit_scales) < 1:
        raise ConfigError(f"data.digit_scales={cfg.digit_scales} needs factors >= 1.")


@dataclass
class DataConfig:
    """Every data option's keys: batching, loading, and what the model is sized for."""

    # What an item's target is (a declaration of the option, not a key): "labels" (one class
    # per image), "masks" (one per pixel) or "tokens" (next-token ids); a task says which it
    # takes. ``wrong_task`` is what to say to a task that does not take it ({data}: the
    # option's name).
    holds: ClassVar[str] = "labels"
    wrong_task: ClassVar[str] = ""
    # The module that builds this option's loaders (``ddp_utils.data.registry`` says what it
    # defines); a new data family is that module, its schema here and its conf/data file.
    family: ClassVar[str] = "ddp_utils.data.images.in_memory"
    # Whether the family's ``resolve`` fills in ``num_classes=null`` from the data.
    counts_classes: ClassVar[bool] = False
    # The keys whose change makes a checkpoint another experiment's (resume refuses it).
    identity: ClassVar[tuple[str, ...]] = ("name", "in_channels", "image_size", "num_classes",
                                           "mean", "std")  # fmt: skip

    name: str = "digits"  # the option's name: digits | mnist | imagefolder | ...
    batch_size: int = 100  # per process (with global_batch_size: the most a process takes)
    # The samples of one optimizer step over all processes. Set, it is the recipe's unit: the
    # per-process batch and trainer.grad_accum_steps follow from it and the world size, and
    # each step trains on the same samples at any world size. null: batch_size x processes.
    global_batch_size: int | None = None
    # DataLoader worker processes per rank; null = the node's cores / local ranks, less one.
    num_workers: int | None = None
    prefetch_factor: int = 2  # batches each worker prepares ahead
    # auto (tensor for the in-memory sets, DataLoader workers for the streamed ones) |
    # tensor (batches indexed on the device) | torch (DataLoader)
    loader: str = "auto"
    split: str = "val"  # which split eval.py scores
    # Training ends each epoch at the last whole batch on every rank (full batches: no
    # BatchNorm batch of one); false trains on every sample, the last batch short.
    # Validation and eval.py always see every sample.
    drop_last: bool = True
    # What the model is sized for; each data config declares its own.
    in_channels: int = 1
    image_size: int = 8
    # null only where the data names its classes (``counts_classes``): read before training
    num_classes: int | None = 10
    mean: list[float] = field(default_factory=lambda: [0.5])
    std: list[float] = field(default_factory=lambda: [0.5])
    # In-memory sets: random crop with padding and flip on the device; streamed sets:
    # RandomResizedCrop + horizontal flip per sample
    augment: bool = False
    # MixUp / CutMix on the device batch (task=classification, any data option)
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    def check(self) -> None:
        """Value ranges the types cannot express; ConfigError naming the key."""
        check_choice("data.split", self.split, SPLITS)
        check_choice("data.loader", self.loader, LOADERS)
        for key in ("batch_size", "global_batch_size", "in_channels", "image_size",
                    "num_classes"):  # fmt: skip
            check_positive(f"data.{key}", getattr(self, key))
        if self.num_classes is None and not self.counts_classes:
            raise ConfigError(
                f"data.num_classes=null: data={self.name} does not count its classes; set "
                "data.num_classes=N."
            )
        for key in ("num_workers", "prefetch_factor", "mixup_alpha", "cutmix_alpha"):
            check_positive(f"data.{key}", getattr(self, key), allow_zero=True)
        if len(self.mean) != self.in_channels or len(self.std) != self.in_channels:
            raise ConfigError(
                f"data.mean and data.std need one value per channel (data.in_channels="
                f"{self.in_channels}); got {len(self.mean)} and {len(self.std)}."
            )

    def describe_inputs(self) -> str:
        """What the model is fed, as errors name it."""
        size = self.image_size
        return f"images of {self.in_channels}x{size}x{size}"

    def sizes(self) -> dict[str, Any]:
        """What models and tasks are offered (where their signatures take them)."""
        return {"num_classes": self.num_classes, "in_channels": self.in_channels,
                "image_size": self.image_size}  # fmt: skip


def is_url(root: str | None) -> bool:
    """A ``data.root`` on an object store or web server (read through fsspec), not a folder."""
    return root is not None and "://" in root and not root.startswith("file://")


def skips_bad_images(cfg: DataConfig) -> bool:
    """``data.skip_bad_images`` of the options that read files one by one and have the key
    (the in-memory sets cannot meet a bad file)."""
    return bool(getattr(cfg, "skip_bad_images", False))
