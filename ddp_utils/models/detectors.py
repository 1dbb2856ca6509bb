"""Detectors: ``model=tiny_det``, a small FCOS for the CPU and the tests.

It is torchvision's ``FCOS`` (its head, its losses, its box coder and post-processing), given
a small backbone: three or more stride-2 conv stages, the last two joined by a top-down FPN
into feature maps at strides 4 and 8 (a 64-pixel canvas gives 16x16 and 8x8). The images
arrive normalised by the data's preprocessing, so its transform only batches them (mean 0,
std 1, no resize beyond ``image_size``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F
from torchvision.models.detection import FCOS
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.fcos import FCOSHead


def conv_bn(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))  # fmt: skip


class TinyBackbone(nn.Module):
    """Stride-2 conv stages; an FPN over the last two (strides 2^(n-1) and 2^n)."""

    def __init__(self, in_channels: int, channels: list[int], out_channels: int) -> None:
        super().__init__()
        widths = [in_channels, *channels]
        self.stages = nn.ModuleList(
            conv_bn(widths[i], widths[i + 1], 2) for i in range(len(channels))
        )
        self.lateral = nn.ModuleList(nn.Conv2d(c, out_channels, 1) for c in channels[-2:])
        self.smooth = nn.ModuleList(
            nn.Conv2d(out_channels, out_channels, 3, padding=1) for _ in range(2)
        )
        self.out_channels = out_channels  # what torchvision's detectors read

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        fine, coarse = (lat(f) for lat, f in zip(self.lateral, feats[-2:], strict=True))
        fine = fine + F.interpolate(coarse, size=fine.shape[-2:], mode="nearest")
        return OrderedDict([("0", self.smooth[0](fine)), ("1", self.smooth[1](coarse))])


class TinyFCOS(FCOS):
    """FCOS with ``TinyBackbone``; ``num_classes`` counts the background (label 0)."""

    def __init__(self, num_classes: int, in_channels: int = 1, image_size: int = 64,
                 channels: tuple[int, ...] = (16, 32, 64), fpn_channels: int = 64,
                 head_convs: int = 2) -> None:  # fmt: skip
        backbone = TinyBackbone(in_channels, list(channels), fpn_channels)
        stride = 2 ** (len(channels) - 1)  # of the finer of the two maps
        # FCOS assigns a box to a level by its size against these (x4 .. x8 per level).
        anchors = AnchorGenerator(sizes=((stride * 2,), (stride * 4,)), aspect_ratios=((1.0,),) * 2)
        super().__init__(
            backbone,
            num_classes,
            min_size=image_size,
            max_size=image_size,
            image_mean=[0.0] * in_channels,
            image_std=[1.0] * in_channels,
            anchor_generator=anchors,
            head=FCOSHead(fpn_channels, 1, num_classes, num_convs=head_convs),
            detections_per_img=30,
            topk_candidates=200,
        )
