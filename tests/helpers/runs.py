"""What a finished run left: its checkpoints' parameters, metrics.jsonl, the samples it
recorded; composing a config as train.py does; evaluating at several world sizes."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

from helpers.launch import run_forked, run_ranks
from helpers.paths import ROOT


def wait_for_step_checkpoint(
    run_dir: Path, proc: subprocess.Popen, after: int = -1, timeout: float = 120
) -> None:
    """Until the running ``proc`` has written a step checkpoint later than step ``after``
    into ``run_dir``."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        steps = [int(p.stem[5:]) for p in (run_dir / "checkpoints").glob("step_*")
                 if p.suffix in (".pt", ".dcp")]  # fmt: skip
        if any(s > after for s in steps):
            return
        time.sleep(0.02)
    raise AssertionError(f"the run ended or stalled before a step checkpoint: {proc.communicate()}")


def params(run_dir: Path, name: str = "last.pt") -> dict:
    """The model state of a run's checkpoint (of ``last.dcp`` for a sharded run)."""
    path = run_dir / "checkpoints" / name
    if not path.exists() and path.with_suffix(".dcp").exists():
        path = path.with_suffix(".dcp")
    return whole_checkpoint(path)["model"]


def whole_checkpoint(path: Path) -> dict:
    """A checkpoint file, or a sharded checkpoint's states gathered whole (torch's converter)."""
    import tempfile

    import torch

    if not path.is_dir():
        return torch.load(path, weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "whole.pt")
        return torch.load(Path(tmp) / "whole.pt", weights_only=True)


def assert_same_params(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def recorded_samples(folder: Path, epoch: int, max_step: int | None = None) -> Counter:
    """How often each sample index was trained on in ``epoch`` (up to ``max_step``), from the
    files the sample recorder wrote into ``folder``."""
    seen: Counter = Counter()
    for path in folder.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["epoch"] == epoch and (max_step is None or r["step"] <= max_step):
                seen.update(r["indices"])
    return seen


def compose_config(*overrides: str, name: str = "train"):
    """The typed config train.py (or eval.py) would get from these overrides."""
    from hydra import compose, initialize_config_dir

    from ddp_utils.config import EvalConfig, TrainConfig, to_schema
    from ddp_utils.entry import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name=name, overrides=list(overrides))
    return to_schema(cfg, EvalConfig if name == "eval" else TrainConfig)


def eval_at_world_sizes(
    checkpoint: Path, out_dir: Path, worlds: tuple[int | None, ...] = (None, 2, 3)
) -> dict[int | None, dict]:
    """eval.py's results for ``checkpoint`` in one process (a fork: None), and as the forked
    ranks of a group at each other world size of ``worlds``."""
    results = {}
    for n in worlds:
        out = out_dir / f"eval{n}.json"
        args = (f"checkpoint={checkpoint}", f"output={out}")
        if n is None:
            assert run_forked("eval.py", *args).returncode == 0
        else:
            run_ranks("eval.py", *args, nproc=n)
        results[n] = json.loads(out.read_text())
    return results


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
