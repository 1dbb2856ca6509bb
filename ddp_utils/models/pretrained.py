"""Someone else's pretrained model, read without the network: a Hugging Face model folder
(``config.json``, ``*.safetensors`` possibly sharded, the tokenizer files) on a local or
shared file system, or at an fsspec URL, downloaded once per node into a cache (a lock lets
one process download while the node's others wait; a folder is renamed into place whole)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_utils.config import ConfigError
from ddp_utils.files import local_folder

WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


def model_folder(where: str, storage_options: dict[str, Any] | None = None) -> Path:
    """``where`` as a local folder: itself, or (a URL) this node's downloaded copy."""
    try:
        return local_folder(where, storage_options or {}, "models")
    except FileNotFoundError:
        raise ConfigError(f"model.pretrained={where}: no such folder on the store.") from None


def check_folder(folder: Path, where: str) -> None:
    """A model folder has its config and its weights; each missing file is named."""
    if not folder.is_dir():
        raise ConfigError(f"model.pretrained={where}: no such folder. Give a Hugging Face model "
                          "folder (config.json and *.safetensors), e.g. one save_pretrained "
                          "wrote.")  # fmt: skip
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.pretrained={where} has no config.json: it is not a Hugging "
                          "Face model folder.")  # fmt: skip
    if not any(any(folder.glob(pattern)) for pattern in WEIGHTS):
        raise ConfigError(
            f"model.pretrained={where} has config.json but no weights (*.safetensors or "
            "pytorch_model*.bin): copy the weight files into the folder, or drop "
            "model.pretrained to train from scratch."
        )


def load_causal_lm(where: str, vocab_size: int, overrides: dict[str, Any]) -> nn.Module:
    """The pretrained causal LM at ``where``, in float32 (the precision's autocast computes in
    the lower dtype; the optimizer keeps full-precision weights), never touching the network.
    The data's vocabulary must be the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load, on every rank, among the run's lines

    folder = model_folder(where)
    check_folder(folder, where)
    if torch.get_default_device().type == "meta":
        # A sharding strategy's other ranks: the architecture alone, no weights read; the
        # main rank's weights reach their shards (fsdp2's fill), so no rank but the main one
        # ever holds the whole model
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **dict(overrides or {}))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        with contextlib.redirect_stdout(None):
            model = AutoModelForCausalLM.from_pretrained(
                folder, local_files_only=True, dtype=torch.float32, **dict(overrides or {})
            )
    size = model.get_input_embeddings().num_embeddings
    if vocab_size != size:
        # Wider logits than the data's ids would change the loss's normalisation; narrower
        # ones could not score the data's ids
        raise ConfigError(f"data.vocab_size={vocab_size}, but model.pretrained={where} has "
                          f"{size} tokens: tokenize the data with the model's own tokenizer, "
                          f"whose ids are the model's ({size} of them).")  # fmt: skip
    return model
