"""The baseline of `make bench-det` (under torchrun): a detection training loop written the way
torchvision's references/detection (train.py, engine.train_one_epoch, utils.reduce_dict) write
theirs, over the same canvases and the same detector as ``experiment=digits_detection``.

Per sample, in the DataLoader: the uint8 canvas to a float image in [0, 1], normalised, the
boxes plain tensors (the reference's ``PILToTensor``, ``ToDtype(scale=True)``,
``ToPureTensor``; normalising here because our small detector's transform only batches).
A ``DistributedSampler``, a ``BatchSampler`` (drop_last) and the collate
``tuple(zip(*batch))``. Each step moves the images and every target dict to the device one by
one, sums the loss dict, all-reduces it for the log (``reduce_dict``), reads ``.item()`` and
checks it is finite, steps SGD (momentum 0.9, weight decay 1e-4) with the first epoch's linear
warm-up, and clips nothing (the reference's default). Prints one JSON line on rank 0:
images/s over ``--steps`` steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler
from torchvision.transforms import v2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devices import clock, join_group  # noqa: E402 - bench/devices.py

from ddp_utils.config import to_schema  # noqa: E402
from ddp_utils.data.detection.canvases import DetCanvasSource  # noqa: E402 - the same data
from ddp_utils.entry import register  # noqa: E402
from ddp_utils.models import build_model  # noqa: E402 - the same detector


class Transformed(Dataset):
    def __init__(self, source, mean: list[float], std: list[float]) -> None:
        self.source = source
        self.transform = v2.Compose(
            [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
        )

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        return self.transform(*self.source[i])


def collate_fn(batch):
    return tuple(zip(*batch, strict=True))


def reduce_dict(losses: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """references/detection/utils.reduce_dict: the losses averaged over the ranks, for the log."""
    with torch.inference_mode():
        names = sorted(losses)
        values = torch.stack([losses[k] for k in names])
        dist.all_reduce(values)
        values /= dist.get_world_size()
        return dict(zip(names, values, strict=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args()
    device = join_group(fixed_input_shapes=False)  # images keep their sizes
    rank, world = dist.get_rank(), dist.get_world_size()
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = to_schema(compose("train", overrides=["experiment=digits_detection"]))
    torch.manual_seed(cfg.seed)
    data = Transformed(DetCanvasSource(cfg.data, "train"), cfg.data.mean, cfg.data.std)
    sampler = DistributedSampler(data)
    batches = BatchSampler(sampler, cfg.data.batch_size, drop_last=True)
    loader = DataLoader(data, batch_sampler=batches, num_workers=args.workers,
                        collate_fn=collate_fn)  # fmt: skip
    model = build_model(cfg.model, cfg.data).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.SGD(params, lr=cfg.optim.lr, momentum=0.9, weight_decay=1e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.001,
                                               total_iters=min(1000, len(loader) - 1))  # fmt: skip
    it, start = 0, 0.0
    model.train()
    for epoch in range(math.ceil((args.warmup + args.steps) / len(loader)) + 1):
        sampler.set_epoch(epoch)
        for images, targets in loader:
            if it == args.warmup:
                dist.barrier()
                start = clock(device)
            if it == args.warmup + args.steps:
                break
            images = list(image.to(device) for image in images)
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())
            loss_value = sum(reduce_dict(loss_dict).values()).item()
            if not math.isfinite(loss_value):
                raise SystemExit(f"Loss is {loss_value}, stopping training")
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
            if epoch == 0:
                warmup.step()
            it += 1
        if it == args.warmup + args.steps:
            break
    elapsed = clock(device) - start
    dist.barrier()
    if rank == 0:
        images_per_s = args.steps * cfg.data.batch_size * world / elapsed
        print("BENCH " + json.dumps({"world_size": world, "images_per_s": images_per_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
