"""Unit tests with a patched environment: launch env, devices, samplers, schedules, models."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from helpers.paths import ROOT
from helpers.runs import compose_config
from torch.utils.data import DistributedSampler

from ddp_utils.config import (
    ConfigError,
    ConvNetModel,
    CosineSched,
    DataConfig,
    DigitsData,
    TorchvisionData,
    TrainerConfig,
    option_schema,
)
from ddp_utils.data import Preprocess, load_split
from ddp_utils.data.images.preprocess import random_crop_flip
from ddp_utils.data.samplers import EvalShardSampler
from ddp_utils.dist import (
    Runtime,
    first_host,
    init_distributed,
    pick_backend,
    pick_device,
    read_launch_env,
    shutdown,
)
from ddp_utils.hardware import Cuda
from ddp_utils.models import build_model
from ddp_utils.optim import lr_factor

TORCHRUN_ENV = {
    "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job7",
}  # fmt: skip


def test_launch_env_reads_torchrun_variables():
    env = read_launch_env(TORCHRUN_ENV)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.master_addr, env.master_port, env.run_id) == ("10.0.0.1", 29400, "job7")
    assert env.launched


def test_no_torchrun_means_world_size_one():
    env = read_launch_env({})
    assert (env.rank, env.world_size, env.launched) == (0, 1, False)


def test_plain_python_joins_a_group_of_one():
    with mock.patch.dict("os.environ", {}, clear=True):
        rt = init_distributed(TrainerConfig(device="cpu"))
    try:
        assert (rt.rank, rt.world_size, rt.is_main, rt.backend) == (0, 1, True, "gloo")
        assert torch.distributed.get_world_size() == 1
        with pytest.raises(
            dataclasses.FrozenInstanceError
        ):  # frozen: runtime facts cannot be changed
            rt.rank = 3
    finally:
        shutdown()
    assert not torch.distributed.is_initialized()


def test_survivors_of_a_lost_peer_leave_the_group_without_waiting_for_it(monkeypatch):
    """After a collective lost its peer, the others are not waited for at the end (it never
    comes: tests/test_elastic_e2e.py); any other ending waits for every rank."""
    import ddp_utils.lifecycle.peers as dist_module
    from ddp_utils.lifecycle.peers import process_group_left
    from ddp_utils.lifecycle.preemption import StoppedEarly

    calls = []
    monkeypatch.setattr(dist_module, "shutdown",
                        lambda together=True, wait_s=30.0: calls.append(together))  # fmt: skip
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1")
    with pytest.raises(RuntimeError), process_group_left():
        raise lost
    with pytest.raises(StoppedEarly), process_group_left():
        try:
            raise lost
        except RuntimeError:
            raise StoppedEarly(15) from None
    with pytest.raises(ValueError), process_group_left():
        raise ValueError("a user's mistake")
    with process_group_left():
        pass
    with process_group_left(leave=False):  # a sweep's job: the group stays
        pass
    assert calls == [False, False, True, True]


def test_device_auto_is_cpu_without_cuda_and_cuda_is_refused():
    env = read_launch_env(TORCHRUN_ENV)
    assert pick_device(TrainerConfig(device="auto"), env, Cuda()).type == "cpu"
    with pytest.raises(ConfigError, match="trainer.device=cuda"):
        pick_device(TrainerConfig(device="cuda"), env, Cuda())


def test_more_local_processes_than_gpus_fails_fast():
    env = read_launch_env(TORCHRUN_ENV)  # 4 local processes
    with pytest.raises(ConfigError, match="--nproc_per_node=2"):
        pick_device(TrainerConfig(device="auto"), env, Cuda(usable=True, device_count=2))
    four = Cuda(usable=True, device_count=4)
    assert pick_device(TrainerConfig(), env, four) == torch.device("cuda", 1)


def test_backend_choice():
    assert pick_backend(TrainerConfig(), torch.device("cpu")) == "gloo"
    assert pick_backend(TrainerConfig(), torch.device("cuda", 0)) == "nccl"
    assert pick_backend(TrainerConfig(backend="gloo"), torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ConfigError, match="trainer.backend=nccl"):
        pick_backend(TrainerConfig(backend="nccl"), torch.device("cpu"))


@pytest.mark.parametrize("length", [0, 1, 7, 2000, 2001])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_eval_sampler_gives_every_index_to_exactly_one_rank(length, world_size, batch):
    samplers = [EvalShardSampler(length, world_size, r, batch) for r in range(world_size)]
    shards = [list(s) for s in samplers]
    flat = sorted(i for shard in shards for i in shard)
    assert flat == list(range(length))
    assert [len(s) for s in samplers] == [len(s) for s in shards]
    # Whole canonical batches: batch k (the data set's k-th run of `batch`) on rank k % W, so a
    # loader batching each shard by `batch` sees world size 1's batches.
    for r, sampler in enumerate(samplers):
        batches = [shards[r][i : i + batch] for i in range(0, len(shards[r]), batch)]
        assert batches == [list(range(k * batch, min((k + 1) * batch, length)))
                           for k in sampler.batches()]  # fmt: skip
        assert all(k % world_size == r for k in sampler.batches())


def test_distributed_sampler_pads_which_is_why_eval_does_not_use_it():
    counted = sum(len(DistributedSampler(range(2000), 3, r, shuffle=False)) for r in range(3))
    assert counted == 2001


@pytest.mark.parametrize("name", ["none", "cosine", "step"])
def test_warmup_then_schedule(name):
    kw = {"step_epochs": 1, "gamma": 0.5} if name == "step" else {}
    cfg = option_schema("sched", name)(warmup_steps=10, warmup_start_factor=0.1, **kw)
    factors = [
        lr_factor(cfg, s, total_steps=100, steps_per_epoch=20, base_lr=0.1) for s in range(100)
    ]
    assert factors[0] == pytest.approx(0.1) and factors[5] == pytest.approx(0.55)
    assert factors[10] == pytest.approx(1.0)
    if name == "cosine":
        assert factors[-1] < 0.01 and all(
            a >= b for a, b in zip(factors[10:], factors[11:], strict=False)
        )
    if name == "step":
        assert factors[20] == 0.5 and factors[40] == 0.25


def test_warmup_epochs_count_in_optimizer_steps():
    cfg = CosineSched(warmup_epochs=2, warmup_start_factor=0.5)
    factors = [lr_factor(cfg, s, total_steps=50, steps_per_epoch=5, base_lr=0.1) for s in range(50)]
    assert factors[0] == pytest.approx(0.5) and factors[5] == pytest.approx(0.75)
    assert factors[10] == pytest.approx(1.0) and factors[11] < 1.0


@pytest.mark.parametrize("name", ["convnet", "mlp", "resnet18"])
@pytest.mark.parametrize("shape", [(1, 8, 10), (1, 28, 10), (3, 32, 10), (2, 20, 7)])
def test_models_fit_the_declared_data(name, shape):
    c, s, k = shape
    data = DataConfig(in_channels=c, image_size=s, num_classes=k, mean=[0.5] * c, std=[0.5] * c)
    model = build_model(compose_config(f"model={name}").model, data)
    assert model(torch.randn(2, c, s, s)).shape == (2, k)


def test_convnet_is_the_tutorial_model():
    model = build_model(ConvNetModel(), DataConfig(image_size=28))
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(16, (5, 5)), (32, (5, 5))]
    assert len(bns) == 2 and model.fc.in_features == 7 * 7 * 32


def test_digits_split_is_fixed_and_disjoint():
    cfg = DigitsData()
    train, val = load_split(cfg, "train"), load_split(cfg, "val")
    assert len(train) + len(val) == 1797 and len(val) == 359
    assert train.images.dtype == torch.uint8 and train.images.shape[1:] == (1, 8, 8)
    assert torch.equal(load_split(cfg, "val").labels, val.labels)
    train_rows = {tuple(x.flatten().tolist()) for x in train.images}
    overlap = sum(tuple(x.flatten().tolist()) in train_rows for x in val.images)
    assert overlap < 10  # the bundled set has a few duplicate images, no shared indices


def test_missing_torchvision_data_names_root_and_fix(tmp_path):
    cfg = TorchvisionData(name="mnist", root=str(tmp_path), image_size=28)
    with pytest.raises(ConfigError, match="data.download=true") as e:
        load_split(cfg, "val")
    assert str(tmp_path) in str(e.value)


def test_preprocess_normalises_and_augments_in_batch():
    cfg = DataConfig(in_channels=3, image_size=32, mean=[0.5] * 3, std=[0.25] * 3, augment=True)
    x = torch.full((4, 3, 32, 32), 128, dtype=torch.uint8)
    out = Preprocess(cfg, augment=False)(x)
    assert out.dtype == torch.float32 and torch.allclose(
        out, torch.full_like(out, 0.00784), atol=1e-4
    )
    torch.manual_seed(0)
    crops = random_crop_flip(torch.arange(1, 2 * 32 * 32 + 1.0).view(2, 1, 32, 32), padding=4)
    assert crops.shape == (2, 1, 32, 32)
    assert (crops == 0).any()  # some zero padding shifted in


def test_slurm_environment_without_torchrun():
    env = read_launch_env(
        {
            "SLURM_PROCID": "9",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "16",
            "SLURM_TASKS_PER_NODE": "8(x2)",
            "SLURM_JOB_NODELIST": "gpu[007-008,012],cpu1",
            "SLURM_JOB_ID": "4242",
        }  # fmt: skip
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (9, 1, 16, 8)
    assert env.master_addr == "gpu007" and env.master_port == 15000 + 4242
    assert env.run_id == "slurm4242" and env.launched


def test_torchrun_variables_win_over_slurm_and_master_can_be_set():
    both = {**TORCHRUN_ENV, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert read_launch_env(both).rank == 5
    env = read_launch_env(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "n1",
            "MASTER_ADDR": "head",
            "MASTER_PORT": "1234",
        }  # fmt: skip
    )
    assert (env.master_addr, env.master_port, env.local_world_size) == ("head", 1234, 2)


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("node1", "node1"),
        ("a-b[1-2]", "a-b1"),
        ("n[03]x,m1", "n03x"),
        ("h1,h2", "h1"),
        ("gpu[12,4]", "gpu12"),
    ],  # fmt: skip
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_a_rank_that_cannot_see_run_dir_says_so(tmp_path):
    from ddp_utils.run.folder import resolve_run_dir

    rt = Runtime(rank=3, local_rank=1, world_size=4, local_world_size=2,
                 device=torch.device("cpu"), backend="gloo")  # fmt: skip
    missing = tmp_path / "on_another_node"
    with (
        mock.patch(
            "ddp_utils.run.folder.broadcast_object", return_value=(str(missing), False, None, "")
        ),
        mock.patch("ddp_utils.run.folder.barrier"),
        pytest.raises(ConfigError, match="shared") as e,
    ):
        resolve_run_dir(None, rt)
    assert e.value.rank_specific and "rank 3" in str(e.value)


def test_eval_metrics_match_scikit_learns_and_leave_skipped_images_out():
    from sklearn import metrics as skm

    from ddp_utils.config import TaskConfig
    from ddp_utils.data.samplers import BAD_LABEL
    from ddp_utils.evaluation import build_metrics, evaluate
    from ddp_utils.tasks.classification import Classification

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 10, generator=g)
    logits[:, 9] -= 100  # class 9: never predicted and never a label, so left out of macro F1
    target = torch.randint(0, 9, (500,), generator=g)
    target[target == 7] = 3  # class 7: predicted, never a label (recall 0)
    skipped = torch.arange(500) % 37 == 0
    labels = torch.where(skipped, BAD_LABEL, target)
    # The logits stand in for the images: an identity model, a batch loader of 64.
    loader = torch.utils.data.DataLoader(list(zip(logits, labels, strict=True)), batch_size=64)
    task = Classification(10)
    metrics = build_metrics(TaskConfig(), task, torch.device("cpu"))
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
    identity = torch.nn.Identity()
    r = evaluate(identity, loader, identity, rt, task, metrics, skip_bad=True)
    y, scores = target[~skipped].numpy(), logits[~skipped]
    pred = scores.argmax(dim=1).numpy()
    assert (r["num_samples"], r["skipped_images"]) == (500 - 14, 14)
    assert r["confusion_matrix"] == skm.confusion_matrix(y, pred, labels=range(10)).tolist()
    assert r["accuracy"] == pytest.approx(skm.accuracy_score(y, pred), abs=1e-6)
    assert r["f1_macro"] == pytest.approx(skm.f1_score(y, pred, average="macro"), abs=1e-6)
    recall = skm.recall_score(y, pred, average=None, labels=range(10), zero_division=0)
    assert r["per_class_accuracy"] == pytest.approx(recall.tolist(), abs=1e-6)
    top5 = skm.top_k_accuracy_score(y, scores.numpy(), k=5, labels=range(10))
    assert r["top5"] == pytest.approx(top5, abs=1e-6)
    loss = torch.nn.functional.cross_entropy(scores, target[~skipped]).item()
    assert r["loss"] == pytest.approx(loss, rel=1e-6)


def test_digits_are_scikit_learns_load_digits():
    from sklearn.datasets import load_digits

    from ddp_utils.data.images.builtin import digits_arrays

    images, target = digits_arrays()
    bunch = load_digits()
    assert np.array_equal(images, bunch.images) and np.array_equal(target, bunch.target)


def test_help_and_config_mistakes_answer_before_the_training_stack_is_imported():
    """What keeps --help and every configuration mistake quick: the entry's imports and the
    config's validation load neither torchmetrics (2-3 s a process) nor torchvision."""
    code = """
import sys
import ddp_utils.entry
from ddp_utils.config import TrainConfig, validate
validate(TrainConfig())
print(sorted({m.split(".")[0] for m in sys.modules} & {"torchmetrics", "torchvision"}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "code, fix",
    [("ENOSPC", "Free space there"), ("EDQUOT", "Free space there"),
     ("EROFS", "Make the folder writable"), ("EACCES", "Make the folder writable")],
)  # fmt: skip
def test_an_unwritable_run_dir_is_one_paragraph_and_leaves_no_torn_line(tmp_path, code, fix):
    import errno
    import os

    from ddp_utils.lifecycle.disk import WRITE_FAILED_EXIT, UnwritableError
    from ddp_utils.run.records import append_metrics

    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
    append_metrics(tmp_path, {"epoch": 0, "step": 1}, rt)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    err = OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
    with mock.patch("os.fsync", side_effect=err), pytest.raises(UnwritableError) as e:
        append_metrics(tmp_path, {"epoch": 1, "step": 2}, rt)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    message = str(e.value)
    assert message.startswith(f"cannot write {tmp_path / 'metrics.jsonl'} ({err.strerror})")
    assert f"run_dir={tmp_path} has " in message and fix in message
    assert e.value.exit_code == WRITE_FAILED_EXIT == 4


@pytest.mark.parametrize("precision, clip", [("32", None), ("bf16", 2.0)])
def test_the_divergence_message_suggests_only_what_would_change(tmp_path, precision, clip):
    from types import SimpleNamespace

    from ddp_utils.checkpoint import diverged

    trainer = SimpleNamespace(grad_clip=clip, precision=precision)
    cfg = SimpleNamespace(optim=SimpleNamespace(lr=0.1), trainer=trainer)
    tr = SimpleNamespace(run_dir=tmp_path, step=3, epoch=0, cfg=cfg)
    text = str(diverged(tr, "the training loss"))
    assert "a lower optim.lr (now 0.1)" in text
    assert ("trainer.precision=32" in text) == (precision != "32")
    assert ("trainer.grad_clip=1.0" in text) == (clip is None)
    assert ("a lower trainer.grad_clip (now 2)" in text) == (clip is not None)


def test_a_checkpoint_from_before_per_option_schemas_resumes_and_evaluates():
    """That release stored every data option's keys (and every model option's) whatever the
    option: they are not this option's, so they are neither compared nor merged."""
    from ddp_utils.checkpoint.resume import config_changes
    from ddp_utils.config import TrainConfig, as_plain_dict, from_record, to_schema

    stored = as_plain_dict(TrainConfig())
    stored["data"] |= {"root": "data", "download": False, "train_dir": "train", "val_dir": "val",
                       "resize_size": None, "interpolation": "bilinear", "skip_bad_images": False,
                       "_target_": None, "kwargs": {}, "auto_augment": None, "random_erase": 0.0,
                       "train_crop_size": None, "num_train": 8000, "num_val": 2000}  # fmt: skip
    stored["model"] |= {"arch": None, "hidden": 256, "kwargs": {}}
    stored["task"] |= {"kwargs": {}}
    assert config_changes(stored, TrainConfig()) == ([], [])
    assert to_schema(from_record(stored)) == TrainConfig()
    stored["data"]["val_fraction"] = 0.3
    assert config_changes(stored, TrainConfig())[0] == ["data.val_fraction: 0.3 -> 0.2"]


def test_a_custom_targets_arguments_belong_to_the_runs_identity():
    from ddp_utils.checkpoint.resume import config_changes
    from ddp_utils.config import CustomData, TrainConfig, as_plain_dict

    cfg = TrainConfig(data=CustomData(_target_="m.f", kwargs={"limit": 5}))
    stored = as_plain_dict(TrainConfig(data=CustomData(_target_="m.f", kwargs={"limit": 6})))
    assert config_changes(stored, cfg)[0] == ["data.kwargs.limit: 6 -> 5"]


def test_a_checkpoint_from_before_tasks_resumes_as_classification():
    from ddp_utils.checkpoint.resume import config_changes
    from ddp_utils.checkpoint.state import resumed_best
    from ddp_utils.config import TrainConfig, as_plain_dict

    stored = as_plain_dict(TrainConfig())
    del stored["task"]  # the previous release's checkpoints have no task
    assert config_changes(stored, TrainConfig()) == ([], [])
    old = {"best_accuracy": 0.9, "best_ema_accuracy": -1.0, "config": stored}
    assert resumed_best(old, "accuracy") == (0.9, None)
    assert resumed_best(old, "loss") == (None, None)  # another monitor: its best afresh


def test_the_sweep_table_shows_each_jobs_monitor_whatever_the_task(tmp_path):
    from ddp_utils.sweep import format_summary, write_summary

    for job, (monitor, record) in enumerate([
        ("val/mae", {"val/mae": 1.25, "val/loss": 2.0}),
        ("val/mae", {"val/mae": 0.75, "val/loss": 1.0}),
    ]):  # fmt: skip
        folder = tmp_path / str(job)
        folder.mkdir()
        (folder / "job.json").write_text(json.dumps(
            {"job": job, "overrides": [f"optim.lr={job}"], "status": "COMPLETED",
             "monitor": monitor, "error": None}))  # fmt: skip
        line = {"epoch": 1, "step": 9, "world_size": 2, "train/loss": 3.0, **record}
        (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    rows = write_summary(tmp_path)
    table = format_summary(rows).splitlines()
    assert table[0].split()[:3] == ["job", "status", "val/mae"]
    assert table[1].split()[:4] == ["0", "COMPLETED", "1.2500", "3.0000"]
    header = (tmp_path / "summary.csv").read_text().splitlines()[0]
    assert header == ("job,overrides,status,world_size,epoch,step,train/loss,val/mae,val/loss,"
                      "monitor,error")  # fmt: skip
    rows[1].pop("monitor")  # a job.json from before tasks: val/accuracy
    assert format_summary(rows).splitlines()[0].split()[2] == "monitor"


def test_optimizers_are_fused_and_a_single_process_trains_its_module_without_ddp():
    """Both measured faster here (README): fused SGD and AdamW on the CPU too, and no DDP
    reducer at world size 1, where its all-reduce is the identity."""
    from ddp_utils.optim import build_optimizer
    from ddp_utils.strategy import build_strategy

    module = torch.nn.Linear(3, 2)
    for option in ("sgd", "adamw"):
        optimizer = build_optimizer(compose_config(f"optim={option}").optim, module)
        assert optimizer.defaults["fused"] is True
    rt = Runtime(rank=0, world_size=1, local_rank=0, local_world_size=1,
                 device=torch.device("cpu"), backend="gloo")  # fmt: skip
    strategy = build_strategy(TrainerConfig(channels_last="false"), rt)
    assert strategy.wrap(module) is strategy.raw_model is module


def test_what_identifies_a_run_is_declared_by_its_options():
    """resume refuses a change of a key the data or task option declares in ``identity``, and
    takes any other (a data option of the user's own extends its parent's declaration)."""
    from dataclasses import dataclass
    from typing import ClassVar

    from ddp_utils.checkpoint.resume import config_changes, identity_keys
    from ddp_utils.config import PyStdlibData, SyntheticData, TrainConfig, as_plain_dict

    cfg = TrainConfig(data=PyStdlibData(tokenizer="bytes", batch_size=8))
    stored = as_plain_dict(TrainConfig(data=PyStdlibData(tokenizer="char", batch_size=4)))
    refused, allowed = config_changes(stored, cfg)
    assert refused == ["data.tokenizer: 'char' -> 'bytes'"]
    assert allowed == ["data.batch_size: 4 -> 8"]

    @dataclass
    class Shapes(SyntheticData):
        identity: ClassVar[tuple[str, ...]] = SyntheticData.identity + ("sides",)
        sides: int = 3

    keys = identity_keys(TrainConfig(data=Shapes()))
    assert {"data.sides", "data.num_train", "seed", "model."} <= set(keys)
    assert "data.batch_size" not in keys


def _signal_inside(steps: list[str]) -> None:
    """Inside clean_exit as a job runs it: the training loop begins if asked, then a lost
    collective if asked, and SIGTERM arrives while that error unwinds (torchrun's stop of the
    survivors)."""
    import os
    import signal
    from datetime import timedelta

    from ddp_utils.entry import clean_exit
    from ddp_utils.lifecycle.preemption import StopRequest

    with clean_exit():
        stop = StopRequest(timedelta(seconds=5))
        if "train" in steps:
            stop.begin()
        stop.close()  # the loop's handlers go, as tr.close() does after an error
        try:
            if "lost" in steps:
                raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode


@pytest.mark.parametrize(
    ("steps", "code", "says"),
    [
        ((), 75, "error: stopped by SIGTERM before the first training step; nothing was saved"),
        (("train",), 75, "error: stopped by SIGTERM while the run was ending; relaunch the same"),
        (("train", "lost"), 1, "[rank 0] stopping: another rank is gone"),
    ],
)
def test_a_stop_signal_outside_the_loop_names_what_happened(steps, code, says, capsys):
    with (
        mock.patch.dict("os.environ", {"RANK": "0"}),
        mock.patch("ddp_utils.lifecycle.exit.NON_MAIN_EXIT_DELAY_S", 0),
        mock.patch("ddp_utils.lifecycle.exit.write_error_file"),
        mock.patch("ddp_utils.lifecycle.exit.exit_now", sys.exit),  # not os._exit: this is pytest
        # clean_exit marks the job started: a fork of this process (run_forked) must not
        # inherit that, nor the training flag.
        mock.patch("ddp_utils.entry._job_started", False),
        mock.patch("ddp_utils.lifecycle.preemption._trained", False),
        pytest.raises(SystemExit) as exit_,
    ):
        _signal_inside(list(steps))
    assert exit_.value.code == code
    assert says in capsys.readouterr().err


def test_leave_joins_threads_runs_atexit_handlers_and_exits_0(tmp_path):
    """A finished script's exit skips the module teardown, not what the teardown would run:
    a non-daemon thread still working, an atexit handler, and logs and prints still buffered."""
    from helpers.paths import ROOT

    script = f"""
import atexit, logging, pathlib, sys, threading, time
sys.path.insert(0, {str(ROOT)!r})
from ddp_utils.lifecycle.exit import leave
out = pathlib.Path({str(tmp_path)!r})
logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
atexit.register(lambda: (out / "atexit").write_text("done"))
logging.info("logged")
print("printed", end="")
leave()
print("never")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "printed", proc.stderr
    assert (tmp_path / "thread").read_text() == "done" == (tmp_path / "atexit").read_text()
    assert "logged" in (tmp_path / "log.txt").read_text()


@pytest.mark.parametrize(
    ("world_size", "cap", "want"),
    [(1, 100, (60, 2)), (1, 120, (120, 1)), (2, 100, (60, 1)), (3, 100, (40, 1)), (4, 100, (30, 1)),
     (2, 32, (30, 2)), (1, 7, (6, 20)), (8, 16, (15, 1))],
)  # fmt: skip
def test_a_global_batch_is_split_with_the_fewest_accumulation_steps(world_size, cap, want):
    from ddp_utils.train.state import split_global_batch

    batch, accum = split_global_batch(120, world_size, cap)
    assert (batch, accum) == want and batch * world_size * accum == 120 and batch <= cap


def test_a_global_batch_the_world_size_does_not_divide_is_refused_naming_values():
    from ddp_utils.train.state import split_global_batch

    with pytest.raises(ConfigError, match=r"data.global_batch_size=119 or 126"):
        split_global_batch(125, 7, 100)


def test_the_global_batch_sets_batch_and_accumulation_and_refuses_an_explicit_one():
    from ddp_utils.train.state import resolve_auto

    cfg = compose_config("data.global_batch_size=120", "data.batch_size=32",
                         "trainer.precision=32")  # fmt: skip
    rt = Runtime(0, 0, 2, 2, torch.device("cpu"), "gloo")
    resolved = resolve_auto(cfg, rt)
    assert (resolved.data.batch_size, resolved.trainer.grad_accum_steps) == (30, 2)
    assert resolved.data.global_batch_size == 120
    both = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, grad_accum_steps=3))
    with pytest.raises(ConfigError, match=r"drop trainer.grad_accum_steps=3"):
        resolve_auto(both, rt)


def test_with_a_global_batch_each_step_takes_the_same_samples_at_any_world_size():
    """Global batch k is positions [kG, (k+1)G) of the epoch's order whatever the world size,
    an epoch has the same steps, and a resume at another world size from a step boundary
    continues with the same global batches."""
    from ddp_utils.config import DigitsData
    from ddp_utils.data.samplers import training_sampler

    def steps(world_size: int, start: int = 0) -> list[set[int]]:
        batch, accum = {2: (30, 2), 3: (40, 1), 4: (30, 1)}[world_size]
        cfg = DigitsData(batch_size=batch, global_batch_size=120)
        shards = []
        for rank in range(world_size):
            rt = Runtime(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")
            sampler = training_sampler(1797, cfg, rt, seed=3)
            sampler.set_epoch(1, start)
            shards.append(list(sampler))
        per_step = batch * accum
        assert all(len(s) % per_step == 0 for s in shards)
        return [set().union(*(s[k * per_step:(k + 1) * per_step] for s in shards))
                for k in range(len(shards[0]) // per_step)]  # fmt: skip

    two = steps(2)
    assert len(two) == 1797 // 120 and all(len(s) == 120 for s in two)
    assert steps(3) == two == steps(4)
    assert steps(3, start=5 * 120) == two[5:]


def test_a_finished_script_exits_with_a_thread_pool_alive_and_runs_atexit(tmp_path):
    """torch.compile leaves a ThreadPoolExecutor behind: ``leave`` must let its workers finish
    (threading's exit hooks) before joining them, and still run the atexit handlers."""
    marker = tmp_path / "atexit"
    code = f"""
import atexit, concurrent.futures, pathlib
from ddp_utils.lifecycle.exit import leave
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(sum, [1, 2]).result()
atexit.register(pathlib.Path({str(marker)!r}).write_text, "ran")
leave()
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "ran"


def test_profiler_ranks_outside_the_world_are_named_and_profile_nothing(tmp_path, caplog):
    from types import SimpleNamespace

    from ddp_utils.config.schema import ProfilerOptions
    from ddp_utils.train.profiler import Profiler
    from ddp_utils.train.state import no_phase

    rt = SimpleNamespace(rank=0, world_size=2, is_main=True, device=torch.device("cpu"))
    tr = SimpleNamespace(rt=rt, run_dir=tmp_path, phase=no_phase)
    profiler = Profiler(ProfilerOptions(ranks=[4]))
    with caplog.at_level("WARNING"):
        profiler.on_train_start(tr)
    assert "trainer.profiler.ranks=[4] names no rank of world size 2" in caplog.text
    assert "name ranks from 0 to 1" in caplog.text
    assert profiler.prof is None and tr.phase is no_phase
    caplog.clear()
    Profiler(ProfilerOptions(ranks=[1])).on_train_start(tr)  # rank 1 exists: no warning
    assert "names no rank" not in caplog.text
