"""The detection speed benchmark: `make bench-det`.

Images/s of ``experiment=digits_detection`` (the digit canvases, the small FCOS, batch 16 per
process, SGD) at world sizes 1 and 2: train.py in full precision without the recipe's
gradient clipping (the reference's work), and the recipe as it is, against a loop written
the way torchvision's detection reference writes its ``train_one_epoch`` (bench/det_loop.py)
over the same canvases and the same detector, full precision. train.py's number is the
median of its interval images/s after the first interval (warm-up excluded; the interval
rate leaves validation out); the reference loop's is timed over the same number of steps
after a warm-up. The runs alternate and each side's median over ``--repeats`` is reported.
Writes bench/results/det.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_lm import torchrun

from bench import bench_result, interval_medians  # bench/bench.py: bench/ is a folder of scripts

ROOT = Path(__file__).resolve().parents[1]


def ours(world_size: int, extra: list[str], steps: int, every: int,
         tmp: Path) -> tuple[float, float]:  # fmt: skip
    """(images/s, mfu): medians over the validation intervals after the first."""
    run = tmp / f"run_{world_size}_{len(list(tmp.glob('run_*')))}"
    torchrun(world_size, "train.py", "experiment=digits_detection", "data.global_batch_size=null",
             f"trainer.max_steps={steps}",
             f"trainer.val_every_steps={every}", f"run_dir={run}", "logger=none",
             "trainer.progress=false", *extra)  # fmt: skip
    return interval_medians(run, "samples_per_s", "mfu")


def reference(world_size: int, steps: int, warmup: int) -> float:
    out = torchrun(world_size, "bench/det_loop.py", f"--steps={steps}", f"--warmup={warmup}")
    return bench_result(out)["images_per_s"]


# The reference clips nothing: train.py without the recipe's trainer.grad_clip does the same
# work; the recipe as it is (clipping at 10) is shown beside it.
FP32 = "train.py fp32"
VARIANTS = {FP32: ["trainer.precision=32", "trainer.grad_clip=null"], "train.py recipe": []}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="*", default=[1, 2])
    p.add_argument("--steps", type=int, default=300, help="train.py's steps per run")
    p.add_argument("--every", type=int, default=100, help="train.py's validation interval")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "det.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        for ws in args.world_sizes:
            runs: dict[str, list[float]] = {"reference loop": []} | {n: [] for n in VARIANTS}
            mfus: dict[str, list[float]] = {n: [] for n in VARIANTS}
            for _ in range(args.repeats):
                runs["reference loop"].append(reference(ws, args.steps - args.every, args.every))
                for name, extra in VARIANTS.items():
                    rate, mfu = ours(ws, extra, args.steps, args.every, Path(t))
                    runs[name].append(rate)
                    mfus[name].append(mfu)
            rates = {k: statistics.median(v) for k, v in runs.items()}
            mfu = {k: statistics.median(v) for k, v in mfus.items()}
            rows.append({"world_size": ws, "images_per_s": rates, "mfu": mfu, "runs": runs})
            print(ws, runs, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2))
    names = list(rows[0]["images_per_s"])
    print("\n| world size | " + " | ".join(f"{n} (images/s)" for n in names)
          + " | fp32 / reference | mfu of each train.py |")  # fmt: skip
    print("|" + " --- |" * (len(names) + 3))
    for r in rows:
        ips = r["images_per_s"]
        cells = " | ".join(f"{ips[n]:,.0f}" for n in names)
        mfu = " / ".join(f"{100 * v:.1f}%" for v in r["mfu"].values())
        print(f"| {r['world_size']} | {cells} | {ips[FP32] / ips['reference loop']:.2f}x | {mfu} |")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
