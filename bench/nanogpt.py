"""`make bench-nanogpt NANOGPT=DIR`: whole runs of nanoGPT's own train.py (from a checkout of
github:karpathy/nanoGPT at DIR, never copied here) against `experiment=lm_char`, on the same
characters in the same shape, one process each, interleaved (ours, theirs, ...).

nanoGPT runs its README's CPU command on tiny Shakespeare (`config/train_shakespeare_char.py
--device=cpu --compile=False --eval_iters=20 --block_size=64 --batch_size=12 --n_layer=4
--n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`, with
`--dtype` the precision ours ran in on CUDA (float32 on a CPU, where nanoGPT's autocast does
nothing), plus `--always_save_checkpoint=True` so that its final model is on disk and
an `out_dir` of the benchmark's), from a work folder that links its scripts and holds our
`prepare_text` output as `data/shakespeare_char` (byte-identical to its `prepare.py`'s).
Ours: `train.py experiment=lm_char data=tokens` on that folder, with our defaults. Each run
is timed from launch to exit; both final models are scored exactly on every non-overlapping
64-character window of val.bin (ours: its last validation, which covers them all; theirs:
its ckpt.pt through its own model.py, on the same windows). Medians over ``--pairs``; the
table and bench/results/nanogpt.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devices import bench_device, ours_device  # bench/, beside this file

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "tiny_shakespeare" / "input.txt"
RESULTS = ROOT / "bench" / "results"
BLOCK = 64
THEIR_ARGS = ["config/train_shakespeare_char.py", f"--device={bench_device()}", "--compile=False",
              "--eval_iters=20", f"--block_size={BLOCK}", "--batch_size=12", "--n_layer=4",
              "--n_head=4", "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000",
              "--dropout=0.0", "--always_save_checkpoint=True"]  # fmt: skip
# nanoGPT's --dtype for ours' precision: on CUDA the same autocast dtype, like with like; on a
# CPU nanoGPT's autocast context is a no-op, so it runs float32 whatever it is given.
THEIR_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "32": "float32"}


def their_dtype(ours: str | None) -> str:
    return THEIR_DTYPE.get(ours or "32", "float32") if bench_device() == "cuda" else "float32"


NEEDED = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")


def workdir(nanogpt: Path, prepared: Path, tmp: Path) -> Path:
    """nanoGPT reads ``configurator.py``, ``config/`` and ``data/<dataset>`` from its working
    folder: links to the user's checkout, and our prepared characters as its dataset."""
    missing = [n for n in NEEDED if not (nanogpt / n).is_file()]
    if missing:
        raise SystemExit(f"NANOGPT={nanogpt} is not a nanoGPT checkout (no {', '.join(missing)}):"
                         " git clone github.com/karpathy/nanoGPT and pass its folder.")  # fmt: skip
    work = tmp / "nanogpt"
    (work / "data").mkdir(parents=True)
    for name in ("train.py", "model.py", "configurator.py", "config"):
        (work / name).symlink_to(nanogpt / name)
    (work / "data" / "shakespeare_char").symlink_to(prepared)
    return work


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return took


def score_theirs(nanogpt: Path, ckpt: Path, val: Path) -> float:
    """Mean cross-entropy of nanoGPT's saved model on every window of ``val`` (its model.py)."""
    code = f"""
import sys, numpy as np, torch
sys.path.insert(0, {str(nanogpt)!r})
from model import GPT, GPTConfig
ck = torch.load({str(ckpt)!r}, map_location="cpu", weights_only=False)
m = GPT(GPTConfig(**ck["model_args"]))
m.load_state_dict({{k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()}})
m.eval()
ids = torch.from_numpy(np.fromfile({str(val)!r}, dtype=np.uint16).astype(np.int64))
n = (len(ids) - 1) // {BLOCK}
total = 0.0
with torch.no_grad():
    for s in range(0, n, 256):
        k = torch.arange(s, min(n, s + 256)) * {BLOCK}
        x = torch.stack([ids[i : i + {BLOCK}] for i in k])
        y = torch.stack([ids[i + 1 : i + {BLOCK} + 1] for i in k])
        _, loss = m(x, y)
        total += loss.item() * y.numel()
print(total / (n * {BLOCK}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a checkout of nanoGPT")
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("ours_args", nargs="*", help="extra overrides for train.py")
    args = p.parse_args()
    if not args.text.is_file():
        raise SystemExit(f"{args.text}: no such file (tiny Shakespeare's input.txt)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    walls: dict[str, list[float]] = {"nanoGPT": [], "train.py": []}
    losses: dict[str, list[float]] = {"nanoGPT": [], "train.py": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        prepared = tmp / "shakespeare_char"
        subprocess.run([sys.executable, "-m", "ddp_utils.prepare_text", str(prepared),
                        str(args.text)], check=True, cwd=ROOT)  # fmt: skip
        work = workdir(args.nanogpt.resolve(), prepared, tmp)
        for i in range(args.pairs):
            run = tmp / f"ours{i}"
            ours = [sys.executable, str(ROOT / "train.py"), "experiment=lm_char", "data=tokens",
                    "data.global_batch_size=null", f"data.root={prepared}", f"run_dir={run}",
                    "logger=none", "trainer.progress=false", *ours_device(),
                    *args.ours_args]  # fmt: skip
            walls["train.py"].append(timed(ours, ROOT, env))
            last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
            losses["train.py"].append(last["val/loss"])
            found = re.search(r"\| precision (\S+) \|", (run / "train.log").read_text())
            precision = {"train.py": found.group(1) if found else None}
            precision["nanoGPT"] = their_dtype(precision["train.py"])
            out = tmp / f"theirs{i}"
            theirs = [sys.executable, "train.py", *THEIR_ARGS, f"--dtype={precision['nanoGPT']}",
                      f"--out_dir={out}"]  # fmt: skip
            walls["nanoGPT"].append(timed(theirs, work, env))
            losses["nanoGPT"].append(score_theirs(args.nanogpt.resolve(), out / "ckpt.pt",
                                                  prepared / "val.bin"))  # fmt: skip
            print(
                f"pair {i}: train.py {walls['train.py'][-1]:.1f} s (val/loss "
                f"{losses['train.py'][-1]:.4f}), nanoGPT {walls['nanoGPT'][-1]:.1f} s "
                f"(val/loss {losses['nanoGPT'][-1]:.4f})",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in walls.items()}
    loss = {k: statistics.median(v) for k, v in losses.items()}
    print(
        "| side | precision | wall s (median) | every run | val/loss (median, exact on val.bin) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for side in walls:
        runs = ", ".join(f"{w:.1f}" for w in walls[side])
        print(f"| {side} | {precision[side]} | {med[side]:.1f} | {runs} | {loss[side]:.4f} |")
    print(
        f"train.py / nanoGPT wall: {med['train.py'] / med['nanoGPT']:.2f}x; val/loss "
        f"difference {loss['train.py'] - loss['nanoGPT']:+.4f}"
    )
    if THEIR_DTYPE.get(precision["train.py"] or "32") != precision["nanoGPT"]:
        print("not like with like: nanoGPT runs float32 on a CPU; add trainer.precision=32 to "
              "compare ours in the same precision")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "nanogpt.json").write_text(json.dumps(
        {"machine": platform.processor() or platform.machine(), "walls_s": walls,
         "val_loss": losses, "median_wall_s": med, "median_val_loss": loss,
         "precision": precision}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
