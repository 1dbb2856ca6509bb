"""Playing the Kubernetes operators on one machine: a manifest of examples/kubernetes/ as the
pods it makes, each with the container's command and the environment its operator sets
(the Kubeflow training operator's PET_* variables, which torchrun reads as its flags; a
JobSet's JOB_COMPLETION_INDEX), the service names resolved to 127.0.0.1."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class Pod:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def container(template: dict) -> dict:
    (c,) = template["spec"]["containers"]
    return c


def own_env(c: dict) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in c.get("env", []) if "value" in e}


def pods(manifest: dict, port: int, procs: int | None = None) -> list[Pod]:
    """The pods ``manifest`` makes, in node-rank order; ``procs`` replaces the processes a
    node (GPUs a pod there, one CPU process here)."""
    kind = manifest["kind"]
    if kind == "PyTorchJob":
        return pytorchjob(manifest, port, procs)
    if kind == "TrainJob":
        return trainjob(manifest, port, procs)
    if kind == "JobSet":
        return jobset(manifest, port)
    raise ValueError(f"no operator played for {kind}")


def pytorchjob(m: dict, port: int, procs: int | None) -> list[Pod]:
    """kubeflow.org/v1's: Master is node 0, the Workers follow; an elastic job has Workers
    only and a c10d rendezvous on the first."""
    spec, name = m["spec"], m["metadata"]["name"]
    nproc = str(procs or spec["nprocPerNode"])
    replicas = [(role, k, spec["pytorchReplicaSpecs"][role]["template"])
                for role in ("Master", "Worker") if role in spec["pytorchReplicaSpecs"]
                for k in range(spec["pytorchReplicaSpecs"][role]["replicas"])]  # fmt: skip
    out = []
    for rank, (role, k, template) in enumerate(replicas):
        c = container(template)
        env = {"PET_NPROC_PER_NODE": nproc}
        if "elasticPolicy" in spec:
            policy = spec["elasticPolicy"]
            env |= {"PET_RDZV_BACKEND": policy["rdzvBackend"],
                    "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}", "PET_RDZV_ID": name,
                    "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
                    "PET_MAX_RESTARTS": str(policy["maxRestarts"])}  # fmt: skip
        else:
            env |= {"PET_NNODES": str(len(replicas)), "PET_NODE_RANK": str(rank),
                    "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(len(replicas)), "RANK": str(rank)}  # fmt: skip
        out.append(Pod(f"{name}-{role.lower()}-{k}", c["command"] + c.get("args", []),
                       own_env(c) | env))  # fmt: skip
    return out


def trainjob(m: dict, port: int, procs: int | None) -> list[Pod]:
    """trainer.kubeflow.org's torch-distributed runtime: one pod a node."""
    t, name = m["spec"]["trainer"], m["metadata"]["name"]
    nproc = str(procs or t["numProcPerNode"])
    env = {"PET_NNODES": str(t["numNodes"]), "PET_NPROC_PER_NODE": nproc,
           "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}  # fmt: skip
    return [Pod(f"{name}-node-{k}", t["command"] + t.get("args", []),
                env | {"PET_NODE_RANK": str(k)}) for k in range(t["numNodes"])]  # fmt: skip


def jobset(m: dict, port: int) -> list[Pod]:
    """jobset.x-k8s.io's indexed Job: pod k has JOB_COMPLETION_INDEX=k; the headless service's
    names resolve to this machine."""
    name = m["metadata"]["name"]
    (rjob,) = m["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    c = container(job["template"])
    host = f"{name}-{rjob['name']}-0-0.{name}"
    command = [part.replace(host, "127.0.0.1").replace("29500", str(port))
               for part in c["command"] + c.get("args", [])]  # fmt: skip
    return [Pod(f"{name}-{rjob['name']}-0-{k}", command, {"JOB_COMPLETION_INDEX": str(k)})
            for k in range(job["parallelism"])]  # fmt: skip
