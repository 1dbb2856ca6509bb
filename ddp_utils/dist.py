"""The one home for distributed state and helpers.

``Runtime`` holds the facts of this process (rank, device, ...). It is built once by
``init_distributed`` and passed explicitly; nothing is written onto the config.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_utils.config import ConfigError, TrainerConfig
from ddp_utils.hardware import Cuda, choose_device, probe_cuda


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    # SLURM's CPUs for this task when srun started one process per task (each has its own);
    # None under torchrun, whose workers on a node share theirs
    cpus_per_task: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun, or none) told this process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    run_id: str | None = None
    # One process per task, each possibly bound to GPUs of its own: srun's tasks, or ranks a
    # job script exported itself (no LOCAL_WORLD_SIZE, which torchrun always sets)
    slurm_tasks: bool = False
    cpus_per_task: int | None = None  # SLURM_CPUS_PER_TASK of such a task

    @property
    def launched(self) -> bool:
        return self.master_addr is not None


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read torchrun's variables, else SLURM's (srun without torchrun); without either this is
    a single process of world size 1."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        # torchrun always sets LOCAL_WORLD_SIZE. Without it, a job script exported the ranks
        # itself (srun, mpirun, a Kubernetes pod), possibly with a GPU bound to each process
        # (--gpus-per-task=1): each then takes a device it sees, as srun's own tasks do.
        own_launch = "LOCAL_WORLD_SIZE" not in env
        return LaunchEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE") or tasks_per_node(env, world_size)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            run_id=env.get("TORCHELASTIC_RUN_ID"),
            slurm_tasks=own_launch,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return read_slurm_env(env)
    return LaunchEnv()


def read_slurm_env(env: Mapping[str, str]) -> LaunchEnv:
    """One process per SLURM task: ranks from SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS, the
    master on the job's first node (MASTER_ADDR and MASTER_PORT override)."""
    job_id = env.get("SLURM_JOB_ID", "0")
    world_size = int(env["SLURM_NTASKS"])
    local_world = tasks_per_node(env, world_size)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
    return LaunchEnv(
        rank=int(env["SLURM_PROCID"]),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        world_size=world_size,
        local_world_size=local_world,
        master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
        # Jobs sharing a node get different ports; the range avoids the ephemeral ports.
        master_port=int(env.get("MASTER_PORT") or 15000 + int(job_id) % 20000),
        run_id=f"slurm{job_id}",
        slurm_tasks=True,
        cpus_per_task=int(env["SLURM_CPUS_PER_TASK"]) if env.get("SLURM_CPUS_PER_TASK") else None,
    )


def tasks_per_node(env: Mapping[str, str], world_size: int) -> int:
    """SLURM's tasks on this node (its first count: ``4(x2)`` -> 4), else ``world_size``."""
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    return int(per_node.split("(")[0].split(",")[0]) if per_node else world_size


def nnodes_of(args: list[str]) -> tuple[int, int] | None:
    """torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``) among its arguments, or None."""
    for i, arg in enumerate(args):
        value = None
        if arg in ("--nnodes", "--nnodes_") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
        if value is not None:
            low, _, high = value.partition(":")
            with contextlib.suppress(ValueError):
                return int(low), int(high or low)
    return None


def shared_store_warning(env: Mapping[str, str], agent_args: list[str]) -> str | None:
    """What to tell an elastic or multi-node torchrun job that shares the agent's rendezvous
    store with its workers (torchrun's default): when a node comes back, the agents wait on
    each other's keys in that store and fail after 60 s (docs/elasticity.md)."""
    nodes = nnodes_of(agent_args)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or nodes is None or nodes[1] < 2:
        return None
    return (f"torchrun --nnodes={':'.join(map(str, dict.fromkeys(nodes)))} shares its "
            "rendezvous store with the workers: when a node is lost and comes back, the agents "
            "wait on each other's keys in it and fail after 60 s. Launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every node's environment (ddp-run sets it), "
            "see docs/elasticity.md.")  # fmt: skip


def agent_args() -> list[str]:
    """The command line of this worker's parent (its torchrun agent, if any)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def restart_note(env: Mapping[str, str] | None = None) -> str | None:
    """Under a torchrun agent with restarts left, what happens after this rank fails: the
    agent restarts the workers, which resume by themselves."""
    env = os.environ if env is None else env
    left = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        env.get("TORCHELASTIC_RESTART_COUNT", "0"))  # fmt: skip
    if left <= 0:
        return None
    return (f"torchrun restarts the workers ({left} of its --max-restarts left) and they resume "
            "from the newest checkpoint by themselves; if it gives up, relaunch the same "
            "command")  # fmt: skip


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[007-009,012],cpu1`` -> ``gpu007``."""
    first = re.match(r"[^,\[]*(\[[^\]]*\])?[^,]*", nodelist.strip()).group(0)
    m = re.fullmatch(r"([^\[]*)\[([^\],-]+)[^\]]*\](.*)", first)
    return f"{m.group(1)}{m.group(2)}{m.group(3)}" if m else first


def pick_device(cfg: TrainerConfig, launch: LaunchEnv, cuda: Cuda | None = None) -> torch.device:
    """``trainer.device`` for this rank (ddp_utils.hardware.choose_device decides)."""
    cuda = probe_cuda() if cuda is None else cuda
    return choose_device(
        cfg.device, launch.local_rank, launch.local_world_size, launch.slurm_tasks, cuda
    )


def pick_backend(cfg: TrainerConfig, device: torch.device) -> str:
    """gloo on a CPU, NCCL on CUDA. With ``trainer.fsdp.cpu_offload`` on CUDA the gradients,
    and so clipping's norms and the gradient scaler's inf checks, live in host memory: those
    collectives go to a gloo backend beside NCCL (as torchtitan runs offload)."""
    if cfg.backend != "auto":
        if cfg.backend == "nccl" and device.type != "cuda":
            raise ConfigError("trainer.backend=nccl needs CUDA devices; use trainer.backend=gloo.")
        return cfg.backend
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cfg.fsdp.cpu_offload else "nccl"


# NCCL's own watchdog ends a process whose collective waited the group's timeout, before any
# Python handler runs: the group waits this much longer than ``trainer.timeout_s``, so that
# the step watchdog (ddp_utils.lifecycle.watchdog), at ``trainer.timeout_s``, names what
# was stuck first.
NCCL_GRACE_S = 60.0


def group_timeout(cfg: TrainerConfig, backend: str) -> timedelta:
    extra = NCCL_GRACE_S if "nccl" in backend else 0.0
    return timedelta(seconds=cfg.timeout_s + extra)


def side_group_timeout(cfg: TrainerConfig) -> timedelta:
    """The timeout of a gloo group beside the main one (the stop poll's): longer than the step
    watchdog's ``trainer.timeout_s``, as NCCL's is, so that a stall is reported by the
    watchdog, naming what was stuck, not by a side group's collective timing out first."""
    return timedelta(seconds=cfg.timeout_s + NCCL_GRACE_S)


_CHECKPOINT_GROUPS: dict[tuple[int, float], dist.ProcessGroup] = {}


def checkpoint_group(timeout_s: float) -> dist.ProcessGroup | None:
    """A gloo group with ``timeout_s`` (``trainer.checkpoint.timeout_s``) for a sharded save's
    collectives: a slow file system can hold one rank's write far longer than the training
    group's timeout, which would end the others' wait in DCP's final gather. Every rank calls
    it at the same save; made once per default group. None without a group of several."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    key = (id(dist.group.WORLD), timeout_s)
    if key not in _CHECKPOINT_GROUPS:
        _CHECKPOINT_GROUPS.clear()  # a previous group's are gone with it
        _CHECKPOINT_GROUPS[key] = dist.new_group(backend="gloo",
                                                 timeout=timedelta(seconds=timeout_s))  # fmt: skip
    return _CHECKPOINT_GROUPS[key]


def launch_store(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT, with keys private to this attempt.

    torchrun shares its own TCPStore with the workers and keeps it across restarts, so the
    workers of a restarted group can read the previous attempt's addresses and fail to
    connect (pytorch/pytorch#135712). Prefixing the keys with the restart count keeps each
    attempt apart. Each agent counts its own restarts, so across nodes the counts can differ:
    multi-node jobs with --max-restarts should set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which
    gives every attempt a new store of its own (see docs/resume.md).
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        launch.master_addr,
        launch.master_port,
        launch.world_size,
        is_master=not agent_hosts_it and launch.rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    if not agent_hosts_it:
        return store  # rank 0 hosts a new store for every attempt: nothing stale in it
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ddp_recipes/attempt{attempt}", store)


def init_distributed(cfg: TrainerConfig, env: dict[str, str] | None = None) -> Runtime:
    """Set the device, then join the process group (a group of one without torchrun)."""
    launch = read_launch_env(env)
    device = pick_device(cfg, launch)
    backend = pick_backend(cfg, device)
    if device.type == "cuda":
        # Before the process group: NCCL binds each rank to the current device.
        torch.cuda.set_device(device)
    timeout = group_timeout(cfg, backend)
    if not dist.is_initialized():
        if launch.launched:
            join_launch_group(launch, backend, timeout, device if device.type == "cuda" else None)
        else:
            # A one-process group keeps DDP and the evaluation on the same code path as torchrun.
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        # A sweep keeps the group for all its jobs; it is left when the process exits.
        atexit.register(shutdown)
    return Runtime(
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        device=device,
        backend=backend,
        cpus_per_task=launch.cpus_per_task,
    )


_GROUP_STORE: list[dist.Store] = []  # the launched group's store, for leaving together


def join_launch_group(
    launch: LaunchEnv, backend: str, timeout: timedelta, device_id: torch.device | None = None
) -> None:
    """Join the launcher's process group through its rendezvous store."""
    _GROUP_STORE[:] = [launch_store(launch, timeout)]
    dist.init_process_group(
        backend,
        store=_GROUP_STORE[0],
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timeout,
        device_id=device_id,
    )


def group_store() -> dist.Store:
    """The store of the running default group: the launcher's, or that of a group another
    script started (a peer's reference run)."""
    return _GROUP_STORE[0] if _GROUP_STORE else dist.distributed_c10d._get_default_store()


LEAVE_WAIT_S = 30.0  # how long a rank waits at the end for the others to tear down


def shutdown(together: bool = True, wait_s: float = LEAVE_WAIT_S) -> None:
    """Leave the process group so that no rank aborts at exit. A rank whose peer closed its
    gloo connections while it was still tearing its own down, or whose group objects were left
    to the interpreter's finalization, was seen to abort ("terminate called without an active
    exception", now and then under fsdp2): every rank destroys its group, then waits
    (through the store, which outlives the group) until all have, and the objects that still
    hold a group are collected while the interpreter is whole. Not ``together``: a peer is
    gone, and nobody waits for it; ``wait_s``: how long to wait for the others at most."""
    if dist.is_initialized():
        store, world = group_store(), dist.get_world_size()
        dist.destroy_process_group()
        if world > 1 and together:
            leave_together(store, world, wait_s)
        # The store goes with the group: a fork of this process (a test's ranks) would
        # otherwise inherit a store whose server thread it does not have, and hang replacing it.
        _GROUP_STORE.clear()
    gc.collect()


def leave_together(store: dist.Store, world: int, wait_s: float = LEAVE_WAIT_S) -> None:
    try:
        store.add("ddp_recipes/left", 1)
        deadline = time.monotonic() + wait_s
        while store.add("ddp_recipes/left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.005)
    except Exception:  # a peer (or the store's host) already gone: nothing to wait for
        pass


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Every rank gets rank ``src``'s object."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (an object collective, so it works
    on every backend without a device tensor)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return any(flags)


def broadcast_buffers(modules: Iterable[torch.nn.Module], src: int = 0) -> None:
    """Every rank gets rank ``src``'s buffers of ``modules`` (BatchNorm's running statistics).

    DDP copies rank 0's buffers to the others only at the start of a training forward, so
    after a step each rank holds statistics of its own batches; a rank that evaluates or
    saves then would score a model nobody saved. One broadcast for all of them: float64 holds
    every float32/16 value and every integer count below 2**53 exactly.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    buffers = [b for m in modules for b in m.buffers()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).double() for b in buffers])
    dist.broadcast(flat, src)
    offset = 0
    for b in buffers:
        n = b.numel()
        b.detach().copy_(flat[offset : offset + n].view(b.shape))
        offset += n


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


_main_waits = itertools.count()  # the same sequence on every rank: one key per call
MAIN_WAIT_POLL_S = 0.2


def main_rank_runs(rt: Runtime, work: Callable[[], Any]) -> Any:
    """The main rank runs ``work`` (its result is returned there, None elsewhere) while the
    others wait for it as long as it takes: a first listing of a million files can outlast
    ``trainer.timeout_s``, which would end a collective wait. They poll the group's store
    instead; if the main rank dies meanwhile, the launcher (torchrun, srun) ends the job."""
    key = f"ddp_recipes/main_done/{next(_main_waits)}"
    if rt.world_size == 1 or not dist.is_initialized():
        return work() if rt.is_main else None
    store = group_store()
    if rt.is_main:
        try:
            return work()
        finally:
            store.set(key, b"1")
    wait_for_key(store, key)
    return None


def wait_for_key(store: dist.Store, key: str) -> None:
    """Poll the store until ``key`` is set: no collective, so no timeout ends the wait."""
    while not store.check([key]):
        time.sleep(MAIN_WAIT_POLL_S)


@contextlib.contextmanager
def local_main_first(rt: Runtime) -> Iterator[None]:
    """Let local rank 0 prepare per-node files (downloads, caches) while the node's other ranks
    wait for it as long as it takes (through the store, as ``main_rank_runs``: a download can
    outlast ``trainer.timeout_s``). A node's local main is global rank ``rank - local_rank``
    (torchrun and SLURM number a node's ranks contiguously)."""
    key = f"ddp_recipes/local_main_done/{next(_main_waits)}/{rt.rank - rt.local_rank}"
    if rt.world_size == 1 or not dist.is_initialized():
        yield
        return
    store = group_store()
    if not rt.is_local_main:
        wait_for_key(store, key)
        yield
        return
    try:
        yield
    finally:
        store.set(key, b"1")
