"""A user's own model, as a test module: model=custom model._target_=custom_models.TinyNet."""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """One convolution and a linear head; ``width`` comes from ``+model.width=N``."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, width: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, kernel_size=3, padding=1)
        self.head = nn.Linear(width * image_size * image_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))
