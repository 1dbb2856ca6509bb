"""hydra/sweeper=optuna for real: in-process under torchrun (every rank on rank 0's trial, a
pruned trial stopping on both), each trial its own torchrun job, and a SQLite study killed
mid-trial and continued by the same command."""

from __future__ import annotations

import csv
import json
import time

import pytest
from callbacks import slow
from helpers.launch import kill_agent_alone, run_forked, run_script, start_script
from helpers.runs import read_metrics

optuna = pytest.importorskip("optuna")

SEARCH = ("-m", "+hparams_search=digits_optuna", "trainer.precision=32", "logger=none",
          "trainer.progress=false")  # fmt: skip
RECORD = "callbacks=[{_target_:tests.callbacks.TrialRecorder}]"
# A grid over a learning rate too small to learn (pruned at its first validation, where
# val/accuracy < 0.3) and one that learns: which trial gets which is the sampler's, the
# outcome of each is not.
GRID = ("-m", "hydra/sweeper=optuna", "trainer.precision=32", "logger=none",
        "trainer.progress=false",
        "hydra.sweeper.sampler={_target_:optuna.samplers.GridSampler,seed:0,"
        "search_space:{optim.lr:[0.000001,0.1],data.batch_size:[20,50]}}",
        "hydra.sweeper.params={optim.lr:'choice(0.000001,0.1)',data.batch_size:'choice(20,50)'}",
        "hydra.sweeper.pruner={_target_:optuna.pruners.ThresholdPruner,lower:0.3}")  # fmt: skip


def rows(sweep) -> list[dict]:
    return list(csv.DictReader((sweep / "summary.csv").open()))


def study(sweep) -> dict:
    return json.loads((sweep / "optuna_study.json").read_text())


def test_in_process_under_torchrun_every_rank_runs_rank_0s_trial_and_prunes_together(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_script("train.py", *GRID, "hydra.sweeper.n_trials=3", "trainer.epochs=3",
                      RECORD, f"hydra.sweep.dir={sweep}", nproc=2, timeout=400)  # fmt: skip
    trials = study(sweep)["trials"]
    assert len(trials) == 3 and len(rows(sweep)) == 3, proc.stdout
    for t in trials:
        job = sweep / str(t["number"])
        on_rank = [json.loads((job / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert on_rank[0] == on_rank[1]
        assert on_rank[0]["optim.lr"] == t["params"]["optim.lr"]
        assert on_rank[0]["data.batch_size"] == t["params"]["data.batch_size"]
        epochs = [r["epoch"] for r in read_metrics(job)]
        if t["params"]["optim.lr"] < 0.001:  # pruned after its first validation, both ranks
            assert t["state"] == "PRUNED" and epochs == [0] and t["pruned_at_step"] > 0
        else:
            assert t["state"] == "COMPLETE" and epochs == [0, 1, 2]
            assert t["value"] == max(r["val/accuracy"] for r in read_metrics(job))
    best = study(sweep)["best_trial"]
    assert best["value"] == max(t["value"] or 0 for t in trials)
    assert f"best: trial {best['number']}" in proc.stdout
    table = {r["trial"]: r for r in rows(sweep)}
    assert {r["state"] for r in table.values()} == {"PRUNED", "COMPLETE"}
    assert "optim.lr=" in table[str(best["number"])]["params"]
    # the trial's name for its pruning callback is Hydra's, not one of the job's overrides,
    # nor in the line Hydra logs for each job
    assert all("hydra" not in r["overrides"] for r in table.values())
    assert "DDP_OPTUNA_TRIAL" not in proc.stdout + proc.stderr


def test_each_trial_its_own_torchrun_job_with_a_sqlite_study_and_pruning(tmp_path):
    sweep, db = tmp_path / "sweep", tmp_path / "optuna.db"
    run_script("train.py", *GRID, "hydra.sweeper.n_trials=2", "trainer.epochs=2",
               "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2",
               f"hydra.sweeper.storage=sqlite:///{db}", f"hydra.sweep.dir={sweep}",
               timeout=400)  # fmt: skip
    stored = optuna.load_study(study_name="train", storage=f"sqlite:///{db}")
    assert len(stored.trials) == 2
    for t in stored.trials:
        records = read_metrics(sweep / str(t.number))
        assert records[-1]["world_size"] == 2
        expected = "PRUNED" if t.params["optim.lr"] < 0.001 else "COMPLETE"
        assert t.state.name == expected, (t.params, records)
    assert study(sweep)["storage"] == f"sqlite:///{db}"


def test_a_sqlite_study_killed_mid_trial_continues_without_rerunning(tmp_path):
    sweep, db = tmp_path / "sweep", tmp_path / "optuna.db"
    command = (*SEARCH, "hydra.sweeper.n_trials=3", "trainer.epochs=1", "data.val_fraction=0.5",
               f"hydra.sweeper.storage=sqlite:///{db}", f"hydra.sweep.dir={sweep}",
               "callbacks=[{_target_:tests.callbacks.KillInJob,job:1,step:3}]")  # fmt: skip
    killed = run_forked("train.py", *command, timeout=300)
    assert killed.returncode == -9  # SIGKILL in trial 1
    first = (sweep / "0" / "metrics.jsonl").read_text()
    again = run_forked("train.py", *command, timeout=300)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    stored = optuna.load_study(study_name="digits_optuna", storage=f"sqlite:///{db}")
    states = [(t.number, t.state.name, t.user_attrs.get("interrupted")) for t in stored.trials]
    assert states == [(0, "COMPLETE", None), (1, "FAIL", True), (2, "COMPLETE", None),
                      (3, "COMPLETE", None)]  # fmt: skip
    assert stored.trials[2].params == stored.trials[1].params  # the retry, from the start
    assert (sweep / "0" / "metrics.jsonl").read_text() == first  # trial 0 was not rerun
    assert {r["trial"] for r in rows(sweep)} >= {"0", "2", "3"}


def test_a_sweep_whose_agent_alone_is_killed_stops_and_its_relaunch_finishes_n_trials(tmp_path):
    """The agent's SIGKILL ends both ranks within 10 s (they take no further trial); the trial
    they were on is not counted, and the same command then runs until 3 trials really
    finished."""
    sweep, db = tmp_path / "sweep", tmp_path / "optuna.db"
    command = (*SEARCH, "hydra.sweeper.n_trials=3", "trainer.epochs=1", "data.val_fraction=0.5",
               f"hydra.sweeper.storage=sqlite:///{db}", f"hydra.sweep.dir={sweep}",
               slow(0.2))  # fmt: skip
    proc = start_script("train.py", *command, nproc=2)
    deadline = time.time() + 240
    while not (sweep / "1" / "train.log").is_file() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # trial 1 is training
    assert kill_agent_alone(proc) == set()
    run_script("train.py", *command, nproc=2, timeout=400)
    stored = optuna.load_study(study_name="digits_optuna", storage=f"sqlite:///{db}")
    states = [(t.state.name, t.user_attrs.get("interrupted")) for t in stored.trials]
    assert [s for s in states if s[0] == "COMPLETE"] == [("COMPLETE", None)] * 3, states
    assert all(s == ("FAIL", True) for s in states if s[0] != "COMPLETE"), states


def test_a_continued_seeded_study_draws_new_parameters(tmp_path):
    db = tmp_path / "optuna.db"
    command = (*SEARCH, "trainer.epochs=1", "data.val_fraction=0.5",
               f"hydra.sweeper.storage=sqlite:///{db}")  # fmt: skip
    for trials, folder in ((2, "first"), (4, "second")):
        proc = run_forked("train.py", *command, f"hydra.sweeper.n_trials={trials}",
                          f"hydra.sweep.dir={tmp_path / folder}", timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    stored = optuna.load_study(study_name="digits_optuna", storage=f"sqlite:///{db}")
    assert [t.state.name for t in stored.trials] == ["COMPLETE"] * 4
    drawn = [tuple(sorted(t.params.items())) for t in stored.trials]
    assert len(set(drawn)) == 4, drawn
