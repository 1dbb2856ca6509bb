"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

Hydra merges the YAML in ``conf/`` onto these schemas, so an unknown key or a value of the
wrong type fails at composition, naming the key. Values of the right type but outside their
range are checked by ``validate`` and raise ``ConfigError`` (a ``ValueError``) naming the key
and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

DATASETS = ("digits", "mnist", "fashion_mnist", "cifar10", "synthetic", "imagefolder", "custom")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULERS = ("none", "cosine", "step", "onecycle")
PRECISIONS = ("auto", "32", "bf16", "fp16")
AUTO_AUGMENTS = ("ta_wide", "ra", "augmix")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")
SPLITS = ("train", "val")
LOADERS = ("auto", "tensor", "torch")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
LOGGERS = ("tensorboard", "none")
PROGRESS = ("auto", "true", "false")
TASKS = ("classification", "custom")
MONITOR_MODES = ("max", "min")


class ConfigError(ValueError):
    """A user's mistake in the configuration, on the command line or in an input file.

    ``rank_specific`` marks an error that only some ranks see, so each of them reports it.
    """

    def __init__(self, message: str, *, rank_specific: bool = False) -> None:
        super().__init__(message)
        self.rank_specific = rank_specific


def whole_sentences(text: str, limit: int = 240) -> str:
    """``text`` if short, else its leading whole sentences within ``limit`` (never a cut
    mid-sentence); empty when even the first sentence is longer."""
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    return text[: end + 1] if end > 0 else ""


@dataclass
class ModelConfig:
    # What builds the model (a class or function, built with hydra.utils.instantiate); it is
    # given num_classes, in_channels and image_size, and the keys below, where it takes them.
    _target_: str = "ddp_utils.models.nets.ConvNet"
    name: str = "convnet"  # the option's name: convnet | mlp | resnet18 | torchvision | ...
    arch: str | None = None  # torchvision / timm: the model's name in that zoo
    channels: list[int] = field(default_factory=lambda: [16, 32])  # convnet blocks
    hidden: int = 256  # mlp
    batch_norm: bool = True  # convnet; off gives a model whose DDP math is BN-free
    weights: str | None = None  # a local state dict to start from
    kwargs: dict[str, Any] = field(default_factory=dict)  # custom: +model.NAME=VALUE


@dataclass
class DataConfig:
    name: str = "digits"
    root: str = "data"
    download: bool = False
    batch_size: int = 100  # per process
    # DataLoader worker processes per rank; null = the node's cores / local ranks, less one.
    num_workers: int | None = None
    prefetch_factor: int = 2  # batches each worker prepares ahead
    # auto (tensor for the built-in sets, DataLoader workers for imagefolder and custom) |
    # tensor (batches indexed on the device) | torch (DataLoader)
    loader: str = "auto"
    split: str = "val"  # which split eval.py scores
    # What the model is sized for; each data config declares its own.
    in_channels: int = 1
    image_size: int = 8
    num_classes: int = 10
    mean: list[float] = field(default_factory=lambda: [0.5])
    std: list[float] = field(default_factory=lambda: [0.5])
    val_fraction: float = 0.2  # digits: share held out for validation
    split_seed: int = 0  # digits: fixed split, independent of the training seed
    # cifar10: random crop with padding and flip on the device; imagefolder and custom:
    # RandomResizedCrop + horizontal flip per sample
    augment: bool = False
    train_dir: str = "train"  # imagefolder: sub-folders of data.root, one folder per class
    val_dir: str = "val"
    resize_size: int | None = None  # evaluation Resize; null = round(image_size / 0.875)
    interpolation: str = "bilinear"  # nearest | bilinear | bicubic
    skip_bad_images: bool = False  # imagefolder: skip unreadable files with a warning
    _target_: str | None = None  # custom: a callable returning (train, val) data sets
    kwargs: dict[str, Any] = field(default_factory=dict)  # custom: +data.NAME=VALUE
    # Recipe options of the classification references (auto_augment and random_erase: the
    # streamed path; mixup and cutmix: any path, on the device batch)
    auto_augment: str | None = None  # ta_wide | ra | augmix
    random_erase: float = 0.0  # probability
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    train_crop_size: int | None = None  # streamed training crop; null = image_size
    # Which held-out slice is the validation set: digits, the val_fraction slice number k of
    # a split_seed permutation; mnist-like sets, null = the official test set, k = slice k (of
    # the test set's size) of the pooled train + test images, the rest being the training set
    val_slice: int | None = None
    num_train: int = 8000  # synthetic
    num_val: int = 2000  # synthetic


@dataclass
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    norm_weight_decay: float | None = None  # normalisation layers; null = weight_decay
    bias_weight_decay: float | None = None  # biases; null = weight_decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class SchedConfig:
    name: str = "onecycle"
    warmup_steps: int = 0  # linear warmup from warmup_start_factor * lr
    warmup_epochs: int = 0  # the same in epochs (one of the two)
    warmup_start_factor: float = 0.1
    min_lr: float = 0.0  # cosine
    step_epochs: int = 10  # step: decay every this many epochs
    gamma: float = 0.1  # step
    pct_start: float = 0.3  # onecycle


@dataclass
class TrainerConfig:
    epochs: int = 10
    max_steps: int | None = None  # optimizer steps; null = no cap
    precision: str = "auto"  # auto: bf16 where the hardware computes it natively, else 32
    sync_bn: bool = False
    grad_accum_steps: int = 1
    grad_clip: float | None = None  # max global grad norm; null = off
    compile: bool = False
    device: str = "auto"
    backend: str = "auto"
    timeout_s: float = 300.0  # process-group init and collective timeout
    log_every_steps: int = 50
    channels_last: bool = True  # NHWC activations: faster convolutions on CPU and GPU
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size
    gradient_as_bucket_view: bool = True  # gradients alias DDP's buckets: one copy less
    static_graph: bool = False  # DDP: the graph is the same every step
    progress: str = "auto"  # auto (a bar when stderr is a terminal) | true | false
    ckpt_every_steps: int | None = None  # step checkpoints; null = only at epoch ends
    keep_last: int = 2  # newest step checkpoints kept (best.pt and last.pt besides)
    label_smoothing: float = 0.0
    ema_decay: float | None = None  # EMA of the weights (references' adjustment); null = off
    ema_every_steps: int = 32
    save_best_ema: bool = False  # also keep best_ema.pt, by val_ema/accuracy


@dataclass
class TaskConfig:
    # What builds the task (a ddp_utils.tasks.Task subclass, with hydra.utils.instantiate); it
    # is given num_classes, in_channels and image_size where its signature takes them.
    _target_: str = "ddp_utils.tasks.classification.Classification"
    name: str = "classification"  # the option's name: classification | custom
    # The metric that picks best.pt (val/<monitor>; "loss" is the validation loss), and
    # whether larger (max) or smaller (min) is better.
    monitor: str = "accuracy"
    monitor_mode: str = "max"
    # Metrics on top of the task's defaults: NAME -> {_target_: a torchmetrics.Metric, ARG:
    # VALUE}; NAME: null drops a default. Logged as val/NAME (scalars) and in eval.json.
    metrics: dict[str, Any] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)  # custom: +task.NAME=VALUE


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    seed: int = 0
    run_dir: str | None = None  # null = outputs/<date>_<torchrun run id>
    resume: str = "auto"  # auto | never | PATH of a checkpoint
    logger: str = "tensorboard"  # tensorboard (run_dir/tb) | none
    # Optional behaviour hung on the loop: a list of {_target_: pkg.Class, ARG: VALUE}
    callbacks: list[Any] = field(default_factory=list)


@dataclass
class EvalConfig(TrainConfig):
    checkpoint: str = "???"
    output: str | None = None  # null = <run dir of the checkpoint>/eval.json
    ema: bool = False  # score the checkpoint's EMA weights (model_ema)


def register_configs() -> None:
    """The schemas of train.yaml and eval.yaml (their first defaults). The groups are typed
    through them, so no group gets a schema option of its own to show in ``--help``."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(options)}; pick one of those.")


def _positive(key: str, value: float | int | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} is out of range: it must be {bound}.")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check value ranges the schema's types cannot express; raise ConfigError naming the key."""
    m, d, o, s, t = cfg.model, cfg.data, cfg.optim, cfg.sched, cfg.trainer
    _choice("data.name", d.name, DATASETS)
    _choice("data.split", d.split, SPLITS)
    _choice("data.loader", d.loader, LOADERS)
    _choice("data.interpolation", d.interpolation, INTERPOLATIONS)
    _choice("optim.name", o.name, OPTIMIZERS)
    _choice("sched.name", s.name, SCHEDULERS)
    _choice("trainer.precision", t.precision, PRECISIONS)
    if d.auto_augment is not None:
        _choice("data.auto_augment", d.auto_augment, AUTO_AUGMENTS)
    _choice("trainer.device", t.device, DEVICES)
    _choice("trainer.backend", t.backend, BACKENDS)
    _choice("logger", cfg.logger, LOGGERS)
    _choice("task.name", cfg.task.name, TASKS)
    _choice("task.monitor_mode", cfg.task.monitor_mode, MONITOR_MODES)
    t.progress = t.progress.lower()  # `trainer.progress=true` arrives as "True"
    _choice("trainer.progress", t.progress, PROGRESS)
    for key, value in (
        ("optim.lr", o.lr),
        ("data.batch_size", d.batch_size),
        ("data.in_channels", d.in_channels),
        ("data.image_size", d.image_size),
        ("data.num_classes", d.num_classes),
        ("data.num_train", d.num_train),
        ("data.num_val", d.num_val),
        ("data.resize_size", d.resize_size),
        ("model.hidden", m.hidden),
        ("trainer.epochs", t.epochs),
        ("trainer.max_steps", t.max_steps),
        ("trainer.grad_accum_steps", t.grad_accum_steps),
        ("trainer.grad_clip", t.grad_clip),
        ("trainer.timeout_s", t.timeout_s),
        ("trainer.log_every_steps", t.log_every_steps),
        ("trainer.ckpt_every_steps", t.ckpt_every_steps),
        ("trainer.keep_last", t.keep_last),
        ("trainer.bucket_cap_mb", t.bucket_cap_mb),
        ("sched.step_epochs", s.step_epochs),
        ("trainer.ema_every_steps", t.ema_every_steps),
        ("data.train_crop_size", d.train_crop_size),
    ):
        _positive(key, value)
    for key, value in (
        ("data.num_workers", d.num_workers),
        ("data.prefetch_factor", d.prefetch_factor),
        ("optim.weight_decay", o.weight_decay),
        ("optim.momentum", o.momentum),
        ("sched.warmup_steps", s.warmup_steps),
        ("sched.min_lr", s.min_lr),
        ("sched.warmup_epochs", s.warmup_epochs),
        ("optim.norm_weight_decay", o.norm_weight_decay),
        ("optim.bias_weight_decay", o.bias_weight_decay),
        ("data.mixup_alpha", d.mixup_alpha),
        ("data.cutmix_alpha", d.cutmix_alpha),
        ("data.val_slice", d.val_slice),
    ):
        _positive(key, value, allow_zero=True)
    for key, value in (
        ("data.random_erase", d.random_erase),
        ("trainer.label_smoothing", t.label_smoothing),
    ):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key}={value} must lie in [0, 1).")
    if t.ema_decay is not None and not 0.0 < t.ema_decay < 1.0:
        raise ConfigError(
            f"trainer.ema_decay={t.ema_decay} must lie in (0, 1); null turns EMA off."
        )
    if s.warmup_steps and s.warmup_epochs:
        raise ConfigError(
            "sched.warmup_steps and sched.warmup_epochs are both set: keep one, set the other to 0."
        )
    validate_streamed(d)
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must lie strictly between 0 and 1.")
    if len(d.mean) != d.in_channels or len(d.std) != d.in_channels:
        raise ConfigError(
            f"data.mean and data.std need one value per channel (data.in_channels="
            f"{d.in_channels}); got {len(d.mean)} and {len(d.std)}."
        )
    if m.name == "custom" and m._target_ == ModelConfig._target_:
        raise ConfigError(
            "model=custom needs model._target_=pkg.module.Class (a torch.nn.Module, or a "
            "function returning one); pass its arguments as +model.NAME=VALUE."
        )
    if cfg.task.name == "custom" and cfg.task._target_ == TaskConfig._target_:
        raise ConfigError(
            "task=custom needs task._target_=pkg.module.MyTask (a ddp_utils.tasks.Task "
            "subclass); pass its arguments as +task.NAME=VALUE."
        )
    if m.name in ("torchvision", "timm") and not m.arch:
        raise ConfigError(f"model={m.name} needs model.arch=NAME (a model name of {m.name}).")
    if m.name == "convnet" and d.image_size < 4:
        raise ConfigError(
            f"model=convnet pools twice: data.image_size={d.image_size} must be >= 4."
        )
    if not m.channels or any(c < 1 for c in m.channels):
        raise ConfigError(f"model.channels={m.channels} needs positive channel counts.")
    if s.name == "onecycle" and (s.warmup_steps or s.warmup_epochs):
        raise ConfigError(
            "sched=onecycle warms up by itself (sched.pct_start): set sched.warmup_steps=0 and "
            "sched.warmup_epochs=0."
        )
    if not 0.0 < s.warmup_start_factor <= 1.0:
        raise ConfigError("sched.warmup_start_factor must lie in (0, 1].")
    return cfg


def validate_streamed(d: DataConfig) -> None:
    if d.name == "custom" and not d._target_:
        raise ConfigError(
            "data=custom needs data._target_=pkg.module.fn: a callable that returns (train, "
            "val) data sets; pass its arguments as +data.NAME=VALUE."
        )
    if d.name != "custom" and (d._target_ or d.kwargs):
        raise ConfigError(
            f"data._target_ and +data.NAME arguments are for data=custom (this is data={d.name}):"
            " add data=custom, or drop them."
        )
    if d.name in ("imagefolder", "custom") and d.in_channels not in (1, 3):
        raise ConfigError(
            f"data.in_channels={d.in_channels}: images are read as grey (1) or RGB (3); set "
            "data.in_channels=1 or 3."
        )


def collect_target_kwargs(cfg: DictConfig, schema: type = TrainConfig) -> None:
    """Move keys that ``+data.NAME=VALUE`` / ``+model.NAME=VALUE`` added to ``data=custom`` or
    ``model=custom`` into their ``kwargs`` (the target's arguments). Anywhere else a key the
    schema lacks is a mistake (OmegaConf would drop it in silence)."""
    for group, node_schema in (("data", DataConfig), ("model", ModelConfig), ("task", TaskConfig)):
        node = cfg.get(group)
        extra = [k for k in node or () if k not in node_schema.__dataclass_fields__]
        if extra and node.get("name") == "custom":
            with open_dict(node):
                for key in extra:
                    node.kwargs[key] = node.pop(key)
    unknown = unknown_keys(cfg, schema)
    if unknown:
        key = unknown[0]
        group = key.split(".")[0]
        where, hint = "this config", ""
        if group in ("data", "model", "task"):
            where = f"{group}={cfg[group].get('name')}"
            hint = f" +{group}.NAME=VALUE arguments are for {group}=custom."
        raise ConfigError(
            f"{key} is not a key of {where}; check its spelling (python train.py --cfg job "
            f"lists every key).{hint}"
        )


def unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> list[str]:
    """Keys of ``node`` that the dataclass ``schema`` (and its nested dataclasses) lacks."""
    fields = schema.__dataclass_fields__
    found = []
    for key in node:
        if key not in fields:
            found.append(f"{prefix}{key}")
            continue
        sub = fields[key].default_factory if callable(fields[key].default_factory) else None
        value = node.get(key)
        if sub is not None and is_dataclass(sub) and isinstance(value, DictConfig):
            found += unknown_keys(value, sub, f"{prefix}{key}.")
    return found


def as_plain_dict(cfg: Any) -> dict[str, Any]:
    """A config object as plain, resolved containers (what checkpoints store). Not cheap (tens
    of milliseconds): a run converts its config once."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def to_schema(cfg: DictConfig, schema: type = TrainConfig) -> Any:
    """Turn a composed DictConfig into its validated dataclass object."""
    collect_target_kwargs(cfg, schema)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, schema), f"config did not compose onto {schema.__name__}"
    return validate(obj)
