"""examples/kubernetes/ without a cluster: each manifest names the fields its operator reads,
and each pod it makes (tests/kube.py plays the operator: its command, the variables the
operator sets, the service names on 127.0.0.1) runs as a process tree here; the pods train
as one job. The manifests' GPU overrides are swapped for a short digits run, and their node
and GPU counts scaled to 2 nodes of one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.launch import child_env, free_port
from helpers.paths import ROOT
from kube import load, pods

KUBE = ROOT / "examples" / "kubernetes"
LOCAL = ("trainer.epochs=1", "logger=none", "trainer.progress=false")
TORCHRUN = f"{sys.executable} -m torch.distributed.run"


def test_each_manifest_names_the_fields_its_operator_reads():
    job = load(KUBE / "pytorchjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    assert job["spec"]["nprocPerNode"] == "8"
    elastic = load(KUBE / "pytorchjob-elastic.yaml")
    assert set(elastic["spec"]["elasticPolicy"]) == {"rdzvBackend", "minReplicas",
                                                     "maxReplicas", "maxRestarts"}  # fmt: skip
    assert set(elastic["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    train = load(KUBE / "trainjob.yaml")
    assert (train["apiVersion"], train["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert train["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert {"image", "numNodes", "numProcPerNode", "command", "args"} <= set(
        train["spec"]["trainer"]
    )
    jobset = load(KUBE / "jobset.yaml")
    (rjob,) = jobset["spec"]["replicatedJobs"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    assert rjob["template"]["spec"]["completionMode"] == "Indexed"
    for manifest in (job, elastic, train):
        for pod in pods(manifest, 29500):
            assert pod.command[:2] == ["torchrun", "train.py"], pod


def scaled(name: str) -> dict:
    """The manifest at 2 nodes (its one place for the node count)."""
    m = load(KUBE / name)
    if m["kind"] == "PyTorchJob":
        m["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1
    elif m["kind"] == "TrainJob":
        m["spec"]["trainer"]["numNodes"] = 2
    else:
        job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
        job["parallelism"] = job["completions"] = 2
    return m


def local(command: list[str], run) -> list[str]:
    """The pod's command with this machine's interpreter, one process a node, and the short
    run's overrides in place of the manifest's."""
    if command[0] == "bash":  # a JobSet's shell line: its flags stay, its node count scaled
        line = command[2].split(" train.py ")[0].replace("torchrun", TORCHRUN)
        line = line.replace("--nnodes=4", "--nnodes=2").replace("--nproc_per_node=8",
                                                                  "--nproc_per_node=1")  # fmt: skip
        return ["bash", "-c", f"{line} {ROOT / 'train.py'} {' '.join(LOCAL)} run_dir={run}"]
    assert command[:2] == ["torchrun", "train.py"]
    return [*TORCHRUN.split(), str(ROOT / "train.py"), *LOCAL, f"run_dir={run}"]


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "trainjob.yaml", "jobset.yaml"])
def test_the_pods_an_operator_starts_train_as_one_job(name, tmp_path):
    run = tmp_path / "run"
    procs = []
    for pod in pods(scaled(name), free_port(), procs=1):
        env = child_env(**pod.env)
        procs.append(subprocess.Popen(local(pod.command, run), cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(o[-2000:] for o in outs)
    log = (run / "train.log").read_text()
    assert "| world size 2 |" in log and (run / "checkpoints" / "last.pt").exists()


def test_the_dockerfile_copies_what_exists_and_installs_known_extras():
    """No image is built here (no docker, no network): what it copies is in the project, and
    the extras it installs are pyproject's."""
    import re

    import tomllib

    text = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for path in line.split()[:-1]:
            assert (ROOT / path).exists(), path
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]  # fmt: skip
    (wanted,) = re.findall(r"pip install -e '\.\[([a-z0-9,]+)\]'", text)
    assert set(wanted.split(",")) <= set(extras)


def test_a_pod_killed_and_restarted_by_the_operator_resumes_the_job(tmp_path):
    """A Worker pod's whole tree SIGKILLed mid-run: the Master's torchrun fails with it; the
    operator restarts both (restartPolicy: OnFailure), with the same variables, and the job
    resumes from run_dir's newest checkpoint and finishes."""
    import signal

    from helpers.runs import wait_for_step_checkpoint

    run, port = tmp_path / "run", free_port()
    longer = ("trainer.epochs=3", "trainer.ckpt_every_steps=3", "data.batch_size=20")

    def start(pod):
        cmd = [*local(pod.command, run), *longer]
        return subprocess.Popen(cmd, cwd=ROOT, env=child_env(**pod.env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip

    master, worker = pods(scaled("pytorchjob.yaml"), port, procs=1)
    first = [start(master), start(worker)]
    wait_for_step_checkpoint(run, first[0])
    os.killpg(first[1].pid, signal.SIGKILL)
    first[1].wait()
    assert first[0].wait(timeout=120) != 0  # its peer is gone: the Master's pod fails too
    again = [start(master), start(worker)]
    outs = [p.communicate(timeout=300)[0] for p in again]
    assert all(p.returncode == 0 for p in again), "\n---\n".join(o[-2000:] for o in outs)
    assert "resumed from" in (run / "train.log").read_text()
