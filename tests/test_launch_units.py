"""The launch environment: torchrun's and SLURM's variables, devices, backends, joining a group."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from unittest import mock

import pytest
import torch

from ddp_utils.config import (
    ConfigError,
    TrainerConfig,
)
from ddp_utils.dist import (
    first_host,
    init_distributed,
    pick_backend,
    pick_device,
    read_launch_env,
    shutdown,
)
from ddp_utils.hardware import Cuda

TORCHRUN_ENV = {
    "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job7",
}  # fmt: skip


def test_launch_env_reads_torchrun_variables():
    env = read_launch_env(TORCHRUN_ENV)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.master_addr, env.master_port, env.run_id) == ("10.0.0.1", 29400, "job7")
    assert env.launched


def test_no_torchrun_means_world_size_one():
    env = read_launch_env({})
    assert (env.rank, env.world_size, env.launched) == (0, 1, False)


def test_plain_python_joins_a_group_of_one():
    with mock.patch.dict("os.environ", {}, clear=True):
        rt = init_distributed(TrainerConfig(device="cpu"))
    try:
        assert (rt.rank, rt.world_size, rt.is_main, rt.backend) == (0, 1, True, "gloo")
        assert torch.distributed.get_world_size() == 1
        with pytest.raises(
            dataclasses.FrozenInstanceError
        ):  # frozen: runtime facts cannot be changed
            rt.rank = 3
    finally:
        shutdown()
    assert not torch.distributed.is_initialized()


def test_device_auto_is_cpu_without_cuda_and_cuda_is_refused():
    env = read_launch_env(TORCHRUN_ENV)
    assert pick_device(TrainerConfig(device="auto"), env, Cuda()).type == "cpu"
    with pytest.raises(ConfigError, match="trainer.device=cuda"):
        pick_device(TrainerConfig(device="cuda"), env, Cuda())


def test_more_local_processes_than_gpus_fails_fast():
    env = read_launch_env(TORCHRUN_ENV)  # 4 local processes
    with pytest.raises(ConfigError, match="--nproc_per_node=2"):
        pick_device(TrainerConfig(device="auto"), env, Cuda(usable=True, device_count=2))
    four = Cuda(usable=True, device_count=4)
    assert pick_device(TrainerConfig(), env, four) == torch.device("cuda", 1)


def test_backend_choice():
    assert pick_backend(TrainerConfig(), torch.device("cpu")) == "gloo"
    assert pick_backend(TrainerConfig(), torch.device("cuda", 0)) == "nccl"
    assert pick_backend(TrainerConfig(backend="gloo"), torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ConfigError, match="trainer.backend=nccl"):
        pick_backend(TrainerConfig(backend="nccl"), torch.device("cpu"))


def test_slurm_environment_without_torchrun():
    env = read_launch_env(
        {
            "SLURM_PROCID": "9",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "16",
            "SLURM_TASKS_PER_NODE": "8(x2)",
            "SLURM_JOB_NODELIST": "gpu[007-008,012],cpu1",
            "SLURM_JOB_ID": "4242",
        }  # fmt: skip
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (9, 1, 16, 8)
    assert env.master_addr == "gpu007" and env.master_port == 15000 + 4242
    assert env.run_id == "slurm4242" and env.launched


def test_torchrun_variables_win_over_slurm_and_master_can_be_set():
    both = {**TORCHRUN_ENV, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert read_launch_env(both).rank == 5
    env = read_launch_env(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "n1",
            "MASTER_ADDR": "head",
            "MASTER_PORT": "1234",
        }  # fmt: skip
    )
    assert (env.master_addr, env.master_port, env.local_world_size) == ("head", 1234, 2)


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("node1", "node1"),
        ("a-b[1-2]", "a-b1"),
        ("n[03]x,m1", "n03x"),
        ("h1,h2", "h1"),
        ("gpu[12,4]", "gpu12"),
    ],  # fmt: skip
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_help_and_config_mistakes_answer_before_the_training_stack_is_imported():
    """What keeps --help and every configuration mistake quick: the entry's imports and the
    config's validation load neither torchmetrics (2-3 s a process) nor torchvision."""
    code = """
import sys
import ddp_utils.entry
from ddp_utils.config import TrainConfig, validate
validate(TrainConfig())
print(sorted({m.split(".")[0] for m in sys.modules} & {"torchmetrics", "torchvision"}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
