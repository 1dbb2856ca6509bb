"""Model zoos as targets: any classification, segmentation or box-detection model of
torchvision, a classification model of timm, or a causal LM of Hugging Face transformers, when
installed."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from ddp_utils.config import ConfigError

SMALL_IMAGE = 64  # at or below this size, resnets get the CIFAR stem


def _unknown(arch: str, names: list[str], zoo: str) -> ConfigError:
    close = difflib.get_close_matches(arch, names, n=5, cutoff=0.5)
    hint = f"close matches: {', '.join(close)}" if close else f"{len(names)} names exist"
    return ConfigError(
        f"model.arch={arch} is not a classification model of {zoo} ({hint}); pick one of "
        f"{zoo}'s names."
    )


def first_conv(model: nn.Module) -> tuple[nn.Module, str, nn.Conv2d]:
    """The first Conv2d of ``model``, with its parent module and attribute name."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            parent_name, _, attr = name.rpartition(".")
            return model.get_submodule(parent_name), attr, module
    raise ConfigError(f"{type(model).__name__} has no Conv2d to adapt to data.in_channels")


def adapt_stem(model: nn.Module, in_channels: int, image_size: int) -> nn.Module:
    """Small images: the CIFAR stem for resnets (3x3 stride 1, no max-pool), which keep most of
    a 32x32 image; other channel counts than 3: the first convolution takes them."""
    is_resnet = hasattr(model, "conv1") and hasattr(model, "maxpool")
    if is_resnet and image_size <= SMALL_IMAGE:
        out = model.conv1.out_channels
        model.conv1 = nn.Conv2d(in_channels, out, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        parent, attr, conv = first_conv(model)
        setattr(parent, attr, nn.Conv2d(
            in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
            conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
        ))  # fmt: skip
    return model


def torchvision_model(arch: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """``torchvision.models.get_model(arch, weights=None, num_classes=...)``, stem adapted; a
    vision transformer is built for ``image_size`` (its position embedding has one size)."""
    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        raise _unknown(arch, names, "torchvision.models")
    sized = {"image_size": image_size} if arch.startswith("vit_") else {}
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **sized)
    return adapt_stem(model, in_channels, image_size)


def timm_model(arch: str, num_classes: int, in_channels: int) -> nn.Module:
    """``timm.create_model(arch, pretrained=False, ...)`` (the optional extra ``[timm]``)."""
    try:
        import timm
    except ImportError:
        raise ConfigError(
            "model=timm needs timm: pip install -e '.[timm]' (make install does it)."
        ) from None
    names = timm.list_models()
    if arch not in names:
        raise _unknown(arch, names, "timm")
    return timm.create_model(arch, pretrained=False, num_classes=num_classes, in_chans=in_channels)


def torchvision_seg_model(
    arch: str, num_classes: int, in_channels: int, aux_loss: bool = False,
    weights_backbone: str | None = None,
) -> nn.Module:  # fmt: skip
    """``torchvision.models.get_model(arch, weights=None, num_classes=..., aux_loss=...)`` of
    ``torchvision.models.segmentation``, its backbone loaded from a local state dict
    (``model.weights_backbone``, a classifier's: the head's keys are left out), and its first
    convolution adapted to ``in_channels``."""
    from torchvision.models import segmentation

    names = torchvision.models.list_models(module=segmentation)
    if arch not in names:
        raise ConfigError(
            f"model.arch={arch} is not a segmentation model of torchvision; pick one of "
            f"{', '.join(names)}."
        )
    extra = {"aux_loss": True} if aux_loss else {}
    try:
        model = torchvision.models.get_model(arch, weights=None, weights_backbone=None,
                                             num_classes=num_classes, **extra)  # fmt: skip
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ConfigError(
            f"model.arch={arch} with model.aux_loss={aux_loss}: {e}. Set model.aux_loss=false "
            "for it."
        ) from None
    if weights_backbone:
        load_backbone(model.backbone, weights_backbone)
    if in_channels != 3:
        adapt_stem(model, in_channels, image_size=SMALL_IMAGE + 1)  # channels only
    return model


# torchvision's box detectors (not the mask or keypoint ones, whose targets hold more)
DETECTORS = ("fasterrcnn_mobilenet_v3_large_320_fpn", "fasterrcnn_mobilenet_v3_large_fpn",
             "fasterrcnn_resnet50_fpn", "fasterrcnn_resnet50_fpn_v2", "fcos_resnet50_fpn",
             "retinanet_resnet50_fpn", "retinanet_resnet50_fpn_v2", "ssd300_vgg16",
             "ssdlite320_mobilenet_v3_large")  # fmt: skip


class GreyToRGB(nn.Module):
    """A torchvision detector fed grey images: each is repeated to the three channels its
    backbone was made for (the detector's own forward and attributes otherwise)."""

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        self.detector = detector

    def forward(self, images: list[torch.Tensor], targets: Any = None) -> Any:
        return self.detector([im.expand(3, -1, -1) for im in images], targets)


def torchvision_det_model(arch: str, num_classes: int, in_channels: int, image_size: int,
                          weights_backbone: str | None = None) -> nn.Module:  # fmt: skip
    """``torchvision.models.get_model(arch, weights=None, num_classes=...)`` of
    ``torchvision.models.detection``, resizing images to ``image_size`` (its shorter side;
    the SSDs: their own fixed size) and not normalising them again (the data's preprocessing
    does), its backbone loaded from a local state dict (``model.weights_backbone``)."""
    if arch not in DETECTORS:
        close = difflib.get_close_matches(arch, DETECTORS, n=3, cutoff=0.4)
        raise ConfigError(
            f"model.arch={arch} is not a box detector of torchvision"
            f"{' (close: ' + ', '.join(close) + ')' if close else ''}; pick one of "
            f"{', '.join(DETECTORS)}."
        )
    sizes = {} if arch.startswith("ssd") else {"min_size": image_size, "max_size": image_size}
    model = torchvision.models.get_model(arch, weights=None, weights_backbone=None,
                                         num_classes=num_classes, image_mean=[0.0] * 3,
                                         image_std=[1.0] * 3, **sizes)  # fmt: skip
    if weights_backbone:
        load_backbone(model.backbone.body if hasattr(model.backbone, "body") else model.backbone,
                      weights_backbone)  # fmt: skip
    return GreyToRGB(model) if in_channels == 1 else model


def load_backbone(backbone: nn.Module, path: str) -> None:
    """A local state dict into a segmentation model's backbone; the classifier's own keys
    (fc., classifier.) that the backbone lacks are ignored, any other mismatch refused."""
    from ddp_utils.models import read_state_dict

    state = read_state_dict(path, "model.weights_backbone")
    own = backbone.state_dict()
    # A mobilenet's segmentation backbone is the classifier's `features`, renumbered from 0.
    state = {k.removeprefix("features.") if k.removeprefix("features.") in own else k: v
             for k, v in state.items()}  # fmt: skip
    state = {k: v for k, v in state.items() if k in own or not k.startswith(("fc.", "classifier."))}
    result = backbone.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(
            f"model.weights_backbone={path} does not fit the backbone of this model: missing "
            f"{sorted(result.missing_keys)[:4]}, unexpected {sorted(result.unexpected_keys)[:4]}."
            " Give the state dict of the classifier it is built on (resnet50 for "
            "deeplabv3_resnet50, say)."
        )


class CausalLM(nn.Module):
    """A transformers causal LM as an (N, T) ids -> (N, T, vocab) logits module; with LoRA,
    a peft model whose base is frozen and left out of checkpoints (``saves_frozen``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.hf_source: Path | None = None  # the pretrained folder it was loaded from
        self.saves_frozen = not hasattr(model, "merge_and_unload")  # peft: adapters only
        self.packs_records = keeps_packed_records_apart(model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(N, T) ids, or packed rows' (N, 2, T) ids over positions: a position that restarts
        at 0 starts a record, which attends to its own tokens alone."""
        if idx.dim() == 3:
            return self.model(input_ids=idx[:, 0], position_ids=idx[:, 1], use_cache=False).logits
        return self.model(input_ids=idx, use_cache=False).logits

    def fsdp_units(self) -> list[nn.Module]:
        """The decoder blocks (transformers' ``_no_split_modules``), innermost first."""
        names = set(getattr(self.model, "_no_split_modules", None) or [])
        return [m for m in self.model.modules() if type(m).__name__ in names] or [self.model]

    def hf_export(self) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
        """Its own transformers configuration and weights (LoRA's merged into a copy)."""
        model = self.model
        if not self.saves_frozen:
            model = copy.deepcopy(model).merge_and_unload()
        config = model.config
        return type(config).__name__, config.to_dict(), model.state_dict()

    def save_adapter(self, folder: Path) -> None:
        """The LoRA adapters as peft's folder (adapter_config.json naming the base folder,
        adapter_model.safetensors), which peft, transformers and vLLM load on the base."""
        if self.saves_frozen:
            raise ConfigError("--format adapter is for a model.lora run: this checkpoint "
                              "trained every weight; export it with --format hf.")  # fmt: skip
        self.model.peft_config["default"].base_model_name_or_path = str(self.hf_source)
        self.model.save_pretrained(folder)


def keeps_packed_records_apart(model: nn.Module) -> bool:
    """Whether transformers builds the architecture's attention from ``position_ids`` without
    a cache (``masking_utils.create_causal_mask``: packed records kept apart); an older one
    would let a packed record see the one before it."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module = inspect.getmodule(type(base))
    try:
        return module is not None and "create_causal_mask(" in inspect.getsource(module)
    except OSError:  # no source to read
        return False


def with_lora(model: nn.Module, keys: dict[str, Any]) -> nn.Module:
    """``model`` with peft's LoRA adapters (``model.lora``'s keys); its own weights frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("model.lora needs the peft package: pip install -e '.[hf]'.") from None
    config = LoraConfig(r=keys["r"], lora_alpha=keys["alpha"], lora_dropout=keys["dropout"],
                        target_modules=keys["target_modules"] or "all-linear",
                        task_type="CAUSAL_LM")  # fmt: skip
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"model.lora.target_modules={keys['target_modules']}: {e}") from None


def hf_causal_lm(
    arch: str,
    vocab_size: int,
    block_size: int,
    overrides: dict[str, Any] | None = None,
    pretrained: str | None = None,
    lora: Any = None,
) -> nn.Module:
    """model=hf: ``transformers``' ``arch`` built from its configuration class alone (no
    weights or files fetched), with ``vocab_size``, the context ``block_size`` and
    ``model.overrides`` (the configuration's own keys); or, with ``pretrained``, the model
    folder's own architecture and weights."""
    try:
        from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    except ImportError:
        raise ConfigError(
            "model=hf needs the transformers package: pip install -e '.[hf]'."
        ) from None
    if pretrained:
        from ddp_utils.models.pretrained import load_causal_lm, model_folder

        base = load_causal_lm(pretrained, vocab_size, overrides or {})
        keys = dict(lora) if isinstance(lora, dict) else vars(lora) if lora is not None else {}
        model = CausalLM(with_lora(base, keys) if keys.get("r") else base)
        model.hf_source = model_folder(pretrained)  # its tokenizer files, for the export
        return model
    if arch not in CONFIG_MAPPING:
        names = sorted(CONFIG_MAPPING.keys())
        close = difflib.get_close_matches(arch, names, n=5, cutoff=0.5)
        raise ConfigError(
            f"model.arch={arch} is not a transformers model type"
            + (f" (close matches: {', '.join(close)})" if close else "")
            + "; pick one such as gpt2 or llama."
        )
    # No special token ids: they would point outside a small vocabulary.
    args = {"vocab_size": vocab_size, "bos_token_id": None, "eos_token_id": None}
    config = CONFIG_MAPPING[arch](**args | dict(overrides or {}))
    positions = getattr(config, "max_position_embeddings", 0) or 0
    config.max_position_embeddings = max(block_size, positions)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ConfigError(f"model.arch={arch} has no causal LM in transformers ({e}).") from None
    return CausalLM(model)
