"""The peer of `make bench-peer`: torchvision's own classification reference,
``references/classification/train.py`` from a user's checkout of github.com/pytorch/vision
(``--references DIR``: the checkout, its ``references/`` or its ``classification/``), run
with its own presets, transforms and utils, its files untouched.

The reference is written for CUDA. Before its ``main`` runs, this launcher makes the few
changes a CPU run needs, all at the torch level, none in its files:

- ``torch.distributed.init_process_group``: the backend is gloo (it asks for nccl);
- ``torch.cuda.set_device``: skipped (there is no device to select);
- ``DistributedDataParallel``: ``device_ids`` dropped (a CPU model takes none);
- ``torch.tensor(..., device="cuda")``: made on the CPU (its metric sync,
  ``utils.reduce_across_processes``).

Its ``train_one_epoch``, ``evaluate`` and ``MetricLogger.log_every`` are wrapped to print the
``PEER {json}`` stamps bench/peer.py reads (the first step, each epoch's end with its rate
and top-1) on rank 0. Usage, under torchrun:

    peer_reference.py --references DIR [--profile-steps N --profile-out F] -- <train.py args>
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from devices import bench_device  # noqa: I001 - bench/, beside this file

from ddp_utils.dist import shutdown


def reference_folder(root: Path) -> Path:
    """The folder holding the classification reference's train.py under ``root``."""
    for folder in (root / "references" / "classification", root / "classification", root):
        if (folder / "train.py").is_file() and (folder / "presets.py").is_file():
            return folder
    raise SystemExit(
        f"REFERENCES={root}: no references/classification/train.py under it; pass a checkout "
        "of github.com/pytorch/vision (git clone --depth 1 https://github.com/pytorch/vision)."
    )


def run_on_cpu() -> None:
    """The CPU changes listed in the module's docstring, wherever the benchmark's device is
    the CPU (``DEVICE=cpu``, the default), on a host with GPUs too; none with DEVICE=cuda."""
    if bench_device() == "cuda":
        return
    init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        kwargs["backend"] = "gloo"
        return init(*args[1:], **kwargs) if args else init(**kwargs)

    tensor = torch.tensor

    def cpu_tensor(data, *args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return tensor(data, *args, device=device, **kwargs)

    class CpuDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module, device_ids=None, *args, **kwargs):
            super().__init__(module, None, *args, **kwargs)

    dist.init_process_group = init_process_group
    torch.cuda.set_device = lambda device: None
    torch.tensor = cpu_tensor
    torch.nn.parallel.DistributedDataParallel = CpuDDP


def emit(**record) -> None:
    if dist.is_initialized() and dist.get_rank() == 0:
        sys.stdout.write("PEER " + json.dumps(record) + "\n")
        sys.stdout.flush()


def add_stamps(train, utils, prof) -> None:
    """Wrap the reference's epoch, evaluation and step loop to print the PEER stamps."""
    state = {"epoch": 0, "img_s": 0.0, "stepped": False}
    train_one_epoch, evaluate, log_every = (
        train.train_one_epoch,
        train.evaluate,
        utils.MetricLogger.log_every,
    )

    def timed_epoch(model, criterion, optimizer, data_loader, *args, **kwargs):
        start = time.perf_counter()
        out = train_one_epoch(model, criterion, optimizer, data_loader, *args, **kwargs)
        world = dist.get_world_size() if dist.is_initialized() else 1
        state["img_s"] = len(data_loader.sampler) * world / (time.perf_counter() - start)
        return out

    def timed_evaluate(*args, **kwargs):
        top1 = evaluate(*args, **kwargs)
        if not kwargs.get("log_suffix"):  # not its EMA model's evaluation
            emit(event="epoch", epoch=state["epoch"], img_s=state["img_s"], top1=top1 / 100,
                 time=time.time())  # fmt: skip
            state["epoch"] += 1
        return top1

    def stamped(self, iterable, print_freq, header=None):
        training = str(header).startswith("Epoch")
        for obj in log_every(self, iterable, print_freq, header):
            yield obj  # the code below runs once the step on ``obj`` is done
            if training and not state["stepped"]:
                state["stepped"] = True
                emit(event="first_step", time=time.time())
            if training and prof is not None:
                prof.step()

    train.train_one_epoch, train.evaluate = timed_epoch, timed_evaluate
    utils.MetricLogger.log_every = stamped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--references", type=Path, required=True)
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--profile-out", default="profile.txt")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, theirs = p.parse_args(argv[:cut]), argv[cut + 1 :]
    folder = reference_folder(ours.references.expanduser().resolve())
    sys.path.insert(0, str(folder))
    if bench_device() == "cpu":
        run_on_cpu()
    train, utils = importlib.import_module("train"), importlib.import_module("utils")
    args = train.get_args_parser().parse_args(theirs)
    prof = None
    if ours.profile_steps:  # make bench-profile: the same window as ours
        from profile_window import start_profiler

        rank0 = int(os.environ.get("RANK", "0")) == 0
        prof = start_profiler(ours.profile_steps, ours.profile_out, rank0)
    add_stamps(train, utils, prof)
    sys.argv = [str(folder / "train.py"), *theirs]
    train.main(args)
    if prof is not None:
        prof.stop()
    if dist.is_initialized():  # the reference leaves its group to the interpreter's exit,
        # where gloo may abort ("terminate called ..."): every rank finishes, then all leave
        # as train.py's ranks do.
        dist.barrier()
        shutdown()


if __name__ == "__main__":
    main()
