"""A really full disk (a tmpfs filled by the run's own rank 0 at a chosen step), for each
task: whatever the writer raises (torch.save's zip writer wraps ENOSPC in a RuntimeError),
the run stops on every rank with our one paragraph and exit code 4, and the last good
checkpoint still loads."""

from __future__ import annotations

import pytest
import torch
from callbacks import fill_disk
from helpers.faults import tmpfs
from helpers.launch import our_error_lines, run_script
from lm_data import write_token_folder

from ddp_utils.lifecycle.disk import WRITE_FAILED_EXIT

CLASSIFICATION = ("data.batch_size=10", "trainer.epochs=1", "trainer.ckpt_every_steps=10",
                  "trainer.precision=32", "logger=none")  # fmt: skip
SEGMENTATION = ("experiment=digits_segmentation", "model.channels=[8,16]", "data.batch_size=16",
              "data.global_batch_size=null",
                "trainer.max_steps=30", "trainer.ckpt_every_steps=10", "trainer.precision=32",
                "logger=none")  # fmt: skip
LANGUAGE_MODEL = ("experiment=lm_char", "data=tokens", "data.block_size=16",
                  "data.batch_size=4", "data.global_batch_size=null", "model.n_layer=1",
                  "model.n_head=2", "model.n_embd=32",
                  "trainer.max_steps=30", "trainer.val_every_steps=30",
                  "trainer.ckpt_every_steps=10", "trainer.precision=32",
                  "logger=none")  # fmt: skip


MID = 8192  # bytes left: a checkpoint's write starts, and runs out of space half way


@pytest.fixture
def disk(tmp_path):
    with tmpfs(tmp_path / "disk", "8m") as where:
        yield where


def assert_stopped_by_the_full_disk(proc, run, resumable: bool) -> None:
    assert proc.returncode != 0
    assert f"exitcode: {WRITE_FAILED_EXIT}" in proc.stderr, proc.stderr[-4000:]
    ours = our_error_lines(proc.stderr)
    assert len(ours) == 1 and ours[0].startswith("error: cannot write "), proc.stderr[-5000:]
    assert "No space left on device" in ours[0] and f"run_dir={run} has " in ours[0]
    assert "trainer.keep_last=1" in ours[0]
    assert not list(run.rglob("*.tmp")), list(run.rglob("*"))
    if resumable:
        assert f"{run}/checkpoints/last.pt" in ours[0]
        saved = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
        assert saved["step"] > 0 and "model" in saved


@pytest.mark.parametrize(
    "where, overrides, resumable",
    [
        # The first checkpoint meets a full disk (step 10's: filled at step 3).
        ("first checkpoint", (fill_disk(3),), False),
        # A checkpoint's write runs out of space half way (step 20's, after step 10's).
        ("mid checkpoint", (fill_disk(12, leave=MID),), True),
        # metrics.jsonl's line at a validation (step mode: validation at step 20).
        ("metrics", ("trainer.val_every_steps=20", fill_disk(20)), True),
    ],
)  # fmt: skip
def test_classification_on_a_full_disk(disk, where, overrides, resumable):
    run = disk / "run"
    proc = run_script("train.py", *CLASSIFICATION, *overrides, f"run_dir={run}", nproc=2,
                      check=False)  # fmt: skip
    assert_stopped_by_the_full_disk(proc, run, resumable)
    if where == "metrics":  # the line was not written, and no torn one either
        assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text() == ""


def test_segmentation_checkpoint_on_a_full_disk(disk):
    run = disk / "run"
    proc = run_script("train.py", *SEGMENTATION, fill_disk(12, leave=MID), f"run_dir={run}",
                      nproc=2, check=False)  # fmt: skip
    assert_stopped_by_the_full_disk(proc, run, resumable=True)


def test_language_model_checkpoint_on_a_full_disk(disk, tmp_path):
    tokens = write_token_folder(tmp_path / "tokens", 2000, 400)
    run = disk / "run"
    proc = run_script("train.py", *LANGUAGE_MODEL, f"data.root={tokens}", fill_disk(12, leave=MID),
                      f"run_dir={run}", nproc=2, check=False)  # fmt: skip
    assert_stopped_by_the_full_disk(proc, run, resumable=True)


def test_a_picture_on_a_full_disk_is_the_same_paragraph(disk):
    from ddp_utils.dist import Runtime
    from ddp_utils.lifecycle.disk import UnwritableError
    from ddp_utils.plot import plot_runs
    from ddp_utils.run.folder import write_on_main
    from ddp_utils.run.records import append_metrics

    run = disk / "run"
    run.mkdir()
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
    for epoch in range(2):
        append_metrics(run, {"epoch": epoch, "step": epoch + 1, "train/loss": 1.0 / (epoch + 1),
                             "val/loss": 1.0, "val/accuracy": 0.5}, rt)  # fmt: skip
    with open(disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * (1 << 16))
    with pytest.raises(UnwritableError) as e:
        write_on_main(run, rt, lambda: plot_runs([run], run / "curves.png"))
    assert str(e.value).startswith(f"cannot write {run / 'curves.png'} (No space left on device)")
    assert e.value.exit_code == WRITE_FAILED_EXIT
    assert not list(run.glob("*.png")) and not list(run.glob(".*.tmp"))
