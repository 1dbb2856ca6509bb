"""DDP's gradient communication: `make bench-comm`.

experiment=lm_char at world size 2 (full precision, 300 steps) with each of torch's DDP
communication hooks (``trainer.ddp.comm_hook``): the gradient bytes an optimizer step
all-reduces and tokens/s (the median interval after the first). On one machine over gloo the
all-reduce is cheap beside the compute, so what the hooks save shows in the bytes; the time
they save needs a network slower than the compute (many nodes). Writes
bench/results/comm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench_lm import torchrun

from bench import save_rows

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ["null", "fp16", "bf16", "powersgd"]


def measure(hook: str, steps: int, tmp: Path) -> dict:
    run, probe = tmp / f"run_{hook}", tmp / f"comm_{hook}.json"
    os.environ["PYTHONPATH"] = f"{ROOT / 'bench'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    torchrun(2, "train.py", "experiment=lm_char", f"trainer.ddp.comm_hook={hook}",
             f"trainer.max_steps={steps}", f"trainer.val_every_steps={steps // 3}",
             "trainer.precision=32", "logger=none", "trainer.progress=false", f"run_dir={run}",
             f"callbacks=[{{_target_:comm_probe.CommProbe,path:{probe}}}]")  # fmt: skip
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"hook": hook, **json.loads(probe.read_text()),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]),
            "val_loss": rows[-1]["val/loss"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "comm.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as t:
        rows = [measure(h, args.steps, Path(t)) for h in HOOKS]
    save_rows(args.out, rows, "| comm_hook | gradient KiB a step | x fp32 | tokens/s | "
              "val/loss |\n| --- | --- | --- | --- | --- |")  # fmt: skip
    for r in rows:
        print(
            f"| {r['hook']} | {r['bytes_per_step'] / 1024:,.0f} | {1 / r['rate']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {r['val_loss']:.4f} |"
        )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
