"""The failures users hit, with real processes: two launches into one run_dir, a diverging
run, mistakes on the command line, a run that fails before training."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from callbacks import slow
from helpers.launch import child_env, run_forked, run_script, start_script
from helpers.paths import ROOT
from helpers.runs import read_metrics, wait_for_step_checkpoint

from ddp_utils.checkpoint.finite import DIVERGED_EXIT
from ddp_utils.config import options_help

RUN = ("trainer.epochs=2", "data.batch_size=10", "trainer.ckpt_every_steps=10")
DDP_RUN = [sys.executable, "-m", "ddp_utils.launch"]


def strict_json_lines(path):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_one_job_per_run_dir_and_a_killed_holder_does_not_block(tmp_path):
    run = tmp_path / "run"
    # 0.05 s a step (14 s for the run): the holder is still training when the other launch,
    # slowed by a loaded machine's imports, reaches the lock.
    first = start_script("train.py", *RUN, slow(0.05), f"run_dir={run}")
    second = start_script("train.py", *RUN, slow(0.05), f"run_dir={run}")  # the double submit
    started = time.time()
    # One of the two gets the lock; the other is refused within seconds, before it writes.
    while first.poll() is None and second.poll() is None:
        time.sleep(0.05)
    loser, winner = (first, second) if first.poll() is not None else (second, first)
    out, err = loser.communicate()
    assert loser.returncode == 2, out + err
    assert time.time() - started < 60 and winner.poll() is None
    assert f"run_dir={run} is in use by another job" in err and f"pid {winner.pid}" in err
    assert err.count("error:") == 1 and "Traceback" not in err
    # The holder dies without a chance to clean up: the next launch is not blocked.
    wait_for_step_checkpoint(run, winner)
    winner.kill()
    winner.communicate()
    proc = run_forked("train.py", *RUN, f"run_dir={run}")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert [r["epoch"] for r in read_metrics(run)] == [0, 1]


def test_a_diverging_run_stops_with_one_message_and_saves_nothing_non_finite(tmp_path):
    run = tmp_path / "run"
    cmd = [*DDP_RUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *RUN,
           "optim.lr=1e30", "trainer.log_every_steps=5", f"run_dir={run}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == DIVERGED_EXIT, out
    printed = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(printed) == 1 and "the training loss is not finite" in printed[0], out
    assert "Try a lower optim.lr (now 1e+30)" in out and "Traceback" not in out
    for path in (run / "checkpoints").glob("*.pt") if (run / "checkpoints").exists() else []:
        state = torch.load(path, weights_only=True)["model"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    if (run / "metrics.jsonl").exists():
        for record in strict_json_lines(run / "metrics.jsonl"):
            assert all(not isinstance(v, float) or math.isfinite(v) for v in record.values())


MISTAKES = {
    "optim.lrr=0.1": "optim.lrr is not a key of optim=sgd; check its spelling",
    "+optim.lrr=0.1": "optim.lrr is not a key of optim=sgd; check its spelling",
    "trainer.epochs=abc": "trainer.epochs=abc: Value 'abc'",
    "model=resnet50x": "model=resnet50x is not an option; the options of model are: convnet",
    "model=model_schema": "model=model_schema is not an option",
    "model=model_mlp_schema": "model=model_mlp_schema is not an option",
    "data.train_dir=x": "data.train_dir is not a key of data=digits: it belongs to "
    "data=imagefolder | shards | segfolder | segshards | detshards. Pick that option",
    "run_dir=FILE/run": "cannot be created or written (Not a directory)",
}


def test_every_mistake_is_one_paragraph_and_exit_code_2(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("")
    for override in MISTAKES:
        proc = run_forked("train.py", override.replace("FILE", str(afile)))
        err = proc.stderr
        assert proc.returncode == 2, (override, proc.stdout, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (override, err)
        assert MISTAKES[override] in lines[0], (override, lines[0])
    assert not (afile / "run").exists()


def test_a_sweep_hydra_cannot_start_is_one_paragraph(tmp_path):
    proc = run_forked("train.py", "-m", "experiment=null,lm_char", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: the sweep stopped before its first "
                                                   "job: "), lines  # fmt: skip
    assert "Config group override must be a string or a list" in lines[0]


def test_under_torchrun_a_mistake_and_cfg_print_once(tmp_path):
    proc = run_script("train.py", "optim.lrr=0.1", nproc=2, check=False)
    assert proc.returncode != 0
    # Printed once (by rank 0, first), and it is torchrun's root cause instead of a traceback.
    printed = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(printed) == 1 and "optim.lrr is not a key of optim=sgd" in printed[0]
    assert "Traceback" not in proc.stderr.split(printed[0])[0]
    assert f"traceback : {printed[0]}" in proc.stderr
    proc = run_script("train.py", "--cfg", "job", nproc=2)
    assert proc.stdout.count("optim:") == 1
    proc = run_forked("train.py", "--help")
    assert "model: convnet, custom, gpt, hf, mlp" in proc.stdout and "schema" not in proc.stdout
    assert options_help() in proc.stdout  # each option's own keys
    assert "optim.lr=0.1" in proc.stdout and "--cfg job" in proc.stdout


def test_a_run_that_fails_before_training_leaves_no_run_dir(tmp_path):
    run = tmp_path / "new_run"
    proc = run_forked("train.py", "data=imagefolder", f"data.root={tmp_path}/missing",
                      f"run_dir={run}")  # fmt: skip
    assert proc.returncode == 2 and "data.root" in proc.stderr
    assert not run.exists()


def test_sigint_to_a_plain_process_checkpoints_and_exits_130(tmp_path):
    proc = start_script("train.py", *RUN, f"run_dir={tmp_path}")
    wait_for_step_checkpoint(tmp_path, proc)
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "stopped by SIGINT at step" in out and "Traceback" not in err + out


def test_the_multi_run_plot_writes_where_out_says(tmp_path):
    from ddp_utils.plot import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        json.dumps(
            {"epoch": 0, "step": 5, "train/loss": 1.0, "val/loss": None, "val/accuracy": 0.5}
        )
        + "\n"  # fmt: skip
    )
    (run / "curves.png").write_bytes(b"the run's own")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        main([str(run)])
    finally:
        os.chdir(cwd)
    assert (run / "curves.png").read_bytes() == b"the run's own"
    assert (tmp_path / "curves_compared.png").stat().st_size > 0


@pytest.mark.parametrize("value, expected", [(math.nan, None), (math.inf, None), (1.5, 1.5)])
def test_metrics_lines_are_strict_json(value, expected):
    from ddp_utils.run.records import strict_json

    assert json.loads(strict_json({"train/loss": value, "epoch": 0})) == {
        "train/loss": expected, "epoch": 0,
    }  # fmt: skip


def test_a_model_whose_head_does_not_fit_the_data_stops_before_training(tmp_path):
    """A user's model that names its class count ``n_out``: training and eval.py refuse it."""
    env = {"PYTHONPATH": str(ROOT / "tests")}
    named = ("model=custom", "model._target_=custom_models.NamedHead")
    proc = run_forked("train.py", *named, "+model.n_out=3", f"run_dir={tmp_path}/r", env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "has shape (2, 3), but data.num_classes=10 needs (2, 10)" in lines[0]
    assert "n_out=10, given {'n_out': 3}" in lines[0] and not (tmp_path / "r").exists()
    # A checkpoint of that model with its default 10 outputs, evaluated on 3 classes.
    from helpers.runs import compose_config

    from ddp_utils.config import as_plain_dict
    from ddp_utils.models import build_model

    sys.path.insert(0, env["PYTHONPATH"])
    cfg = compose_config(*named)
    ckpt = tmp_path / "named.pt"
    torch.save({"model": build_model(cfg.model, cfg.data).state_dict(),
                "config": as_plain_dict(cfg)}, ckpt)  # fmt: skip
    args = (f"checkpoint={ckpt}", "data=synthetic", "data.image_size=8", "data.num_classes=3")
    proc = run_forked("eval.py", *args, f"output={tmp_path}/out.json", env=env)
    assert proc.returncode == 2 and "but data.num_classes=3 needs (2, 3)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out.json").exists()


def test_the_plot_draws_loss_on_a_log_axis_and_labels_sweep_jobs_by_overrides(tmp_path):
    from ddp_utils.plot import draw_runs, expand

    for job, (lr, loss) in enumerate([("0.1", 0.5), ("1e9", 1.6e13)]):
        run = tmp_path / str(job)
        run.mkdir()
        records = [{"epoch": e, "train/loss": loss / (e + 1), "val/loss": loss,
                    "val/accuracy": 0.5} for e in range(3)]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run / "job.json").write_text(json.dumps({"job": job, "overrides": [f"optim.lr={lr}"]}))
    fig = draw_runs(expand([tmp_path]))
    loss_axis, acc_axis = fig.axes
    assert loss_axis.get_yscale() == "log"
    labels = [t.get_text() for t in acc_axis.get_legend().get_texts()]
    assert labels == ["optim.lr=0.1", "optim.lr=1e9"]
