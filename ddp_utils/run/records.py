"""metrics.jsonl: one JSON line a record, appended whole or not at all by the main rank; set
aside when a run starts afresh in a folder that holds records, trimmed back to the checkpoint
a run resumes from."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from ddp_utils.dist import Runtime
from ddp_utils.logs import log
from ddp_utils.run.folder import write_on_main


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


def set_aside_metrics(path: Path, rt: Runtime) -> None:
    """A fresh start in a run_dir that holds records but no checkpoint (killed before its
    first one, or its checkpoints deleted): keep the old records under another name, so the
    new run never logs an epoch a second time in metrics.jsonl."""
    if rt.is_main and path.exists() and path.stat().st_size > 0:
        old = path.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl.old")
        path.rename(old)
        log.warning("no checkpoint to continue: the earlier metrics.jsonl is now %s", old.name)


def trim_metrics(path: Path, step: int, rt: Runtime) -> None:
    """Drop records logged after the checkpoint, which the resumed run will log again."""
    if not rt.is_main or not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        path.write_text("".join(line + "\n" for line in kept))
