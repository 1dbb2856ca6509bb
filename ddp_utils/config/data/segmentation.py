"""The image/mask options' schemas: ``data=digits_seg``, ``mnist_seg``, ``segfolder``,
``voc``, ``segshards``; their builders are ddp_utils/data/segmentation/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ddp_utils.config.data.base import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    DataConfig,
    check_canvas,
    check_holdout,
    check_read_channels,
)
from ddp_utils.config.data.images import TorchvisionData, embedded_digits
from ddp_utils.config.data.shards import ShardStore
from ddp_utils.config.errors import (
    ConfigError,
    check_choice,
    check_positive,
)


@dataclass
class SegmentationData(DataConfig):
    """What the segmentation options share: (image, index mask) pairs, transformed jointly
    per sample in the loader's workers (``ddp_utils.data.segmentation``)."""

    holds: ClassVar[str] = "masks"
    family: ClassVar[str] = "ddp_utils.data.segmentation"
    wrong_task: ClassVar[str] = (
        "data={data} holds masks: train it with task=segmentation (and a segmentation model: "
        "model=seg_convnet | torchvision_seg), or start from experiment=digits_segmentation."
    )

    name: str = "digits_seg"
    # A mask value that is never counted and never in the loss (VOC's object borders).
    ignore_index: int = 255
    # Training: the shorter side resized to a random size in scale_range x base_size, a random
    # crop_size crop (the mask padded with ignore_index), a horizontal flip (hflip).
    base_size: int = 32
    crop_size: int = 32
    scale_range: list[float] = field(default_factory=lambda: [0.5, 2.0])
    hflip: bool = True
    # Evaluation: the shorter side resized to eval_size; null = each image at its own size.
    eval_size: int | None = None
    interpolation: str = "bilinear"  # the images' resize (masks: nearest neighbour, always)

    def check(self) -> None:
        super().check()
        if self.loader == "tensor":
            raise ConfigError(
                f"data={self.name} makes its batches through DataLoader workers (joint image "
                "and mask transforms): use data.loader=auto."
            )
        check_choice("data.interpolation", self.interpolation, INTERPOLATIONS)
        for key in ("base_size", "crop_size", "eval_size"):
            check_positive(f"data.{key}", getattr(self, key))
        if not 0 <= self.ignore_index <= 255:
            raise ConfigError(
                f"data.ignore_index={self.ignore_index}: index masks are 8-bit PNGs, so the "
                "ignored value lies in 0..255 (255 by default)."
            )
        if self.ignore_index < self.num_classes:
            raise ConfigError(
                f"data.num_classes={self.num_classes} and data.ignore_index="
                f"{self.ignore_index}: class ids are 0..num_classes-1 in an 8-bit mask, below "
                "ignore_index; lower data.num_classes or raise data.ignore_index."
            )
        lo_hi = self.scale_range
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]:
            raise ConfigError(
                f"data.scale_range={list(lo_hi)} needs two factors 0 < low <= high of "
                "data.base_size, e.g. [0.5,2.0]."
            )
        check_read_channels(self.in_channels)


@dataclass
class CanvasData(SegmentationData):
    """What data=digits_seg and mnist_seg share: canvases of one to three digits at random
    places, made once in memory; mask = digit + 1 on the digit's pixels, 0 elsewhere."""

    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + ("split_seed", "val_slice")

    canvas_size: int = 32
    digit_scales: list[int] = field(default_factory=lambda: [2, 3])  # upscaling factors
    max_digits: int = 3
    split_seed: int = 0  # the split and the canvases' layout
    val_slice: int | None = None  # as data=digits / data=mnist: which held-out slice validates

    def check(self) -> None:
        super().check()
        check_canvas(self)

    def digit_data(self) -> DataConfig:
        """The in-memory digit set (and its split) that the canvases are drawn from."""
        raise NotImplementedError


@dataclass
class DigitsSegData(CanvasData):
    """data=digits_seg: canvases of scikit-learn's bundled 8x8 digits."""

    identity: ClassVar[tuple[str, ...]] = CanvasData.identity + ("val_fraction",)

    val_fraction: float = 0.2  # the share of the digits held out for validation

    def check(self) -> None:
        super().check()
        check_holdout(self.val_fraction, self.val_slice)

    def digit_data(self) -> DataConfig:
        return embedded_digits(self)


@dataclass
class MnistSegData(CanvasData):
    """data=mnist_seg: canvases of MNIST's digits, from torchvision's layout under root."""

    name: str = "mnist_seg"
    root: str = "data"  # the folder that holds MNIST/
    canvas_size: int = 64
    digit_scales: list[int] = field(default_factory=lambda: [1])

    def check(self) -> None:
        super().check()
        check_positive("data.val_slice", self.val_slice, allow_zero=True)

    def digit_data(self) -> DataConfig:
        return TorchvisionData(name="mnist", root=self.root, val_slice=self.val_slice,
                               split_seed=self.split_seed)  # fmt: skip


@dataclass
class SegFolderData(SegmentationData):
    """data=segfolder: root/<train_dir>/{images,masks}/, root/<val_dir>/{images,masks}/."""

    name: str = "segfolder"
    root: str = "data"
    in_channels: int = 3
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    augment: bool = True
    train_dir: str = "train"
    val_dir: str = "val"


@dataclass
class VOCData(SegmentationData):
    """data=voc: Pascal VOC's layout under root (VOCdevkit/VOC<year>), never downloaded."""

    name: str = "voc"
    root: str = "data"
    in_channels: int = 3
    num_classes: int = 21
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    augment: bool = True
    base_size: int = 520
    crop_size: int = 480
    image_size: int = 480
    eval_size: int | None = 520
    year: str = "2012"
    train_set: str = "train"  # ImageSets/Segmentation/<train_set>.txt
    val_set: str = "val"


@dataclass
class SegShardsData(SegmentationData, ShardStore):
    """data=segshards: tar shards of KEY.<image> + KEY.mask.png (an 8-bit index mask)."""

    name: str = "segshards"
    in_channels: int = 3
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    augment: bool = True
