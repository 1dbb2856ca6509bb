"""How a run ends: a lost peer, a stop signal outside the loop, an unwritable run_dir, a diverged
loss, and a finished script's exit."""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import pytest
import torch
from helpers.paths import ROOT

from ddp_utils.config import (
    ConfigError,
)
from ddp_utils.dist import (
    Runtime,
)


def test_survivors_of_a_lost_peer_leave_the_group_without_waiting_for_it(monkeypatch):
    """After a collective lost its peer, the others are not waited for at the end (it never
    comes: tests/test_elastic_e2e.py); any other ending waits for every rank."""
    import ddp_utils.lifecycle.peers as dist_module
    from ddp_utils.lifecycle.peers import process_group_left
    from ddp_utils.lifecycle.preemption import StoppedEarly

    calls = []
    monkeypatch.setattr(dist_module, "shutdown",
                        lambda together=True, wait_s=30.0: calls.append(together))  # fmt: skip
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1")
    with pytest.raises(RuntimeError), process_group_left():
        raise lost
    with pytest.raises(StoppedEarly), process_group_left():
        try:
            raise lost
        except RuntimeError:
            raise StoppedEarly(15) from None
    with pytest.raises(ValueError), process_group_left():
        raise ValueError("a user's mistake")
    with process_group_left():
        pass
    with process_group_left(leave=False):  # a sweep's job: the group stays
        pass
    assert calls == [False, False, True, True]


def test_a_rank_that_cannot_see_run_dir_says_so(tmp_path):
    from ddp_utils.run.folder import resolve_run_dir

    rt = Runtime(rank=3, local_rank=1, world_size=4, local_world_size=2,
                 device=torch.device("cpu"), backend="gloo")  # fmt: skip
    missing = tmp_path / "on_another_node"
    with (
        mock.patch(
            "ddp_utils.run.folder.broadcast_object", return_value=(str(missing), False, None, "")
        ),
        mock.patch("ddp_utils.run.folder.barrier"),
        pytest.raises(ConfigError, match="shared") as e,
    ):
        resolve_run_dir(None, rt)
    assert e.value.rank_specific and "rank 3" in str(e.value)


@pytest.mark.parametrize(
    "code, fix",
    [("ENOSPC", "Free space there"), ("EDQUOT", "Free space there"),
     ("EROFS", "Make the folder writable"), ("EACCES", "Make the folder writable")],
)  # fmt: skip
def test_an_unwritable_run_dir_is_one_paragraph_and_leaves_no_torn_line(tmp_path, code, fix):
    import errno
    import os

    from ddp_utils.lifecycle.disk import WRITE_FAILED_EXIT, UnwritableError
    from ddp_utils.run.records import append_metrics

    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
    append_metrics(tmp_path, {"epoch": 0, "step": 1}, rt)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    err = OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
    with mock.patch("os.fsync", side_effect=err), pytest.raises(UnwritableError) as e:
        append_metrics(tmp_path, {"epoch": 1, "step": 2}, rt)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    message = str(e.value)
    assert message.startswith(f"cannot write {tmp_path / 'metrics.jsonl'} ({err.strerror})")
    assert f"run_dir={tmp_path} has " in message and fix in message
    assert e.value.exit_code == WRITE_FAILED_EXIT == 4


@pytest.mark.parametrize("precision, clip", [("32", None), ("bf16", 2.0)])
def test_the_divergence_message_suggests_only_what_would_change(tmp_path, precision, clip):
    from types import SimpleNamespace

    from ddp_utils.checkpoint import diverged

    trainer = SimpleNamespace(grad_clip=clip, precision=precision)
    cfg = SimpleNamespace(optim=SimpleNamespace(lr=0.1), trainer=trainer)
    saves = SimpleNamespace(last_complete=lambda: None)
    tr = SimpleNamespace(run_dir=tmp_path, step=3, epoch=0, cfg=cfg, checkpointer=saves)
    text = str(diverged(tr, "the training loss"))
    assert "Last good checkpoint: none" in text
    assert "a lower optim.lr (now 0.1)" in text
    assert ("trainer.precision=32" in text) == (precision != "32")
    assert ("trainer.grad_clip=1.0" in text) == (clip is None)
    assert ("a lower trainer.grad_clip (now 2)" in text) == (clip is not None)


def _signal_inside(steps: list[str]) -> None:
    """Inside clean_exit as a job runs it: the training loop begins if asked, then a lost
    collective if asked, and SIGTERM arrives while that error unwinds (torchrun's stop of the
    survivors)."""
    import os
    import signal
    from datetime import timedelta

    from ddp_utils.entry import clean_exit
    from ddp_utils.lifecycle.preemption import StopRequest

    with clean_exit():
        stop = StopRequest(timedelta(seconds=5))
        if "train" in steps:
            stop.begin()
        stop.close()  # the loop's handlers go, as tr.close() does after an error
        try:
            if "lost" in steps:
                raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode


@pytest.mark.parametrize(
    ("steps", "code", "says"),
    [
        ((), 75, "error: stopped by SIGTERM before the first training step; nothing was saved"),
        (("train",), 75, "error: stopped by SIGTERM while the run was ending; relaunch the same"),
        (("train", "lost"), 1, "[rank 0] stopping: another rank is gone"),
    ],
)
def test_a_stop_signal_outside_the_loop_names_what_happened(steps, code, says, capsys):
    with (
        mock.patch.dict("os.environ", {"RANK": "0"}),
        mock.patch("ddp_utils.lifecycle.exit.NON_MAIN_EXIT_DELAY_S", 0),
        mock.patch("ddp_utils.lifecycle.exit.write_error_file"),
        mock.patch("ddp_utils.lifecycle.exit.exit_now", sys.exit),  # not os._exit: this is pytest
        # clean_exit marks the job started: a fork of this process (run_forked) must not
        # inherit that, nor the training flag.
        mock.patch("ddp_utils.entry._job_started", False),
        mock.patch("ddp_utils.lifecycle.preemption._trained", False),
        pytest.raises(SystemExit) as exit_,
    ):
        _signal_inside(list(steps))
    assert exit_.value.code == code
    assert says in capsys.readouterr().err


def test_leave_joins_threads_runs_atexit_handlers_and_exits_0(tmp_path):
    """A finished script's exit skips the module teardown, not what the teardown would run:
    a non-daemon thread still working, an atexit handler, and logs and prints still buffered."""
    from helpers.paths import ROOT

    script = f"""
import atexit, logging, pathlib, sys, threading, time
sys.path.insert(0, {str(ROOT)!r})
from ddp_utils.lifecycle.exit import leave
out = pathlib.Path({str(tmp_path)!r})
logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
atexit.register(lambda: (out / "atexit").write_text("done"))
logging.info("logged")
print("printed", end="")
leave()
print("never")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "printed", proc.stderr
    assert (tmp_path / "thread").read_text() == "done" == (tmp_path / "atexit").read_text()
    assert "logged" in (tmp_path / "log.txt").read_text()


def test_a_finished_script_exits_with_a_thread_pool_alive_and_runs_atexit(tmp_path):
    """torch.compile leaves a ThreadPoolExecutor behind: ``leave`` must let its workers finish
    (threading's exit hooks) before joining them, and still run the atexit handlers."""
    marker = tmp_path / "atexit"
    code = f"""
import atexit, concurrent.futures, pathlib
from ddp_utils.lifecycle.exit import leave
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(sum, [1, 2]).result()
atexit.register(pathlib.Path({str(marker)!r}).write_text, "ran")
leave()
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "ran"
