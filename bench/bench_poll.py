"""`make bench-poll`: what the stop-signal poll costs a training step, at world sizes 2, 8, 16
and 32 on gloo (processes on this machine), a tiny DDP model's steps.

Each world size is one torchrun launch whose ranks run blocks of steps in three modes,
interleaved (none, every, default, none, ...): no poll at all; an all-reduce at every step
(``trainer.stop_poll_s=0``, what every run did before the poll was spaced out); and the
default ``trainer.stop_poll_s``. The cost of a mode is its median step time less the
median without a poll. The table and bench/results/poll.json.

    make bench-poll                      # world sizes 2, 8, 16, 32
    python bench/bench_poll.py --worlds 2 4 --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
MODES = ("none", "every step", "default")


def worker(steps: int, repeats: int) -> None:
    """One rank: blocks of ``steps`` steps per mode, ``repeats`` rounds; rank 0 prints the
    medians (ms a step) as JSON."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    from ddp_utils.config import TrainerConfig
    from ddp_utils.lifecycle.preemption import StopRequest

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 64)
    every = {"none": None, "every step": 0.0, "default": TrainerConfig().stop_poll_s}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    in_poll: dict[str, list[float]] = {m: [] for m in MODES}
    reduces: dict[str, int] = dict.fromkeys(MODES, 0)
    for _ in range(repeats):
        for mode in MODES:
            stop = None if every[mode] is None else StopRequest(timedelta(seconds=60), every[mode])
            dist.barrier()
            start, polling = time.perf_counter(), 0.0
            for _ in range(steps):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if stop is not None:
                    before = time.perf_counter()
                    stop.poll()
                    polling += time.perf_counter() - before
            dist.barrier()
            times[mode].append((time.perf_counter() - start) / steps * 1e3)
            in_poll[mode].append(polling / steps * 1e3)
            if stop is not None:
                reduces[mode] += stop.reduces
                stop.close()
    if dist.get_rank() == 0:
        med = {m: statistics.median(t) for m, t in times.items()}
        polls = {m: statistics.median(t) for m, t in in_poll.items()}
        print("POLL " + json.dumps({"ms_per_step": med, "ms_in_poll_per_step": polls,
                                    "reduces": reduces, "steps": steps * repeats}),
              flush=True)  # fmt: skip
    dist.destroy_process_group()


def measure(world: int, steps: int, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", __file__, "--worker", f"--steps={steps}",
           f"--repeats={repeats}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("POLL ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"world size {world} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(line[5:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 8, 16, 32])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.steps, a.repeats)
    rows = {}
    print(
        "| world size | step, no poll (ms) | every step: in poll / step time added (ms) | "
        "reduces | default: in poll / step time added (ms) | reduces |\n"
        "| --- | --- | --- | --- | --- | --- |"
    )
    for world in a.worlds:
        r = rows[world] = measure(world, a.steps, a.repeats)
        ms, n, inside = r["ms_per_step"], r["reduces"], r["ms_in_poll_per_step"]
        print(f"| {world} | {ms['none']:.3f} | {inside['every step']:.3f} / "
              f"{ms['every step'] - ms['none']:+.3f} | {n['every step']} | "
              f"{inside['default']:.3f} / {ms['default'] - ms['none']:+.3f} | {n['default']} |",
              flush=True)  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "poll.json"
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "cpus": os.cpu_count(), "rows": rows}, indent=1))  # fmt: skip
    print(f"written to {out}")


if __name__ == "__main__":
    main()
