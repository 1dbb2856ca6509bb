"""Tokenizers of text data: ``char`` (the sorted set of a corpus' characters), ``bytes`` (UTF-8
bytes, 256 ids) and ``bpe`` (byte-level BPE of the ``tokenizers`` package).

A tokenizer is described by a plain ``spec`` dict (``meta.json``'s ``tokenizer`` entry, and
checkpoints' ``tokenizer``), so generation decodes without the data folder and
``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ddp_utils.config import ConfigError

TOKENIZER_KINDS = ("char", "bytes", "bpe", "hf")
# A Hugging Face folder's tokenizer, chat template and end-of-sequence ids: what data=sft
# encodes with, and what an export copies beside the weights for the tools that load it
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                      "tokenizer.model", "generation_config.json")  # fmt: skip


class Tokenizer:
    """``encode(text) -> ids``, ``decode(ids) -> text``, ``vocab_size``, ``token_bytes`` (the
    UTF-8 bytes each id stands for: bits per byte), ``spec`` (what rebuilds it)."""

    kind = ""
    vocab_size = 0

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_bytes(self) -> list[int]:
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def prompt(self, text: str, chat: bool | None) -> np.ndarray:
        """The ids a sample continues: ``text`` as it was written in training."""
        if chat:
            raise ValueError(f"the {self.kind} tokenizer has no chat template")
        return self.encode(text)

    def stop_ids(self) -> set[int]:
        """The ids that end a sample (none: it runs to max_new_tokens)."""
        return set()


class CharTokenizer(Tokenizer):
    """One id per character of ``chars`` (sorted), nanoGPT's shakespeare_char."""

    kind = "char"

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = sorted(set(chars))
        self.vocab_size = len(self.chars)
        self.index = {c: i for i, c in enumerate(self.chars)}
        points = np.array([ord(c) for c in self.chars], dtype=np.int64)
        self.lookup = np.full(int(points.max()) + 1 if len(points) else 1, -1, dtype=np.int64)
        self.lookup[points] = np.arange(len(points))

    def encode(self, text: str) -> np.ndarray:
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        inside = points < len(self.lookup)
        ids = np.where(inside, self.lookup[np.where(inside, points, 0)], -1)
        if (ids < 0).any():
            bad = sorted({text[i] for i in np.flatnonzero(ids < 0)[:1000]})
            raise ValueError(
                f"characters outside the vocabulary of {self.vocab_size}: "
                f"{', '.join(repr(c) for c in bad[:10])}"
            )
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def token_bytes(self) -> list[int]:
        return [len(c.encode("utf-8")) for c in self.chars]

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars}


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes: 256 ids, nothing to learn."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[int]:
        return [1] * 256


class BPETokenizer(Tokenizer):
    """A byte-level BPE of the ``tokenizers`` package, held as its JSON text."""

    kind = "bpe"

    def __init__(self, json_text: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.json_text = json_text
        self.impl = HFTokenizer.from_str(json_text)
        self.vocab_size = self.impl.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.impl.encode(text).ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self.impl.decode([int(i) for i in ids])

    def token_bytes(self) -> list[int]:
        # Byte-level tokens spell each byte as one character.
        vocab = self.impl.get_vocab()
        lengths = [0] * self.vocab_size
        for token, i in vocab.items():
            lengths[i] = len(token)
        return lengths

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "json": self.json_text}


class HFTokenizer(Tokenizer):
    """A Hugging Face model folder's tokenizer (data=sft): its special tokens, its chat
    template, and its end-of-sequence ids (the tokenizer's and generation_config.json's)."""

    kind = "hf"

    def __init__(self, folder: str, chat: bool = False, source: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.folder, self.chat, self.source = folder, chat, source
        try:
            self.impl = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except OSError:
            raise ConfigError(
                f"the tokenizer folder {folder} (data.tokenizer={source}) the checkpoint was "
                "trained with is gone: restore it (the model folder, or its export's copy)."
            ) from None
        self.vocab_size = len(self.impl)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.impl(text)["input_ids"], dtype=np.int64)

    def prompt(self, text: str, chat: bool | None) -> np.ndarray:
        if not (self.chat if chat is None else chat):
            return self.encode(text)
        if not self.impl.chat_template:
            raise ValueError(f"the tokenizer of {self.folder} has no chat template")
        messages = [{"role": "user", "content": text}]
        ids = self.impl.apply_chat_template(messages, add_generation_prompt=True)
        return np.asarray(ids["input_ids"] if hasattr(ids, "keys") else ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self.impl.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self) -> list[int]:
        raise NotImplementedError("an HF tokenizer's ids have no fixed byte count here")

    def stop_ids(self) -> set[int]:
        ids = {self.impl.eos_token_id} - {None}
        generation = Path(self.folder) / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "folder": self.folder, "chat": self.chat, "source": self.source}


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of ``vocab_size`` ids learnt from ``texts`` (offline, in memory)."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError(
            "--tokenizer=bpe needs the tokenizers package: pip install -e '.[lm]'."
        ) from None
    impl = HFTokenizer(models.BPE())
    impl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    impl.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    impl.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(impl.to_str())


def from_spec(spec: dict[str, Any]) -> Tokenizer:
    """The tokenizer a ``spec`` describes (meta.json's or a checkpoint's)."""
    kind = spec.get("kind")
    if kind == "char":
        return CharTokenizer(spec["chars"])
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer(spec["json"])
    if kind == "hf":
        return HFTokenizer(spec["folder"], bool(spec.get("chat")), spec.get("source"))
    raise ValueError(f"unknown tokenizer kind {kind!r} (known: {', '.join(TOKENIZER_KINDS)})")
