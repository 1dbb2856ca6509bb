"""Main-rank records of a run: the trackers (TensorBoard, CSV, MLflow, W&B, yours) and the
environment it ran in."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ddp_utils.dist import Runtime
from ddp_utils.instantiate import build_instance
from ddp_utils.tracking.base import TrackedRun, Tracker, Trackers, tracked_values
from ddp_utils.tracking.env import (
    environment,
    environment_text,
    peak_memory_mb,
    reset_peak_memory,
)

__all__ = ["TrackedRun", "Tracker", "Trackers", "build_trackers", "environment",
           "environment_text", "peak_memory_mb", "reset_peak_memory", "tracked_values"]  # fmt: skip


def build_trackers(names: Sequence[str], options: Any, rt: Runtime) -> Trackers:
    """The trackers ``logger`` names, built (at ``start``) on the main rank only."""
    return Trackers(lambda: make_trackers(names, options) if rt.is_main else [])


def make_trackers(names: Sequence[str], options: Any) -> list[Tracker]:
    """``logger``'s trackers: ``logger_cfg``'s for a name, a class of yours for a path."""
    built = []
    for name in names:
        spec = {"_target_": name} if "." in name else dataclasses.asdict(getattr(options, name))
        fix = f"check logger_cfg.{name} (or the class's import path)."
        tracker = build_instance(f"logger={name}", spec, Tracker, fix)
        if "." in name:
            tracker.name = name  # what its messages call it: what the user wrote
        built.append(tracker)
    return built
