"""Detection data: ``data=digits_det``, ``data=detfolder`` (a COCO-format folder) and
``data=voc_det`` (Pascal VOC's layout).

Samples are ``(uint8 CHW image, {"boxes": tv_tensors.BoundingBoxes, "labels": int64})``; a
batch's target is the list of those dicts (torchvision detection's layout), a padding
duplicate a ``{SENTINEL: IGNORE_LABEL}`` dict. The samplers and the per-sample seeding are the
other families': every image once per epoch and in evaluation, at any world size.
"""

from __future__ import annotations

from dataclasses import replace

from torchvision.transforms import v2

from ddp_utils.config import (
    DetectionData,
    DetFolderData,
    DetShardsData,
    DigitsDetData,
    VOCDetData,
)
from ddp_utils.data.bundle import DataBundle, EvalData, image_bundle, image_eval
from ddp_utils.data.images.transforms import SeededTransform
from ddp_utils.data.loaders import eval_shard_loader, sharded_loaders
from ddp_utils.data.registry import by_schema
from ddp_utils.dist import Runtime, local_main_first


def canvas_source(cfg: DetectionData, split: str, rt: Runtime):
    from ddp_utils.data.detection.canvases import DetCanvasSource

    with local_main_first(rt):
        return DetCanvasSource(cfg, split)


def coco_source(cfg: DetectionData, split: str, rt: Runtime):
    from ddp_utils.data.detection.coco import CocoSource

    return CocoSource(cfg, split)


def voc_source(cfg: DetectionData, split: str, rt: Runtime):
    from ddp_utils.data.detection.voc import VOCSource

    return VOCSource(cfg, split)


def shards_source(cfg: DetectionData, split: str, rt: Runtime):
    from ddp_utils.data.shards.reader import samples

    return samples(cfg, rt, split)


SOURCES = {DigitsDetData: canvas_source, DetFolderData: coco_source, VOCDetData: voc_source,
           DetShardsData: shards_source}  # fmt: skip


def coco_class_count(cfg: DetFolderData) -> int:
    from ddp_utils.data.detection.coco import class_count

    return class_count(cfg)


def shards_class_count(cfg: DetShardsData) -> int:
    from ddp_utils.data.shards.reader import class_names

    return len(class_names(cfg))


# What data.num_classes is when it is left null: the classes the data names, and the background.
CLASS_COUNTS = {DetFolderData: coco_class_count, VOCDetData: lambda cfg: len(cfg.classes) + 1,
                DetShardsData: shards_class_count}  # fmt: skip


def resolve(cfg: DetectionData, rt: Runtime) -> DetectionData:
    """Every rank: ``data.num_classes`` from the data when it is null (a value given is
    checked against the data when the annotations are read)."""
    if cfg.num_classes is not None:
        return cfg
    return replace(cfg, num_classes=by_schema(CLASS_COUNTS, cfg)(cfg))


def samples(cfg: DetectionData, rt: Runtime, split: str):
    """``(uint8 CHW image, boxes target)`` of a split (``python -m ddp_utils.shards write``)."""
    return by_schema(SOURCES, cfg)(cfg, split, rt)


def det_dataset(source, cfg: DetectionData, train: bool, seed: int) -> SeededTransform:
    """The source's images with their boxes, seeded per sample; training with
    ``data.augment`` and ``data.hflip`` flips image and boxes together (the canvases' digits
    are never mirrored). Images keep their sizes: the detector's own transform resizes."""
    flip = train and cfg.augment and getattr(cfg, "hflip", False)
    return SeededTransform(source, v2.RandomHorizontalFlip() if flip else v2.Identity(), seed)


def build(cfg: DetectionData, rt: Runtime, seed: int, channels_last: bool | str) -> DataBundle:
    train_src, val_src = (by_schema(SOURCES, cfg)(cfg, s, rt) for s in ("train", "val"))
    train_ds, val_ds = (
        det_dataset(train_src, cfg, True, seed),
        det_dataset(val_src, cfg, False, seed),
    )
    loaders = (*sharded_loaders(train_ds, val_ds, cfg, rt, seed, train_src), train_src.classes)
    return image_bundle(cfg, rt, loaders, False, channels_last)


def build_eval(cfg: DetectionData, rt: Runtime, seed: int, channels_last: bool | str) -> EvalData:
    source = by_schema(SOURCES, cfg)(cfg, cfg.split, rt)
    loader = eval_shard_loader(det_dataset(source, cfg, False, seed), cfg, rt)
    return image_eval(cfg, rt, loader, source.classes, channels_last)
