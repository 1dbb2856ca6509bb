"""The published recipes measured on data they were not tuned on: `make recipes`.

Each recipe trains at world size 2 on 3 disjoint held-out validation slices
(``data.val_slice=0,1,2``: the rest of the images are the training set) and on the data set's
own split (``null``; ``--splits``) with 3 seeds, at the
default learning rate and at half and twice it, one torchrun sweep per (recipe, lr), and the
table gives min / mean / max of the final ``val/accuracy`` (``val/miou`` for the segmentation
recipes and ``val/map`` for the detection one, at their own learning rate only, with
``--seg-seeds`` seeds: each run is minutes;
``val/loss`` of the language model on the last tenth of the stdlib corpus, over
``--lm-seeds`` seeds at its own learning rate).
``--only TEXT`` runs the recipes whose name holds TEXT. MNIST rows need the images of
../shared/data/mnist10k (8,000 + 2,000 pooled into 10,000; slices of 2,000). Writes
bench/results/recipes.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT.parent / "shared" / "data" / "mnist10k"
DEFAULT_LR = 0.1
SEG_LR = 0.1  # experiment=digits_segmentation's
RECIPES = {
    "digits (default, 10 epochs)": [],
    "digits segmentation (experiment=digits_segmentation, 24 epochs)": [
        "experiment=digits_segmentation",
    ],
    "MNIST segmentation (experiment=mnist_segmentation, 12 epochs)": [
        "experiment=mnist_segmentation", f"data.root={MNIST}",
    ],
    "MNIST (data=mnist, 10 epochs)": ["data=mnist", f"data.root={MNIST}"],
    "MNIST tutorial (experiment=mnist_convnet, 2 epochs)": [
        "experiment=mnist_convnet", f"data.root={MNIST}",
    ],
    "digits detection (experiment=digits_detection, 12 epochs)": [
        "experiment=digits_detection",
    ],
    "char GPT on the Python stdlib (experiment=lm_char data=pystdlib, 2000 steps)": [
        "experiment=lm_char", "data=pystdlib",
    ],
}  # fmt: skip
LM_LR = 0.001  # experiment=lm_char's
# The held-out slices 0, 1, 2 of the pooled images, and the data set's own split (null: MNIST's
# official 8,000 / 2,000, the digits' default cut), none of which a choice was tuned on but
# slice 0.
SPLITS = "0,1,2,null"
DET_LR = 0.02  # experiment=digits_detection's


def sweep(overrides: list[str], folder: Path, metric: str, seeds: str = "0,1,2",
          slices: str | None = SPLITS) -> list[float]:  # fmt: skip
    """One torchrun sweep over seeds (and the validation splits ``slices``)."""
    held_out = [f"data.val_slice={slices}"] if slices else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "-m", *overrides, *held_out, f"seed={seeds}",
           "logger=none", f"hydra.sweep.dir={folder}"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    rows = list(csv.DictReader((folder / "summary.csv").open()))
    assert all(r["status"] == "COMPLETED" for r in rows), rows
    return [float(r[metric]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr-factors", type=float, nargs="+", default=[1.0, 0.5, 2.0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "recipes.json")
    parser.add_argument(
        "--only", default="", help="run the recipes whose name holds this (A|B: either)"
    )
    parser.add_argument("--seg-seeds", default="0,1,2", help="the segmentation recipe's seeds")
    parser.add_argument("--lm-seeds", default="0,1,2", help="the language model's seeds")
    parser.add_argument("--seeds", default="0,1,2", help="the classification recipes' seeds")
    parser.add_argument("--splits", default=SPLITS, help="data.val_slice values")
    args = parser.parse_args()
    have_mnist = (MNIST / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RECIPES.items():
            if not any(part in name for part in args.only.split("|")):
                continue
            if "MNIST" in name and not have_mnist:
                print(f"skipping {name}: no MNIST images at {MNIST}")
                continue
            seg, lm = "segmentation" in name, "lm_char" in name
            metric, seeds = ("val/miou", args.seg_seeds) if seg else ("val/accuracy", args.seeds)
            lrs = [DEFAULT_LR * f for f in args.lr_factors]
            if seg or lm:
                lrs = [SEG_LR if seg else LM_LR]
            if lm:  # the last tenth of the text validates; the range is over seeds
                metric, seeds = "val/loss", args.lm_seeds
            if "detection" in name:  # its own lr, as the segmentation recipes
                metric, seeds, lrs = "val/map", args.seg_seeds, [DET_LR]
            for lr in lrs:
                folder = Path(tmp) / f"{len(results)}"
                splits = None if lm else args.splits
                acc = sweep([*overrides, f"optim.lr={lr:g}"], folder, metric, seeds, splits)
                results.append({"recipe": name, "lr": lr, "metric": metric, "accuracies": acc})
                print(f"{name}, lr {lr:g}: min {min(acc):.4f} max {max(acc):.4f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print("\n| recipe | optim.lr | metric | min | mean | max | runs |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for r in results:
        a = r["accuracies"]
        loss = r["metric"] == "val/loss"
        show = (lambda v: f"{v:.4f}") if loss else (lambda v: f"{100 * v:.2f}%")  # noqa: B023
        print(f"| {r['recipe']} | {r['lr']:g} | {r['metric']} | {show(min(a))} | "
              f"{show(sum(a) / len(a))} | {show(max(a))} | {len(a)} |")  # fmt: skip


if __name__ == "__main__":
    main()
