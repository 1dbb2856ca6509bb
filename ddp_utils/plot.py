"""Pictures of runs: loss and accuracy curves, a confusion matrix, segmentation and detection
predictions.

    python -m ddp_utils.plot RUN_DIR [RUN_DIR ...] [--out curves_compared.png]

A directory without ``metrics.jsonl`` (a sweep) stands for all the runs inside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# A bare Figure draws to files with the Agg canvas: no pyplot, no display, no global figure
# state, and a quarter second less to import at the end of every run.
from matplotlib.figure import Figure

from ddp_utils.files import atomic_write


def save_figure(fig: Figure, out: Path, dpi: int) -> None:
    """A PNG written atomically: a full disk leaves the old picture or none, never half."""
    out = Path(out)
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=dpi))


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
    save_figure(draw_runs(runs), out, dpi=100)
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
    save_figure(fig, out, dpi=100)
    return out


def palette(n: int) -> np.ndarray:
    """A fixed colour per class id (the bit-interleaving palette of Pascal VOC: class 0 black,
    the same colours in every picture), as floats in [0, 1]; ignored pixels are white."""
    colours = np.zeros((n + 1, 3))
    for c in range(n):
        r = g = b = 0
        cid = c
        for bit in range(8):
            r |= ((cid >> 0) & 1) << (7 - bit)
            g |= ((cid >> 1) & 1) << (7 - bit)
            b |= ((cid >> 2) & 1) << (7 - bit)
            cid >>= 3
        colours[c] = (r / 255, g / 255, b / 255)
    colours[n] = (1.0, 1.0, 1.0)
    return colours


def shown_prediction(truth: np.ndarray, pred: np.ndarray, n_classes: int) -> np.ndarray:
    """The prediction as drawn: where the truth is padding (a smaller image of the batch) or
    ignored, the "ignored" colour (``n_classes``), not a prediction nobody scores."""
    return np.where((truth >= 0) & (truth < n_classes), pred, n_classes)


def plot_predictions(images, truths, preds, classes: list[str], out: Path) -> Path:
    """One row per image: the image, its true mask and the predicted one, in ``palette``
    colours, with a legend of the classes shown (``truths`` use a negative id for ignored)."""
    from matplotlib.patches import Patch

    n, colours = len(images), palette(len(classes))
    fig = Figure(figsize=(7.5, 2.4 * n + 0.8))
    axes = fig.subplots(n, 3, squeeze=False)
    shown: set[int] = set()
    for row, (image, truth, pred) in enumerate(zip(images, truths, preds, strict=True)):
        picture = image.permute(1, 2, 0).numpy()
        axes[row, 0].imshow(picture[..., 0] if picture.shape[-1] == 1 else picture,
                            cmap="gray", vmin=0, vmax=255)  # fmt: skip
        truth, pred = truth.numpy(), pred.numpy()
        counted = (truth >= 0) & (truth < len(classes))
        shown |= set(np.unique(truth[counted]).tolist()) | set(np.unique(pred).tolist())
        axes[row, 1].imshow(colours[np.where(counted, truth, len(classes))])
        axes[row, 2].imshow(colours[shown_prediction(truth, pred, len(classes))])
        for col, title in enumerate(("image", "truth", "prediction")):
            axes[row, col].set_axis_off()
            if row == 0:
                axes[row, col].set_title(title)
    handles = [Patch(color=colours[c], label=classes[c]) for c in sorted(shown)]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="ignored"))
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=8)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.95, bottom=0.8 / (2.4 * n + 0.8) + 0.02,
                        wspace=0.05, hspace=0.08)  # fmt: skip
    save_figure(fig, out, dpi=80)
    return out


def plot_boxes(images, truths, preds, classes: list[str], out: Path,
               min_score: float = 0.3) -> Path:  # fmt: skip
    """One row per image: the true boxes (green) and the predicted ones scoring at least
    ``min_score`` (orange, with their class and score), class names from ``classes``."""
    from matplotlib.patches import Rectangle

    n = len(images)
    fig = Figure(figsize=(5.0, 2.5 * n + 0.4))
    axes = fig.subplots(n, 2, squeeze=False)
    for row, (image, truth, pred) in enumerate(zip(images, truths, preds, strict=True)):
        picture = image.permute(1, 2, 0).numpy()
        for col, (title, target, colour) in enumerate(
            (("truth", truth, "limegreen"), ("prediction", pred, "orange"))
        ):
            ax = axes[row, col]
            ax.imshow(picture[..., 0] if picture.shape[-1] == 1 else picture, cmap="gray",
                      vmin=0, vmax=255)  # fmt: skip
            ax.set_axis_off()
            if row == 0:
                ax.set_title(title)
            scores = target.get("scores")
            for k, (x0, y0, x1, y1) in enumerate(target["boxes"].tolist()):
                if scores is not None and float(scores[k]) < min_score:
                    continue
                ax.add_patch(Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0, y1 - y0, fill=False,
                                       edgecolor=colour, linewidth=1.2))  # fmt: skip
                label = int(target["labels"][k])
                text = classes[label] if label < len(classes) else str(label)
                if scores is not None:
                    text += f" {float(scores[k]):.2f}"
                ax.text(x0, y0 - 1, text, color=colour, fontsize=7)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.95, bottom=0.02, wspace=0.05, hspace=0.1)
    save_figure(fig, out, dpi=80)
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
