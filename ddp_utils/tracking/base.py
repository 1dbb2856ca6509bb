"""The tracker interface, and the fan-out the training loop talks to.

``logger=[tensorboard,csv,mlflow,wandb]`` (or one name, or ``none``) picks trackers by name
from ``logger_cfg``; an entry with a dot is a class of yours (``logger=[csv,pkg.MyTracker]``),
built with no arguments. Only the main rank builds trackers. Each starts after the resume (a
resumed run continues its tracker run: the ids are in the checkpoint) and gets the records
metrics.jsonl holds that it has not logged yet, so a killed run's tracker has every step
once. A tracker that cannot start stops the run before training (exit 2, on every rank); one
that fails later warns once and is dropped: metrics.jsonl stays the record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_utils.config import ConfigError, UserError
from ddp_utils.dist import broadcast_object
from ddp_utils.logs import log


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker starts from."""

    run_dir: Path
    name: str  # the run_dir's name: a tracker run's name
    config: dict[str, Any]  # the resolved config, as stored in checkpoints
    resumed: dict[str, dict[str, Any]]  # each tracker's state from the checkpoint (run ids)

    def resumed_state(self, name: str) -> dict[str, Any] | None:
        return self.resumed.get(name)


class Tracker:
    """One tracker. ``start`` returns the step it has logged through (None: nothing to catch
    up on), ``state`` what the checkpoint keeps for the resume."""

    name = "tracker"
    running = True  # also takes the running loss logged between records

    def start(self, run: TrackedRun) -> int | None:
        return None

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        return {}

    def finish(self, files: list[Path]) -> None:
        """At the end of training: the run's files (config.yaml, curves.png, ...)."""

    def close(self) -> None:
        """Always called last (after ``finish``, or on a failure or a stop instead)."""


class Trackers:
    """The main rank's trackers; on the other ranks, none (they only join the agreement)."""

    def __init__(self, make: Callable[[], list[Tracker]] | None = None) -> None:
        self.make, self.trackers, self._warned = make, [], set()
        self._through: dict[int, int] = {}  # id(tracker) -> the step it has logged through

    def start(self, run: TrackedRun, history: list[dict[str, Any]]) -> None:
        """Build and start every tracker (on the main rank), or raise the first one's
        failure on every rank. Every rank calls it."""
        error = None
        try:
            self.trackers = self.make() if self.make is not None else []
            for t in self.trackers:
                self._start_one(t, run, history)
        except UserError as e:
            error = str(e)
        error = broadcast_object(error)
        if error is not None:
            self.close()
            raise ConfigError(error)

    def _start_one(self, t: Tracker, run: TrackedRun, history: list[dict[str, Any]]) -> None:
        try:
            through = t.start(run)
        except UserError:
            raise
        except ImportError as e:
            raise ConfigError(f"logger={t.name} needs the {e.name or 'missing'} package: pip "
                              f"install -e '.[{t.name}]', or leave {t.name} out of "
                              "logger.") from None  # fmt: skip
        except Exception as e:  # the package's own error: a bad URI, no permission, ...
            raise ConfigError(f"logger={t.name} could not start ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]}); fix logger_cfg.{t.name}, "
                              f"or leave {t.name} out of logger.") from None  # fmt: skip
        if through is not None:
            for record in history:  # what a killed run logged to metrics.jsonl alone
                if record.get("step", 0) > through:
                    self._log_one(t, tracked_values(record), record["step"])
            self._through[id(t)] = through

    def log(self, record: dict[str, Any], step: int, running: bool = False) -> None:
        """Log a record's numbers at ``step`` (``running``: the running loss between
        records); a tracker that has the step (from the process a resume replaces) does not
        get it twice."""
        for t in list(self.trackers):
            if (t.running or not running) and step > self._through.get(id(t), -1):
                self._log_one(t, tracked_values(record), step)

    def _log_one(self, t: Tracker, values: dict[str, float], step: int) -> None:
        try:
            t.log(values, step)
        except Exception as e:
            self._drop(t, "logging", e)

    def _drop(self, t: Tracker, doing: str, e: Exception) -> None:
        if t.name not in self._warned:
            self._warned.add(t.name)
            log.warning("logger=%s stopped %s (%s: %s); training goes on, metrics.jsonl keeps "
                        "every record", t.name, doing, type(e).__name__, e)  # fmt: skip
        if t in self.trackers:
            self.trackers.remove(t)
        with contextlib.suppress(Exception):  # already warned: a second failure adds nothing
            t.close()

    def state(self) -> dict[str, Any]:
        return {t.name: t.state() for t in self.trackers}

    def finish(self, files: list[Path]) -> None:
        for t in list(self.trackers):
            try:
                t.finish([f for f in files if f.exists()])
            except Exception as e:
                self._drop(t, "at the end", e)

    def close(self) -> None:
        for t in list(self.trackers):
            try:
                t.close()
            except Exception as e:
                self._drop(t, "closing", e)
        self.trackers = []


# What the trackers get of each record: its numbers (counts and timings too), less the
# position, which is the step they log at.
SKIPPED = ("epoch", "step")


def tracked_values(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k not in SKIPPED}  # fmt: skip


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` as ``{"optim.lr": 0.1}`` (trackers' parameters)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= flat_config(v, f"{key}.")
        else:
            out[key] = v
    return out
