"""``build_model``: any ``_target_`` built with Hydra's ``instantiate``, sized from the data
config; ``model.weights=PATH`` then loads a local state dict."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from ddp_utils.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    UserError,
    channels_last_on,
    own_keys,
)
from ddp_utils.instantiate import target_arguments as checked_arguments
from ddp_utils.instantiate import why
from ddp_utils.logs import log


def target_arguments(
    cfg: ModelConfig, data: DataConfig, num_outputs: int | None = None
) -> dict[str, Any]:
    """What the target is called with (also stored in checkpoints through the config)."""
    offered = data.sizes()  # num_classes, in_channels, image_size (token data: vocab, block)
    if num_outputs is not None:
        offered["num_classes"] = num_outputs
    given = getattr(cfg, "kwargs", {})  # model=custom's +model.NAME=VALUE
    offered |= {k: getattr(cfg, k) for k in own_keys(type(cfg), "model") if k != "kwargs"}
    return checked_arguments("model._target_", cfg._target_, offered, given)


def build_model(cfg: ModelConfig, data: DataConfig, num_outputs: int | None = None) -> nn.Module:
    """Instantiate ``model._target_`` for the data (``num_classes`` outputs, or the task's
    ``num_outputs``), then load ``model.weights`` if given."""
    args = target_arguments(cfg, data, num_outputs)
    try:
        model = instantiate({"_target_": cfg._target_, "_convert_": "all", **args})
    except InstantiationException as e:
        if isinstance(e.__cause__, UserError):
            raise e.__cause__ from None
        raise ConfigError(
            f"model._target_={cfg._target_} rejected its arguments {sorted(args)} ({why(e)}). "
            "Fix the +model.NAME=VALUE overrides to match its signature."
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={cfg._target_} returned {type(model).__name__}, not a torch.nn.Module."
        )
    if cfg.weights:
        load_weights(model, cfg.weights, args.get("num_classes"))
    return model


def memory_format_of(channels_last: bool | str) -> torch.memory_format:
    """``trainer.channels_last`` resolved (``true`` / ``false``; a bool in checkpoints from
    before ``auto``): NHWC activations (and weights), else the default layout."""
    return torch.channels_last if channels_last_on(channels_last) else torch.contiguous_format


def sized_by_classes(own: torch.Tensor, theirs: torch.Tensor, num_classes: int | None) -> bool:
    """Whether a tensor that differs from the weights' differs only by the class count: its
    first dimension a multiple of the classes (a classifier's rows, a detector's boxes per
    class, a segmentation head's output channels), the rest the same."""
    return (
        num_classes is not None
        and own.ndim == theirs.ndim
        and own.shape[1:] == theirs.shape[1:]
        and own.shape[0] % num_classes == 0
    )


WEIGHTS_NAME = re.compile(r"^\w+_Weights\.\w+$")  # torchvision's: ResNet50_Weights.IMAGENET1K_V2


def hub_file(name: str, key: str) -> str:
    """A torchvision weights name as its file in the torch hub cache ($TORCH_HOME/hub/
    checkpoints, where torchvision keeps what it downloaded), never downloaded here: an
    offline cluster's nodes read what was fetched once elsewhere."""
    import torchvision

    try:
        weights = torchvision.models.get_weight(name)
    except (ValueError, KeyError, AttributeError):
        raise ConfigError(f"{key}={name} is neither a file nor a torchvision weights name "
                          "(such as ResNet50_Weights.IMAGENET1K_V2).") from None  # fmt: skip
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if not path.is_file():
        raise ConfigError(
            f"{key}={name}: {path} is not in the torch hub cache, and nothing is downloaded "
            f"here. Fetch it where there is a network (torchvision.models.get_weight('{name}')"
            ".get_state_dict()) and copy it to that path (TORCH_HOME sets the folder), or give "
            "the file's path."
        )
    return str(path)


def timm_file(name: str, key: str) -> str:
    """A timm weights name (``timm/resnet18.a1_in1k``: its Hugging Face hub id) as the file
    timm would have downloaded, in the Hugging Face hub cache (``HF_HOME``) or the torch hub
    cache (``TORCH_HOME``); nothing is downloaded here."""
    try:
        import timm
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise ConfigError(f"{key}={name} needs timm: pip install -e '.[timm]'.") from None
    cfg = timm.models.get_pretrained_cfg(name.removeprefix("timm/"))
    if cfg is None:
        raise ConfigError(f"{key}={name} is neither a file nor a timm weights name (such as "
                          "timm/resnet18.a1_in1k).")  # fmt: skip
    places = []
    if cfg.hf_hub_id:
        for file in (cfg.hf_hub_filename, "model.safetensors", "pytorch_model.bin"):
            found = try_to_load_from_cache(cfg.hf_hub_id, file) if file else None
            if isinstance(found, str):
                return found
        places.append(f"the Hugging Face hub cache ({cfg.hf_hub_id})")
    if cfg.url:
        path = Path(torch.hub.get_dir()) / "checkpoints" / Path(cfg.url).name
        if path.is_file():
            return str(path)
        places.append(str(path))
    raise ConfigError(
        f"{key}={name} is in neither {' nor '.join(places)}, and nothing is downloaded here. "
        f"Fetch it where there is a network (timm.create_model('{name.removeprefix('timm/')}', "
        "pretrained=True)) and copy the cache (HF_HOME or TORCH_HOME), or give the file's path."
    )


def read_state_dict(path: str, key: str) -> dict[str, torch.Tensor]:
    """A state dict saved with ``torch.save`` (bare, or a train.py checkpoint's ``model``) or
    as safetensors, or a torchvision (``ResNet50_Weights.IMAGENET1K_V2``) or timm
    (``timm/resnet18.a1_in1k``) weights name found in the hub caches; ``key`` names the config
    key in the errors."""
    if WEIGHTS_NAME.match(path) and not Path(path).exists():
        path = hub_file(path, key)
    elif path.startswith("timm/") and not Path(path).exists():
        path = timm_file(path, key)
    try:
        if str(path).endswith(".safetensors") and Path(path).is_file():
            from safetensors.torch import load_file

            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{key}={path}: no such file.") from None
    except Exception as e:
        raise ConfigError(
            f"{key}={path} does not load with weights_only=True ({why(e)}); give a "
            "state dict saved with torch.save(model.state_dict(), path)."
        ) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    return state


def load_weights(model: nn.Module, path: str, num_classes: int | None = None) -> None:
    """Start from a local state dict (a bare one, or a train.py checkpoint's ``model``); the
    layers sized by another class count (a classification, segmentation or detection head)
    are left re-initialised, and the log names them."""
    state = read_state_dict(path, "model.weights")
    own = model.state_dict()
    misfit = {k for k, v in state.items() if k in own and own[k].shape != v.shape}
    head = {k for k in misfit if sized_by_classes(own[k], state[k], num_classes)}
    if misfit - head:
        raise ConfigError(
            f"model.weights={path} does not fit model._target_ (shapes differ at "
            f"{sorted(misfit - head)[:4]}); give the weights of this architecture."
        )
    state = {k: v for k, v in state.items() if k not in misfit}
    result = model.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - misfit
    if missing or result.unexpected_keys:
        raise ConfigError(
            f"model.weights={path} does not match the model: missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(result.unexpected_keys)[:4]}; give the weights of this "
            "architecture."
        )
    log.info("model.weights=%s loaded", path)
    if misfit:
        layers = sorted({k.rpartition(".")[0] for k in misfit})
        log.info("model.weights: replaced layers %s (sized for another class count there), "
                 "re-initialised for %d classes", ", ".join(layers), num_classes)  # fmt: skip
