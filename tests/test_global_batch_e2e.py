"""``data.global_batch_size``: a run stopped at world size 2 and resumed at world size 3
continues the same optimisation (the same samples in each step, the same steps per epoch and
learning-rate schedule), to the uninterrupted run's parameters within float rounding, under
ddp and fsdp2 (the GPT's case: tests/test_fsdp2_e2e.py)."""

from __future__ import annotations

import pytest
from helpers.launch import run_ranks
from helpers.runs import params, read_metrics

# 1,437 training digits, 120 a step: 11 steps an epoch at any world size (60 a process at
# world size 2, 40 at 3). The MLP has no BatchNorm, whose statistics would follow the
# per-process batch.
ARGS = ("model=mlp", "data.global_batch_size=120", "trainer.epochs=2",
        "trainer.ckpt_every_steps=5", "trainer.keep_last=10", "trainer.precision=32")  # fmt: skip
TOLERANCE = 1e-6  # measured: 1.5e-8 (the all-reduce sums 2 or 3 partial gradients)


@pytest.mark.parametrize(("strategy", "suffix"), [("ddp", "pt"), ("fsdp2", "dcp")])
def test_a_run_resumed_at_another_world_size_continues_the_same_optimisation(
    tmp_path, strategy, suffix
):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    args = (*ARGS, f"trainer.strategy={strategy}")
    run_ranks("train.py", *args, f"run_dir={reference}", nproc=2)
    step_15 = reference / "checkpoints" / f"step_00000015.{suffix}"  # 4 steps into epoch 2
    run_ranks("train.py", *args, f"run_dir={resumed}", f"resume={step_15}", nproc=3)
    log = (resumed / "train.log").read_text()
    assert "40 per process x 3 processes x 1 accumulation steps" in log, log
    assert "the run's length from here" not in log  # the same steps: the schedule stands
    want, got = params(reference), params(resumed)
    worst = max((want[k] - got[k]).abs().max().item() for k in want)
    print(f"{strategy}: largest parameter difference {worst:.2e}")
    assert worst < TOLERANCE, worst
    last, again = read_metrics(reference)[-1], read_metrics(resumed)[-1]
    assert last["step"] == again["step"] == 22
    assert abs(last["val/loss"] - again["val/loss"]) < 1e-4
