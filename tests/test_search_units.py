"""hydra/sweeper=optuna's pieces, and the trackers', in this process."""

from __future__ import annotations

import csv
import json
import os

import pytest

from ddp_utils.config import ConfigError

optuna = pytest.importorskip("optuna")
from optuna.distributions import (  # noqa: E402
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from ddp_utils.sweep.optuna_search import (  # noqa: E402
    INTERRUPTED,
    SWEEPER,
    Search,
    override_text,
    search_space,
    study_direction,
)


def test_the_official_plugins_param_syntax_reads_as_optuna_distributions():
    params = {"optim.lr": "tag(log, interval(0.001, 0.1))", "optim.weight_decay": "interval(0, 1)",
              "data.batch_size": "choice(32, 64)", "trainer.epochs": "range(1, 4)",
              "model.hidden": "tag(int, interval(8, 64))", "seed": "3"}  # fmt: skip
    space, fixed = search_space(params, ["optim=choice(sgd,adamw)", "trainer.epochs=2"])
    assert space["optim.lr"] == FloatDistribution(0.001, 0.1, log=True)
    assert space["optim.weight_decay"] == FloatDistribution(0.0, 1.0)
    assert space["data.batch_size"] == CategoricalDistribution([32, 64])
    assert space["trainer.epochs"] == CategoricalDistribution([1, 2, 3])
    assert space["model.hidden"] == IntDistribution(8, 64)
    assert space["optim"] == CategoricalDistribution(["sgd", "adamw"])
    assert fixed == ["seed=3", "trainer.epochs=2"]  # a plain command-line value is kept
    for bad, why in [({"optim.lr": "tag(log, interval(0, 1))"}, "positive LOW"),
                     ({"optim.lr": "interval(1, 0.5)"}, "LOW < HIGH"),
                     ({"optim.lr": "interval(0.1"}, "hydra.sweeper.params"),
                     ({}, "nothing to search")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            search_space(bad, [])


def test_suggested_values_become_overrides_hydra_reads_back():
    assert override_text("optim.lr", 0.012345678901234) == "optim.lr=0.012345678901234"
    assert override_text("data.batch_size", 64) == "data.batch_size=64"
    assert override_text("optim", "adamw") == "optim=adamw"
    assert override_text("x", "a b") == "x='a b'"
    assert override_text("x", True) == "x=true" and override_text("x", None) == "x=null"
    assert study_direction(None, "max") == "maximize"
    assert study_direction("minimize", "max") == "minimize"
    with pytest.raises(ConfigError, match="minimize or maximize"):
        study_direction(["maximize", "minimize"], "max")


def sweeper(storage, **kw):
    return {"storage": storage, "study_name": "s", "n_trials": 3, "n_jobs": 1,
            "sampler": {"_target_": "optuna.samplers.RandomSampler", "seed": 0}, **kw}  # fmt: skip


def test_a_relaunched_study_fails_the_interrupted_trial_and_asks_its_params_first(tmp_path):
    storage = f"sqlite:///{tmp_path / 'o.db'}"
    space, _ = search_space({"optim.lr": "interval(0.01, 0.1)"}, [])
    first = Search(sweeper(storage), space, "maximize", "train")
    (done,) = first.ask(None)
    assert first.tell(done, True, 0.5, None)["state"] == "COMPLETE"
    (killed,) = first.ask(None)  # its sweep dies mid-trial: the trial stays RUNNING
    trial_id = first.study.trials[killed.number]._trial_id
    first.study._storage.set_trial_user_attr(trial_id, SWEEPER, "gone-host:1")
    second = Search(sweeper(storage), space, "maximize", "train")
    states = [(t.state.name, t.user_attrs.get(INTERRUPTED)) for t in second.study.trials]
    assert states == [("COMPLETE", None), ("FAIL", True)]
    assert second.counted() == 1
    (retry,) = second.ask(None)
    assert retry.params == killed.params and retry.number == 2
    second.tell(retry, True, 0.7, None)
    (last,) = second.ask(None)
    second.tell(last, False, None, "RuntimeError: boom")  # a crash of its own counts
    assert second.ask(None) == [] and second.counted() == 3
    report = second.report()
    assert report["best_trial"]["number"] == 2 and report["best_trial"]["value"] == 0.7
    assert [t["state"] for t in report["trials"]] == ["COMPLETE", "FAIL", "COMPLETE", "FAIL"]
    with pytest.raises(ConfigError, match="is to maximize its objective, this sweep would"):
        Search(sweeper(storage), space, "minimize", "train")


@pytest.mark.parametrize("sampler", ["RandomSampler", "TPESampler"])
def test_a_continued_seeded_study_draws_new_parameters(tmp_path, sampler):
    storage = f"sqlite:///{tmp_path / 'o.db'}"
    space, _ = search_space(
        {"optim.lr": "interval(0.01, 0.1)", "data.batch_size": "choice(8, 16, 32)"}, []
    )
    spec = {"_target_": f"optuna.samplers.{sampler}", "seed": 1234}

    def launch(n_trials: int) -> None:
        search = Search(sweeper(storage, n_trials=n_trials, sampler=spec), space, "maximize", "t")
        while asks := search.ask(None):
            for a in asks:
                search.tell(a, True, a.params["optim.lr"], None)

    launch(2)
    launch(4)  # the same command, a larger budget
    trials = optuna.load_study(study_name="s", storage=storage).trials
    assert len(trials) == 4
    assert len({t.params["optim.lr"] for t in trials}) == 4
    # Deterministic all the same: a second study launched the same way draws the same trials.
    storage = f"sqlite:///{tmp_path / 'again.db'}"
    launch(2)
    launch(4)
    again = optuna.load_study(study_name="s", storage=storage).trials
    assert [t.params for t in again] == [t.params for t in trials]


@pytest.mark.parametrize("n_trials", [2, 3])
def test_a_grid_told_its_last_point_ends_the_search_with_every_trial_recorded(n_trials):
    """optuna's GridSampler stops the study at its last grid point (Study.stop, which raises
    outside optimize()): under torchrun rank 0 raised alone there and the other ranks waited
    for it until the timeout. The trial counts, and no trial is asked after it."""
    space, _ = search_space({"optim.lr": "choice(0.01, 0.02)"}, [])
    grid = {"_target_": "optuna.samplers.GridSampler", "seed": 0,
            "search_space": {"optim.lr": [0.01, 0.02]}}  # fmt: skip
    search = Search(sweeper(None, n_trials=n_trials, sampler=grid), space, "maximize", "t")
    told = []
    while asks := search.ask(None):
        told += [search.tell(a, True, a.params["optim.lr"], None) for a in asks]
    assert sorted(t["params"]["optim.lr"] for t in told) == [0.01, 0.02]
    assert [t["state"] for t in told] == ["COMPLETE", "COMPLETE"]
    assert search.report()["best_trial"]["params"] == {"optim.lr": 0.02}


def test_a_bad_storage_or_sampler_is_one_paragraph(tmp_path):
    space, _ = search_space({"optim.lr": "interval(0.01, 0.1)"}, [])
    with pytest.raises(ConfigError, match=r"hydra.sweeper.storage=nosuch://x: Optuna could not"):
        Search(sweeper("nosuch://x"), space, "maximize", "train")
    with pytest.raises(ConfigError, match="sampler / pruner could not be built"):
        Search(sweeper(None, sampler={"_target_": "optuna.samplers.NoSuch"}), space, "maximize",
               "train")  # fmt: skip


def test_logger_takes_one_name_a_list_or_none():
    from ddp_utils.config.logger import logger_names

    assert logger_names("tensorboard") == ["tensorboard"]
    assert logger_names(["tensorboard", "csv"]) == ["tensorboard", "csv"]
    assert logger_names("none") == [] and logger_names([]) == []
    assert logger_names(["csv", "pkg.Mine"]) == ["csv", "pkg.Mine"]
    with pytest.raises(ConfigError, match="logger=mlfow is not a tracker"):
        logger_names(["mlfow"])


def test_a_tracker_failing_mid_run_warns_once_and_is_dropped(tmp_path, caplog):
    from ddp_utils.tracking.base import TrackedRun, Tracker, Trackers

    class Breaks(Tracker):
        name = "breaks"

        def __init__(self):
            self.calls = 0

        def log(self, values, step):
            self.calls += 1
            raise OSError("disk full")

    class Fine(Tracker):
        name = "fine"
        seen = []

        def start(self, run):
            return 0  # it has logged nothing: it catches up on the history

        def log(self, values, step):
            self.seen.append((step, values))

    breaks, fine = Breaks(), Fine()
    trackers = Trackers(lambda: [breaks, fine])
    run = TrackedRun(tmp_path, "run", {"optim": {"lr": 0.1}}, {})
    trackers.start(run, [{"epoch": 0, "step": 5, "val/accuracy": 0.5}])
    with caplog.at_level("WARNING", logger="ddp_recipes"):
        trackers.log({"step": 10, "train/loss": 1.0}, 10)
        trackers.log({"step": 15, "train/loss": 0.5}, 15)
    assert breaks.calls == 1 and trackers.trackers == [fine]
    assert [s for s, _ in fine.seen] == [5, 10, 15] and fine.seen[0][1] == {"val/accuracy": 0.5}
    assert sum("logger=breaks stopped" in r.getMessage() for r in caplog.records) == 1

    class NoStart(Tracker):
        name = "nostart"

        def start(self, run):
            import no_such_tracking_package  # noqa: F401

    with pytest.raises(ConfigError, match=r"logger=nostart needs the no_such_tracking_package"):
        Trackers(lambda: [NoStart()]).start(run, [])


def test_csv_holds_metrics_jsonl_records_with_every_key(tmp_path):
    from ddp_utils.tracking.csvfile import write_csv

    records = [{"epoch": 0, "step": 3, "train/loss": 1.5},
               {"epoch": 1, "step": 6, "train/loss": 0.25, "val/accuracy": 0.875}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_csv(tmp_path, tmp_path / "metrics.csv")
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [{k: float(v) for k, v in r.items() if v != ""} for r in rows] == records
    assert not os.path.exists(tmp_path / "metrics.csv.tmp")


def test_a_diverged_trial_fails_alone_and_a_mistake_stops_the_search(tmp_path):
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from ddp_utils.checkpoint.finite import NonFiniteError
    from ddp_utils.sweep.driver import SearchRun

    config = OmegaConf.create({"task": {"monitor_mode": "max"}, "hydra": {
        "job": {"name": "train"}, "sweep": {"dir": str(tmp_path)}, "sweeper": {}}})  # fmt: skip
    run = SearchRun(config, sweeper(None, n_trials=4), ["optim.lr=interval(0.01, 0.1)"], True)

    def fail(outcome):
        number = run.next(config)[0]  # ask the next trial, then its job fails with outcome
        ret = JobReturn(overrides=[], status=JobStatus.FAILED)
        ret._return_value = outcome
        run.tell_all([ret], tmp_path)
        return json.loads((tmp_path / str(number) / "job.json").read_text())

    assert fail(NonFiniteError("diverged at step 3"))["state"] == "FAIL"
    assert fail(ConfigError("optim.lr=-1 is out of range"))["state"] == "FAIL"
    with pytest.raises(ConfigError, match="optim.lr=-1 is out of range"):
        run.next(config)  # the search stops: the same mistake would fail every trial


def test_a_trial_whose_peer_vanished_is_not_counted_and_stops_the_search(tmp_path):
    """The agent killed alone: one rank's watcher ends it first, and rank 0's trial fails
    with the collective's "Connection closed by peer" before its own watcher ends it."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from ddp_utils.sweep.driver import SearchRun, SweepFailed

    config = OmegaConf.create({"task": {"monitor_mode": "max"}, "hydra": {
        "job": {"name": "train"}, "sweep": {"dir": str(tmp_path)}, "sweeper": {}}})  # fmt: skip
    run = SearchRun(config, sweeper(None, n_trials=4), ["optim.lr=interval(0.01, 0.1)"], True)
    number = run.next(config)[0]
    ret = JobReturn(overrides=[], status=JobStatus.FAILED)
    ret._return_value = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")
    run.tell_all([ret], tmp_path)
    trial = run.search.study.trials[number]
    assert trial.state.name == "FAIL" and trial.user_attrs[INTERRUPTED] is True
    assert run.search.counted() == 0
    with pytest.raises(SweepFailed, match="another rank is gone; relaunch the same command"):
        run.next(config)


def suggest_momentum(cfg, trial) -> None:
    """A custom_search_space: momentum only for SGD (a conditional parameter)."""
    if trial.params["optim"] == "sgd":
        trial.suggest_float("optim.momentum", 0.8, 0.99)


def test_custom_search_space_adds_conditional_parameters_to_the_trials_overrides():
    space, fixed = search_space({"optim": "choice(sgd, adamw)"}, [])
    search = Search(sweeper(None, n_trials=6), space, "maximize", "train",
                    "test_search_units.suggest_momentum")  # fmt: skip
    asks = [search.ask(None)[0] for _ in range(6)]
    for ask in asks:
        assert ("optim.momentum" in ask.params) == (ask.params["optim"] == "sgd")
        search.tell(ask, True, 0.5, None)
    sgd = next(a for a in asks if a.params["optim"] == "sgd")
    assert f"optim.momentum={sgd.params['optim.momentum']!r}" in sgd.overrides(fixed)
