"""Token files (nanoGPT's layout): ``train.bin`` / ``val.bin`` read with ``numpy.memmap``,
``meta.json`` with ``vocab_size``, ``dtype`` and the tokenizer.

Training windows: an epoch covers the training tokens once in windows of ``block_size + 1``
tokens (input and shifted target) at ``offset + i * block_size``. The offset of epoch ``e`` is
entry ``e % block_size`` of a permutation of ``range(block_size)`` seeded by ``seed``, so over
``block_size`` epochs every position starts a window once. The window count is the same every
epoch (``(n - block_size) // block_size``: every offset fits), so the resumable sampler shuffles
and shards window indices as it does images, and a mid-epoch resume continues the same stream.

Validation: every non-overlapping window ``k * block_size`` of ``val.bin``, each on exactly one
rank (``EvalShardSampler``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Sampler

from ddp_utils.config import ConfigError, TokenData
from ddp_utils.config.data import TOKEN_DTYPES
from ddp_utils.data.bundle import DataBundle, EvalData, Unit
from ddp_utils.data.samplers import (
    IGNORE_LABEL,
    EvalShardSampler,
    ResumableDistributedSampler,
    training_sampler,
)
from ddp_utils.dist import Runtime

META = "meta.json"
DEFAULT_DTYPE = "uint16"  # nanoGPT's


@dataclass(frozen=True)
class TokenMeta:
    """What ``meta.json`` says (or ``data.vocab_size`` without one)."""

    vocab_size: int
    dtype: str
    tokenizer: dict[str, Any] | None = None  # a ``ddp_utils.data.tokenizer`` spec
    token_bytes: tuple[int, ...] | None = None  # UTF-8 bytes per id: bits per byte


def token_root(cfg: TokenData) -> Path:
    """``data.root``; for data=pystdlib without one, its folder in the per-user data cache."""
    return cfg.folder()


def read_meta(cfg: TokenData) -> TokenMeta:
    """``meta.json`` of ``data.root`` with ``data.vocab_size`` / ``data.dtype`` on top."""
    root = token_root(cfg)
    meta = _read_meta_file(root)
    if meta is None:
        if cfg.vocab_size is None:
            pkl = (
                " Its meta.pkl is never unpickled (a pickle can run code)."
                if (root / "meta.pkl").exists()
                else ""
            )
            raise ConfigError(
                f"data.root={root} has no {META}.{pkl} Pass the vocabulary size as "
                "data.vocab_size=N (and data.dtype=uint32 if the ids need 32 bits), or "
                f'write {root / META} with {{"vocab_size": N, "dtype": "uint16"}}; '
                "python -m ddp_utils.prepare_text writes one."
            )
        return TokenMeta(cfg.vocab_size, cfg.dtype or DEFAULT_DTYPE)
    vocab = cfg.vocab_size if cfg.vocab_size is not None else meta.vocab_size
    if vocab < meta.vocab_size:
        raise ConfigError(
            f"data.vocab_size={cfg.vocab_size} is smaller than {root / META}'s vocab_size="
            f"{meta.vocab_size}: ids up to {meta.vocab_size - 1} would have no embedding. "
            "Drop data.vocab_size, or give one at least that large."
        )
    return replace(meta, vocab_size=vocab, dtype=cfg.dtype or meta.dtype)


def _read_meta_file(root: Path) -> TokenMeta | None:
    path = root / META
    if not path.is_file():
        if not root.is_dir():
            raise ConfigError(
                f"data.root={root} is not a folder: give the folder that holds train.bin, "
                "val.bin and meta.json (python -m ddp_utils.prepare_text OUT TEXT... makes one)."
            )
        return None
    try:
        meta = json.loads(path.read_text())
        vocab, dtype = int(meta["vocab_size"]), str(meta.get("dtype", DEFAULT_DTYPE))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f'{path} does not read as {{"vocab_size": N, "dtype": "uint16"}} ({e}); '
            "fix or rewrite it (python -m ddp_utils.prepare_text writes one)."
        ) from None
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(
            f"{path} has dtype {dtype!r}, which is not a token dtype this reads: use one of "
            f"{', '.join(TOKEN_DTYPES)} (uint16 for vocabularies up to 65536, uint32 above)."
        )
    spec = meta.get("tokenizer")
    if isinstance(spec, dict) and spec.get("kind") == "bpe" and "file" in spec:
        spec = {"kind": "bpe", "json": (root / spec["file"]).read_text()}
    token_bytes = meta.get("token_bytes")
    return TokenMeta(vocab, dtype, spec, tuple(token_bytes) if token_bytes else None)


def resolve(cfg: TokenData, rt: Runtime) -> TokenData:
    """Every rank: the config with vocab_size, dtype and num_classes read from the data, so
    that config.yaml and checkpoints say what the model was sized for."""
    meta = read_meta(cfg)
    resolved = replace(
        cfg, vocab_size=meta.vocab_size, dtype=meta.dtype, num_classes=meta.vocab_size
    )
    # The files' lengths against data.block_size now, before any model is built or probed
    # and before run_dir exists: a mistake there stops in seconds and leaves nothing.
    train_windows(resolved, seed=0)
    eval_windows(resolved, "val")
    return resolved


class TokenFile:
    """One ``.bin`` file as a memmap: nothing is read until a window is gathered."""

    def __init__(self, path: Path, dtype: str, vocab_size: int) -> None:
        if not path.is_file():
            raise ConfigError(
                f"{path}: no such file. data.root needs train.bin and val.bin (flat arrays of "
                "token ids); python -m ddp_utils.prepare_text OUT TEXT... writes them."
            )
        size, width = path.stat().st_size, np.dtype(dtype).itemsize
        if size % width:
            raise ConfigError(
                f"{path} has {size} bytes, not a whole number of {dtype} ids: is data.dtype "
                "(or meta.json's dtype) the one it was written with?"
            )
        self.path, self.vocab_size = path, vocab_size
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)

    def __len__(self) -> int:
        return len(self.tokens)

    def check_sample(self, limit: int) -> None:
        """Refuse ids >= vocab_size in up to ``limit`` tokens spread over the file."""
        n = len(self.tokens)
        chunks = 16
        step = max(1, limit // chunks)
        starts = [0] if n <= limit else np.linspace(0, n - step, chunks).astype(np.int64)
        for start in starts:
            part = self.tokens[start : start + (n if n <= limit else step)]
            if len(part) and int(part.max()) >= self.vocab_size:
                at = int(start + np.argmax(part >= self.vocab_size))
                raise self.bad_id(at, int(self.tokens[at]))

    def bad_id(self, position: int, value: int) -> ConfigError:
        return ConfigError(
            f"{self.path} holds token id {value} at position {position}, but the vocabulary "
            f"has {self.vocab_size} ids (data.vocab_size / meta.json's vocab_size). The file "
            "was written with another tokenizer or dtype: prepare it again, or give the right "
            "data.vocab_size and data.dtype."
        )

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The windows of ``length`` tokens at ``starts``, as int64, checked against the
        vocabulary on the host (one max per batch: no device sync)."""
        rows = self.tokens[starts[:, None] + np.arange(length)].astype(np.int64)
        if rows.size and int(rows.max()) >= self.vocab_size:
            r, c = np.argwhere(rows >= self.vocab_size)[0]
            raise self.bad_id(int(starts[r] + c), int(rows[r, c]))
        return rows


class Windows:
    """The windows of one file: ``len`` is their number; window ``i`` starts at
    ``offset(epoch) + i * block_size``."""

    def __init__(
        self, file: TokenFile, block_size: int, count: int, offset: Callable[[int], int]
    ) -> None:
        self.file, self.block_size, self.count, self.offset = file, block_size, count, offset

    def __len__(self) -> int:
        return self.count

    def starts(self, index: np.ndarray, epoch: int) -> np.ndarray:
        return self.offset(epoch) + index * self.block_size


class WindowLoader:
    """Batches of (inputs, targets), each (batch, block_size) int64, gathered from the memmap
    in the training process (a copy of a few KB per batch: no workers needed). The sampler's
    padding markers get all-ignored targets, as the tensor loader's images do."""

    def __init__(
        self, ds: Windows, sampler: Sampler, batch_size: int, device: torch.device
    ) -> None:
        self.dataset, self.sampler, self.batch_size, self.device = ds, sampler, batch_size, device

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = np.fromiter(iter(self.sampler), dtype=np.int64)
        real = order >= 0
        starts = self.dataset.starts(
            np.where(real, order, ~order), getattr(self.sampler, "epoch", 0)
        )
        pin = self.device.type == "cuda"
        for b in range(0, len(order), self.batch_size):
            rows = torch.from_numpy(
                self.dataset.file.windows(
                    starts[b : b + self.batch_size], self.dataset.block_size + 1
                )
            )
            x, y = rows[:, :-1], rows[:, 1:].clone()
            y[torch.from_numpy(~real[b : b + self.batch_size])] = IGNORE_LABEL
            if pin:
                x, y = x.pin_memory(), y.pin_memory()
            yield x.to(self.device, non_blocking=pin), y.to(self.device, non_blocking=pin)


def epoch_offset(seed: int, block_size: int) -> Callable[[int], int]:
    """Epoch -> its windows' offset: every offset once per ``block_size`` epochs."""
    order = torch.randperm(block_size, generator=torch.Generator().manual_seed(seed)).tolist()
    return lambda epoch: order[epoch % block_size]


def open_split(cfg: TokenData, split: str) -> TokenFile:
    meta = read_meta(cfg)
    file = TokenFile(token_root(cfg) / f"{split}.bin", meta.dtype, meta.vocab_size)
    if cfg.check_tokens:
        file.check_sample(cfg.check_tokens)
    return file


def train_windows(cfg: TokenData, seed: int) -> Windows:
    file, b = open_split(cfg, "train"), cfg.block_size
    count = (len(file) - b) // b
    if count < 1:
        raise ConfigError(
            f"{file.path} has {len(file)} tokens: too few for one training window of "
            f"data.block_size={b} at every offset (it needs {2 * b}). Lower data.block_size, "
            "or give more text."
        )
    return Windows(file, b, count, epoch_offset(seed, b))


def eval_windows(cfg: TokenData, split: str) -> Windows:
    file, b = open_split(cfg, split), cfg.block_size
    count = (len(file) - 1) // b
    if count < 1:
        raise ConfigError(
            f"data.block_size={b} is larger than the {split} file: {file.path} has {len(file)} "
            f"tokens, and a window needs block_size + 1 = {b + 1}. Lower data.block_size (to at "
            f"most {max(1, len(file) - 1)}), or give a larger {split} split."
        )
    return Windows(file, b, count, lambda epoch: 0)


def eval_loader(cfg: TokenData, rt: Runtime, split: str) -> WindowLoader:
    ds = eval_windows(cfg, split)
    batch = cfg.eval_batch_size or cfg.batch_size
    return WindowLoader(ds, EvalShardSampler(len(ds), rt.world_size, rt.rank, batch), batch,
                        rt.device)  # fmt: skip


def token_loaders(
    cfg: TokenData, rt: Runtime, seed: int
) -> tuple[WindowLoader, WindowLoader, ResumableDistributedSampler]:
    """Every rank: the shuffled, sharded training windows and the exact validation ones."""
    train = train_windows(cfg, seed)
    sampler = training_sampler(len(train), cfg, rt, seed)
    loader = WindowLoader(train, sampler, cfg.batch_size, rt.device)
    return loader, eval_loader(cfg, rt, "val"), sampler


def offered(cfg: TokenData) -> dict[str, Any]:
    """The bytes each id stands for (None where unknown): bits per byte."""
    return {"token_bytes": read_meta(cfg).token_bytes}


def build(cfg: TokenData, rt: Runtime, seed: int, channels_last: bool | str) -> DataBundle:
    """Windows of token ids on the device; progress and throughput counted in tokens."""
    train, val, sampler = token_loaders(cfg, rt, seed)
    tokenizer = read_meta(cfg).tokenizer
    return DataBundle(
        train, val, sampler, nn.Identity(), nn.Identity(),
        unit=Unit("tok", cfg.block_size, "tokens"),
        checkpoint_extras={"tokenizer": tokenizer} if tokenizer is not None else {},
    )  # fmt: skip


def build_eval(cfg: TokenData, rt: Runtime, seed: int, channels_last: bool | str) -> EvalData:
    return EvalData(eval_loader(cfg, rt, cfg.split), nn.Identity(), None)
