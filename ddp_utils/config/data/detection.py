"""The images-with-boxes options' schemas: ``data=digits_det``, ``detfolder``,
``detshards``, ``voc_det``; their builders are ddp_utils/data/detection/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ddp_utils.config.data.base import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    VOC_CLASSES,
    DataConfig,
    check_canvas,
    check_holdout,
    check_read_channels,
)
from ddp_utils.config.data.images import embedded_digits
from ddp_utils.config.data.shards import ShardStore
from ddp_utils.config.errors import (
    ConfigError,
)


@dataclass
class DetectionData(DataConfig):
    """What the detection options share: images with per-image boxes and their labels,
    ``(uint8 CHW image, {"boxes": tv_tensors.BoundingBoxes (xyxy, pixels), "labels"})``.
    Label 0 is the background (torchvision's detectors count it in num_classes)."""

    holds: ClassVar[str] = "boxes"
    wrong_task: ClassVar[str] = (
        "data={data} holds boxes: train it with task=detection and a detector (model=tiny_det), "
        "or start from experiment=digits_detection."
    )
    family: ClassVar[str] = "ddp_utils.data.detection"

    name: str = "digits_det"
    num_workers: int | None = 0

    def check(self) -> None:
        super().check()
        if self.mixup_alpha or self.cutmix_alpha:
            raise ConfigError(
                f"data={self.name} holds boxes: data.mixup_alpha and data.cutmix_alpha mix "
                "class labels; leave them at 0."
            )


@dataclass
class DigitsDetData(DetectionData):
    """data=digits_det: canvases of scikit-learn's 8x8 digits, each digit's box and class."""

    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + (
        "canvas_size", "digit_scales", "max_digits", "split_seed", "val_slice", "val_fraction"
    )  # fmt: skip

    canvas_size: int = 64
    digit_scales: list[int] = field(default_factory=lambda: [2, 3])  # upscaling factors
    max_digits: int = 3
    split_seed: int = 0  # the split and the canvases' layout
    val_slice: int | None = None  # as data=digits: which held-out slice validates
    val_fraction: float = 0.2  # the share of the digits held out for validation

    def check(self) -> None:
        super().check()
        check_canvas(self)
        check_holdout(self.val_fraction, self.val_slice)
        if self.image_size != self.canvas_size:
            raise ConfigError(
                f"data.image_size={self.image_size} and data.canvas_size={self.canvas_size}: the "
                "canvases are the images; set data.image_size to data.canvas_size."
            )

    def digit_data(self) -> DataConfig:
        """The in-memory digit set (and its split) that the canvases are drawn from."""
        return embedded_digits(self)


@dataclass
class DetFilesData(DetectionData):
    """What the detection options that read image files share."""

    root: str = "data"
    in_channels: int = 3
    image_size: int = 320  # what the detector is checked at before training
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    hflip: bool = True  # training: a random horizontal flip, boxes with it (data.augment)

    def check(self) -> None:
        super().check()
        check_read_channels(self.in_channels)


@dataclass
class DetFolderData(DetFilesData):
    """data=detfolder: a COCO-format folder (ddp_utils/data/detection/coco.py)."""

    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + (
        "root", "images_dir", "train_annotations", "val_annotations"
    )  # fmt: skip

    counts_classes: ClassVar[bool] = True

    name: str = "detfolder"
    num_classes: int | None = None  # null = the annotation files' categories + 1
    images_dir: str = "images"
    train_annotations: str = "annotations/train.json"
    val_annotations: str = "annotations/val.json"


@dataclass
class DetShardsData(DetFilesData, ShardStore):
    """data=detshards: tar shards of KEY.<image> + KEY.json (boxes, labels, iscrowd); the
    class names in data.root/classes.txt (the background first)."""

    counts_classes: ClassVar[bool] = True

    name: str = "detshards"
    root: str = "shards"
    num_classes: int | None = None  # null = the lines of data.root/classes.txt


@dataclass
class VOCDetData(DetFilesData):
    """data=voc_det: Pascal VOC's detection layout (ddp_utils/data/detection/voc.py)."""

    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + (
        "root", "year", "train_set", "val_set", "classes", "keep_difficult"
    )  # fmt: skip

    counts_classes: ClassVar[bool] = True

    name: str = "voc_det"
    year: str = "2012"
    train_set: str = "train"  # ImageSets/Main/<train_set>.txt
    val_set: str = "val"
    classes: list[str] = field(default_factory=lambda: list(VOC_CLASSES))
    num_classes: int | None = None  # null = data.classes + 1 (the background)
    keep_difficult: bool = True  # as crowd boxes: out of training, neither hit nor miss in mAP

    def check(self) -> None:
        super().check()
        if len(set(self.classes)) != len(self.classes) or not self.classes:
            raise ConfigError(
                f"data.classes={list(self.classes)}: the object classes' names, each once "
                "(their order gives the labels 1..K)."
            )
        if self.num_classes is not None and self.num_classes != len(self.classes) + 1:
            raise ConfigError(
                f"data.num_classes={self.num_classes} with {len(self.classes)} data.classes: "
                f"set data.num_classes={len(self.classes) + 1} (the classes and the background)."
            )
