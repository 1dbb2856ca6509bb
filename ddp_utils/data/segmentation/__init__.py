"""Segmentation data: ``data=segfolder | voc | digits_seg | mnist_seg``.

Samples are ``(uint8 CHW image, int64 HW mask)`` with ``IGNORE_LABEL`` where a pixel is not
counted (the mask's ``data.ignore_index``, crop padding, a sampler's padding duplicate). The
same samplers as every other set (resumable training shards, exact evaluation shards) and the
same per-sample seeding by (seed, epoch, index) as the image folders: identical crops at any
``data.num_workers`` and world size, and after a resume.
"""

from __future__ import annotations

from torch.utils.data import DataLoader

from ddp_utils.config import CanvasData, SegmentationData, VOCData
from ddp_utils.data.loaders import eval_shard_loader, sharded_loaders
from ddp_utils.data.samplers import ResumableDistributedSampler
from ddp_utils.data.segmentation.transforms import (
    EvalResizePad,
    SeededPairs,
    short_side_shape,
    train_transform,
)
from ddp_utils.dist import Runtime, local_main_first

__all__ = ["seg_eval_loader", "seg_loaders", "seg_source", "seg_dataset"]


def seg_source(cfg: SegmentationData, split: str, rt: Runtime):
    """The split's ``(image, mask)`` source, with ``classes`` and ``sizes`` (N, 2)."""
    if isinstance(cfg, CanvasData):
        from ddp_utils.data.segmentation.canvases import CanvasSource

        with local_main_first(rt):  # data=mnist_seg decodes MNIST into its cache once
            return CanvasSource(cfg, split)
    from ddp_utils.data.segmentation import folders

    if isinstance(cfg, VOCData):
        return folders.PairSource(folders.voc_index(cfg, split, rt), cfg, folders.VOC_CLASSES)
    index = folders.segfolder_index(cfg, split, rt)
    return folders.PairSource(index, cfg, folders.folder_classes(cfg))


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


def seg_loaders(
    cfg: SegmentationData, rt: Runtime, seed: int
) -> tuple[DataLoader, DataLoader, ResumableDistributedSampler, list[str]]:
    """The training and validation loaders, the training sampler, and the class names."""
    train_src, val_src = seg_source(cfg, "train", rt), seg_source(cfg, "val", rt)
    train_ds = seg_dataset(train_src, cfg, True, seed)
    val_ds = seg_dataset(val_src, cfg, False, seed)
    return (*sharded_loaders(train_ds, val_ds, cfg, rt, seed), train_src.classes)


def seg_eval_loader(cfg: SegmentationData, rt: Runtime, seed: int) -> tuple[DataLoader, list]:
    """The loader of ``data.split``, sharded exactly, and the class names."""
    source = seg_source(cfg, cfg.split, rt)
    return eval_shard_loader(seg_dataset(source, cfg, False, seed), cfg, rt), source.classes
