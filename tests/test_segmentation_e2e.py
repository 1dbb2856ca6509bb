"""Segmentation end to end with real processes: eval.py's numbers identical at world sizes 1,
2 and 3 on images of different sizes, a SIGKILLed rank resumed to the same parameters, a
resume at another world size (2 -> 1; 2 -> 3 is tested for the classification paths),
pictures, and a bad folder's one-paragraph error."""

from __future__ import annotations

import json

import pytest
import torch
from callbacks import fault, recorder
from helpers.launch import run_forked, run_ranks, run_script
from helpers.runs import assert_same_params, params, read_metrics, recorded_samples
from segfolders import VAL_SIZES, seg_args, write_seg_folder

# The embedded canvases with random resized crops, small and fast: 45 steps an epoch at 2
# processes.
DIGITS = ("experiment=digits_segmentation", "model.channels=[8,16]", "data.batch_size=16",
          "data.global_batch_size=null",
          "data.augment=true", "trainer.epochs=2", "trainer.ckpt_every_steps=10",
          "trainer.keep_last=10", "trainer.precision=32", "logger=none")  # fmt: skip
N_TRAIN = 1438


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = write_seg_folder(tmp_path_factory.mktemp("segfolder"))
    run = tmp_path_factory.mktemp("segrun")
    run_ranks("train.py", *seg_args(root, "trainer.epochs=2", "logger=none"), f"run_dir={run}",
              nproc=1)  # fmt: skip
    return root, run


def test_eval_gives_the_same_numbers_at_world_sizes_1_2_3(trained, tmp_path):
    root, run = trained
    assert (run / "predictions.png").stat().st_size > 0
    assert read_metrics(run)[-1]["val/num_samples"] == len(VAL_SIZES)
    reports = {}
    for ws in (1, 2, 3):
        out = tmp_path / f"eval{ws}" / "eval.json"
        run_ranks("eval.py", f"checkpoint={run}/checkpoints/last.pt", f"output={out}",
                  nproc=ws)  # fmt: skip
        reports[ws] = json.loads(out.read_text())
    one = reports[1]
    assert one["num_samples"] == 7 and one["classes"] == ["background", "red", "green", "blue"]
    assert len(one["per_class_iou"]) == 4 and len(one["confusion_matrix"]) == 4
    for ws in (2, 3):
        r = reports[ws]
        assert r["world_size"] == ws
        for key in ("miou", "pixel_accuracy", "per_class_iou", "confusion_matrix", "num_samples",
                    "loss"):  # fmt: skip
            assert r[key] == one[key], (ws, key)
    # Pixels: every counted pixel of the truth once (the first row of each mask is ignored).
    counted = sum(h * w - w for h, w in VAL_SIZES)
    assert sum(map(sum, one["confusion_matrix"])) == counted
    assert (tmp_path / "eval1" / "predictions.png").stat().st_size > 0
    # Training's last validation is eval.py's: the same convention, the same numbers.
    last = read_metrics(run)[-1]
    assert {k: last[f"val/{k}"] for k in ("miou", "pixel_accuracy", "loss")} == {
        k: one[k] for k in ("miou", "pixel_accuracy", "loss")
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, its samples recorded (``rec``) and every step checkpoint kept."""
    run = tmp_path_factory.mktemp("seg_reference")
    run_ranks("train.py", *DIGITS, f"run_dir={run}/run", recorder(run), nproc=2)
    return run


def test_sigkill_mid_epoch_then_elastic_restart_matches_uninterrupted(reference, tmp_path):
    proc = run_script("train.py", *DIGITS, f"run_dir={tmp_path}", fault("kill", 57, 1),
                      nproc=2, launcher=("--max-restarts=1",))  # fmt: skip
    assert "failed (exitcode:" in proc.stderr
    log = (tmp_path / "train.log").read_text()
    assert log.count("| world size 2 |") == 2 and "resumed from" in log
    assert_same_params(params(tmp_path), params(reference / "run"))
    assert [r["step"] for r in read_metrics(tmp_path)] == [44, 88]


def test_resume_at_another_world_size_sees_each_sample_at_most_once(reference, tmp_path):
    """The reference run's mid-epoch checkpoint of step 50 (2 processes), resumed by one:
    with whole batches (data.drop_last, the default), each sample at most once, and fewer
    left out than one batch of the resumed run."""
    step_50 = reference / "run" / "checkpoints" / "step_00000050.pt"
    ckpt = torch.load(step_50, weights_only=True)
    assert (ckpt["epoch"], ckpt["step"]) == (1, 50) and ckpt["sample_offset"] == 6 * 32
    rec = tmp_path / "rec"
    rec.mkdir()
    run_ranks("train.py", *DIGITS, f"run_dir={tmp_path}/run", f"resume={step_50}",
              recorder(rec), nproc=1)  # fmt: skip
    before = recorded_samples(reference, epoch=1, max_step=ckpt["step"])
    seen = before + recorded_samples(rec, epoch=1)
    assert sum(before.values()) == ckpt["sample_offset"]
    assert set(seen) <= set(range(N_TRAIN)) and set(seen.values()) == {1}
    assert 0 <= N_TRAIN - len(seen) < 16  # one process, batches of 16


def test_a_bad_folder_is_one_paragraph_and_exit_2_before_training(tmp_path):
    root = write_seg_folder(tmp_path / "data", n_train=4, val_sizes=[(20, 20)])
    (root / "train" / "masks" / "002.png").unlink()
    proc = run_forked("train.py", *seg_args(root), f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr
    assert "1 images without a mask" in proc.stderr and "002.png" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_deeplabv3_trains_when_a_split_leaves_one_image_over(tmp_path):
    """5 training images at world size 2, batches of 2: each rank's last batch would hold
    one image, which BatchNorm cannot train on. Dropped by default; kept (data.drop_last=false)
    it is refused before training, naming the key."""
    root = write_seg_folder(tmp_path / "folder", n_train=5, val_sizes=[(32, 32)] * 3)
    args = ("task=segmentation", "model=torchvision_seg",
            "model.arch=deeplabv3_mobilenet_v3_large", "data=segfolder", f"data.root={root}",
            "data.num_classes=4", "data.base_size=32", "data.crop_size=32", "data.batch_size=2",
            "data.num_workers=0", "sched=poly", "trainer.epochs=1", "logger=none")  # fmt: skip
    run_ranks("train.py", *args, f"run_dir={tmp_path}/run", nproc=2)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]  # 4 images, 1 step
    proc = run_script("train.py", *args, "data.drop_last=false", f"run_dir={tmp_path}/kept",
                      nproc=2, check=False)  # fmt: skip
    assert proc.returncode != 0 and "exitcode: 2" in proc.stderr
    assert "each rank's last batch of an epoch holds one sample" in proc.stderr
    assert "data.drop_last=true" in proc.stderr and not (tmp_path / "kept").exists()


def test_a_segmentation_model_on_class_labels_says_use_task_segmentation(tmp_path):
    args = ("model=torchvision_seg", "model.arch=lraspp_mobilenet_v3_large")
    proc = run_forked("train.py", *args, f"run_dir={tmp_path}/run")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "is a segmentation model (its output is a dict of out" in lines[0]
    assert "use task=segmentation" in lines[0] and not (tmp_path / "run").exists()
