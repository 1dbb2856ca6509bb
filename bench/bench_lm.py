"""The language-model speed benchmark: `make bench-lm`.

Tokens/s of ``experiment=lm_char`` (4 layers, 4 heads, n_embd 128, block 64, batch 12 per
process) at world sizes 1 and 2: train.py in full precision, with bf16 autocast, and with
torch.compile, against a plain DDP loop over random windows written in the benchmark the
way nanoGPT's README describes its CPU run (bench/lm_loop.py). Data: the pystdlib corpus
(char), its validation split cut to 256 windows so that train.py's validations (every
``--every`` steps: the interval tokens/s excludes them) cost little. train.py's number is
the median interval tokens/s after the first interval (compile and warm-up excluded); the
baseline's is timed after ``--warmup`` steps. Writes bench/results/lm.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from devices import ours_device

# bench/bench.py: bench/ is a folder of scripts
from bench import bench_result, env, interval_medians

ROOT = Path(__file__).resolve().parents[1]


def torchrun(world_size: int, script: str, *args: str) -> str:
    """``script`` under torchrun on DEVICE (bench/devices.py): train.py is given
    ``trainer.device``, a baseline loop reads DEVICE itself."""
    device = ours_device() if script == "train.py" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world_size}", str(ROOT / script), *args, *device]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def corpus(tmp: Path, val_windows: int) -> tuple[Path, int]:
    """data=pystdlib prepared (once, in the cache), copied with a short val.bin."""
    sys.path.insert(0, str(ROOT))
    from ddp_utils.config import PyStdlibData
    from ddp_utils.data.text.pystdlib import prepare_pystdlib

    src = prepare_pystdlib(PyStdlibData())
    dst = tmp / "pystdlib"
    dst.mkdir()
    shutil.copy(src / "train.bin", dst / "train.bin")
    shutil.copy(src / "meta.json", dst / "meta.json")
    val = np.fromfile(src / "val.bin", dtype=np.uint16)[: 64 * val_windows + 1]
    val.tofile(dst / "val.bin")
    return dst, json.loads((src / "meta.json").read_text())["vocab_size"]


def ours(world_size: int, root: Path, extra: list[str], steps: int, every: int,
         tmp: Path) -> tuple[float, float]:  # fmt: skip
    """(tokens/s, mfu): medians over the validation intervals after the first."""
    run = tmp / f"run_{world_size}_{len(list(tmp.glob('run_*')))}"
    torchrun(world_size, "train.py", "experiment=lm_char", "data=tokens", f"data.root={root}",
             "data.global_batch_size=null",
             f"trainer.max_steps={steps}", f"trainer.val_every_steps={every}", f"run_dir={run}",
             "logger=none", "trainer.progress=false", *extra)  # fmt: skip
    return interval_medians(run, "tokens_per_s", "mfu")


def baseline(world_size: int, root: Path, vocab: int, steps: int) -> float:
    out = torchrun(world_size, "bench/lm_loop.py", f"--root={root}", f"--vocab={vocab}",
                   f"--steps={steps}")  # fmt: skip
    return bench_result(out)["tokens_per_s"]


FP32, BF16, COMPILE = "trainer.precision=32", "trainer.precision=bf16", "trainer.compile=true"
VARIANTS = {
    "train.py": [FP32],
    "train.py bf16": [BF16],
    "train.py compile": [FP32, COMPILE],
    "train.py bf16 compile": [BF16, COMPILE],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="*", default=[1, 2])
    p.add_argument("--steps", type=int, default=200, help="train.py's steps per run")
    p.add_argument("--every", type=int, default=40, help="train.py's validation interval")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lm.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        root, vocab = corpus(tmp, val_windows=256)
        for ws in args.world_sizes:
            rates = {"plain DDP loop": baseline(ws, root, vocab, args.steps - args.every)}
            mfu = {}
            for name in args.variants:
                rates[name], mfu[name] = ours(ws, root, VARIANTS[name], args.steps, args.every,
                                              tmp)  # fmt: skip
            rows.append({"world_size": ws, "tokens_per_s": rates, "mfu": mfu})
            print(ws, rates, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2))
    names = list(rows[0]["tokens_per_s"])
    print("\n| world size | " + " | ".join(f"{n} (tokens/s)" for n in names)
          + " | best / plain | mfu of each train.py |")  # fmt: skip
    print("|" + " --- |" * (len(names) + 3))
    for r in rows:
        tps = r["tokens_per_s"]
        best = max(v for k, v in tps.items() if k != "plain DDP loop")
        cells = " | ".join(f"{tps[n]:,.0f}" for n in names)
        mfu = " / ".join(f"{100 * v:.1f}%" for v in r["mfu"].values())
        print(f"| {r['world_size']} | {cells} | {best / tps['plain DDP loop']:.2f}x | {mfu} |")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
