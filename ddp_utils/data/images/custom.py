"""Your own data set: ``data=custom data._target_=pkg.module.fn +data.NAME=VALUE``.

The target (built with Hydra's ``instantiate``) returns ``(train, val)``: two map-style data
sets whose items are ``(image, target)``. The target is a class label, or a dict (boxes and
their labels, say) that your task reads: a batch then holds a list of per-sample dicts. The
image is a PIL image (any mode: 16-bit and float ones are scaled to 8 bits) or a tensor
(uint8, uint16, or float in [0, 1]; CHW or HW). Each image is turned into a uint8 CHW tensor
of ``data.in_channels`` channels, then goes through the same seeded transforms (a dict
target's ``tv_tensors.BoundingBoxes`` with it), samplers and on-device normalisation as an
image folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch.utils.data import Dataset

from ddp_utils.config import ConfigError, DataConfig, UserError
from ddp_utils.data.images.imagefolder import BadImages, match_channels, pil_to_uint8, to_uint8


def load_custom(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """Call ``data._target_`` with ``data.kwargs``; check it returned two sized data sets."""
    try:
        made = instantiate({"_target_": cfg._target_, **cfg.kwargs})
    except InstantiationException as e:
        cause = e.__cause__ or e
        raise ConfigError(
            f"data._target_={cfg._target_} could not be called with {dict(cfg.kwargs)} "
            f"({type(cause).__name__}: {str(cause).strip().splitlines()[-1][:300]}). Check that "
            "the module is importable from where you launch (PYTHONPATH) and that its "
            "arguments match the +data.NAME=VALUE overrides."
        ) from None
    if not (isinstance(made, tuple | list) and len(made) == 2):
        raise ConfigError(
            f"data._target_={cfg._target_} returned {type(made).__name__}; it must return "
            "(train, val), two map-style data sets of (image, label)."
        )
    for name, ds in zip(("train", "val"), made, strict=True):
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
            raise ConfigError(
                f"data._target_={cfg._target_}: its {name} set ({type(ds).__name__}) is not a "
                "map-style data set (it needs __len__ and __getitem__)."
            )
    return made[0], made[1]


def to_uint8_image(image: Any, channels: int, where: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor):  # a PIL image
        return pil_to_uint8(image, channels, where)
    return match_channels(to_uint8(image, where), channels, where)


class CustomSource(Dataset):
    """A user's data set as ``(uint8 CHW image, int label)``; with ``data.skip_bad_images`` an
    item whose image cannot be made one is skipped (``BAD_LABEL``) instead of stopping."""

    def __init__(self, ds: Dataset, cfg: DataConfig, split: str) -> None:
        self.ds, self.channels = ds, cfg.in_channels
        self.bad = BadImages(cfg)
        self.where = f"data._target_={cfg._target_} ({split} set)"
        self.classes = list(getattr(ds, "classes", []) or []) or None

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        image, target = self.ds[i]
        # A dict target (boxes, ...) is the task's to read; anything else is a class label.
        target = target if isinstance(target, Mapping) else int(target)
        try:
            return to_uint8_image(image, self.channels, f"{self.where}, item {i}"), target
        except UserError as e:
            stop = f"{e}. Fix the item, or set data.skip_bad_images=true to skip such items."
            return self.bad.handle(i, stop, f"skipping {e}")
