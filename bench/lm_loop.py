"""The baseline of `make bench-lm` (under torchrun): a plain DDP loop over random windows, the
way nanoGPT's README describes its CPU run, written here from that description.

Each step draws ``batch_size`` random offsets into train.bin (a fresh memmap, one
``torch.from_numpy`` per window, stacked), runs the same GPT shape under DDP in full precision
(nanoGPT's CPU setting: no autocast, no compile), clips the gradient norm at 1.0, steps a
non-fused AdamW with the learning rate set by hand every step, and logs ``loss.item()`` every
step (its ``log_interval=1``): one host sync per step. Prints one JSON line on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devices import clock, join_group  # noqa: E402 - bench/devices.py

from ddp_utils.models.gpt import GPT  # noqa: E402 - the same model as train.py's


def get_batch(root: Path, block: int, batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.memmap(root / "train.bin", dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block, (batch,))
    x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    device = join_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1337 + rank)
    block, batch = 64, 12
    gpt = GPT(args.vocab, block, n_layer=4, n_head=4, n_embd=128, dropout=0.0).to(device)
    model = DDP(gpt, device_ids=[device.index] if device.type == "cuda" else None)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    other = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))  # fmt: skip
    start = 0.0
    for it in range(args.warmup + args.steps):
        if it == args.warmup:
            dist.barrier()
            start = clock(device)
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, (it + 1) / 101)
        x, y = get_batch(args.root, block, batch, device)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _ = loss.item()  # the per-iteration log line
    elapsed = clock(device) - start
    dist.barrier()
    if rank == 0:
        tokens = args.steps * batch * block * world
        print("BENCH " + json.dumps({"world_size": world, "tokens_per_s": tokens / elapsed}))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
