"""The trackers for real: CSV, MLflow on a SQLite backend (read back with mlflow's client),
W&B offline, TensorBoard, all continued by a resume after SIGKILL; the mistakes."""

from __future__ import annotations

import csv
import json
import signal
import socket
import time

import pytest
from callbacks import fault
from helpers.launch import our_error_lines, run_ranks, run_script, start_script
from helpers.runs import read_metrics

from ddp_utils.lifecycle.preemption import PREEMPTED_EXIT

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")

# 18 steps per epoch at 2 processes (digits, batch 50): a step checkpoint every 5.
RUN = ("trainer.epochs=3", "data.batch_size=50", "trainer.ckpt_every_steps=5",
       "trainer.precision=32", "trainer.progress=false",
       "logger=[tensorboard,csv,mlflow,wandb]")  # fmt: skip


def test_every_tracker_continues_its_run_after_sigkill_with_each_step_once(tmp_path):
    run = tmp_path / "run"
    killed = run_script("train.py", *RUN, f"run_dir={run}", fault("kill", 42, 1), nproc=2,
                        check=False, launcher=("--max-restarts=1",))  # fmt: skip
    assert killed.returncode == 0, killed.stderr[-3000:]  # torchrun restarted it: resumed
    records = read_metrics(run)
    assert [r["epoch"] for r in records] == [0, 1, 2]
    # CSV: metrics.jsonl's records, row for row
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert len(rows) == 3
    for row, record in zip(rows, records, strict=True):
        assert {k: float(v) for k, v in row.items() if v != ""} == pytest.approx(
            {k: float(v) for k, v in record.items() if isinstance(v, (int, float))}
        )
    # MLflow: one run, its params, each metric once per step, the files as artifacts
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "ddp-recipes"]
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.data.params["optim.lr"] == "0.1" and mlrun.info.status == "FINISHED"
    assert mlrun.info.run_name == "run"
    history = client.get_metric_history(mlrun.info.run_id, "val/accuracy")
    assert [m.step for m in history] == [r["step"] for r in records]
    assert [m.value for m in history] == pytest.approx([r["val/accuracy"] for r in records])
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"config.yaml", "curves.png", "metrics.jsonl"} <= artifacts
    # eval.py on its checkpoint adds the evaluation to the same MLflow run
    run_ranks("eval.py", f"checkpoint={run}/checkpoints/best.pt", nproc=1)
    evaluated = json.loads((run / "eval.json").read_text())
    assert "eval.json" in {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    (metric,) = client.get_metric_history(mlrun.info.run_id, "eval/accuracy")
    assert metric.value == pytest.approx(evaluated["accuracy"])
    # W&B offline: one run id across the restart, its files in run_dir/wandb
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2  # the first attempt's and the resumed one's
    assert len({p.name.rsplit("-", 1)[1] for p in offline}) == 1
    assert all(list(p.glob("run-*.wandb")) for p in offline)
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_a_tracker_that_cannot_start_stops_before_training_and_one_that_fails_later_warns(
    tmp_path,
):
    run = tmp_path / "run"
    proc = run_script("train.py", "logger=[csv,mlflow]", "logger_cfg.mlflow.tracking_uri=nosuch://x",
                      f"run_dir={run}", "trainer.epochs=1", nproc=2, check=False)  # fmt: skip
    assert proc.returncode != 0  # rank 0 exits 2; torchrun reports the failed group as 1
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "logger=mlflow could not start" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr.split(lines[0])[0]  # (torchrun's own comes after)
    assert not (run / "metrics.jsonl").exists()
    proc = run_ranks("train.py", "logger=[csv,tests.callbacks.FlakyTracker]", f"run_dir={run}",
                     "trainer.epochs=3", "trainer.progress=false", nproc=1)  # fmt: skip
    warned = "logger=tests.callbacks.FlakyTracker stopped logging"
    assert (proc.stdout + proc.stderr).count(warned) == 1, proc.stderr[-2000:]
    assert len(read_metrics(run)) == 3
    assert len(list(csv.DictReader((run / "metrics.csv").open()))) == 3
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 2


@pytest.fixture
def silent_server():
    """A listener on 127.0.0.1 that takes connections (the kernel's backlog completes them)
    and never answers; its URI."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there now: connections are refused


@pytest.mark.parametrize("server", ["refuses", "never answers"])
def test_an_unreachable_tracking_server_stops_the_run_within_30_s_leaving_nothing(
    server, silent_server, tmp_path
):
    uri = closed_port() if server == "refuses" else silent_server
    run = tmp_path / "run"
    start = time.monotonic()
    proc = run_script("train.py", "logger=[tensorboard,csv,mlflow]",
                      f"logger_cfg.mlflow.tracking_uri={uri}",
                      f"run_dir={run}", "logger_cfg.mlflow.timeout_s=4", nproc=2,
                      check=False, timeout=120)  # fmt: skip
    took = time.monotonic() - start
    assert proc.returncode != 0 and "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert took < 30 + 15, took  # the tries, plus two processes' start-up
    ours = our_error_lines(proc.stderr)
    assert len(ours) == 1, proc.stderr[-3000:]
    assert f"logger_cfg.mlflow.tracking_uri={uri} did not answer" in ours[0]
    assert "leave mlflow out of logger" in ours[0]
    assert not run.exists(), list(run.rglob("*"))


def test_sigterm_while_a_tracker_blocks_stops_at_once_with_one_line(silent_server, tmp_path):
    run = tmp_path / "run"
    proc = start_script("train.py", "logger=mlflow",
                        f"logger_cfg.mlflow.tracking_uri={silent_server}",
                        "logger_cfg.mlflow.timeout_s=60", f"run_dir={run}")  # fmt: skip
    deadline = time.time() + 60
    while not (run / "config.yaml").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # in the tracker's first request
    proc.send_signal(signal.SIGTERM)
    stopped = time.time()
    out, err = proc.communicate(timeout=60)
    assert time.time() - stopped < 10
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["error: stopped by SIGTERM before the first training step; nothing was "
                     "saved; relaunch the same command to start again"], err[-3000:]  # fmt: skip
    assert not run.exists()
