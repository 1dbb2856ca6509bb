"""Segmentation data: ``data=segfolder | voc | digits_seg | mnist_seg``.

Samples are ``(uint8 CHW image, int64 HW mask)`` with ``IGNORE_LABEL`` where a pixel is not
counted (the mask's ``data.ignore_index``, crop padding, a sampler's padding duplicate). The
same samplers as every other set (resumable training shards, exact evaluation shards) and the
same per-sample seeding by (seed, epoch, index) as the image folders: identical crops at any
``data.num_workers`` and world size, and after a resume.
"""

from __future__ import annotations

from ddp_utils.config import CanvasData, SegFolderData, SegmentationData, SegShardsData, VOCData
from ddp_utils.data.bundle import DataBundle, EvalData, image_bundle, image_eval
from ddp_utils.data.loaders import eval_shard_loader, sharded_loaders
from ddp_utils.data.registry import by_schema
from ddp_utils.data.segmentation.transforms import (
    EvalResizePad,
    SeededPairs,
    short_side_shape,
    train_transform,
)
from ddp_utils.dist import Runtime, local_main_first

__all__ = ["build", "build_eval", "samples", "seg_source", "seg_dataset"]


def canvas_source(cfg: SegmentationData, split: str, rt: Runtime):
    from ddp_utils.data.segmentation.canvases import CanvasSource

    with local_main_first(rt):  # data=mnist_seg decodes MNIST into its cache once
        return CanvasSource(cfg, split)


def voc_source(cfg: SegmentationData, split: str, rt: Runtime):
    from ddp_utils.data.segmentation import folders

    return folders.PairSource(folders.voc_index(cfg, split, rt), cfg, folders.VOC_CLASSES)


def folder_source(cfg: SegmentationData, split: str, rt: Runtime):
    from ddp_utils.data.segmentation import folders

    index = folders.segfolder_index(cfg, split, rt)
    return folders.PairSource(index, cfg, folders.folder_classes(cfg))


def shards_source(cfg: SegmentationData, split: str, rt: Runtime):
    from ddp_utils.data.shards.reader import samples

    return samples(cfg, rt, split)


SOURCES = {CanvasData: canvas_source, VOCData: voc_source, SegFolderData: folder_source,
           SegShardsData: shards_source}  # fmt: skip


def seg_source(cfg: SegmentationData, split: str, rt: Runtime):
    """The split's ``(image, mask)`` source, with ``classes`` and ``sizes`` (N, 2)."""
    return by_schema(SOURCES, cfg)(cfg, split, rt)


def samples(cfg: SegmentationData, rt: Runtime, split: str):
    """``(uint8 CHW image, uint8 HW mask)`` of a split (``python -m ddp_utils.shards write``)."""
    return seg_source(cfg, split, rt)


def seg_dataset(source, cfg: SegmentationData, train: bool, seed: int) -> SeededPairs:
    """Training: the augmented crops (``data.augment``); evaluation (and training without
    augmentation): every image padded to the split's largest evaluation size."""
    if train and cfg.augment:
        transform = train_transform(cfg)
    else:
        shapes = [short_side_shape(int(h), int(w), cfg.eval_size) for h, w in source.sizes.tolist()]
        canvas = (max(h for h, _ in shapes), max(w for _, w in shapes))
        transform = EvalResizePad(cfg, canvas)
    return SeededPairs(source, transform, seed, cfg.ignore_index)


def build(cfg: SegmentationData, rt: Runtime, seed: int, channels_last: bool | str) -> DataBundle:
    """The training and validation loaders (joint transforms in the workers)."""
    train_src, val_src = seg_source(cfg, "train", rt), seg_source(cfg, "val", rt)
    train_ds = seg_dataset(train_src, cfg, True, seed)
    val_ds = seg_dataset(val_src, cfg, False, seed)
    loaders = (*sharded_loaders(train_ds, val_ds, cfg, rt, seed, train_src), train_src.classes)
    return image_bundle(cfg, rt, loaders, False, channels_last)


def build_eval(
    cfg: SegmentationData, rt: Runtime, seed: int, channels_last: bool | str
) -> EvalData:
    """The loader of ``data.split``, sharded exactly."""
    source = seg_source(cfg, cfg.split, rt)
    loader = eval_shard_loader(seg_dataset(source, cfg, False, seed), cfg, rt)
    return image_eval(cfg, rt, loader, source.classes, channels_last)
