"""Small detection folders for the tests, COCO's layout or VOC's: coloured squares on grey
images of two sizes (a batch mixes them), one class per colour, some images without boxes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torchvision.io import write_jpeg, write_png

COLOURS = {1: (230, 40, 40), 2: (40, 200, 40)}  # label -> RGB
CLASSES = ["red", "green"]  # labels 1, 2


def scenes(n: int, seed: int) -> list[tuple[torch.Tensor, list[tuple[list[int], int]]]]:
    """``n`` images, each with its squares as ``([x, y, side, side], label)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        h, w = (48, 64) if i % 2 else (64, 56)
        image = torch.full((3, h, w), 90, dtype=torch.uint8)
        boxes = []
        for _ in range(int(torch.randint(0, 3, (), generator=g))):
            label = int(torch.randint(1, 3, (), generator=g))
            s = int(torch.randint(10, 18, (), generator=g))
            x = int(torch.randint(0, w - s, (), generator=g))
            y = int(torch.randint(0, h - s, (), generator=g))
            image[:, y : y + s, x : x + s] = torch.tensor(COLOURS[label]).view(3, 1, 1)
            boxes.append(([x, y, s, s], label))
        out.append((image, boxes))
    return out


def write_coco_folder(root: Path, n_train: int = 24, n_val: int = 13, seed: int = 0) -> Path:
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    for split, n, s in (("train", n_train, seed), ("val", n_val, seed + 1)):
        images, anns = [], []
        for i, (image, boxes) in enumerate(scenes(n, s)):
            for bbox, label in boxes:
                anns.append({"id": len(anns) + 1, "image_id": i, "category_id": label,
                             "bbox": bbox, "area": bbox[2] * bbox[3], "iscrowd": 0})  # fmt: skip
            name = f"{split}_{i:03d}.png"
            write_png(image, str(root / "images" / name))
            images.append({"id": i, "file_name": name, "width": image.shape[2],
                           "height": image.shape[1]})  # fmt: skip
        doc = {"images": images, "annotations": anns,
               "categories": [{"id": k + 1, "name": c} for k, c in enumerate(CLASSES)]}  # fmt: skip
        (root / "annotations" / f"{split}.json").write_text(json.dumps(doc))
    write_odd_formats(root / "images")
    return root


def write_odd_formats(folder: Path) -> None:
    """Three of the images as a 16-bit grey PNG, a palette PNG and an RGBA PNG: what cameras
    and annotation tools write, which every image folder reads as 8-bit RGB."""
    import numpy as np
    from PIL import Image

    def pixels(name: str) -> np.ndarray:
        return np.array(Image.open(folder / name).convert("RGB"))

    grey = pixels("val_001.png").mean(2).astype(np.uint16) * 257
    Image.fromarray(grey).save(folder / "val_001.png")
    Image.fromarray(pixels("train_002.png")).convert("P").save(folder / "train_002.png")
    Image.fromarray(pixels("train_003.png")).convert("RGBA").save(folder / "train_003.png")


def voc_object(bbox: list[int], label: int, difficult: int = 0) -> str:
    """VOC's <object>: pixels counted from 1, both ends included."""
    x, y, w, h = bbox
    return (f"<object><name>{CLASSES[label - 1]}</name><difficult>{difficult}</difficult>"
            f"<bndbox><xmin>{x + 1}</xmin><ymin>{y + 1}</ymin><xmax>{x + w}</xmax>"
            f"<ymax>{y + h}</ymax></bndbox></object>")  # fmt: skip


def write_voc_folder(root: Path, n_train: int = 24, n_val: int = 13, seed: int = 0) -> Path:
    """``root/VOCdevkit/VOC2012`` with JPEG images; returns ``root`` (data.root)."""
    voc = root / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (voc / sub).mkdir(parents=True, exist_ok=True)
    for split, n, s in (("train", n_train, seed), ("val", n_val, seed + 1)):
        ids = []
        for i, (image, boxes) in enumerate(scenes(n, s)):
            key = f"{split}_{i:03d}"
            write_jpeg(image, str(voc / "JPEGImages" / f"{key}.jpg"), quality=95)
            size = (
                f"<width>{image.shape[2]}</width><height>{image.shape[1]}</height><depth>3</depth>"
            )
            objects = "".join(voc_object(b, label) for b, label in boxes)
            (voc / "Annotations" / f"{key}.xml").write_text(
                f"<annotation><filename>{key}.jpg</filename><size>{size}</size>{objects}"
                "</annotation>"
            )
            ids.append(key)
        (voc / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root
