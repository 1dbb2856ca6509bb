"""eval.py end to end: exact numbers at any world size, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest
from helpers.faults import write_malicious_checkpoint
from helpers.launch import run_forked, run_ranks, run_script
from helpers.runs import read_metrics

EVAL_KEYS = {
    "accuracy", "top5", "f1_macro", "loss", "num_samples", "per_class_accuracy",
    "confusion_matrix", "world_size", "checkpoint",
}  # fmt: skip


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("digits_run")
    run_ranks("train.py", "trainer.epochs=2", f"run_dir={run}", nproc=1)
    return run


def test_same_numbers_at_world_size_1_and_3(digits_run, tmp_path):
    # (World size 2 is train.py's validation in the image-folder test: the same code.)
    ckpt = digits_run / "checkpoints" / "last.pt"
    # World size 1 with the default output: eval.json beside the checkpoint's run, no strays.
    run_script("eval.py", f"checkpoint={ckpt}", cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []
    results = {1: json.loads((digits_run / "eval.json").read_text())}
    for n in (3,):
        out = tmp_path / f"eval{n}.json"
        proc = run_script("eval.py", f"checkpoint={ckpt}", f"output={out}", nproc=n, cwd=tmp_path)
        assert "359 samples" in proc.stdout and f"world size {n}" in proc.stdout
        results[n] = json.loads(out.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "confusion_matrix.png", "eval3.json"
    ]  # fmt: skip
    assert (digits_run / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    base = results[1]
    assert base.keys() >= EVAL_KEYS
    assert base["num_samples"] == 359  # 3 does not divide 359: padding is ignored
    assert sum(map(sum, base["confusion_matrix"])) == 359
    for n, r in results.items():
        assert r["world_size"] == n and r["num_samples"] == 359
        for key in ("accuracy", "top5", "f1_macro", "per_class_accuracy", "confusion_matrix"):
            assert r[key] == base[key], (n, key)
        assert abs(r["loss"] - base["loss"]) <= 1e-6
    # train.py's validation went through the same code: the same accuracy for the same weights.
    assert read_metrics(digits_run)[-1]["val/accuracy"] == base["accuracy"]


def test_overrides_apply_on_top_of_the_checkpoint_config(digits_run, tmp_path):
    out = tmp_path / "train_split.json"
    ckpt = digits_run / "checkpoints" / "best.pt"
    run_ranks("eval.py", f"checkpoint={ckpt}", "data.split=train", "data.batch_size=7",
              f"output={out}", nproc=1)  # fmt: skip
    assert json.loads(out.read_text())["num_samples"] == 1797 - 359


def _torn(src, dst):
    dst.write_bytes(src.read_bytes()[:5000])
    return dst


@pytest.mark.parametrize(
    "case", ["missing", "torn", "other_model", "other_classes", "no_data", "malicious"]
)
def test_bad_input_gives_a_clear_message_and_a_non_zero_exit(case, digits_run, tmp_path):
    ckpt = digits_run / "checkpoints" / "last.pt"
    marker = tmp_path / "code_ran"
    args, expected = {
        "missing": ([f"checkpoint={tmp_path}/nope.pt"], "no such file"),
        "torn": ([f"checkpoint={_torn(ckpt, tmp_path / 'torn.pt')}"], "corrupt or truncated"),
        "other_model": ([f"checkpoint={ckpt}", "model=mlp"], "trained as model=convnet"),
        "other_classes": (
            [f"checkpoint={ckpt}", "data=synthetic", "data.image_size=8", "data.num_classes=7"],
            "does not fit the model",
        ),
        "no_data": (
            [
                f"checkpoint={ckpt}",
                "data=mnist",
                "data.image_size=8",  # the checkpoint's model: data that fits it, but no files
                f"data.root={tmp_path}",
                "data.download=false",
            ],
            "data.download=true",
        ),
        "malicious": ([f"checkpoint={tmp_path / 'evil.pt'}"], "arbitrary unpickling"),
    }[case]
    if case == "malicious":
        write_malicious_checkpoint(tmp_path / "evil.pt", marker)
    proc = run_forked("eval.py", *args, f"output={tmp_path}/out.json")
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out.json").exists() and not marker.exists()


def test_missing_checkpoint_under_torchrun_reports_once(tmp_path):
    proc = run_script("eval.py", f"checkpoint={tmp_path}/nope.pt", nproc=2, check=False)
    assert proc.returncode != 0
    printed = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(printed) == 1 and "no such file" in printed[0]  # the summary repeats it once


def test_checkpoint_is_required():
    proc = run_forked("eval.py")
    assert proc.returncode == 2 and "checkpoint=PATH is required" in proc.stderr
