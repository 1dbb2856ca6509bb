"""Strategy units with a patched runtime: where fsdp2 builds the model (the main rank whole,
every other rank on the meta device, a model that cannot be built there whole with a
warning)."""

from __future__ import annotations

import logging

import pytest
import torch
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
