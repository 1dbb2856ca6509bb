"""The token options' schemas: ``data=tokens`` and ``pystdlib``; their builders are
ddp_utils/data/text/."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ddp_utils.config.data.base import DataConfig, check_holdout, is_url
from ddp_utils.config.errors import (
    ConfigError,
    check_choice,
    check_positive,
)

# data=pystdlib's rule that cuts train from val; a new rule makes older caches stale (2:
# nanoGPT's ``int(n * (1 - val_fraction))`` training characters).
SPLIT_RULE = 2
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
TOKENIZERS = ("char", "bytes")  # data=pystdlib's; prepare_text also has bpe


@dataclass
class TokenData(DataConfig):
    """data=tokens: nanoGPT's layout, root/train.bin and root/val.bin (flat token ids, read
    with numpy.memmap) and root/meta.json (vocab_size, dtype, the tokenizer)."""

    holds: ClassVar[str] = "tokens"
    family: ClassVar[str] = "ddp_utils.data.text.tokens"
    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + ("block_size", "vocab_size")
    root_may_be_null: ClassVar[bool] = False
    wrong_task: ClassVar[str] = (
        "data={data} holds token ids: train it with task=language_model and model=gpt (or "
        "model=hf | custom), or start from experiment=lm_char."
    )

    name: str = "tokens"
    # A folder or URL (s3://, gs://, https://) holding train.bin and val.bin, or train/ and
    # val/ folders of .bin shards (read as one stream, by name), and meta.json
    root: str | None = "data"
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec's, for a URL
    cache_dir: str | None = None  # a URL's files, once per node; null = ~/.cache/ddp-recipes
    retries: int = 5  # attempts at the store before the run stops (exit code 75)
    batch_size: int = 12
    block_size: int = 64  # context length: windows of block_size + 1 tokens
    eval_batch_size: int | None = None  # validation windows per batch; null = batch_size
    # null = meta.json's; a larger value pads the embedding (GPT-2's 50304 for 50257)
    vocab_size: int | None = None
    dtype: str | None = None  # null = meta.json's (uint16 without one)
    # The ids of a sample of each file are checked against vocab_size at start (null: all of
    # a file up to this many tokens is read; every batch is checked as it is read anyway).
    check_tokens: int = 1_000_000
    # Not images: the image keys keep their defaults; num_classes is set to vocab_size.
    in_channels: int = 1
    image_size: int = 1

    def check(self) -> None:
        super().check()
        if self.root is None and not self.root_may_be_null:
            raise ConfigError(
                f"data.root=null: data={self.name} reads ROOT/train.bin, ROOT/val.bin and "
                "ROOT/meta.json; set data.root to that folder."
            )
        check_positive("data.block_size", self.block_size)
        check_positive("data.retries", self.retries)
        check_positive("data.eval_batch_size", self.eval_batch_size)
        check_positive("data.vocab_size", self.vocab_size)
        check_positive("data.check_tokens", self.check_tokens, allow_zero=True)
        if self.dtype is not None:
            check_choice("data.dtype", self.dtype, TOKEN_DTYPES)
        if self.mixup_alpha or self.cutmix_alpha or self.augment:
            raise ConfigError(
                f"data={self.name} holds token ids: data.augment, data.mixup_alpha and "
                "data.cutmix_alpha apply to images; leave them at their defaults."
            )

    def sizes(self) -> dict[str, Any]:
        return super().sizes() | {"vocab_size": self.num_classes, "block_size": self.block_size}

    def describe_inputs(self) -> str:
        return f"sequences of {self.block_size} token ids"

    def folder(self) -> Path:
        """Where train.bin, val.bin and meta.json are."""
        return Path(self.root)


@dataclass
class PyStdlibData(TokenData):
    """data=pystdlib: the running interpreter's standard library .py sources as text,
    tokenized once into root (null = the per-user data cache)."""

    family: ClassVar[str] = "ddp_utils.data.text.pystdlib"
    identity: ClassVar[tuple[str, ...]] = TokenData.identity + ("tokenizer", "val_fraction")
    root_may_be_null: ClassVar[bool] = True  # the per-user cache

    name: str = "pystdlib"
    root: str | None = None
    tokenizer: str = "char"  # char | bytes
    val_fraction: float = 0.1  # the last tenth of the text, as prepare_text

    def check(self) -> None:
        super().check()
        check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check_holdout(self.val_fraction, None)
        if is_url(self.root):
            raise ConfigError(
                f"data.root={self.root}: data=pystdlib prepares its files in a local folder; "
                "give a folder (or null), or train on a URL's files with data=tokens."
            )

    def source_key(self) -> str:
        """What the prepared corpus is made from: a folder holding another is rebuilt."""
        version = ".".join(map(str, sys.version_info[:3]))
        return f"python{version}-{self.tokenizer}-val{self.val_fraction}-split{SPLIT_RULE}"

    def folder(self) -> Path:
        """``data.root``, or the corpus' folder in the per-user data cache
        (``$XDG_CACHE_HOME/ddp-recipes/pystdlib/<source_key>``, by default under ~/.cache)."""
        if self.root is not None:
            return Path(self.root)
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return cache / "ddp-recipes" / "pystdlib" / self.source_key()


TRAIN_ON = ("completion", "all")
OVERFLOW = ("truncate", "error")


@dataclass
class SFTData(DataConfig):
    """data=sft: instruction records for supervised fine-tuning, JSONL or Parquet, each
    ``{"prompt", "completion"}`` or chat ``{"messages": [{"role", "content"}, ...]}``,
    tokenized with the model folder's tokenizer (chat records through its chat template)."""

    holds: ClassVar[str] = "tokens"
    family: ClassVar[str] = "ddp_utils.data.text.sft"
    identity: ClassVar[tuple[str, ...]] = DataConfig.identity + (
        "vocab_size", "max_length", "train_on", "packing")  # fmt: skip
    wrong_task: ClassVar[str] = TokenData.wrong_task

    name: str = "sft"
    # A folder or URL holding train.jsonl and val.jsonl (or .parquet), or one such file that
    # data.val_fraction splits
    root: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec's, for a URL
    cache_dir: str | None = None  # tokenized records, per node; null = ~/.cache/ddp-recipes/sft
    # The Hugging Face folder whose tokenizer (and chat template) encodes the records; the
    # option's file sets it to model.pretrained
    tokenizer: str | None = None
    train_on: str = "completion"  # completion (the assistant turns) | all (every token)
    max_length: int = 1024  # tokens of a record, prompt and completion together
    overflow: str = "truncate"  # a longer record: truncate (counted in the log) | error
    # Training rows of several records up to max_length, each record's positions from 0 and
    # its attention its own (validation keeps a record a row: its numbers are unpacked ones)
    packing: bool = False
    val_fraction: float = 0.05  # one file: the held-out share of its records
    split_seed: int = 0  # one file: which records are held out
    batch_size: int = 8  # rows per process, padded to the longest
    eval_batch_size: int | None = None  # validation rows per batch; null = batch_size
    vocab_size: int | None = None  # null = the model folder's (its embedding's rows)
    # Not images: the image keys keep their defaults; num_classes is set to vocab_size.
    in_channels: int = 1
    image_size: int = 1

    def check(self) -> None:
        super().check()
        if not self.root:
            raise ConfigError(
                "data.root=null: data=sft reads ROOT/train.jsonl and ROOT/val.jsonl (or "
                ".parquet), or one such file split by data.val_fraction; set data.root."
            )
        if not self.tokenizer:
            raise ConfigError(
                "data.tokenizer=null: data=sft encodes its records with a model folder's "
                "tokenizer; set model.pretrained=FOLDER (data.tokenizer follows it) or "
                "data.tokenizer=FOLDER."
            )
        check_choice("data.train_on", self.train_on, TRAIN_ON)
        check_choice("data.overflow", self.overflow, OVERFLOW)
        check_positive("data.max_length", self.max_length)
        if self.max_length < 2:
            raise ConfigError(f"data.max_length={self.max_length}: a record needs at least 2 "
                              "tokens (an input and its next token).")  # fmt: skip
        check_positive("data.eval_batch_size", self.eval_batch_size)
        check_positive("data.vocab_size", self.vocab_size)
        check_holdout(self.val_fraction, None)
        if self.mixup_alpha or self.cutmix_alpha or self.augment:
            raise ConfigError(
                "data=sft holds token ids: data.augment, data.mixup_alpha and "
                "data.cutmix_alpha apply to images; leave them at their defaults."
            )

    @property
    def block_size(self) -> int:
        """The longest row: what the model's positions must reach."""
        return self.max_length

    def sizes(self) -> dict[str, Any]:
        return super().sizes() | {"vocab_size": self.num_classes, "block_size": self.max_length}

    def describe_inputs(self) -> str:
        return f"rows of up to {self.max_length} token ids"
