"""The benchmark's worker runs every loop end to end (its numbers are not asserted here)."""

from __future__ import annotations

import json

from conftest import run_script


def test_bench_worker_runs_every_loop():
    proc = run_script(
        "bench/worker.py", "--repeats", "1", "--overrides", "data=synthetic",
        "data.num_train=400", "data.num_val=100", "--variants",
        "train.py bf16=trainer.precision=bf16", nproc=1,
    )  # fmt: skip
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BENCH "))
    result = json.loads(line[len("BENCH ") :])
    assert result["world_size"] == 1
    rates = result["images_per_s"]
    assert set(rates) == {"tutorial", "raw bound", "train.py", "train.py bf16"}
    assert all(rate > 0 for rate in rates.values())
