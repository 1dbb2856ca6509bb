"""Starting the scripts as users do (python, torchrun) and forking ranks in-process; the
processes a test started, and the lines they printed."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers.paths import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def command(script: str, args: tuple[str, ...], nproc: int | None, launcher: tuple = ()) -> list:
    """``python SCRIPT args`` (nproc=None) or ``torchrun --standalone --nproc_per_node=N``."""
    script = str(ROOT / script)
    if nproc is None:
        return [sys.executable, script, *args]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", *launcher, script, *args,
    ]  # fmt: skip


def start_script(
    script: str, *args: str, nproc: int | None = None, launcher: tuple = (), **env: str
) -> subprocess.Popen:
    """Start in the background (stdout and stderr to pipes), for tests that signal it."""
    return subprocess.Popen(
        command(script, args, nproc, launcher),
        cwd=ROOT,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def our_error_lines(stderr: str) -> list[str]:
    """The lines with "error" that we printed: not torchrun's summary after its traceback,
    nor its log lines (E1203 12:00...)."""
    err = stderr.split("Traceback")[0]
    ours = [line for line in err.splitlines() if not re.match(r"[EWI]\d{4} ", line)]
    return [line for line in ours if "error" in line.lower()]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...), from /proc."""
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parent_of[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie is not)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def kill_agent_alone(proc: subprocess.Popen, within_s: float = 10.0) -> set[int]:
    """SIGKILL torchrun's agent only (not its process group, as the OOM killer would), then
    the processes that were below it and still run ``within_s`` later (none, we expect)."""
    below = descendants(proc.pid)
    assert below, "the agent has no workers yet"
    proc.kill()
    proc.wait(timeout=30)  # the agent alone: its orphans would hold its pipes open
    deadline = time.time() + within_s
    while (left := alive(below)) and time.time() < deadline:
        time.sleep(0.2)
    for pid in left:  # not to leave them to the next test
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    proc.communicate(timeout=30)
    return left


def run_script(
    script: str,
    *args: str,
    nproc: int | None = None,
    timeout: float = 300,
    check: bool = True,
    cwd: Path = ROOT,
    launcher: tuple = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run to the end; with ``check``, fail the test on a non-zero exit, showing the output."""
    cmd = command(script, args, nproc, launcher)
    proc = subprocess.run(
        cmd, cwd=cwd, env=child_env(**(env or {})), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        fail(" ".join(cmd), proc)
    return proc


def fail(what: str, proc: subprocess.CompletedProcess):
    """Fail the test on a run's non-zero exit, showing the run's output."""
    raise AssertionError(f"{what} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                         f"\n--- stderr\n{proc.stderr[-6000:]}")  # fmt: skip


def run_forked(
    script: str,
    *args: str,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """``python SCRIPT args`` in a fork of this test process: the real entry script as
    ``__main__`` in a process of its own, with its own exit code, stdout and stderr, but
    without paying again for the interpreter's imports (torch, torchvision, torchmetrics:
    seconds each). The fork runs on one intra-op thread, as torchrun's workers do, so it
    never enters the parent's OpenMP pool. Tests of a plain process's own life (its signals,
    its exit code) use ``run_script``."""
    (done,) = run_forked_group(script, *args, envs=[env or {}], cwd=cwd, timeout=timeout)
    return done


def run_ranks(
    script: str,
    *args: str,
    nproc: int,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``script`` as the ``nproc`` ranks of one real gloo group, each a fork of this test
    process given the variables torchrun gives its workers: for checks of what a script
    computes at a world size (eval.py's numbers). The ranks skip seconds of imports each;
    tests of torchrun itself (restarts, its signals, its exit report) use ``run_script``.
    One result: the first failing rank's exit code, every rank's stdout and stderr."""
    port = free_port()
    envs = [{**(env or {}), **rank_env(r, nproc, port)} for r in range(nproc)]
    done = run_forked_group(script, *args, envs=envs, cwd=cwd, timeout=timeout)
    code = next((p.returncode for p in done if p.returncode != 0), 0)
    proc = subprocess.CompletedProcess([script, *args], code, "".join(p.stdout for p in done),
                                       "".join(p.stderr for p in done))  # fmt: skip
    if check and code != 0:
        fail(f"{script} {' '.join(args)} as {nproc} forked ranks", proc)
    return proc


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives a worker of a one-node group of ``world``."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@contextlib.contextmanager
def frozen_heap():
    """For forking: the forks' garbage collections skip this process's objects, which
    touching would copy into each fork page by page (seconds a run)."""
    sys.stdout.flush(), sys.stderr.flush()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def fork_ranks(fn, args: tuple, world: int) -> None:
    """``fn(rank, *args)`` in ``world`` forks of this process, each waited for."""
    import torch.multiprocessing as mp

    with frozen_heap():
        mp.start_processes(fn, args=args, nprocs=world, start_method="fork")


def run_forked_group(
    script: str, *args: str, envs: list[dict[str, str]], cwd: Path = ROOT, timeout: float = 120
) -> list[subprocess.CompletedProcess]:
    """One fork a process of ``envs``, all started together (the ranks of a group, given
    torchrun's variables), each waited for; their exit codes, stdout and stderr."""
    import tempfile

    # imported once here rather than in every fork: the scripts' heavy imports (torch,
    # torchvision, torchmetrics, hydra) are most of a short run's seconds
    import ddp_utils.entry  # noqa: F401
    import ddp_utils.eval_checkpoint  # noqa: F401
    import ddp_utils.train.loop  # noqa: F401

    files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in envs]  # noqa: SIM115
    pids = []
    with frozen_heap():
        for env, (out, err) in zip(envs, files, strict=True):
            pid = os.fork()
            if pid == 0:
                _forked_main(str(ROOT / script), args, cwd, env, out.fileno(), err.fileno())
            pids.append(pid)
    deadline, codes = time.time() + timeout, {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes and (done := os.waitpid(pid, os.WNOHANG))[0] != 0:
                codes[pid] = os.waitstatus_to_exitcode(done[1])
        if time.time() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired([script, *args], timeout)
        time.sleep(0.01)
    results = []
    for pid, (out, err) in zip(pids, files, strict=True):
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode())
            f.close()
        results.append(subprocess.CompletedProcess([script, *args], codes[pid], *texts))
    return results


def _forked_main(script: str, args: tuple, cwd: Path, env: dict, out: int, err: int) -> None:
    """The child of ``run_forked``: run ``script`` as ``__main__``; never returns to pytest."""
    import runpy
    import traceback

    code = 1
    try:
        os.dup2(out, 1), os.dup2(err, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(child_env(**env))
        # what PYTHONPATH gives a new interpreter (this one read it at its start)
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        import torch

        torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a new process
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def _rank_result(rank: int, fn, world: int, store: str, out: str, args: tuple) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def in_gloo_group(fn, world: int, tmp_path: Path, *args):
    """``fn(rank, world, *args)`` on every rank of a real gloo group of ``world`` processes,
    forks of this one (see ``run_forked_group``); rank 0's result (JSON-able) back here."""
    out = tmp_path / "rank0.json"
    fork_ranks(_rank_result, (fn, world, str(tmp_path / "store"), str(out), args), world)
    return json.loads(out.read_text())
