"""Where checkpoints go and how a save runs, in one process: an fsspec folder (``memory://``)
with commit markers, ``last``/``best`` markers and retention; background saves, their copy
to host memory, and failures reported, retried and counted. The real store (SeaweedFS) and
real processes are tests/test_checkpoint_store_e2e.py's."""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch

from ddp_utils.checkpoint.format import CorruptCheckpointError, load_checkpoint, newest_loadable
from ddp_utils.checkpoint.save import Checkpointer, CheckpointsFailing
from ddp_utils.checkpoint.storage import COMMIT, ObjectStore, open_storage
from ddp_utils.config.schema import CheckpointOptions
from ddp_utils.dist import Runtime
from ddp_utils.logs import LOGGER_NAME

RT = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
_folders = itertools.count()


@pytest.fixture
def url() -> str:
    return f"memory://ckpt-tests/{next(_folders)}"


def state(step: int, value: float = 0.0) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "step": step, "config": {"seed": 0}}


def options(url: str, **values) -> CheckpointOptions:
    return CheckpointOptions(dir=url, **values)


def test_a_step_counts_on_a_store_only_once_its_marker_is_written(url):
    store = open_storage(url)
    assert isinstance(store, ObjectStore) and store.complete() == [] and not store.holds_any()
    store.write_file("step_00000002.pt", state(2))
    assert store.complete() == [] and store.holds_any()  # uploaded, not committed
    assert newest_loadable(store, print) is None
    with pytest.raises(CorruptCheckpointError, match="no commit marker"):
        load_checkpoint(f"{url}/step_00000002.pt")
    store.commit("step_00000002.pt", None, (), keep_last=2)
    assert store.complete() == ["step_00000002.pt"]
    ref, ckpt = newest_loadable(store, print)
    assert ref == f"{url}/step_00000002.pt" and ckpt["step"] == 2


def test_last_and_best_are_markers_and_keep_last_spares_the_best(url):
    store = open_storage(url)
    for step in (1, 2, 3, 4, 5):
        store.write_file(f"step_{step:08d}.pt", state(step, float(step)))
        store.commit(f"step_{step:08d}.pt", None, ("best.pt",) if step == 2 else (), 2)
    store.write_file("step_00000006.pt", state(6))  # a save killed before its marker
    assert store.complete() == ["step_00000005.pt", "step_00000004.pt", "step_00000002.pt"]
    assert load_checkpoint(f"{url}/best.pt")["step"] == 2
    assert load_checkpoint(f"{url}/last.pt")["step"] == 5
    assert store.steps()[-1] == "step_00000006.pt"  # newer than the newest: left alone
    store.write_file("step_00000007.pt", state(7))
    store.commit("step_00000007.pt", None, (), 2)
    # The incomplete step 6 is older than the newest complete one now: removed
    assert store.steps() == ["step_00000002.pt", "step_00000005.pt", "step_00000007.pt"]
    assert not store.fs.exists(store._path("step_00000004.pt" + COMMIT))


def test_a_missing_marker_names_the_url_and_the_marker(url):
    with pytest.raises(Exception, match="best.json"):
        load_checkpoint(f"{url}/best.pt")


def test_a_local_folder_is_the_default_and_keeps_its_names(tmp_path):
    saver = Checkpointer(CheckpointOptions(), tmp_path, RT, keep_last=1)
    assert saver.storage.is_local and saver.storage.where == str(tmp_path / "checkpoints")
    (tmp_path / "checkpoints").mkdir()
    for step in (1, 2):
        saver.save(state(step), ("best.pt",) if step == 1 else (), sharded=False)
    saver.close()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best.pt", "last.pt", "step_00000002.pt"]
    assert torch.load(tmp_path / "checkpoints" / "best.pt")["step"] == 1


@pytest.mark.parametrize("background", [False, True])
def test_a_background_save_writes_what_the_state_was_when_it_was_taken(url, background):
    saver = Checkpointer(options(url, **{"async": background}), None, RT, keep_last=2)
    live = state(1, 1.0)
    saver.save(live, (), sharded=False)
    live["model"]["w"].fill_(99.0)  # the next steps change the live tensors at once
    saver.close()
    assert torch.equal(load_checkpoint(f"{url}/last.pt")["model"]["w"], torch.full((3,), 1.0))
    assert saver.completed() == [f"{url}/step_00000001.pt"]


def test_the_copy_to_host_memory_shares_nothing_with_the_state(url):
    saver = Checkpointer(options(url), None, RT, keep_last=2)
    live = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": {"c": torch.arange(3)}, "n": None}
    copy = saver.staged(live)
    live["a"][0].add_(1)
    live["b"]["c"].zero_()
    assert torch.equal(copy["a"][0], torch.ones(2)) and torch.equal(copy["b"]["c"], torch.arange(3))
    assert isinstance(copy["a"][1], tuple) and copy["a"][1][1] == 3 and copy["n"] is None


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda", True)])
def test_a_gpus_state_is_copied_into_pinned_memory(device, pinned):
    """The CUDA branch's choice, made without a GPU (the options only; no copy)."""
    from ddp_utils.checkpoint.save import staging_options

    chosen = staging_options(torch.device(device))
    assert chosen.use_pinned_memory is pinned and chosen.use_non_blocking_copy is pinned
    assert not chosen.use_shared_memory and not chosen.use_async_staging


class FailingUpload:
    """An upload that fails ``n`` times, then works (a store that comes back)."""

    def __init__(self, store, n: int) -> None:
        self.store, self.left, self.calls = store, n, 0

    def __call__(self, name, value):
        self.calls += 1
        if self.left:
            self.left -= 1
            raise ConnectionError("Could not connect to the endpoint URL")
        type(self.store).write_file(self.store, name, value)


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_save_is_reported_once_and_the_next_one_retries(url, background, caplog):
    saver = Checkpointer(options(url, **{"async": background}), None, RT, keep_last=2)
    saver.storage.write_file = FailingUpload(saver.storage, 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        saver.save(state(1), (), sharded=False)
        saver.save(state(2), (), sharded=False)  # settles the first: reported, counted
        saver.close()
    reports = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(reports) == 1 and "step_00000001.pt" in reports[0]
    assert "Could not connect" in reports[0] and "none yet" in reports[0]
    assert saver.failures == 0 and saver.storage.complete() == ["step_00000002.pt"]


def test_saves_failing_in_a_row_stop_the_run_with_exit_code_75(url):
    saver = Checkpointer(options(url, retries=2), None, RT, keep_last=2)
    saver.save(state(1), (), sharded=False)
    saver.settle()
    saver.storage.write_file = FailingUpload(saver.storage, 5)
    saver.save(state(2), (), sharded=False)
    with pytest.raises(CheckpointsFailing) as stop:
        saver.save(state(3), (), sharded=False)  # settles step 2's failure: 1 of 2
        saver.save(state(4), (), sharded=False)  # settles step 3's: 2 of 2
    assert stop.value.exit_code == 75
    assert f"{url}/step_00000001.pt" in str(stop.value) and "relaunch" in str(stop.value)


def test_a_last_save_that_failed_stops_the_run_at_its_end(url):
    saver = Checkpointer(options(url), None, RT, keep_last=2)
    saver.storage.write_file = FailingUpload(saver.storage, 1)
    saver.save(state(1), (), sharded=False)
    with pytest.raises(CheckpointsFailing, match="last checkpoint could not be written"):
        saver.close()


def test_a_full_disk_stops_at_once_as_it_always_did(tmp_path):
    from ddp_utils.lifecycle.disk import UnwritableError

    saver = Checkpointer(CheckpointOptions(), tmp_path, RT, keep_last=2)

    def full(name, value):
        raise OSError(28, "No space left on device")

    saver.storage.write_file = full
    saver.save(state(1), (), sharded=False)
    with pytest.raises(UnwritableError, match="trainer.checkpoint.dir|run_dir"):
        saver.settle()


def test_the_async_key_is_spelled_as_the_docs_say():
    from ddp_utils.config.schema import CheckpointOptions as C

    assert C().background is True  # measured faster: docs/measurements.md
    assert C(**{"async": False}).background is False
    with pytest.raises(TypeError, match="no key asynk"):
        C(asynk=True)


def test_a_url_given_to_a_tool_is_read_with_the_environments_credentials(url, monkeypatch):
    """eval.py, generate.py and the export read a checkpoint URL as train.py wrote it."""
    store = open_storage(url)
    store.write_file("step_00000003.pt", state(3, 2.0))
    store.commit("step_00000003.pt", None, ("best.pt",), 2)
    ckpt = load_checkpoint(f"{url}/best.pt")
    assert ckpt["step"] == 3 and torch.equal(ckpt["model"]["w"], torch.full((3,), 2.0))
    assert SimpleNamespace(**ckpt).config == {"seed": 0}


def sharded_state(step: int, value: float) -> dict:
    return {"model": {"w": torch.full((4,), value)}, "optimizer": {"m": torch.zeros(2)},
            "step": step, "config": {"seed": 0}, "world_size": 1}  # fmt: skip


@pytest.mark.parametrize("background", [False, True])
def test_a_sharded_checkpoint_on_a_store_commits_after_its_shards(url, background):
    from ddp_utils.checkpoint.format import read_all_shards

    saver = Checkpointer(options(url, **{"async": background}), None, RT, keep_last=1)
    live = sharded_state(3, 1.0)
    saver.save(live, ("best.pt",), sharded=True)
    live["model"]["w"].fill_(7.0)  # the step goes on
    saver.close()
    assert saver.storage.complete() == ["step_00000003.dcp"]
    ckpt = load_checkpoint(f"{url}/best.pt")  # the marker names the folder
    assert ckpt["sharded"] == ["model", "optimizer"] and ckpt["step"] == 3
    assert torch.equal(read_all_shards(ckpt)["model"]["w"], torch.full((4,), 1.0))


def test_a_sharded_save_that_fails_is_reported_and_leaves_no_complete_step(url, tmp_path, caplog):
    from torch.distributed.checkpoint import FileSystemWriter

    saver = Checkpointer(options(url, retries=2), None, RT, keep_last=2)
    saver.save(sharded_state(1, 1.0), (), sharded=True)
    saver.settle()
    (tmp_path / "not-a-folder").write_text("")
    good = saver.storage.shard_writer
    saver.storage.shard_writer = lambda name: FileSystemWriter(tmp_path / "not-a-folder" / name)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        saver.save(sharded_state(2, 2.0), (), sharded=True)
        saver.storage.shard_writer = good  # the store is back
        saver.save(sharded_state(3, 3.0), (), sharded=True)  # reports step 2's failure
        saver.close()
    reports = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(reports) == 1 and "step_00000002.dcp" in reports[0]
    assert saver.storage.complete() == ["step_00000003.dcp", "step_00000001.dcp"]
