"""One benchmark launch (under torchrun): every training loop, several times, at one world size.

Each loop trains the tutorial's ConvNet for one epoch over the same samples, batch 100 per
process, SGD, under DDP. Started by bench/bench.py; prints one JSON line on rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from hydra import compose, initialize_config_dir
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddp_utils.config import channels_last_on, to_schema  # noqa: E402
from ddp_utils.data import load_split  # noqa: E402
from ddp_utils.dist import init_distributed  # noqa: E402
from ddp_utils.entry import register  # noqa: E402
from ddp_utils.models import memory_format_of  # noqa: E402
from ddp_utils.models.nets import ConvNet  # noqa: E402
from ddp_utils.train.callbacks import build_callbacks  # noqa: E402
from ddp_utils.train.loop import train_one_epoch  # noqa: E402
from ddp_utils.train.state import build_training, resolve_auto  # noqa: E402


class PILDigits(Dataset):
    """The tutorial's per-sample path: a PIL image, then ToTensor and Normalize."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float):
        self.images, self.labels = images, labels
        self.transform = torchvision.transforms.Compose(
            [torchvision.transforms.ToTensor(), torchvision.transforms.Normalize((mean,), (std,))]
        )
        from PIL import Image

        self.to_pil = lambda x: Image.fromarray(x.numpy(), mode="L")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(self.to_pil(self.images[i, 0])), int(self.labels[i])


def timed(fn, rt) -> float:
    """Seconds for ``fn`` on the slowest rank."""
    dist.barrier()
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    # On the group's device: NCCL has no backend for host tensors.
    elapsed = torch.tensor([time.perf_counter() - start], device=rt.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def convnet(cfg, rt, channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = ConvNet(1, cfg.data.image_size, cfg.data.num_classes, [16, 32])
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(rt.device, memory_format=fmt)
    return DDP(model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)


def tutorial_loop(cfg, rt, ds):
    """The tutorial, in plain PyTorch: PIL + ToTensor per sample, DistributedSampler, DDP."""
    pil = PILDigits(ds.images, ds.labels, cfg.data.mean[0], cfg.data.std[0])
    sampler = DistributedSampler(pil, rt.world_size, rt.rank, shuffle=True)
    pin = rt.device.type == "cuda"
    loader = DataLoader(pil, batch_size=100, sampler=sampler, num_workers=0, pin_memory=pin)
    model = convnet(cfg, rt, channels_last=False)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    epoch = [0]

    def run():
        sampler.set_epoch(epoch[0])
        epoch[0] += 1
        for images, labels in loader:
            images, labels = images.to(rt.device), labels.to(rt.device)
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return run


def train_py_loop(cfg, rt, run_dir, opened: list):
    """train.py's own epoch loop with its defaults."""
    tr = build_training(resolve_auto(cfg, rt), rt, run_dir, build_callbacks(cfg.callbacks))
    opened.append(tr)

    def run():
        train_one_epoch(tr)
        tr.epoch, tr.sample_offset = tr.epoch + 1, 0

    return run


def raw_loop(cfg, rt, ds):
    """The bound: the same DDP model stepping over normalised batches already in memory."""
    sampler = DistributedSampler(range(len(ds)), rt.world_size, rt.rank, shuffle=True)
    idx = torch.tensor(list(sampler))
    fmt = memory_format_of(cfg.trainer.channels_last)
    x = (ds.images[idx].float() / 255 - cfg.data.mean[0]) / cfg.data.std[0]
    batches = [
        (xb.to(rt.device).contiguous(memory_format=fmt), yb.to(rt.device))
        for xb, yb in zip(x.split(100), ds.labels[idx].split(100), strict=True)
    ]
    model = convnet(cfg, rt, channels_last=channels_last_on(cfg.trainer.channels_last))
    opt = torch.optim.SGD(
        model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum, foreach=True
    )

    def run():
        for images, labels in batches:
            loss = F.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--overrides", nargs="*", default=[])
    p.add_argument("--variants", nargs="*", default=[])  # name=override,override for train.py
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = to_schema(compose(config_name="train", overrides=args.overrides))
    rt = init_distributed(cfg.trainer)
    cfg = resolve_auto(cfg, rt)  # the raw bound runs in the memory format train.py picks
    ds = load_split(cfg.data, "train")
    loops = {
        "tutorial": tutorial_loop(cfg, rt, ds),
        "raw bound": raw_loop(cfg, rt, ds),
    }
    opened: list = []  # train.py's runs, closed at the end
    with tempfile.TemporaryDirectory() as tmp:
        loops["train.py"] = train_py_loop(cfg, rt, Path(tmp) / "main", opened)
        # Each loop's MFU terms: train.py's own; the fp32 model's for the plain loops.
        usage = dict.fromkeys(loops, opened[-1].utilisation)
        for variant in args.variants:
            name, _, extra = variant.partition("=")
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
                vcfg = to_schema(compose("train", overrides=args.overrides + extra.split(",")))
            loops[name] = train_py_loop(vcfg, rt, Path(tmp) / name, opened)
            usage[name] = opened[-1].utilisation
        for run in loops.values():
            run()  # warm-up: allocator, autotuning, compilation
        times: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(args.repeats):
            for name, run in loops.items():
                times[name].append(timed(run, rt))
        for tr in opened:
            tr.close()
    if rt.is_main:
        n = len(ds)
        result = {name: n / statistics.median(t) for name, t in times.items()}
        mfu = {name: usage[name].of(ips) for name, ips in result.items()}
        print("BENCH " + json.dumps({"world_size": rt.world_size, "images_per_s": result,
                                     "mfu": mfu}))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
