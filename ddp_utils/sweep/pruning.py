"""Optuna pruning inside a trial: ``hydra.sweeper.pruner``.

At each validation the main rank reports ``val/<task.monitor>`` to the trial (step = the
optimizer step) and asks the pruner; the answer is broadcast, so every rank ends the trial
after the same validation (its checkpoint written), and the job ends cleanly (exit 0). The
sweep then records the trial as PRUNED.

The trial is found by number: in this process (an in-process sweep registers the trials it
asks), else in the study's database (each trial a torchrun or SLURM job), which the sweep
names in ``DDP_OPTUNA_TRIAL`` through ``hydra.job.env_set``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from ddp_utils.dist import broadcast_object
from ddp_utils.logs import log
from ddp_utils.train.callbacks import Callback

if TYPE_CHECKING:
    import optuna

    from ddp_utils.train.state import Training

TRIAL_ENV = "DDP_OPTUNA_TRIAL"
PRUNED_AT = "pruned_at_step"  # the user attr of a pruned trial, read by the sweep
_asked: dict[tuple[str, int], optuna.Trial] = {}  # (study name, number) -> this process's trial


def register_trial(trial: optuna.Trial) -> None:
    _asked[(trial.study.study_name, trial.number)] = trial


def trial_identity(study: str, storage: str | None, number: int, pruner: Any) -> str:
    """What a trial's job needs to find its trial (the value of ``DDP_OPTUNA_TRIAL``): a
    database keeps the study's trials but not its pruner, so the pruner's config comes too."""
    return json.dumps({"study": study, "storage": storage, "number": number, "pruner": pruner})


def find_trial(identity: dict[str, Any]) -> optuna.Trial:
    key = (identity["study"], int(identity["number"]))
    if key in _asked:
        return _asked[key]
    import optuna
    from hydra.utils import instantiate

    pruner = instantiate(identity["pruner"]) if identity.get("pruner") else None
    study = optuna.load_study(study_name=identity["study"], storage=identity["storage"],
                              pruner=pruner)  # fmt: skip
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, key[1])
    return optuna.trial.Trial(study, trial_id)


class OptunaPruning(Callback):
    """Report each validation to the trial; stop the run where the pruner says so."""

    def __init__(self, identity: str) -> None:
        self.identity = json.loads(identity)
        self.trial: optuna.Trial | None = None

    def on_train_start(self, tr: Training) -> None:
        if tr.rt.is_main:
            self.trial = find_trial(self.identity)

    def on_epoch_end(self, tr: Training, record: dict[str, Any]) -> None:
        prune = False
        if self.trial is not None:
            value = record.get(f"val/{tr.cfg.task.monitor}")
            if value is not None:
                self.trial.report(float(value), tr.step)
                prune = self.trial.should_prune()
            if prune:
                self.trial.set_user_attr(PRUNED_AT, tr.step)
        if broadcast_object(prune):  # every rank, every validation
            tr.stop_early = f"pruned by Optuna after step {tr.step}"
            if tr.rt.is_main:
                log.info("trial %d %s", self.identity["number"], tr.stop_early)


def sweep_callbacks() -> list[Callback]:
    """The callbacks a sweep asks for in this job (pruning, when its trial is named)."""
    identity = os.environ.get(TRIAL_ENV)
    return [OptunaPruning(identity)] if identity else []
