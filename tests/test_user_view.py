"""The user's view of a torchrun run: one run directory, curves, TensorBoard, progress
output, and the doctor."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
import torch
from helpers.launch import child_env, free_port, run_script
from helpers.paths import ROOT
from helpers.runs import read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory):
    """One torchrun run of two ranks with the default run_dir, from a fresh working folder."""
    cwd = tmp_path_factory.mktemp("view")
    proc = run_script("train.py", "trainer.epochs=2", "trainer.log_every_steps=2", nproc=2,
                      cwd=cwd)  # fmt: skip
    runs = list((cwd / "outputs").iterdir()) if (cwd / "outputs").is_dir() else []
    assert len(runs) == 1, runs
    return runs[0], proc


def test_torchrun_two_ranks_share_one_run_dir(two_epoch_run):
    run, proc = two_epoch_run
    # Nothing but outputs/<one run>: no per-rank folders, no Hydra files.
    assert [p.name for p in run.parent.parent.iterdir()] == ["outputs"]
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "train.log", "metrics.jsonl"}
    assert not list(run.glob(".hydra")) and not list(run.glob("train.rank*.log"))
    log = (run / "train.log").read_text()
    assert "world size 2" in log and "global batch 200" in log
    assert "world size 2" in proc.stdout
    records = read_metrics(run)
    assert [r["epoch"] for r in records] == [0, 1]
    for r in records:
        assert {"epoch", "step", "lr", "train/loss", "val/accuracy", "val/num_samples",
                "samples_per_s", "mfu"} <= r.keys()  # fmt: skip
        assert r["val/num_samples"] == 359 and 0 < r["mfu"] < 1
    assert "model FLOPs: " in log and "GFLOP a training sample; peak" in log
    assert re.search(r"step 2/14 \| .* img/s \| mfu \d+\.\d% \|", log), log  # the progress line
    ckpt = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "config"} <= ckpt.keys()
    assert ckpt["step"] == records[-1]["step"] and ckpt["config"]["data"]["name"] == "digits"
    assert (run / "checkpoints" / "best.pt").is_file()


def test_curves_png_after_two_epochs(two_epoch_run, tmp_path):
    run, _ = two_epoch_run
    assert (run / "curves.png").read_bytes()[:8] == PNG
    # Several runs in one figure, from the command line.
    out = tmp_path / "both.png"
    subprocess.run([sys.executable, "-m", "ddp_utils.plot", str(run), str(run), "--out", str(out)],
                   check=True, cwd=ROOT, env=child_env())  # fmt: skip
    assert out.read_bytes()[:8] == PNG


def test_tensorboard_holds_the_scalars(two_epoch_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = two_epoch_run
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "lr", "val/accuracy", "samples_per_s", "mfu", "peak_memory_mb"} <= tags
    assert [e.step for e in events.Scalars("val/accuracy")] == [7, 14]


def test_environment_is_recorded(two_epoch_run):
    import json

    run, _ = two_epoch_run
    env = json.loads((run / "env.json").read_text())
    assert env["world_size"] == 2 and env["torch"] and "git_commit" in env


def test_output_to_a_file_has_no_bar_fragments(two_epoch_run):
    _, proc = two_epoch_run
    out = proc.stdout + proc.stderr
    assert "\r" not in out and "it/s" not in out and "%|" not in out
    assert "epoch 0 | step 2/14 | loss" in proc.stdout  # a plain line every log_every_steps


def test_only_the_main_rank_draws_a_bar(tmp_path):
    proc = run_script("train.py", "trainer.epochs=1", "trainer.progress=true",
                      "trainer.log_every_steps=2", f"run_dir={tmp_path}", nproc=2)  # fmt: skip
    # Each bar starts with one render at 0%: one bar, not one per rank.
    assert proc.stderr.count("epoch 0:   0%|") == 1, proc.stderr
    assert "loss=" in proc.stderr and "img_s=" in proc.stderr and "100%|" in proc.stderr
    assert "epoch 0 | step 2/8 | loss" not in proc.stdout  # the bar replaces the plain lines


def test_doctor_passes_with_two_cpu_processes():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "ddp_utils.doctor", "--device", "cpu"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in ("all_reduce", "broadcast", "all_gather"):
        assert f"ok    {check} correct on all 2 ranks" in proc.stdout
    assert "rank 1:" in proc.stdout and "bus bandwidth" in proc.stdout


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddp_utils.doctor", *args], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60)  # fmt: skip


def test_doctor_diagnoses_an_unreachable_endpoint():
    port = free_port()  # nothing listens there
    proc = doctor("--rdzv-endpoint", f"127.0.0.1:{port}")
    assert proc.returncode == 1
    assert "refused the connection" in proc.stdout and "fix: start the head node" in proc.stdout


def test_doctor_diagnoses_a_port_in_use():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = doctor("--port", str(port))
    assert proc.returncode == 1
    assert f"port {port} is already in use" in proc.stdout and "fix:" in proc.stdout


def test_trainer_profile_writes_a_trace_and_prints_where_the_steps_go(tmp_path, two_epoch_run):
    """trainer.profile=true on the default run: rank 0 records steps 8-12 (wait 5, warm-up 2,
    active 5), writes a Chrome/Perfetto trace under run_dir/profile and logs the phase and
    operator tables; off (the default), nothing is recorded."""
    import json

    run = tmp_path / "run"
    proc = run_script("train.py", "trainer.profile=true", "trainer.epochs=1",
                      "data.batch_size=20", "logger=none", f"run_dir={run}", nproc=2)  # fmt: skip
    (trace,) = (run / "profile").glob("rank0.step12.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "backward", "optimizer", "data"} <= names
    assert sum(1 for n in names if str(n).startswith("ProfilerStep")) == 5
    log = (run / "train.log").read_text()
    assert "profile of rank 0, 5 steps to step 12" in log and "top operators:" in log
    table = log.split("share of the steps")[1].split("top operators:")[0]
    shares = dict(re.findall(r"\n(\w+) +([\d.]+)%", table))
    assert set(shares) == {"data", "forward", "backward", "optimizer", "validation",
                           "checkpoint", "communication", "other"}  # fmt: skip
    assert 50 < sum(float(shares[p]) for p in ("data", "forward", "backward", "optimizer")) <= 100
    assert "profile of rank 0" in proc.stdout + proc.stderr
    assert not (two_epoch_run[0] / "profile").exists()  # off by default


def test_trainer_profile_explains_a_default_run_and_a_run_too_short_for_it(tmp_path):
    """At the default batch the window holds the epoch's end: validation and the checkpoint
    have rows of their own, and what no row explains stays small; a run shorter than the
    window says so."""
    run = tmp_path / "run"
    run_script("train.py", "trainer.profile=true", "trainer.max_steps=14", "logger=none",
               f"run_dir={run}", nproc=2)  # fmt: skip
    log = (run / "train.log").read_text()
    table = log.split("share of the steps")[1].split("top operators:")[0]
    shares = {k: float(v) for k, v in re.findall(r"\n(\w+) +([\d.]+)%", table)}
    assert shares["validation"] + shares["checkpoint"] > 0, table
    assert shares["other"] < 30, table
    short = tmp_path / "short"
    proc = run_script("train.py", "trainer.profile=true", "trainer.max_steps=5", "logger=none",
                      f"run_dir={short}", nproc=1)  # fmt: skip
    assert "before the profiler's window" in proc.stdout + proc.stderr
    assert not (short / "profile").exists()
