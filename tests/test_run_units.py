"""How a launch without run_dir picks its folder, and what its first line says."""

from __future__ import annotations

import json

from ddp_utils.run import Identity, _default_run_dir, run_identity


def test_a_new_run_beside_an_unfinished_one_of_nearly_the_same_config_names_it(tmp_path):
    from conftest import compose_config

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
    from conftest import compose_config

    a, b = run_identity(compose_config("run_dir=/a")), run_identity(compose_config("run_dir=/b"))
    assert a == b and isinstance(a, Identity) and a.settings["optim.lr"] == 0.1
