"""Relaunching the same command continues the run it interrupted, without ``run_dir``: under
``--standalone`` (a new torchrun run id each launch) and as one plain process, after SIGTERM,
Ctrl-C and SIGKILL of the whole process tree; a finished run is not continued."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.launch import child_env
from helpers.paths import ROOT
from helpers.runs import read_metrics

# 3 epochs of 71 steps at 2 processes (143 at one): time to stop it mid-run.
RUN = ("trainer.epochs=3", "data.batch_size=10", "trainer.ckpt_every_steps=10", "logger=none")


def launch(cwd: Path, nproc: int | None) -> subprocess.Popen:
    """The same command each time, in ``cwd`` (so ``outputs/`` is the test's own)."""
    script = str(ROOT / "train.py")
    if nproc is None:
        cmd = [sys.executable, script, *RUN]
    else:
        cmd = [sys.executable, "-m", "ddp_utils.launch", "--standalone",
               f"--nproc_per_node={nproc}", script, *RUN]  # fmt: skip
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen(cmd, cwd=cwd, env=child_env(), start_new_session=True, **out)


def runs(cwd: Path) -> list[Path]:
    out = cwd / "outputs"
    return sorted(p for p in out.iterdir() if p.is_dir()) if out.is_dir() else []


def step_checkpoints(run: Path) -> list[int]:
    return [int(p.stem[5:]) for p in (run / "checkpoints").glob("step_*.pt")]


def wait_for_checkpoint_after(cwd: Path, proc: subprocess.Popen, after: int) -> Path:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        for run in runs(cwd):
            if any(s > after for s in step_checkpoints(run)):
                return run
        time.sleep(0.02)
    raise AssertionError(f"no step checkpoint after step {after}: {proc.communicate()}")


def first_line(out: str) -> str:
    """Our first line (Hydra or matplotlib may print a cache notice before it)."""
    return next(line for line in out.splitlines() if "run_dir=" in line)


def stop(proc: subprocess.Popen, sig: int) -> str:
    """``sig`` to the whole process tree, as a terminal (Ctrl-C) or a scheduler does."""
    os.killpg(proc.pid, sig)
    out, _ = proc.communicate(timeout=90)
    return out


def last_step(run: Path) -> int:
    import torch

    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"]


def test_standalone_relaunch_resumes_after_sigterm_and_sigkill_of_the_tree(tmp_path):
    proc = launch(tmp_path, nproc=2)
    run = wait_for_checkpoint_after(tmp_path, proc, -1)
    out = stop(proc, signal.SIGTERM)
    assert re.search(r"new run: run_dir=outputs/\S+", first_line(out)), out
    stopped = last_step(run)
    # The stop names the folder and the command that resumes it.
    assert f"checkpoint written in run_dir=outputs/{run.name}" in out, out
    resume = re.search(r"name the run: (.*)", out)[1]
    assert "ddp_utils.launch --standalone --nproc_per_node=2" in resume
    assert resume.endswith(f"run_dir=outputs/{run.name}"), resume

    proc = launch(tmp_path, nproc=2)
    wait_for_checkpoint_after(tmp_path, proc, stopped)
    out = stop(proc, signal.SIGKILL)  # nothing runs to say goodbye
    assert first_line(out) == (
        f"resuming the unfinished run of this command and config: run_dir=outputs/{run.name}"
    ), out
    assert f"resumed from {run / 'checkpoints'}" in out or "resumed from" in out, out
    killed_at = last_step(run)
    assert killed_at > stopped

    proc = launch(tmp_path, nproc=2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert first_line(out).startswith("resuming the unfinished run"), out
    assert runs(tmp_path) == [run]
    assert read_metrics(run)[-1]["step"] == last_step(run) == 3 * 71
    assert json.loads((run / "run.json").read_text())["finished"] is True


def test_plain_python_relaunch_resumes_after_ctrl_c_and_starts_anew_once_finished(tmp_path):
    proc = launch(tmp_path, nproc=None)
    run = wait_for_checkpoint_after(tmp_path, proc, -1)
    out = stop(proc, signal.SIGINT)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert f"python {ROOT / 'train.py'} {' '.join(RUN)} run_dir=outputs/{run.name}" in out, out
    stopped = last_step(run)

    proc = launch(tmp_path, nproc=None)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert first_line(out).endswith(f"run_dir=outputs/{run.name}"), out
    assert "resumed from" in out and last_step(run) == 3 * 143 > stopped

    proc = launch(tmp_path, nproc=None)  # the run had finished: a new one
    first = ""
    deadline = time.time() + 120
    while "run_dir=" not in first and time.time() < deadline:
        first = proc.stdout.readline()
    stop(proc, signal.SIGTERM)
    assert f"(the newest run of this command and config, outputs/{run.name}, had finished)" in (
        first
    ), first
    assert first.startswith("new run: run_dir=outputs/")
