"""The peer of `make bench-peer`: a training run the way torchvision's classification
reference (references/classification/train.py) does it, written here from what it does.

ImageFolder with PIL transforms (RandomResizedCrop + flip for training; Resize + CenterCrop
for evaluation), DistributedSampler, DDP, SGD with cross-entropy, a per-batch top-1 and loss
for its logger (a host sync each step), an evaluation whose counts are all-reduced, and a
checkpoint on rank 0 after every epoch. The learning rate follows a cosine over the run's
steps, stepped every iteration, as ours does (the reference steps it once per epoch), so
the two runs train the same schedule. Launched by bench/peer.py under torchrun; prints
``PEER {json}`` lines on rank 0 with wall-clock stamps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def emit(**record) -> None:
    if dist.get_rank() == 0:
        print("PEER " + json.dumps(record), flush=True)


def loaders(args: argparse.Namespace) -> tuple[DataLoader, DataLoader, DistributedSampler]:
    to_float = [T.PILToTensor(), T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)]
    train_tf = T.Compose([T.RandomResizedCrop(args.crop), T.RandomHorizontalFlip(), *to_float])
    val_tf = T.Compose([T.Resize(round(args.crop / 0.875)), T.CenterCrop(args.crop), *to_float])
    train = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val, shuffle=False)  # pads: some images count twice
    kw = dict(batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)
    return (
        DataLoader(train, sampler=sampler, **kw),
        DataLoader(val, sampler=val_sampler, **kw),
        sampler,
    )


def train_one_epoch(model, criterion, optimizer, scheduler, loader, prof) -> tuple[int, float]:
    model.train()
    seen, start = 0, time.perf_counter()
    for image, target in loader:
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        # The reference's MetricLogger: loss.item() and top-1 of every batch.
        _ = loss.item(), (output.argmax(1) == target).float().mean().item()
        seen += len(target)
        if seen == len(target):
            emit(event="first_step", time=time.time())
        if prof is not None:
            prof.step()
    return seen, time.perf_counter() - start


def evaluate(model, criterion, loader) -> float:
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64)  # correct, samples, loss sum
    with torch.inference_mode():
        for image, target in loader:
            output = model(image)
            counts += torch.tensor([(output.argmax(1) == target).sum().item(), len(target),
                                    criterion(output, target).item() * len(target)])  # fmt: skip
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output-dir", required=True)
    for name, kind, default in [("epochs", int, 3), ("batch-size", int, 64), ("workers", int, 1),
                                ("crop", int, 32), ("seed", int, 0), ("num-classes", int, 10),
                                ("lr", float, 0.1), ("momentum", float, 0.9),
                                ("wd", float, 1e-4), ("profile-steps", int, 0),
                                ("profile-out", str, "profile.txt")]:  # fmt: skip
        p.add_argument(f"--{name}", type=kind, default=default)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    train, val, sampler = loaders(args)
    model = DDP(torchvision.models.resnet18(num_classes=args.num_classes))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.wd)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(train))
    prof = None
    if args.profile_steps:  # make bench-profile: the same window as ours
        from profile_window import start_profiler

        prof = start_profiler(args.profile_steps, args.profile_out, dist.get_rank() == 0)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen, elapsed = train_one_epoch(model, criterion, optimizer, scheduler, train, prof)
        rate = torch.tensor([seen / elapsed])
        dist.all_reduce(rate)  # the global rate: every rank's images over its time
        top1 = evaluate(model, criterion, val)
        emit(event="epoch", epoch=epoch, img_s=float(rate), top1=top1, time=time.time())
        if dist.get_rank() == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "lr_scheduler": scheduler.state_dict(), "epoch": epoch}  # fmt: skip
            torch.save(state, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            torch.save(state, os.path.join(args.output_dir, "checkpoint.pth"))
    if prof is not None:
        prof.stop()  # as ours' callback does at the end of training
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
