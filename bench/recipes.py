"""The published recipes measured on data they were not tuned on: `make recipes`.

Each recipe trains at world size 2 on 3 disjoint held-out validation slices
(``data.val_slice=0,1,2``: the rest of the images are the training set) with 3 seeds, at the
default learning rate and at half and twice it, one torchrun sweep per (recipe, lr), and the
table gives min / mean / max of the final ``val/accuracy``. MNIST rows need the images of
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
RECIPES = {
    "digits (default, 10 epochs)": [],
    "MNIST (data=mnist, 10 epochs)": ["data=mnist", f"data.root={MNIST}"],
    "MNIST tutorial (experiment=mnist_convnet, 2 epochs)": [
        "experiment=mnist_convnet", f"data.root={MNIST}",
    ],
}  # fmt: skip


def sweep(overrides: list[str], folder: Path) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "-m", *overrides, "data.val_slice=0,1,2", "seed=0,1,2",
           "logger=none", f"hydra.sweep.dir={folder}"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    rows = list(csv.DictReader((folder / "summary.csv").open()))
    assert all(r["status"] == "COMPLETED" for r in rows), rows
    return [float(r["val/accuracy"]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr-factors", type=float, nargs="+", default=[1.0, 0.5, 2.0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "recipes.json")
    args = parser.parse_args()
    have_mnist = (MNIST / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RECIPES.items():
            if "MNIST" in name and not have_mnist:
                print(f"skipping {name}: no MNIST images at {MNIST}")
                continue
            for factor in args.lr_factors:
                lr = DEFAULT_LR * factor
                folder = Path(tmp) / f"{len(results)}"
                acc = sweep([*overrides, f"optim.lr={lr:g}"], folder)
                results.append({"recipe": name, "lr": lr, "accuracies": acc})
                print(f"{name}, lr {lr:g}: min {min(acc):.4f} max {max(acc):.4f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(
        "\n| recipe | optim.lr | val/accuracy min | mean | max |\n| --- | --- | --- | --- | --- |"
    )
    for r in results:
        a = r["accuracies"]
        print(f"| {r['recipe']} | {r['lr']:g} | {100 * min(a):.2f}% | "
              f"{100 * sum(a) / len(a):.2f}% | {100 * max(a):.2f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
