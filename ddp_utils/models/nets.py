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


def conv_bn(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class SegConvNet(nn.Module):
    """A small encoder-decoder for segmentation: stage ``k`` works at 1/2**k of the input
    (two 3x3 conv blocks, the first strided), the decoder upsamples each stage and adds the
    one above it (a U-Net with sums), and a 1x1 convolution scores every pixel at the input's
    size. Inputs whose sides do not divide by 2**(stages-1) are fine: each upsampling goes to
    the skip's own size."""

    def __init__(self, in_channels: int, num_classes: int, channels: list[int] = (32, 64, 96)):
        super().__init__()
        stages, c_in = [], in_channels
        for k, c in enumerate(channels):
            stages.append(nn.Sequential(conv_bn(c_in, c, stride=1 if k == 0 else 2), conv_bn(c, c)))
            c_in = c
        self.stages = nn.ModuleList(stages)
        self.lateral = nn.ModuleList(
            nn.Conv2d(hi, lo, kernel_size=1) for lo, hi in zip(channels, channels[1:], strict=False)
        )
        self.head = nn.Conv2d(channels[0], num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.stages:
            x = stage(x)
            skips.append(x)
        for skip, lateral in zip(reversed(skips[:-1]), reversed(self.lateral), strict=True):
            x = skip + nn.functional.interpolate(
                lateral(x), size=skip.shape[-2:], mode="bilinear", align_corners=False
            )
        return self.head(x)
