"""Fault tolerance with real gloo processes: kills, SIGTERM, torn files, re-sharding, stalls."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from callbacks import both, fault, recorder, slow
from helpers.faults import write_malicious_checkpoint
from helpers.launch import (
    child_env,
    kill_agent_alone,
    run_forked,
    run_ranks,
    run_script,
    start_script,
)
from helpers.paths import ROOT
from helpers.runs import (
    assert_same_params,
    params,
    read_metrics,
    recorded_samples,
    wait_for_step_checkpoint,
)

from ddp_utils.lifecycle.preemption import PREEMPTED_EXIT

DDP_RUN = [sys.executable, "-m", "ddp_utils.launch"]

# Small batches give enough steps (71 per epoch at 2 processes: 1,438 samples, the last 18
# dropped for whole batches) to interrupt mid-epoch.
RUN = ("trainer.epochs=2", "data.batch_size=10", "trainer.ckpt_every_steps=10")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every interrupted one must match exactly."""
    run = tmp_path_factory.mktemp("reference")
    run_ranks("train.py", *RUN, f"run_dir={run}", nproc=2)
    return run


def test_sigkill_mid_epoch_then_elastic_restart_matches_uninterrupted(reference, tmp_path):
    proc = run_script(
        "train.py", *RUN, f"run_dir={tmp_path}", fault("kill", 97, 1),  # newest ckpt: 90
        nproc=2, launcher=("--max-restarts=1",),  # the kill: epoch 1, step 26 of 71
    )  # fmt: skip
    # The worker really died and torchrun restarted the group: two starts, the second resumed.
    # (Which exit code torchrun reports first, the killed rank's -9 or its peer's, is a race.)
    assert "failed (exitcode:" in proc.stderr
    log = (tmp_path / "train.log").read_text()
    assert log.count("| world size 2 |") == 2
    assert "resumed from" in log and "step 90" in log
    assert_same_params(params(tmp_path), params(reference))
    assert [r["step"] for r in read_metrics(tmp_path)] == [71, 142]


def _stop_step(out: str, signame: str) -> int:
    return int(out.split(f"stopped by {signame} at step ")[1].split(":")[0])


def test_sigterm_then_ctrl_c_each_checkpoint_the_stop_step_and_the_run_resumes_exactly(
    reference, tmp_path
):
    """One run stopped twice, each time resumed by the same command: SIGTERM to torchrun's
    agent (which forwards it to the workers), then Ctrl-C to ``ddp-run``'s process group (as a
    terminal sends it), then it finishes, equal to the uninterrupted run."""
    args = (*RUN, f"run_dir={tmp_path}")
    proc = start_script("train.py", *args, nproc=2)
    wait_for_step_checkpoint(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    log = (tmp_path / "train.log").read_text()
    assert f"exiting with code {PREEMPTED_EXIT}" in log, out + err
    first_stop = _stop_step(log, "SIGTERM")
    ckpt = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["step"] == first_stop < 142

    proc = subprocess.Popen(
        [*DDP_RUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *args],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    wait_for_step_checkpoint(tmp_path, proc, after=first_stop)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "resumed from" in out and out.count("stopped by SIGINT at step") == 1, out
    second_stop = _stop_step(out, "SIGINT")
    ckpt = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert first_stop < ckpt["step"] == second_stop < 142

    run_script("train.py", *args, nproc=2)
    assert_same_params(params(tmp_path), params(reference))


def test_no_loadable_checkpoint_stops_with_the_list_and_best_survives(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    ckpts = run / "checkpoints"
    for step_file in ckpts.glob("step_*.pt"):
        step_file.unlink()
    last = ckpts / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])  # truncated
    assert torch.load(ckpts / "best.pt", weights_only=True)["epoch"] == 2  # its own file
    metrics = (run / "metrics.jsonl").read_text()
    proc = run_forked("train.py", *RUN, "trainer.epochs=3", f"run_dir={run}")
    assert proc.returncode == 2, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert "found checkpoints" in line and "last.pt (" in line and "resume=PATH" in line
    assert "Other files there: best.pt" in line
    assert (run / "metrics.jsonl").read_text() == metrics


def test_sigterm_exit_code_of_a_plain_process(tmp_path):
    proc = start_script("train.py", *RUN, f"run_dir={tmp_path}")
    wait_for_step_checkpoint(tmp_path, proc)
    proc.send_signal(signal.SIGUSR1)  # what SLURM sends before a time limit
    proc.communicate(timeout=60)
    assert proc.returncode == PREEMPTED_EXIT


def test_torn_newest_checkpoint_resumes_from_the_previous_one(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    steps = sorted((run / "checkpoints").glob("step_*.pt"))
    assert [p.name for p in steps] == ["step_00000140.pt", "step_00000142.pt"]
    newest = steps[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # last.pt shares it
    proc = run_forked("train.py", *RUN, "trainer.epochs=3", f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "skipping a checkpoint that does not load" in proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "step_00000140.pt" in proc.stdout
    # From step 140 (1,380 samples into epoch 1) at world size 1, batch 10: the 58 left take
    # 5 whole steps, then epoch 2 takes 143.
    assert [r["step"] for r in read_metrics(run)] == [71, 145, 288]


@pytest.mark.parametrize("new_world_size", [3])  # 2 -> 1: tests/test_imagefolder_e2e.py
def test_resume_at_another_world_size_sees_each_sample_once(tmp_path_factory, new_world_size):
    """With data.drop_last=false every sample counts exactly once an epoch, whatever the
    world sizes before and after the resume."""
    every = (*RUN, "data.drop_last=false")
    base = tmp_path_factory.getbasetemp() / "reshard_base"
    if not base.exists():  # one interrupted run serves both parametrisations
        proc = run_script(
            "train.py", *every, f"run_dir={base}/run", both("kill", 95, 0, base), nproc=2,
            check=False,
        )  # fmt: skip
        assert proc.returncode != 0
    ckpt = torch.load(base / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["step"]) == (1, 90) and 0 < ckpt["sample_offset"] < 1438
    run, rec = base / f"run_w{new_world_size}", base / f"rec_w{new_world_size}"
    shutil.copytree(base / "run", run)
    rec.mkdir()
    proc = run_ranks("train.py", *every, f"run_dir={run}", recorder(rec), nproc=new_world_size)
    # the new length is said with what makes it up
    assert re.search(
        r"the run's length from here: \d+ optimizer steps in all, 90 done at world "
        rf"size 2 and \d+ to go at world size {new_world_size} \(\d+ an epoch\), "
        r"where this command started afresh would take \d+",
        proc.stdout,
    ), proc.stdout
    before = recorded_samples(base, epoch=1, max_step=ckpt["step"])
    after = recorded_samples(rec, epoch=1)
    seen = before + after
    assert sum(before.values()) == ckpt["sample_offset"]
    assert set(seen) == set(range(1438)) and set(seen.values()) == {1}


@pytest.mark.parametrize("case", ["malicious", "never", "changed_model"])
def test_resume_refusals(reference, tmp_path, case):
    marker = tmp_path / "code_ran"
    if case == "malicious":
        evil = write_malicious_checkpoint(tmp_path / "evil.pt", marker)
        args, expected = [f"resume={evil}", f"run_dir={tmp_path}/run"], "arbitrary unpickling"
    elif case == "never":
        args, expected = [f"run_dir={reference}", "resume=never"], "resume=auto"
    else:
        run = tmp_path / "run"
        shutil.copytree(reference, run)
        args, expected = [f"run_dir={run}", "model=mlp"], "model.name: 'convnet' -> 'mlp'"
    proc = run_forked("train.py", *RUN, *args)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_a_stalled_rank_ends_the_job_within_the_timeout(tmp_path):
    timeout_s = 10
    mark = tmp_path / "stall_began"
    start = time.time()
    proc = run_script(
        "train.py", *RUN, f"run_dir={tmp_path}/run", f"trainer.timeout_s={timeout_s}",
        fault("stall", 15, 1, mark=str(mark)), nproc=2, check=False,
    )  # fmt: skip
    ended = time.time()
    assert proc.returncode != 0
    stalled_at = float(mark.read_text())
    assert start < stalled_at < ended
    assert ended - stalled_at <= timeout_s + 8, (ended - stalled_at, proc.stderr[-6000:])
    assert "no training step for 10 s" in proc.stderr


def test_a_full_disk_stops_every_rank_with_one_message_and_resumes_exactly(reference, small_disk):
    run = small_disk / "run"
    filler = small_disk / "filler"
    # Room for a few 150 KB checkpoints: the disk fills within the first epoch.
    filler.write_bytes(b"\0" * (1024 * 1024 - 600 * 1024))
    proc = run_script("train.py", *RUN, f"run_dir={run}", nproc=2, check=False)
    assert proc.returncode != 0
    assert "exitcode: 4" in proc.stderr or "exit code 4" in proc.stderr, proc.stderr[-3000:]
    # Ours, not torchrun's: its summary after its traceback, its log lines (E1203 12:00...).
    err = proc.stderr.split("Traceback")[0]
    ours = [line for line in err.splitlines() if not re.match(r"[EWI]\d{4} ", line)]
    assert [line for line in ours if "error" in line.lower()] == [
        next(line for line in err.splitlines() if line.startswith("error: cannot write"))
    ], proc.stderr[-5000:]
    assert "No space left on device" in err and f"run_dir={run} has " in err and "free of" in err
    assert "trainer.keep_last=1" in err and f"{run}/checkpoints/last.pt" in err
    assert not list(run.rglob("*.tmp")), list(run.rglob("*"))
    saved = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert 0 < saved["step"] < 144
    filler.unlink()
    run_script("train.py", *RUN, f"run_dir={run}", "trainer.keep_last=1", nproc=2)
    assert_same_params(params(run), params(reference))
    assert [r["epoch"] for r in read_metrics(run)] == [0, 1]


def test_a_stalled_validation_loader_ends_the_job_within_the_timeout(tmp_path):
    # Long enough that no collective times out while the other test worker loads the cores
    # (at 8 s one did, once: rank 0 then reported its peer, not its own stalled loader).
    timeout_s = 15
    args = ("data=custom", "data._target_=imagefolders.stalling_datasets", "+data.stall_at=250",
            "data.in_channels=1", "data.image_size=8", "data.resize_size=8",
            "data.mean=[0.3]", "data.std=[0.38]", "data.num_workers=1", "trainer.epochs=1",
            f"trainer.timeout_s={timeout_s}",
            "logger=none", f"run_dir={tmp_path}/run")  # fmt: skip
    start = time.time()
    proc = run_script("train.py", *args, nproc=2, check=False, timeout=120,
                      env={"PYTHONPATH": str(ROOT / "tests")})  # fmt: skip
    assert proc.returncode != 0
    assert time.time() - start < timeout_s + 45, proc.stderr[-4000:]
    # Item 250 of 359 is on rank 0 (EvalShardSampler: batch 2 of 100 goes to rank 2 % 2 = 0).
    stalled = (
        f"error: no validation batch for {timeout_s} s (trainer.timeout_s): this rank is stuck in "
    )
    ours = [line for line in proc.stderr.split("Traceback")[0].splitlines()
            if "error" in line and not re.match(r"[EWI]\d{4} ", line)]  # fmt: skip
    assert len(ours) == 1 and stalled in ours[0] and "validation loader" in ours[0], ours
    assert f"traceback : {ours[0]}" in proc.stderr  # torchrun's root cause


def test_workers_and_their_loader_workers_stop_when_the_agent_alone_is_killed(tmp_path):
    """``kill -9`` of torchrun's agent (not its group: the OOM killer's way): within 10 s no
    process of the run is left, the lock is free, and the relaunch resumes exactly."""
    args = (*RUN, "data.loader=torch", "data.num_workers=1", "trainer.precision=32")
    reference = tmp_path / "reference"
    run_ranks("train.py", *args, f"run_dir={reference}", nproc=2)
    run = tmp_path / "run"
    # 0.1 s a step: 12 s of training are left when the agent dies.
    proc = start_script("train.py", *args, slow(0.1), f"run_dir={run}", nproc=2)
    wait_for_step_checkpoint(run, proc, after=20)
    assert kill_agent_alone(proc) == set()
    log = (run / "train.log").read_text()
    proc = run_script("train.py", *args, f"run_dir={run}", nproc=2)  # no "in use by" refusal
    assert "resumed from" in (run / "train.log").read_text()[len(log) :]
    assert_same_params(params(run), params(reference))
