"""The checkpoint benchmark: `make bench-checkpoint`.

How long a training step is blocked by a save, with ``trainer.checkpoint.async`` false (the
step writes it) and true (the step pays for the copy to host memory; the writing goes on in
the background), to a local folder and to an S3 store (SeaweedFS on 127.0.0.1, started
here), for
- GPT-2 124M (experiment=gpt2_124m's 12 x 768 GPT) under fsdp2 at world size 2: every rank
  writes its shards of the model and the AdamW state (DCP, a sharded folder);
- ResNet-50 under ddp: the main rank writes one whole file.
The state is the model and AdamW's state after one step; each figure is the median of 3
saves, with nothing else in flight. Then the upload alone: the same bytes (ResNet-50's
checkpoint file) uploaded through the checkpoint's storage (s3fs's multipart upload, its
parts side by side) against boto3's ``upload_file`` (what ``aws s3 cp`` does). Writes
bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import save_rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SeaweedFS helper the tests start their store with
REPEATS = 3


def build(model: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, bool]:
    """The model after one AdamW step (so the optimizer holds its moments); sharded or not."""
    if model == "gpt2_124m":
        from ddp_utils.models.gpt import GPT

        net = GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                  dropout=0.0)  # fmt: skip
        x = torch.randint(0, 50304, (1, 16))
    else:
        import torchvision

        net = torchvision.models.resnet50()
        x = torch.randn(2, 3, 64, 64)
    sharded = model == "gpt2_124m"
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    out = net(x)
    (out[0] if isinstance(out, tuple) else out).float().mean().backward()
    opt.step()
    return net, opt, sharded


def state_of(net: torch.nn.Module, opt: torch.optim.Optimizer, sharded: bool, step: int) -> dict:
    if sharded:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        model, optim = get_model_state_dict(net), get_optimizer_state_dict(net, opt)
    else:
        model, optim = net.state_dict(), opt.state_dict()
    return {"model": model, "optimizer": optim, "step": step, "config": {}}


def worker(rank: int, world: int, port: int, model: str, target: str, background: bool,
           env: dict, out: str) -> None:  # fmt: skip
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ddp_utils.checkpoint.save import Checkpointer
    from ddp_utils.config.schema import CheckpointOptions
    from ddp_utils.dist import Runtime

    rt = Runtime(rank, rank, world, world, torch.device("cpu"), "gloo")
    net, opt, sharded = build(model, world)
    options = CheckpointOptions(dir=target, **{"async": background})
    saver = Checkpointer(options, Path(target), rt, keep_last=1)
    blocked, total = [], []
    for i in range(REPEATS):
        state = state_of(net, opt, sharded, i + 1)
        dist.barrier()
        start = time.perf_counter()
        saver.save(state, (), sharded)
        blocked.append(time.perf_counter() - start)
        saver.settle()
        total.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({"blocked_s": statistics.median(blocked),
                                         "total_s": statistics.median(total)}))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def measure(model: str, world: int, target: str, background: bool, env: dict) -> dict:
    from helpers.launch import free_port

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.start_processes(worker, (world, free_port(), model, target, background, env, f.name),
                           nprocs=world, start_method="spawn")  # fmt: skip
        return json.loads(Path(f.name).read_text())


def upload_race(store, env: dict, tmp: Path) -> dict:
    """The same bytes uploaded through the checkpoint storage and through boto3."""
    import boto3
    import torchvision

    from ddp_utils.checkpoint.storage import open_storage

    os.environ.update(env)
    net = torchvision.models.resnet50()
    state = {"model": net.state_dict(), "step": 1, "config": {}}
    local = tmp / "resnet50.pt"
    torch.save(state, local)
    size = local.stat().st_size
    ours, theirs = [], []
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
    for i in range(REPEATS):
        storage = open_storage(f"s3://bench/race{i}")
        start = time.perf_counter()
        storage.upload(local, "step_00000001.pt")
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        client.upload_file(str(local), "bench", f"boto3/{i}.pt")
        theirs.append(time.perf_counter() - start)
    return {"bytes": size, "ours_s": statistics.median(ours), "boto3_s": statistics.median(theirs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    parser.add_argument("--models", default="resnet50,gpt2_124m")
    args = parser.parse_args()
    from seaweed import Seaweed

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        # room for a few GPT-2 checkpoints (1.5 GB each with AdamW's moments)
        store = Seaweed(Path(tmp) / "weed", volumes=64, volume_mb=256).start()
        store.bucket("bench")
        env = store.env()
        try:
            for model in args.models.split(","):
                world = 2 if model == "gpt2_124m" else 1
                for where, target in (("local", f"{tmp}/{model}"), ("S3", f"s3://bench/{model}")):
                    sync = measure(model, world, target, False, env)
                    bg = measure(model, world, target, True, env)
                    rows.append({"model": model, "world_size": world, "to": where,
                                 "sync_blocked_s": sync["blocked_s"],
                                 "async_blocked_s": bg["blocked_s"],
                                 "async_total_s": bg["total_s"]})  # fmt: skip
            race = upload_race(store, env, Path(tmp))
        finally:
            store.stop()
    save_rows(Path(args.out), rows + [race], "| model | world size | to | step blocked, sync | "
              "step blocked, async | async save's whole time | async / sync |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for r in rows:
        print(f"| {r['model']} | {r['world_size']} | {r['to']} | {r['sync_blocked_s']:.2f} s | "
              f"{r['async_blocked_s']:.2f} s | {r['async_total_s']:.2f} s | "
              f"{r['async_blocked_s'] / r['sync_blocked_s']:.0%} |")  # fmt: skip
    mb = race["bytes"] / 2**20
    print(
        f"\n| upload of {mb:.0f} MiB | checkpoint storage | boto3 upload_file | ratio |\n"
        f"| --- | --- | --- | --- |\n| to S3 (SeaweedFS, loopback) | {race['ours_s']:.2f} s "
        f"| {race['boto3_s']:.2f} s | {race['ours_s'] / race['boto3_s']:.2f}x |"
    )


if __name__ == "__main__":
    main()
