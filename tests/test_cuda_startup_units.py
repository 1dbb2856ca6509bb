"""The CUDA branch's host-side start-up, run on a CPU with the CUDA probe faked: every call a
GPU run makes before its first tensor reaches the device (the device and backend choice, the
process group's options, precision=auto, torch's TF32/cuDNN switches set and MFU's peak looked
up after them, the gradient scaler), in the order train.py makes them. A line only a GPU
would run fails here first: setting torch's new fp32_precision switch and then reading the
legacy allow_tf32 one raised on every default CUDA run before its first step."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers.launch import free_port
from helpers.runs import compose_config

from ddp_utils.config import TrainConfig, TrainerConfig
from ddp_utils.data import resolve_data
from ddp_utils.dist import init_distributed, shutdown
from ddp_utils.lifecycle.preemption import StopRequest
from ddp_utils.strategy import build_strategy
from ddp_utils.tasks import build_task
from ddp_utils.train.state import check_runtime, prepare_device, resolve_auto

H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
V100 = ("Tesla V100-SXM2-32GB", (7, 0))


@contextlib.contextmanager
def fake_cuda(name: str, capability: tuple[int, int], count: int = 8) -> Iterator[dict]:
    """torch and the driver report ``count`` GPUs of one kind; what would touch a device is
    recorded instead. The process group is a real gloo one, joined with the options a GPU
    run asks for (kept in the record)."""
    seen: dict = {}
    real_init = dist.init_process_group

    def init_process_group(backend, **kwargs):
        seen["backend"], seen["device_id"] = backend, kwargs.pop("device_id", None)
        seen["timeout"] = kwargs["timeout"]
        real_init("gloo", **kwargs)

    torch_flags = (torch.backends.cuda.matmul.fp32_precision,
                   torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.benchmark,
                   torch.backends.cudnn.deterministic)  # fmt: skip
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.device_count", return_value=count),
        mock.patch("torch.cuda.get_device_capability", return_value=capability),
        mock.patch("torch.cuda.get_device_name", return_value=name),
        mock.patch("torch.cuda.set_device", side_effect=lambda d: seen.update(set_device=d)),
        mock.patch("torch.cuda.reset_peak_memory_stats"),
        mock.patch("ddp_utils.hardware.driver_cuda_version", return_value="13.0"),
        mock.patch("ddp_utils.hardware.host_nvidia_devices", return_value=count),
        mock.patch.object(dist, "init_process_group", init_process_group),
    ):
        try:
            yield seen
        finally:
            shutdown()
            torch.use_deterministic_algorithms(False)
            (
                torch.backends.cuda.matmul.fp32_precision,
                torch.backends.cudnn.conv.fp32_precision,
                torch.backends.cudnn.benchmark,
                torch.backends.cudnn.deterministic,
            ) = torch_flags


def start_up(cfg: TrainConfig) -> dict:
    """train.py's start-up up to the model, as a torchrun worker of one makes it."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    rt = init_distributed(cfg.trainer, env)  # train.py
    check_runtime(cfg.trainer, rt)  # fit
    cfg = resolve_auto(cfg, rt)
    cfg = dataclasses.replace(cfg, data=resolve_data(cfg.data, rt))
    t = cfg.trainer
    task = build_task(cfg)  # build_training
    peak, source = prepare_device(t, rt, task)
    scaler = build_strategy(t, rt).make_scaler(enabled=t.precision == "fp16")
    StopRequest(dist.default_pg_timeout).close()
    return {"rt": rt, "precision": t.precision, "peak": peak, "source": source,
            "scaler": scaler.is_enabled(), "tf32": torch.backends.cuda.matmul.fp32_precision,
            "conv": torch.backends.cudnn.conv.fp32_precision,
            "benchmark": torch.backends.cudnn.benchmark}  # fmt: skip


def test_a_default_run_on_an_h100_reaches_its_first_step_with_tf32_and_the_datasheet_peak():
    with fake_cuda(*H100) as seen:
        got = start_up(compose_config())
    assert got["rt"].device == torch.device("cuda", 0) and got["rt"].backend == "nccl"
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 0)
    assert seen["set_device"] == torch.device("cuda", 0)
    assert seen["timeout"].total_seconds() > TrainerConfig().timeout_s  # NCCL's is longer
    assert got["precision"] == "bf16" and not got["scaler"]
    assert (got["tf32"], got["conv"], got["benchmark"]) == ("tf32", "tf32", True)
    assert got["peak"] == 989e12 and got["source"] == "the datasheet of NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("gpu", "overrides", "want"),
    [
        # fp32 on tensor cores: the TF32 peak
        (H100, ["trainer.precision=32"], ("32", 494.7e12, False, "tf32", True)),
        # determinism: IEEE fp32 and its peak, no autotuning
        (H100, ["trainer.precision=32", "trainer.deterministic=true"],
         ("32", 67e12, False, "ieee", False)),
        # no bf16 units: fp16 with a gradient scaler, under fsdp2's sharded one too
        (V100, [], ("fp16", 125e12, True, "tf32", True)),
        (V100, ["trainer.strategy=fsdp2"], ("fp16", 125e12, True, "tf32", True)),
        # images of their own sizes: TF32 on, autotuning off
        (H100, ["experiment=digits_detection"], ("bf16", 989e12, False, "tf32", False)),
        (H100, ["experiment=lm_char"], ("bf16", 989e12, False, "tf32", True)),
        (H100, ["experiment=digits_segmentation"], ("bf16", 989e12, False, "tf32", True)),
    ],
)  # fmt: skip
def test_each_gpu_and_setting_starts_with_its_precision_peak_scaler_and_switches(
    gpu, overrides, want
):
    with fake_cuda(*gpu):
        got = start_up(compose_config(*overrides))
    assert (got["precision"], got["peak"], got["scaler"], got["tf32"], got["benchmark"]) == want


def test_deterministic_segmentation_on_cuda_says_which_kernel_is_not(caplog):
    with fake_cuda(*H100), caplog.at_level("WARNING"):
        start_up(compose_config("experiment=digits_segmentation", "trainer.deterministic=true"))
    assert "bilinear upsampling's backward" in caplog.text
    assert "no deterministic CUDA kernel" in caplog.text
