"""The run's log: ``log`` (the package's logger), set up per rank by ``setup_logging`` (the
main rank to stdout and ``<name>.log``, the others their warnings to stderr and
``<name>.rank<N>.log``)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ddp_utils.dist import Runtime

LOGGER_NAME = "ddp_recipes"
log = logging.getLogger(LOGGER_NAME)


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
    # An object store's clients log INFO lines on every run ("Found credentials in
    # environment variables"), which Hydra's root handler would print among ours
    for chatty in ("botocore", "aiobotocore", "s3fs"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
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
