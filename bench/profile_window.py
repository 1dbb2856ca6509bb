"""The profiled window of `make bench-profile`, shared by train.py's callback
(bench/peer_profile.py) and the peer loop (bench/peer_reference.py), torch only: the peer
imports nothing of ours.
"""

from __future__ import annotations

from pathlib import Path

import torch

WARMUP = 10  # steps skipped first: the loader's first batches and the allocator's warm-up


def start_profiler(steps: int, out: str | Path, record: bool) -> torch.profiler.profile | None:
    """A CPU profiler that skips ``WARMUP`` steps, records ``steps`` and then writes the
    operator table (self CPU time) to ``out``; None on the ranks that do not record."""
    if not record:
        return None

    def write(prof: torch.profiler.profile) -> None:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        Path(out).write_text(f"{steps} steps after {WARMUP} of warm-up, rank 0\n{table}\n")

    schedule = torch.profiler.schedule(wait=WARMUP, warmup=1, active=steps, repeat=1)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=schedule, on_trace_ready=write)  # fmt: skip
    prof.start()
    return prof
