"""Test instrumentation, attached to train.py as callbacks (never part of the product):

callbacks=[{_target_:tests.callbacks.Fault,kind:kill,step:97,rank:1}]
callbacks=[{_target_:tests.callbacks.SampleRecorder,folder:/tmp/rec}]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

from ddp_utils.tracking import Tracker
from ddp_utils.train.callbacks import Callback


class Fault(Callback):
    """Kill (SIGKILL) or stall one rank at one step, in torchrun's first attempt only (so the
    restarted group runs on). A stall first writes the time it began into ``mark``; ``mark``
    as the kind only writes it (for a test to act then: stop a server); ``rmtree`` removes the
    folder ``mark`` (a tmp cleaner taking a cache away)."""

    def __init__(self, kind: str, step: int, rank: int, mark: str | None = None) -> None:
        assert kind in ("kill", "stall", "mark", "rmtree"), kind
        self.kind, self.step, self.rank, self.mark = kind, step, rank, mark

    def on_step_end(self, tr) -> None:
        if tr.step != self.step or tr.rt.rank != self.rank:
            return
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "rmtree":
            # gone at once (renamed away, then removed): the run's own processes may make the
            # folder again while a plain rmtree is still walking it
            gone = f"{self.mark}.gone"
            os.rename(self.mark, gone)
            shutil.rmtree(gone)
            return
        if self.mark:
            Path(self.mark).write_text(str(time.time()))
        if self.kind == "stall":
            time.sleep(3600)


class SampleRecorder(Callback):
    """Each rank appends to ``folder/rank<R>.jsonl`` the real (non-padding) sample indices of
    every optimizer step: the tests' ground truth for "each sample exactly once"."""

    def __init__(self, folder: str) -> None:
        self.folder, self.order, self.pos = Path(folder), [], 0

    def on_epoch_start(self, tr) -> None:
        self.order, self.pos = list(tr.data.train_sampler), 0

    def on_step_end(self, tr) -> None:
        take = tr.cfg.trainer.grad_accum_steps * tr.cfg.data.batch_size
        chunk = self.order[self.pos : self.pos + take]
        self.pos += take
        record = {"epoch": tr.epoch, "step": tr.step, "indices": [j for j in chunk if j >= 0]}
        with open(self.folder / f"rank{tr.rt.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


class ValidationDump(Callback):
    """Rank 0 writes each epoch's full validation results (``tr.validation``: the confusion
    matrix too) to ``folder/epoch<N>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_epoch_end(self, tr, record) -> None:
        if tr.rt.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / f"epoch{record['epoch']}.json").write_text(json.dumps(tr.validation))


def fault(kind: str, step: int, rank: int, mark: str | None = None) -> str:
    """The override that attaches a ``Fault``."""
    extra = f",mark:'{mark}'" if mark else ""
    return (
        f"callbacks=[{{_target_:tests.callbacks.Fault,kind:{kind},step:{step},rank:{rank}{extra}}}]"
    )


def dump_validation(folder: Path) -> str:
    return f"callbacks=[{{_target_:tests.callbacks.ValidationDump,folder:'{folder}'}}]"


def recorder(folder: Path) -> str:
    return f"callbacks=[{{_target_:tests.callbacks.SampleRecorder,folder:'{folder}'}}]"


def both(kind: str, step: int, rank: int, folder: Path) -> str:
    return (
        f"callbacks=[{{_target_:tests.callbacks.Fault,kind:{kind},step:{step},rank:{rank}}},"
        f"{{_target_:tests.callbacks.SampleRecorder,folder:'{folder}'}}]"
    )


class TrialRecorder(Callback):
    """Each rank writes ``<run_dir>/rank<R>.json``: the parameters it trains a trial with."""

    def on_train_start(self, tr) -> None:
        c = tr.cfg
        seen = {"optim.lr": c.optim.lr, "optim.weight_decay": c.optim.weight_decay,
                "data.batch_size": c.data.batch_size}  # fmt: skip
        (tr.run_dir / f"rank{tr.rt.rank}.json").write_text(json.dumps(seen))


class KillInJob(Callback):
    """SIGKILL this process at ``step`` of sweep job ``job`` (a sweep killed mid-trial)."""

    def __init__(self, job: int, step: int) -> None:
        self.job, self.step = job, step

    def on_step_end(self, tr) -> None:
        from hydra.core.hydra_config import HydraConfig

        if tr.step == self.step and HydraConfig.get().job.num == self.job:
            os.kill(os.getpid(), signal.SIGKILL)


class FlakyTracker(Tracker):
    """``logger=[csv,callbacks.FlakyTracker]``: fails at its second record."""

    name = "flaky"

    def __init__(self) -> None:
        self.records = 0

    def log(self, values, step) -> None:
        self.records += 1
        if self.records == 2:
            raise ConnectionError("the tracking server went away")


class FillDisk(Callback):
    """Rank 0 fills the filesystem of ``tr.run_dir`` at the end of ``step``, leaving about
    ``leave`` bytes free (a few KiB: the next checkpoint's zip header fits, its tensors do
    not, and torch.save raises RuntimeError "unexpected pos"): the next write of the run (a
    checkpoint, metrics.jsonl) meets a really full disk, wherever the space runs out."""

    def __init__(self, step: int, leave: int = 0) -> None:
        self.step, self.leave = step, leave

    def on_step_end(self, tr) -> None:
        if tr.step != self.step or not tr.rt.is_main:
            return
        filler = tr.run_dir.parent / "filler"

        def free() -> int:
            st = os.statvfs(filler)
            return st.f_bavail * st.f_frsize

        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while (room := free()) > self.leave:
                os.write(fd, b"\0" * max(4096, min(1 << 20, room - self.leave)))
        except OSError:
            pass
        finally:
            os.close(fd)


def fill_disk(step: int, leave: int = 0) -> str:
    return f"callbacks=[{{_target_:tests.callbacks.FillDisk,step:{step},leave:{leave}}}]"


class Slow(Callback):
    """Every rank sleeps ``step_s`` after each step: a run long enough to interrupt, whose
    numbers are the same as without it."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def on_step_end(self, tr) -> None:
        time.sleep(self.step_s)


def slow(step_s: float) -> str:
    return f"callbacks=[{{_target_:tests.callbacks.Slow,step_s:{step_s}}}]"


class Gated(Callback):
    """Every rank sleeps ``step_s`` after each step while the file ``gate`` exists: a run held
    at a walking pace while a test changes what runs it, then let go to its end."""

    def __init__(self, gate: str, step_s: float) -> None:
        self.gate, self.step_s = Path(gate), step_s

    def on_step_end(self, tr) -> None:
        if self.gate.exists():
            time.sleep(self.step_s)


def gated(gate: Path, step_s: float) -> str:
    return f"callbacks=[{{_target_:tests.callbacks.Gated,gate:'{gate}',step_s:{step_s}}}]"


class StateDump(Callback):
    """At the start of training (after a resume) rank 0 writes the whole model and optimizer
    state, gathered from every rank's shards, to ``path``: what a resume really loaded."""

    def __init__(self, path: str, optimizer: bool = True) -> None:
        # optimizer=False before the first step: torch's get_optimizer_state_dict creates the
        # state it lacks by a step at lr 0, which counts a step (AdamW's bias correction).
        self.path, self.optimizer = path, optimizer

    def on_train_start(self, tr) -> None:
        import torch
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"model": get_model_state_dict(tr.raw_model, options=whole)}
        if self.optimizer:
            state["optimizer"] = get_optimizer_state_dict(tr.raw_model, tr.optimizer, options=whole)
        if tr.rt.is_main:
            torch.save(state, self.path)


def dump_state(path: Path, optimizer: bool = True) -> str:
    return (f"callbacks=[{{_target_:tests.callbacks.StateDump,path:{path},"
            f"optimizer:{str(optimizer).lower()}}}]")  # fmt: skip


class SlowStore(Callback):
    """Registers ``slows3://``: the S3 store, whose ``nth`` upload of a step file hangs for a
    minute before it completes, after writing its name into ``mark`` (for a test to SIGKILL
    the run while that save is in flight). Once ``mark`` exists (a relaunch), nothing hangs."""

    def __init__(self, mark: str, nth: int = 2) -> None:
        import fsspec
        from s3fs import S3FileSystem

        class SlowS3(S3FileSystem):
            protocol = ("slows3",)
            uploads = 0

            async def _put_file(self, lpath, rpath, *args, **kwargs):
                if "/step_" in rpath and rpath.endswith(".pt"):
                    SlowS3.uploads += 1
                    if SlowS3.uploads == nth and not Path(mark).exists():
                        Path(mark).write_text(rpath)
                        await asyncio.sleep(60)
                return await super()._put_file(lpath, rpath, *args, **kwargs)

        fsspec.register_implementation("slows3", SlowS3, clobber=True)


def slow_store(mark: Path, nth: int = 2) -> str:
    return f"{{_target_:tests.callbacks.SlowStore,mark:'{mark}',nth:{nth}}}"
