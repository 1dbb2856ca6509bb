"""Pictures of runs: loss and accuracy curves, and a confusion matrix.

    python -m ddp_utils.plot RUN_DIR [RUN_DIR ...] [--out curves_compared.png]

A directory without ``metrics.jsonl`` (a sweep) stands for all the runs inside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# A bare Figure draws to files with the Agg canvas: no pyplot, no display, no global figure
# state, and a quarter second less to import at the end of every run.
from matplotlib.figure import Figure


def expand(paths: list[Path]) -> list[Path]:
    runs: list[Path] = []
    for p in paths:
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        else:
            runs += sorted(d.parent for d in p.glob("*/metrics.jsonl"))
    return runs


def read_records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def run_label(run: Path) -> str:
    """A sweep job by its overrides (its ``job.json``), any other run by its folder's name."""
    job = run / "job.json"
    if job.is_file():
        overrides = json.loads(job.read_text()).get("overrides") or []
        if overrides:
            return " ".join(overrides)
    return run.name


def draw_runs(runs: list[Path]) -> Figure:
    """Loss (train and val, on a log axis, so one diverged run does not flatten the others)
    and val accuracy (or a task's own metric) per epoch, one line per run."""
    fig = Figure(figsize=(11, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    runs_records = [(run, read_records(run)) for run in runs]
    metric = score_key(runs_records[0][1] if runs_records else [])
    for run, records in runs_records:
        epochs = [r["epoch"] for r in records]
        label = run_label(run) if len(runs) > 1 else None
        (line,) = ax_loss.plot(epochs, [_value(r, "train/loss") for r in records], marker="o",
                               label=f"{label} train" if label else "train")  # fmt: skip
        ax_loss.plot(epochs, [_value(r, "val/loss") for r in records], marker="s",
                     linestyle="--", color=line.get_color(),
                     label=f"{label} val" if label else "val")  # fmt: skip
        ax_acc.plot(epochs, [_value(r, metric) for r in records], marker="o",
                    color=line.get_color(), label=label or "val")  # fmt: skip
    ax_loss.set_yscale("log")
    ax_loss.set(xlabel="epoch", ylabel="loss (log scale)", title="loss")
    ax_acc.set(xlabel="epoch", ylabel=metric, title="validation " + metric.removeprefix("val/"))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    # Fixed margins: tight_layout would render the figure once more just to measure it, a
    # third of the drawing time at the end of every run.
    fig.subplots_adjust(left=0.085, right=0.98, bottom=0.13, top=0.91, wspace=0.25)
    return fig


NOT_SCORES = ("val/loss", "val/num_samples", "val/skipped_images")


def score_key(records: list[dict]) -> str:
    """What the right panel draws: val/accuracy, or a task's first other validation metric."""
    keys = records[0].keys() if records else ()
    if "val/accuracy" in keys or not records:
        return "val/accuracy"
    return next((k for k in keys if k.startswith("val/") and k not in NOT_SCORES), "val/loss")


def _value(record: dict, key: str) -> float:
    """A number to draw: a missing or non-finite one (null in metrics.jsonl) leaves a gap."""
    value = record.get(key)
    return float("nan") if value is None else value


def plot_runs(runs: list[Path], out: Path) -> Path:
    draw_runs(runs).savefig(out, dpi=100)
    return out


def plot_confusion_matrix(matrix: list[list[int]], out: Path) -> Path:
    n = len(matrix)
    fig = Figure(figsize=(0.5 * n + 3, 0.5 * n + 2.5))
    ax = fig.subplots()
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax)
    peak = max(max(row) for row in matrix) or 1
    for i, row in enumerate(matrix):
        for j, count in enumerate(row):
            color = "white" if count > peak / 2 else "black"
            ax.text(j, i, str(count), ha="center", va="center", fontsize=7, color=color)
    ax.set(xlabel="predicted", ylabel="true", xticks=range(n), yticks=range(n),
           title="confusion matrix")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddp_utils.plot", description=__doc__)
    p.add_argument("paths", nargs="+", type=Path, help="run directories or sweep directories")
    # Not into a run: each run's own curves.png is train.py's, redrawn when it ends.
    p.add_argument("--out", type=Path, default=Path("curves_compared.png"),
                   help="the picture to write (default: ./curves_compared.png)")  # fmt: skip
    args = p.parse_args(argv)
    runs = expand(args.paths)
    if not runs:
        p.error(f"no metrics.jsonl in or under {', '.join(map(str, args.paths))}")
    out = plot_runs(runs, args.out)
    print(f"{len(runs)} run(s) drawn into {out}")


if __name__ == "__main__":
    main()
