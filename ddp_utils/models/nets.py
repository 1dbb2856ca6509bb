"""The built-in networks, sized by the data config (channels, image size, classes)."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    """The tutorial's ConvNet: conv 5x5 (+BN) + ReLU + 2x2 max-pool blocks, then a linear head."""

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        channels: list[int] = (16, 32),
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
    """Flatten, Linear, ReLU, Linear: no BatchNorm, so DDP equals one big batch exactly."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * image_size * image_size, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
