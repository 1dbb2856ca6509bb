"""The benchmark's worker runs every loop end to end (its numbers are not asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers.launch import run_script
from helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import profile_summary  # noqa: E402 - bench/ is a folder of scripts, not a package

from bench import bench_result  # noqa: E402


def test_bench_worker_runs_every_loop(tmp_path):
    # the peak measured now, under the load the loops run in (a cached one may come from a
    # quieter or a busier hour)
    proc = run_script(
        "bench/worker.py", "--repeats", "1", "--overrides", "data=synthetic",
        "data.num_train=400", "data.num_val=100", "--variants",
        "train.py bf16=trainer.precision=bf16", nproc=1,
        env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
    )  # fmt: skip
    result = bench_result(proc.stdout)
    assert result["world_size"] == 1
    rates = result["images_per_s"]
    assert set(rates) == {"tutorial", "raw bound", "train.py", "train.py bf16"}
    assert all(rate > 0 for rate in rates.values())
    assert set(result["mfu"]) == set(rates)  # make bench's second table
    assert all(0 < mfu < 1 for mfu in result["mfu"].values())
    from bench import mfu_table

    assert "| 1 | " in mfu_table([result])


def test_profile_callback_writes_rank_0s_operator_table(tmp_path):
    """make bench-profile's window in train.py; a run ending inside the window still writes it."""
    table = tmp_path / "ours_torch_profiler.txt"
    proc = run_script(
        "train.py", "data=digits", "trainer.epochs=2", "trainer.max_steps=14",
        "trainer.progress=false", f"run_dir={tmp_path / 'run'}",
        "callbacks=[{_target_: peer_timing.Timing}, {_target_: peer_profile.Profile, steps: 50, "
        f"out: '{table}'}}]",
        env={"PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)])},
    )  # fmt: skip
    assert any(x.startswith("PEER ") and "first_step" in x for x in proc.stdout.splitlines())
    text = table.read_text()
    assert text.startswith("50 steps after 10 of warm-up") and "aten::" in text


def test_profile_summary_splits_rank_0s_samples_by_phase(tmp_path):
    rank0 = f'process 11:"python -u {ROOT / "train.py"} data=x"'
    rank1 = f'process 12:"python -u {ROOT / "train.py"} data=x"'
    peer = f'process 21:"python -u {ROOT / "bench" / "peer_reference.py"}"'
    agent = 'process 10:"python -m torch.distributed.run"'
    (tmp_path / "ours_py_spy.txt").write_text("\n".join([
        f"{agent};{rank0};<module> (train.py:1);_find_and_load (<frozen>:1) 100",
        f"{agent};{rank0};train_one_epoch (ddp_utils/train/loop.py:9);"
        "backward (torch/_tensor.py:5) 250",
        f"{agent};{rank0};Thread._bootstrap (threading.py:1);wait (x.py:1) 999",
        f"{agent};{rank1};train_one_epoch (ddp_utils/train/loop.py:9) 999",
    ]))  # fmt: skip
    (tmp_path / "theirs_py_spy.txt").write_text(
        f"{agent};{peer};main (peer_reference.py:3);evaluate (peer_reference.py:7) 50"
    )
    ours = profile_summary.phases(tmp_path / "ours_py_spy.txt", "train.py")
    theirs = profile_summary.phases(tmp_path / "theirs_py_spy.txt", "bench/peer_reference.py")
    assert ours == {"imports": 2.0, "step: backward": 5.0} and theirs == {"validation": 1.0}


def test_bench_seg_sides_make_the_same_batches_of_the_same_folder(tmp_path):
    """make bench-seg's two pipelines on one folder: image and mask crops of one shape (its
    rates are the benchmark's, not asserted here)."""
    import bench_seg
    import torch
    from segfolders import write_seg_folder

    from ddp_utils.data import IGNORE_LABEL

    root = write_seg_folder(tmp_path, n_train=6)
    (root / "classes.txt").unlink()  # the bench's folders have 21 classes and no names
    theirs = next(iter(bench_seg.reference_loader(root, 0, 3, base=24, crop=16)))
    loader, preprocess = bench_seg.ours_loader(root, 0, 3, 24, 16, torch.device("cpu"))
    images, masks = next(iter(loader))
    ours = (preprocess(images), masks)
    for (a, b), pad in zip((theirs, ours), (255, IGNORE_LABEL), strict=True):
        assert a.shape == (3, 3, 16, 16) and a.dtype == torch.float32
        assert b.shape == (3, 16, 16) and b.dtype == torch.int64
        assert set(b.unique().tolist()) <= {0, 1, 2, 3, pad}


def test_bench_lm_baseline_loop_runs(tmp_path):
    """make bench-lm's plain DDP loop, on a small token folder at world size 2."""
    from lm_data import CHARS, write_token_folder

    root = write_token_folder(tmp_path / "tok", 20_000, 2_000)
    proc = run_script("bench/lm_loop.py", f"--root={root}", f"--vocab={len(CHARS)}",
                      "--steps=6", "--warmup=2", nproc=2)  # fmt: skip
    assert bench_result(proc.stdout)["tokens_per_s"] > 0


def test_bench_nanogpt_links_a_checkout_and_refuses_a_folder_that_is_none(tmp_path):
    import nanogpt  # bench/nanogpt.py
    import pytest

    checkout, prepared = tmp_path / "nanoGPT", tmp_path / "prepared"
    (checkout / "config").mkdir(parents=True)
    prepared.mkdir()
    with pytest.raises(SystemExit, match="is not a nanoGPT checkout .no train.py, model.py"):
        nanogpt.workdir(checkout, prepared, tmp_path)
    for name in nanogpt.NEEDED:
        (checkout / name).write_text("")
    work = nanogpt.workdir(checkout, prepared, tmp_path)
    assert (work / "train.py").resolve() == (checkout / "train.py").resolve()
    assert (work / "data" / "shakespeare_char").resolve() == prepared.resolve()
    assert "--block_size=64" in nanogpt.THEIR_ARGS
    # like with like: on CUDA nanoGPT runs ours' autocast dtype; on a CPU it can only run fp32
    with mock.patch.dict(os.environ, {"DEVICE": "cuda"}):
        assert nanogpt.their_dtype("bf16") == "bfloat16" and nanogpt.their_dtype("32") == "float32"
        assert nanogpt.their_dtype("fp16") == "float16"
    with mock.patch.dict(os.environ, {"DEVICE": "cpu"}):
        assert nanogpt.their_dtype("bf16") == "float32"


REFERENCE_UTILS = """
import torch, torch.distributed as dist


class MetricLogger:
    def log_every(self, iterable, print_freq, header=None):
        yield from iterable


def reduce_across_processes(val):
    t = torch.tensor(val, device="cuda")  # the reference's metric sync, on CUDA
    dist.barrier()
    dist.all_reduce(t)
    return t
"""
REFERENCE_TRAIN = """
import argparse, os, torch, utils


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args):
    for x, y in utils.MetricLogger().log_every(data_loader, 10, f"Epoch: [{epoch}]"):
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()


def evaluate(model, criterion, data_loader, device, log_suffix=""):
    right = sum(int((model(x).argmax(1) == y).sum()) for x, y in data_loader)
    return 100.0 * float(utils.reduce_across_processes([right])[0]) / 16


def main(args):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group(backend="nccl", init_method="env://")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), device_ids=[0])
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    sampler = torch.utils.data.distributed.DistributedSampler(data)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        train_one_epoch(model, torch.nn.CrossEntropyLoss(), optimizer, loader, "cpu", epoch, args)
        evaluate(model, None, loader, "cpu")


def get_args_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--lr", type=float)
    return parser
"""


def test_bench_peer_runs_a_cuda_written_reference_on_the_cpu_with_its_files_untouched(tmp_path):
    """bench/peer_reference.py's CPU changes, at world size 2 with gloo, on a checkout laid
    out as torchvision's whose train.py makes each CUDA-only call the real one makes (nccl,
    set_device, DDP device_ids, a metric sync on a CUDA tensor); its stamps come back."""
    folder = tmp_path / "vision" / "references" / "classification"
    folder.mkdir(parents=True)
    files = {"train.py": REFERENCE_TRAIN, "utils.py": REFERENCE_UTILS, "presets.py": ""}
    for name, text in files.items():
        (folder / name).write_text(text)
    proc = run_script("bench/peer_reference.py", f"--references={tmp_path / 'vision'}", "--",
                      "--epochs=2", "--lr=0.1", nproc=2)  # fmt: skip
    events = [x for x in proc.stdout.splitlines() if x.startswith("PEER ")]
    assert [e.split('"event": ')[1].split(",")[0] for e in events] == [
        '"first_step"', '"epoch"', '"epoch"']  # fmt: skip
    assert all((folder / n).read_text() == t for n, t in files.items())


def test_bench_peer_refuses_a_folder_that_holds_no_reference(tmp_path):
    import peer_reference  # bench/peer_reference.py
    import pytest

    with pytest.raises(SystemExit, match="no references/classification/train.py under it"):
        peer_reference.reference_folder(tmp_path)


def test_bench_det_reference_loop_runs():
    """make bench-det's loop written as torchvision's detection reference writes it."""
    proc = run_script("bench/det_loop.py", "--steps=3", "--warmup=1", nproc=1)
    assert bench_result(proc.stdout)["images_per_s"] > 0


def test_bench_memory_counts_half_the_state_a_rank_under_fsdp2(tmp_path):
    """make bench-memory's measurement (train.py with its probe) on lm_char's GPT at world
    size 2: fsdp2 holds half of ddp's parameters + gradients + AdamW state a rank (the shards
    of a tensor may differ by a row's padding)."""
    import bench_memory

    bench_memory.RECIPES["lm_char"] = (128, ["experiment=lm_char", "trainer.max_steps=3"])
    rows = {s: bench_memory.measure("lm_char", s, tmp_path) for s in ("ddp", "fsdp2")}
    assert all(r["peak_MiB"] > 0 and r["step_s"] > 0 for r in rows.values())
    assert all(len(r["peak_rank_MiB"]) == 2 for r in rows.values())
    assert abs(rows["fsdp2"]["state_MiB"] / rows["ddp"]["state_MiB"] - 0.5) < 0.01


def test_gpu_check_skips_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: make gpu-check runs its checks")
    proc = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu-check: skipped: no NVIDIA GPU on this host")


def test_gpu_check_fails_where_torch_cannot_use_the_hosts_gpus(tmp_path, capsys):
    import gpu_check

    from ddp_utils.hardware import Cuda

    old_driver = Cuda(usable=False, nvidia_devices=4, driver_cuda="12.4", wheel_cuda="13.0")
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(probe=lambda: old_driver, out=out) == 1
    report = json.loads(out.read_text())
    assert not report["passed"] and report["rows"][0]["result"] == "FAIL"
    assert (
        "4 NVIDIA GPU(s)" in report["rows"][0]["detail"] and "12.4" in report["rows"][0]["detail"]
    )
    assert "| torch sees the GPUs | FAIL |" in capsys.readouterr().out


SLOW_TESTS = """
import os, subprocess, time

def test_first():
    pass

def test_stuck(tmp_path):
    child = subprocess.Popen(["sleep", "120"])
    open(os.environ["CHILD_PID"], "w").write(str(child.pid))
    time.sleep(120)

def test_never_reached():
    pass
"""


def test_gpu_check_ends_at_its_deadline_with_the_unrun_checks_failed(tmp_path, monkeypatch):
    import gpu_check

    tests = tmp_path / "test_slow.py"
    tests.write_text(SLOW_TESTS)
    monkeypatch.setenv("CHILD_PID", str(tmp_path / "child.pid"))
    clock = gpu_check.Clock(15.0)
    rows = gpu_check.run_tests(clock, tmp_path, [str(tests)], reserve=0.0, workers=1)
    assert clock.left() < 5.0  # it waited for the deadline, no longer
    got = {r.check: (r.result, r.detail) for r in rows}
    assert got["test_slow::test_first"] == ("ok", "")
    assert got["test_slow::test_stuck"][0] == "FAIL"
    assert got["test_slow::test_never_reached"] == ("FAIL", "not run: the deadline came first")
    # the stopped test's own child went with it
    stat = Path(f"/proc/{int((tmp_path / 'child.pid').read_text())}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().split()[2] != "Z":  # gone, or a zombie
        assert time.monotonic() < deadline, "the stuck test's child outlived the deadline"
        time.sleep(0.1)
    assert gpu_check.report(rows, "test host", tmp_path / "r.json") == 1
    # the verbose lines pytest-xdist prints name the same rows
    xdist = ("[gw1] [ 33%] PASSED tmp/test_slow.py::test_first\n"
             "[gw0] [ 66%] FAILED x/test_slow.py::test_stuck\n")  # fmt: skip
    got = {r.check: r.result for r in gpu_check.test_rows(tmp_path / "none.xml", xdist, [], False)}
    assert got == {"test_slow::test_first": "ok", "test_slow::test_stuck": "FAIL"}


def test_benchmarks_run_both_sides_on_one_device(monkeypatch):
    import bench_lm
    import devices

    monkeypatch.setenv("DEVICE", "cuda")
    assert devices.ours_device() == ["trainer.device=cuda"]
    calls = []
    monkeypatch.setattr(bench_lm.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))  # fmt: skip
    bench_lm.torchrun(2, "train.py", "experiment=lm_char")
    bench_lm.torchrun(2, "bench/lm_loop.py", "--steps=1")
    assert calls[0][-1] == "trainer.device=cuda" and "trainer.device=cuda" not in calls[1]
    monkeypatch.setenv("DEVICE", "gpu")
    with pytest.raises(SystemExit, match="DEVICE=gpu: choose one of cpu, cuda"):
        devices.bench_device()


def test_baselines_set_tf32_and_autotuning_as_train_py_does_for_their_task():
    import devices

    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.benchmark)
    try:
        devices.baseline_numerics("cuda")  # lm_loop: TF32 and autotuning, as train.py
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.benchmark
        devices.baseline_numerics("cuda", fixed_input_shapes=False)  # det_loop: no autotuning
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.benchmark = before
        torch.backends.cudnn.conv.fp32_precision = "tf32"


CPU_PEER = """
import sys
from unittest import mock
import torch
sys.path.insert(0, "bench")
with mock.patch("torch.cuda.is_available", return_value=True):
    import peer_reference
    peer_reference.run_on_cpu()
print(torch.nn.parallel.DistributedDataParallel.__name__)
"""


@pytest.mark.parametrize(
    ("device", "ddp"), [("cpu", "CpuDDP"), ("cuda", "DistributedDataParallel")]
)
def test_bench_peer_patches_the_reference_whenever_its_device_is_the_cpu(device, ddp):
    # a host with GPUs benchmarking the CPU (DEVICE=cpu) still needs the reference's CPU changes
    proc = subprocess.run([sys.executable, "-c", CPU_PEER], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "DEVICE": device})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [ddp]


def test_interval_medians_leave_out_the_first_validation_interval(tmp_path):
    from bench import interval_medians

    rows = [{"samples_per_s": 1.0, "mfu": 0.01}, {"samples_per_s": 10.0, "mfu": 0.2},
            {"samples_per_s": 30.0, "mfu": 0.4}, {"samples_per_s": 20.0, "mfu": 0.3}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert interval_medians(tmp_path, "samples_per_s", "mfu") == (20.0, 0.3)


def test_bench_poll_measures_both_modes_against_no_poll():
    import bench_poll

    got = bench_poll.measure(2, steps=40, repeats=1)
    assert got["reduces"]["every step"] == 40 and got["reduces"]["none"] == 0
    assert 0 < got["reduces"]["default"] < 40
    assert all(v > 0 for v in got["ms_per_step"].values())
    assert got["ms_in_poll_per_step"]["none"] == 0
