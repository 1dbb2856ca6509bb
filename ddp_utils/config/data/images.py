"""The image-label options' schemas: ``data=digits`` (embedded), ``mnist``,
``fashion_mnist``, ``cifar10`` (torchvision), ``synthetic``, ``imagefolder`` and ``custom``
(streamed from files); their builders are ddp_utils/data/images/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ddp_utils.config.data.base import (
    AUTO_AUGMENTS,
    INTERPOLATIONS,
    DataConfig,
    check_holdout,
    check_read_channels,
)
from ddp_utils.config.errors import (
    check_choice,
    check_fraction,
    check_positive,
    needs_target,
)


@dataclass
class DigitsData(DataConfig):
    """data=digits: scikit-learn's bundled 8x8 digits, split in memory."""

    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + (
        "val_fraction",
        "split_seed",
        "val_slice",
    )

    val_fraction: float = 0.2  # share held out for validation
    split_seed: int = 0  # fixed split, independent of the training seed
    # Which held-out slice is the validation set: slice k of val_fraction of a split_seed
    # permutation (null = 0); the rest is the training set
    val_slice: int | None = None

    def check(self) -> None:
        super().check()
        check_holdout(self.val_fraction, self.val_slice)


@dataclass
class TorchvisionData(DataConfig):
    """data=mnist | fashion_mnist | cifar10: torchvision's files under data.root, decoded
    once into memory."""

    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + ("split_seed", "val_slice")

    name: str = "mnist"
    root: str = "data"
    download: bool = False
    # null = the official test set; k = slice k (of the test set's size) of the pooled
    # train + test images, permuted by split_seed, the rest being the training set
    val_slice: int | None = None
    split_seed: int = 0

    def check(self) -> None:
        super().check()
        check_positive("data.val_slice", self.val_slice, allow_zero=True)


@dataclass
class SyntheticData(DataConfig):
    """data=synthetic: random images and labels of the declared shape."""

    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + ("num_train", "num_val")

    name: str = "synthetic"
    num_train: int = 8000
    num_val: int = 2000

    def check(self) -> None:
        super().check()
        check_positive("data.num_train", self.num_train)
        check_positive("data.num_val", self.num_val)


@dataclass
class StreamedData(DataConfig):
    """What the streamed options share: images decoded and transformed per sample in the
    loader's workers (the classification references' presets)."""

    family: ClassVar[str] = "ddp_utils.data.images.streamed"

    resize_size: int | None = None  # evaluation Resize; null = round(image_size / 0.875)
    interpolation: str = "bilinear"  # nearest | bilinear | bicubic
    skip_bad_images: bool = False  # skip unreadable images with a warning, count them
    auto_augment: str | None = None  # ta_wide | ra | augmix
    random_erase: float = 0.0  # probability
    train_crop_size: int | None = None  # training crop; null = image_size

    def check(self) -> None:
        super().check()
        check_choice("data.interpolation", self.interpolation, INTERPOLATIONS)
        if self.auto_augment is not None:
            check_choice("data.auto_augment", self.auto_augment, AUTO_AUGMENTS)
        check_fraction("data.random_erase", self.random_erase)
        check_positive("data.resize_size", self.resize_size)
        check_positive("data.train_crop_size", self.train_crop_size)
        check_read_channels(self.in_channels)


@dataclass
class ImageFolderData(StreamedData):
    """data=imagefolder: data.root/<train_dir>/<class>/*, data.root/<val_dir>/<class>/*."""

    name: str = "imagefolder"
    root: str = "data"
    train_dir: str = "train"
    val_dir: str = "val"


@dataclass
class CustomData(StreamedData):
    """data=custom: a callable of yours that returns (train, val) data sets."""

    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + ("_target_", "kwargs")

    name: str = "custom"
    _target_: str | None = None  # pkg.module.fn
    kwargs: dict[str, Any] = field(default_factory=dict)  # +data.NAME=VALUE

    def check(self) -> None:
        if not self._target_:
            raise needs_target(
                "data", "pkg.module.fn: a callable that returns (train, val) data sets"
            )
        super().check()


def embedded_digits(cfg: Any) -> DigitsData:
    """data=digits' split that a canvas option of the embedded digits draws from."""
    return DigitsData(name=cfg.name, val_fraction=cfg.val_fraction, split_seed=cfg.split_seed,
                      val_slice=cfg.val_slice)  # fmt: skip
