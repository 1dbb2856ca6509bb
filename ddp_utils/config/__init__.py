"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

``schema`` holds the whole run's (TrainConfig, EvalConfig) and its validation; ``data``,
``model`` and ``task`` each hold their group's base schema and one per option; ``options``
maps an option to its schema; ``errors`` holds UserError and ConfigError.
"""

from ddp_utils.config.data.base import VOC_CLASSES, DataConfig, skips_bad_images
from ddp_utils.config.data.detection import (
    DetectionData,
    DetFilesData,
    DetFolderData,
    DetShardsData,
    DigitsDetData,
    VOCDetData,
)
from ddp_utils.config.data.images import (
    CustomData,
    DigitsData,
    ImageFolderData,
    StreamedData,
    SyntheticData,
    TorchvisionData,
)
from ddp_utils.config.data.segmentation import (
    CanvasData,
    DigitsSegData,
    MnistSegData,
    SegFolderData,
    SegmentationData,
    SegShardsData,
    VOCData,
)
from ddp_utils.config.data.shards import ShardsData, ShardStore
from ddp_utils.config.data.text import PyStdlibData, SFTData, TokenData
from ddp_utils.config.errors import ConfigError, UserError, whole_sentences
from ddp_utils.config.model import (
    ConvNetModel,
    CustomModel,
    DetZooModel,
    GPTModel,
    HFModel,
    MLPModel,
    ModelConfig,
    SegConvNetModel,
    SegZooModel,
    TinyDetModel,
    ZooModel,
)
from ddp_utils.config.optim import (
    AdamWOptim,
    CosineSched,
    CustomOptim,
    CustomSched,
    OneCycleSched,
    OptimConfig,
    PolySched,
    SchedConfig,
    SGDOptim,
    StepSched,
)
from ddp_utils.config.options import option_schema, options_help, own_keys
from ddp_utils.config.schema import (
    EvalConfig,
    GenerateConfig,
    TrainConfig,
    TrainerConfig,
    as_plain_dict,
    channels_last_on,
    collect_target_kwargs,
    from_record,
    option_defaults,
    register_configs,
    to_schema,
    unknown_keys,
    validate,
)
from ddp_utils.config.task import (
    CustomTask,
    DetectionTask,
    LanguageModelTask,
    SegmentationTask,
    TaskConfig,
)

__all__ = [
    "CanvasData", "ConfigError", "ConvNetModel", "CustomData", "CustomModel", "CustomTask",
    "DataConfig", "DigitsData", "DigitsSegData", "EvalConfig", "GenerateConfig", "ImageFolderData",
    "ShardsData",
    "ShardStore",
    "SegShardsData",
    "DetShardsData",
    "MLPModel",
    "MnistSegData", "ModelConfig", "OptimConfig", "SchedConfig", "SegConvNetModel",
    "SegFolderData", "SegZooModel", "SegmentationData", "SegmentationTask", "StreamedData",
    "SyntheticData", "TaskConfig", "TorchvisionData", "TrainConfig", "TrainerConfig",
    "VOCData", "ZooModel", "TokenData", "PyStdlibData", "SFTData", "GPTModel", "HFModel",
    "LanguageModelTask", "DetectionData", "DetFolderData", "DigitsDetData", "DetectionTask",
    "VOCDetData", "VOC_CLASSES", "DetFilesData",
    "TinyDetModel", "DetZooModel",
    "AdamWOptim", "CosineSched", "CustomOptim", "CustomSched",
    "OneCycleSched", "PolySched", "SGDOptim", "StepSched", "as_plain_dict", "channels_last_on",
    "collect_target_kwargs",
    "from_record",
    "option_defaults", "option_schema", "options_help", "own_keys", "register_configs",
    "skips_bad_images", "to_schema", "unknown_keys", "UserError", "validate", "whole_sentences",
]  # fmt: skip
