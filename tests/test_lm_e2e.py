"""Language models end to end with real gloo processes: step-based runs, exact evaluation at
world sizes 1, 2 and 3, an exact resume after a SIGKILL, deterministic generation."""

from __future__ import annotations

import math
import time

import pytest
from callbacks import fault
from helpers.launch import run_forked, run_ranks, run_script
from helpers.runs import assert_same_params, eval_at_world_sizes, params, read_metrics
from lm_data import write_token_folder

VAL_WINDOWS = 127  # 16-token windows: a prime, which no world size divides
# 2000 training tokens: 124 windows of 16, 15 whole steps an epoch at 2 x 4 (4 windows left
# out); 30 steps span 2 epochs.
RUN = ("experiment=lm_char", "data=tokens", "data.block_size=16", "data.batch_size=4",
       "data.global_batch_size=null",
       "data.eval_batch_size=8", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
       "trainer.max_steps=30", "trainer.val_every_steps=10", "trainer.ckpt_every_steps=5",
       "sched.warmup_steps=5", "trainer.precision=32", "logger=none")  # fmt: skip


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_token_folder(tmp_path_factory.mktemp("tokens"), 2000, 16 * VAL_WINDOWS + 1)


@pytest.fixture(scope="module")
def reference(tokens, tmp_path_factory):
    run = tmp_path_factory.mktemp("lm_reference")
    run_ranks("train.py", *RUN, f"data.root={tokens}", f"run_dir={run}", nproc=2)
    return run


def test_a_step_based_run_validates_every_n_steps_across_epochs(reference):
    records = read_metrics(reference)
    assert [r["step"] for r in records] == [10, 20, 30]
    assert [r["epoch"] for r in records] == [0, 1, 1]  # the epoch rolled over at step 15
    assert [r["tokens"] for r in records] == [10 * 8 * 16, 20 * 8 * 16, 30 * 8 * 16]
    for r in records:
        assert r["val/num_samples"] == VAL_WINDOWS and r["tokens_per_s"] > 0
        assert math.isclose(r["val/perplexity"], math.exp(r["val/loss"]), rel_tol=1e-5)
        assert math.isclose(r["val/bits_per_byte"], r["val/loss"] / math.log(2), rel_tol=1e-9)
    assert records[-1]["val/loss"] < records[0]["val/loss"] < math.log(30)


def test_sigkill_mid_epoch_then_elastic_restart_matches_uninterrupted(tokens, reference, tmp_path):
    proc = run_script("train.py", *RUN, f"data.root={tokens}", f"run_dir={tmp_path}",
                      fault("kill", 23, 1), nproc=2, launcher=("--max-restarts=1",))  # fmt: skip
    assert "failed (exitcode:" in proc.stderr
    log = (tmp_path / "train.log").read_text()
    assert "resumed from" in log and "step 20" in log
    assert_same_params(params(tmp_path), params(reference))
    assert [r["step"] for r in read_metrics(tmp_path)] == [10, 20, 30]


def test_eval_loss_is_the_same_at_world_sizes_1_2_and_3(reference, tmp_path):
    results = eval_at_world_sizes(reference / "checkpoints" / "last.pt", tmp_path)
    logged = read_metrics(reference)[-1]
    for n, r in results.items():
        assert r["num_samples"] == VAL_WINDOWS, n
        # Training's validation and eval.py at every world size: the same, to the last digit.
        for key in ("loss", "perplexity", "bits_per_byte"):
            assert r[key] == logged[f"val/{key}"], (n, key)


def test_generation_is_deterministic_for_a_seed_and_refuses_bad_input(reference, tmp_path):
    ckpt = reference / "checkpoints" / "best.pt"
    args = (f"checkpoint={ckpt}", "prompt='the '", "max_new_tokens=40", "num_samples=2")
    runs = [run_forked("generate.py", *args, f"seed={s}") for s in (0, 0, 1)]
    assert all(p.returncode == 0 for p in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout != runs[2].stdout
    samples = [line for line in runs[0].stdout.splitlines() if not line.startswith("---")]
    assert samples[0].startswith("the ") and runs[0].stdout.count("--- sample") == 2
    for bad, said in (("prompt='the Zebra'", "outside the vocabulary"),
                      (f"checkpoint={tmp_path}/none.pt", "no such file")):  # fmt: skip
        proc = run_forked("generate.py", *args, bad)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(errors) == 1 and said in errors[0], proc.stderr


@pytest.mark.parametrize(
    "block, split, said",
    [(200000, "train", "too few for one training window of data.block_size=200000"),
     (500, "val", "data.block_size=500 is larger than the val file")],
)  # fmt: skip
def test_a_block_size_longer_than_a_file_stops_in_seconds_naming_it(tmp_path, block, split,
                                                                    said):  # fmt: skip
    tokens = write_token_folder(tmp_path / "tokens", 2000, 400)
    run = tmp_path / "run"
    start = time.monotonic()
    proc = run_forked("train.py", *RUN, f"data.root={tokens}", f"data.block_size={block}",
                      "model.n_layer=4", "model.n_embd=128", f"run_dir={run}")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - start < 30
    length = 2000 if split == "train" else 400
    assert said in proc.stderr and f"{tokens / split}.bin has {length} tokens" in proc.stderr
    assert not run.exists()
