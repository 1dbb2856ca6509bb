"""``logger=csv``: ``run_dir/metrics.csv``, one row per record of metrics.jsonl.

Rewritten from metrics.jsonl at every record (a few hundred lines at most), so it holds the
same values, with a column for every key any record has, and follows a resume's trim.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ddp_utils.files import atomic_write_text
from ddp_utils.run.records import read_metrics
from ddp_utils.tracking.base import TrackedRun, Tracker


class CsvTracker(Tracker):
    name = "csv"
    running = False  # metrics.jsonl's records only

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
        write_csv(self.run_dir, self.run_dir / self.filename)


def write_csv(run_dir: Path, out: Path) -> None:
    """``out``: ``run_dir/metrics.jsonl``'s records as CSV rows."""
    records = read_metrics(run_dir)
    columns = list(dict.fromkeys(k for r in records for k in r))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(records)
    atomic_write_text(out, text.getvalue())
