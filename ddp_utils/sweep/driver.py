"""The Optuna sweep's loop, on every rank: rank 0 asks, all ranks run, rank 0 tells.

An in-process sweep under torchrun runs every trial on every rank, so the trials (or the
reason to stop) travel from global rank 0 to the others before each launch, through the
process group the first trial then trains in. A launcher that runs each trial as a job of its
own leaves this process alone with the study.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from ddp_utils.config import ConfigError, UserError
from ddp_utils.dist import broadcast_object, init_distributed, read_launch_env
from ddp_utils.lifecycle.peers import lost_peer
from ddp_utils.logs import log
from ddp_utils.sweep.pruning import TRIAL_ENV, trial_identity
from ddp_utils.sweep.summary import add_to_job, write_summary

STUDY_FILE = "optuna_study.json"
Launch = Callable[[list[list[str]], int], list[JobReturn]]
Order = tuple[int, list[list[str]]]  # the first trial's number, each trial's overrides


class SweepFailed(UserError):
    """No trial of the study finished: the sweep exits non-zero (1), after its table."""

    exit_code = 1


def run_search(config: DictConfig, sweeper: Mapping[str, Any], arguments: Sequence[str],
               launch: Launch, in_process: bool) -> None:  # fmt: skip
    """Run the study to ``n_trials`` counted trials; the summary and optuna_study.json."""
    rank = read_launch_env().rank
    shared = in_process and read_launch_env().world_size > 1
    if shared:  # the group the trials will train in, joined now to agree on each trial
        init_distributed(OmegaConf.to_object(config.trainer))  # a TrainerConfig
    sweep_dir = Path(config.hydra.sweep.dir)
    run = agree(lambda: SearchRun(config, sweeper, arguments, in_process), rank, shared, False)
    while (order := agree(lambda: run.next(config), rank, shared)) is not None:
        returns = launch(order[1], order[0])
        if rank == 0:
            run.tell_all(returns, sweep_dir)
    agree(lambda: run.finish(sweep_dir), rank, shared, False)


def agree(make: Callable[[], Any], rank: int, shared: bool, share: bool = True) -> Any:
    """``make()`` on rank 0, and its result (``share``) or its ConfigError on every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = make()
        except UserError as e:
            error = e
    if shared:
        message, sent = broadcast_object((
            None if error is None else (str(error), isinstance(error, SweepFailed)),
            result if share else None))  # fmt: skip
        if rank != 0:
            result = sent
            error = None if message is None else (SweepFailed if message[1] else ConfigError)(
                message[0])  # fmt: skip
    if error is not None:
        raise error
    return result


class SearchRun:
    """Rank 0's side of the loop: the study, the fixed overrides, the trials in flight."""

    def __init__(self, config: DictConfig, sweeper: Mapping[str, Any], arguments: Sequence[str],
                 in_process: bool) -> None:  # fmt: skip
        try:
            from ddp_utils.sweep.optuna_search import Search, search_space, study_direction
        except ModuleNotFoundError as e:
            raise ConfigError(f"hydra/sweeper=optuna needs the {e.name} package: pip install "
                              "-e '.[optuna]' (make install installs it).") from None  # fmt: skip

        space, self.fixed = search_space(sweeper.get("params"), arguments)
        direction = study_direction(sweeper.get("direction"),
                                    OmegaConf.select(config, "task.monitor_mode"))  # fmt: skip
        self.search = Search(sweeper, space, direction, config.hydra.job.name,
                             sweeper.get("custom_search_space"))  # fmt: skip
        if self.search.pruning and not in_process and not self.search.storage:
            raise ConfigError(
                "hydra.sweeper.pruner with a launcher that runs each trial as its own job needs "
                "a study those jobs can reach: set hydra.sweeper.storage=sqlite:///PATH (on a "
                "filesystem they share)."
            )
        self.pruner = OmegaConf.to_container(config.hydra.sweeper.pruner, resolve=True) if (
            OmegaConf.is_config(config.hydra.sweeper.get("pruner"))) else None  # fmt: skip
        self.pending: list[Any] = []
        self.stop: ConfigError | None = None
        Path(config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)
        log.info("Optuna study %s (%s, %s): %d of %d trials done", self.search.name,
                 self.search.storage or "in memory", direction, self.search.counted(),
                 self.search.n_trials)  # fmt: skip

    def next(self, config: DictConfig) -> Order | None:
        if self.stop is not None:
            raise self.stop
        self.pending = self.search.ask(config)
        if not self.pending:
            return None
        return self.pending[0].number, [a.overrides(self.fixed) + self.names(a.number)
                                        for a in self.pending]  # fmt: skip

    def names(self, number: int) -> list[str]:
        """The override that names the trial to its job, for pruning."""
        if not self.search.pruning:
            return []
        identity = trial_identity(self.search.name, self.search.storage, number, self.pruner)
        # Without a prefix (train.yaml declares the key): Hydra leaves hydra.* overrides out of
        # the line it logs for each job, so the user sees the trial's own parameters only.
        return [f"hydra.job.env_set.{TRIAL_ENV}='{identity}'"]

    def tell_all(self, returns: Sequence[JobReturn], sweep_dir: Path) -> None:
        for ask, ret in zip(self.pending, returns, strict=True):
            completed = ret.status == JobStatus.COMPLETED
            outcome = ret._return_value
            # A rank that vanished (its launcher killed, a lost node) is no failure of the
            # trial's: it stays unfinished, is not counted, and a relaunch runs it again.
            gone = None if completed else lost_peer(outcome)
            fields = self.search.tell(ask, completed, outcome if completed else None,
                                      None if completed else str(outcome),
                                      interrupted=gone is not None)  # fmt: skip
            add_to_job(job_dir(ret, sweep_dir, ask.number), fields)
            if gone is not None:
                self.stop = SweepFailed(f"trial {ask.number} stopped: {gone}; relaunch the "
                                        "same command to go on with the study")  # fmt: skip
            elif not completed and is_mistake(outcome):
                self.stop = ConfigError(str(outcome))  # it would fail every trial the same
        write_summary(sweep_dir)

    def finish(self, sweep_dir: Path) -> None:
        report = self.search.report()
        (sweep_dir / STUDY_FILE).write_text(json.dumps(report, indent=2))
        if report["best_trial"] is None and not any(
            t["state"] == "PRUNED" for t in report["trials"]
        ):
            raise SweepFailed(f"no trial of study {report['study_name']} finished; see "
                              f"{sweep_dir / 'summary.csv'}")  # fmt: skip


def is_mistake(error: Any) -> bool:
    """A configuration mistake (exit code 2) stops the search; a trial of its own failing
    (a diverged run, exit code 3; a crash) is one FAIL, and the search goes on."""
    return isinstance(error, UserError) and getattr(error, "exit_code", 2) == 2


def job_dir(ret: JobReturn, sweep_dir: Path, number: int) -> Path:
    for cfg in (ret.hydra_cfg, ret.cfg):
        out = OmegaConf.select(cfg, "hydra.runtime.output_dir") if cfg is not None else None
        if out:
            return Path(out)
    return sweep_dir / str(number)
