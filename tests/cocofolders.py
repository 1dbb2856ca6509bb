"""Small COCO-format detection folders for the tests: coloured squares on grey images of
several sizes, one category per colour."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torchvision.io import write_png

COLOURS = {1: (230, 40, 40), 2: (40, 200, 40)}  # category id -> RGB


def write_coco_folder(root: Path, n_train: int = 24, n_val: int = 13, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        images, anns = [], []
        for i in range(n):
            h, w = (48, 64) if i % 2 else (64, 56)  # two sizes: a batch mixes them
            image = torch.full((3, h, w), 90, dtype=torch.uint8)
            for _ in range(int(torch.randint(0, 3, (), generator=g))):  # some have none
                cat = int(torch.randint(1, 3, (), generator=g))
                s = int(torch.randint(10, 18, (), generator=g))
                x = int(torch.randint(0, w - s, (), generator=g))
                y = int(torch.randint(0, h - s, (), generator=g))
                image[:, y : y + s, x : x + s] = torch.tensor(COLOURS[cat]).view(3, 1, 1)
                anns.append({"id": len(anns) + 1, "image_id": i, "category_id": cat,
                             "bbox": [x, y, s, s], "area": s * s, "iscrowd": 0})  # fmt: skip
            name = f"{split}_{i:03d}.png"
            write_png(image, str(root / "images" / name))
            images.append({"id": i, "file_name": name, "width": w, "height": h})
        doc = {"images": images, "annotations": anns,
               "categories": [{"id": 1, "name": "red"}, {"id": 2, "name": "green"}]}  # fmt: skip
        (root / "annotations" / f"{split}.json").write_text(json.dumps(doc))
    return root
