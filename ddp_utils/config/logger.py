"""``logger`` and ``logger_cfg``: which trackers a run logs to, and each one's options."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ddp_utils.config.errors import ConfigError


@dataclass
class TensorBoardLogger:
    _target_: str = "ddp_utils.tracking.tensorboard.TensorBoardTracker"
    subdir: str = "tb"  # run_dir/tb


@dataclass
class CsvLogger:
    _target_: str = "ddp_utils.tracking.csvfile.CsvTracker"
    filename: str = "metrics.csv"  # in run_dir: metrics.jsonl's records as rows


@dataclass
class MlflowLogger:
    _target_: str = "ddp_utils.tracking.mlflow_tracker.MlflowTracker"
    # null: sqlite:///<run_dir>/../mlruns.db (artifacts in ../mlartifacts); or http://HOST:5000
    tracking_uri: str | None = None
    experiment_name: str = "ddp-recipes"
    run_name: str | None = None  # null: the run_dir's name
    # A server's every request: answered within timeout_s, tried retries + 1 times (MLflow's
    # own defaults, 120 s and 7 retries, keep a run waiting for many minutes on a dead server)
    timeout_s: int = 8
    retries: int = 1


@dataclass
class WandbLogger:
    _target_: str = "ddp_utils.tracking.wandb_tracker.WandbTracker"
    project: str = "ddp-recipes"
    entity: str | None = None
    mode: str | None = None  # null: offline unless WANDB_MODE or WANDB_API_KEY is set


@dataclass
class LoggerOptions:
    tensorboard: TensorBoardLogger = field(default_factory=TensorBoardLogger)
    csv: CsvLogger = field(default_factory=CsvLogger)
    mlflow: MlflowLogger = field(default_factory=MlflowLogger)
    wandb: WandbLogger = field(default_factory=WandbLogger)


TRACKERS = tuple(f.name for f in fields(LoggerOptions))


def logger_names(value: Any) -> list[str]:
    """``logger`` as a list of tracker names: one name, a list, or none (``none`` / [])."""
    names = [value] if isinstance(value, str) else list(value or [])
    if any(not isinstance(n, str) for n in names):
        raise ConfigError(f"logger={value}: write names, e.g. logger=[tensorboard,csv].")
    names = [n for n in names if n != "none"]
    for n in names:
        if n not in TRACKERS and "." not in n:
            raise ConfigError(f"logger={n} is not a tracker; pick from {', '.join(TRACKERS)} "
                              "or none (several as logger=[tensorboard,csv]), or name a class "
                              "of yours, logger=[pkg.module.MyTracker].")  # fmt: skip
    if len(set(names)) != len(names):
        raise ConfigError(f"logger={value} names a tracker twice.")
    return names
