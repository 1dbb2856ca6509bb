"""torchmetrics as the metrics engine: users' metrics from the command line, best.pt by
task.monitor, the same numbers at any world size, and clear errors for a bad metric."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.launch import run_forked, run_ranks
from helpers.paths import ROOT, documentation
from helpers.runs import eval_at_world_sizes, read_metrics

AUROC = ("+task.metrics.auroc._target_=torchmetrics.classification.MulticlassAUROC",
         "+task.metrics.auroc.num_classes=${data.num_classes}")  # fmt: skip


@pytest.fixture(scope="module")
def auroc_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("auroc_run")
    run_ranks("train.py", "trainer.epochs=3", "trainer.precision=32", *AUROC,
              "task.monitor=auroc", "logger=none", f"run_dir={run}", nproc=2)  # fmt: skip
    return run


def test_a_users_metric_is_logged_and_picks_best_pt(auroc_run):
    records = read_metrics(auroc_run)
    assert all(0.5 < r["val/auroc"] <= 1 for r in records)
    assert all(
        {"val/accuracy", "val/top5", "val/f1_macro", "val/loss"} <= r.keys() for r in records
    )
    best = max(records, key=lambda r: r["val/auroc"])
    assert (
        torch.load(auroc_run / "checkpoints" / "best.pt", weights_only=True)["step"]
        == (best["step"])
    )


def test_every_metric_is_the_same_at_world_sizes_1_2_and_3(auroc_run, tmp_path):
    """359 validation digits: no world size here divides them, none is padded."""
    results = eval_at_world_sizes(auroc_run / "checkpoints" / "last.pt", tmp_path)
    base, logged = results[None], read_metrics(auroc_run)[-1]
    assert base["num_samples"] == 359  # a prime: no world size divides it
    # Training's last validation is eval.py's, to the last digit.
    assert {k: base[k] for k in ("auroc", "loss", "accuracy", "f1_macro", "top5")} == {
        k: logged[f"val/{k}"] for k in ("auroc", "loss", "accuracy", "f1_macro", "top5")
    }
    keys = ("accuracy", "top5", "f1_macro", "per_class_accuracy", "confusion_matrix", "auroc",
            "loss", "num_samples")  # fmt: skip
    for n, r in results.items():
        assert {k: r[k] for k in keys} == {k: base[k] for k in keys}, n


def test_eval_adds_and_drops_metrics_from_the_command_line(auroc_run, tmp_path):
    out = tmp_path / "eval.json"
    proc = run_forked(
        "eval.py", f"checkpoint={auroc_run}/checkpoints/last.pt", f"output={out}",
        "+task.metrics.ap._target_=torchmetrics.classification.MulticlassAveragePrecision",
        "+task.metrics.ap.num_classes=10", "++task.metrics.auroc=null", "task.monitor=accuracy",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert 0.5 < result["ap"] <= 1 and "auroc" not in result


BAD_METRICS = {
    "no module": (["+task.metrics.x._target_=torchmetrics.nowhere.Metric"],
                  "task.metrics.x._target_=torchmetrics.nowhere.Metric cannot be imported"),
    "no class count": (["+task.metrics.x._target_=torchmetrics.classification.MulticlassAUROC"],
                       "task.metrics.x: torchmetrics.classification.MulticlassAUROC rejected"),
    "wrong class count": ([*AUROC[:1], "+task.metrics.auroc.num_classes=3"],
                          "task.metrics.auroc (MulticlassAUROC) cannot take this task's batches"),
    "not a metric": (["+task.metrics.x._target_=torch.nn.Identity"],
                     "built a Identity, not a torchmetrics.Metric"),
    "monitor": (["task.monitor=auc"], "task.monitor=auc is not among the metrics (accuracy, "),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_METRICS)
def test_a_bad_metric_is_one_paragraph_before_training(case, tmp_path):
    overrides, expected = BAD_METRICS[case]
    proc = run_forked("train.py", *overrides, f"run_dir={tmp_path}/run")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


TASK = ("task=custom", "task._target_=custom_tasks.DigitValue", "task.monitor=mae")


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory):
    """docs/extend/task.md's custom task: the digits' value regressed with MSE, scored by MAE."""
    run = tmp_path_factory.mktemp("regression")
    run_ranks("train.py", *TASK, "optim.lr=0.01", "trainer.precision=32", "logger=none",
              f"run_dir={run}", nproc=2, env={"PYTHONPATH": str(ROOT / "tests")})  # fmt: skip
    return run


def test_a_custom_task_trains_picks_best_by_its_metric_and_evaluates(regression_run, tmp_path):
    records = read_metrics(regression_run)
    assert "val/accuracy" not in records[-1] and records[-1]["val/mae"] < 1.4, records[-1]
    best = min(records, key=lambda r: r["val/mae"])  # task.monitor_mode=min (task=custom)
    out = tmp_path / "eval.json"
    proc = run_forked("eval.py", f"checkpoint={regression_run}/checkpoints/best.pt",
                      f"output={out}", env={"PYTHONPATH": str(ROOT / "tests")})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    # A float sum, added in another order at another world size: equal to the last bits.
    assert result["mae"] == pytest.approx(best["val/mae"], rel=1e-6)
    assert result["loss"] == pytest.approx(best["val/loss"], rel=1e-6)
    assert "confusion_matrix" not in result and not (tmp_path / "confusion_matrix.png").exists()


def test_the_readmes_custom_task_is_the_tested_one():
    readme = documentation()
    code = (ROOT / "tests" / "custom_tasks.py").read_text()
    example = code.split("\n\n\nclass NoEvalStep")[0].strip()
    assert f"```python\n# mypkg/tasks.py\n{example.split(chr(10), 1)[1].strip()}\n```" in readme
    assert len(example.splitlines()) <= 31  # the module docstring, then at most 30 lines


BAD_TASKS = {
    "no eval_step": (["task=custom", "task._target_=custom_tasks.NoEvalStep"],
                     "task._target_=custom_tasks.NoEvalStep has no eval_step"),
    "no target": (["task=custom"], "task=custom needs task._target_=pkg.module.MyTask"),
    "no module": (["task=custom", "task._target_=nosuch.Task"],  # no Hydra lines before it
                  "task._target_=nosuch.Task cannot be imported"),
    "mixup": ([*TASK, "data.mixup_alpha=0.2"],
              "data.mixup_alpha only apply to task=classification (this is task=custom)"),
    "argument": ([*TASK, "+task.depth=3"], "custom_tasks.DigitValue rejected its arguments"),
    "per-sample loss": (["task=custom", "task._target_=custom_tasks.PerSampleLoss"],
                        "PerSampleLoss.train_loss returned a tensor of shape (2,) as its loss"),
    "no count": (["task=custom", "task._target_=custom_tasks.NoCount"],
                 "NoCount.train_loss returned a tensor of shape (), not a pair"),
    "mean for sum": (["task=custom", "task._target_=custom_tasks.MeanLoss"],
                     "MeanLoss.train_loss's loss stayed"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_TASKS)
def test_a_bad_task_is_one_paragraph_before_training(case, tmp_path):
    overrides, expected = BAD_TASKS[case]
    proc = run_forked("train.py", *overrides, f"run_dir={tmp_path}/run",
                      env={"PYTHONPATH": str(ROOT / "tests")})  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "run").exists()
