"""The stop poll in a real gloo group: every rank stops at the same step whichever rank got
the signal and however unevenly the ranks step, with one all-reduce every ``stop_poll_s``
rather than every step."""

from __future__ import annotations

import signal
import time
from datetime import timedelta

import pytest
from helpers.launch import in_gloo_group


def _stop_step(
    rank: int, world: int, signalled: int, at: int, every_s: float, sync_every: int = 0
) -> dict:
    import torch.distributed as dist

    from ddp_utils.lifecycle.preemption import StopRequest

    stop = StopRequest(timedelta(seconds=30), every_s)
    stop.begin()
    stopped = None
    for step in range(1, 2000):
        time.sleep(0.001 * (1 + rank))  # ranks of different speeds
        if step % 25 == 0:
            time.sleep(0.03)  # a validation now and then
        if rank == signalled and step == at:
            stop.signum = signal.SIGTERM  # what the handler records
        if stop.poll(sync=bool(sync_every) and step % sync_every == 0):
            stopped = step
            break
    reduces = stop.reduces
    stop.close()
    found = [None] * world
    dist.all_gather_object(found, (stopped, stop.signum, reduces))
    return {"steps": [f[0] for f in found], "signals": [f[1] for f in found],
            "reduces": [f[2] for f in found]}  # fmt: skip


@pytest.mark.parametrize(("signalled", "at"), [(0, 40), (2, 97)])
def test_every_rank_stops_at_the_same_step_with_a_reduce_every_poll_interval(
    tmp_path, signalled, at
):
    got = in_gloo_group(_stop_step, 3, tmp_path, signalled, at, 0.05)
    steps = got["steps"]
    assert steps[0] is not None and len(set(steps)) == 1, steps
    assert steps[0] > at  # agreed later than the signal, never before it
    # within about two poll intervals: steps of 3 ms, polled every 50 ms (about 17 steps)
    assert steps[0] - at <= 60, steps
    assert got["signals"] == [int(signal.SIGTERM)] * 3
    # Steps of 3 ms (the slowest rank) polled about every 50 ms: far fewer reduces than steps.
    assert len(set(got["reduces"])) == 1 and got["reduces"][0] < steps[0] / 3


def test_a_poll_every_step_still_agrees(tmp_path):
    got = in_gloo_group(_stop_step, 2, tmp_path, 1, 5, 0.0)
    assert got["steps"][0] == got["steps"][1] and got["steps"][0] in (6, 7)


def test_a_checkpoint_step_agrees_at_once_on_a_signal_since_the_last_poll(tmp_path):
    # polled about every 5 s: without the checkpoint at step 50 the stop would come far later
    got = in_gloo_group(_stop_step, 2, tmp_path, 1, 45, 5.0, 50)
    assert got["steps"] == [50, 50]


STUCK = """
import os, signal, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from ddp_utils.lifecycle import preemption
preemption.STUCK_GRACE_S = 0.5
def on_stuck(stop):
    print("stuck:", stop, flush=True)
    os._exit(stop.exit_code)
try:
    with preemption.stop_signals_act_at_once(on_stuck):
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        if sys.argv[1] == "c++":
            dist.HashStore().wait(["never"], timedelta(seconds=60))  # never back in Python
        else:
            time.sleep(60)
except preemption.StoppedEarly as e:
    time.sleep(1.0)  # unwinding: the watch must leave it alone
    print("handled:", e, flush=True)
"""


@pytest.mark.parametrize(("where", "says"), [("c++", "stuck:"), ("python", "handled:")])
def test_a_stop_signal_the_main_thread_cannot_take_still_ends_the_process(where, says):
    import subprocess
    import sys

    from helpers.paths import ROOT

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK, where], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert time.monotonic() - start < 30, "waited for the C++ call's own timeout"
    assert f"{says} stopped by SIGTERM before the first training step" in proc.stdout, proc
    assert proc.returncode == (75 if where == "c++" else 0), proc.stderr
