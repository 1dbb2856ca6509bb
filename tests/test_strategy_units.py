"""Strategy units with a patched runtime: where fsdp2 builds the model (the main rank whole,
every other rank on the meta device, a model that cannot be built there whole with a
warning)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from helpers.runs import compose_config
from torch import nn

from ddp_utils.config import ConfigError, TrainerConfig
from ddp_utils.dist import Runtime
from ddp_utils.models.nets import ConvNet
from ddp_utils.strategy.fsdp2 import FSDP2Strategy


def fsdp2(rank: int) -> FSDP2Strategy:
    return FSDP2Strategy(TrainerConfig(), Runtime(rank, rank, 2, 2, torch.device("cpu"), "gloo"))


def test_fsdp2_builds_the_model_whole_on_the_main_rank_only():
    def make() -> nn.Module:
        return ConvNet(in_channels=1, image_size=8, num_classes=10)

    main, other = fsdp2(0).build(make), fsdp2(1).build(make)
    assert not any(p.is_meta for p in main.parameters())
    assert all(t.is_meta for t in [*other.parameters(), *other.buffers()])


class NeedsValues(nn.Module):
    """A model whose own code reads a value at construction (as some timm models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.width = int(torch.tensor(8.0).item())
        self.fc = nn.Linear(4, self.width)


def test_a_model_that_cannot_be_built_on_meta_is_built_whole_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        model = fsdp2(1).build(NeedsValues)
    assert not model.fc.weight.is_meta and model.fc.weight.shape == (8, 4)
    assert "could not be built on the meta device" in caplog.text


def test_a_users_mistake_in_the_model_is_raised_as_on_the_main_rank(caplog):
    def make() -> nn.Module:
        raise ConfigError("model.width=-1: give a positive width.")

    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match="model.width"):
        fsdp2(1).build(make)
    assert "meta device" not in caplog.text


def test_units_skip_containers_without_a_forward():
    """fully_shard refuses a ModuleList: its modules are the units instead (the segmentation
    ConvNet keeps its stages in one)."""
    from ddp_utils.config import DigitsSegData, SegConvNetModel
    from ddp_utils.models import build_model
    from ddp_utils.strategy.base import model_units

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))])
            self.heads = nn.ModuleDict({"a": nn.Linear(2, 1)})
            self.head = nn.Linear(2, 2)

    net = Net()
    units = model_units(net, None, "trainer.fsdp.wrap")
    assert units == [net.stages[0], net.stages[1], net.heads["a"], net.head]
    assert not any(isinstance(u, nn.ModuleList | nn.ModuleDict) for u in units)
    with pytest.raises(ConfigError, match="no module of these classes"):
        model_units(net, ["ModuleList"], "trainer.fsdp.wrap")
    seg = build_model(SegConvNetModel(), DigitsSegData(), 4)
    assert all(type(u).forward is not nn.Module.forward
               for u in model_units(seg, None, "trainer.fsdp.wrap"))  # fmt: skip


@pytest.mark.parametrize(
    "strategy,key,value,message",
    [
        ("fsdp2", "ddp.comm_hook", "fp16", "trainer.ddp.comm_hook=fp16 is trainer.strategy=ddp's"),
        ("fsdp2", "ddp.sync_bn", True, "trainer.ddp.sync_bn=true is trainer.strategy=ddp's"),
        (
            "ddp",
            "fsdp.cpu_offload",
            True,
            "trainer.fsdp.cpu_offload=true is trainer.strategy=fsdp2",
        ),
    ],
)
def test_a_strategy_refuses_the_keys_of_another_by_name(strategy, key, value, message):
    from omegaconf import OmegaConf

    from ddp_utils.strategy import build_strategy

    trainer = OmegaConf.structured(TrainerConfig(strategy=strategy))
    OmegaConf.update(trainer, key, value)
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_strategy(OmegaConf.to_object(trainer), rt)
    build_strategy(TrainerConfig(strategy=strategy), rt)  # the defaults pass


def test_hsdp_meshes_from_trainer_fsdp_replicate():
    from ddp_utils.strategy.fsdp2 import mesh_shape

    assert mesh_shape(1, 4, 2) == (4,)  # one group: plain fsdp2
    assert mesh_shape(2, 4, 4) == (2, 2)
    assert mesh_shape(-1, 16, 8) == (2, 8)  # a group a node: shards within a node
    assert mesh_shape(-1, 8, 8) == (8,)  # one node left: one group
    assert mesh_shape(4, 4, 1) == (4, 1)  # replicas only: DDP's arithmetic
    with pytest.raises(ConfigError, match=r"replicate=2 does not divide the world size 3.*1, 3"):
        mesh_shape(2, 3, 3)


@pytest.mark.parametrize("value", [0, -2])
def test_a_replicate_of_no_group_is_refused_by_name(value):
    from ddp_utils.config import validate

    with pytest.raises(ConfigError, match=f"trainer.fsdp.replicate={value}: set the number"):
        validate(compose_config("trainer.strategy=fsdp2", f"trainer.fsdp.replicate={value}"))


def test_the_world_size_a_replicate_cannot_divide_stops_before_the_run_starts():
    from ddp_utils.train.state import check_runtime

    trainer = TrainerConfig(strategy="fsdp2")
    trainer.fsdp.replicate = 2
    rt = Runtime(0, 0, 3, 3, torch.device("cpu"), "gloo")
    with pytest.raises(ConfigError, match="trainer.fsdp.replicate=2 does not divide"):
        check_runtime(trainer, rt)
    with pytest.raises(ConfigError, match="trainer.fsdp.replicate=2 is trainer.strategy=fsdp2"):
        check_runtime(TrainerConfig(fsdp=trainer.fsdp), rt)
