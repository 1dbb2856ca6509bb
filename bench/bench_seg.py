"""The segmentation input-pipeline benchmark: `make bench-seg`.

Images per second of the training input pipeline alone (read, decode, joint random resize,
crop and flip of image and mask, collate, normalise; no model) on a folder of JPEG photographs
with PNG index masks, at each ``data.num_workers``, side by side in one run:
- references: torchvision's segmentation references as they ship (PIL backend): PIL reads the
  image and the mask, RandomResize (shorter side in 0.5-2.0 x base_size), horizontal flip,
  RandomCrop with the mask padded by 255, PILToTensor, ToDtype, Normalize, in the workers,
  drawing from Python's global ``random`` (written here from what the references do);
- train.py: ``data=segfolder`` (decode_image and v2 transforms on uint8 tensors with
  ``tv_tensors.Mask``, seeded per sample, uint8 batches, normalisation after the loader).
The folder (random crops of scikit-image's bundled photographs at VOC's 500x375, quality 90,
with masks of 21 luminance classes and 255 on their borders) is written once under
bench/results/. Writes bench/results/seg.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_data import MEAN, STD, make_folder, rate  # noqa: E402
from devices import bench_device  # noqa: E402

from ddp_utils.config import SegFolderData  # noqa: E402
from ddp_utils.data import build_data  # noqa: E402
from ddp_utils.dist import Runtime  # noqa: E402

CLASSES = 21


def make_seg_folder(photos: Path, root: Path, count: int) -> Path:
    """``root/train/{images,masks}``: the photos with luminance-class masks."""
    from PIL import Image

    done = root / ".complete"
    if done.is_file() and done.read_text() == str(count):
        return root
    files = sorted((photos / "train").rglob("*.jpg"))[:count]
    for split in ("train", "val"):
        for d in ("images", "masks"):
            (root / split / d).mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(files):
        with Image.open(f) as im:
            rgb = im.convert("RGB").resize((500, 375))
        grey = np.asarray(rgb.convert("L"), dtype=np.int64)
        mask = (grey * CLASSES // 256).astype(np.uint8)
        edge = np.zeros_like(mask, dtype=bool)
        edge[1:] |= mask[1:] != mask[:-1]
        edge[:, 1:] |= mask[:, 1:] != mask[:, :-1]
        mask[edge] = 255
        split = "val" if i < 2 else "train"  # evaluation is not measured: two images keep it valid
        rgb.save(root / split / "images" / f"{i:04d}.jpg", quality=90)
        Image.fromarray(mask, mode="L").save(root / split / "masks" / f"{i:04d}.png")
    done.write_text(str(count))
    return root


class ReferenceSegmentation(torch.utils.data.Dataset):
    """The references' training preset with the PIL backend, on (image, mask) files."""

    def __init__(self, root: Path, base: int, crop: int) -> None:
        folder = root / "train" / "images"
        self.images = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".png"))
        self.base, self.crop = base, crop

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        from PIL import Image
        from torchvision.transforms import functional as F

        image = Image.open(self.images[i]).convert("RGB")
        target = Image.open(self.images[i].parent.parent / "masks" / f"{self.images[i].stem}.png")
        size = random.randint(int(0.5 * self.base), int(2.0 * self.base))
        image = F.resize(image, size)
        target = F.resize(target, size, interpolation=F.InterpolationMode.NEAREST)
        if random.random() < 0.5:
            image, target = F.hflip(image), F.hflip(target)
        w, h = image.size
        if min(w, h) < self.crop:  # pad_if_smaller
            pad = [0, 0, max(self.crop - w, 0), max(self.crop - h, 0)]
            image, target = F.pad(image, pad, fill=0), F.pad(target, pad, fill=255)
        w, h = image.size
        top, left = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        image = F.crop(image, top, left, self.crop, self.crop)
        target = F.crop(target, top, left, self.crop, self.crop)
        tensor = F.convert_image_dtype(F.pil_to_tensor(image), torch.float)
        tensor = F.normalize(tensor, MEAN, STD)
        return tensor, torch.as_tensor(np.array(target), dtype=torch.int64)


def reference_loader(root: Path, workers: int, batch: int, base: int, crop: int):
    ds = ReferenceSegmentation(root, base, crop)
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers,
                                       persistent_workers=workers > 0, drop_last=True)  # fmt: skip


def ours_loader(root: Path, workers: int, batch: int, base: int, crop: int, device):
    cfg = SegFolderData(root=str(root), base_size=base, crop_size=crop, image_size=crop,
                        num_classes=CLASSES, batch_size=batch, num_workers=workers,
                        mean=list(MEAN), std=list(STD))  # fmt: skip
    data = build_data(cfg, Runtime(0, 0, 1, 1, device, "gloo"), seed=0)
    return data.train, data.preprocess_train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--images", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--base-size", type=int, default=520)
    parser.add_argument("--crop-size", type=int, default=480)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--device", default=bench_device(), help="both sides' (DEVICE)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "seg.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = ROOT / "bench" / "results"
    # A folder of its own: bench-data's photos/ is regenerated when its per-class count changes.
    photos = make_folder(results / "seg_photos", per_class=max(1, -(-args.images // 7)))
    root = make_seg_folder(photos, results / "segphotos", args.images)
    device = torch.device(args.device)
    rows = []
    sizes = (args.batch_size, args.base_size, args.crop_size)
    for w in args.workers:
        theirs = rate(reference_loader(root, w, *sizes), lambda x: x.to(device), args.epochs)
        loader, preprocess = ours_loader(root, w, *sizes, device)
        ours = rate(loader, lambda x, p=preprocess: p(x.to(device)), args.epochs)
        rows.append({"num_workers": w, "references": theirs, "train.py": ours,
                     "ratio": ours / theirs})  # fmt: skip
    result = {"device": str(device), "images": args.images, "batch_size": args.batch_size,
              "base_size": args.base_size, "crop_size": args.crop_size, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nsegmentation input pipeline, {args.images} JPEGs 500x375 + PNG masks, batch "
          f"{args.batch_size}, resize {args.base_size // 2}-{2 * args.base_size}, crop "
          f"{args.crop_size}, flip, to {device}:\n")  # fmt: skip
    print("| data.num_workers | references (img/s) | train.py (img/s) | train.py / references |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['num_workers']} | {r['references']:.1f} | {r['train.py']:.1f} | "
              f"{r['ratio']:.2f}x |")  # fmt: skip
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
