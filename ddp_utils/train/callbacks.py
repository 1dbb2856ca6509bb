"""Callbacks: optional behaviour hung on the training loop, configured as ``_target_``s.

    callbacks:
      - _target_: mypkg.callbacks.PrintLoss
        every: 100

A callback subclasses ``Callback`` and overrides the hooks it needs; each hook gets the
training state (``ddp_utils.train.state.Training``: model, optimizer, data, epoch, step, ...).
Every rank calls every hook, in the order of the list. A hook must not change what training
computes unless that is its purpose, and must call a collective on every rank or on none.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_utils.config import ConfigError
from ddp_utils.instantiate import build_instance

if TYPE_CHECKING:
    from ddp_utils.train.state import Training


class Callback:
    """The hook interface; every hook does nothing by default."""

    def on_train_start(self, tr: Training) -> None:
        """After the resume, before the first step of this process."""

    def on_epoch_start(self, tr: Training) -> None:
        """The epoch's sampler is set (``tr.data.train_sampler`` knows where the epoch resumes)."""

    def on_step_end(self, tr: Training) -> None:
        """After each optimizer step (``tr.step`` counts it), before a requested stop."""

    def on_epoch_end(self, tr: Training, record: dict[str, Any]) -> None:
        """After validation; ``record`` is the epoch's line of metrics.jsonl."""

    def on_checkpoint(self, tr: Training, path: Path | str) -> None:
        """Once a checkpoint is complete and every rank knows it (a background save's at the
        next save or the end of training); a URL for one on a store."""

    def on_train_end(self, tr: Training) -> None:
        """After the last epoch (not after a stop or a crash)."""


class CallbackList(Callback):
    """Calls each hook of each callback in order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_train_start(self, tr: Training) -> None:
        for cb in self.callbacks:
            cb.on_train_start(tr)

    def on_epoch_start(self, tr: Training) -> None:
        for cb in self.callbacks:
            cb.on_epoch_start(tr)

    def on_step_end(self, tr: Training) -> None:
        for cb in self.callbacks:
            cb.on_step_end(tr)

    def on_epoch_end(self, tr: Training, record: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_epoch_end(tr, record)

    def on_checkpoint(self, tr: Training, path: Path | str) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint(tr, path)

    def on_train_end(self, tr: Training) -> None:
        for cb in self.callbacks:
            cb.on_train_end(tr)


def build_callbacks(specs: Sequence[Any], extra: Sequence[Callback] = ()) -> CallbackList:
    """Instantiate ``callbacks`` (a list of ``{_target_: ..., ARG: VALUE}``); then ``extra``,
    the ones the entry script adds (a sweep's pruning)."""
    built = []
    for spec in specs:
        target = spec.get("_target_") if isinstance(spec, dict) else None
        if not target:
            raise ConfigError(
                f"callbacks: each entry needs a _target_ (got {spec!r}); for example "
                "callbacks='[{_target_: mypkg.MyCallback}]'."
            )
        built.append(build_instance("callbacks", spec, Callback,
                                    "check its import path and arguments."))  # fmt: skip
    return CallbackList([*built, *extra])
