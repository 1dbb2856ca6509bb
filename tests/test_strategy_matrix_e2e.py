"""Every strategy on every built-in task and model family, at world size 2, with the default
precision (auto): the BatchNorm ConvNet, ResNet-18, both segmentation models, both detectors
and the GPT (tests/conf/experiment/matrix_*.yaml), two steps and a validation each, as one
sweep per launch (the loaders' default workers); and with each pinned lower precision, bf16
and fp16, on the cheapest family of each task.

fp16 on a CPU is emulated (minutes for the larger models here); bf16 is native on CPUs with
AVX512-BF16 or AMX, and torch emulates it elsewhere."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest
from helpers.launch import child_env
from helpers.paths import ROOT
from lm_data import write_token_folder

pytest.importorskip(
    "faster_coco_eval", reason="mAP needs faster-coco-eval (make install: the [det] extra)"
)

FAMILIES = ("matrix_convnet", "matrix_resnet", "matrix_seg_convnet", "matrix_deeplab",
            "matrix_tiny_det", "matrix_faster_rcnn", "matrix_gpt")  # fmt: skip
PICTURED = ("matrix_seg_convnet", "matrix_deeplab", "matrix_tiny_det", "matrix_faster_rcnn")
CHEAP = ("matrix_convnet", "matrix_seg_convnet", "matrix_tiny_det", "matrix_gpt")


def sweep(tmp_path, name: str, families: tuple[str, ...], precisions: str) -> list[dict]:
    """One torchrun launch of 2 processes running every job of the sweep; its summary rows."""
    tokens = write_token_folder(tmp_path / "tokens", 2000, 16 * 37 + 1)
    cwd = tmp_path / name
    cwd.mkdir()
    cmd = [sys.executable, "-m", "ddp_utils.launch", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "-m", f"hydra.searchpath=[file://{ROOT}/tests/conf]",
           f"experiment={','.join(families)}", "trainer.strategy=ddp,fsdp2",
           f"trainer.precision={precisions}", "logger=none"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=cwd, env=child_env(MATRIX_TOKENS=str(tokens)),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    (summary,) = (cwd / "multirun").glob("*/summary.csv")
    rows = list(csv.DictReader(summary.open()))
    failed = {r["overrides"]: r["error"][-600:] for r in rows if r["status"] != "COMPLETED"}
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    for row in rows:
        row["dir"] = summary.parent / row["job"]
    return rows


def family(row: dict) -> str:
    return row["overrides"].split("experiment=")[1].split()[0]


def test_every_strategy_and_family_trains_validates_and_draws(tmp_path):
    rows = sweep(tmp_path, "matrix", FAMILIES, "auto")
    assert len(rows) == len(FAMILIES) * 2
    for row in rows:
        assert int(row["step"]) == 2 and int(row["world_size"]) == 2, row["overrides"]
        assert math.isfinite(float(row["train/loss"])) and math.isfinite(float(row["val/loss"]))
        if family(row) in PICTURED:  # drawn by the main rank from the gathered weights
            assert (row["dir"] / "predictions.png").stat().st_size > 0, row["overrides"]
    # fsdp2 starts from DDP's weights and trains the same steps: in full precision (auto on
    # this CPU without AMX tiles) the validation agrees to rounding.
    by = {(family(r), "fsdp2" in r["overrides"]): r for r in rows}
    for name in FAMILIES:
        ddp, fsdp2 = by[(name, False)], by[(name, True)]
        assert float(fsdp2["val/loss"]) == pytest.approx(float(ddp["val/loss"]), rel=1e-4), name


def test_bf16_and_fp16_on_the_cheapest_family_of_each_task(tmp_path):
    rows = sweep(tmp_path, "low", CHEAP, "bf16,fp16")
    assert len(rows) == len(CHEAP) * 2 * 2
    assert all(math.isfinite(float(r["val/loss"])) for r in rows)
    assert all(int(r["step"]) == 2 for r in rows)
