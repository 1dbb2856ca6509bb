"""What only a CUDA GPU can show: the device and precision train.py picks there, fp16 with its
scaler, fsdp2 with its parameters offloaded to host memory (buffers on the GPU, clipping over
gloo beside NCCL), SyncBatchNorm, and trainer.deterministic's claim: two runs, the same
parameters. Each skips with a reason on a machine without one; `make gpu-check` runs them
with the GPU benchmarks and multi-process NCCL runs (docs/gpus.md)."""

from __future__ import annotations

import pytest
import torch
from conftest import params, run_script, whole_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check runs these there)"
)

SHORT = ("trainer.max_steps=6", "trainer.val_every_steps=3", "logger=none",
         "trainer.progress=false")  # fmt: skip


def test_the_gpu_is_chosen_and_precision_auto_matches_its_capability():
    from ddp_utils.hardware import auto_precision, choose_device, probe_cuda

    cuda = probe_cuda()
    assert cuda.usable and cuda.wheel_cuda and cuda.driver_cuda
    assert choose_device("auto", 0, 1, False, cuda) == torch.device("cuda", 0)
    want = "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"
    assert auto_precision("cuda", cuda, amx=False, bf16_on_cpu=False) == want


def test_defaults_train_on_the_gpu(tmp_path):
    proc = run_script("train.py", *SHORT, f"run_dir={tmp_path}/run", nproc=1)
    want = "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"
    assert "device cuda:0 | backend nccl" in proc.stdout and f"precision {want}" in proc.stdout


def test_fp16_with_its_gradient_scaler_under_ddp_and_fsdp2(tmp_path):
    for strategy in ("ddp", "fsdp2"):
        run_script("train.py", *SHORT, "trainer.precision=fp16", "trainer.grad_clip=1.0",
                   f"trainer.strategy={strategy}", f"run_dir={tmp_path}/{strategy}",
                   nproc=1)  # fmt: skip
        ckpt = tmp_path / strategy / "checkpoints"
        saved = whole_checkpoint(ckpt / "last.pt" if strategy == "ddp" else ckpt / "last.dcp")
        assert saved["scaler"]["scale"] > 0


def test_fsdp2_with_cpu_offload_on_a_model_with_batchnorm(tmp_path):
    proc = run_script("train.py", *SHORT, "trainer.strategy=fsdp2", "trainer.fsdp.cpu_offload=true",
                      "trainer.grad_clip=1.0", f"run_dir={tmp_path}/run", nproc=1)  # fmt: skip
    assert "backend cpu:gloo,cuda:nccl" in proc.stdout


def test_sync_bn_trains(tmp_path):
    run_script("train.py", *SHORT, "trainer.sync_bn=true", f"run_dir={tmp_path}/run", nproc=1)


def test_deterministic_runs_give_the_same_parameters(tmp_path):
    for name in ("a", "b"):
        run_script("train.py", *SHORT, "trainer.deterministic=true", "trainer.precision=32",
                   f"run_dir={tmp_path}/{name}", nproc=1)  # fmt: skip
    a, b = params(tmp_path / "a"), params(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
