"""Ctrl-C at any moment of start-up ends the job within seconds, as a user's Ctrl-C does: the
signal to the whole process group of `ddp-run --nproc_per_node=2`, at points from the first
line to the first steps, each point more than once. A rank whose main thread waits in C++ on
a peer that already left on the same signal (a collective, a store) used to hold the job until
torchrun killed it 30 s later; now it ends after a few seconds with the job's one line."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from helpers.launch import child_env
from helpers.paths import ROOT

DDP_RUN = ROOT / ".venv" / "bin" / "ddp-run"
# (line to wait for, seconds after it): from the first line to the training loop
POINTS = [("run_dir=", 0.0), ("model FLOPs", 0.6), ("model FLOPs", 0.6),
          ("model FLOPs", 1.2)]  # fmt: skip
BOUND_S = 15.0  # torchrun's own kill came at 30 s; a stop within seconds is well inside this


@pytest.mark.skipif(not DDP_RUN.exists(), reason="ddp-run is installed by make install")
@pytest.mark.parametrize(("marker", "delay"), POINTS)
def test_ctrl_c_during_start_up_ends_the_job_within_seconds(tmp_path, marker, delay):
    cmd = [str(DDP_RUN), "--standalone", "--nproc_per_node=2", "train.py", "trainer.epochs=300",
           "logger=none", f"run_dir={tmp_path}/run"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(marker in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.01)
        time.sleep(delay)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    out = "".join(lines)
    assert proc.returncode == 130, out[-3000:]
    assert took < BOUND_S and "forcefully exiting" not in out, (took, out[-3000:])
    assert "stopped by SIGINT" in out and "Traceback" not in out, out[-3000:]
