"""SLURM for real: a single-node cluster started by examples/slurm/local_cluster.sh, the sbatch
examples, a time-limit warning that requeues and resumes, and the submitit launcher."""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.launch import child_env, run_script
from helpers.paths import ROOT
from helpers.runs import assert_same_params, params, read_metrics

SBIN = os.pathsep.join(["/usr/sbin", "/sbin", os.environ.get("PATH", "")])
CLUSTER = ROOT / "examples" / "slurm" / "local_cluster.sh"
pytestmark = [
    pytest.mark.skipif(
        shutil.which("slurmctld", path=SBIN) is None or shutil.which("munged", path=SBIN) is None,
        reason="slurm-wlm and munge are not installed (apt-get install -y slurm-wlm munge)",
    ),
    pytest.mark.skipif(
        os.geteuid() != 0, reason="the local SLURM cluster starts its daemons as root"
    ),
]
# 72 steps per epoch at 2 processes: room to stop mid-epoch. fp32: parameters compared exactly.
RUN = ("trainer.epochs=2", "data.batch_size=10", "trainer.ckpt_every_steps=10",
       "trainer.precision=32")  # fmt: skip
CPU_NODE = ("--nodes=1", "--gpus-per-node=0")


def controller_ports() -> int:
    """P such that P (slurmctld) and P+1 (slurmd) are free on every interface. Drawn below the
    kernel's ephemeral range, which the torchrun tests of the other worker keep using for their
    own connections (a port free a moment ago could be one of theirs by the time slurmctld
    binds it)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000, 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("", port))
                b.bind(("", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two free neighbouring ports between 20000 and 32000")


def start_cluster(folder: Path) -> tuple[dict[str, str], str]:
    """(environment, "") once the cluster runs, or (environment, what went wrong)."""
    # The project's Python is not on PATH: the sbatch scripts find ROOT/.venv themselves (VENV
    # names it where the tests run from another environment).
    venv = {} if Path(sys.prefix) == ROOT / ".venv" else {"VENV": sys.prefix}
    env = child_env(PATH=os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin", SBIN]),
                    LOCAL_SLURM_PORT=str(controller_ports()),
                    SLURM_CONF=str(folder / "slurm.conf"), **venv)  # fmt: skip
    proc = subprocess.run([CLUSTER, "start", folder], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    if proc.returncode == 0:
        return env, ""
    logs = "".join(f"\n--- {log.name} (end)\n" + "\n".join(log.read_text().splitlines()[-30:])
                   for log in sorted(folder.glob("*.log")))  # fmt: skip
    subprocess.run([CLUSTER, "stop", folder], env=env, timeout=120)
    return env, f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}{logs}"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running single-node cluster; yields the environment its clients need. A start that
    fails is tried once more in a fresh folder on other ports, and reports the daemons' logs."""
    failures = []
    for _ in range(2):
        folder = tmp_path_factory.mktemp("slurm")
        env, failure = start_cluster(folder)
        if not failure:
            break
        failures.append(failure)
    else:
        pytest.fail("the local SLURM cluster did not start:\n" + "\n\n".join(failures))
    if failures:
        print("the first start failed, the second worked:\n" + failures[0])
    try:
        yield env
    finally:
        subprocess.run([CLUSTER, "stop", folder], env=env, timeout=120)


def sbatch(env, *args, wait=True) -> str:
    """Submit from the repository root (as the README says); the job id. With ``wait``,
    return once the job has ended (polled finely: ``sbatch --wait`` polls every few seconds)."""
    cmd = ["sbatch", "--parsable", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip(), proc.stderr
    job = proc.stdout.strip().split(";")[0]
    if wait:
        wait_until(lambda: job_info(env, job)["JobState"] in ENDED, timeout=600,
                   what=f"job {job} to end")  # fmt: skip
    return job


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL")


def job_info(env, job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def node_state(env) -> str:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return out.strip()


def wait_until(predicate, timeout=180, what="the awaited state"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training under plain torchrun, uninterrupted."""
    run = tmp_path_factory.mktemp("reference")
    run_script("train.py", *RUN, f"run_dir={run}", nproc=2)
    return run


@pytest.mark.parametrize(
    "script, resources",
    [
        ("train.sbatch", ("--cpus-per-task=2",)),  # one torchrun agent, NPROC_PER_NODE workers
        ("train_srun.sbatch", ("--ntasks-per-node=2", "--cpus-per-task=1")),  # two srun tasks
    ],
)
def test_sbatch_example_on_a_cpu_node_matches_torchrun(
    slurm, reference, tmp_path, script, resources
):
    env = {**slurm, "NPROC_PER_NODE": "2"} if script == "train.sbatch" else slurm
    job = sbatch(env, *CPU_NODE, *resources, f"--output={tmp_path}/slurm-%j.out",
                 f"examples/slurm/{script}", *RUN, f"run_dir={tmp_path}/run")  # fmt: skip
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert job_info(slurm, job)["JobState"] == "COMPLETED", out
    assert f"job {job} (restart 0): 1 node(s) x 2 " in out
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["run"]  # one run directory
    ours, theirs = read_metrics(tmp_path / "run"), read_metrics(reference)
    assert [r["world_size"] for r in ours] == [2, 2]
    assert ours[-1]["val/accuracy"] == theirs[-1]["val/accuracy"]
    assert_same_params(params(tmp_path / "run"), params(reference))


def test_time_limit_warning_checkpoints_requeues_once_and_resumes_exactly(
    slurm, reference, tmp_path
):
    run = tmp_path / "run"
    env = {**slurm, "NPROC_PER_NODE": "2"}
    job = sbatch(env, *CPU_NODE, "--cpus-per-task=2", f"--output={tmp_path}/slurm-%j.out",
                 "examples/slurm/train.sbatch", *RUN, f"run_dir={run}", wait=False)  # fmt: skip
    wait_until(lambda: list((run / "checkpoints").glob("step_*.pt")), what="a step checkpoint")
    # What SLURM sends at `--signal=B:USR1@180`: SIGUSR1 to the batch shell only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    wait_until(lambda: job_info(slurm, job)["JobState"] == "PENDING", what="the requeue")
    info = job_info(slurm, job)
    assert info["Restarts"] == "1"
    log = (run / "train.log").read_text()
    stop_step = int(log.split("stopped by SIGTERM at step ")[1].split(":")[0])
    stopped = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert stopped["step"] == stop_step < 144
    # A requeued job waits for a begin time about 2 minutes ahead: let it start now, once the
    # node has finished with its first run and a second has passed. Sooner, slurmd refuses the
    # new job credential as revoked (it compares whole seconds: ctime <= revoked).
    wait_until(lambda: node_state(slurm) == "idle", what="the node to be idle again")
    time.sleep(1.5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, check=True)
    wait_until(lambda: job_info(slurm, job)["JobState"] in ENDED, timeout=300,
               what="the requeued run to end")  # fmt: skip
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert job_info(slurm, job)["JobState"] == "COMPLETED", out
    assert out.count("requeueing job") == 1, out
    assert f"job {job} (restart 1)" in out
    assert (
        f"resumed from {run}/checkpoints/step_{stop_step:08d}.pt" in (run / "train.log").read_text()
    )
    assert [r["epoch"] for r in read_metrics(run)] == [0, 1]
    assert_same_params(params(run), params(reference))


def test_a_user_error_is_not_requeued(slurm, tmp_path):
    # srun tasks without torchrun: the job's exit code is train.py's own (torchrun's
    # --max-restarts would retry the failure first, then exit 1).
    job = sbatch(slurm, *CPU_NODE, "--ntasks-per-node=2", "--cpus-per-task=1",
                 f"--output={tmp_path}/slurm-%j.out", "examples/slurm/train_srun.sbatch",
                 "optim.lr=-1", f"run_dir={tmp_path}/run")  # fmt: skip
    info = job_info(slurm, job)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), out
    assert out.count("error: optim.lr=-1.0 is out of range") == 1, out


def test_submitit_sweep_runs_each_job_on_the_cluster(slurm, tmp_path):
    proc = run_script(
        "train.py", "-m", "hydra/launcher=submitit_ddp", "hydra.launcher.nodes=1",
        "hydra.launcher.tasks_per_node=2", "hydra.launcher.gpus_per_node=0",
        "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "optim.lr=0.02,0.05",
        "trainer.epochs=1", cwd=tmp_path, env=slurm, timeout=600,
    )  # fmt: skip
    (sweep,) = (tmp_path / "multirun").iterdir()  # one sweep directory, from the submitter
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(r["overrides"], r["status"]) for r in rows] == [
        ("optim.lr=0.02 trainer.epochs=1", "COMPLETED"),
        ("optim.lr=0.05 trainer.epochs=1", "COMPLETED"),
    ], proc.stdout
    for job in ("0", "1"):
        assert read_metrics(sweep / job)[-1]["world_size"] == 2
    # Each job ran as SLURM tasks: submitit's log of the job names both of them.
    logs = sorted(p.name for p in (sweep / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 4, logs


def test_optuna_sweep_runs_each_trial_as_a_slurm_job(slurm, tmp_path):
    db = tmp_path / "optuna.db"
    run_script(
        "train.py", "-m", "+hparams_search=digits_optuna", "hydra/launcher=submitit_ddp",
        "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
        f"hydra.sweeper.storage=sqlite:///{db}", "trainer.epochs=1", "logger=none",
        cwd=tmp_path, env=slurm, timeout=600,
    )  # fmt: skip
    (sweep,) = (tmp_path / "multirun").iterdir()
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(r["trial"], r["state"]) for r in rows] == [("0", "COMPLETE"), ("1", "COMPLETE")]
    study = json.loads((sweep / "optuna_study.json").read_text())
    assert study["best_trial"]["value"] == max(float(r["value"]) for r in rows)
    for r in rows:  # each trial one SLURM job of 2 tasks, trained with its own parameters
        records = read_metrics(sweep / r["trial"])
        assert records[-1]["world_size"] == 2
        assert f"optim.lr={study['trials'][int(r['trial'])]['params']['optim.lr']!r}" in (
            r["overrides"])  # fmt: skip
