"""The ``model`` group's schemas: the keys every option has, then each option's own.

The builder offers an option's own keys (``channels``, ``hidden``, ``arch``, ...) to its
``_target_`` where the target's signature takes them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from hydra.utils import get_object

from ddp_utils.config.errors import ConfigError, check_positive, needs_target

if TYPE_CHECKING:
    from ddp_utils.config.data.base import DataConfig

DEFAULT_MODEL = "ddp_utils.models.nets.ConvNet"


@dataclass
class ModelConfig:
    """Every model option's keys."""

    # What builds the model (a class or function, built with hydra.utils.instantiate); it is
    # given num_classes, in_channels and image_size, and the option's own keys, where it
    # takes them.
    _target_: str = DEFAULT_MODEL
    name: str = "convnet"  # the option's name: convnet | mlp | resnet18 | torchvision | ...
    weights: str | None = None  # a local state dict to start from
    # Whether trainer.precision=auto takes bf16 on a CPU with AMX: only where measured faster
    # for this kind of model (a declaration of the option, not a key).
    bf16_on_cpu: ClassVar[bool] = False

    def check(self) -> None:
        """Value ranges the types cannot express; ConfigError naming the key."""

    def check_with(self, data: DataConfig) -> None:
        """What the option needs of the data config (its image size, ...); ConfigError."""

    def describe(self) -> str:
        """The option as errors name it."""
        arch = getattr(self, "arch", None)
        return f"model={self.name}" + (f" model.arch={arch}" if arch else "")


@dataclass
class ConvNetModel(ModelConfig):
    """model=convnet: the tutorial's conv blocks and a linear head."""

    channels: list[int] = field(default_factory=lambda: [16, 32])  # one conv block each
    batch_norm: bool = True  # off gives a model whose DDP math is BN-free
    bf16_on_cpu: ClassVar[bool] = True  # AMX computes its convolutions faster in bf16

    def check(self) -> None:
        if not self.channels or any(c < 1 for c in self.channels):
            raise ConfigError(f"model.channels={self.channels} needs positive channel counts.")

    def check_with(self, data: DataConfig) -> None:
        if data.image_size < 4:
            raise ConfigError(
                f"model=convnet pools twice: data.image_size={data.image_size} must be >= 4."
            )


@dataclass
class MLPModel(ModelConfig):
    """model=mlp: Linear-ReLU-Linear."""

    _target_: str = "ddp_utils.models.nets.MLP"
    name: str = "mlp"
    hidden: int = 256

    def check(self) -> None:
        check_positive("model.hidden", self.hidden)


@dataclass
class ZooModel(ModelConfig):
    """model=resnet18 | torchvision | timm: a model of that zoo by name."""

    _target_: str = "ddp_utils.models.zoo.torchvision_model"
    name: str = "torchvision"
    arch: str | None = None  # the model's name in the zoo

    def check(self) -> None:
        if not self.arch:
            raise ConfigError(
                f"model={self.name} needs model.arch=NAME (a model name of {self.name})."
            )


@dataclass
class CustomModel(ModelConfig):
    """model=custom: your nn.Module (or a function returning one)."""

    name: str = "custom"
    kwargs: dict[str, Any] = field(default_factory=dict)  # +model.NAME=VALUE

    def check(self) -> None:
        if self._target_ == DEFAULT_MODEL:
            raise needs_target(
                "model", "pkg.module.Class (a torch.nn.Module, or a function returning one)"
            )

    def describe(self) -> str:
        """Its target with the constructor's parameters (so a class count under another
        name, ``n_out``, say, is visible) and what it was given."""
        try:
            params = inspect.signature(get_object(self._target_)).parameters.values()
            signature = ", ".join(
                p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params
            )
        except (ValueError, TypeError, ImportError):
            signature = "..."
        given = f", given {dict(self.kwargs)}" if self.kwargs else ""
        return f"model._target_={self._target_} (its parameters: {signature}{given})"


@dataclass
class SegConvNetModel(ModelConfig):
    """model=seg_convnet: a small encoder-decoder for per-pixel class scores."""

    _target_: str = "ddp_utils.models.nets.SegConvNet"
    name: str = "seg_convnet"
    channels: list[int] = field(default_factory=lambda: [16, 32, 64, 96])  # one stage each
    context: list[int] = field(default_factory=lambda: [2, 4])  # dilations on the last stage
    stem_stride: int = 2  # 1: the first stage at full resolution (thin strokes, small inputs)

    def check(self) -> None:
        if len(self.channels) < 2 or any(c < 1 for c in self.channels):
            raise ConfigError(
                f"model.channels={self.channels} needs two or more positive channel counts."
            )
        if self.stem_stride not in (1, 2):
            raise ConfigError(f"model.stem_stride={self.stem_stride} must be 1 or 2.")
        if any(d < 1 for d in self.context):
            raise ConfigError(
                f"model.context={self.context} needs dilations >= 1 (or [] for none)."
            )


@dataclass
class SegZooModel(ModelConfig):
    """model=torchvision_seg: a segmentation model of torchvision by name."""

    _target_: str = "ddp_utils.models.zoo.torchvision_seg_model"
    name: str = "torchvision_seg"
    arch: str = "fcn_resnet50"
    aux_loss: bool = False  # the auxiliary head (its loss weight: task.aux_weight)
    weights_backbone: str | None = None  # a local state dict of the backbone

    def check(self) -> None:
        if not self.arch:
            raise ConfigError("model=torchvision_seg needs model.arch=NAME.")


@dataclass
class GPTModel(ModelConfig):
    """model=gpt: a decoder-only transformer (pre-norm, causal attention, tied embeddings);
    its context length is data.block_size, its vocabulary data.vocab_size."""

    _target_: str = "ddp_utils.models.gpt.GPT"
    name: str = "gpt"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # in the Linear and LayerNorm layers
    # AMX computes its matmuls faster in bf16, once the attention is kept in fp32
    # (ddp_utils.models.gpt.attention)
    bf16_on_cpu: ClassVar[bool] = True

    def check(self) -> None:
        for key in ("n_layer", "n_head", "n_embd"):
            check_positive(f"model.{key}", getattr(self, key))
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                "each head takes n_embd / n_head channels. Pick an n_embd that is a multiple "
                f"of n_head (e.g. {self.n_head * max(1, round(self.n_embd / self.n_head))})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must lie in [0, 1).")


@dataclass
class LoRAOptions:
    """model.lora: low-rank adapters (peft) on a pretrained model's linear layers; only they
    train, and only they (with their optimizer state) go into checkpoints."""

    r: int = 0  # the adapters' rank; 0 = full fine-tuning (every weight trains)
    alpha: float = 16.0  # the adapters' scale is alpha / r
    dropout: float = 0.0  # on the adapters' input
    # The layers that get adapters, by name (q_proj, v_proj, ...); null = every linear layer
    # but the output head
    target_modules: list[str] | None = None

    def check(self) -> None:
        check_positive("model.lora.r", self.r, allow_zero=True)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout={self.dropout} must lie in [0, 1).")
        if self.target_modules is not None and not self.target_modules:
            raise ConfigError(
                "model.lora.target_modules=[] adapts nothing: name layers (q_proj, v_proj, "
                "...) or leave it null for every linear layer."
            )


@dataclass
class HFModel(ModelConfig):
    """model=hf: a Hugging Face transformers causal LM, built from its configuration alone
    (sized by data.vocab_size and data.block_size) or loaded with its weights from
    ``model.pretrained`` (the [hf] extra)."""

    _target_: str = "ddp_utils.models.zoo.hf_causal_lm"
    name: str = "hf"
    arch: str = "gpt2"  # a model type of transformers' CONFIG_MAPPING
    # The configuration's own keys, e.g. {n_layer: 4, n_head: 4, n_embd: 128}
    overrides: dict[str, Any] = field(default_factory=dict)
    # A Hugging Face model folder (config.json, *.safetensors) or its fsspec URL: its
    # architecture and weights, read without any network access (model.arch is not used)
    pretrained: str | None = None
    lora: LoRAOptions = field(default_factory=LoRAOptions)

    def describe(self) -> str:
        if self.pretrained:
            lora = f" model.lora.r={self.lora.r}" if self.lora.r else ""
            return f"model=hf model.pretrained={self.pretrained}{lora}"
        return super().describe()

    def check(self) -> None:
        if not self.arch and not self.pretrained:
            raise ConfigError("model=hf needs model.arch=NAME (gpt2, llama, ...) or "
                              "model.pretrained=FOLDER.")  # fmt: skip
        self.lora.check()
        if self.lora.r and not self.pretrained:
            raise ConfigError(f"model.lora.r={self.lora.r} adapts a pretrained model: set "
                              "model.pretrained=FOLDER, or model.lora.r=0 to train every "
                              "weight.")  # fmt: skip


@dataclass
class DetZooModel(ModelConfig):
    """model=torchvision_det: a box detector of torchvision by name (fasterrcnn_*, fcos_*,
    retinanet_*, ssd*), sized for data.num_classes, untrained or from local weights."""

    _target_: str = "ddp_utils.models.zoo.torchvision_det_model"
    name: str = "torchvision_det"
    arch: str = "fasterrcnn_mobilenet_v3_large_320_fpn"
    weights_backbone: str | None = None  # a local state dict of the backbone

    def check(self) -> None:
        if not self.arch:
            raise ConfigError("model=torchvision_det needs model.arch=NAME.")


@dataclass
class TinyDetModel(ModelConfig):
    """model=tiny_det: a small FCOS detector (torchvision's head and losses on a three-stage
    conv backbone with a two-level FPN), fast enough for a CPU."""

    _target_: str = "ddp_utils.models.detectors.TinyFCOS"
    name: str = "tiny_det"
    channels: list[int] = field(default_factory=lambda: [16, 32, 64])  # stages, stride 2 each
    fpn_channels: int = 64
    head_convs: int = 2  # conv layers in each of the head's two branches (FCOS: 4)

    def check(self) -> None:
        if len(self.channels) < 2 or any(c < 1 for c in self.channels):
            raise ConfigError(
                f"model.channels={list(self.channels)} needs two or more stages, each of 1+ "
                "channels: the FPN reads the last two."
            )
        check_positive("model.fpn_channels", self.fpn_channels)
        check_positive("model.head_convs", self.head_convs)


MODEL_OPTIONS: dict[str, type[ModelConfig]] = {
    "convnet": ConvNetModel,
    "mlp": MLPModel,
    "resnet18": ZooModel,
    "torchvision": ZooModel,
    "timm": ZooModel,
    "custom": CustomModel,
    "seg_convnet": SegConvNetModel,
    "seg_convnet_fullres": SegConvNetModel,  # the same network, a full-resolution preset
    "torchvision_seg": SegZooModel,
    "gpt": GPTModel,
    "hf": HFModel,
    "tiny_det": TinyDetModel,
    "torchvision_det": DetZooModel,
}
