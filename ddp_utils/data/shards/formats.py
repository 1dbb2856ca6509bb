"""What a sample of a shard holds besides its image, per kind of data: a class, a mask, boxes.

A format names the members it reads (``KEY.cls``; ``KEY.mask.png``; ``KEY.json``), the numbers
the split's index keeps of them (one int64 tensor a column, no Python object a sample), how a
sample's target is made from those numbers and bytes, and how the writer stores a target. The
data option's ``holds`` (labels, masks, boxes) picks it, for reading and for writing.

    KEY.cls        the class index as text                          data=shards
    KEY.mask.png   8-bit index mask (KEY.seg.png is read too)       data=segshards
    KEY.json       {"boxes": [[x0, y0, x1, y1], ...] (pixels),      data=detshards
                    "labels": [1..K, ...], "iscrowd": [0 | 1, ...]}
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchvision import tv_tensors

from ddp_utils.config import ConfigError, DataConfig

Size = tuple[int, int]  # an image's (height, width)


def image_size(data: bytes, kind: str) -> Size:
    """(height, width) from an image member's header, without decoding it."""
    if kind == "npy":
        buffer = io.BytesIO(data)
        version = np.lib.format.read_magic(buffer)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0  # fmt: skip
        shape = read(buffer)[0]
        return int(shape[-2]), int(shape[-1])
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.height, image.width


class ClassFormat:
    """``KEY.cls``: the class index, kept in the index (no read a sample)."""

    option = "shards"  # the data option that reads it
    kinds = ("cls",)
    columns = ("label",)
    sizes = False  # no (height, width) column: nothing here needs them
    reads_target = False  # the index holds the whole target

    def __init__(self, cfg: DataConfig) -> None:
        self.num_classes = cfg.num_classes

    def index_sample(self, key: str, label: bytes, size: Size | None, shard: str) -> dict[str, int]:
        try:
            value = int(label.decode().strip())
        except ValueError:
            raise ConfigError(f"{key}.cls in the shard {shard} holds {label[:20]!r}, not a class "
                              "index") from None  # fmt: skip
        if not 0 <= value < self.num_classes:
            raise ConfigError(f"{key}.cls in the shard {shard} is class {value}, outside "
                              f"data.num_classes={self.num_classes}; set data.num_classes to the "
                              "number of classes.")  # fmt: skip
        return {"label": value}

    def target(self, index: dict[str, Any], i: int, data: bytes | None, where: str) -> int:
        return int(index["label"][i])

    def encode(self, target: Any) -> tuple[str, bytes]:
        return "cls", str(int(target)).encode()

    def skipped(self, target: Any) -> bool:
        """A source's unreadable image (``data.skip_bad_images``), not written."""
        from ddp_utils.data.samplers import BAD_LABEL

        return int(target) == BAD_LABEL


class MaskFormat:
    """``KEY.mask.png``: the mask, read with each sample; the index keeps its byte range."""

    option = "segshards"
    kinds = ("mask.png", "seg.png")
    columns = ()
    sizes = True  # evaluation pads every image to the split's largest
    reads_target = True

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg

    def index_sample(self, key: str, mask: bytes, size: Size | None, shard: str) -> dict[str, int]:
        return {}  # the mask's values are checked as it is read, naming the sample

    def target(self, index: dict[str, Any], i: int, data: bytes | None, where: str) -> torch.Tensor:
        from ddp_utils.data.segmentation.folders import read_mask

        assert data is not None
        return read_mask(io.BytesIO(data), self.cfg, f"the mask of {where}")

    def encode(self, target: torch.Tensor) -> tuple[str, bytes]:
        from torchvision.io import encode_png

        return "mask.png", encode_png(target.to(torch.uint8)[None]).numpy().tobytes()

    def skipped(self, target: Any) -> bool:
        return False  # an unreadable pair stops the writer, naming the file


class BoxFormat:
    """``KEY.json``: boxes (xyxy, pixels), labels 1..K and crowd flags, checked when indexed."""

    option = "detshards"
    kinds = ("json",)
    columns = ()
    sizes = True  # the boxes are checked against the image's size
    reads_target = True

    def __init__(self, cfg: DataConfig) -> None:
        self.num_classes = cfg.num_classes

    def parse(self, data: bytes, where: str) -> tuple[list[list[float]], list[int], list[int]]:
        from ddp_utils.data.detection.boxes import fail

        try:
            doc = json.loads(data)
            boxes = [[float(v) for v in b] for b in doc.get("boxes", [])]
            labels = [int(v) for v in doc.get("labels", [])]
            crowd = [int(bool(v)) for v in doc.get("iscrowd", [0] * len(labels))]
        except (ValueError, TypeError, AttributeError) as e:
            fix = 'A sample\'s .json holds {"boxes": [[x0, y0, x1, y1], ...], "labels": [...]}.'
            raise fail(Path(where), f"is not a boxes record ({e})", fix) from None
        if not (len(boxes) == len(labels) == len(crowd)) or any(len(b) != 4 for b in boxes):
            raise fail(Path(where), f"has {len(boxes)} boxes, {len(labels)} labels and "
                       f"{len(crowd)} iscrowd flags", "Give one label (and flag) a box, each box "
                       "as [x0, y0, x1, y1].")  # fmt: skip
        return boxes, labels, crowd

    def index_sample(self, key: str, data: bytes, size: Size | None, shard: str) -> dict[str, int]:
        from ddp_utils.data.detection.boxes import check_xyxy, fail

        assert size is not None
        where, (h, w) = f"{key}.json in the shard {shard}", size
        boxes, labels, _ = self.parse(data, where)
        for n, (box, label) in enumerate(zip(boxes, labels, strict=True)):
            check_xyxy(box, w, h, Path(where), f"box {n}", box)
            if self.num_classes is not None and not 1 <= label < self.num_classes:
                top = self.num_classes - 1
                raise fail(Path(where), f"box {n} has label {label}, outside 1..{top}",
                           f"Labels are 1..K (0 is the background) for data.num_classes="
                           f"{self.num_classes}; set data.num_classes to K + 1.")  # fmt: skip
        return {}

    def target(
        self, index: dict[str, Any], i: int, data: bytes | None, where: str
    ) -> dict[str, Any]:
        assert data is not None
        from ddp_utils.data.detection.boxes import check_xyxy

        shown = f"the boxes of {where}"
        boxes, labels, crowd = self.parse(data, shown)
        size = (int(index["height"][i]), int(index["width"][i]))
        clipped = [check_xyxy(b, size[1], size[0], Path(shown), f"box {n}", b)
                   for n, b in enumerate(boxes)]  # fmt: skip
        return {
            "boxes": tv_tensors.BoundingBoxes(torch.tensor(clipped, dtype=torch.float32)
                                              .reshape(-1, 4), format="XYXY", canvas_size=size),
            "labels": torch.tensor(labels, dtype=torch.int64),
            "iscrowd": torch.tensor(crowd, dtype=torch.int64),
        }  # fmt: skip

    def encode(self, target: dict[str, Any]) -> tuple[str, bytes]:
        labels = target["labels"].tolist()
        crowd = target.get("iscrowd", torch.zeros(len(labels), dtype=torch.int64)).tolist()
        doc = {"boxes": torch.as_tensor(target["boxes"]).tolist(), "labels": labels,
               "iscrowd": crowd}  # fmt: skip
        return "json", json.dumps(doc).encode()

    def skipped(self, target: Any) -> bool:
        return False


SampleFormat = ClassFormat | MaskFormat | BoxFormat
FORMATS: dict[str, type[SampleFormat]] = {
    "labels": ClassFormat,
    "masks": MaskFormat,
    "boxes": BoxFormat,
}


def format_of(cfg: DataConfig) -> SampleFormat:
    """The format of what ``cfg``'s data option holds."""
    kind = FORMATS.get(type(cfg).holds)
    if kind is None:
        raise ConfigError(
            f"data={cfg.name} holds {type(cfg).holds}: tar shards hold images with classes "
            "(data=shards), masks (data=segshards) or boxes (data=detshards)."
        )
    return kind(cfg)
