"""The run directory that every rank shares (chosen, locked, recorded in run.json), and the
rank-aware files written into it."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ddp_utils.config import ConfigError, UserError
from ddp_utils.dist import (
    Runtime,
    agent_args,
    barrier,
    broadcast_object,
    main_rank_runs,
    read_launch_env,
)
from ddp_utils.files import atomic_write_text
from ddp_utils.lifecycle.disk import UnwritableError, writing_into
from ddp_utils.lifecycle.lock import RunLock


def run_tag(run_id: str) -> str:
    """A short, readable tag of a launcher's run id (a uuid from --standalone is cut to 8)."""
    return run_id if len(run_id) <= 16 else run_id[:8]


RUN_RECORD = "run.json"  # what launched the run, and whether it finished


@dataclass(frozen=True)
class Identity:
    """What makes a relaunch "the same run": the composed config, less where it lives and how
    it resumes, as a digest and as its settings (``optim.lr`` -> 0.1). The world size is no
    part of it: a relaunch on fewer or more processes continues the run (resumes reshard)."""

    digest: str
    settings: dict[str, Any]


def run_identity(cfg: Any) -> Identity:
    plain = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    for key in ("run_dir", "resume"):
        plain.pop(key, None)
    digest = hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()
    return Identity(digest, json.loads(json.dumps(flatten(plain), default=str)))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}`` (lists stay values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat |= flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}")
    return flat


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``key=theirs (here: mine)`` for each setting that differs."""
    keys = sorted(set(mine) | set(theirs))
    return [f"{k}={theirs.get(k)} (here {mine.get(k)})" for k in keys
            if mine.get(k) != theirs.get(k)]  # fmt: skip


def launch_command() -> str:
    """The command line that started this job, as a user would type it again: torchrun's (or
    ddp-run's) when a torchrun agent is this process's parent, else ``python`` and argv."""
    if read_launch_env().launched:
        agent = agent_args()
        for i, arg in enumerate(agent):
            name = Path(arg).name
            if name in ("torchrun", "ddp-run"):
                return shlex.join([name, *agent[i + 1 :]])
            if arg in ("torch.distributed.run", "ddp_utils.launch") and i and agent[i - 1] == "-m":
                return shlex.join(["python", "-m", arg, *agent[i + 1 :]])
    return shlex.join(["python", *sys.argv])


def resume_command(run_dir: Path) -> str:
    """This job's command with ``run_dir=`` naming the run: it resumes from any folder, also
    once a newer run of the same command exists."""
    command = launch_command()
    if f"run_dir={run_dir}" in command:
        return command
    return f"{command} {shlex.quote(f'run_dir={run_dir}')}"


def _read_record(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def write_run_record(run_dir: Path, identity: Identity, finished: bool) -> None:
    """``run.json``: the identity that a relaunch without ``run_dir`` looks for (and its
    settings, to name what differs), the command, and whether the run finished (a finished
    run is not continued by a relaunch)."""
    record = {"identity": identity.digest, "command": launch_command(), "finished": finished,
              "settings": identity.settings}  # fmt: skip
    atomic_write_text(run_dir / RUN_RECORD, json.dumps(record, indent=1) + "\n")


def _default_run_dir(base: Path, run_id: str | None, identity: Identity | None) -> tuple[Path, str]:
    """Where a launch without ``run_dir`` goes, and why (the first line of the log).

    The folder of this launcher run id first (torchrun's restarts of one job share it); else
    the newest run in ``base`` with the same identity, if it has not finished and no live job
    holds it (``--standalone`` and plain ``python`` draw a new id each launch, so this is how
    a relaunch of the same command continues); else a new ``<date>[_<run id>]``.
    """
    tag = run_tag(run_id) if run_id else None
    runs = sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    if tag and (mine := [p for p in runs if p.name.endswith(f"_{tag}")]):
        return mine[-1], f"restarted job: continuing run_dir={mine[-1]}"
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    new = base / (f"{stamp}_{tag}" if tag else stamp)
    for n in range(2, 1000):  # two launches in one second get two folders
        if not new.exists():
            break
        new = base / f"{stamp}_{n}"
    same = [p for p in runs if identity and _read_record(p).get("identity") == identity.digest]
    if not same:
        return new, f"new run: run_dir={new}{_near_run(runs, identity)}"
    newest = same[-1]
    if _read_record(newest).get("finished"):
        return new, (f"new run: run_dir={new} (the newest run of this command and config, "
                     f"{newest}, had finished)")  # fmt: skip
    if RunLock.held(newest):
        return new, (f"new run: run_dir={new} (the newest run of this command and config, "
                     f"{newest}, is still running)")  # fmt: skip
    return newest, (f"resuming the unfinished run of this command and config: run_dir={newest}")


NEAR_SETTINGS = 3  # an unfinished run whose config differs in this many settings or fewer


def _near_run(runs: list[Path], identity: Identity | None) -> str:
    """Where a new run starts beside an unfinished one of nearly the same config (an override
    changed, or a default): the newest such run and what differs, so that a relaunch meant to
    continue it can name it."""
    for run in reversed(runs) if identity else []:
        record = _read_record(run)
        if record.get("finished") or "settings" not in record or RunLock.held(run):
            continue
        differ = differences(identity.settings, record["settings"])
        if 0 < len(differ) <= NEAR_SETTINGS:
            return (f" (not the unfinished run {run}, whose config differs in "
                    f"{', '.join(differ)}: to continue that one, relaunch with "
                    f"run_dir={run})")  # fmt: skip
    return ""


@dataclass
class RunDir:
    path: Path
    created: bool  # this job made the folder, so an early failure may remove it again
    lock: RunLock | None  # the main rank's lock on it
    why: str = ""  # how the folder was chosen (new, continued), for the log's first line


def resolve_run_dir(
    run_dir: str | None, rt: Runtime, identity: Identity | None = None, continue_same: bool = True
) -> RunDir:
    """One folder for all ranks, locked for this job: the main rank names, creates and locks
    it, the others are told (or told why not: every rank then raises the same error).

    Resolving a timestamp on each rank separately would make one folder per rank, so only the
    main rank decides. Every rank must see the folder: ``run_dir`` has to be on a filesystem
    shared by all nodes. Without ``run_dir``, ``identity`` (``run_identity``; None: always a
    new folder) is written to ``run.json``; with ``continue_same``, it finds the unfinished run
    that a relaunch of the same command continues.
    """
    path, created, lock, error, why = None, False, None, None, ""
    if rt.is_main:
        run_id = read_launch_env().run_id
        if run_id == "none":  # torchrun without --rdzv-id or --standalone
            run_id = None
        if run_dir:
            path, why = Path(run_dir), f"run_dir={run_dir}"
        else:
            wanted = identity if continue_same else None
            path, why = _default_run_dir(Path("outputs"), run_id, wanted)
        try:
            created = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
            lock = RunLock.acquire(path)
            if identity is not None:  # the latest launch's, unfinished until it ends
                write_run_record(path, identity, finished=False)
        except UserError as e:
            error = str(e)
        except OSError as e:
            error = (f"run_dir={path} cannot be created or written ({e.strerror or e}); choose "
                     "a writable folder with run_dir=PATH.")  # fmt: skip
    path, created, error, why = broadcast_object((str(path) if path else None, created, error, why))
    if error:
        raise ConfigError(error)
    path = Path(path)
    barrier()
    if not path.is_dir():
        raise ConfigError(
            f"rank {rt.rank} cannot see run_dir={path}: put run_dir on a filesystem that every "
            "node shares (run_dir=/shared/path/...).",
            rank_specific=True,
        )
    return RunDir(path, created, lock, why)


def remove_if_unused(run: RunDir, rt: Runtime) -> None:
    """After a failure before the first training step: remove the folder, if this job
    created it (the config, logs, lock and trackers' files written so far are all it holds);
    a folder that existed before is left as it was."""
    if rt.is_main and run.created:
        shutil.rmtree(run.path, ignore_errors=True)


def write_on_main(run_dir: Path, rt: Runtime, write: Callable[[], Any]) -> None:
    """The main rank calls ``write``; then every rank learns whether it failed for want of
    space or permission, and all stop together with the same ``UnwritableError`` (alone,
    the main rank would exit and leave the others in their next collective)."""

    def attempt() -> str | None:
        try:
            with writing_into(run_dir):
                write()
        except UnwritableError as e:
            return str(e)
        return None

    # The others wait through the store, not a collective: a multi-GB checkpoint written to
    # a slow file system can take longer than trainer.timeout_s.
    error = broadcast_object(main_rank_runs(rt, attempt))
    if error:
        raise UnwritableError(error)


def write_run_files(run_dir: Path, files: dict[str, Callable[[], str]], rt: Runtime) -> None:
    """The main rank writes each ``name: text()`` into ``run_dir`` (config.yaml, env.json,
    classes.json, ...) atomically; an unwritable folder stops every rank together."""

    def write() -> None:
        for name, text in files.items():
            atomic_write_text(run_dir / name, text())

    write_on_main(run_dir, rt, write)


def config_text(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def classes_text(classes: list[str]) -> str:
    """``classes.json``: the class names in label order."""
    return json.dumps(classes, indent=1) + "\n"


def seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux), for the launch-to-first-step figure."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
