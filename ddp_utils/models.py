"""Models, each sized from what the data config declares (channels, image size, classes)."""

from __future__ import annotations

import torch
import torchvision
from torch import nn

from ddp_utils.config import DataConfig, ModelConfig


class ConvNet(nn.Module):
    """The tutorial's ConvNet: conv 5x5 (+BN) + ReLU + 2x2 max-pool blocks, then a linear head."""

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        channels: list[int],
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        c_in, size = in_channels, image_size
        for c_out in channels:
            blocks += [
                nn.Conv2d(c_in, c_out, kernel_size=5, stride=1, padding=2),
                nn.BatchNorm2d(c_out) if batch_norm else nn.Identity(),
                nn.ReLU(),
                nn.MaxPool2d(kernel_size=2, stride=2),
            ]
            c_in, size = c_out, size // 2
        self.features = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in * size * size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resnet18(in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if image_size <= 64:
        # The ImageNet stem (7x7 stride 2, then max-pool) throws away most of a small image:
        # use the usual CIFAR stem instead.
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def build_model(model_cfg: ModelConfig, data_cfg: DataConfig) -> nn.Module:
    c, s, k = data_cfg.in_channels, data_cfg.image_size, data_cfg.num_classes
    if model_cfg.name == "convnet":
        return ConvNet(c, s, k, list(model_cfg.channels), model_cfg.batch_norm)
    if model_cfg.name == "mlp":
        return MLP(c * s * s, model_cfg.hidden, k)
    if model_cfg.name == "resnet18":
        return resnet18(c, s, k)
    raise AssertionError(f"unvalidated model name {model_cfg.name}")
