"""Training-time validation scores the model that is saved: at world size 2 with BatchNorm,
every logged number is what eval.py gives on the checkpoint, at any world size."""

from __future__ import annotations

import json

import pytest
from callbacks import dump_validation
from helpers.launch import run_forked, run_ranks
from helpers.runs import read_metrics

# 1,438 digits at batch 100 on 2 ranks: 8 steps an epoch. The EMA decay gives an average that
# differs from the weights (and holds BatchNorm statistics of its own: use_buffers).
ARGS = ("trainer.epochs=3", "trainer.precision=32", "trainer.ema_decay=0.995",
        "trainer.ema_every_steps=1", "trainer.save_best_ema=true")  # fmt: skip


@pytest.fixture(scope="module")
def bn_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("bn_run")
    run_ranks("train.py", *ARGS, f"run_dir={run}", dump_validation(run / "val"), nproc=2)
    return run


def evaluate(run, name: str, out, nproc: int | None = None, ema: bool = False) -> dict:
    args = (f"checkpoint={run}/checkpoints/{name}", f"ema={str(ema).lower()}", f"output={out}")
    if nproc is None:  # one process: a fork of this one, no second torch import
        proc = run_forked("eval.py", *args)
        assert proc.returncode == 0, proc.stderr
    else:
        run_ranks("eval.py", *args, nproc=nproc)
    return json.loads(out.read_text())


def assert_same_scores(result: dict, validation: dict, record: dict, prefix: str) -> None:
    assert result["num_samples"] == record[f"{prefix}/num_samples"] == 359
    assert result["accuracy"] == record[f"{prefix}/accuracy"] == validation["accuracy"]
    assert result["confusion_matrix"] == validation["confusion_matrix"]
    assert abs(result["loss"] - record[f"{prefix}/loss"]) <= 1e-6


def test_logged_validation_is_what_eval_gives_on_the_checkpoints(bn_run, tmp_path):
    records = read_metrics(bn_run)
    last = json.loads((bn_run / "val" / f"epoch{len(records) - 1}.json").read_text())
    for nproc in (None, 3):
        result = evaluate(bn_run, "last.pt", tmp_path / f"last{nproc}.json", nproc)
        assert_same_scores(result, last["val"], records[-1], "val")
    result = evaluate(bn_run, "last.pt", tmp_path / "last_ema.json", ema=True)
    assert_same_scores(result, last["val_ema"], records[-1], "val_ema")
    # best.pt and best_ema.pt: the first epoch of the best logged accuracy (a strict '>').
    for name, prefix in (("best.pt", "val"), ("best_ema.pt", "val_ema")):
        best = max(records, key=lambda r: r[f"{prefix}/accuracy"])
        epoch = json.loads((bn_run / "val" / f"epoch{best['epoch']}.json").read_text())
        result = evaluate(bn_run, name, tmp_path / f"{name}.json", ema=prefix == "val_ema")
        assert_same_scores(result, epoch[prefix], best, prefix)
