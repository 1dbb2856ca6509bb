"""``logger=csv``: ``run_dir/metrics.csv``, one row per record of metrics.jsonl.

Rewritten from metrics.jsonl at every record (a few hundred lines at most), so it holds the
same values, with a column for every key any record has, and follows a resume's trim.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from ddp_utils.tracking.base import TrackedRun, Tracker


class CsvTracker(Tracker):
    name = "csv"

    def __init__(self, filename: str = "metrics.csv") -> None:
        self.filename, self.run_dir = filename, None

    def start(self, run: TrackedRun) -> int | None:
        self.run_dir = run.run_dir
        self.write()
        return None

    def log(self, values: dict[str, float], step: int) -> None:
        self.write()

    def write(self) -> None:
        assert self.run_dir is not None
        write_csv(self.run_dir / "metrics.jsonl", self.run_dir / self.filename)


def write_csv(jsonl: Path, out: Path) -> None:
    records = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
    columns = list(dict.fromkeys(k for r in records for k in r))
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)
    os.replace(tmp, out)
