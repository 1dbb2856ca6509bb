"""The trackers for real: CSV, MLflow on a SQLite backend (read back with mlflow's client),
W&B offline, TensorBoard, all continued by a resume after SIGKILL; the mistakes."""

from __future__ import annotations

import csv
import json

import pytest
from callbacks import fault
from conftest import read_metrics, run_script

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
    run_script("eval.py", f"checkpoint={run}/checkpoints/best.pt")
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
    proc = run_script("train.py", "logger=[csv,tests.callbacks.FlakyTracker]", f"run_dir={run}",
                      "trainer.epochs=3", "trainer.progress=false")  # fmt: skip
    warned = "logger=tests.callbacks.FlakyTracker stopped logging"
    assert (proc.stdout + proc.stderr).count(warned) == 1, proc.stderr[-2000:]
    assert len(read_metrics(run)) == 3
    assert len(list(csv.DictReader((run / "metrics.csv").open()))) == 3
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 2
