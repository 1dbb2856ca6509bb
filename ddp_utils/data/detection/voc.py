"""``data=voc_det``: Pascal VOC's detection layout, read where it lies (never downloaded).

    ROOT/VOCdevkit/VOC<year>/ImageSets/Main/<set>.txt   one image id a line (data.train_set,
    ROOT/VOCdevkit/VOC<year>/Annotations/<id>.xml        data.val_set)
    ROOT/VOCdevkit/VOC<year>/JPEGImages/<id>.jpg

torchvision's ``VOCDetection`` lists the files and parses the XML. VOC's ``<bndbox>`` counts
pixels from 1, both ends included, so a box is ``xmin - 1, ymin - 1, xmax, ymax`` in xyxy from
0 (as detectron2 reads it). A ``<difficult>1</difficult>`` object is kept as a crowd box: left
out of training, neither a hit nor a miss for the mAP (VOC's own rule);
``data.keep_difficult=false`` drops it. The classes are ``data.classes`` in order, labels
1..K: VOC's 20 by default, a labelImg folder's own names otherwise. Every malformed file stops
before training with the file, the object and the fix.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from PIL import Image
from torchvision.datasets import VOCDetection

from ddp_utils.config import VOCDetData
from ddp_utils.data.detection.boxes import Annotated, BoxFiles, check_xyxy, fail
from ddp_utils.data.images.voc import open_voc

CORNERS = ("xmin", "ymin", "xmax", "ymax")


def read_annotation(xml: Path) -> dict[str, Any]:
    if not xml.is_file():
        raise fail(xml, "does not exist, but its image set lists it", "Add the annotation "
                   "or remove the image's id from ImageSets/Main.")  # fmt: skip
    try:
        return VOCDetection.parse_voc_xml(ET.parse(xml).getroot())["annotation"]
    except ET.ParseError as e:
        raise fail(xml, f"is not XML ({e})", "Fix or regenerate the file.") from None
    except KeyError:
        raise fail(xml, "has no <annotation> root", "VOC's files are <annotation> "
                   "elements.") from None  # fmt: skip


def image_size(ann: dict[str, Any], image: Path) -> tuple[float, float]:
    """``<size>``'s width and height, or the image header's where the file has none."""
    size = ann.get("size") if isinstance(ann.get("size"), dict) else {}
    try:
        width, height = float(size["width"]), float(size["height"])
        if width > 0 and height > 0:
            return width, height
    except (KeyError, TypeError, ValueError):
        pass
    with Image.open(image) as im:
        return float(im.width), float(im.height)


def read_object(
    obj: Any, k: int, xml: Path, size: tuple[float, float], labels: dict[str, int]
) -> tuple[list[float], int, int]:
    name = obj.get("name") if isinstance(obj, dict) else None
    where = f"object {k} ({name})"
    if name not in labels:
        raise fail(xml, f"object {k} has class {name!r}, not one of data.classes "
                   f"{list(labels)}", "Fix the name, or add the class to data.classes and "
                   "raise data.num_classes.")  # fmt: skip
    box = obj.get("bndbox")
    try:
        xmin, ymin, xmax, ymax = (float(box[c]) for c in CORNERS)
    except (KeyError, TypeError, ValueError):
        raise fail(xml, f"{where} has bndbox {box!r}", "A bndbox holds numbers xmin, ymin, "
                   "xmax and ymax.") from None  # fmt: skip
    shown = [box[c] for c in CORNERS]
    xyxy = check_xyxy([xmin - 1, ymin - 1, xmax, ymax], *size, xml, where, shown)
    return xyxy, labels[name], int(str(obj.get("difficult", "0")).strip() == "1")


def read_image(image: Path, xml: Path, labels: dict[str, int], keep_difficult: bool) -> Annotated:
    ann = read_annotation(xml)
    if not image.is_file():
        raise fail(xml, f"annotates {image}, which does not exist", "Add the image or "
                   "remove its id from ImageSets/Main.")  # fmt: skip
    size = image_size(ann, image)
    objects = ann.get("object") or []
    boxes = [read_object(obj, k + 1, xml, size, labels) for k, obj in enumerate(objects)]
    return Annotated(image, [b for b in boxes if keep_difficult or not b[2]])


class VOCSource(BoxFiles):
    """One image set of a VOC folder."""

    def __init__(self, cfg: VOCDetData, split: str) -> None:
        image_set = cfg.train_set if split == "train" else cfg.val_set
        contents = f"JPEGImages, Annotations, ImageSets/Main/{image_set}.txt"
        voc = open_voc(VOCDetection, cfg, image_set, contents)
        labels = {name: k + 1 for k, name in enumerate(cfg.classes)}
        items = [read_image(Path(image), Path(xml), labels, cfg.keep_difficult)
                 for image, xml in zip(voc.images, voc.annotations, strict=True)]  # fmt: skip
        super().__init__(items, ["background", *cfg.classes], cfg.in_channels)
