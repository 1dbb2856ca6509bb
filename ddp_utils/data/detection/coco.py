"""``data=detfolder``: a COCO-format folder.

    ROOT/images/...                 the image files (data.images_dir)
    ROOT/annotations/train.json     COCO's {"images", "annotations", "categories"}
    ROOT/annotations/val.json       (data.train_annotations, data.val_annotations)

A box is COCO's ``[x, y, width, height]`` in pixels, read as xyxy. The categories, sorted by
id, are labels 1..K (0 is the background), so ``data.num_classes`` is K + 1. Images without
boxes are kept; a box with ``iscrowd: 1`` is left out of training and marked for the mAP,
which neither rewards nor punishes detections of it (COCO's rule). Every malformed input stops
before training with the file, the annotation and the fix: a box outside its image or of zero
area, an unknown category or image id, a missing image file, a malformed entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_image

from ddp_utils.config import ConfigError, DataConfig

EDGE_SLACK = 1.0  # pixels a box may pass its image's border by (annotation tools round)


def fail(path: Path, what: str, fix: str) -> ConfigError:
    return ConfigError(f"{path}: {what}. {fix}")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: data=detfolder reads COCO annotations there (set "
            "data.root, data.train_annotations and data.val_annotations)."
        )
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise fail(path, f"is not JSON ({e})", "Fix or regenerate the file.") from None
    missing = [
        k for k in ("images", "annotations", "categories") if not isinstance(doc.get(k), list)
    ]
    if missing:
        raise fail(path, f"has no list {', '.join(missing)}", "COCO files hold images, "
                   "annotations and categories (each a list).")  # fmt: skip
    return doc


def category_labels(doc: dict[str, Any], path: Path) -> tuple[dict[int, int], list[str]]:
    """COCO category id -> label 1..K (sorted by id), and the class names (0: background)."""
    try:
        cats = sorted((int(c["id"]), str(c.get("name", c["id"]))) for c in doc["categories"])
    except (KeyError, TypeError, ValueError) as e:
        raise fail(path, f"has a category without an integer id ({e})", "Give each "
                   "category an id and a name.") from None  # fmt: skip
    return {cid: k + 1 for k, (cid, _) in enumerate(cats)}, ["background"] + [n for _, n in cats]


def check_box(ann: dict[str, Any], image: dict[str, Any], path: Path) -> list[float]:
    """The annotation's box as xyxy, or ConfigError naming it."""
    where = f"annotation id {ann.get('id')} (image {image['file_name']})"
    bbox = ann.get("bbox")
    if not (
        isinstance(bbox, list) and len(bbox) == 4 and all(isinstance(v, int | float) for v in bbox)
    ):
        raise fail(path, f"{where} has bbox {bbox!r}", "A bbox is [x, y, width, height].")
    x, y, w, h = (float(v) for v in bbox)
    if w <= 0 or h <= 0:
        raise fail(path, f"{where} has a box of zero area ({bbox})", "Remove the annotation "
                   "or give it a width and height above 0.")  # fmt: skip
    width, height = float(image["width"]), float(image["height"])
    if (
        x < -EDGE_SLACK
        or y < -EDGE_SLACK
        or x + w > width + EDGE_SLACK
        or y + h > height + EDGE_SLACK
    ):
        size = f"{image['width']}x{image['height']}"
        raise fail(path, f"{where} has box {bbox} outside its {size} image",
                   "Clip the box to the image, or fix the image's width and height.")  # fmt: skip
    return [max(x, 0.0), max(y, 0.0), min(x + w, width), min(y + h, height)]


class CocoSource:
    """One split of a COCO folder: ``(uint8 CHW image, {"boxes", "labels", "iscrowd"})``."""

    def __init__(self, cfg: DataConfig, split: str) -> None:
        root = Path(cfg.root)
        path = root / (cfg.train_annotations if split == "train" else cfg.val_annotations)
        doc = read_json(path)
        labels, self.classes = category_labels(doc, path)
        if cfg.num_classes != len(self.classes):
            raise ConfigError(
                f"{path} has {len(self.classes) - 1} categories, so data.num_classes="
                f"{len(self.classes)} (with the background); it is {cfg.num_classes}."
            )
        self.images = self.index_images(doc, path, root / cfg.images_dir)
        boxes: dict[int, list] = {i: [] for i in self.images}
        for ann in doc["annotations"]:
            image = self.images.get(ann.get("image_id"))
            if image is None:
                raise fail(path, f"annotation id {ann.get('id')} names image_id "
                           f"{ann.get('image_id')!r}, which is not in its images",
                           "Add the image or remove the annotation.")  # fmt: skip
            if ann.get("category_id") not in labels:
                raise fail(path, f"annotation id {ann.get('id')} (image {image['file_name']}) "
                           f"has category_id {ann.get('category_id')!r}, not one of its "
                           f"categories {sorted(labels)}",
                           "Fix the id or add the category.")  # fmt: skip
            xyxy = check_box(ann, image, path)
            boxes[image["id"]].append(
                (xyxy, labels[ann["category_id"]], int(bool(ann.get("iscrowd", 0))))
            )
        self.ids = sorted(self.images)
        self.targets = [boxes[i] for i in self.ids]
        self.channels, self.root = cfg.in_channels, root / cfg.images_dir

    @staticmethod
    def index_images(doc: dict[str, Any], path: Path, folder: Path) -> dict[int, dict[str, Any]]:
        images: dict[int, dict[str, Any]] = {}
        for image in doc["images"]:
            try:
                key, name = int(image["id"]), str(image["file_name"])
                int(image["width"]), int(image["height"])
            except (KeyError, TypeError, ValueError) as e:
                raise fail(path, f"image entry {image!r} lacks {e}", "Each image needs id, "
                           "file_name, width and height.") from None  # fmt: skip
            if key in images:
                raise fail(path, f"image id {key} appears twice", "Give each image its own id.")
            if not (folder / name).is_file():
                raise fail(path, f"image id {key} names {folder / name}, which does not exist",
                           "Add the file, fix file_name, or set data.images_dir.")  # fmt: skip
            images[key] = image
        return images

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image = self.images[self.ids[i]]
        mode = ImageReadMode.GRAY if self.channels == 1 else ImageReadMode.RGB
        pixels = decode_image(str(self.root / image["file_name"]), mode=mode)
        entries = self.targets[i]
        boxes = torch.tensor([e[0] for e in entries], dtype=torch.float32).reshape(-1, 4)
        size = (int(pixels.shape[-2]), int(pixels.shape[-1]))
        return pixels, {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=size),
            "labels": torch.tensor([e[1] for e in entries], dtype=torch.int64),
            "iscrowd": torch.tensor([e[2] for e in entries], dtype=torch.int64),
        }
