"""``trainer.profile=true``: torch.profiler on a few steps of your own run.

    torchrun --standalone --nproc_per_node=2 train.py trainer.profile=true

On the ranks ``trainer.profiler.ranks`` (the main rank by default) the steps after
``trainer.profiler.wait`` steps and ``warmup`` more are recorded for ``active`` steps. Their
trace goes to ``run_dir/profile/rank<R>.step<N>.pt.trace.json`` (Perfetto, ui.perfetto.dev,
or TensorBoard's profiler plugin read it), and the rank logs two tables: the share of the
recorded steps spent in each phase (data loading, forward, backward, optimizer,
communication, validation, checkpoints, the rest), and the top operators by their own time.
A run that ends before the window reaches a recorded step says so. Off, nothing is
recorded: the loop's phase marks are one shared no-op context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.profiler import ProfilerActivity, profile, record_function, schedule

from ddp_utils.logs import log
from ddp_utils.train.callbacks import Callback
from ddp_utils.train.state import no_phase

if TYPE_CHECKING:
    from ddp_utils.config.schema import ProfilerOptions
    from ddp_utils.train.state import Training

# The loop's marks (Training.phase): a step's four, and the validation and checkpoint that
# fall in some steps' windows (in an epoch-mode run, every epoch's last step)
PHASES = ("data", "forward", "backward", "optimizer", "validation", "checkpoint")
# Collectives as the profiler names them: c10d's ops and the backends' own.
COMMUNICATION = ("all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather",
                 "broadcast", "barrier")  # fmt: skip


def batches(loader: Any, phase: Callable[[str], contextlib.AbstractContextManager]) -> Iterator:
    """``loader``'s batches, each fetched inside the ``data`` phase."""
    with phase("data"):
        items = iter(loader)  # an epoch's start: its order, its workers' first batches
    while True:
        with phase("data"):
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


class Profiler(Callback):
    """torch.profiler over ``wait`` + ``warmup`` + ``active`` steps of the ranks chosen."""

    def __init__(self, options: ProfilerOptions) -> None:
        self.options = options
        self.prof: profile | None = None
        self.reported = False

    def on_train_start(self, tr: Training) -> None:
        o = self.options
        if tr.rt.is_main and not any(0 <= r < tr.rt.world_size for r in o.ranks):
            log.warning("trainer.profile: trainer.profiler.ranks=%s names no rank of world size "
                        "%d, so nothing is profiled; name ranks from 0 to %d", list(o.ranks),
                        tr.rt.world_size, tr.rt.world_size - 1)  # fmt: skip
        if tr.rt.rank not in o.ranks:
            return
        folder = tr.run_dir / "profile"
        activities = [ProfilerActivity.CPU]
        if tr.rt.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=o.wait, warmup=o.warmup, active=o.active, repeat=1),
            on_trace_ready=lambda p: self.report(p, folder, tr),
            record_shapes=o.record_shapes,
            with_stack=o.with_stack,
        )
        self.prof.start()
        tr.phase = record_function

    def on_step_end(self, tr: Training) -> None:
        if self.prof is not None:
            self.prof.step()
            if self.reported:  # its one cycle is over: nothing more to record
                self.stop(tr)

    def on_train_end(self, tr: Training) -> None:
        recording = self.prof is not None
        self.stop(tr)
        if recording and not self.reported:
            o = self.options
            log.warning("trainer.profile: the run ended at step %d, before the profiler's "
                        "window (wait %d, warm-up %d, then %d recorded steps, from step %d) "
                        "reached a recorded step: nothing was written. Lower "
                        "trainer.profiler.wait or run longer", tr.step, o.wait, o.warmup,
                        o.active, tr.first_step)  # fmt: skip

    def stop(self, tr: Training) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
            tr.phase = no_phase

    def report(self, prof: profile, folder: Path, tr: Training) -> None:
        """The trace file, then the two tables in the rank's log."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{tr.rt.rank}.step{tr.step}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        device = tr.rt.device.type == "cuda"
        top = prof.key_averages().table(
            sort_by="self_cuda_time_total" if device else "self_cpu_time_total",
            row_limit=self.options.top,
        )
        events = prof.events()
        recorded = sum(1 for e in events if e.name.startswith("ProfilerStep"))
        log.info("profile of rank %d, %d steps to step %d: %s\n%s\ntop operators:\n%s",
                 tr.rt.rank, recorded, tr.step, path, phase_table(events), top)  # fmt: skip
        self.reported = True


def phase_table(events: Any) -> str:
    """Each phase's share of the recorded steps' wall time, on the training thread.
    Communication is the time that thread spent in collective calls (launching them, and
    waiting for them: DDP's buckets inside the backward, so it overlaps that row); a
    validation or checkpoint that fell in the recorded steps has its own row; 'other' is what
    no mark covers: logging, callbacks, the progress line, waiting on the device."""
    step_events = [e for e in events if e.name.startswith("ProfilerStep")]
    if not step_events:
        return "(no step was recorded)"
    main_thread = step_events[0].thread

    def communicates(e: Any) -> bool:
        return e is not None and any(c in e.name.lower() for c in COMMUNICATION)

    events = [e for e in events if e.thread == main_thread]
    steps = sum(e.cpu_time_total for e in step_events)
    spent = {p: sum(e.cpu_time_total for e in events if e.name == p) for p in PHASES}
    # The outermost communication events only: c10d's op holds the backend's own.
    outer = [e for e in events if communicates(e) and not communicates(e.cpu_parent)]
    comm = sum(e.cpu_time_total for e in outer)
    rows = [(p, spent[p]) for p in PHASES] + [("communication", comm)]
    rows.append(("other", max(steps - sum(spent.values()), 0.0)))
    lines = ["phase          share of the steps   time (ms)"]
    for name, us in rows:
        share = 100.0 * us / steps if steps else 0.0
        lines.append(f"{name:<14} {share:>17.1f}%   {us / 1e3:>9.1f}")
    return "\n".join(lines)
