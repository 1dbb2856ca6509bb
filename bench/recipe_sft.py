"""The fine-tuning recipe's range: `make recipe-sft`.

The synthetic task of tests/test_sft_e2e.py: a tiny Llama pretrained here to copy a word
(tests/sft_data.py's ``pretrained_folder``) is fine-tuned with ``experiment=sft`` at world
size 2 to shift each letter ("abcd" -> "bcde"), fully (lr 3e-3) and with LoRA (r 8,
lr 1e-2), 120 steps of 32 records. One records file of 1,100 is split by
``data.split_seed=0,1,2`` (a tenth held out), with ``seed=0,1,2``: one torchrun sweep a mode.
Per run: the greedy exact-match accuracy on its own held-out records and on 100 words drawn
from another seed, which no split saw. Writes bench/results/recipe_sft.json and prints the
range.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
MODES = {
    "full": ["optim.lr=3e-3"],
    "LoRA r 8": ["model.lora.r=8", "optim.lr=1e-2"],
}


def main() -> None:
    from sft_data import exact_match, pretrained_folder, shift_records, write_jsonl

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--splits", default="0,1,2")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "recipe_sft.json")
    args = p.parse_args()
    unseen = shift_records(100, seed=99)
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        base = pretrained_folder(tmp / "base")
        records = write_jsonl(tmp / "records.jsonl", shift_records(1100, 0))
        for mode, overrides in MODES.items():
            sweep = tmp / mode.replace(" ", "_")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=2", str(ROOT / "train.py"), "-m", "experiment=sft",
                   f"model.pretrained={base}", f"data.root={records}", "data.val_fraction=0.1",
                   f"data.split_seed={args.splits}", f"seed={args.seeds}",
                   "data.global_batch_size=32", "data.batch_size=16", "trainer.max_steps=120",
                   "trainer.val_every_steps=120", "sched.warmup_steps=10", "logger=none",
                   "trainer.progress=false", f"hydra.sweep.dir={sweep}", *overrides]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
            for run in sorted(p for p in sweep.iterdir() if (p / "checkpoints").is_dir()):
                logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
                held = held_out(records, split_seed_of(run))
                last = run / "checkpoints" / "last.pt"
                rows.append({"mode": mode, "run": run.name, "split_seed": split_seed_of(run),
                             "val_loss": logged.get("val/loss"),
                             "held_out_exact_match": exact_match(last, held),
                             "unseen_exact_match": exact_match(last, unseen)})  # fmt: skip
                print(rows[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2))
    print("\n| mode | held-out records (9 runs) | 100 unseen words (9 runs) | val/loss |")
    print("| --- | --- | --- | --- |")
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        held = [r["held_out_exact_match"] for r in mine]
        new = [r["unseen_exact_match"] for r in mine]
        loss = [r["val_loss"] for r in mine]
        print(f"| {mode} | {min(held):.2f}-{max(held):.2f} | {min(new):.2f}-{max(new):.2f} | "
              f"{min(loss):.4f}-{max(loss):.4f} |")  # fmt: skip
    print(f"written to {args.out}")


def split_seed_of(run: Path) -> int:
    """The run's data.split_seed, from the config it saved."""
    import yaml

    config = yaml.safe_load((run / "config.yaml").read_text())
    return int(config["data"]["split_seed"])


def held_out(records: Path, split_seed: int) -> list[dict]:
    """The records data=sft held out under ``split_seed`` (its own rule: a permutation of
    that seed, the first tenth)."""
    import numpy as np

    rows = [json.loads(line) for line in records.read_text().splitlines()]
    order = np.random.default_rng(split_seed).permutation(len(rows))
    return [rows[i] for i in sorted(order[: round(len(rows) * 0.1)].tolist())]


if __name__ == "__main__":
    main()
