"""trainer.strategy=fsdp2 with real gloo processes: the same loss curve as ddp on a GPT for 300
steps and on the tutorial's ConvNet; sharded checkpoints that resume at world sizes 1 and 3
with exactly the saved model and optimizer state and, with a fixed global batch, train on to
the uninterrupted run's parameters within rounding (a DDP checkpoint as well); a SIGKILLed run
resumes bit for bit, a SIGTERMed one saves its stop step and resumes exactly, a full disk in a
sharded save stops every rank and leaves nothing partial, the run lock holds, an in-process
Optuna sweep runs; evaluation of the sharded folder is the same at world sizes 1 and 3 and
equals training's (a language model's loss to the last digit, as under DDP),
and generate.py reads it as it reads the converted single file; 20 groups in a row exit
cleanly; a GPT over a per-process memory cap trains under fsdp2 and not under ddp. Beside
them, DDP's compression hooks: fp16, bf16 and PowerSGD (whose state a SIGKILLed run resumes
exactly)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from callbacks import dump_state, fault, fill_disk
from helpers.faults import tmpfs
from helpers.launch import (
    child_env,
    free_port,
    our_error_lines,
    rank_env,
    run_forked,
    run_ranks,
    run_script,
    start_script,
)
from helpers.paths import ROOT
from helpers.runs import (
    assert_same_params,
    eval_at_world_sizes,
    params,
    read_metrics,
    wait_for_step_checkpoint,
    whole_checkpoint,
)
from lm_data import write_token_folder

from ddp_utils.lifecycle.disk import WRITE_FAILED_EXIT
from ddp_utils.lifecycle.preemption import PREEMPTED_EXIT

VAL_WINDOWS = 121  # a prime number of windows a rank cannot divide: uneven shards
# 20,000 training tokens: 1,250 windows of 16, 104 steps an epoch of 12 windows (6 a process
# at world size 2, 4 at 3, 12 at 1 in 2 accumulation steps of 6).
LM = ("experiment=lm_char", "data=tokens", "data.block_size=16", "data.global_batch_size=12",
      "data.batch_size=6",
      "data.eval_batch_size=8", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
      "trainer.max_steps=300", "trainer.val_every_steps=100", "trainer.ckpt_every_steps=50",
      "trainer.keep_last=10", "sched.warmup_steps=20", "trainer.precision=32",
      "trainer.ema_decay=0.99", "trainer.ema_every_steps=4", "logger=none",
      "trainer.progress=false")  # fmt: skip
FSDP = "trainer.strategy=fsdp2"
HSDP, HSDP_2 = "hsdp", "trainer.fsdp.replicate=2"  # 2 replica groups of 2 ranks: a 2x2 mesh
# fp32 sums in another order (a reduce-scatter of shards against an all-reduce of buckets):
# the curves agree to this relative tolerance, not bit for bit.
CURVE_RTOL = 1e-4
# A run resumed at another world size sums each step's gradients in another order: after the
# last 100 of 300 AdamW steps the parameters were within 1.2e-7 of the uninterrupted run's.
RESHARD_ATOL = 1e-6


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_token_folder(tmp_path_factory.mktemp("tokens"), 20000, 16 * VAL_WINDOWS + 1)


@pytest.fixture(scope="module")
def runs(tokens, tmp_path_factory):
    out = {}
    for name, extra, world in (("ddp", (), 2), ("fsdp2", (FSDP,), 2), (HSDP, (FSDP, HSDP_2), 4)):
        out[name] = tmp_path_factory.mktemp(name)
        out[f"{name}_start"] = tmp_path_factory.mktemp(f"{name}_start") / "state.pt"
        run_ranks("train.py", *LM, *extra, f"data.root={tokens}", f"run_dir={out[name]}",
                  dump_state(out[f"{name}_start"], optimizer=False), nproc=world)  # fmt: skip
    return out


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * abs(b)


def test_fsdp2_follows_ddps_loss_curve_on_a_gpt_for_300_steps(runs):
    ddp, fsdp = read_metrics(runs["ddp"]), read_metrics(runs["fsdp2"])
    assert [r["step"] for r in fsdp] == [r["step"] for r in ddp] == [100, 200, 300]
    for a, b in zip(fsdp, ddp, strict=True):
        for key in ("train/loss", "val/loss", "val_ema/loss"):
            assert close(a[key], b[key], CURVE_RTOL), (a["step"], key, a[key], b[key])
    assert fsdp[-1]["val/loss"] < fsdp[0]["val/loss"]  # it learns
    folder = runs["fsdp2"] / "checkpoints"
    assert (folder / "last.dcp").resolve().name == "step_00000300.dcp"
    assert (folder / "best.dcp" / ".metadata").is_file()
    assert len(list((folder / "step_00000300.dcp").glob("*.distcp"))) == 2  # a file a rank


def test_fsdp2_starts_from_ddps_weights_built_by_the_main_rank_alone(runs):
    """The other rank built the GPT on the meta device; its shards were filled from the main
    rank's weights: the starting model is DDP's, bit for bit."""
    ddp, fsdp = (torch.load(runs[f"{n}_start"], weights_only=True) for n in ("ddp", "fsdp2"))
    assert ddp["model"].keys() == fsdp["model"].keys()
    for key, value in ddp["model"].items():
        assert torch.equal(value, fsdp["model"][key]), key


def test_activation_checkpointing_recomputes_the_same_numbers(runs, tokens, tmp_path):
    """trainer.activation_checkpointing under fsdp2: each block recomputed in the backward,
    the same losses as without it (the same kernels run again) and the same checkpoint keys."""
    run_ranks("train.py", *LM, FSDP, "trainer.activation_checkpointing=true",
              f"data.root={tokens}", f"run_dir={tmp_path}", nproc=2)  # fmt: skip
    for a, b in zip(read_metrics(tmp_path), read_metrics(runs["fsdp2"]), strict=True):
        for key in ("train/loss", "val/loss"):
            assert close(a[key], b[key], 1e-6), (a["step"], key, a[key], b[key])
    assert params(tmp_path).keys() == params(runs["fsdp2"]).keys()


def test_evaluating_the_sharded_folder_is_the_same_at_world_sizes_1_and_3(runs, tmp_path):
    """The folder of the HSDP run (a 2x2 mesh): as any sharded folder."""
    ckpt = runs[HSDP] / "checkpoints" / "last.dcp"
    results = eval_at_world_sizes(ckpt, tmp_path, (None, 3))
    assert results[None]["num_samples"] == results[3]["num_samples"] == VAL_WINDOWS
    # exact at any world size and equal to training's validation, as under ddp
    # (tests/test_lm_e2e.py): canonical batches, per-window losses reduced in the data's order
    assert results[None]["loss"] == results[3]["loss"]
    assert results[3]["loss"] == read_metrics(runs[HSDP])[-1]["val/loss"]
    # the converter's single file gives eval.py the same numbers
    single = tmp_path / "whole.pt"
    converted = subprocess.run([sys.executable, "-m", "ddp_utils.checkpoint", str(ckpt),
                                str(single)], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert converted.returncode == 0 and "wrote" in converted.stdout, converted.stderr
    out = tmp_path / "single.json"
    assert run_forked("eval.py", f"checkpoint={single}", f"output={out}").returncode == 0
    assert json.loads(out.read_text())["loss"] == results[None]["loss"]
    # generate.py reads the folder and the single file alike: the same text for a seed
    args = ("prompt='the '", "max_new_tokens=20", "num_samples=1", "seed=0")
    texts = [run_forked("generate.py", f"checkpoint={c}", *args) for c in (ckpt, single)]
    assert all(p.returncode == 0 for p in texts), texts[0].stderr
    assert texts[0].stdout == texts[1].stdout and "the " in texts[0].stdout


def reshard_then_train(saved: Path, run: Path, tokens: Path, world: int, *extra: str) -> None:
    """The checkpoint ``saved`` copied to the new ``run``, resumed at ``world`` processes: it
    holds the saved model (and sharded optimizer) state, every tensor equal, then trains on
    to step 300 with the same windows in each step and the same schedule."""
    (run / "checkpoints").mkdir(parents=True)
    (shutil.copytree if saved.is_dir() else shutil.copy2)(saved, run / "checkpoints" / saved.name)
    dump = run.parent / f"{run.name}_loaded.pt"
    proc = run_ranks("train.py", *LM, *extra, f"data.root={tokens}", f"run_dir={run}",
                     dump_state(dump), nproc=world)  # fmt: skip
    log = (run / "train.log").read_text()
    assert "saved at world size" in log, proc.stdout
    assert "the run's length from here" not in log  # the same steps: the schedule stands
    loaded, expected = torch.load(dump, weights_only=True), whole_checkpoint(saved)
    assert_same_params(loaded["model"], expected["model"])
    if saved.is_dir():
        for key, state in expected["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(loaded["optimizer"]["state"][key][name], value), (key, name)
    saved_step = int(saved.name.split("_")[1].split(".")[0])
    assert [r["step"] for r in read_metrics(run)] == [s for s in (100, 200, 300) if s > saved_step]


def worst_difference(a: Path, b: Path) -> float:
    want, got = params(a), params(b)
    return max((want[k] - got[k]).abs().max().item() for k in want)


def test_hsdp_on_a_2x2_mesh_trains_as_fsdp2_and_its_folder_moves_to_1x3_then_1x1(
    runs, tokens, tmp_path
):
    """trainer.fsdp.replicate=2 at world size 4: 2 groups of 2 ranks, each holding the model
    sharded, the same training as fsdp2 over 2 ranks (a fixed global batch). Its step-100
    folder resumes at 1x3 (plain fsdp2 at world size 3), whose step-200 folder resumes at 1x1:
    each hop loads the exact state and ends at the uninterrupted run's parameters."""
    assert "2 replica groups of 2 ranks" in (runs[HSDP] / "train.log").read_text()
    for a, b in zip(read_metrics(runs[HSDP]), read_metrics(runs["fsdp2"]), strict=True):
        for key in ("train/loss", "val/loss", "val_ema/loss"):
            assert close(a[key], b[key], CURVE_RTOL), (a["step"], key, a[key], b[key])
    assert len(list((runs[HSDP] / "checkpoints" / "step_00000300.dcp").glob("*.distcp"))) == 4
    assert worst_difference(runs[HSDP], runs["fsdp2"]) < RESHARD_ATOL
    hop1, hop2 = tmp_path / "1x3", tmp_path / "1x1"
    reshard_then_train(runs[HSDP] / "checkpoints" / "step_00000100.dcp", hop1, tokens, 3, FSDP)
    reshard_then_train(hop1 / "checkpoints" / "step_00000200.dcp", hop2, tokens, 1, FSDP)
    for run in (hop1, hop2):
        worst = worst_difference(runs["fsdp2"], run)
        print(f"{run.name}: largest parameter difference {worst:.2e}")
        assert worst < RESHARD_ATOL, (run.name, worst)


def test_a_ddp_checkpoint_saved_at_world_size_2_resumes_at_3_and_trains_on_the_same(
    runs, tokens, tmp_path
):
    run = tmp_path / "run"
    reshard_then_train(runs["ddp"] / "checkpoints" / "step_00000200.pt", run, tokens, 3)
    worst = worst_difference(runs["ddp"], run)
    print(f"ddp at world size 3: largest parameter difference {worst:.2e}")
    assert worst < RESHARD_ATOL, worst


def test_a_sigkilled_fsdp2_run_resumes_to_the_same_parameters(runs, tokens, tmp_path):
    proc = run_script("train.py", *LM, FSDP, f"data.root={tokens}", f"run_dir={tmp_path}",
                      fault("kill", 237, 1), nproc=2, launcher=("--max-restarts=1",))  # fmt: skip
    assert "failed (exitcode:" in proc.stderr
    assert "step 200" in (tmp_path / "train.log").read_text()
    assert_same_params(params(tmp_path), params(runs["fsdp2"]))


def test_fsdp2_follows_ddp_on_the_tutorial_convnet(tmp_path):
    """The embedded digits, the ConvNet with BatchNorm, two epochs at world size 2, with
    gradient accumulation (no reduce-scatter on the first micro-batch) and clipping."""
    curves = {}
    for name, extra in (("ddp", ()), ("fsdp2", (FSDP,))):
        run = tmp_path / name
        run_ranks("train.py", "trainer.epochs=2", "trainer.precision=32", "logger=none",
                  "trainer.grad_accum_steps=2", "trainer.grad_clip=1.0", f"run_dir={run}",
                  *extra, nproc=2)  # fmt: skip
        curves[name] = read_metrics(run)
    for a, b in zip(curves["fsdp2"], curves["ddp"], strict=True):
        for key in ("train/loss", "val/loss", "val/accuracy"):
            assert close(a[key], b[key], CURVE_RTOL), (a["epoch"], key, a[key], b[key])


def test_twenty_fsdp2_groups_in_a_row_exit_cleanly(tmp_path):
    """Two real processes a group (torchrun's variables, rank 0 hosting the store), each
    sharding, stepping, saving and leaving through the interpreter's exit as train.py does;
    20 groups, every exit 0 and no abort at teardown (tests/fsdp_teardown.py forks the ranks
    from one process that imported torch once)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fsdp_teardown.py"),
                           str(tmp_path), "20"], env=child_env(), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(list(tmp_path.glob("*/checkpoints/step_00000003.dcp/.metadata"))) == 20


MEMORY_CGROUP = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller
LIMIT_MIB = 1850  # a rank's memory: under DDP's peak (~2,080 MiB), above fsdp2's (~1,670)
GPT = ("experiment=gpt2_124m", "model.n_layer=6", "data.block_size=128", "data.batch_size=1",
       "data.global_batch_size=null",
       "data.eval_batch_size=1", "data.vocab_size=50304", "trainer.grad_accum_steps=1",
       "trainer.max_steps=2", "trainer.val_every_steps=2", "trainer.precision=32",
       "trainer.compile=false", "trainer.timeout_s=60", "logger=none",
       "trainer.progress=false")  # fmt: skip


def memory_cgroup_writable() -> bool:
    probe = MEMORY_CGROUP / f"ddp_recipes_probe_{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


def run_capped(args: tuple[str, ...], groups: list[Path]) -> list[int]:
    """Two ranks of train.py, each started inside its own memory cgroup; when one dies the
    other is stopped (it would wait for its peer until the timeout). Their exit codes."""
    port = free_port()
    procs = []
    for r, group in enumerate(groups):
        env = child_env(**rank_env(r, 2, port))
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda g=group: (g / "cgroup.procs").write_text(str(os.getpid())),
        ))  # fmt: skip
    deadline = time.time() + 300
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.kill() if p.poll() is None else None
        time.sleep(0.2)
    return [p.wait() for p in procs]


@pytest.mark.skipif(not memory_cgroup_writable(), reason="needs a writable cgroup v1 memory "
                    "controller (root) to cap a process's memory")  # fmt: skip
def test_a_gpt_over_a_processs_memory_limit_under_ddp_trains_under_fsdp2(tmp_path):
    """A 6-layer GPT-2 (81M parameters, AdamW: ~1.3 GB of state) with every rank capped at
    LIMIT_MIB: DDP's rank is killed by the kernel for memory; fsdp2 at world size 2 trains."""
    rng = np.random.default_rng(0)
    data = tmp_path / "tokens"
    data.mkdir()
    rng.integers(0, 50257, 20_000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 50257, 4 * 128 + 1, dtype=np.uint16).tofile(data / "val.bin")
    for strategy in ("ddp", "fsdp2"):
        groups = [MEMORY_CGROUP / f"ddp_recipes_{os.getpid()}_{strategy}{r}" for r in (0, 1)]
        try:
            for g in groups:
                g.mkdir()
                (g / "memory.limit_in_bytes").write_text(str(LIMIT_MIB << 20))
            run = tmp_path / strategy
            args = (*GPT, "data=tokens", f"data.root={data}", f"trainer.strategy={strategy}")
            codes = run_capped((*args, f"run_dir={run}"), groups)
            failcnt = [int((g / "memory.failcnt").read_text()) for g in groups]
        finally:
            for g in groups:
                g.rmdir() if g.exists() else None
        if strategy == "ddp":
            assert -9 in codes and max(failcnt) > 0, (codes, failcnt)  # the OOM killer
        else:
            assert codes == [0, 0], codes
            assert [r["step"] for r in read_metrics(run)] == [2]


def _stop_step(log: str, signame: str) -> int:
    return int(log.split(f"stopped by {signame} at step ")[1].split(":")[0])


def test_sigterm_saves_its_step_the_lock_holds_and_the_run_resumes_exactly(runs, tokens, tmp_path):
    """SIGTERM to torchrun's agent mid-run: every rank writes its shards of the stop step and
    the job exits as preempted; meanwhile a second launch on the run_dir is refused by the
    lock; the same command then finishes with the uninterrupted run's parameters."""
    args = (*LM, FSDP, f"data.root={tokens}", f"run_dir={tmp_path}")
    proc = start_script("train.py", *args, nproc=2)
    wait_for_step_checkpoint(tmp_path, proc)
    second = run_forked("train.py", *args)
    assert second.returncode == 2 and f"run_dir={tmp_path} is in use" in second.stderr
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    log = (tmp_path / "train.log").read_text()
    assert f"exiting with code {PREEMPTED_EXIT}" in log, out + err
    stop = _stop_step(log, "SIGTERM")
    saved = torch.load(tmp_path / "checkpoints" / "last.dcp" / "meta.pt", weights_only=True)
    assert saved["step"] == stop < 300
    run_script("train.py", *args, nproc=2)
    assert_same_params(params(tmp_path), params(runs["fsdp2"]))


def test_a_full_disk_in_a_sharded_save_stops_every_rank_and_resumes_exactly(runs, tokens, tmp_path):
    """The disk filled at step 120 (a few KiB left): step 150's shards run out of space on
    their way; every rank stops with the one paragraph and exit code 4, no partial folder is
    left, and the run resumes from step 100's folder to the uninterrupted run's end."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        run = disk / "run"
        args = (*LM, FSDP, f"data.root={tokens}", f"run_dir={run}")
        proc = run_script("train.py", *args, fill_disk(120, leave=8192), nproc=2, check=False)
        assert f"exitcode: {WRITE_FAILED_EXIT}" in proc.stderr, proc.stderr[-4000:]
        ours = our_error_lines(proc.stderr)
        assert len(ours) == 1 and "No space left on device" in ours[0], proc.stderr[-4000:]
        assert f"{run}/checkpoints/last.dcp" in ours[0]
        assert not list(run.rglob("*.tmp")), list(run.rglob("*"))
        assert (run / "checkpoints" / "last.dcp").resolve().name == "step_00000100.dcp"
        (disk / "filler").unlink()
        run_script("train.py", *args, "trainer.keep_last=1", nproc=2)
        assert_same_params(params(run), params(runs["fsdp2"]))


def test_an_optuna_sweep_in_process_under_fsdp2(tmp_path):
    """Two trials in one torchrun job (every rank in rank 0's trial), each its own sharded
    model and checkpoints; the objective is each trial's best val/accuracy."""
    pytest.importorskip("optuna")
    sweep = tmp_path / "sweep"
    run_script("train.py", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
               "hydra.sweeper.sampler={_target_:optuna.samplers.GridSampler,seed:0,"
               "search_space:{optim.lr:[0.05,0.1]}}",
               "hydra.sweeper.params={optim.lr:'choice(0.05,0.1)'}", FSDP, "trainer.epochs=1",
               "trainer.precision=32", "logger=none", "trainer.progress=false",
               f"hydra.sweep.dir={sweep}", nproc=2, timeout=600)  # fmt: skip
    trials = json.loads((sweep / "optuna_study.json").read_text())["trials"]
    assert sorted(t["params"]["optim.lr"] for t in trials) == [0.05, 0.1]
    for t in trials:
        job = sweep / str(t["number"])
        assert t["state"] == "COMPLETE"
        assert t["value"] == max(r["val/accuracy"] for r in read_metrics(job))
        assert (job / "checkpoints" / "last.dcp" / ".metadata").is_file()


HOOKED = ("trainer.epochs=2", "trainer.precision=32", "logger=none", "trainer.progress=false",
          "trainer.ckpt_every_steps=5")  # fmt: skip
# Six epochs (42 steps), rank 2, compressed from step 4 (measured: 0.944; the fp32 all-reduce
# 0.986, rank 1 0.872). Small buckets: the strategy makes them one under gloo (torch's hook
# aborts on two).
POWERSGD = ("trainer.epochs=6", "trainer.ddp.comm_hook=powersgd", "trainer.ddp.powersgd_rank=2",
            "trainer.ddp.powersgd_start_iter=4", "trainer.ddp.bucket_cap_mb=0.01")  # fmt: skip


def test_ddps_half_precision_hooks_train_as_the_fp32_all_reduce_and_resume_exactly(tmp_path):
    """fp16 and bf16 gradients (each bucket all-reduced in half the bytes) train the ConvNet
    at world size 2 to the fp32 all-reduce's accuracy within 2 points; the hooks keep no
    state, so a SIGKILLed run resumes to the uninterrupted run's parameters, bit for bit."""
    sweep = tmp_path / "sweep"  # one launch: jobs 0, 1, 2 are null (fp32), fp16, bf16
    run_ranks("train.py", "-m", *HOOKED, "trainer.ddp.comm_hook=null,fp16,bf16",
              f"hydra.sweep.dir={sweep}", nproc=2)  # fmt: skip
    plain = read_metrics(sweep / "0")[-1]["val/accuracy"]
    for job, hook in ((1, "fp16"), (2, "bf16")):
        accuracy = read_metrics(sweep / str(job))[-1]["val/accuracy"]
        assert abs(accuracy - plain) < 0.02, (hook, accuracy, plain)
    killed = tmp_path / "killed"
    run_script("train.py", *HOOKED, "trainer.ddp.comm_hook=bf16", f"run_dir={killed}",
               fault("kill", 13, 1), nproc=2, launcher=("--max-restarts=1",))  # fmt: skip
    assert "step 10" in (killed / "train.log").read_text()
    assert_same_params(params(killed), params(sweep / "2"))


def test_a_sigkilled_powersgd_run_resumes_to_the_same_parameters(tmp_path):
    """PowerSGD's error feedback and factors are checkpointed per parameter (every rank's), so
    a SIGKILLed run, whose restarted DDP steps first on other buckets, resumes to the
    uninterrupted run's parameters, bit for bit; the ConvNet learns under it."""
    run = tmp_path / "run"
    run_ranks("train.py", *HOOKED, *POWERSGD, f"run_dir={run}", nproc=2)
    assert read_metrics(run)[-1]["val/accuracy"] > 0.9
    saved = whole_checkpoint(run / "checkpoints" / "last.pt")["strategy"]["powersgd"]
    assert len(saved) == 2 and saved[0]["iter"] > 4 and saved[0]["p"] and saved[0]["error"]
    killed = tmp_path / "killed"
    run_script("train.py", *HOOKED, *POWERSGD, f"run_dir={killed}", fault("kill", 13, 1),
               nproc=2, launcher=("--max-restarts=1",))  # fmt: skip
    assert "step 10" in (killed / "train.log").read_text()
    assert_same_params(params(killed), params(run))
