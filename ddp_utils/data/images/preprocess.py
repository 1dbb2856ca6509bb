"""On the device: uint8 batches become normalised floats, for every data path.

Torch only, so the in-memory sets start without torchvision; the in-memory sets' batched
random crop and flip is here too (streamed sets are augmented per sample in the workers).
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_utils.config import DataConfig, channels_last_on


class Preprocess(nn.Module):
    """uint8 batch on the device -> normalised float; ``augment`` adds the in-memory sets'
    batched random crop and flip (streamed sets are augmented per sample in the workers)."""

    def __init__(self, cfg: DataConfig, augment: bool, channels_last: bool | str = False) -> None:
        super().__init__()
        self.augment = augment
        on = channels_last_on(channels_last)
        self.memory_format = torch.channels_last if on else torch.contiguous_format
        mean = torch.tensor(cfg.mean).view(1, -1, 1, 1) * 255.0
        std = torch.tensor(cfg.std).view(1, -1, 1, 1) * 255.0
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("inv_std", 1.0 / std, persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # The layout is set while the batch is still uint8 (a quarter of the bytes to move);
        # float() keeps it, and the in-place ops allocate nothing more.
        x = images.contiguous(memory_format=self.memory_format).float()
        if self.augment:
            x = random_crop_flip(x, padding=4).contiguous(memory_format=self.memory_format)
        return x.sub_(self.mean).mul_(self.inv_std)


def random_crop_flip(x: torch.Tensor, padding: int) -> torch.Tensor:
    """Per-sample random crop (zero padding) and horizontal flip, for the whole batch at once."""
    n, _, h, w = x.shape
    padded = nn.functional.pad(x, (padding,) * 4)
    oy = torch.randint(0, 2 * padding + 1, (n, 1), device=x.device)
    ox = torch.randint(0, 2 * padding + 1, (n, 1), device=x.device)
    rows = (oy + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (ox + torch.arange(w, device=x.device))[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    out = padded[batch, chan, rows, cols]
    flip = torch.rand(n, device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)
