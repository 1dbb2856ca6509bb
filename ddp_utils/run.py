"""The run directory that every rank shares, and the rank-aware files written into it."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ddp_utils.config import ConfigError
from ddp_utils.dist import Runtime, barrier, broadcast_object, read_launch_env
from ddp_utils.files import UnwritableError, atomic_write_text, writing_into
from ddp_utils.lock import RunLock

LOGGER_NAME = "ddp_recipes"
log = logging.getLogger(LOGGER_NAME)


def run_tag(run_id: str) -> str:
    """A short, readable tag of a launcher's run id (a uuid from --standalone is cut to 8)."""
    return run_id if len(run_id) <= 16 else run_id[:8]


def _default_run_dir(base: Path, run_id: str | None) -> Path:
    """outputs/<date>_<run id>: reuse the folder of this run id, so a restart finds it again."""
    if run_id:
        tag = run_tag(run_id)
        existing = sorted(base.glob(f"*_{tag}")) if base.is_dir() else []
        if existing:
            return existing[-1]
        return base / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{tag}"
    return base / time.strftime("%Y-%m-%d_%H-%M-%S")


@dataclass
class RunDir:
    path: Path
    created: bool  # this job made the folder, so an early failure may remove it again
    lock: RunLock | None  # the main rank's lock on it


def resolve_run_dir(run_dir: str | None, rt: Runtime) -> RunDir:
    """One folder for all ranks, locked for this job: the main rank names, creates and locks
    it, the others are told (or told why not: every rank then raises the same error).

    Resolving a timestamp on each rank separately would make one folder per rank, so only the
    main rank decides. Every rank must see the folder: ``run_dir`` has to be on a filesystem
    shared by all nodes.
    """
    path, created, lock, error = None, False, None, None
    if rt.is_main:
        run_id = read_launch_env().run_id
        if run_id == "none":  # torchrun without --rdzv-id or --standalone
            run_id = None
        path = Path(run_dir) if run_dir else _default_run_dir(Path("outputs"), run_id)
        try:
            created = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
            lock = RunLock.acquire(path)
        except ConfigError as e:
            error = str(e)
        except OSError as e:
            error = (f"run_dir={path} cannot be created or written ({e.strerror or e}); choose "
                     "a writable folder with run_dir=PATH.")  # fmt: skip
    path, created, error = broadcast_object((str(path) if path else None, created, error))
    if error:
        raise ConfigError(error)
    path = Path(path)
    barrier()
    if not path.is_dir():
        raise ConfigError(
            f"rank {rt.rank} cannot see run_dir={path}: put run_dir on a filesystem that every "
            "node shares (run_dir=/shared/path/...).",
            rank_specific=True,
        )
    return RunDir(path, created, lock)


def remove_if_unused(run: RunDir, rt: Runtime) -> None:
    """After a failure before the first training step: remove the folder, if this job
    created it (the config, logs, lock and trackers' files written so far are all it holds);
    a folder that existed before is left as it was."""
    if rt.is_main and run.created:
        shutil.rmtree(run.path, ignore_errors=True)


def write_on_main(run_dir: Path, rt: Runtime, write: Callable[[], Any]) -> None:
    """The main rank calls ``write``; then every rank learns whether it failed for want of
    space or permission, and all stop together with the same ``UnwritableError`` (alone,
    the main rank would exit and leave the others in their next collective)."""
    error = None
    if rt.is_main:
        try:
            with writing_into(run_dir):
                write()
        except UnwritableError as e:
            error = str(e)
    error = broadcast_object(error)
    if error:
        raise UnwritableError(error)


class _LogFile(logging.FileHandler):
    """A log file that, once the disk is full, stops writing instead of printing a traceback
    per record (the console still shows them; the failing write itself is reported)."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if isinstance(sys.exc_info()[1], OSError):
            self.setLevel(logging.CRITICAL + 1)
            return
        super().handleError(record)


class _RankPrefix(logging.Formatter):
    def __init__(self, rank: int) -> None:
        super().__init__(f"[rank {rank}] %(levelname)s %(message)s")


def setup_logging(run_dir: Path | None, rt: Runtime, name: str = "train") -> logging.Logger:
    """Main rank: INFO to stdout and ``<name>.log``. Others: warnings and errors only, to stderr
    and ``<name>.rank<N>.log`` (created only if something is written)."""
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO)
    if rt.is_main:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(console)
        if run_dir is not None:
            f = _LogFile(run_dir / f"{name}.log")
            f.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            log.addHandler(f)
    else:
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(_RankPrefix(rt.rank))
        log.addHandler(console)
        if run_dir is not None:
            f = _LogFile(run_dir / f"{name}.rank{rt.rank}.log", delay=True)
            f.setLevel(logging.WARNING)
            f.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            log.addHandler(f)
    return log


def log_to_files(level: int, message: str) -> None:
    """Into this rank's log files only (the console already shows the message)."""
    for h in log.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(log.makeRecord(log.name, level, __file__, 0, message, None, None))


def write_run_files(run_dir: Path, files: dict[str, Callable[[], str]], rt: Runtime) -> None:
    """The main rank writes each ``name: text()`` into ``run_dir`` (config.yaml, env.json,
    classes.json, ...) atomically; an unwritable folder stops every rank together."""

    def write() -> None:
        for name, text in files.items():
            atomic_write_text(run_dir / name, text())

    write_on_main(run_dir, rt, write)


def config_text(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def classes_text(classes: list[str]) -> str:
    """``classes.json``: the class names in label order."""
    return json.dumps(classes, indent=1) + "\n"


def strict_json(record: dict[str, Any]) -> str:
    """One JSON line that strict parsers accept: a NaN or infinite value becomes null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
             for k, v in record.items()}  # fmt: skip
    return json.dumps(clean, allow_nan=False)


def append_metrics(run_dir: Path, record: dict[str, Any], rt: Runtime) -> None:
    """One line of metrics.jsonl, whole or not at all; every rank learns if it failed."""

    def append() -> None:
        with open(run_dir / "metrics.jsonl", "ab") as f:
            size = f.tell()
            try:
                f.write((strict_json(record) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                f.truncate(size)  # no torn line for the resume to trip over
                e.filename = str(run_dir / "metrics.jsonl")
                raise

    write_on_main(run_dir, rt, append)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records; none when the file is missing."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux), for the launch-to-first-step figure."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
