"""Shared helpers: launching the real entry scripts under torchrun or as one process."""

from __future__ import annotations

import os
import sys

import pytest
from helpers.faults import tmpfs

# The ranks and scripts a test forks (run_forked, run_ranks) compute on one intra-op thread,
# as torchrun's workers do. OpenMP reads this once, when torch loads it: set later, the
# threads a fork starts (gloo's callbacks, where PowerSGD multiplies matrices) would still
# split work over the parent's pool, which a fork does not have, giving other sums each run.
if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS") != "1":
    raise RuntimeError("torch was imported before tests/conftest.py could set OMP_NUM_THREADS=1")
os.environ["OMP_NUM_THREADS"] = "1"


# The longest files first: `make test` runs one file per CPU at a time (xdist --dist
# loadfile), handed out in collection order, so starting with the long ones packs them best.
LONGEST_FIRST = ("test_fsdp2_e2e", "test_checkpoint_store_e2e", "test_resume_e2e",
                 "test_imagefolder_e2e", "test_shards_e2e", "test_sft_e2e", "test_elastic_e2e",
                 "test_kubernetes_e2e",
                 "test_accumulation_e2e", "test_detection_e2e", "test_task_shards_e2e",
                 "test_interrupt_e2e",
                 "test_slurm_e2e", "test_strategy_matrix_e2e", "test_trackers_e2e",
                 "test_search_e2e", "test_docs", "test_multinode_sweep_e2e", "test_bench",
                 "test_failures_e2e", "test_full_disk_e2e", "test_segmentation_e2e",
                 "test_relaunch_e2e", "test_recipe_e2e", "test_lm_e2e", "test_train_e2e",
                 "test_user_view", "test_eval_e2e", "test_metrics_e2e", "test_validation_e2e",
                 "test_detfolder_e2e", "test_targets_e2e")  # fmt: skip


def pytest_collection_modifyitems(items: list) -> None:
    def rank(item) -> int:
        name = item.path.stem
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (skipped where this process may not mount one)."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk
