"""Config composition: every option of every group composes and validates; mistakes fail."""

from __future__ import annotations

from dataclasses import fields

import pytest
from helpers.paths import ROOT, documentation
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from ddp_utils.config import (
    ConfigError,
    EvalConfig,
    TrainConfig,
    option_schema,
    options_help,
    to_schema,
)
from ddp_utils.entry import register
from ddp_utils.train.state import split_global_batch

register()
GROUPS = ("model", "data", "optim", "sched", "trainer", "experiment")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))


def compose_train(*overrides: str, name: str = "train"):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in options(g)], ids=lambda v: str(v)
)
def test_every_option_composes_and_validates(group, option):
    required = {
        ("data", "custom"): ["data._target_=imagefolders.digits_datasets"],
        ("model", "custom"): ["model._target_=ddp_utils.models.nets.MLP"],
        ("optim", "custom"): ["optim._target_=torch.optim.RMSprop", "+optim.alpha=0.9"],
        ("sched", "custom"): [
            "sched._target_=torch.optim.lr_scheduler.ExponentialLR",
            "+sched.gamma=0.99",
        ],
        ("data", "tokens"): ["model=gpt", "task=language_model"],
        ("data", "sft"): ["model=hf", "model.pretrained=x", "task=language_model", "data.root=x"],
        ("experiment", "sft"): ["model.pretrained=x", "data.root=x"],
        ("data", "pystdlib"): ["model=gpt", "task=language_model"],
        ("data", "digits_det"): ["model=tiny_det", "task=detection"],
        ("data", "voc_det"): ["model=tiny_det", "task=detection"],
        ("data", "detshards"): ["model=tiny_det", "task=detection", "data.num_classes=3"],
        ("data", "detfolder"): [
            "model=tiny_det",
            "task=detection",
            "data.root=x",
            "data.num_classes=3",
        ],
        **{
            ("data", seg): ["model=seg_convnet", "task=segmentation"]
            for seg in ("digits_seg", "mnist_seg", "segfolder", "voc", "segshards")
        },
    }.get((group, option), [])
    cfg = to_schema(compose_train(f"{group}={option}", *required))
    assert isinstance(cfg, TrainConfig)
    if group in ("model", "data", "optim", "sched"):
        assert getattr(cfg, group).name == option


def test_defaults_are_the_embedded_digits_with_the_tutorial_convnet():
    cfg = to_schema(compose_train())
    assert (cfg.data.name, cfg.model.name, cfg.optim.name) == ("digits", "convnet", "sgd")
    assert cfg.data.batch_size == 100 and cfg.run_dir is None


def test_experiment_overrides_groups():
    cfg = to_schema(compose_train("experiment=mnist_convnet"))
    assert cfg.data.name == "mnist" and cfg.data.image_size == 28 and cfg.trainer.epochs == 2


@pytest.mark.parametrize("recipe", options("experiment"))
def test_every_recipe_states_its_global_batch_and_learning_rate(recipe):
    """A recipe's unit is its global batch: it trains the same steps at 1, 2 or 8 processes
    (accumulating where a process's share exceeds data.batch_size), and its YAML says the
    global batch and the learning rate it was set with."""
    composed = compose_train(f"experiment={recipe}")
    if "root" in composed.data:
        composed.data.root = "unused"
    if "pretrained" in composed.model:  # experiment=sft: a model folder of the user's
        composed.model.pretrained = "unused"
    cfg = to_schema(composed)
    text = (ROOT / "conf" / "experiment" / f"{recipe}.yaml").read_text()
    assert cfg.data.global_batch_size is not None, recipe
    assert f"global batch of {cfg.data.global_batch_size}" in text, recipe
    assert "lr" in text, recipe
    for world in (1, 2, 8):
        batch, accum = split_global_batch(cfg.data.global_batch_size, world, cfg.data.batch_size)
        assert batch * accum * world == cfg.data.global_batch_size


@pytest.mark.parametrize("option,keys", [
    ("data=digits", ("data.batch_size", "data.num_workers", "data.val_fraction", "optim.lr",
                     "trainer.epochs", "trainer.max_steps", "trainer.precision",
                     "trainer.ddp.sync_bn",
                     "trainer.grad_accum_steps", "trainer.grad_clip", "trainer.compile",
                     "trainer.device", "trainer.backend", "seed", "run_dir")),
    ("data=mnist", ("data.root", "data.download", "data.val_slice")),
    ("data=imagefolder", ("data.root", "data.train_dir", "data.skip_bad_images")),
])  # fmt: skip
def test_public_keys_exist(option, keys):
    cfg = compose_train(option)
    for key in keys:
        group, _, leaf = key.rpartition(".")
        assert leaf in (OmegaConf.select(cfg, group) if group else cfg), key


def test_unknown_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as e:
        compose_train("trainer.epoch=3")
    assert "epoch" in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("override", ["+optim.lrr=0.1", "+trainer.foo.bar=1", "+nope=1",
                                      "+model.depth=3"])  # fmt: skip
def test_a_key_added_with_plus_that_the_schema_lacks_is_refused(override):
    key = override[1:].split("=")[0]
    with pytest.raises(ConfigError, match=f"{key.split('.foo')[0]}"):
        to_schema(compose_train(override))


def test_plus_keys_are_the_arguments_of_a_custom_target():
    cfg = to_schema(compose_train("model=custom", "model._target_=m.Net", "+model.depth=3"))
    assert cfg.model.kwargs == {"depth": 3}


def test_job_identity_is_what_survives_restarts_and_requeues():
    from ddp_utils.lifecycle.lock import job_identity

    assert job_identity({"SLURM_JOB_ID": "42", "TORCHELASTIC_RUN_ID": "x"}) == "slurm:42"
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}
    assert job_identity(torchrun) == "torchrun:abc"
    assert job_identity({}).startswith("process:")


def test_hydra_errors_read_as_one_paragraph():
    from ddp_utils.entry import hydra_error_paragraph

    for override, expected in [
        ("optim.lrr=1", "optim.lrr is not a key of optim=sgd; check its spelling"),
        ("model=nope", "model=nope is not an option; the options of model are: convnet"),
    ]:
        with pytest.raises(ConfigCompositionException) as e:
            compose_train(override)
        text = hydra_error_paragraph(e.value)
        assert expected in text and "\n" not in text and "+optim.lrr" not in text


def test_wrong_type_fails_naming_the_key():
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError)) as e:
        compose_train("optim.lr=fast")
    assert "lr" in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize(
    "override,key",
    [
        ("optim.lr=0", "optim.lr"),
        ("optim.lr=-0.1", "optim.lr"),
        ("data.batch_size=0", "data.batch_size"),
        ("trainer.precision=fp8", "trainer.precision"),
        ("trainer.device=tpu", "trainer.device"),
        ("trainer.grad_accum_steps=0", "trainer.grad_accum_steps"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("data.in_channels=3", "data.in_channels"),
        ("data.image_size=2", "data.image_size"),
        ("sched.pct_start=1.5", "sched.pct_start"),
        ("optim.nesterov=true optim.momentum=0", "optim.nesterov"),
    ],
)
def test_bad_values_raise_value_error_naming_the_key(override, key):
    with pytest.raises(ValueError) as e:
        to_schema(compose_train(*override.split()))
    assert isinstance(e.value, ConfigError)
    assert key in str(e.value)


def test_precision_accepts_a_number():
    assert to_schema(compose_train("trainer.precision=32")).trainer.precision == "32"


def test_eval_config_requires_a_checkpoint():
    cfg = compose_train("checkpoint=x.pt", name="eval")
    assert isinstance(to_schema(cfg, EvalConfig), EvalConfig)


SCHEMA_GROUPS = ("data", "model", "task")


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in SCHEMA_GROUPS for o in options(g)], ids=lambda v: str(v)
)
def test_each_option_composes_onto_its_own_schema_with_only_its_keys(group, option):
    node = compose_train(f"{group}={option}")[group]
    schema = option_schema(group, option)
    assert OmegaConf.get_type(node) is schema
    assert list(node) == [f.name for f in fields(schema)]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data=synthetic", "data.train_dir=x"],
         "data.train_dir is not a key of data=synthetic: it belongs to data=imagefolder | "
         "shards | segfolder | segshards | detshards. Pick"),
        (["data.root=/data"], "data.root is not a key of data=digits: it belongs to data=mnist |"
         " fashion_mnist | cifar10 | imagefolder"),
        (["data=cifar10", "data.val_fraction=0.1"],
         "data.val_fraction is not a key of data=cifar10: it belongs to data=digits"),
        (["model=mlp", "model.arch=resnet18"],
         "model.arch is not a key of model=mlp: it belongs to model=resnet18 | torchvision | timm"),
        (["model=resnet18", "model.hidden=3"],
         "model.hidden is not a key of model=resnet18: it belongs to model=mlp"),
        (["task.kwargs={}"], "task.kwargs is not a key of task=classification: it belongs to "
         "task=custom"),
        (["data=imagefolder", "data.batchsize=3"], "data.batchsize is not a key of "
         "data=imagefolder; check its spelling (python train.py --help lists each option's keys)"),
    ],
)  # fmt: skip
def test_a_key_of_another_option_is_refused_by_name_at_composition(overrides, message):
    from ddp_utils.entry import hydra_error_paragraph

    with pytest.raises(ConfigCompositionException) as e:
        compose_train(*overrides)
    assert message in hydra_error_paragraph(e.value, overrides)


def test_a_key_added_with_plus_to_another_option_is_refused_by_name():
    with pytest.raises(ConfigError, match="data.num_train is not a key of data=imagefolder: it "
                       "belongs to data=synthetic"):  # fmt: skip
        to_schema(compose_train("data=imagefolder", "+data.num_train=3"))
    with pytest.raises(ConfigError, match="names another option than the one composed"):
        to_schema(compose_train("data.name=mnist"))


def test_help_and_readme_list_each_options_own_keys():
    text = options_help()
    assert "  data=digits: val_fraction split_seed val_slice" in text
    assert "  data=synthetic: num_train num_val" in text
    assert "  model=mlp: hidden" in text and "  task=custom: +task.NAME=VALUE" in text
    assert f"```text\n{text}\n```" in documentation()


def test_eval_composes_with_the_checkpoints_own_options(tmp_path):
    import torch

    from ddp_utils.config import CustomTask, ImageFolderData, TrainConfig, as_plain_dict
    from ddp_utils.entry import checkpoint_options

    stored = as_plain_dict(TrainConfig(data=ImageFolderData(), task=CustomTask(_target_="m.T")))
    torch.save({"model": {}, "config": stored}, tmp_path / "c.pt")
    ckpt = f"checkpoint={tmp_path}/c.pt"
    assert checkpoint_options([ckpt, "data.root=/x"]) == [
        "data=imagefolder", "model=convnet", "task=custom",
    ]  # fmt: skip
    assert checkpoint_options([ckpt, "data=mnist", "+task=classification"]) == ["model=convnet"]
    assert checkpoint_options(["data.root=/x"]) == []
    with pytest.raises(ConfigError, match="no such file"):
        checkpoint_options([f"checkpoint={tmp_path}/nope.pt"])


def test_data_and_task_pair_by_what_they_declare_not_by_name():
    """Issue 34: a new kind of data and the task that takes it pair through their
    declarations (``holds``, ``takes``), with no edit to the core's check."""
    from dataclasses import dataclass
    from typing import ClassVar

    from ddp_utils.config import DataConfig, DigitsData, TaskConfig
    from ddp_utils.config.schema import check_pairing

    @dataclass
    class BoxData(DataConfig):
        holds: ClassVar[str] = "boxes"
        wrong_task: ClassVar[str] = "data={data} holds boxes: use task=boxes."

    @dataclass
    class BoxTask(TaskConfig):
        takes: ClassVar[str | None] = "boxes"
        other_data: ClassVar[str] = "task=boxes needs box data (this is data={data})."

    check_pairing(TrainConfig(data=BoxData(name="mine"), task=BoxTask(name="boxes")))
    with pytest.raises(ConfigError, match=r"^data=mine holds boxes: use task=boxes\.$"):
        check_pairing(TrainConfig(data=BoxData(name="mine")))  # the classification task
    with pytest.raises(ConfigError, match=r"^task=boxes needs box data \(this is data=digits"):
        check_pairing(TrainConfig(data=DigitsData(), task=BoxTask(name="boxes")))


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.ddp.comm_hook=topk", "comm_hook='topk' is not one of fp16, bf16, powersgd"),
        ("trainer.ddp.powersgd_rank=0", r"trainer.ddp.powersgd_rank"),
        ("trainer.ddp.powersgd_start_iter=1", r"powersgd_start_iter=1: .* set 2 or more"),
    ],
)
def test_ddps_communication_keys_are_checked_by_name(override, message):
    with pytest.raises(ConfigError, match=message):
        to_schema(compose_train(override))
    cfg = to_schema(compose_train("trainer.ddp.comm_hook=powersgd"))
    assert (cfg.trainer.ddp.powersgd_rank, cfg.trainer.ddp.powersgd_start_iter) == (1, 10)


def test_the_old_flat_ddp_keys_still_work_with_one_line_naming_the_new_key(capsys):
    t = to_schema(compose_train("trainer.sync_bn=true", "trainer.bucket_cap_mb=50",
                                "trainer.static_graph=false")).trainer  # fmt: skip
    assert t.ddp.sync_bn is True and t.ddp.bucket_cap_mb == 50 and t.ddp.static_graph is False
    assert (t.sync_bn, t.bucket_cap_mb, t.static_graph) == (None, None, None)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "warning: trainer.sync_bn is deprecated and will be removed in the next release; use "
        "trainer.ddp.sync_bn=true (taken for this run)",
        "warning: trainer.bucket_cap_mb is deprecated and will be removed in the next release; "
        "use trainer.ddp.bucket_cap_mb=50 (taken for this run)",
    ]  # a value equal to the default (what older checkpoints stored) says nothing
    assert to_schema(compose_train("trainer.ddp.sync_bn=true")).trainer.ddp.sync_bn is True
    assert capsys.readouterr().err == ""


def test_activation_checkpointing_has_its_own_units_and_takes_fsdp_wrap_once_with_a_warning(
    capsys,
):
    units = "trainer.activation_checkpointing_units=[Block]"
    own = to_schema(compose_train("trainer.activation_checkpointing=true", units)).trainer
    assert own.activation_checkpointing_units == ["Block"] and own.fsdp.wrap is None
    old = to_schema(compose_train("trainer.activation_checkpointing=true",
                                  "trainer.fsdp.wrap=[Block]")).trainer  # fmt: skip
    assert old.activation_checkpointing_units == ["Block"]
    assert "use trainer.activation_checkpointing_units=['Block']" in capsys.readouterr().err


@pytest.mark.parametrize("task, holds", [("segmentation", "masks"), ("detection", "boxes"),
                                         ("language_model", "tokens")])  # fmt: skip
def test_the_data_a_task_asks_for_is_every_option_that_holds_it(task, holds):
    """Derived from what each data option ``holds``: the shard options are named too."""
    with pytest.raises(ConfigError) as e:
        to_schema(compose_train(f"task={task}"))
    named = str(e.value).split("data=", 1)[1].split(" (this is")[0].split(" | ")
    assert sorted(named) == [o for o in options("data") if option_schema("data", o).holds == holds]
    assert any("shards" in o for o in named) or holds == "tokens"
