"""Detection end to end: experiment=digits_detection trains at world size 2; its last
validation mAP equals eval.py's on last.pt at world sizes 1, 2 and 3 (359 validation canvases:
a prime, so the shards are uneven); predictions.png is drawn; a SIGKILL'd run resumes to the
same parameters as an uninterrupted one."""

from __future__ import annotations

import csv
import json

import pytest
from callbacks import fault
from helpers.launch import run_ranks, run_script
from helpers.runs import assert_same_params, eval_at_world_sizes, params, read_metrics

pytest.importorskip(
    "faster_coco_eval", reason="mAP needs faster-coco-eval (make install: the [det] extra)"
)

# Short: a few hundred canvases a rank, in fp32 so parameters compare exactly.
# 44 steps an epoch at 2 processes; step checkpoints every 10 give a resume point mid-epoch.
RUN = ("experiment=digits_detection", "trainer.epochs=2", "trainer.precision=32",
       "trainer.ckpt_every_steps=10")  # fmt: skip
MAP_KEYS = ("map", "map_50", "map_75", "map_per_class")


@pytest.fixture(scope="module")
def det_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("det")
    run_ranks("train.py", *RUN, f"run_dir={run}", nproc=2, timeout=900)
    return run


def test_training_validation_and_eval_give_the_same_map_at_world_sizes_1_2_3(det_run, tmp_path):
    records = read_metrics(det_run)
    assert [r["epoch"] for r in records] == [0, 1] and records[-1]["val/num_samples"] == 359
    assert records[-1]["val/map_50"] > records[0]["val/map_50"] >= 0  # it learns
    results = eval_at_world_sizes(det_run / "checkpoints" / "last.pt", tmp_path)
    base = results[None]
    assert base["num_samples"] == 359 and 0 < base["map_50"] <= 1
    for n, r in results.items():
        for key in MAP_KEYS:
            assert r[key] == base[key], (n, key)
    assert base["map"] == records[-1]["val/map"]  # training's validation: the same code
    assert (det_run / "predictions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sigkilled_detection_run_resumes_to_the_same_parameters(det_run, tmp_path):
    """Rank 1 killed at step 57 (epoch 1), torchrun restarts the group, which resumes from
    step 50: the end is the uninterrupted run's, bit for bit, EMA-free and in fp32."""
    proc = run_script("train.py", *RUN, f"run_dir={tmp_path}", fault("kill", 57, 1), nproc=2,
                      launcher=("--max-restarts=1",), timeout=900)  # fmt: skip
    assert "failed (exitcode:" in proc.stderr
    log = (tmp_path / "train.log").read_text()
    assert "resumed from" in log and "step 50" in log
    assert_same_params(params(tmp_path), params(det_run))
    assert [r["step"] for r in read_metrics(tmp_path)] == [44, 88]
    assert read_metrics(tmp_path)[-1]["val/map"] == read_metrics(det_run)[-1]["val/map"]


def test_a_torchvision_detector_scores_the_same_at_world_sizes_1_2_3(tmp_path):
    """fasterrcnn_mobilenet_v3_large_320_fpn by name, a few steps at world size 2 (untrained
    weights: the numbers only need to be the same), then eval.py at 1, 2 and 3 processes, on
    89 validation canvases (a prime: uneven shards)."""
    run = tmp_path / "run"
    run_ranks("train.py", "experiment=digits_detection", "model=torchvision_det",
              "data.val_fraction=0.0495", "trainer.max_steps=6", "trainer.precision=32",
              f"run_dir={run}", nproc=2, timeout=900)  # fmt: skip
    results = eval_at_world_sizes(run / "checkpoints" / "last.pt", tmp_path)
    base = results[None]
    assert base["num_samples"] == 89
    for n, r in results.items():
        for key in MAP_KEYS:
            assert r[key] == base[key], (n, key)
    assert base["map"] == read_metrics(run)[-1]["val/map"]


def test_an_optuna_sweep_of_detection_in_bf16_with_ema_and_trackers(tmp_path):
    """Two trials (a grid over the learning rate) of the recipe at world size 2 in bf16 with
    an EMA, two validations each, logged to CSV and MLflow: each trial's objective is its best
    val/map, the trackers hold the scalar mAPs (map_per_class, a list, left out), and eval.py
    on best_ema.pt with ema=true gives the val_ema/map it was kept for."""
    pytest.importorskip("optuna")
    mlflow = pytest.importorskip("mlflow")
    sweep = tmp_path / "sweep"
    run_script("train.py", "-m", "experiment=digits_detection", "hydra/sweeper=optuna",
               "hydra.sweeper.n_trials=2",
               "hydra.sweeper.sampler={_target_:optuna.samplers.GridSampler,seed:0,"
               "search_space:{optim.lr:[0.01,0.02]}}",
               "hydra.sweeper.params={optim.lr:'choice(0.01,0.02)'}", "trainer.max_steps=16",
               "trainer.val_every_steps=8", "data.val_fraction=0.0495", "trainer.precision=bf16",
               "trainer.ema_decay=0.9", "trainer.ema_every_steps=4",
               "trainer.save_best_ema=true", "logger=[csv,mlflow]", "trainer.progress=false",
               f"hydra.sweep.dir={sweep}", nproc=2, timeout=900)  # fmt: skip
    trials = json.loads((sweep / "optuna_study.json").read_text())["trials"]
    assert sorted(t["params"]["optim.lr"] for t in trials) == [0.01, 0.02]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{sweep / 'mlruns.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "ddp-recipes"]
    assert len(client.search_runs([experiment.experiment_id])) == 2
    for t in trials:
        job = sweep / str(t["number"])
        records = read_metrics(job)
        assert t["state"] == "COMPLETE" and t["value"] == max(r["val/map"] for r in records)
        assert all(0 <= r["val_ema/map"] <= 1 for r in records)
        rows = list(csv.DictReader((job / "metrics.csv").open()))
        assert [float(r["val/map"]) for r in rows] == [r["val/map"] for r in records]
        assert "val/map_per_class" not in rows[0]
        out = tmp_path / f"eval{t['number']}.json"
        run_ranks("eval.py", f"checkpoint={job}/checkpoints/best_ema.pt", "ema=true",
                  f"output={out}", nproc=1)  # fmt: skip
        assert json.loads(out.read_text())["map"] == max(r["val_ema/map"] for r in records)
