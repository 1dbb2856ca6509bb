"""End-to-end: train.py under torchrun with real gloo processes, checked against numbers."""

from __future__ import annotations

import pytest
import torch
from helpers.launch import run_forked, run_ranks, run_script
from helpers.paths import MNIST_ROOT, needs_mnist
from helpers.runs import compose_config, read_metrics

from ddp_utils.config import DataConfig
from ddp_utils.models import build_model


def _params(path):
    return torch.load(path, weights_only=True)["model"]


def test_two_ranks_at_batch_b_equal_one_rank_at_batch_2b(tmp_path):
    common = ["model=mlp", "trainer.max_steps=12", "trainer.epochs=1", "optim.lr=0.05",
              "trainer.precision=32"]  # fmt: skip
    run_ranks("train.py", *common, "data.batch_size=16", f"run_dir={tmp_path}/ddp", nproc=2)
    run_ranks("train.py", *common, "data.batch_size=32", f"run_dir={tmp_path}/single", nproc=1)
    a = _params(tmp_path / "ddp" / "checkpoints" / "last.pt")
    b = _params(tmp_path / "single" / "checkpoints" / "last.pt")
    torch.manual_seed(0)  # train.py's weights come from `seed` (0) on every rank
    initial = build_model(compose_config("model=mlp").model, DataConfig()).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        rel = (a[k] - b[k]).norm() / b[k].norm()
        assert rel <= 1e-5, f"{k}: relative difference {rel:.2e}"
        # The runs really trained: equality is not the untouched initial weights.
        assert (a[k] - initial[k]).norm() / initial[k].norm() > 1e-3


def test_bad_input_gives_one_message_and_a_non_zero_exit(tmp_path):
    proc = run_script("train.py", "trainer.ddp.sync_bn=true", nproc=2, check=False, cwd=tmp_path)
    assert proc.returncode != 0
    # Printed once, first (the other rank says nothing); torchrun's summary names it as the
    # root cause instead of a traceback.
    printed = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(printed) == 1 and "trainer.ddp.sync_bn=true needs CUDA" in printed[0]
    assert "Traceback" not in proc.stderr.split(printed[0])[0]
    assert f"traceback : {printed[0]}" in proc.stderr
    assert not (tmp_path / "outputs").exists()  # refused before anything was written


def test_unknown_key_on_the_command_line_names_it(tmp_path):
    proc = run_forked("train.py", "trainer.epoch=3", cwd=tmp_path)
    assert proc.returncode != 0
    assert "epoch" in proc.stderr and "Traceback" not in proc.stderr


@needs_mnist
def test_mnist_two_ranks_two_epochs_reach_97_percent(tmp_path):
    run_script(
        "train.py", "data=mnist", f"data.root={MNIST_ROOT}", "data.download=false",
        "trainer.epochs=2", f"run_dir={tmp_path}", nproc=2,
    )  # fmt: skip
    last = read_metrics(tmp_path)[-1]
    assert last["val/num_samples"] == 2000
    assert last["val/accuracy"] >= 0.97, last


def test_your_own_optimizer_and_schedule_by_target_train_and_resume_their_state(tmp_path):
    """optim=custom and sched=custom (issue 34): any torch optimizer and scheduler by
    ``_target_`` with ``+GROUP.NAME=VALUE`` arguments, at world size 2; the checkpoint holds
    their state, and the lr is the schedule's after every optimizer step."""
    args = ["model=mlp", "trainer.max_steps=6", "trainer.epochs=1", "optim=custom",
            "optim._target_=torch.optim.RMSprop", "+optim.alpha=0.8", "optim.lr=0.002",
            "sched=custom", "sched._target_=torch.optim.lr_scheduler.ExponentialLR",
            "+sched.gamma=0.5", f"run_dir={tmp_path}/run", "trainer.precision=32"]  # fmt: skip
    run_ranks("train.py", *args, nproc=2)
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)
    group = ckpt["optimizer"]["param_groups"][0]
    assert group["alpha"] == 0.8 and group["lr"] == pytest.approx(0.002 * 0.5**6)
    assert "square_avg" in next(iter(ckpt["optimizer"]["state"].values()))  # RMSprop's
    assert ckpt["scheduler"]["gamma"] == 0.5


def test_a_custom_optimizer_or_schedule_without_a_target_is_refused_naming_the_key(tmp_path):
    for group, name in (("optim", "Optimizer"), ("sched", "Scheduler")):
        proc = run_forked("train.py", f"{group}=custom", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert f"{group}=custom needs {group}._target_=pkg.module.{name}" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()
