"""Targets of any shape: a user's task outside the package, whose data set yields per-image
dicts of boxes of varying length, trains at world size 2 and evaluates identically at world
sizes 1 and 3 (tests/box_task.py)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.launch import run_ranks
from helpers.paths import ROOT
from helpers.runs import read_metrics

from ddp_utils.data.loaders import collate
from ddp_utils.data.samplers import BAD_LABEL, IGNORE_LABEL, SENTINEL
from ddp_utils.tasks import Task

ENV = {"PYTHONPATH": str(ROOT / "tests")}
# 121 training images: at world size 2 one rank's shard ends in a padding duplicate, which
# data.drop_last=false trains on as a sentinel target (not counted).
RUN = ("data=custom", "data._target_=box_task.boxes", "task=custom",
       "task._target_=box_task.BoxCount", "task.monitor=count_accuracy", "task.monitor_mode=max",
       "data.image_size=16", "data.resize_size=16", "data.num_classes=1", "data.batch_size=8",
       "data.drop_last=false", "data.num_workers=1", "trainer.epochs=2", "trainer.precision=32",
       "optim.lr=0.02", "trainer.grad_clip=1.0")  # fmt: skip


def test_per_sample_dict_targets_collate_as_a_list_and_count_only_real_samples():
    image = torch.zeros(1, 4, 4, dtype=torch.uint8)
    one = {"boxes": torch.tensor([[0.0, 0, 2, 2]]), "labels": torch.tensor([1])}
    two = {"boxes": torch.zeros(2, 4), "labels": torch.tensor([1, 1])}
    images, target = collate([(image, one), (image, two), (image, IGNORE_LABEL),
                              (image, BAD_LABEL)])  # fmt: skip
    assert images.shape == (4, 1, 4, 4) and target[:2] == [one, two]
    assert target[2:] == [{SENTINEL: IGNORE_LABEL}, {SENTINEL: BAD_LABEL}]
    batch = Task().to_batch(images, target, torch.device("cpu"), torch.nn.Identity(),
                            skip_bad=True)  # fmt: skip
    assert batch.size == 4 and batch.real.tolist() == [True, True, False, False]
    assert int(batch.count()) == 2 and int(batch.skipped) == 1
    assert batch.select(["a", "b", "c", "d"]) == ["a", "b"]
    labels = collate([(image, 3), (image, IGNORE_LABEL)])[1]  # class labels: one tensor
    assert labels.tolist() == [3, IGNORE_LABEL]


@pytest.fixture(scope="module")
def box_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("boxes")
    run_ranks("train.py", *RUN, f"run_dir={run}", nproc=2, env=ENV)
    return run


def test_a_box_task_trains_at_world_size_2_and_evaluates_the_same_at_1_and_3(box_run, tmp_path):
    from box_task import boxes

    records = read_metrics(box_run)
    assert [r["epoch"] for r in records] == [0, 1] and records[-1]["val/num_samples"] == 50
    val = boxes()[1]
    truth = {"boxes": sum(len(t["boxes"]) for _, t in val),
             "box_area": sum(float(((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])).sum())
                             for b in (t["boxes"] for _, t in val))}  # fmt: skip
    assert records[-1]["val/boxes"] == truth["boxes"]  # every image once, no duplicate
    results = {}
    for n in (1, 3):
        out = tmp_path / f"eval{n}.json"
        run_ranks("eval.py", f"checkpoint={box_run}/checkpoints/last.pt", f"output={out}",
                  nproc=n, env=ENV)  # fmt: skip
        results[n] = json.loads(out.read_text())
    for n, r in results.items():
        assert r["num_samples"] == 50 and r["world_size"] == n
        assert r["boxes"] == truth["boxes"] and r["box_area"] == truth["box_area"], n
        assert r["count_accuracy"] == results[1]["count_accuracy"]
        assert abs(r["loss"] - results[1]["loss"]) <= 1e-6
    assert results[1]["count_accuracy"] == records[-1]["val/count_accuracy"]
