"""Pascal VOC's folders, as torchvision's VOC data sets list them (never downloaded): what
``data=voc`` (segmentation) and ``data=voc_det`` (detection) share."""

from __future__ import annotations

from typing import Any

from ddp_utils.config import ConfigError, DataConfig


def open_voc(dataset: type, cfg: DataConfig, image_set: str, contents: str) -> Any:
    """torchvision's ``dataset`` (``VOCSegmentation``, ``VOCDetection``) for ``image_set``;
    where the folder is not there, ConfigError naming the layout (``contents``) to point
    ``data.root`` at."""
    try:
        return dataset(cfg.root, year=cfg.year, image_set=image_set, download=False)
    except (RuntimeError, OSError, ValueError) as e:
        # torchvision suggests download=True, which no data option offers here.
        reason = str(e).split(" You can use download=True")[0].strip().rstrip(".")
        raise ConfigError(
            f"data={cfg.name}: no Pascal VOC {cfg.year} under data.root={cfg.root} ({reason}). "
            f"It is never downloaded here: point data.root at the folder that holds "
            f"VOCdevkit/VOC{cfg.year}/ ({contents})."
        ) from None
