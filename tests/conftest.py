"""Shared helpers: launching the real entry scripts under torchrun or as one process."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

# The ranks and scripts a test forks (run_forked, run_ranks) compute on one intra-op thread,
# as torchrun's workers do. OpenMP reads this once, when torch loads it: set later, the
# threads a fork starts (gloo's callbacks, where PowerSGD multiplies matrices) would still
# split work over the parent's pool, which a fork does not have, giving other sums each run.
if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS") != "1":
    raise RuntimeError("torch was imported before tests/conftest.py could set OMP_NUM_THREADS=1")
os.environ["OMP_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parents[1]
MNIST_ROOT = ROOT.parent / "shared" / "data" / "mnist10k"

needs_mnist = pytest.mark.skipif(
    not (MNIST_ROOT / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file(),
    reason=f"real MNIST digits not found at {MNIST_ROOT} (only in the project's workspace)",
)


# The longest files first: `make test` runs one file per CPU at a time (xdist --dist
# loadfile), handed out in collection order, so starting with the long ones packs them best.
LONGEST_FIRST = ("test_fsdp2_e2e", "test_resume_e2e", "test_imagefolder_e2e", "test_shards_e2e",
                 "test_accumulation_e2e", "test_detection_e2e", "test_task_shards_e2e",
                 "test_interrupt_e2e",
                 "test_slurm_e2e", "test_strategy_matrix_e2e", "test_trackers_e2e",
                 "test_search_e2e", "test_docs", "test_multinode_sweep_e2e", "test_bench",
                 "test_failures_e2e", "test_full_disk_e2e", "test_segmentation_e2e",
                 "test_relaunch_e2e", "test_recipe_e2e", "test_lm_e2e", "test_train_e2e",
                 "test_user_view", "test_eval_e2e", "test_metrics_e2e", "test_validation_e2e",
                 "test_detfolder_e2e", "test_targets_e2e")  # fmt: skip


def pytest_collection_modifyitems(items: list) -> None:
    def rank(item) -> int:
        name = item.path.stem
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept


def documentation() -> str:
    """The README and every page of docs/, as one text."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


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


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    """A real tmpfs of ``size`` mounted at ``where`` for the block (the test skips where this
    process may not mount one), unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or 'not root'}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (skipped where this process may not mount one)."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


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


def wait_for_step_checkpoint(
    run_dir: Path, proc: subprocess.Popen, after: int = -1, timeout: float = 120
) -> None:
    """Until the running ``proc`` has written a step checkpoint later than step ``after``
    into ``run_dir``."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        steps = [int(p.stem[5:]) for p in (run_dir / "checkpoints").glob("step_*")
                 if p.suffix in (".pt", ".dcp")]  # fmt: skip
        if any(s > after for s in steps):
            return
        time.sleep(0.02)
    raise AssertionError(f"the run ended or stalled before a step checkpoint: {proc.communicate()}")


def params(run_dir: Path, name: str = "last.pt") -> dict:
    """The model state of a run's checkpoint (of ``last.dcp`` for a sharded run)."""
    path = run_dir / "checkpoints" / name
    if not path.exists() and path.with_suffix(".dcp").exists():
        path = path.with_suffix(".dcp")
    return whole_checkpoint(path)["model"]


def whole_checkpoint(path: Path) -> dict:
    """A checkpoint file, or a sharded checkpoint's states gathered whole (torch's converter)."""
    import tempfile

    import torch

    if not path.is_dir():
        return torch.load(path, weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "whole.pt")
        return torch.load(Path(tmp) / "whole.pt", weights_only=True)


def assert_same_params(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def recorded_samples(folder: Path, epoch: int, max_step: int | None = None) -> Counter:
    """How often each sample index was trained on in ``epoch`` (up to ``max_step``), from the
    files the sample recorder wrote into ``folder``."""
    seen: Counter = Counter()
    for path in folder.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["epoch"] == epoch and (max_step is None or r["step"] <= max_step):
                seen.update(r["indices"])
    return seen


def compose_config(*overrides: str, name: str = "train"):
    """The typed config train.py (or eval.py) would get from these overrides."""
    from hydra import compose, initialize_config_dir

    from ddp_utils.config import EvalConfig, TrainConfig, to_schema
    from ddp_utils.entry import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name=name, overrides=list(overrides))
    return to_schema(cfg, EvalConfig if name == "eval" else TrainConfig)


def eval_at_world_sizes(
    checkpoint: Path, out_dir: Path, worlds: tuple[int | None, ...] = (None, 2, 3)
) -> dict[int | None, dict]:
    """eval.py's results for ``checkpoint`` in one process (a fork: None), and as the forked
    ranks of a group at each other world size of ``worlds``."""
    results = {}
    for n in worlds:
        out = out_dir / f"eval{n}.json"
        args = (f"checkpoint={checkpoint}", f"output={out}")
        if n is None:
            assert run_forked("eval.py", *args).returncode == 0
        else:
            run_ranks("eval.py", *args, nproc=n)
        results[n] = json.loads(out.read_text())
    return results


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_malicious_checkpoint(path: Path, marker: Path) -> Path:
    """A .pt whose unpickling would run ``touch marker``: loading it must be refused."""
    path.write_bytes(pickle.dumps({"model": _RunsCode(marker), "config": {}}))
    return path


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
