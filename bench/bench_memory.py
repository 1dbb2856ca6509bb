"""The memory benchmark: `make bench-memory`.

Per rank: the bytes of parameters + gradients + optimizer state (AdamW: two moments) that the
rank holds, its peak memory (resident on a CPU, allocated on a GPU: DEVICE=cuda), and the
median step time, for trainer.strategy=ddp against fsdp2 at world size 2, each also with
trainer.activation_checkpointing, and at world size 4 ddp, fsdp2 and HSDP on a 2x2 mesh
(trainer.fsdp.replicate=2: shards over 2 ranks, 2 replicas), on the
GPT recipes: experiment=lm_char (its shape, on random tokens) and experiment=gpt2_124m's
12 x 768 GPT (124M parameters) for a few steps, one window a step, of 128 tokens and of its
full 1024 (where the activations weigh; on a CPU its batch of 12 windows would take minutes a
step). Full precision, no compile. Writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from pathlib import Path

import numpy as np
from bench_lm import torchrun

from bench import save_rows

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ["experiment=gpt2_124m", "data.batch_size=1", "data.global_batch_size=null",
        "data.eval_batch_size=1",
        "trainer.grad_accum_steps=1"]  # fmt: skip
# recipe -> (its vocabulary, its overrides)
RECIPES = {
    "lm_char": (128, ["experiment=lm_char", "trainer.max_steps=30"]),
    "gpt2_124m": (50304, [*GPT2, "data.block_size=128", "trainer.max_steps=4"]),
    "gpt2_124m x 1024": (50304, [*GPT2, "data.block_size=1024", "trainer.max_steps=3"]),
}
# variant -> (world size, its overrides); each is compared with ddp at its world size
VARIANTS = {
    "ddp": (2, ["trainer.strategy=ddp"]),
    "fsdp2": (2, ["trainer.strategy=fsdp2"]),
    "ddp + AC": (2, ["trainer.strategy=ddp", "trainer.activation_checkpointing=true"]),
    "fsdp2 + AC": (2, ["trainer.strategy=fsdp2", "trainer.activation_checkpointing=true"]),
    "ddp, 4 ranks": (4, ["trainer.strategy=ddp"]),
    "fsdp2, 4 ranks": (4, ["trainer.strategy=fsdp2"]),
    "hsdp 2x2, 4 ranks": (4, ["trainer.strategy=fsdp2", "trainer.fsdp.replicate=2"]),
}


def token_folder(root: Path, vocab: int) -> Path:
    """Random ids: what is measured does not depend on the text."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    rng.integers(0, vocab, 200_000, dtype=np.uint16).tofile(root / "train.bin")
    rng.integers(0, vocab, 4 * 1024 + 1, dtype=np.uint16).tofile(root / "val.bin")
    return root


def measure(recipe: str, variant: str, tmp: Path) -> dict:
    run = tmp / re.sub(r"[^A-Za-z0-9]+", "_", f"{recipe}-{variant}")  # a path an override takes
    probe = tmp / "probe" / run.name
    os.environ["PYTHONPATH"] = f"{ROOT / 'bench'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    vocab, overrides = RECIPES[recipe]
    world, strategy = VARIANTS[variant]
    data = token_folder(tmp / f"tokens{vocab}", vocab)
    torchrun(world, "train.py", *overrides, *strategy, "data=tokens",
             f"data.root={data}", f"data.vocab_size={vocab}", "trainer.precision=32",
             "trainer.compile=false", "trainer.val_every_steps=1000000", "logger=none",
             "trainer.progress=false", f"run_dir={run}",
             f"callbacks=[{{_target_:memory_probe.MemoryProbe,folder:{probe}}}]")  # fmt: skip
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in range(world)]
    state = max(sum(r["state_bytes"].values()) for r in ranks)
    peaks = [r["peak_bytes"] / 2**20 for r in ranks]
    return {"world_size": world, "state_MiB": state / 2**20, "peak_MiB": max(peaks),
            "peak_rank_MiB": peaks, "peak_kind": ranks[0]["peak_kind"],
            "step_s": statistics.median(r["step_s"] for r in ranks)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="*", default=list(RECIPES))
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        for recipe in args.recipes:
            for variant in args.variants:
                rows.append({"recipe": recipe, "strategy": variant,
                             **measure(recipe, variant, Path(t))})  # fmt: skip
                print(rows[-1], flush=True)
    header = ("| recipe | strategy | params + grads + optimizer a rank (MiB) | x ddp | "
              f"peak {rows[0]['peak_kind']} of each rank (MiB) | step (s) |\n"
              "| --- | --- | --- | --- | --- | --- |")  # fmt: skip
    save_rows(args.out, rows, header)
    for r in rows:
        base = next((b for b in rows if b["recipe"] == r["recipe"] and b["world_size"] ==
                     r["world_size"] and b["strategy"].startswith("ddp") and "AC" not in
                     b["strategy"]), r)  # fmt: skip
        print(
            f"| {r['recipe']} | {r['strategy']} | {r['state_MiB']:,.1f} | "
            f"{r['state_MiB'] / base['state_MiB']:.2f} | "
            f"{' / '.join(f'{m:,.0f}' for m in r['peak_rank_MiB'])} | "
            f"{r['step_s']:.3f} |"
        )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
