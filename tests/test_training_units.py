"""What trains: schedules, the built-in models, the optimizers, the embedded digits and their
metrics, the profiler's ranks, the sweep table."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.runs import compose_config

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
from ddp_utils.dist import (
    Runtime,
)
from ddp_utils.models import build_model
from ddp_utils.optim import lr_factor


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
