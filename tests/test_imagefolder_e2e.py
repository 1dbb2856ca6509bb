"""Image folders and custom data sets streamed through DataLoader workers, with real gloo
processes: the tensor path's accuracy, exact evaluation, seeded augmentation, exact resume."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from callbacks import both, dump_validation, fault, recorder
from helpers.launch import run_forked, run_ranks, run_script
from helpers.paths import ROOT
from helpers.runs import assert_same_params, params, read_metrics, recorded_samples
from imagefolders import folder_args, write_digits_folder

# 1,438 training images at batch 50 on 2 ranks: 14 whole steps an epoch (38 left out).
AUG = ("data.augment=true", "trainer.precision=32", "trainer.epochs=2", "data.batch_size=50",
       "trainer.ckpt_every_steps=5")  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_digits_folder(tmp_path_factory.mktemp("digits_folder"))


@pytest.fixture(scope="module")
def folder_run(folder, tmp_path_factory):
    run = tmp_path_factory.mktemp("folder_run")
    proc = run_script(
        "train.py", *folder_args(folder, "data.num_workers=2", "data.augment=false"),
        "trainer.epochs=6", "trainer.precision=32", f"run_dir={run}",
        dump_validation(run / "val"), nproc=2,
    )  # fmt: skip
    return run, proc


def test_folder_trains_like_the_tensor_path_on_the_same_images(folder_run, tmp_path):
    run, proc = folder_run
    tensor = tmp_path / "tensor"
    # data=digits: the same images, as uint8 tensors indexed on the device
    run_ranks("train.py", "trainer.epochs=6", f"run_dir={tensor}", nproc=2)
    a, b = read_metrics(run)[-1], read_metrics(tensor)[-1]
    assert a["val/num_samples"] == 359 == b["val/num_samples"]
    assert abs(a["val/accuracy"] - b["val/accuracy"]) <= 0.01, (a, b)
    assert json.loads((run / "classes.json").read_text()) == [str(i) for i in range(10)]
    ckpt = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["classes"] == [str(i) for i in range(10)]


def test_eval_gives_identical_numbers_at_world_size_1_and_3(folder_run, tmp_path):
    # With train.py's own validation at world size 2 (the last assertions): 1, 2 and 3. The
    # ranks' BatchNorm statistics differ after each step; validation uses the saved ones.
    run, _ = folder_run
    ckpt = run / "checkpoints" / "last.pt"
    results = {}
    for n in (1, 3):
        out = tmp_path / f"eval{n}.json"
        run_ranks("eval.py", f"checkpoint={ckpt}", f"output={out}", "data.num_workers=1",
                  nproc=n)  # fmt: skip
        results[n] = json.loads(out.read_text())
    for n, r in results.items():
        assert r["num_samples"] == 359 and r["world_size"] == n
        assert r["accuracy"] == results[1]["accuracy"]
        assert r["confusion_matrix"] == results[1]["confusion_matrix"]
    logged = read_metrics(run)[-1]
    validated = json.loads((run / "val" / f"epoch{logged['epoch']}.json").read_text())["val"]
    assert results[1]["accuracy"] == logged["val/accuracy"]
    assert results[1]["confusion_matrix"] == validated["confusion_matrix"]
    assert abs(results[1]["loss"] - logged["val/loss"]) <= 1e-6


def test_eval_refuses_a_folder_with_other_classes(folder_run, folder, tmp_path):
    run, _ = folder_run
    other = tmp_path / "other"
    shutil.copytree(folder / "val", other / "val")
    (other / "val" / "9").rename(other / "val" / "nine")
    proc = run_forked("eval.py", f"checkpoint={run}/checkpoints/last.pt", f"data.root={other}")
    assert proc.returncode == 2
    assert "only in the checkpoint: ['9']; only in the folder: ['nine']" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def augmented(folder, tmp_path_factory):
    """The uninterrupted run with augmentation and 2 workers per rank."""
    run = tmp_path_factory.mktemp("augmented")
    run_ranks("train.py", *folder_args(folder, *AUG, "data.num_workers=2"), f"run_dir={run}",
              nproc=2)  # fmt: skip
    return run


def test_augmentation_does_not_depend_on_the_number_of_workers(folder, augmented, tmp_path):
    run_ranks("train.py", *folder_args(folder, *AUG, "data.num_workers=0"), f"run_dir={tmp_path}",
              nproc=2)  # fmt: skip
    assert_same_params(params(tmp_path), params(augmented))


def test_sigkilled_rank_restarts_and_matches_the_uninterrupted_run(folder, augmented, tmp_path):
    proc = run_script(
        "train.py", *folder_args(folder, *AUG, "data.num_workers=2"), f"run_dir={tmp_path}",
        fault("kill", 22, 1),  # epoch 1, step 8 of 14; newest ckpt: 20
        nproc=2, launcher=("--max-restarts=1",),
    )  # fmt: skip
    assert "failed (exitcode:" in proc.stderr
    log = (tmp_path / "train.log").read_text()
    assert log.count("| world size 2 |") == 2 and "resumed from" in log and "step 20" in log
    assert_same_params(params(tmp_path), params(augmented))


def test_resume_at_another_world_size_sees_each_remaining_sample_once(folder, tmp_path):
    every = ("data.num_workers=2", "data.drop_last=false")  # each sample exactly once
    args = (*folder_args(folder, *AUG, *every), f"run_dir={tmp_path}/run")
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()
    proc = run_script("train.py", *args, both("kill", 23, 0, before), nproc=2, check=False)
    assert proc.returncode != 0
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["step"]) == (1, 20) and 0 < ckpt["sample_offset"] < 1438
    run_ranks("train.py", *args, recorder(after), nproc=1)
    done, rest = recorded_samples(before, 1, max_step=20), recorded_samples(after, 1)
    assert sum(done.values()) == ckpt["sample_offset"]
    assert set(done + rest) == set(range(1438)) and set((done + rest).values()) == {1}


def test_a_custom_data_set_trains_and_evaluates(tmp_path):
    args = ("data=custom", "data._target_=imagefolders.digits_datasets", "+data.limit=600",
            "data.in_channels=1", "data.image_size=8", "data.resize_size=8", "data.mean=[0.3]",
            "data.std=[0.38]", "trainer.epochs=3", "data.batch_size=25",
            "data.num_workers=1")  # fmt: skip
    env = {"PYTHONPATH": str(ROOT / "tests")}
    run_ranks("train.py", *args, f"run_dir={tmp_path}", nproc=2, env=env)
    records = read_metrics(tmp_path)
    assert [r["val/num_samples"] for r in records] == [359] * 3  # val has 359 < 600
    assert records[-1]["val/accuracy"] > 0.8
    ckpt = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["config"]["data"]["kwargs"] == {"limit": 600}
    out = tmp_path / "eval.json"
    run_ranks("eval.py", f"checkpoint={tmp_path}/checkpoints/last.pt", f"output={out}",
              nproc=1, env=env)  # one process: validated in training by two  # fmt: skip
    assert json.loads(out.read_text())["accuracy"] == records[-1]["val/accuracy"]


def test_one_scan_per_job(folder, tmp_path):
    """Global rank 0 lists the folder; the other ranks read its cached index; a later job
    (here: the probe's second build) lists nothing. Each listing takes twice the collectives'
    timeout (the probe's): the others wait for it without a collective."""
    fresh = tmp_path / "fresh"
    shutil.copytree(folder, fresh, ignore=shutil.ignore_patterns(".ddp_recipes_cache"))
    run_script("tests/scan_probe.py", str(fresh), str(tmp_path), nproc=3)
    for build, scans in ((0, [2, 0, 0]), (1, [0, 0, 0])):  # train and val, then the cache
        counts = [json.loads((tmp_path / f"rank{r}.{build}.json").read_text()) for r in range(3)]
        assert [c["scans"] for c in counts] == scans, counts
        assert [c["cache_reads"] for c in counts[1:]] == [2, 2]
        assert all(c["train"] == 1438 and c["val"] == 359 for c in counts)


def test_unreadable_image_stops_with_its_name_or_is_skipped(folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken, ignore=shutil.ignore_patterns(".ddp_recipes_cache"))
    bad = sorted((broken / "train" / "3").iterdir())[5]
    bad.write_bytes(bad.read_bytes()[:40])
    args = (*folder_args(broken, "data.num_workers=1", "trainer.epochs=2"), f"run_dir={tmp_path}/r")
    proc = run_script("train.py", *args, nproc=2, check=False)
    assert proc.returncode != 0 and "exitcode: 2" in proc.stderr
    # One paragraph, from the rank that read the file; the other rank adds no traceback.
    ours = proc.stderr.split("Traceback")[0]  # then torchrun's own summary
    errors = [line for line in ours.splitlines() if "error: " in line]
    assert len(errors) == 1 and f"cannot read the image {bad} (Out of bound read" in errors[0]
    assert "data.skip_bad_images=true" in errors[0] and "decode_png.cpp" not in errors[0]
    assert "Connection closed" not in proc.stderr and f"traceback : {errors[0]}" in proc.stderr
    proc = run_ranks("train.py", *args, "data.skip_bad_images=true", f"run_dir={tmp_path}/s",
                     nproc=2)  # fmt: skip
    assert [r["train/skipped_images"] for r in read_metrics(tmp_path / "s")] == [1, 1]
    assert [r["val/num_samples"] for r in read_metrics(tmp_path / "s")] == [359, 359]
    assert f"skipping the unreadable image {bad}" in proc.stdout + proc.stderr
