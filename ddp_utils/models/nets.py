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


def conv_bn(c_in: int, c_out: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=dilation, dilation=dilation, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class SegConvNet(nn.Module):
    """A small encoder-decoder for segmentation. The first stage works at 1/``stem_stride``
    of the input, each further one at half the resolution of the one before (two 3x3 conv
    blocks, the first strided); residual dilated 3x3 blocks on the last stage (``context``)
    widen its view; the decoder upsamples each stage and adds the one above it (a U-Net with
    sums), a 1x1 convolution scores every pixel at the first stage's resolution, and the
    scores are upsampled to the input's size.

    Why this shape (docs/segmentation.md): a class needs the whole digit in view. The
    defaults' receptive field is far wider than a 28-pixel MNIST digit (three stages from full
    resolution saw less than one, so the class flipped along its strokes); the stride-2 stem
    also makes every later stage a quarter of the work.
    Inputs whose sides do not divide by 2**stages are fine: each upsampling goes to the
    skip's own size."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        channels: list[int] = (16, 32, 64, 96),
        context: list[int] = (2, 4),
        stem_stride: int = 2,
    ) -> None:
        super().__init__()
        stages, c_in = [], in_channels
        for k, c in enumerate(channels):
            stride = stem_stride if k == 0 else 2
            stages.append(nn.Sequential(conv_bn(c_in, c, stride=stride), conv_bn(c, c)))
            c_in = c
        self.stages = nn.ModuleList(stages)
        self.context = nn.ModuleList(conv_bn(c_in, c_in, dilation=d) for d in context)
        self.lateral = nn.ModuleList(
            nn.Conv2d(hi, lo, kernel_size=1) for lo, hi in zip(channels, channels[1:], strict=False)
        )
        self.head = nn.Conv2d(channels[0], num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size, skips = x.shape[-2:], []
        for stage in self.stages:
            x = stage(x)
            skips.append(x)
        for block in self.context:
            x = x + block(x)
        for skip, lateral in zip(reversed(skips[:-1]), reversed(self.lateral), strict=True):
            x = skip + nn.functional.interpolate(
                lateral(x), size=skip.shape[-2:], mode="bilinear", align_corners=False
            )
        scores = self.head(x)
        if scores.shape[-2:] == size:
            return scores
        return nn.functional.interpolate(scores, size=size, mode="bilinear", align_corners=False)
