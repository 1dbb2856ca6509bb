"""`make bench-peer REFERENCES=DIR`: whole training runs side by side, train.py against
torchvision's own classification reference (DIR/references/classification/train.py, from a
checkout of github.com/pytorch/vision, launched by bench/peer_reference.py with its CPU
changes), on the same image folder, model, batch, workers, optimizer, schedule and epochs,
at world size 2 with gloo on the CPU.

Runs alternate (ours, theirs, ours, theirs, ...) so that a noisy machine slows both alike.
Each run is timed from its launch to its exit; both print wall-clock stamps of their first
step and of each epoch's end (ours through the callback bench/peer_timing.py). Reported, as
medians over the runs: wall time, train img/s of each epoch, time to the first step, time
after the last epoch's validation, and the final top-1. The folder: the 8,000 + 2,000
MNIST digits of ../shared/data/mnist10k as PNG files (else the embedded digits), written
once into bench/results/peer_folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import profile_summary  # bench/, beside this file
from devices import bench_device, ours_device

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT.parent / "shared" / "data" / "mnist10k"
RESULTS = ROOT / "bench" / "results"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def make_folder(root: Path) -> tuple[Path, str]:
    """``root/{train,val}/<digit>/NNNNN.png``, written once."""
    done = root / ".complete"
    if done.is_file():
        return root, done.read_text()
    import numpy as np
    from PIL import Image

    if (MNIST / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file():
        import torchvision

        splits = {s: torchvision.datasets.MNIST(str(MNIST), train=s == "train", download=False)
                  for s in ("train", "val")}  # fmt: skip
        arrays = {s: (ds.data.numpy(), ds.targets.numpy()) for s, ds in splits.items()}
        what = "MNIST digits of ../shared/data/mnist10k (8,000 train / 2,000 val PNGs, 28 px)"
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = (bunch.images * (255 / 16)).round().astype(np.uint8)
        cut = round(len(images) * 0.8)
        arrays = {"train": (images[:cut], bunch.target[:cut]),
                  "val": (images[cut:], bunch.target[cut:])}  # fmt: skip
        what = "the embedded 8x8 digits (1,438 train / 359 val PNGs)"
    for split, (images, labels) in arrays.items():
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            folder = root / split / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image, mode="L").save(folder / f"{i:05d}.png")
    done.write_text(what)
    return root, what


def decoded_shards(folder: Path, out: Path) -> Path:
    """The folder's images as decoded (uint8 array) tar shards, written once."""
    done = out / ".complete"
    if not done.is_file():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "ddp_utils.shards", "write", f"--out={out}",
                        "--samples-per-shard=1000", "--decoded", "data=imagefolder",
                        f"data.root={folder}", "data.in_channels=3", "data.num_classes=10"],
                       cwd=ROOT, check=True, capture_output=True)  # fmt: skip
        done.write_text("")
    return out


def ours_command(
    data: Path, run_dir: Path, a: argparse.Namespace, callbacks: str = ""
) -> list[str]:
    """train.py on the job; ``callbacks``: more entries for its callbacks list (the profiler)."""
    source = ("data=shards", f"data.root={a.shards}") if a.ours_data == "shards" else \
        ("data=imagefolder", f"data.root={data}")  # fmt: skip
    return [*TORCHRUN, str(ROOT / "train.py"), *source, "data.in_channels=3",
            f"data.image_size={a.crop}", "data.num_classes=10",
            f"data.batch_size={a.batch_size}", f"data.num_workers={a.workers}",
            "model=custom", "model._target_=torchvision.models.resnet18", "+model.num_classes=10",
            "optim=sgd", f"optim.lr={a.lr}", "optim.momentum=0.9", "optim.weight_decay=1e-4",
            "sched=cosine", f"trainer.epochs={a.epochs}", f"trainer.precision={a.precision}",
            "trainer.progress=false", f"run_dir={run_dir}",
            f"callbacks=[{{_target_: peer_timing.Timing}}{callbacks}]", *ours_device()]  # fmt: skip


def theirs_command(data: Path, run_dir: Path, a: argparse.Namespace) -> list[str]:
    """torchvision's references/classification/train.py from ``a.references`` on the same
    job, through bench/peer_reference.py (its CPU changes); its validation resizes to
    crop / 0.875 and center-crops, as its presets do at 224 / 256."""
    return [*TORCHRUN, str(ROOT / "bench" / "peer_reference.py"), f"--references={a.references}",
            "--", f"--data-path={data}", "--model=resnet18", f"--device={bench_device()}",
            f"--output-dir={run_dir}", f"--epochs={a.epochs}", f"--batch-size={a.batch_size}",
            f"--workers={a.workers}", f"--lr={a.lr}", "--momentum=0.9", "--wd=1e-4",
            "--lr-scheduler=cosineannealinglr", f"--train-crop-size={a.crop}",
            f"--val-crop-size={a.crop}", f"--val-resize-size={round(a.crop / 0.875)}"]  # fmt: skip


def profiled_command(kind: str, data: Path, run_dir: Path, a: argparse.Namespace) -> list[str]:
    """The run with the torch.profiler window on rank 0 and, where py-spy is installed, under
    ``py-spy record`` (every process: torchrun, the ranks, their loader workers)."""
    table = a.profile_dir / f"{kind}_torch_profiler.txt"
    if kind == "ours":
        profile = f", {{_target_: peer_profile.Profile, steps: {a.profile}, out: '{table}'}}"
        command = ours_command(data, run_dir, a, callbacks=profile)
    else:
        command = theirs_command(data, run_dir, a)
        cut = command.index("--")  # the launcher's own options go before its "--"
        command[cut:cut] = [f"--profile-steps={a.profile}", f"--profile-out={table}"]
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        print("py-spy not found (pip install py-spy): torch.profiler only", flush=True)
        return command
    flame = a.profile_dir / f"{kind}_py_spy.txt"
    return [spy, "record", "--subprocesses", "--idle", "--rate", str(profile_summary.RATE),
            "--format", "raw", "--output", str(flame), "--", *command]  # fmt: skip


def run(kind: str, data: Path, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        plain = ours_command if kind == "ours" else theirs_command
        command = (profiled_command(kind, data, Path(tmp), a) if a.profile
                   else plain(data, Path(tmp), a))  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)])}
        start = time.time()
        proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=3600)  # fmt: skip
        end = time.time()
    if proc.returncode != 0:
        sys.exit(f"{kind} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    events = [json.loads(x[5:]) for x in proc.stdout.splitlines() if x.startswith("PEER ")]
    epochs = [e for e in events if e["event"] == "epoch"]
    first = next(e for e in events if e["event"] == "first_step")
    return {"kind": kind, "wall_s": end - start, "first_step_s": first["time"] - start,
            "after_last_epoch_s": end - epochs[-1]["time"],
            "img_s": [e["img_s"] for e in epochs], "top1": epochs[-1]["top1"]}  # fmt: skip


def medians(runs: list[dict]) -> dict:
    epochs = len(runs[0]["img_s"])
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "first_step_s": statistics.median(r["first_step_s"] for r in runs),
        "after_last_epoch_s": statistics.median(r["after_last_epoch_s"] for r in runs),
        "img_s": [statistics.median(r["img_s"][e] for r in runs) for e in range(epochs)],
        "top1": statistics.median(r["top1"] for r in runs),
    }


def table(ours: dict, theirs: dict) -> str:
    rows = [("wall time (s)", "wall_s", "{:.1f}"), ("time to first step (s)", "first_step_s",
             "{:.1f}"), ("after the last epoch (s)", "after_last_epoch_s", "{:.1f}"),
            ("final top-1", "top1", "{:.4f}")]  # fmt: skip
    lines = [
        "| median | ours | torchvision reference | ours / theirs |",
        "| --- | --- | --- | --- |",
    ]
    for label, key, fmt in rows:
        ratio = ours[key] / theirs[key] if theirs[key] else float("nan")
        lines.append(f"| {label} | {fmt.format(ours[key])} | {fmt.format(theirs[key])} | "
                     f"{ratio:.2f}x |")  # fmt: skip
    for e, (a, b) in enumerate(zip(ours["img_s"], theirs["img_s"], strict=True)):
        lines.append(f"| train img/s, epoch {e} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")
    return "\n".join(lines)


def machine() -> str:
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next(x.split(":", 1)[1].strip() for x in text.splitlines() if "model name" in x)
        found = {f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in text}
        flags = f"{model}, {os.cpu_count()} cores, {' '.join(sorted(found)) or 'no AVX2'}"
    except (OSError, StopIteration):
        flags = f"{platform.processor()}, {os.cpu_count()} cores"
    return flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--references",
        type=Path,
        required=True,
        help="a checkout of github.com/pytorch/vision (make bench-peer REFERENCES=DIR)",
    )
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--crop", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--out", type=Path, default=RESULTS / "peer.json")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="one run of each, profiling STEPS steps (torch.profiler, py-spy) into "
                   "--profile-dir; timings then include the profilers' overhead")  # fmt: skip
    p.add_argument("--profile-dir", type=Path, default=RESULTS / "profile")
    p.add_argument("--ours-data", choices=("folder", "shards"), default="folder",
                   help="ours reads the image folder, or the same images as decoded tar shards "
                   "(written once beside it); the reference always reads the folder")  # fmt: skip
    p.add_argument("--precision", default="32",
                   help="ours' trainer.precision: 32 (the reference's only one on a CPU: its "
                   "--amp is CUDA's), auto (ours' default) or bf16")  # fmt: skip
    a = p.parse_args()
    if a.profile:
        a.pairs, a.out = 1, a.profile_dir / "peer.json"
        a.profile_dir.mkdir(parents=True, exist_ok=True)
    data, what = make_folder(RESULTS / "peer_folder")
    if a.ours_data == "shards":
        a.shards = decoded_shards(data, RESULTS / "peer_shards_decoded")
        what += "; ours read it as decoded tar shards (python -m ddp_utils.shards write --decoded)"
    runs: dict[str, list[dict]] = {"ours": [], "theirs": []}
    for i in range(a.pairs):
        for kind in ("ours", "theirs"):
            r = run(kind, data, a)
            runs[kind].append(r)
            print(f"pair {i} {kind:<6} wall {r['wall_s']:.1f} s, first step {r['first_step_s']:.1f}"
                  f" s, img/s {[round(x) for x in r['img_s']]}, top-1 {r['top1']:.4f}",
                  flush=True)  # fmt: skip
    ours, theirs = medians(runs["ours"]), medians(runs["theirs"])
    print(f"\n{a.pairs} pairs of {a.epochs}-epoch runs, resnet18, {a.crop} px crops, batch "
          f"{a.batch_size} per process, {a.workers} worker per process, world size 2 (gloo), "
          f"ours at trainer.precision={a.precision}, theirs fp32; data: {what}; "
          f"machine: {machine()}\n")  # fmt: skip
    print(table(ours, theirs))
    if a.profile and (a.profile_dir / "ours_py_spy.txt").is_file():
        print(f"\nprofiles in {a.profile_dir} (torch.profiler tables: *_torch_profiler.txt)\n")
        profile_summary.main([str(a.profile_dir)])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"runs": runs, "ours": ours, "theirs": theirs,
                                 "data": what, "machine": machine()}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
