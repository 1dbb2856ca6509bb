"""The whole run's schema (TrainConfig, EvalConfig), its validation, and the step from a
composed DictConfig to the validated dataclass object.

Hydra merges the YAML in ``conf/`` onto these schemas, so an unknown key or a value of the
wrong type fails at composition, naming the key. The data, model and task options each have
a schema of their own (``ddp_utils.config.options``). Values of the right type but outside
their range are checked by ``validate`` and raise ``ConfigError`` (a ``ValueError``) naming
the key and the fix.
"""

from __future__ import annotations

import os
import sys
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from ddp_utils.config.data.base import DataConfig
from ddp_utils.config.data.images import DigitsData
from ddp_utils.config.errors import ConfigError, check_choice, check_fraction, check_positive
from ddp_utils.config.logger import LoggerOptions, logger_names
from ddp_utils.config.model import ConvNetModel, ModelConfig
from ddp_utils.config.optim import OneCycleSched, OptimConfig, SchedConfig, SGDOptim
from ddp_utils.config.options import (
    ARGUMENTS,
    GROUPS,
    keys_of,
    not_a_key,
    option_schema,
    options_help,
    store_name,
)
from ddp_utils.config.task import TaskConfig

PRECISIONS = ("auto", "32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")
PROGRESS = ("auto", "true", "false")


@dataclass
class FSDPOptions:
    """``trainer.strategy=fsdp2``'s keys (ddp_utils/strategy/fsdp2.py)."""

    # Module class names sharded one by one (then the root); null = the model's own blocks:
    # its ``fsdp_units()`` where it defines one (the GPT's transformer blocks), else its
    # top-level children that hold parameters (a torchvision model's stages).
    wrap: list[str] | None = None
    # Free each unit's gathered parameters after its forward (gathered again for the
    # backward): less memory, one more all-gather a unit.
    reshard_after_forward: bool = True
    cpu_offload: bool = False  # parameters, gradients and optimizer state in host memory
    # HSDP: this many replica groups of ranks, each holding one whole copy sharded over its
    # ranks (a 2-D mesh; gradients reduce-scattered in a group, then all-reduced across).
    # 1 = one group of every rank; -1 = one group a node, so all-gathers stay within a node.
    replicate: int = 1


@dataclass
class ProfilerOptions:
    """``trainer.profile=true``'s schedule and output (ddp_utils/train/profiler.py)."""

    wait: int = 5  # steps of this process left alone first (start-up, the first batches)
    warmup: int = 2  # steps traced and thrown away (the profiler's own start)
    active: int = 5  # steps recorded: the trace and the tables
    ranks: list[int] = field(default_factory=lambda: [0])  # the global ranks that profile
    top: int = 15  # rows of the top-operators table
    record_shapes: bool = False  # input shapes in the trace (more overhead)
    with_stack: bool = False  # Python stacks in the trace (much more overhead)


COMM_HOOKS = ("fp16", "bf16", "powersgd")  # DDP's built-in gradient compression hooks


class CheckpointOptions:
    """Where and how checkpoints are written (ddp_utils/checkpoint/). ``async`` is a Python
    keyword, so this schema is a dataclass with an ``__init__`` of its own (Hydra's key stays
    ``trainer.checkpoint.async``); code reads it as ``background``."""

    __annotations__ = {"dir": "str | None", "storage_options": "dict[str, Any]",
                       "async": "bool", "retries": "int", "timeout_s": "float"}  # fmt: skip
    # null = run_dir/checkpoints; a folder, or an fsspec URL (s3://bucket/prefix) where a
    # fresh node finds them
    dir = None
    # fsspec's options for a URL (s3fs: endpoint_url, key, secret, client_kwargs, ...); S3
    # also reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... and its usual credential chain
    storage_options = field(default_factory=dict)
    # (async, below) true: the step pays for a copy of the state to host memory; writing
    # and uploading go on in the background, one save at a time
    # Saves in a row that may fail (reported, retried at the next checkpoint) before the run
    # stops with exit code 75
    retries = 3
    # How long a sharded (fsdp2) save's collectives wait for the slowest rank's write: a slow
    # file system can take far longer than trainer.timeout_s for a large model
    timeout_s = 1800.0

    def __init__(self, **values: Any) -> None:
        for f in fields(self):
            default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
            setattr(self, f.name, values.pop(f.name, default))
        if values:
            raise TypeError(f"trainer.checkpoint has no key {', '.join(sorted(values))}")

    def __repr__(self) -> str:
        return f"CheckpointOptions({vars(self)})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    @property
    def background(self) -> bool:
        """``trainer.checkpoint.async``."""
        return bool(getattr(self, "async"))


setattr(CheckpointOptions, "async", True)  # noqa: B010 - a keyword; see the class
CheckpointOptions = dataclass(init=False, repr=False, eq=False)(CheckpointOptions)


@dataclass
class DDPOptions:
    """``trainer.strategy=ddp``'s keys (ddp_utils/strategy/ddp.py)."""

    sync_bn: bool = False  # SyncBatchNorm (CUDA only)
    bucket_cap_mb: float = 25.0  # gradient bucket size
    gradient_as_bucket_view: bool = True  # gradients alias DDP's buckets: one copy less
    static_graph: bool = False  # the graph is the same every step
    # null (full-precision all-reduce) | fp16 | bf16 (each bucket in half the bytes) |
    # powersgd (large matrices as a low-rank product, with error feedback)
    comm_hook: str | None = None
    powersgd_rank: int = 1  # PowerSGD's matrix approximation rank
    powersgd_start_iter: int = 10  # plain all-reduce steps before it (at least 2)


@dataclass
class TrainerConfig:
    epochs: int = 10
    # The run's length in optimizer steps (as many epochs as that takes); null = epochs
    max_steps: int | None = None
    # Validate (and checkpoint) every N steps and at the end instead of at epoch ends
    val_every_steps: int | None = None
    precision: str = "auto"  # auto: bf16 where the hardware computes it natively, else 32
    grad_accum_steps: int = 1
    grad_clip: float | None = None  # max global grad norm; null = off
    compile: bool = False
    device: str = "auto"
    backend: str = "auto"
    # Reproducible kernels (torch.use_deterministic_algorithms, cuDNN deterministic, no
    # autotuning, no TF32): the same numbers from the same seed on GPUs too, slower there
    deterministic: bool = False
    # A rank that makes no progress this long stops the job (the step watchdog); also the
    # rendezvous and collective timeout (NCCL's: a minute longer, docs/gpus.md)
    timeout_s: float = 300.0
    # How often the ranks agree on a stop signal (SIGTERM, Ctrl-C, SIGUSR1/2) or a diverged
    # loss: every rank stops at the same step, at most about twice this after the signal; one
    # small all-reduce this often instead of every step (docs/resume.md)
    stop_poll_s: float = 0.5
    log_every_steps: int = 50
    # NHWC activations: auto = on for CUDA (tensor-core convolutions), off on a CPU (its
    # convolutions are slower in NHWC) | true | false
    channels_last: str = "auto"
    # How the model is distributed (ddp_utils.strategy): ddp | fsdp2 | pkg.module.MyStrategy
    strategy: str = "ddp"
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    # Recompute each of the model's units in the backward instead of keeping its
    # activations: less memory, one more forward a unit (either strategy)
    activation_checkpointing: bool = False
    # The module class names recomputed; null = the model's own blocks (as fsdp.wrap's null)
    activation_checkpointing_units: list[str] | None = None
    ddp: DDPOptions = field(default_factory=DDPOptions)
    # Deprecated spellings of trainer.ddp's keys, taken for one release with a warning: null
    # = not given (DEPRECATED_KEYS)
    sync_bn: bool | None = None
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool | None = None
    static_graph: bool | None = None
    progress: str = "auto"  # auto (a bar when stderr is a terminal) | true | false
    ckpt_every_steps: int | None = None  # step checkpoints; null = only at epoch ends
    keep_last: int = 2  # newest step checkpoints kept (best.pt and last.pt besides)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    label_smoothing: float = 0.0
    ema_decay: float | None = None  # EMA of the weights (references' adjustment); null = off
    ema_every_steps: int = 32
    save_best_ema: bool = False  # also keep best_ema.pt, by val_ema/<task.monitor>
    # A device's peak FLOP/s in the run's precision, for `mfu`; null = a GPU's datasheet
    # value, else a matmul measured once on this machine (ddp_utils/flops.py)
    peak_flops: float | None = None
    # torch.profiler on a few steps: a trace under run_dir/profile and the phase and operator
    # tables in the log (trainer.profiler sets which steps and ranks)
    profile: bool = False
    profiler: ProfilerOptions = field(default_factory=ProfilerOptions)


@dataclass
class TrainConfig:
    # Typed by each group's base; the chosen option's schema is merged in at composition.
    model: ModelConfig = field(default_factory=ConvNetModel)
    data: DataConfig = field(default_factory=DigitsData)
    optim: OptimConfig = field(default_factory=SGDOptim)
    sched: SchedConfig = field(default_factory=OneCycleSched)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    seed: int = 0
    run_dir: str | None = None  # null = this command's unfinished run in outputs/, else a new one
    resume: str = "auto"  # auto | never | PATH of a checkpoint
    # Trackers: one name or a list of tensorboard | csv | mlflow | wandb | pkg.Class; none
    logger: Any = field(default_factory=lambda: ["tensorboard"])
    logger_cfg: LoggerOptions = field(default_factory=LoggerOptions)  # each tracker's options
    # Optional behaviour hung on the loop: a list of {_target_: pkg.Class, ARG: VALUE}
    callbacks: list[Any] = field(default_factory=list)


@dataclass
class EvalConfig(TrainConfig):
    checkpoint: str = "???"
    output: str | None = None  # null = <run dir of the checkpoint>/eval.json
    ema: bool = False  # score the checkpoint's EMA weights (model_ema)


@dataclass
class GenerateConfig:
    """generate.py: sample text from a language-model checkpoint (one process)."""

    checkpoint: str = "???"
    prompt: str = "\n"
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0 = greedy (the most likely token every time)
    top_k: int | None = 200  # sample among the k likeliest tokens; null = all
    seed: int = 0
    num_samples: int = 3
    device: str = "auto"  # auto (cuda if there is one) | cpu | cuda
    ema: bool = False  # the checkpoint's EMA weights
    output: str | None = None  # also write the samples to this JSON file
    # The prompt as a user turn of the model's chat template; null = as in training (a model
    # fine-tuned on chat records gets the template)
    chat: bool | None = None

    def check(self) -> None:
        check_positive("max_new_tokens", self.max_new_tokens)
        check_positive("num_samples", self.num_samples)
        check_positive("top_k", self.top_k)
        check_positive("temperature", self.temperature, allow_zero=True)
        check_choice("device", self.device, DEVICES)


def _open_groups(schema: type) -> Any:
    """``schema`` with each option group typed by its base, so that any option's schema
    (a subclass) can be merged in; OmegaConf refuses to merge one subclass onto another."""
    return schema(**{group: base() for group, (base, _) in GROUPS.items()})


def register_configs() -> None:
    """The schemas of train.yaml and eval.yaml (their first defaults), and one per option of
    data, model and task, stored outside any group: none shows as an option in ``--help``,
    whose ``${ddp_option_keys:}`` lists each option's keys instead."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=_open_groups(TrainConfig))
    cs.store(name="eval_schema", node=_open_groups(EvalConfig))
    cs.store(name="generate_schema", node=GenerateConfig)
    for group, (_, options) in GROUPS.items():
        for option, schema in options.items():
            cs.store(name=store_name(group, option), node=schema)
    OmegaConf.register_new_resolver("ddp_option_keys", options_help, replace=True)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check value ranges the schema's types cannot express; raise ConfigError naming the key."""
    for group, (_, options) in GROUPS.items():
        node = getattr(cfg, group)
        if group != "model":  # the code dispatches on these names; a model is its _target_
            check_choice(f"{group}.name", node.name, tuple(options))
        expected = option_schema(group, node.name)
        if not isinstance(node, expected):
            raise ConfigError(
                f"{group}.name={node.name} names another option than the one composed "
                f"({type(node).__name__}): choose it as {group}={node.name}, not {group}.name."
            )
        node.check()
    check_run(cfg)
    check_pairing(cfg)
    cfg.model.check_with(cfg.data)
    return cfg


def check_pairing(cfg: TrainConfig) -> None:
    """A task takes one kind of data (its ``takes``; a data option ``holds`` one kind): the
    task says what it needs, or, for the image-label tasks, the data says what it needs."""
    task, data = cfg.task, cfg.data
    if task.takes is None or task.takes == data.holds:
        return
    message = task.other_data or data.wrong_task
    assert message, f"{type(task).__name__} and {type(data).__name__} declare no message"
    raise ConfigError(message.format(data=data.name, options=" | ".join(holding(task.takes))))


def holding(kind: str) -> list[str]:
    """The data options whose schema ``holds`` ``kind`` (labels, masks, boxes, tokens)."""
    return [option for option, schema in GROUPS["data"][1].items() if schema.holds == kind]


def channels_last_on(value: bool | str) -> bool:
    """``trainer.channels_last`` once resolved (``true`` / ``false``; a bool in checkpoints
    written before ``auto``)."""
    return value is True or str(value).lower() == "true"


# Old flat trainer keys and where they live now (DDP's keys moved under trainer.ddp).
DEPRECATED_KEYS = {"sync_bn": "ddp.sync_bn", "bucket_cap_mb": "ddp.bucket_cap_mb",
                   "gradient_as_bucket_view": "ddp.gradient_as_bucket_view",
                   "static_graph": "ddp.static_graph"}  # fmt: skip


def take_deprecated(t: TrainerConfig) -> None:
    """Move each deprecated flat key's value to its new key, with one warning line naming the
    new key (from global rank 0 only). A value equal to the new key's default says nothing:
    checkpoints of earlier releases stored every flat key."""
    for old, new in DEPRECATED_KEYS.items():
        value = getattr(t, old)
        setattr(t, old, None)
        if value is None:
            continue
        node, key = new.split(".")
        if value != getattr(type(getattr(t, node))(), key):
            setattr(getattr(t, node), key, value)
            deprecated(f"trainer.{old}", f"trainer.{new}", value)
    if t.activation_checkpointing and t.activation_checkpointing_units is None and t.fsdp.wrap:
        t.activation_checkpointing_units = list(t.fsdp.wrap)
        deprecated("trainer.fsdp.wrap for activation checkpointing",
                   "trainer.activation_checkpointing_units", t.fsdp.wrap)  # fmt: skip


def deprecated(old: str, new: str, value: Any) -> None:
    if os.environ.get("RANK", "0") == "0":
        shown = (
            str(value).lower()
            if isinstance(value, bool)
            else f"{value:g}"
            if isinstance(value, float)
            else value
        )
        print(f"warning: {old} is deprecated and will be removed in the next release; "
              f"use {new}={shown} (taken for this run)", file=sys.stderr, flush=True)  # fmt: skip


def check_run(cfg: TrainConfig) -> None:
    """The groups without options of their own schema: trainer, the top level."""
    t = cfg.trainer
    take_deprecated(t)
    check_choice("trainer.precision", t.precision, PRECISIONS)
    check_choice("trainer.device", t.device, DEVICES)
    check_choice("trainer.backend", t.backend, BACKENDS)
    if t.ddp.comm_hook is not None:
        check_choice("trainer.ddp.comm_hook", t.ddp.comm_hook, COMM_HOOKS)
    check_positive("trainer.ddp.powersgd_rank", t.ddp.powersgd_rank)
    if t.ddp.powersgd_start_iter < 2:
        raise ConfigError(
            f"trainer.ddp.powersgd_start_iter={t.ddp.powersgd_start_iter}: DDP rebuilds its "
            "buckets after the first step, so PowerSGD's state may start at step 2 at the "
            "earliest; set 2 or more."
        )
    cfg.logger = logger_names(cfg.logger)
    t.progress = t.progress.lower()  # `trainer.progress=true` arrives as "True"
    check_choice("trainer.progress", t.progress, PROGRESS)
    t.channels_last = str(t.channels_last).lower()
    check_choice("trainer.channels_last", t.channels_last, PROGRESS)  # auto | true | false
    for key, value in (
        ("trainer.epochs", t.epochs),
        ("trainer.max_steps", t.max_steps),
        ("trainer.val_every_steps", t.val_every_steps),
        ("trainer.grad_accum_steps", t.grad_accum_steps),
        ("trainer.grad_clip", t.grad_clip),
        ("trainer.timeout_s", t.timeout_s),
        ("trainer.stop_poll_s", t.stop_poll_s),
        ("trainer.checkpoint.timeout_s", t.checkpoint.timeout_s),
        ("trainer.checkpoint.retries", t.checkpoint.retries),
        ("trainer.log_every_steps", t.log_every_steps),
        ("trainer.ckpt_every_steps", t.ckpt_every_steps),
        ("trainer.keep_last", t.keep_last),
        ("trainer.bucket_cap_mb", t.bucket_cap_mb),
        ("trainer.ema_every_steps", t.ema_every_steps),
        ("trainer.peak_flops", t.peak_flops),
        ("trainer.profiler.active", t.profiler.active),
        ("trainer.profiler.top", t.profiler.top),
    ):
        check_positive(key, value)
    check_fraction("trainer.label_smoothing", t.label_smoothing)
    if t.fsdp.replicate == 0 or t.fsdp.replicate < -1:
        raise ConfigError(
            f"trainer.fsdp.replicate={t.fsdp.replicate}: set the number of replica groups (1 "
            "or more, dividing the world size), or -1 for one group a node."
        )
    if t.ema_decay is not None and not 0.0 < t.ema_decay < 1.0:
        raise ConfigError(
            f"trainer.ema_decay={t.ema_decay} must lie in (0, 1); null turns EMA off."
        )


def collect_target_kwargs(cfg: DictConfig, schema: type = TrainConfig) -> None:
    """Move keys that ``+GROUP.NAME=VALUE`` added to a custom option (data, model, task) into
    its ``kwargs`` (the target's arguments). Anywhere else a key the schema lacks is a
    mistake (OmegaConf would drop it in silence)."""
    for group in GROUPS:
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        own = keys_of(OmegaConf.get_type(node))
        extra = [k for k in node if k not in own]
        if extra and ARGUMENTS in own:
            with open_dict(node):
                for key in extra:
                    node[ARGUMENTS][key] = node.pop(key)
    unknown = unknown_keys(cfg, schema)
    if unknown:
        group, _, key = unknown[0].partition(".")
        if key and group in GROUPS:
            raise ConfigError(not_a_key(group, cfg[group].get("name"), key))
        raise ConfigError(
            f"{unknown[0]} is not a key of this config; check its spelling (python train.py "
            "--cfg job lists every key)."
        )


def unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> list[str]:
    """Keys of ``node`` that the dataclass ``schema`` (and the dataclasses of its nodes) lack."""
    names = {f.name for f in fields(schema)}
    found = []
    for key in node:
        if key not in names:
            found.append(f"{prefix}{key}")
            continue
        value = node.get(key)
        if isinstance(value, DictConfig) and is_dataclass(sub := OmegaConf.get_type(value)):
            found += unknown_keys(value, sub, f"{prefix}{key}.")
    return found


def as_plain_dict(cfg: Any) -> dict[str, Any]:
    """A config object as plain, resolved containers (what checkpoints store). Not cheap (tens
    of milliseconds): a run converts its config once."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def option_defaults(cfg: TrainConfig) -> TrainConfig:
    """The defaults of ``cfg``'s options: what a key a record lacks meant when it was written."""
    return TrainConfig(**{group: type(getattr(cfg, group))() for group in GROUPS})


def from_record(stored: dict[str, Any]) -> DictConfig:
    """A stored config (a checkpoint's) on the schemas of its own options. Keys an option's
    schema lacks are dropped: releases before per-option schemas stored every option's keys."""
    record, parts = dict(stored), {}
    for group in GROUPS:
        node = stored.get(group)
        if node is None:  # a release before this group existed: its default
            continue
        schema = option_schema(group, node.get("name"))
        parts[group] = schema()
        record[group] = {k: v for k, v in node.items() if k in keys_of(schema)}
    return OmegaConf.merge(OmegaConf.structured(TrainConfig(**parts)), record)


def to_schema(cfg: DictConfig, schema: type = TrainConfig) -> Any:
    """Turn a composed DictConfig into its validated dataclass object."""
    collect_target_kwargs(cfg, schema)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, schema), f"config did not compose onto {schema.__name__}"
    return validate(obj)
