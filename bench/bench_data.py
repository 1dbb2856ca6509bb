"""The input-pipeline benchmark: `make bench-data`.

Images per second of the training input pipeline alone (read, decode, augment, collate, to
the device; no model) on an ImageFolder of real photographs as JPEG, at each
``data.num_workers``, side by side in one run:
- classic: torchvision's classification references (ImageFolder + PIL, their training preset
  RandomResizedCrop + flip + PILToTensor + ToDtype + Normalize, DataLoader);
- train.py: ``data=imagefolder`` (decode_image, v2 transforms on uint8 tensors seeded per
  sample, uint8 batches, normalisation on the device);
with the JPEG decode rate of one core (torchvision and PIL) as the ceiling. The folder (random
400x350 crops of scikit-image's bundled photographs, quality 90) is generated once under
bench/results/. Writes bench/results/data.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devices import bench_device  # noqa: E402 - bench/, beside this file

from ddp_utils.config import ImageFolderData  # noqa: E402
from ddp_utils.data import build_data  # noqa: E402
from ddp_utils.dist import Runtime  # noqa: E402

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field",
          "immunohistochemistry", "retina")  # fmt: skip
CROP_W, CROP_H = 400, 350
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_folder(root: Path, per_class: int, seed: int = 0) -> Path:
    """``root/train/<photo>/NNNN.jpg``: random crops of each bundled photograph."""
    import skimage.data
    from PIL import Image

    done = root / "train" / ".complete"
    if done.is_file() and done.read_text() == str(per_class):
        return root
    rng = np.random.default_rng(seed)
    for name in PHOTOS:
        photo = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
        scale = max(1.0, 1.3 * CROP_W / photo.width, 1.3 * CROP_H / photo.height)
        photo = photo.resize((round(photo.width * scale), round(photo.height * scale)))
        folder = root / "train" / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            x = int(rng.integers(0, photo.width - CROP_W + 1))
            y = int(rng.integers(0, photo.height - CROP_H + 1))
            crop = photo.crop((x, y, x + CROP_W, y + CROP_H))
            crop.save(folder / f"{i:04d}.jpg", quality=90)
    (root / "val").mkdir(exist_ok=True)
    for name in PHOTOS:  # evaluation is not measured: one image per class keeps it valid
        (root / "val" / name).mkdir(exist_ok=True)
        first = root / "train" / name / "0000.jpg"
        (root / "val" / name / "0000.jpg").write_bytes(first.read_bytes())
    done.write_text(str(per_class))
    return root


def classic_loader(root: Path, workers: int, batch: int, size: int):
    """The references' ClassificationPresetTrain (PIL backend) with ImageFolder."""
    import torchvision
    from torchvision.transforms import v2 as T

    transform = T.Compose([
        T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip(0.5),
        T.PILToTensor(), T.ToDtype(torch.float, scale=True), T.Normalize(MEAN, STD),
    ])  # fmt: skip
    ds = torchvision.datasets.ImageFolder(str(root / "train"), transform=transform)
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(
        ds, batch_size=batch, sampler=sampler, num_workers=workers,
        persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
    )  # fmt: skip


def ours_loader(root: Path, workers: int, batch: int, size: int, device: torch.device):
    cfg = ImageFolderData(
        root=str(root), in_channels=3, image_size=size, augment=True,
        num_classes=len(PHOTOS), mean=list(MEAN), std=list(STD), batch_size=batch,
        num_workers=workers,
    )  # fmt: skip
    rt = Runtime(0, 0, 1, 1, device, "gloo")
    data = build_data(cfg, rt, seed=0)
    return data.train, data.preprocess_train


def rate(loader, to_device, epochs: int) -> float:
    """Images/s over ``epochs`` passes, not counting the first batch (worker start-up)."""
    n, start = 0, None
    for epoch in range(epochs):
        if hasattr(loader, "sampler") and hasattr(loader.sampler, "sampler"):
            loader.sampler.sampler.set_epoch(epoch)
        for images, _ in loader:
            out = to_device(images)
            if start is None:
                start = time.perf_counter()
                continue
            n += len(out)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def decode_rate(root: Path, count: int = 300) -> dict[str, float]:
    """JPEG decodes per second on one core: torchvision (libjpeg-turbo) and PIL."""
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_image, read_file

    torch.set_num_threads(1)
    files = sorted((root / "train").rglob("*.jpg"))[:count]
    start = time.perf_counter()
    for f in files:
        decode_image(read_file(str(f)), mode=ImageReadMode.RGB)
    tv = len(files) / (time.perf_counter() - start)
    start = time.perf_counter()
    for f in files:
        with Image.open(f) as im:
            im.convert("RGB").load()
    pil = len(files) / (time.perf_counter() - start)
    return {"torchvision.io": tv, "PIL": pil}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--per-class", type=int, default=430, help="images per class (7 classes)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--device", default=bench_device(), help="both sides' (DEVICE)")
    parser.add_argument("--root", type=Path, default=ROOT / "bench" / "results" / "photos")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "data.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = make_folder(args.root, args.per_class)
    device = torch.device(args.device)
    n_files = len(PHOTOS) * args.per_class
    rows = []
    for w in args.workers:
        classic = rate(
            classic_loader(root, w, args.batch_size, args.image_size),
            lambda x: x.to(device, non_blocking=True), args.epochs,
        )  # fmt: skip
        loader, preprocess = ours_loader(root, w, args.batch_size, args.image_size, device)
        ours = rate(loader, lambda x, p=preprocess: p(x.to(device, non_blocking=True)), args.epochs)
        rows.append({"num_workers": w, "classic": classic, "train.py": ours,
                     "ratio": ours / classic})  # fmt: skip
    ceiling = decode_rate(root)
    result = {"device": str(device), "files": n_files, "batch_size": args.batch_size,
              "image_size": args.image_size, "rows": rows, "decode_per_core": ceiling}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\ninput pipeline, {n_files} JPEGs ({CROP_W}x{CROP_H}, q90), batch {args.batch_size}, "
          f"RandomResizedCrop({args.image_size}) + flip, to {device}:\n")  # fmt: skip
    print("| data.num_workers | classic (img/s) | train.py (img/s) | train.py / classic |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['num_workers']} | {r['classic']:,.0f} | {r['train.py']:,.0f} | "
              f"{r['ratio']:.2f}x |")  # fmt: skip
    print(
        f"\nceiling: JPEG decodes per second on one core: torchvision.io "
        f"{ceiling['torchvision.io']:,.0f}, PIL {ceiling['PIL']:,.0f}; written to {args.out}"
    )


if __name__ == "__main__":
    main()
