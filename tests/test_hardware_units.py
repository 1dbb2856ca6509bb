"""The GPU-path decisions, with the hardware faked: the device a rank takes (torchrun, SLURM
tasks bound to their own GPUs, hosts whose GPUs torch cannot use), precision=auto and the
bf16 refusal, cuDNN/TF32/determinism flags, timeouts, the backend under CPU offload, the
loader's worker count under SLURM, and the buffers of an offloaded FSDP2 model."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
import torch
from torch import nn

from ddp_utils.config import ConfigError, TrainerConfig
from ddp_utils.data.loaders import default_num_workers
from ddp_utils.dist import (
    group_timeout,
    pick_backend,
    pick_device,
    read_launch_env,
    side_group_timeout,
)
from ddp_utils.hardware import (
    Cuda,
    apply_backend_flags,
    auto_precision,
    backend_flags,
    check_precision,
    choose_device,
    host_nvidia_devices,
    probe_cuda,
)
from ddp_utils.lifecycle.peers import lost_peer
from ddp_utils.strategy.fsdp2 import buffers_to

V100 = Cuda(usable=True, device_count=8, nvidia_devices=8, driver_cuda="12.2",
            wheel_cuda="12.1", capability=(7, 0), name="Tesla V100-SXM2-32GB")  # fmt: skip
H100 = Cuda(usable=True, device_count=8, nvidia_devices=8, driver_cuda="13.0",
            wheel_cuda="13.0", capability=(9, 0), name="NVIDIA H100 80GB HBM3")  # fmt: skip
# A driver for CUDA 12.4 under a wheel built for CUDA 13: torch sees no GPU.
OLD_DRIVER = Cuda(usable=False, nvidia_devices=4, driver_cuda="12.4", wheel_cuda="13.0")

SLURM_GPU_PER_TASK = {
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
    "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "77",
    "SLURM_CPUS_PER_TASK": "8",
}  # fmt: skip


def test_a_host_whose_gpus_torch_cannot_use_is_refused_naming_both_cuda_versions():
    with pytest.raises(ConfigError) as e:
        choose_device("auto", 0, 1, False, OLD_DRIVER)
    text = str(e.value)
    assert "4 NVIDIA GPU(s)" in text and "CUDA 13.0" in text and "CUDA 12.4" in text
    assert "TORCH_INDEX=" in text and "trainer.device=cpu" in text
    # On purpose: the CPU, or GPUs hidden with CUDA_VISIBLE_DEVICES="".
    assert choose_device("cpu", 0, 1, False, OLD_DRIVER).type == "cpu"
    hidden = Cuda(nvidia_devices=4, hidden=True, driver_cuda="12.4", wheel_cuda="13.0")
    assert choose_device("auto", 0, 1, False, hidden).type == "cpu"
    with pytest.raises(ConfigError, match="trainer.device=cuda, but torch is built for CUDA 13"):
        choose_device("cuda", 0, 1, False, OLD_DRIVER)


@pytest.mark.parametrize(
    ("cuda", "reason"),
    [
        (Cuda(nvidia_devices=1, wheel_cuda=None), "CPU-only build"),
        (Cuda(nvidia_devices=1, wheel_cuda="13.0"), "libcuda.so.1"),
        (Cuda(nvidia_devices=1, wheel_cuda="13.0", driver_cuda="13.1"), "doctor"),
    ],
)
def test_each_reason_torch_cannot_use_a_gpu_is_named(cuda, reason):
    with pytest.raises(ConfigError, match=reason):
        choose_device("auto", 0, 1, False, cuda)


def test_a_cpu_host_trains_on_the_cpu_and_refuses_cuda():
    assert choose_device("auto", 0, 1, False, Cuda()).type == "cpu"
    with pytest.raises(ConfigError, match="no NVIDIA GPU is visible"):
        choose_device("cuda", 0, 1, False, Cuda())


def test_slurm_tasks_bound_to_one_gpu_each_take_the_one_they_see():
    launch = read_launch_env(SLURM_GPU_PER_TASK)
    assert launch.slurm_tasks and launch.local_world_size == 4 and launch.cpus_per_task == 8
    one = Cuda(usable=True, device_count=1, capability=(9, 0))
    assert pick_device(TrainerConfig(), launch, one) == torch.device("cuda", 0)
    # srun without GPU binding: every task sees the node's 4, and takes its local rank's.
    four = Cuda(usable=True, device_count=4, capability=(9, 0))
    assert pick_device(TrainerConfig(), launch, four) == torch.device("cuda", 1)
    # Two GPUs a task: the task's first two local ranks... each task still takes one of its own.
    two = Cuda(usable=True, device_count=2, capability=(9, 0))
    assert pick_device(TrainerConfig(), launch, two) == torch.device("cuda", 1)
    # torchrun's workers all see the node's devices: more workers than GPUs is a mistake.
    with pytest.raises(ConfigError, match="--nproc_per_node=1"):
        choose_device("auto", 1, 4, False, one)


def test_loader_workers_under_slurm_use_the_tasks_own_cpus():
    with mock.patch("os.sched_getaffinity", return_value=set(range(64))):
        assert default_num_workers(8) == 7  # torchrun: 8 ranks share the 64 cores
        assert default_num_workers(8, cpus_per_task=8) == 7
    # A task bound to its 8 cores sees only those: 8 for this rank, not 8 / 4.
    with mock.patch("os.sched_getaffinity", return_value=set(range(8))):
        assert default_num_workers(4) == 1
        assert default_num_workers(4, cpus_per_task=8) == 7


def test_precision_auto_bf16_where_native_else_fp16_and_explicit_bf16_refused_there():
    assert auto_precision("cuda", H100, amx=False, bf16_on_cpu=False) == "bf16"
    assert auto_precision("cuda", V100, amx=False, bf16_on_cpu=False) == "fp16"
    assert auto_precision("cpu", Cuda(), amx=True, bf16_on_cpu=True) == "bf16"
    assert auto_precision("cpu", Cuda(), amx=True, bf16_on_cpu=False) == "32"
    check_precision("bf16", "cuda", H100)
    check_precision("fp16", "cuda", V100)
    check_precision("bf16", "cpu", Cuda())  # a CPU computes bf16 (slowly without AMX)
    with pytest.raises(ConfigError) as e:
        check_precision("bf16", "cuda", V100)
    assert "V100" in str(e.value) and "7.0" in str(e.value)
    assert "trainer.precision=auto" in str(e.value) and "fp16" in str(e.value)


def test_cudnn_autotuning_and_tf32_on_cuda_unless_deterministic():
    fast = backend_flags("cuda", deterministic=False)
    assert (fast.cudnn_benchmark, fast.tf32, fast.deterministic) == (True, True, False)
    exact = backend_flags("cuda", deterministic=True)
    assert (exact.cudnn_benchmark, exact.tf32, exact.deterministic) == (False, False, True)
    cpu = backend_flags("cpu", deterministic=False)
    assert (cpu.cudnn_benchmark, cpu.tf32) == (False, False)
    # Inputs of varying shapes (detection's images): autotuning would run for every new one.
    varying = backend_flags("cuda", deterministic=False, fixed_input_shapes=False)
    assert (varying.cudnn_benchmark, varying.tf32) == (False, True)


def test_ranks_a_job_script_exported_itself_take_the_gpu_each_sees():
    # srun --gpus-per-task=1 running `RANK=$SLURM_PROCID ... python train.py`: no
    # LOCAL_WORLD_SIZE (torchrun's), and each process sees the one GPU bound to it.
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "node1"}
    one = Cuda(usable=True, device_count=1, capability=(9, 0))
    assert pick_device(TrainerConfig(), read_launch_env(env), one) == torch.device("cuda", 0)
    # ... or all of the node's: the local rank's, as under torchrun
    four = Cuda(usable=True, device_count=4, capability=(9, 0))
    assert pick_device(TrainerConfig(), read_launch_env(env), four) == torch.device("cuda", 1)
    slurm = env | {"SLURM_NTASKS_PER_NODE": "4"}
    assert read_launch_env(slurm).local_world_size == 4
    # torchrun's workers still refuse more processes than GPUs.
    torchrun = env | {"LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(ConfigError, match="--nproc_per_node=1"):
        pick_device(TrainerConfig(), read_launch_env(torchrun), one)


def test_nvl_parts_have_their_own_lower_peak():
    from ddp_utils.flops import gpu_peak_flops

    assert gpu_peak_flops("NVIDIA H100 NVL", "bf16", True) < gpu_peak_flops(
        "NVIDIA H100 80GB HBM3", "bf16", True)  # fmt: skip
    assert gpu_peak_flops("NVIDIA H200 NVL", "32", False) < gpu_peak_flops(
        "NVIDIA H200", "32", False)  # fmt: skip


def test_applying_the_flags_sets_torch_and_a_cpu_run_leaves_cudas_switches():
    before = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.fp32_precision)
    try:
        apply_backend_flags(backend_flags("cpu", deterministic=True), "cpu")
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert (torch.backends.cudnn.benchmark,
                torch.backends.cuda.matmul.fp32_precision) == before  # fmt: skip
        apply_backend_flags(backend_flags("cpu", deterministic=False), "cpu")
        assert not torch.are_deterministic_algorithms_enabled()
        with mock.patch.dict("os.environ", {}, clear=True):
            apply_backend_flags(backend_flags("cuda", deterministic=False), "cuda")
            assert torch.backends.cudnn.benchmark
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
            assert torch.backends.cudnn.conv.fp32_precision == "tf32"
            apply_backend_flags(backend_flags("cuda", deterministic=True), "cuda")
            assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
            import os

            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        apply_backend_flags(backend_flags("cpu", deterministic=False), "cpu")
        torch.backends.cudnn.benchmark = before[0]
        torch.backends.cudnn.deterministic = False
        torch.backends.cuda.matmul.fp32_precision = before[1]
        torch.backends.cudnn.conv.fp32_precision = "tf32"


def test_nccl_waits_longer_than_the_step_watchdog_and_gloo_as_configured():
    t = TrainerConfig(timeout_s=300)
    assert group_timeout(t, "gloo") == timedelta(seconds=300)
    # the stop poll's gloo group: the watchdog reports a stall before it times out
    assert side_group_timeout(t) > timedelta(seconds=300)
    assert group_timeout(t, "nccl") > timedelta(seconds=300)
    assert group_timeout(t, "cpu:gloo,cuda:nccl") == group_timeout(t, "nccl")


def test_cpu_offload_on_cuda_adds_gloo_for_host_tensors():
    offload = TrainerConfig(strategy="fsdp2")
    offload.fsdp.cpu_offload = True
    cuda = torch.device("cuda", 0)
    assert pick_backend(offload, cuda) == "cpu:gloo,cuda:nccl"
    assert pick_backend(TrainerConfig(), cuda) == "nccl"
    assert pick_backend(offload, torch.device("cpu")) == "gloo"


def test_nccl_failures_are_a_lost_peer():
    aborted = torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1.")
    assert lost_peer(aborted) == "another rank is gone"
    assert lost_peer(RuntimeError("NCCL error: remote process exited or there was a network "
                                  "error")) == "another rank is gone"  # fmt: skip
    assert lost_peer(RuntimeError("CUDA out of memory")) is None


def test_host_gpus_are_counted_from_the_driver(tmp_path):
    assert host_nvidia_devices(tmp_path) == 0
    (tmp_path / "dev").mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / "dev" / name).touch()
    assert host_nvidia_devices(tmp_path) == 2
    gpus = tmp_path / "proc/driver/nvidia/gpus"
    for bus in ("0000:07:00.0", "0000:0f:00.0", "0000:47:00.0"):
        (gpus / bus).mkdir(parents=True)
    assert host_nvidia_devices(tmp_path) == 3


def test_probe_on_this_machine_is_consistent():
    cuda = probe_cuda()
    assert cuda.usable == torch.cuda.is_available()
    assert cuda.wheel_cuda == torch.version.cuda
    hidden = probe_cuda({"CUDA_VISIBLE_DEVICES": ""})
    assert hidden.hidden


def test_offloaded_fsdp2_buffers_go_to_the_device_and_parameters_stay():
    # On a GPU: parameters stay in host memory (the offload), buffers go to cuda:N. Here the
    # meta device stands in for the GPU.
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    buffers_to(model, torch.device("meta"))
    assert [b.device.type for b in model.buffers()] == ["meta"] * 3
    assert all(p.device.type == "cpu" for p in model.parameters())


def _scale_after_an_overflow_on_rank_one(rank: int, world: int, strategy: str) -> float:
    from ddp_utils.dist import Runtime
    from ddp_utils.strategy import build_strategy

    trainer = TrainerConfig(strategy=strategy, precision="fp16")
    scaler = build_strategy(trainer, Runtime(rank, rank, world, world, torch.device("cpu"),
                                             "gloo")).make_scaler(enabled=True)  # fmt: skip
    # Each rank's own gradient shard: only rank 1's overflowed.
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), float("inf") if rank == 1 else 1.0)
    # fused: the step takes the scaler's overflow flag (its shape must be a scalar's)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    scaler.scale(torch.ones(()))  # the scale is made at the first loss scaled
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale() / before


def test_fsdp2s_scaler_skips_a_step_on_every_rank_when_one_rank_overflowed(tmp_path):
    from helpers.launch import in_gloo_group

    # The sharded scaler backs off on rank 0 too; a plain GradScaler would not have (rank 0
    # would step and rank 1 skip: the shards would drift apart).
    assert in_gloo_group(_scale_after_an_overflow_on_rank_one, 2, tmp_path, "fsdp2") == 0.5
    (tmp_path / "ddp").mkdir()
    assert in_gloo_group(_scale_after_an_overflow_on_rank_one, 2, tmp_path / "ddp", "ddp") == 1.0


PEAK = """
import torch
from ddp_utils.tracking import peak_memory_mb, reset_peak_memory
cpu = torch.device("cpu")
block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
block.add_(1)
high = peak_memory_mb(cpu)
del block
reset_peak_memory(cpu)
print(high, peak_memory_mb(cpu))
"""


def test_each_sweep_job_reports_its_own_peak_memory():
    import subprocess
    import sys

    # A process of its own: the test process's allocator may keep a freed block's pages.
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True,
                         check=True, timeout=60).stdout  # fmt: skip
    high, after = (float(x) for x in out.split())
    assert after < high - 128


WATCHED = """
import sys, time
from ddp_utils.lifecycle import watchdog
watchdog.OTHERS_PAUSE_S = 1.0
dog = watchdog.StepWatchdog(0.5, rank=int(sys.argv[1]), poll_s=0.05)
dog.beat()
time.sleep(0.8)  # past the timeout: rank 0 exits now; rank 1 pauses first
dog.beat()  # rank 1: progress again within its pause, so no exit
time.sleep(float(sys.argv[2]))
print("still running", flush=True)
"""


@pytest.mark.parametrize(("rank", "then", "exits"), [(0, 0.0, True), (1, 0.0, False),
                                                     (1, 3.0, True)])  # fmt: skip
def test_the_main_ranks_watchdog_speaks_first_and_a_pause_lets_others_recover(rank, then, exits):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", WATCHED, str(rank), str(then)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (proc.returncode != 0) == exits, proc.stderr
    assert ("still running" in proc.stdout) != exits
    if exits:
        assert f"[rank {rank}] error: no training step for 0 s" in proc.stderr
