"""The ``task`` group's schemas: the keys every task has, then each option's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ddp_utils.config.errors import ConfigError, check_choice, needs_target

MONITOR_MODES = ("max", "min")
DEFAULT_TASK = "ddp_utils.tasks.classification.Classification"


@dataclass
class TaskConfig:
    """Every task option's keys; task=classification has no others."""

    # What builds the task (a ddp_utils.tasks.Task subclass, with hydra.utils.instantiate); it
    # is given num_classes, in_channels and image_size where its signature takes them.
    _target_: str = DEFAULT_TASK
    name: str = "classification"  # the option's name: classification | custom
    # The metric that picks best.pt (val/<monitor>; "loss" is the validation loss), and
    # whether larger (max) or smaller (min) is better.
    monitor: str = "accuracy"
    monitor_mode: str = "max"
    # Metrics on top of the task's defaults: NAME -> {_target_: a torchmetrics.Metric, ARG:
    # VALUE}; NAME: null drops a default. Logged as val/NAME (scalars) and in eval.json.
    metrics: dict[str, Any] = field(default_factory=dict)
    # Declarations of the option, not keys: which data it takes (a data option's ``holds``;
    # None: any), what to say to data it does not take ({data}: that option's name;
    # {options}: the data options that hold what it takes; empty: the data's own message),
    # and whether its checkpoints generate text (generate.py).
    takes: ClassVar[str | None] = "labels"
    other_data: ClassVar[str] = ""
    generates: ClassVar[bool] = False
    # Whether the label options (data.mixup_alpha, data.cutmix_alpha,
    # trainer.label_smoothing) mean something to it: they are handed to its target, and
    # refused by a task without them.
    label_options: ClassVar[bool] = True
    # The keys whose change makes a checkpoint another experiment's (resume refuses it).
    identity: ClassVar[tuple[str, ...]] = ("name", "_target_", "kwargs")

    def check(self) -> None:
        """Value ranges the types cannot express; ConfigError naming the key."""
        check_choice("task.monitor_mode", self.monitor_mode, MONITOR_MODES)


@dataclass
class CustomTask(TaskConfig):
    """task=custom: your ddp_utils.tasks.Task subclass."""

    label_options: ClassVar[bool] = False

    takes: ClassVar[str | None] = None  # yours says what it reads

    name: str = "custom"
    monitor: str = "loss"
    monitor_mode: str = "min"
    kwargs: dict[str, Any] = field(default_factory=dict)  # +task.NAME=VALUE

    def check(self) -> None:
        super().check()
        if self._target_ == DEFAULT_TASK:
            raise needs_target("task", "pkg.module.MyTask (a ddp_utils.tasks.Task subclass)")


@dataclass
class SegmentationTask(TaskConfig):
    """task=segmentation: per-pixel cross-entropy (and the auxiliary head's), mean IoU."""

    label_options: ClassVar[bool] = False

    takes: ClassVar[str | None] = "masks"
    other_data: ClassVar[str] = (
        "task=segmentation needs image/mask data: data={options} (this is data={data}); "
        "experiment=digits_segmentation sets all of it."
    )

    _target_: str = "ddp_utils.tasks.segmentation.Segmentation"
    name: str = "segmentation"
    monitor: str = "miou"
    aux_weight: float = 0.5  # the auxiliary head's share of the loss (model.aux_loss=true)

    def check(self) -> None:
        super().check()
        if self.aux_weight < 0:
            raise ConfigError(f"task.aux_weight={self.aux_weight} must be >= 0.")


@dataclass
class DetectionTask(TaskConfig):
    """task=detection: a torchvision-style detector's own losses in training; mAP (COCO's,
    through torchmetrics) exact at any world size in evaluation."""

    label_options: ClassVar[bool] = False

    takes: ClassVar[str | None] = "boxes"
    other_data: ClassVar[str] = (
        "task=detection needs images with boxes: data={options} (this is data={data}); "
        "experiment=digits_detection sets all of it."
    )

    _target_: str = "ddp_utils.tasks.detection.Detection"
    name: str = "detection"
    monitor: str = "map"
    coco_summary: bool = False  # COCO's summary tables in the log after each evaluation


@dataclass
class LanguageModelTask(TaskConfig):
    """task=language_model: next-token cross-entropy summed over tokens; val/loss,
    val/perplexity and (where the tokenizer knows bytes per token) val/bits_per_byte."""

    label_options: ClassVar[bool] = False

    takes: ClassVar[str | None] = "tokens"
    other_data: ClassVar[str] = (
        "task=language_model needs token data: data={options} (this is data={data}); "
        "experiment=lm_char sets all of it."
    )
    generates: ClassVar[bool] = True

    _target_: str = "ddp_utils.tasks.language_model.LanguageModel"
    name: str = "language_model"
    monitor: str = "loss"
    monitor_mode: str = "min"


TASK_OPTIONS: dict[str, type[TaskConfig]] = {
    "classification": TaskConfig,
    "custom": CustomTask,
    "segmentation": SegmentationTask,
    "language_model": LanguageModelTask,
    "detection": DetectionTask,
}
