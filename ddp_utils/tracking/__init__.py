"""Main-rank records of a run: the trackers (TensorBoard, CSV, MLflow, W&B, yours) and the
environment it ran in."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate

from ddp_utils.config import ConfigError
from ddp_utils.dist import Runtime
from ddp_utils.tracking.base import TrackedRun, Tracker, Trackers, tracked_values
from ddp_utils.tracking.env import environment, environment_text, peak_memory_mb

__all__ = ["TrackedRun", "Tracker", "Trackers", "build_trackers", "environment",
           "environment_text", "peak_memory_mb", "tracked_values"]  # fmt: skip


def build_trackers(names: Sequence[str], options: Any, rt: Runtime) -> Trackers:
    """The trackers ``logger`` names, built (at ``start``) on the main rank only."""
    return Trackers(lambda: make_trackers(names, options) if rt.is_main else [])


def make_trackers(names: Sequence[str], options: Any) -> list[Tracker]:
    built = []
    for name in names:
        try:
            if "." in name:  # a class of yours
                tracker = get_class(name)()
                tracker.name = name
            else:
                spec = options[name] if isinstance(options, dict) else getattr(options, name)
                tracker = instantiate(dataclasses.asdict(spec) if dataclasses.is_dataclass(spec)
                                      else spec, _convert_="all")  # fmt: skip
        except (InstantiationException, ImportError, AttributeError, ValueError) as e:
            cause = e.__cause__ or e
            raise ConfigError(f"logger={name} could not be built ({type(cause).__name__}: "
                              f"{str(cause).strip()[:300]}).") from None  # fmt: skip
        if not isinstance(tracker, Tracker):
            raise ConfigError(f"logger={name}: {type(tracker).__name__} is not a "
                              "ddp_utils.tracking.Tracker.")  # fmt: skip
        built.append(tracker)
    return built
