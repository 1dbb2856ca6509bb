"""Preflight checks for distributed training, with a one-line diagnosis and fix per failure.

    python -m ddp_utils.doctor                                  # this machine
    torchrun --standalone --nproc_per_node=2 -m ddp_utils.doctor  # collectives on N ranks
    python -m ddp_utils.doctor --rdzv-endpoint HEAD:29500       # can this node reach the head?
    python -m ddp_utils.doctor --port 29500                     # is the port free here?

Under torchrun (any number of nodes) every rank reports its environment, and all_reduce,
broadcast and all_gather are checked for the right results on every rank, then all_reduce
bandwidth is measured for a few sizes. Exit code 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddp_utils.config import TrainerConfig, UserError
from ddp_utils.dist import init_distributed, read_launch_env, shutdown
from ddp_utils.hardware import INSTALL_DOC, choose_device, probe_cuda


@dataclass
class Report:
    rank: int = 0
    problems: list[str] = field(default_factory=list)

    def ok(self, what: str) -> None:
        if self.rank == 0:
            print(f"  ok    {what}")

    def fail(self, what: str, fix: str) -> None:
        self.problems.append(what)
        prefix = f"[rank {self.rank}] " if self.rank else ""
        print(f"{prefix}  FAIL  {what}\n        fix: {fix}", flush=True)


def versions() -> dict[str, str | None]:
    cuda = probe_cuda()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch built for cuda": cuda.wheel_cuda,
        "driver runs cuda": cuda.driver_cuda,
        "nvidia gpus on the host": str(cuda.nvidia_devices),
        "cuda available": str(cuda.usable),
        "gpus": str(cuda.device_count),
        "gpu": f"{cuda.name} (compute capability {'.'.join(map(str, cuda.capability))})"
        if cuda.capability
        else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda.usable else None,
        "gloo": str(dist.is_gloo_available()),
    }


def check_local(report: Report) -> None:
    """Problems visible on this machine alone: GPUs torch cannot use, NCCL, processes
    against GPUs (the checks train.py's trainer.device=auto makes)."""
    launch, cuda = read_launch_env(), probe_cuda()
    if cuda.usable and not dist.is_nccl_available():
        report.fail(
            "CUDA is available but this torch build has no NCCL",
            "install a CUDA build of torch with NCCL, or use trainer.backend=gloo",
        )
    if not cuda.usable and not dist.is_gloo_available():
        report.fail("no CUDA and no gloo backend", "install a torch build with gloo")
    try:
        device = choose_device(
            "auto", launch.local_rank, launch.local_world_size, launch.slurm_tasks, cuda
        )
    except UserError as e:  # its message names the fix
        report.fail(str(e), f"see {INSTALL_DOC}")
        return
    report.ok(f"trainer.device=auto trains on {device}")


def check_port_free(report: Report, port: int, host: str = "0.0.0.0") -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                report.fail(
                    f"port {port} is already in use on this machine",
                    f"pick another port (--rdzv-endpoint=HOST:OTHER or --master-port), or stop "
                    f"what listens there (`ss -ltnp | grep {port}`)",
                )
            else:
                report.fail(f"cannot bind port {port}: {e.strerror}", "pick a port above 1024")
            return
    report.ok(f"port {port} is free")


def check_endpoint(report: Report, endpoint: str, timeout_s: float = 5.0) -> None:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        report.fail(f"--rdzv-endpoint={endpoint} is not HOST:PORT", "write it as HOST:PORT")
        return
    try:
        addr = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)[0][4]
    except socket.gaierror:
        report.fail(
            f"host name {host} does not resolve",
            "use the head node's IP address, or fix DNS / /etc/hosts",
        )
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except ConnectionRefusedError:
        report.fail(
            f"rendezvous endpoint {endpoint} ({addr[0]}) refused the connection",
            "start the head node's torchrun first (it hosts the endpoint), check HOST:PORT "
            "matches its --rdzv-endpoint, and that no firewall closes the port",
        )
        return
    except OSError as e:
        report.fail(
            f"rendezvous endpoint {endpoint} unreachable ({e.strerror or e})",
            "check the network route and firewall between the nodes",
        )
        return
    report.ok(f"rendezvous endpoint {endpoint} reachable")


def check_collectives(report: Report, device: torch.device) -> None:
    """Every rank must see the right results of all_reduce, broadcast and all_gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    checks = {"all_reduce": bool(torch.all(t == expected))}
    b = torch.full((4,), float(rank == 0) * 42.0, device=device)
    dist.broadcast(b, src=0)
    checks["broadcast"] = bool(torch.all(b == 42.0))
    out = [torch.zeros(2, device=device) for _ in range(world)]
    dist.all_gather(out, torch.full((2,), float(rank), device=device))
    checks["all_gather"] = all(bool(torch.all(o == r)) for r, o in enumerate(out))
    # Every rank's verdicts, so rank 0 can report which ranks are wrong.
    verdicts = [None] * world
    dist.all_gather_object(verdicts, checks)
    if rank == 0:
        for name in checks:
            bad = [r for r, v in enumerate(verdicts) if not v[name]]
            if bad:
                report.fail(
                    f"{name} gave wrong results on ranks {bad}",
                    "check the interconnect; try NCCL_P2P_DISABLE=1 or the gloo backend",
                )
            else:
                report.ok(f"{name} correct on all {world} ranks")


def bandwidth(device: torch.device, sizes_mb=(1, 16, 64), repeats: int = 5) -> dict[str, float]:
    """all_reduce bus bandwidth (GB/s, the nccl-tests convention) per message size."""
    world, result = dist.get_world_size(), {}
    for mb in sizes_mb:
        t = torch.ones(mb * 2**20 // 4, device=device)
        dist.all_reduce(t)  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / repeats
        result[f"{mb} MB"] = mb / 1024 / elapsed * 2 * (world - 1) / world
    return result


def run(args: argparse.Namespace) -> int:
    launch = read_launch_env()
    report = Report(rank=launch.rank)
    if launch.rank == 0:
        print("versions: " + json.dumps(versions()))
    check_local(report)
    if args.port is not None:
        check_port_free(report, args.port)
    if args.rdzv_endpoint:
        check_endpoint(report, args.rdzv_endpoint)
    if launch.launched:
        try:
            rt = init_distributed(TrainerConfig(device=args.device, timeout_s=args.timeout_s))
        except UserError as e:
            report.fail(str(e), "see the message")
            return 1
        except Exception as e:  # a failed rendezvous: name it, with the usual causes
            report.fail(
                f"joining the process group failed: {str(e).splitlines()[0]}",
                "check MASTER_ADDR/MASTER_PORT are reachable from every node and the "
                "port is free on the master (python -m ddp_utils.doctor --port PORT)",
            )
            return 1
        try:
            env = {
                k: os.environ.get(k)
                for k in (
                    "RANK",
                    "LOCAL_RANK",
                    "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                )
            }
            envs = [None] * rt.world_size
            dist.all_gather_object(
                envs, {"host": socket.gethostname(), "device": str(rt.device), **env}
            )
            if rt.is_main:
                print(f"backend {rt.backend}, world size {rt.world_size}")
                for r, e in enumerate(envs):
                    print(f"  rank {r}: " + json.dumps(e))
            check_collectives(report, rt.device)
            speeds = bandwidth(rt.device)
            if rt.is_main:
                cells = ", ".join(f"{k}: {v:.2f} GB/s" for k, v in speeds.items())
                print(f"all_reduce bus bandwidth: {cells}")
            problems = [None] * rt.world_size
            dist.all_gather_object(problems, report.problems)
            failed = any(problems)
        finally:
            shutdown()
    else:
        failed = bool(report.problems)
    if launch.rank == 0:
        print("doctor: all checks passed" if not failed else "doctor: problems found (see FAIL)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m ddp_utils.doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the head node's rendezvous to reach")
    p.add_argument("--port", type=int, help="a port that must be free on this machine")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--timeout-s", type=float, default=60.0)
    sys.exit(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
