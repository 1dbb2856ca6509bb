"""Several torchrun agents with c10d rendezvous, network namespaces, and Hydra sweeps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest
from helpers.launch import child_env, command, free_port, run_ranks, run_script
from helpers.paths import ROOT
from helpers.runs import read_metrics

TRAIN = ("trainer.epochs=2", "data.batch_size=50")


def agent_cmd(endpoint: str, run_id: str, *args: str, extra: tuple = ()) -> list[str]:
    launcher = ("--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id}", *extra)  # fmt: skip
    cmd = command("train.py", (*TRAIN, *args), nproc=1, launcher=launcher)
    cmd.remove("--standalone")
    return cmd


def run_agents(cmds: list[list[str]], cwd, envs: list[dict] | None = None) -> None:
    envs = envs or [{} for _ in cmds]
    procs = [
        subprocess.Popen(
            c,
            cwd=cwd,
            env=child_env(**e),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for c, e in zip(cmds, envs, strict=True)
    ]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-5000:]


@pytest.fixture(scope="module")
def one_agent_two_procs(tmp_path_factory):
    run = tmp_path_factory.mktemp("one_agent") / "run"
    run_ranks("train.py", *TRAIN, f"run_dir={run}", nproc=2)
    return read_metrics(run)


def test_two_agents_train_as_one_job(tmp_path, one_agent_two_procs):
    run_id = f"job{uuid.uuid4().hex[:6]}"
    endpoint = f"127.0.0.1:{free_port()}"
    run_agents([agent_cmd(endpoint, run_id), agent_cmd(endpoint, run_id)], cwd=tmp_path)
    runs = list((tmp_path / "outputs").iterdir())
    assert len(runs) == 1 and runs[0].name.endswith(run_id)  # named from --rdzv-id
    run = runs[0]
    assert "world size 2" in (run / "train.log").read_text()
    records = read_metrics(run)
    assert [r["epoch"] for r in records] == [0, 1]  # written once, not once per node
    assert all(r["world_size"] == 2 for r in records)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "best.pt", "last.pt", "step_00000014.pt", "step_00000028.pt"
    ]  # fmt: skip
    assert records[-1]["val/accuracy"] == one_agent_two_procs[-1]["val/accuracy"]


def _can_make_netns() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"ddpprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.231.7.1 and 10.231.7.2."""
    tag = f"{os.getpid() % 10000}"
    names, addrs = [f"ddpa{tag}", f"ddpb{tag}"], ["10.231.7.1", "10.231.7.2"]
    veth = [f"vda{tag}", f"vdb{tag}"]

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for n in names:
            ip("netns", "add", n)
        ip("link", "add", veth[0], "netns", names[0], "type", "veth", "peer", "name", veth[1],
           "netns", names[1])  # fmt: skip
        for n, v, a in zip(names, veth, addrs, strict=True):
            ip("-n", n, "addr", "add", f"{a}/24", "dev", v)
            ip("-n", n, "link", "set", v, "up")
            ip("-n", n, "link", "set", "lo", "up")
        yield list(zip(names, addrs, veth, strict=True))
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


@pytest.mark.skipif(not _can_make_netns(), reason="cannot create network namespaces here")
def test_two_agents_in_two_network_namespaces(tmp_path, two_hosts, one_agent_two_procs):
    (ns_a, addr_a, _), _ = two_hosts
    endpoint, run_id = f"{addr_a}:{free_port()}", f"ns{uuid.uuid4().hex[:6]}"
    run = tmp_path / "run"
    # The host name resolves to no namespace's address: each agent names its own address
    # (--local-addr, which becomes MASTER_ADDR), the first one hosts the rendezvous store,
    # and gloo is told which interface to use.
    cmds, envs = [], []
    for ns, addr, dev in two_hosts:
        extra = (f"--rdzv-conf=is_host={int(ns == ns_a)}", f"--local-addr={addr}")
        cmds.append(["ip", "netns", "exec", ns, *agent_cmd(endpoint, run_id, f"run_dir={run}",
                                                           extra=extra)])  # fmt: skip
        envs.append({"GLOO_SOCKET_IFNAME": dev})
    run_agents(cmds, cwd=ROOT, envs=envs)
    records = read_metrics(run)
    assert [r["world_size"] for r in records] == [2, 2]
    assert records[-1]["val/accuracy"] == one_agent_two_procs[-1]["val/accuracy"]


def _summary(sweep_root):
    (sweep,) = list(sweep_root.iterdir())
    return sweep, json.loads((sweep / "summary.json").read_text())


def test_sweep_under_torchrun_runs_each_job_on_all_ranks_and_reports_a_failed_one(tmp_path):
    # Job 0 is a mistake: every rank fails it alike and goes on in step with the others.
    proc = run_script("train.py", "-m", "optim.lr=-1,0.05,0.01", "trainer.epochs=1",
                      nproc=2, cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    sweep, rows = _summary(tmp_path / "multirun")
    # Written by global rank 0 even when the other rank finishes the sweep first.
    assert [r["status"] for r in rows] == ["FAILED", "COMPLETED", "COMPLETED"], proc.stderr[-3000:]
    assert [r["overrides"][0] for r in rows] == ["optim.lr=-1", "optim.lr=0.05", "optim.lr=0.01"]
    assert "optim.lr" in rows[0]["error"]
    assert all(r["world_size"] == 2 for r in rows[1:])
    assert rows[1]["val/accuracy"] != rows[2]["val/accuracy"]
    for job in ("1", "2"):
        assert len(read_metrics(sweep / job)) == 1  # one folder per job, shared by both ranks
    assert sorted(p.name for p in sweep.iterdir()) == [
        "0", "1", "2", "multirun.yaml", "summary.csv", "summary.json"
    ]  # fmt: skip
    assert proc.stdout.count("sweep summary") == 1
    assert proc.stdout.count("Launching 3 jobs") == 1  # Hydra's messages from rank 0 only
    end = f"error: 1 of 3 sweep jobs failed; see multirun/{sweep.name}/summary.csv"
    lines = proc.stderr.splitlines()
    assert lines.count(end) == 1 and "Traceback" not in proc.stderr.split(end)[0]  # once


def test_a_sweep_whose_jobs_all_fail_before_training_still_ends_together(tmp_path):
    # No job joined the process group: the ranks meet in one made for the end of the sweep.
    proc = run_script("train.py", "-m", "optim.lr=-1,-2", nproc=2, cwd=tmp_path, check=False)
    sweep, rows = _summary(tmp_path / "multirun")
    assert [r["status"] for r in rows] == ["FAILED", "FAILED"], proc.stderr[-3000:]
    end = f"error: 2 of 2 sweep jobs failed; see multirun/{sweep.name}/summary.csv"
    assert proc.stderr.splitlines().count(end) == 1, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr  # rank 0's code: a configuration mistake


def test_sweep_with_the_torchrun_launcher_runs_each_job_as_a_torchrun_job(tmp_path):
    proc = run_script("train.py", "-m", "hydra/launcher=torchrun",
                      "hydra.launcher.nproc_per_node=2", "optim.lr=0.05,0.01",
                      "trainer.epochs=1", cwd=tmp_path)  # fmt: skip
    _, rows = _summary(tmp_path / "multirun")
    assert [(r["status"], r["world_size"]) for r in rows] == [("COMPLETED", 2)] * 2
    assert "optim.lr=0.01" in proc.stdout
