"""``data=detfolder``: a COCO-format folder.

    ROOT/images/...                 the image files (data.images_dir)
    ROOT/annotations/train.json     COCO's {"images", "annotations", "categories"}
    ROOT/annotations/val.json       (data.train_annotations, data.val_annotations)

A box is COCO's ``[x, y, width, height]`` in pixels, read as xyxy. The categories, sorted by
id, are labels 1..K (0 is the background), so ``data.num_classes`` is K + 1 (null: read from
the validation annotations, and the training file's categories checked against it). Images without
boxes are kept; a box with ``iscrowd: 1`` is left out of training and marked for the mAP,
which neither rewards nor punishes detections of it (COCO's rule). Every malformed input stops
before training with the file, the annotation and the fix: a box outside its image or of zero
area, an unknown category or image id, a missing image file, a malformed entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddp_utils.config import ConfigError, DataConfig
from ddp_utils.data.detection.boxes import Annotated, BoxFiles, check_xyxy, fail


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
    width, height = float(image["width"]), float(image["height"])
    return check_xyxy([x, y, x + w, y + h], width, height, path, where, bbox)


def class_count(cfg: DataConfig) -> int:
    """K + 1: the validation file's categories and the background (the smaller file: both
    files are checked against it when read)."""
    path = Path(cfg.root) / cfg.val_annotations
    return len(category_labels(read_json(path), path)[1])


class CocoSource(BoxFiles):
    """One split of a COCO folder."""

    def __init__(self, cfg: DataConfig, split: str) -> None:
        root = Path(cfg.root)
        path = root / (cfg.train_annotations if split == "train" else cfg.val_annotations)
        doc = read_json(path)
        labels, classes = category_labels(doc, path)
        if cfg.num_classes != len(classes):
            val = root / cfg.val_annotations
            raise fail(path, f"has {len(classes) - 1} categories, so data.num_classes="
                       f"{len(classes)} (with the background); it is {cfg.num_classes}",
                       "Give the annotation files the same categories (data.num_classes=null "
                       f"counts those of {val}), or set data.num_classes to match.")  # fmt: skip
        folder = root / cfg.images_dir
        images = self.index_images(doc, path, folder)
        items = {key: Annotated(folder / image["file_name"]) for key, image in images.items()}
        for ann in doc["annotations"]:
            image = images.get(ann.get("image_id"))
            if image is None:
                raise fail(path, f"annotation id {ann.get('id')} names image_id "
                           f"{ann.get('image_id')!r}, which is not in its images",
                           "Add the image or remove the annotation.")  # fmt: skip
            if ann.get("category_id") not in labels:
                raise fail(path, f"annotation id {ann.get('id')} (image {image['file_name']}) "
                           f"has category_id {ann.get('category_id')!r}, not one of its "
                           f"categories {sorted(labels)}",
                           "Fix the id or add the category.")  # fmt: skip
            items[image["id"]].boxes.append((check_box(ann, image, path),
                labels[ann["category_id"]], int(bool(ann.get("iscrowd", 0)))))  # fmt: skip
        super().__init__([items[key] for key in sorted(items)], classes, cfg.in_channels)

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
