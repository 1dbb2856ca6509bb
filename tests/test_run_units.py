"""How a launch without run_dir picks its folder, and what its first line says."""

from __future__ import annotations

import json

from ddp_utils.run.folder import Identity, _default_run_dir, run_identity


def test_a_new_run_beside_an_unfinished_one_of_nearly_the_same_config_names_it(tmp_path):
    from helpers.runs import compose_config

    mine = run_identity(compose_config("optim.lr=0.05"))
    theirs = run_identity(compose_config())
    old = tmp_path / "2026-12-01_10-00-00"
    old.mkdir()
    record = {"identity": theirs.digest, "finished": False, "settings": theirs.settings}
    (old / "run.json").write_text(json.dumps(record))
    path, why = _default_run_dir(tmp_path, None, mine)
    assert path != old and why.startswith(f"new run: run_dir={path} (not the unfinished run {old}")
    assert "optim.lr=0.1 (here 0.05)" in why and f"relaunch with run_dir={old}" in why
    # the same config continues it; a finished one is not named; a far one is not named
    assert _default_run_dir(tmp_path, None, theirs)[0] == old
    far = run_identity(compose_config("optim.lr=0.05", "seed=3", "model=mlp", "trainer.epochs=2"))
    assert "not the unfinished run" not in _default_run_dir(tmp_path, None, far)[1]
    (old / "run.json").write_text(json.dumps(record | {"finished": True}))
    path, why = _default_run_dir(tmp_path, None, mine)
    assert why == f"new run: run_dir={path}"


def test_the_identity_ignores_where_the_run_lives():
    from helpers.runs import compose_config

    a, b = run_identity(compose_config("run_dir=/a")), run_identity(compose_config("run_dir=/b"))
    assert a == b and isinstance(a, Identity) and a.settings["optim.lr"] == 0.1


def test_an_elastic_launch_sharing_torchruns_store_is_warned_about():
    from ddp_utils.dist import nnodes_of, shared_store_warning

    assert nnodes_of(["--nnodes=1:2", "train.py"]) == (1, 2)
    assert nnodes_of(["--nnodes", "4", "train.py"]) == (4, 4)
    assert nnodes_of(["--standalone", "train.py"]) is None
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    warning = shared_store_warning(shared, ["--nnodes=1:2", "--rdzv-backend=c10d"])
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning and "--nnodes=1:2" in warning
    # its own store each attempt (the variable set), or one node: nothing to say
    assert shared_store_warning({}, ["--nnodes=1:2"]) is None
    assert shared_store_warning(shared, ["--standalone", "--nproc_per_node=2"]) is None


def test_ddp_run_gives_multi_node_launches_a_store_of_their_own(monkeypatch):
    import os

    from ddp_utils import launch

    seen = {}
    # a copy of the environment, put back after the test
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})  # fmt: skip
    monkeypatch.setattr(launch, "torchrun", lambda argv: seen.update(
        value=os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")))  # fmt: skip
    launch.main(["--standalone", "--nproc_per_node=2", "train.py"])
    assert seen["value"] is None
    launch.main(["--nnodes=1:2", "--rdzv-backend=c10d", "train.py"])
    assert seen["value"] == "1"


def test_a_rank_under_an_agent_with_restarts_left_is_told_it_restarts():
    from ddp_utils.dist import restart_note

    note = restart_note({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert "torchrun restarts the workers (2 of its --max-restarts left)" in note
    assert (
        restart_note({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "3"}) is None
    )
    assert restart_note({}) is None
