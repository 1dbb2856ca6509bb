"""The ``data`` group's schemas: the keys every option has (``base``), then each family's
options in a module of their own, as ddp_utils/data/ holds their builders.

Each ``conf/data/<option>.yaml`` starts from its schema (``DATA_OPTIONS``), so a key of
another option (``data=digits data.train_dir=x``) is refused at composition, by name.
"""

from __future__ import annotations

from ddp_utils.config.data.base import DataConfig
from ddp_utils.config.data.detection import DetFolderData, DetShardsData, DigitsDetData, VOCDetData
from ddp_utils.config.data.images import (
    CustomData,
    DigitsData,
    ImageFolderData,
    SyntheticData,
    TorchvisionData,
)
from ddp_utils.config.data.segmentation import (
    DigitsSegData,
    MnistSegData,
    SegFolderData,
    SegShardsData,
    VOCData,
)
from ddp_utils.config.data.shards import ShardsData
from ddp_utils.config.data.text import PyStdlibData, SFTData, TokenData

DATA_OPTIONS: dict[str, type[DataConfig]] = {
    "digits": DigitsData,
    "mnist": TorchvisionData,
    "fashion_mnist": TorchvisionData,
    "cifar10": TorchvisionData,
    "synthetic": SyntheticData,
    "imagefolder": ImageFolderData,
    "shards": ShardsData,
    "custom": CustomData,
    "digits_seg": DigitsSegData,
    "mnist_seg": MnistSegData,
    "segfolder": SegFolderData,
    "segshards": SegShardsData,
    "voc": VOCData,
    "tokens": TokenData,
    "pystdlib": PyStdlibData,
    "sft": SFTData,
    "digits_det": DigitsDetData,
    "detfolder": DetFolderData,
    "detshards": DetShardsData,
    "voc_det": VOCDetData,
}
