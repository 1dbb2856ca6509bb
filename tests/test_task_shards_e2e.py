"""data=segshards and data=detshards end to end: a segmentation folder and a COCO folder
written as tar shards by ``python -m ddp_utils.shards write``, read back sample for sample,
trained at world size 2 and scored by eval.py at world sizes 1 and 3 with identical numbers,
equal to training's last validation; a malformed boxes record named before training."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from detfolders import write_coco_folder
from helpers.launch import run_forked, run_ranks
from helpers.paths import ROOT
from helpers.runs import read_metrics
from segfolders import VAL_SIZES, seg_args, write_seg_folder

from ddp_utils.config import DetFolderData, DetShardsData, SegFolderData, SegShardsData
from ddp_utils.dist import Runtime

CPU = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")


def write(out: Path, *overrides: str) -> str:
    cmd = [sys.executable, "-m", "ddp_utils.shards", "write", f"--out={out}",
           "--samples-per-shard=4", "--workers=2", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def scores(run: Path, tmp_path: Path, keys: tuple[str, ...]) -> dict[int, dict]:
    """eval.py's report of the run's last checkpoint at world sizes 1 and 3."""
    reports = {}
    for ws in (1, 3):
        out = tmp_path / f"eval{ws}" / "eval.json"
        run_ranks("eval.py", f"checkpoint={run}/checkpoints/last.pt", f"output={out}", nproc=ws)
        reports[ws] = json.loads(out.read_text())
    for key in keys:
        assert reports[1][key] == reports[3][key], key
    return reports


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
    folder = write_seg_folder(tmp_path_factory.mktemp("segfolder"))
    shards = tmp_path_factory.mktemp("segshards") / "s"
    data = [a for a in seg_args(folder) if a.startswith("data")]
    said = write(shards, *data)
    assert "train with: train.py data=segshards" in said
    return folder, shards


def test_segmentation_shards_hold_the_folders_pairs_and_score_alike(seg, tmp_path):
    from ddp_utils.data.segmentation import samples

    folder, shards = seg
    assert sorted(p.name for p in (shards / "val").iterdir()) == [
        "index.pt", "shard-000000.tar", "shard-000001.tar"]  # fmt: skip
    for split in ("train", "val"):
        want = samples(SegFolderData(root=str(folder), num_classes=4), CPU, split)
        got = samples(SegShardsData(root=str(shards), num_classes=4), CPU, split)
        assert len(got) == len(want) and torch.equal(got.sizes, want.sizes)
        for i in range(len(want)):
            assert all(torch.equal(a, b) for a, b in zip(got[i], want[i], strict=True)), (split, i)
    assert got.classes == ["background", "red", "green", "blue"]

    run = tmp_path / "run"
    args = [a.replace("data=segfolder", "data=segshards") for a in seg_args(shards)]
    run_ranks("train.py", *args, "data.num_workers=1", "data.shuffle_window=2",
              "trainer.epochs=2", "logger=none", f"run_dir={run}", nproc=2)  # fmt: skip
    last = read_metrics(run)[-1]
    assert last["val/num_samples"] == len(VAL_SIZES)
    one = scores(run, tmp_path, ("miou", "pixel_accuracy", "confusion_matrix", "loss"))[1]
    assert {k: last[f"val/{k}"] for k in ("miou", "pixel_accuracy", "loss")} == {
        k: one[k] for k in ("miou", "pixel_accuracy", "loss")}  # fmt: skip


@pytest.fixture(scope="module")
def det(tmp_path_factory):
    pytest.importorskip("faster_coco_eval", reason="mAP needs faster-coco-eval (the [det] extra)")
    coco = write_coco_folder(tmp_path_factory.mktemp("coco"))
    shards = tmp_path_factory.mktemp("detshards") / "s"
    said = write(shards, "data=detfolder", f"data.root={coco}")
    assert "train with: train.py data=detshards" in said and "data.num_classes=3" in said
    return coco, shards


def test_detection_shards_hold_the_folders_boxes_and_score_alike(det, tmp_path):
    from ddp_utils.data.detection import samples

    coco, shards = det
    for split in ("train", "val"):
        want = samples(DetFolderData(root=str(coco), num_classes=3), CPU, split)
        got = samples(DetShardsData(root=str(shards), num_classes=3), CPU, split)
        assert len(got) == len(want)
        for i in range(len(want)):
            (image, target), (image0, target0) = got[i], want[i]
            assert torch.equal(image, image0), (split, i)
            assert target.keys() == target0.keys()
            for k in target0:
                assert torch.equal(torch.as_tensor(target[k]), torch.as_tensor(target0[k]))
            assert target["boxes"].canvas_size == target0["boxes"].canvas_size

    run = tmp_path / "run"
    run_ranks("train.py", "data=detshards", f"data.root={shards}", "model=tiny_det",
              "task=detection", "data.image_size=64", "data.num_workers=1", "data.batch_size=4",
              "trainer.epochs=2", "trainer.precision=32", "optim.lr=0.01", "logger=none",
              f"run_dir={run}", nproc=2)  # fmt: skip
    last = read_metrics(run)[-1]
    assert last["val/num_samples"] == 13
    one = scores(run, tmp_path, ("map", "map_50", "map_per_class", "num_samples"))[1]
    assert one["map"] == last["val/map"]


def test_a_malformed_boxes_record_is_named_before_training(det, tmp_path):
    _, shards = det
    broken = tmp_path / "broken"
    (broken / "train").mkdir(parents=True)
    (broken / "classes.txt").write_text((shards / "classes.txt").read_text())
    (broken / "val").symlink_to(shards / "val")
    buffer = io.BytesIO()
    with tarfile.open(shards / "train" / "shard-000000.tar") as src, \
            tarfile.open(fileobj=buffer, mode="w") as out:  # fmt: skip
        for info in src:
            data = src.extractfile(info).read()
            if info.name.endswith(".json") and "bad" not in locals():
                doc = json.loads(data)
                doc["boxes"][0] = [5, 5, 500, 6]  # far outside the image
                data, bad = json.dumps(doc).encode(), info.name
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    (broken / "train" / "shard-000000.tar").write_bytes(buffer.getvalue())
    proc = run_forked("train.py", "data=detshards", f"data.root={broken}", "model=tiny_det",
                      "task=detection", "data.image_size=64", "data.num_workers=0",
                      "logger=none", f"run_dir={tmp_path}/run")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    stem = bad.rpartition(".")[0]
    assert f"{stem}.json in the shard" in proc.stderr and "outside its" in proc.stderr
    assert "Traceback" not in proc.stderr
