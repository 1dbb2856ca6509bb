"""Where each side's rank 0 spends its wall time, from the py-spy samples of
`make bench-profile` (bench/results/profile/{ours,theirs}_py_spy.txt, py-spy's raw format:
one ``frame;frame;... count`` line per distinct stack).

    python bench/profile_summary.py [PROFILE_DIR]

Only rank 0's main thread is counted (py-spy with ``--idle``: waiting counts too), so the
phases add up to that process's life. A sample goes to the first phase whose frame it holds.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATE = 50  # py-spy's samples per second (bench/peer.py passes it as --rate)
PHASES = [  # (phase, a frame that marks it); the first match wins
    ("plot curves", "draw_pictures"),
    ("teardown", "shutdown (ddp_utils/dist"),
    ("teardown", "close (ddp_utils/train/state"),
    ("teardown", "destroy_process_group"),
    ("step: next batch", "__next__ (torch/utils/data/dataloader"),
    ("step: next batch", "__iter__ (torch/utils/data/dataloader"),
    ("step: stop poll", "poll (ddp_utils/lifecycle/preemption"),
    ("step: profiler", "profile_window"),
    ("step: backward", "backward (torch/_tensor"),
    ("step: optimizer", "optimizer_step"),
    ("step: optimizer", "step (torch/optim"),
    ("validation", "evaluate ("),
    ("checkpoint", "save (ddp_utils/checkpoint/save"),
    ("checkpoint", "save (torch/serialization"),
    ("step: forward and the rest", "train_one_epoch"),
    ("build: model, data, metrics", "build_training"),
    ("build: model, data, metrics", "load_data ("),  # the torchvision reference's
    ("process group", "init_distributed"),
    ("process group", "init_process_group"),
    ("imports", "_find_and_load"),
    ("Hydra composition", "hydra/"),
]


def main_process(lines: list[str], script: str) -> str:
    """The first worker torchrun started (``python -u script``): global rank 0."""
    marker = f"-u {ROOT / script}"
    pids = {f.split(":")[0] for line in lines for f in line.split(";")
            if f.startswith("process ") and marker in f}  # fmt: skip
    return min(pids, key=lambda p: int(p.split()[1]))


def phases(path: Path, script: str) -> collections.Counter:
    lines = path.read_text().splitlines()
    rank0 = main_process(lines, script)
    seconds: collections.Counter = collections.Counter()
    for line in lines:
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        rest = frames[len(procs) :]
        if procs[-1].split(":")[0] != rank0 or not rest or rest[0].startswith("Thread."):
            continue
        joined = ";".join(rest)
        phase = next((name for name, frame in PHASES if frame in joined), "other")
        seconds[phase] += int(count) / RATE
    return seconds


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0]) if argv else Path(__file__).parent / "results" / "profile"
    ours = phases(folder / "ours_py_spy.txt", "train.py")
    theirs = phases(folder / "theirs_py_spy.txt", "bench/peer_reference.py")
    names = list(dict.fromkeys([name for name, _ in PHASES] + ["other"]))
    print("| rank 0's wall time (s, py-spy) | ours | torchvision reference |\n| --- | --- | --- |")
    for name in names:
        if ours[name] or theirs[name]:
            print(f"| {name} | {ours[name]:.1f} | {theirs[name]:.1f} |")
    print(f"| total | {sum(ours.values()):.1f} | {sum(theirs.values()):.1f} |")


if __name__ == "__main__":
    main()
