"""The ``data`` group's schemas: the keys every option has, then each option's own.

Each ``conf/data/<option>.yaml`` starts from its schema (``DATA_OPTIONS``), so a key of
another option (``data=digits data.train_dir=x``) is refused at composition, by name.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ddp_utils.config.errors import (
    ConfigError,
    check_choice,
    check_fraction,
    check_positive,
    needs_target,
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


def embedded_digits(cfg: Any) -> DigitsData:
    """data=digits' split that a canvas option of the embedded digits draws from."""
    return DigitsData(name=cfg.name, val_fraction=cfg.val_fraction, split_seed=cfg.split_seed,
                      val_slice=cfg.val_slice)  # fmt: skip


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
class ShardStore(DataConfig):
    """Where tar shards are and how they are read: the keys data=shards, segshards and
    detshards share (``ddp_utils.data.shards``)."""

    root: str = "shards"  # a folder or URL holding <train_dir>/ and <val_dir>/
    # A split's folder (its *.tar), or a brace pattern of shards: train/s-{000..099}.tar
    train_dir: str = "train"
    val_dir: str = "val"
    # fsspec's options for the store (s3fs: endpoint_url, key, secret, client_kwargs, ...);
    # S3 also reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... and its usual credential chain
    storage_options: dict[str, Any] = field(default_factory=dict)
    # Where remote shards are kept on this node (null: ~/.cache/ddp-recipes/shards), and how
    # many bytes they may take (least recently used go first); 0 reads by range requests
    cache_dir: str | None = None
    cache_bytes: int = 50 * 2**30
    # The epoch's order: the shards shuffled, then the samples within each window of this
    # many shards (from seed and epoch alone); 1 reads one shard at a time
    shuffle_window: int = 8
    retries: int = 5  # attempts at a shard before the store counts as gone (backoff 1, 2, 4 s...)

    def check(self) -> None:
        super().check()
        check_positive("data.shuffle_window", self.shuffle_window)
        check_positive("data.cache_bytes", self.cache_bytes, allow_zero=True)
        check_positive("data.retries", self.retries)


@dataclass
class ShardsData(StreamedData, ShardStore):
    """data=shards: WebDataset-layout tar shards (KEY.<image> + KEY.cls) under
    data.root/<train_dir>/*.tar (and <val_dir>), in a local folder or at any fsspec URL."""

    family: ClassVar[str] = "ddp_utils.data.shards.reader"
    name: str = "shards"


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


# data=pystdlib's rule that cuts train from val; a new rule makes older caches stale (2:
# nanoGPT's ``int(n * (1 - val_fraction))`` training characters, issue 33).
SPLIT_RULE = 2
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
TOKENIZERS = ("char", "bytes")  # data=pystdlib's; prepare_text also has bpe


@dataclass
class TokenData(DataConfig):
    """data=tokens: nanoGPT's layout, root/train.bin and root/val.bin (flat token ids, read
    with numpy.memmap) and root/meta.json (vocab_size, dtype, the tokenizer)."""

    holds: ClassVar[str] = "tokens"
    family: ClassVar[str] = "ddp_utils.data.text.tokens"
    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + ("block_size", "vocab_size")
    root_may_be_null: ClassVar[bool] = False
    wrong_task: ClassVar[str] = (
        "data={data} holds token ids: train it with task=language_model and model=gpt (or "
        "model=hf | custom), or start from experiment=lm_char."
    )

    name: str = "tokens"
    # A folder or URL (s3://, gs://, https://) holding train.bin and val.bin, or train/ and
    # val/ folders of .bin shards (read as one stream, by name), and meta.json
    root: str | None = "data"
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec's, for a URL
    cache_dir: str | None = None  # a URL's files, once per node; null = ~/.cache/ddp-recipes
    retries: int = 5  # attempts at the store before the run stops (exit code 75)
    batch_size: int = 12
    block_size: int = 64  # context length: windows of block_size + 1 tokens
    eval_batch_size: int | None = None  # validation windows per batch; null = batch_size
    # null = meta.json's; a larger value pads the embedding (GPT-2's 50304 for 50257)
    vocab_size: int | None = None
    dtype: str | None = None  # null = meta.json's (uint16 without one)
    # The ids of a sample of each file are checked against vocab_size at start (null: all of
    # a file up to this many tokens is read; every batch is checked as it is read anyway).
    check_tokens: int = 1_000_000
    # Not images: the image keys keep their defaults; num_classes is set to vocab_size.
    in_channels: int = 1
    image_size: int = 1

    def check(self) -> None:
        super().check()
        if self.root is None and not self.root_may_be_null:
            raise ConfigError(
                f"data.root=null: data={self.name} reads ROOT/train.bin, ROOT/val.bin and "
                "ROOT/meta.json; set data.root to that folder."
            )
        check_positive("data.block_size", self.block_size)
        check_positive("data.retries", self.retries)
        check_positive("data.eval_batch_size", self.eval_batch_size)
        check_positive("data.vocab_size", self.vocab_size)
        check_positive("data.check_tokens", self.check_tokens, allow_zero=True)
        if self.dtype is not None:
            check_choice("data.dtype", self.dtype, TOKEN_DTYPES)
        if self.mixup_alpha or self.cutmix_alpha or self.augment:
            raise ConfigError(
                f"data={self.name} holds token ids: data.augment, data.mixup_alpha and "
                "data.cutmix_alpha apply to images; leave them at their defaults."
            )

    def sizes(self) -> dict[str, Any]:
        return super().sizes() | {"vocab_size": self.num_classes, "block_size": self.block_size}

    def describe_inputs(self) -> str:
        return f"sequences of {self.block_size} token ids"

    def folder(self) -> Path:
        """Where train.bin, val.bin and meta.json are."""
        return Path(self.root)


@dataclass
class PyStdlibData(TokenData):
    """data=pystdlib: the running interpreter's standard library .py sources as text,
    tokenized once into root (null = the per-user data cache)."""

    family: ClassVar[str] = "ddp_utils.data.text.pystdlib"
    identity: ClassVar[tuple[str, ...]] = TokenData.identity + ("tokenizer", "val_fraction")
    root_may_be_null: ClassVar[bool] = True  # the per-user cache

    name: str = "pystdlib"
    root: str | None = None
    tokenizer: str = "char"  # char | bytes
    val_fraction: float = 0.1  # the last tenth of the text, as prepare_text

    def check(self) -> None:
        super().check()
        check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check_holdout(self.val_fraction, None)
        if is_url(self.root):
            raise ConfigError(
                f"data.root={self.root}: data=pystdlib prepares its files in a local folder; "
                "give a folder (or null), or train on a URL's files with data=tokens."
            )

    def source_key(self) -> str:
        """What the prepared corpus is made from: a folder holding another is rebuilt."""
        version = ".".join(map(str, sys.version_info[:3]))
        return f"python{version}-{self.tokenizer}-val{self.val_fraction}-split{SPLIT_RULE}"

    def folder(self) -> Path:
        """``data.root``, or the corpus' folder in the per-user data cache
        (``$XDG_CACHE_HOME/ddp-recipes/pystdlib/<source_key>``, by default under ~/.cache)."""
        if self.root is not None:
            return Path(self.root)
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return cache / "ddp-recipes" / "pystdlib" / self.source_key()


def is_url(root: str | None) -> bool:
    """A ``data.root`` on an object store or web server (read through fsspec), not a folder."""
    return root is not None and "://" in root and not root.startswith("file://")


DATA_OPTIONS: dict[str, type[DataConfig]] = {
    "digits": DigitsData,
    "mnist": TorchvisionData,
    "fashion_mnist": TorchvisionData,
    "cifar10": TorchvisionData,
    "synthetic": SyntheticData,
    "imagefolder": ImageFolderData,
    "shards": ShardsData,
    "custom": CustomData,
    "digits_seg": DigitsSegData,
    "mnist_seg": MnistSegData,
    "segfolder": SegFolderData,
    "segshards": SegShardsData,
    "voc": VOCData,
    "tokens": TokenData,
    "pystdlib": PyStdlibData,
    "digits_det": DigitsDetData,
    "detfolder": DetFolderData,
    "detshards": DetShardsData,
    "voc_det": VOCDetData,
}


def skips_bad_images(cfg: DataConfig) -> bool:
    """``data.skip_bad_images`` of the options that read files one by one and have the key
    (the in-memory sets cannot meet a bad file)."""
    return bool(getattr(cfg, "skip_bad_images", False))
