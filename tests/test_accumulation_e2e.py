"""A fixed global batch trains the same model however it is made: one process taking it
whole, two processes taking half each, or one process accumulating it in three micro-batches
(what an elastic job that shrank does), for three epochs, on every data path that feeds a
classifier (in-memory tensors, an image folder read by workers with augmentation, tar shards
read by workers) and on the GPT's token path, with epochs that are and are not a whole number
of global batches. Models without per-process layers (no BatchNorm, no dropout): those follow
the per-process batch (docs/training-details.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.launch import run_ranks
from helpers.paths import ROOT
from helpers.runs import params
from imagefolders import folder_args, write_digits_folder
from lm_data import write_token_folder

TOLERANCE = 1e-6
COMMON = ("trainer.precision=32", "trainer.epochs=3", "logger=none", "trainer.progress=false")


def digits_shards(root):
    out = root / "shards"
    cmd = [sys.executable, "-m", "ddp_utils.shards", "write", f"--out={out}",
           "--samples-per-shard=150", "--workers=2", "data=digits"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# path -> (overrides given the test's folder, global batch): the digits' 1,437 training images
# are 11 global batches of 120 and 117 left over; the folder's 1,200 and the 240 token windows
# are whole numbers of them.
PATHS = {
    "tensor": (lambda tmp: ("data=digits", "model=mlp"), 120),
    "image folder": (lambda tmp: (*folder_args(write_digits_folder(tmp / "f", limit=1200)),
                                  "data.num_workers=2", "data.augment=true", "model=mlp"),
                     120),
    "shards": (lambda tmp: ("data=shards", f"data.root={digits_shards(tmp)}",
                            "data.num_classes=10", "data.in_channels=1", "data.image_size=8",
                            "data.resize_size=8", "data.mean=[0.30]", "data.std=[0.38]",
                            "data.num_workers=2", "model=mlp"), 120),
    "tokens": (lambda tmp: ("experiment=lm_char", "data=tokens",
                            f"data.root={write_token_folder(tmp / 't', 64 * 241, 64 * 20)}",
                            "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                            "trainer.max_steps=null", "trainer.val_every_steps=null"), 24),
}  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
def test_one_process_two_processes_and_accumulation_train_alike(tmp_path, path):
    overrides, batch = PATHS[path]
    args = (*overrides(tmp_path), *COMMON, f"data.global_batch_size={batch}")
    runs = {
        "1 x G": (1, f"data.batch_size={batch}"),
        "2 x G/2": (2, f"data.batch_size={batch // 2}"),
        "3 micro-batches of G/3": (1, f"data.batch_size={batch // 3}"),
    }
    got = {}
    for name, (nproc, cap) in runs.items():
        run_dir = tmp_path / name.replace(" ", "_").replace("/", "")
        proc = run_ranks("train.py", *args, cap, f"run_dir={run_dir}", nproc=nproc)
        if name.startswith("3"):
            assert "x 3 accumulation steps" in proc.stdout, proc.stdout
            assert f"is 3 accumulation steps of {batch // 3} a process" in proc.stdout
        got[name] = params(run_dir)
    base = got["1 x G"]
    for name, p in got.items():
        worst = max((base[k] - p[k]).abs().max().item() for k in base)
        assert worst < TOLERANCE, (name, worst)
