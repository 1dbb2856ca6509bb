"""Optuna search for ``hydra/sweeper=optuna``: the search space, the study, ask and tell.

The Hydra plugin (``hydra_plugins/ddp_recipes_launcher/optuna_sweeper.py``) drives this on
global rank 0 only; the other ranks of an in-process sweep receive rank 0's trials. The keys
are those of the official ``hydra-optuna-sweeper`` (``params`` with ``interval(...)``,
``choice(...)``, ``range(...)``, ``tag(log, ...)``; ``sampler``, ``direction``, ``storage``,
``study_name``, ``n_trials``, ``n_jobs``, ``custom_search_space``), on current Optuna's
ask-and-tell API.

A seeded sampler (``sampler.seed``) of a continued study is seeded with ``seed`` plus the
number of trials the study already holds, so a relaunch draws new parameters.
A study in a database (``storage=sqlite:///PATH``) survives the sweep: the same command
continues it. The trials a killed sweep left RUNNING are marked FAIL (``interrupted``) and
their parameters are asked again first, so a retry runs from the start with the same
parameters, and only finished trials (COMPLETE, PRUNED, or FAIL by a crash of their own)
count towards ``n_trials``.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from ddp_utils.config import ConfigError
from ddp_utils.sweep.pruning import PRUNED_AT, register_trial

INTERRUPTED = "interrupted"  # user attr of a trial its sweep did not live to finish
SWEEPER = "sweeper"  # user attr: host:pid of the sweep that asked the trial
SYNTAX = ("interval(LOW, HIGH), tag(log, interval(LOW, HIGH)), tag(int, interval(LOW, HIGH)), "
          "choice(A, B, ...) or range(START, STOP[, STEP])")  # fmt: skip
DIRECTIONS = {"max": "maximize", "min": "minimize", "maximize": "maximize",
              "minimize": "minimize"}  # fmt: skip


def distribution(override: Override) -> BaseDistribution:
    """The Optuna distribution of one swept key (the official plugin's reading of it)."""
    key, value = override.get_key_element(), override.value()
    if isinstance(value, ChoiceSweep):
        return CategoricalDistribution([plain(x) for x in value.list])
    if isinstance(value, RangeSweep):
        if value.shuffle:
            raise ConfigError(f"hydra.sweeper.params.{key}: shuffle(range(...)) has no order "
                              "Optuna could use; write range(...) or choice(...).")  # fmt: skip
        return CategoricalDistribution(list(override.sweep_iterator()))
    if isinstance(value, IntervalSweep):
        low, high = value.start, value.end
        if low is None or high is None or not low < high:
            raise ConfigError(f"hydra.sweeper.params.{key}: interval({low}, {high}) needs "
                              "LOW < HIGH.")  # fmt: skip
        log = "log" in value.tags
        if log and low <= 0:
            raise ConfigError(f"hydra.sweeper.params.{key}: tag(log, interval(...)) needs a "
                              f"positive LOW (got {low}).")  # fmt: skip
        if "int" in value.tags:
            return IntDistribution(int(low), int(high), log=log)
        return FloatDistribution(low, high, log=log)
    raise ConfigError(f"hydra.sweeper.params.{key}={override.get_value_element_as_str()} is "
                      f"not a search space; write {SYNTAX}.")  # fmt: skip


def plain(x: Any) -> Any:
    """A choice as Optuna stores it: a number, string, bool or None as is, anything else as
    the override text Hydra reads back."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    from hydra.core.override_parser.types import Transformer

    return Transformer.encode(x)


def search_space(
    params: Mapping[str, Any] | None, arguments: Sequence[str]
) -> tuple[dict[str, BaseDistribution], list[str]]:
    """The distributions of ``hydra.sweeper.params`` and of the command line's sweeps (which
    win), and the command line's other overrides, given to every trial."""
    parser = OverridesParser.create()
    lines = [f"{k}={v}" for k, v in (params or {}).items()]
    try:
        from_config = parser.parse_overrides(lines)
        from_command = parser.parse_overrides(list(arguments))
    except Exception as e:  # Hydra's OverrideParseException, with the position
        message = " ".join(str(e).split())
        raise ConfigError(f"hydra.sweeper.params: {message}; write {SYNTAX}.") from None
    space, fixed = {}, []
    for o in from_config:
        if not o.is_sweep_override():
            fixed.append(o.input_line)
        else:
            space[o.get_key_element()] = distribution(o)
    for o in from_command:
        if o.is_sweep_override():
            space[o.get_key_element()] = distribution(o)
        else:
            fixed.append(o.input_line)
    if not space:
        raise ConfigError("hydra/sweeper=optuna has nothing to search: set hydra.sweeper.params "
                          f"(KEY: {SYNTAX}) or sweep a key on the command line.")  # fmt: skip
    return space, fixed


def override_text(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value!r}"
    if isinstance(value, str) and value and not any(c in value for c in " ,'\"=[]{}()"):
        return f"{key}={value}"
    if isinstance(value, str):
        return f"{key}='{value}'" if "'" not in value else f"{key}={value}"
    if isinstance(value, bool) or value is None:
        return f"{key}={'null' if value is None else str(value).lower()}"
    return f"{key}={value}"


def study_direction(direction: Any, monitor_mode: str | None) -> str:
    """``hydra.sweeper.direction``, or, when null, the one ``task.monitor_mode`` implies."""
    chosen = monitor_mode if direction is None else direction
    if isinstance(chosen, (list, tuple)) or str(chosen) not in DIRECTIONS:
        raise ConfigError(f"hydra.sweeper.direction={direction}: write minimize or maximize (or "
                          "leave it null to follow task.monitor_mode); one objective per "
                          "study.")  # fmt: skip
    return DIRECTIONS[str(chosen)]


@dataclass(frozen=True)
class Ask:
    """One trial to run: its number (the job's number and folder) and its overrides."""

    number: int
    params: dict[str, Any]

    def overrides(self, fixed: Sequence[str]) -> list[str]:
        return [*fixed, *(override_text(k, v) for k, v in self.params.items())]


class Search:
    """Rank 0's study: opened (or continued) at the start, asked and told trial by trial."""

    def __init__(self, sweeper: Mapping[str, Any], space: dict[str, BaseDistribution],
                 direction: str, default_name: str, custom: Any = None) -> None:  # fmt: skip
        self.space, self.n_trials = space, int(sweeper.get("n_trials") or 0)
        self.batch = max(1, int(sweeper.get("n_jobs") or 1))
        self.exhausted = False  # the sampler has no trial left to give (a finished grid)
        self.storage = sweeper.get("storage")
        self.custom = get_method(custom) if custom else None
        if self.n_trials < 1:
            raise ConfigError(f"hydra.sweeper.n_trials={self.n_trials}: needs at least 1.")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler_spec = sweeper.get("sampler")
        try:
            sampler, pruner = built(sampler_spec), built(sweeper.get("pruner"))
        except Exception as e:
            raise ConfigError(f"hydra.sweeper.sampler / pruner could not be built "
                              f"({type(e).__name__}: {str(e)[:300]}).") from None  # fmt: skip
        self.pruning = pruner is not None
        try:
            self.study = optuna.create_study(
                storage=self.storage, sampler=sampler, pruner=pruner or optuna.pruners.NopPruner(),
                study_name=sweeper.get("study_name") or default_name, direction=direction,
                load_if_exists=True,
            )  # fmt: skip
        except ValueError as e:  # a study of that name with another direction, ...
            raise ConfigError(f"hydra.sweeper: {e}") from None
        except Exception as e:  # a bad storage URL, an unreachable database
            raise ConfigError(
                f"hydra.sweeper.storage={self.storage}: Optuna could not open it "
                f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); write an RDB URL "
                "such as sqlite:///PATH/optuna.db, or null for a study in memory."
            ) from None
        stored = self.study.direction.name.lower()
        if stored != direction:
            raise ConfigError(
                f"hydra.sweeper: study {self.study.study_name} in {self.storage} is to {stored} "
                f"its objective, this sweep would {direction} it; set "
                "hydra.sweeper.study_name=NEW for a new study (or the direction it has)."
            )
        self.retries = self._fail_interrupted()
        self._advance_seed(sampler_spec)

    def _advance_seed(self, spec: Any) -> None:
        """A continued study's seeded sampler starts at ``seed + trials so far``: restarted
        at ``seed`` it would draw the first launch's parameters again, retraining what the
        study already has. The same study and command still draw the same trials."""
        so_far = len(self.study.get_trials(deepcopy=False))
        if not so_far or not isinstance(spec, Mapping) and not OmegaConf.is_config(spec):
            return
        if spec.get("seed") is None:
            return
        advanced = OmegaConf.to_container(OmegaConf.create(dict(spec))) | {
            "seed": int(spec["seed"]) + so_far}  # fmt: skip
        self.study.sampler = built(advanced)

    @property
    def name(self) -> str:
        return self.study.study_name

    def _fail_interrupted(self) -> list[dict[str, Any]]:
        """RUNNING trials left by a sweep that is gone: FAIL, and their params to ask again."""
        retries = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if sweeper_alive(t.user_attrs.get(SWEEPER, "")):
                continue  # another live sweep's trial (a study shared by several sweeps)
            self.study._storage.set_trial_user_attr(t._trial_id, INTERRUPTED, True)
            self.study.tell(t.number, state=TrialState.FAIL)
            retries.append(t.params)
        return retries

    def counted(self) -> int:
        """Trials that count towards n_trials: finished, not interrupted."""
        return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
            t.state == TrialState.FAIL and not t.user_attrs.get(INTERRUPTED))
            for t in self.study.get_trials(deepcopy=False))  # fmt: skip

    def ask(self, config: Any) -> list[Ask]:
        """The next batch (``n_jobs`` trials, fewer at the end; none when done)."""
        n = 0 if self.exhausted else min(self.batch, self.n_trials - self.counted())
        asks = []
        for _ in range(max(n, 0)):
            if self.retries:
                self.study.enqueue_trial(self.retries.pop(0))
            trial = self.study.ask(self.space)
            trial.set_user_attr(SWEEPER, f"{socket.gethostname()}:{os.getpid()}")
            if self.custom is not None:
                self.custom(config, trial)
            register_trial(trial)
            asks.append(Ask(trial.number, dict(trial.params)))
        return asks

    def tell(self, ask: Ask, completed: bool, value: Any, error: str | None,
             interrupted: bool = False) -> dict[str, Any]:  # fmt: skip
        """Record one finished job; what its job.json gains (trial, state, value, params).
        ``interrupted``: it did not finish for a reason outside it (a rank gone): FAIL, not
        counted towards n_trials."""
        trial = self.study.get_trials(deepcopy=False)[ask.number]
        if interrupted:
            self.study._storage.set_trial_user_attr(trial._trial_id, INTERRUPTED, True)
        if not completed:
            trial_state, told = TrialState.FAIL, None
        elif PRUNED_AT in trial.user_attrs:  # set by the trial's pruning callback
            trial_state, told = TrialState.PRUNED, None
        elif isinstance(value, (int, float)) and math.isfinite(value):
            trial_state, told = TrialState.COMPLETE, float(value)
        else:
            trial_state, told = TrialState.FAIL, None
            error = error or f"the objective was {value!r}, not a finite number"
        if error:
            self.study._storage.set_trial_user_attr(trial._trial_id, "error", error[:500])
        try:
            self.study.tell(ask.number, told, state=trial_state)
        except RuntimeError as e:
            # GridSampler asks the study to stop once its last grid point is told (Study.stop),
            # which optuna allows only inside optimize(): the trial is recorded all the same,
            # and there is no trial left to ask for.
            if "Study.stop" not in str(e):
                raise
            self.exhausted = True
        return {"trial": ask.number, "state": trial_state.name, "value": told,
                "params": ask.params, "direction": self.study.direction.name.lower()}  # fmt: skip

    def report(self) -> dict[str, Any]:
        """``optuna_study.json``: the study, where it is stored, every trial and the best."""
        trials = self.study.get_trials(deepcopy=False)
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        best = self.study.best_trial if done else None
        return {
            "study_name": self.name,
            "storage": self.storage,
            "direction": self.study.direction.name.lower(),
            "n_trials": self.n_trials,
            "best_trial": None if best is None else row(best),
            "trials": [row(t) for t in trials],
        }


def built(spec: Any) -> Any:
    """A sampler or pruner: Hydra builds the sweeper's nested ``_target_``s already; a plain
    mapping (a test's, a caller's) is built here."""
    if isinstance(spec, Mapping) or OmegaConf.is_config(spec):
        return instantiate(spec) if spec else None
    return spec


def row(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    attrs = {k: v for k, v in t.user_attrs.items() if k != SWEEPER}
    return {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
            **attrs}  # fmt: skip


def sweeper_alive(owner: str) -> bool:
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another host's sweep cannot be asked: a study has one sweep at a time
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
