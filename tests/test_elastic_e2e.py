"""Elastic membership: two torchrun agents on loopback, one node each, with ``--nnodes=1:2``
and c10d rendezvous. One agent's whole process tree is SIGKILLed mid-epoch; the other
re-forms the group and trains on at world size 1 from the last checkpoint, with no relaunch;
the agent started again makes the job grow back to world size 2. With a fixed global batch
the run ends at the uninterrupted run's parameters, and its metrics.jsonl holds each
validation once."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from callbacks import gated
from helpers.launch import child_env, command, free_port, run_ranks
from helpers.paths import ROOT
from helpers.runs import params, read_metrics

# 1,437 training digits, 120 a step: 11 steps an epoch at either world size (60 a process at
# 2; 2 accumulation steps of 60 at 1). 12 epochs: 132 steps. The MLP has no BatchNorm.
ARGS = ("model=mlp", "data.global_batch_size=120", "trainer.epochs=12",
        "trainer.ckpt_every_steps=5", "trainer.precision=32", "logger=none",
        "trainer.progress=false")  # fmt: skip
TOLERANCE = 1e-6
# The rendezvous settles a round 5 s after its first node (last_call_timeout); a node whose
# heartbeats stop for 3 s is dropped (keep_alive_interval x keep_alive_max_attempt).
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def agent(run: Path, endpoint: str, run_id: str, gate: Path, out: Path) -> subprocess.Popen:
    launcher = ("--nnodes=1:2", "--max-restarts=3", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--rdzv-conf={RDZV_CONF}",
                "--monitor-interval=0.5")  # fmt: skip
    cmd = command("train.py", (*ARGS, f"run_dir={run}", gated(gate, 0.2)), 1, launcher)
    cmd.remove("--standalone")
    cmd[cmd.index("torch.distributed.run")] = "ddp_utils.launch"
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def wait_for(what: str, ready, procs: list[subprocess.Popen], timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (value := ready()) is not None and value is not False:
            return value
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"an agent ended while waiting for {what}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


def newest_checkpoint(run: Path) -> int:
    found = [int(p.stem[5:]) for p in (run / "checkpoints").glob("step_*.pt")]
    return max(found, default=0)


def worlds(run: Path) -> list[int]:
    """The world size of each group that started, in order, from the run's log."""
    log = run / "train.log"
    text = log.read_text() if log.exists() else ""
    return [int(w) for w in re.findall(r"\| world size (\d+) \|", text)]


def listening(endpoint: str) -> bool:
    host, port = endpoint.split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


def test_a_lost_node_shrinks_the_job_and_a_returning_one_grows_it_back(tmp_path):
    reference, run, gate = tmp_path / "reference", tmp_path / "run", tmp_path / "gate"
    run_ranks("train.py", *ARGS, f"run_dir={reference}", nproc=2)
    gate.touch()
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"elastic{uuid.uuid4().hex[:6]}"
    a = agent(run, endpoint, run_id, gate, tmp_path / "a.txt")
    procs = [a]
    try:
        wait_for("the rendezvous store", lambda: listening(endpoint), procs, 60)  # a serves it
        b = agent(run, endpoint, run_id, gate, tmp_path / "b.txt")
        procs.append(b)
        wait_for("a group of 2", lambda: 2 in worlds(run), procs)
        at = newest_checkpoint(run)
        wait_for("a checkpoint at world size 2", lambda: newest_checkpoint(run) > at, procs)
        time.sleep(0.5)  # a few steps past it: work the survivor must redo
        os.killpg(b.pid, signal.SIGKILL)  # the node's agent and its worker, as a lost machine
        b.wait(timeout=30)
        killed = time.time()
        procs.remove(b)
        wait_for("the smaller group", lambda: worlds(run)[-1] == 1, procs)
        shrink_s = time.time() - killed
        at = newest_checkpoint(run)
        wait_for("a checkpoint at world size 1", lambda: newest_checkpoint(run) > at, procs)
        b = agent(run, endpoint, run_id, gate, tmp_path / "b_again.txt")
        procs.append(b)
        back = time.time()
        wait_for("the group grown back", lambda: worlds(run)[-2:] == [1, 2], procs)
        grow_s = time.time() - back
        at = newest_checkpoint(run)
        wait_for("a checkpoint after growing", lambda: newest_checkpoint(run) > at, procs)
        gate.unlink()  # the rest at full speed
        for p in procs:
            assert p.wait(timeout=180) == 0, (tmp_path / "a.txt").read_text()[-5000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    log = (run / "train.log").read_text()
    stopped = [int(s) for s in re.findall(r"the run stopped at step (\d+)", log)]
    resumed = [int(s) for s in re.findall(r"resumed from \S+step_(\d+)\.pt", log)]
    term = [int(s) for s in re.findall(r"stopped by SIGTERM at step (\d+)", log)]
    # The last two resumes are the shrink and the growth (had the first round formed before
    # the second agent joined, a growth at the start comes before them).
    print(
        f"shrink {shrink_s:.1f} s, {stopped[-1] - resumed[-2]} steps redone; grow "
        f"{grow_s:.1f} s, the stop step {term[-1]} saved and resumed from {resumed[-1]}"
    )
    assert re.findall(r"saved at world size (\d)", log)[-2:] == ["2", "1"]
    assert term[-1] == resumed[-1]  # growing loses no step: the stop step is saved first
    want = [r["step"] for r in read_metrics(reference)]
    assert [r["step"] for r in read_metrics(run)] == want == list(range(11, 133, 11))
    expected, got = params(reference), params(run)
    worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
    print(f"largest parameter difference {worst:.2e}")
    assert worst < TOLERANCE, worst
