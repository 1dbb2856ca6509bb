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


class NamedHead(nn.Module):
    """A user's model whose class count is called ``n_out`` (default 10), so the builder cannot
    pass ``num_classes``: the output-shape check must catch a mismatch."""

    def __init__(self, in_channels: int = 1, n_out: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, kernel_size=3, padding=1)
        self.head = nn.Linear(4, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))


class Broken(nn.Module):
    """A model with a bug in forward() at every size."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1))[:, :, None].squeeze(3)


class DictSegNet(nn.Module):
    """A user's segmentation model answering as torchvision's do: ``{"out": (N, C, H, W)}``."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_classes, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.conv(x)}


class PooledSegNet(nn.Module):
    """A segmentation model that forgets to upsample: its scores are at half the size."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_classes, kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class BigramLM(nn.Module):
    """A user's language model for model=custom: (N, T) ids to (N, T, vocab) logits."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table(idx)
