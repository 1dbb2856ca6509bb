"""How a save runs: ``save(training)`` captures the whole training state on every rank and
hands it to the run's ``Checkpointer``, which writes it to its storage in the step or, with
``trainer.checkpoint.async`` (the default), in the background.

A background save costs the step one copy of the state to host memory (pinned where CUDA is
present; torch's ``DefaultStager``, whose buffers serve every save); a whole file is then
written by a thread of the main rank, a sharded one by DCP's ``async_save`` on every rank,
over a gloo group of its own. At most one save is in flight:
the next save, a stop signal's save and the end of training wait for it first.

A save that fails for a cause that may pass (the store did not answer) is reported once, with
its cause, and training goes on; the next checkpoint tries again. ``trainer.checkpoint.retries``
failures in a row stop the run with exit code 75, naming the last complete checkpoint. A
failure the user must fix (a full disk) stops the run at once, as it always did.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp_utils.checkpoint.finite import check_state
from ddp_utils.checkpoint.format import SHARDED_KEYS, summary
from ddp_utils.checkpoint.state import LOSS_SUM, TrainingState, capture
from ddp_utils.checkpoint.storage import SHARDED_SUFFIX, Storage, run_storage, step_name
from ddp_utils.config import ConfigError, UserError
from ddp_utils.dist import Runtime, broadcast_object, checkpoint_group, main_rank_runs
from ddp_utils.lifecycle.disk import writing_into
from ddp_utils.logs import log

RETRY_EXIT = 75  # EX_TEMPFAIL: relaunch once the store is back; the run resumes exactly


class CheckpointsFailing(UserError):
    """``trainer.checkpoint.retries`` saves in a row failed."""

    exit_code = RETRY_EXIT


class Job:
    """One save running in a thread (or run at once): its outcome, once done."""

    def __init__(self, name: str, work: Callable[[], None], background: bool) -> None:
        self.name = name
        self.error: BaseException | None = None
        self._work = work
        self._thread: threading.Thread | None = None
        if background:
            # A daemon: a run that dies with a save in flight is not held open by it
            self._thread = threading.Thread(target=self._run, name="checkpoint", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as e:  # noqa: BLE001 - reported by the rank that settles it
            self.error = e

    def wait(self) -> BaseException | None:
        if self._thread is not None:
            self._thread.join()
        return self.error


class Checkpointer:
    """The run's saves: where they go (``storage``), and the one in flight."""

    def __init__(self, options: Any, run_dir: Path, rt: Runtime, keep_last: int) -> None:
        self.options, self.rt, self.keep_last = options, rt, keep_last
        self.storage: Storage = run_storage(options, run_dir)
        self.run_dir = run_dir
        self.in_flight: str | None = None  # the save not yet settled, on every rank
        self.pending: Job | None = None  # this rank's part of it (none for a whole file's)
        self.failures = 0  # failed saves in a row
        self.newest: str | None = None  # the last complete checkpoint this run wrote
        self.done: list[str] = []  # complete since the caller last asked (``completed``)
        self.stager: Any = None  # made at the first background save

    def save(self, state: dict[str, Any], also: tuple[str, ...], sharded: bool,
             wait: bool = False) -> str:  # fmt: skip
        """Every rank: write ``state`` (sharded when the strategy shards parameters) as the
        step ``state["step"]``; in the background unless ``wait`` or ``async`` is off. Returns
        the checkpoint's path or URL."""
        self.settle()
        background = self.options.background and not wait
        name = step_name(state["step"], SHARDED_SUFFIX if sharded else ".pt")
        if sharded:
            work = self._sharded(name, state, also, background)
        else:
            work = self._whole(name, state, also, background)
        if work is None and sharded:
            return self.storage.ref(name)  # it failed to begin: reported and counted
        self.in_flight = name
        self.pending = Job(name, work, background) if work is not None else None
        if not background:
            self.settle()
        return self.storage.ref(name)

    def _whole(self, name: str, state: dict[str, Any], also: tuple[str, ...],
               background: bool) -> Callable[[], None] | None:  # fmt: skip
        """The main rank's work for a whole file (the others have none)."""
        if not self.rt.is_main:
            return None
        if background:
            state = self.staged(state)  # the step goes on changing the live tensors

        def work() -> None:
            with self.writing():
                self.storage.write_file(name, state)
                self.storage.commit(name, None, also, self.keep_last)

        return work

    def _sharded(self, name: str, state: dict[str, Any], also: tuple[str, ...],
                 background: bool) -> Callable[[], None] | None:  # fmt: skip
        """Every rank's work for a sharded folder: its shards, and the main rank's commit."""
        import torch.distributed.checkpoint as dcp

        def begin() -> str | None:
            try:
                with self.writing():
                    self.storage.begin_sharded(name)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - reported and retried as a failed save
                return summary(e)
            return None

        error = broadcast_object(main_rank_runs(self.rt, begin))
        if error:
            self._failed(name, error)
            return None
        shards = {k: state[k] for k in SHARDED_KEYS if k in state}
        plain = copy.deepcopy({k: v for k, v in state.items() if k not in shards})
        plain["sharded"] = sorted(shards)
        group = checkpoint_group(self.options.timeout_s)
        writer = self.storage.shard_writer(name)
        if background:
            future = dcp.async_save(shards, storage_writer=writer, process_group=group,
                                    async_stager=self.stager_())  # fmt: skip
            written: Callable[[], Any] = future.result
        else:
            written = lambda: dcp.save(shards, storage_writer=writer, process_group=group)  # noqa: E731

        def work() -> None:
            with self.writing():
                try:
                    written()  # raises on every rank when any rank's write failed
                except BaseException:
                    if self.rt.is_main:
                        self.storage.abandon(name)
                    raise
                if self.rt.is_main:
                    self.storage.commit(name, plain, also, self.keep_last)

        return work

    def stager_(self) -> Any:
        """The copier to host memory, made at the first background save and kept: its buffers
        (pinned, from a GPU) serve every save, which never overlap."""
        if self.stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager

            self.stager = DefaultStager(staging_options(self.rt.device))
        return self.stager

    def staged(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` in host memory that the next steps do not touch."""
        return self.stager_().stage(state)

    def writing(self) -> Any:
        """A full local disk becomes the one ``UnwritableError`` paragraph (a store's failures
        are its own: reported and retried)."""
        if not self.storage.is_local:
            return contextlib.nullcontext()
        if self.options.dir:
            return writing_into(Path(self.storage.where), "trainer.checkpoint.dir")
        return writing_into(self.run_dir, "run_dir")  # names its checkpoints/last.pt

    def settle(self) -> None:
        """Every rank: wait for the save in flight, then agree on the main rank's outcome: a
        failure the user must fix raises on every rank; one that may pass is reported once
        and counted."""
        name, job = self.in_flight, self.pending
        self.in_flight, self.pending = None, None
        if name is None:
            return

        def outcome() -> tuple[type[BaseException], str] | None:
            error = job.wait() if job is not None else None
            if error is None:
                return None
            return type(error), str(error) if isinstance(error, UserError) else summary(error)

        if not self.rt.is_main and job is not None:
            job.wait()  # this rank's shards; the main rank's outcome speaks for all
        result = broadcast_object(main_rank_runs(self.rt, outcome))
        if result is None:
            self.failures, self.newest = 0, self.storage.ref(name)
            self.done.append(self.newest)
            return
        kind, message = result
        if issubclass(kind, UserError):
            raise (kind(message) if kind is not UserError else ConfigError(message))
        self._failed(name, message)

    def completed(self) -> list[str]:
        """The checkpoints completed since the last call (for ``on_checkpoint``)."""
        done, self.done = self.done, []
        return done

    def _failed(self, name: str, cause: str) -> None:
        self.failures += 1
        last = self.last_complete() or "none yet"
        if self.rt.is_main:
            log.warning("checkpoint %s failed (%s); training goes on and the next checkpoint "
                        "tries again (%d of trainer.checkpoint.retries=%d failed in a row). "
                        "Last complete checkpoint: %s", self.storage.ref(name), cause,
                        self.failures, self.options.retries, last)  # fmt: skip
        if self.failures >= self.options.retries:
            raise CheckpointsFailing(
                f"{self.failures} checkpoints in a row could not be written to "
                f"{self.storage.where} (the last: {cause}). The last complete checkpoint is "
                f"{last}: once the store answers again, relaunch the same command and the run "
                "resumes from it."
            )

    def last_complete(self) -> str | None:
        """The newest complete checkpoint: this run's, else the storage's."""
        return self.newest or self._newest_in_store()

    def _newest_in_store(self) -> str | None:
        try:
            found = self.storage.complete()
        except Exception:  # noqa: BLE001 - the store may be what is failing
            return None
        return self.storage.ref(found[0]) if found else None

    def close(self, drain: bool = True) -> None:
        """At the end of a run, or on a stop: wait for the save in flight (every rank, with
        ``drain``). Without ``drain`` (a rank may be gone) only a whole file's writer is waited
        for: it needs no other rank."""
        if drain:
            self.settle()
            if self.stager is not None:
                self.stager.close()  # its host copy of the state
                self.stager = None
            if self.failures:
                raise CheckpointsFailing(
                    f"the run's last checkpoint could not be written to {self.storage.where}. "
                    f"The last complete checkpoint is {self.newest or 'none'}: relaunch the "
                    "same command and the run resumes from it."
                )
        elif self.pending is not None and self.rt.is_main and self.pending.name.endswith(".pt"):
            self.pending.wait()


def staging_options(device: torch.device) -> Any:
    """How a background save copies the state to host memory: from a GPU into pinned memory,
    without blocking the stream until the copies are queued."""
    from torch.distributed.checkpoint.staging import StagingOptions

    cuda = device.type == "cuda"
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                          use_async_staging=False, use_non_blocking_copy=cuda)  # fmt: skip


def save(tr: TrainingState, also: tuple[str, ...] = (), wait: bool = False) -> None:
    """Checkpoint from every rank's state, published as each name in ``also`` (best.pt) once
    complete; ``wait``: written before this returns (a stop signal's save)."""
    state = capture(tr)
    check_state(tr, state["epoch_totals"][LOSS_SUM])  # nothing non-finite is ever written
    tr.checkpointer.save(state, also, tr.strategy.shards_parameters, wait)
    announce(tr)


def finish_saves(tr: TrainingState) -> None:
    """Every rank, at the end of training: wait for the last save; raise if it failed."""
    tr.checkpointer.close()
    announce(tr)


def announce(tr: TrainingState) -> None:
    """``on_checkpoint`` for each checkpoint completed since the last call."""
    local = tr.checkpointer.storage.is_local
    for ref in tr.checkpointer.completed():
        tr.callbacks.on_checkpoint(tr, Path(ref) if local else ref)
