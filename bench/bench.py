"""The speed benchmark: `make bench` (CPU) and `make bench-gpu` (CUDA).

In one run it measures, at each world size, images/s of
- the tutorial's loop in plain PyTorch (PIL + ToTensor per sample, DistributedSampler, DDP),
- train.py's loop in full precision, then with bf16 autocast, torch.compile, and both,
- the raw bound: the same DDP model stepping over batches already in memory,
each the median of 3 runs of one epoch, and each one's model FLOPs utilisation (a second
table); plus the time from launching `python train.py` to its first training step next to
the time to import torch, torchvision and hydra in a bare interpreter. Data:
../shared/data/mnist10k when present (8,000 MNIST training images), else the synthetic set of
the same shape. Writes a JSON file too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devices import bench_device  # bench/, beside this file

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT.parent / "shared" / "data" / "mnist10k"
IMPORTS = "import torch, torchvision, hydra"


def data_overrides() -> tuple[str, list[str]]:
    if (MNIST / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file():
        return "MNIST (8,000 training images)", ["data=mnist", f"data.root={MNIST}"]
    return "synthetic, MNIST-shaped (8,000 images)", ["data=synthetic"]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def bench_result(stdout: str) -> dict:
    """The ``BENCH {json}`` line a benchmark worker prints on rank 0."""
    line = next(x for x in stdout.splitlines() if x.startswith("BENCH "))
    return json.loads(line[len("BENCH ") :])


def interval_medians(run: Path, *keys: str) -> tuple[float, ...]:
    """Medians of ``keys`` over a train.py run's metrics.jsonl records after the first (its
    first validation interval holds start-up and warm-up)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return tuple(statistics.median(r[k] for r in rows[1:]) for k in keys)


def save_rows(path: Path, rows: list[dict], header: str) -> None:
    """A benchmark's rows as JSON at ``path``; then the Markdown table's ``header`` (its
    column names and rule), whose rows the caller prints."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}, indent=2))
    print("\n" + header)


def bare_import_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], check=True, env=env())
    return time.perf_counter() - start


def launch_to_first_step_s(overrides: list[str], device: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "train.py"), *overrides, "trainer.max_steps=1",
               f"trainer.device={device}", f"run_dir={tmp}"]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env()).stdout
    line = next(x for x in out.splitlines() if "first training step done" in x)
    return float(line.split("done ")[1].split(" s")[0])


def loops(world_size: int, overrides: list[str], variants: list[str]) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world_size}", str(ROOT / "bench" / "worker.py"),
           "--overrides", *overrides, "--variants", *variants]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env()).stdout
    result = bench_result(out)
    return {"images_per_s": result["images_per_s"], "mfu": result["mfu"]}


def table(rows: list[dict]) -> str:
    names = list(rows[0]["images_per_s"])
    head = "| world size | " + " | ".join(f"{n} (img/s)" for n in names)
    head += " | train.py / tutorial | train.py / raw bound |"
    lines = [head, "|" + " --- |" * (len(names) + 3)]
    for r in rows:
        ips = r["images_per_s"]
        cells = " | ".join(f"{ips[n]:,.0f}" for n in names)
        lines.append(
            f"| {r['world_size']} | {cells} | {ips['train.py'] / ips['tutorial']:.2f}x "
            f"| {ips['train.py'] / ips['raw bound']:.2f}x |"
        )
    return "\n".join(lines)


def mfu_table(rows: list[dict]) -> str:
    """Each column's model FLOPs utilisation (ddp_utils.flops: the ConvNet's FLOPs a sample
    over the peak of the column's precision; the plain loops are fp32)."""
    names = list(rows[0]["mfu"])
    lines = ["| world size | " + " | ".join(f"{n} (mfu)" for n in names) + " |",
             "|" + " --- |" * (len(names) + 1)]  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{100 * r['mfu'][n]:.1f}%" for n in names)
        lines.append(f"| {r['world_size']} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=bench_device())
    p.add_argument("--world-sizes", type=int, nargs="*", default=None)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<device>.json)")
    args = p.parse_args()
    data_name, data = data_overrides()
    # The train.py row in full precision, like the tutorial; the variants add bf16 autocast
    # (what trainer.precision=auto picks where it is native) and torch.compile.
    overrides = [*data, f"trainer.device={args.device}", "trainer.precision=32"]
    bf16, compiled = "trainer.precision=bf16", "trainer.compile=true"
    variants = [f"train.py bf16={bf16}", f"train.py compile={compiled}",
                f"train.py bf16 compile={bf16},{compiled}"]  # fmt: skip
    world_sizes = args.world_sizes or [1, 2]
    if args.device == "cuda":
        import torch

        world_sizes = args.world_sizes or [1]
        assert torch.cuda.is_available(), "make bench-gpu needs a CUDA device"
    rows = [{"world_size": w, **loops(w, overrides, variants)} for w in world_sizes]
    imports = statistics.median(bare_import_s() for _ in range(3))
    first_step = statistics.median(launch_to_first_step_s(data, args.device) for _ in range(3))
    report = {
        "device": args.device,
        "data": data_name,
        "rows": rows,
        "bare_import_s": imports,
        "launch_to_first_step_s": first_step,
        "launch_overhead": first_step / imports - 1,
    }
    out = Path(args.out or ROOT / "bench" / "results" / f"{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"data: {data_name}; device: {args.device}; medians of 3 runs of one epoch\n")
    print(table(rows))
    print("\n" + mfu_table(rows))
    print(
        f"\nlaunch to first training step (python train.py): {first_step:.2f} s; bare "
        f"`{IMPORTS}`: {imports:.2f} s (+{100 * report['launch_overhead']:.0f}%)\nwritten to {out}"
    )


if __name__ == "__main__":
    main()
