"""Which checkpoint a run continues from: checkpoints of earlier releases, and the keys that make
another experiment."""

from __future__ import annotations


def test_a_checkpoint_from_before_per_option_schemas_resumes_and_evaluates():
    """That release stored every data option's keys (and every model option's) whatever the
    option: they are not this option's, so they are neither compared nor merged."""
    from ddp_utils.checkpoint.resume import config_changes
    from ddp_utils.config import TrainConfig, as_plain_dict, from_record, to_schema

    stored = as_plain_dict(TrainConfig())
    stored["data"] |= {"root": "data", "download": False, "train_dir": "train", "val_dir": "val",
                       "resize_size": None, "interpolation": "bilinear", "skip_bad_images": False,
                       "_target_": None, "kwargs": {}, "auto_augment": None, "random_erase": 0.0,
                       "train_crop_size": None, "num_train": 8000, "num_val": 2000}  # fmt: skip
    stored["model"] |= {"arch": None, "hidden": 256, "kwargs": {}}
    stored["task"] |= {"kwargs": {}}
    assert config_changes(stored, TrainConfig()) == ([], [])
    assert to_schema(from_record(stored)) == TrainConfig()
    stored["data"]["val_fraction"] = 0.3
    assert config_changes(stored, TrainConfig())[0] == ["data.val_fraction: 0.3 -> 0.2"]


def test_a_custom_targets_arguments_belong_to_the_runs_identity():
    from ddp_utils.checkpoint.resume import config_changes
    from ddp_utils.config import CustomData, TrainConfig, as_plain_dict

    cfg = TrainConfig(data=CustomData(_target_="m.f", kwargs={"limit": 5}))
    stored = as_plain_dict(TrainConfig(data=CustomData(_target_="m.f", kwargs={"limit": 6})))
    assert config_changes(stored, cfg)[0] == ["data.kwargs.limit: 6 -> 5"]


def test_a_checkpoint_from_before_tasks_resumes_as_classification():
    from ddp_utils.checkpoint.resume import config_changes
    from ddp_utils.checkpoint.state import resumed_best
    from ddp_utils.config import TrainConfig, as_plain_dict

    stored = as_plain_dict(TrainConfig())
    del stored["task"]  # the previous release's checkpoints have no task
    assert config_changes(stored, TrainConfig()) == ([], [])
    old = {"best_accuracy": 0.9, "best_ema_accuracy": -1.0, "config": stored}
    assert resumed_best(old, "accuracy") == (0.9, None)
    assert resumed_best(old, "loss") == (None, None)  # another monitor: its best afresh


def test_what_identifies_a_run_is_declared_by_its_options():
    """resume refuses a change of a key the data or task option declares in ``identity``, and
    takes any other (a data option of the user's own extends its parent's declaration)."""
    from dataclasses import dataclass
    from typing import ClassVar

    from ddp_utils.checkpoint.resume import config_changes, identity_keys
    from ddp_utils.config import PyStdlibData, SyntheticData, TrainConfig, as_plain_dict

    cfg = TrainConfig(data=PyStdlibData(tokenizer="bytes", batch_size=8))
    stored = as_plain_dict(TrainConfig(data=PyStdlibData(tokenizer="char", batch_size=4)))
    refused, allowed = config_changes(stored, cfg)
    assert refused == ["data.tokenizer: 'char' -> 'bytes'"]
    assert allowed == ["data.batch_size: 4 -> 8"]

    @dataclass
    class Shapes(SyntheticData):
        identity: ClassVar[tuple[str, ...]] = SyntheticData.identity + ("sides",)
        sides: int = 3

    keys = identity_keys(TrainConfig(data=Shapes()))
    assert {"data.sides", "data.num_train", "seed", "model."} <= set(keys)
    assert "data.batch_size" not in keys
