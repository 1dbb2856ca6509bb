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
from ddp_utils.config.data.base import is_url
from ddp_utils.config.data.text import TOKEN_DTYPES
from ddp_utils.data.bundle import DataBundle, EvalData, Unit
from ddp_utils.data.samplers import (
    IGNORE_LABEL,
    EvalShardSampler,
    ResumableDistributedSampler,
    training_sampler,
)
from ddp_utils.data.shards.store import NodeCache, Store, default_cache_dir
from ddp_utils.dist import Runtime

META = "meta.json"
DEFAULT_DTYPE = "uint16"  # nanoGPT's
LLMC_MAGIC, LLMC_HEADER = 20240520, 1024  # llm.c's (and modded-nanogpt's) shard header
KEEP_ALL = 2**62  # the token cache's size limit: a split is kept whole


@dataclass(frozen=True)
class TokenMeta:
    """What ``meta.json`` says (or ``data.vocab_size`` without one)."""

    vocab_size: int
    dtype: str
    tokenizer: dict[str, Any] | None = None  # a ``ddp_utils.data.text.tokenizer`` spec
    token_bytes: tuple[int, ...] | None = None  # UTF-8 bytes per id: bits per byte


def token_root(cfg: TokenData) -> Path:
    """``data.root``; for data=pystdlib without one, its folder in the per-user data cache."""
    return cfg.folder()


def open_store(cfg: TokenData) -> Store:
    assert is_url(cfg.root)
    return Store(str(cfg.root), dict(cfg.storage_options), cfg.retries)


def where(cfg: TokenData) -> str:
    """``data.root`` as messages name it (a URL stays a URL)."""
    return str(cfg.root).rstrip("/") if is_url(cfg.root) else str(token_root(cfg))


def read_text(cfg: TokenData, name: str) -> str | None:
    """A small file of ``data.root`` (``meta.json``, a tokenizer), None if it is not there."""
    if is_url(cfg.root):
        store = open_store(cfg)
        return store.read(name, 0, store.size(name)).decode() if store.exists(name) else None
    path = token_root(cfg) / name
    return path.read_text() if path.is_file() else None


def read_meta(cfg: TokenData) -> TokenMeta:
    """``meta.json`` of ``data.root`` with ``data.vocab_size`` / ``data.dtype`` on top."""
    root = where(cfg)
    meta = _read_meta_file(cfg)
    if meta is None:
        if cfg.vocab_size is None:
            pkl = (
                " Its meta.pkl is never unpickled (a pickle can run code)."
                if not is_url(cfg.root) and (token_root(cfg) / "meta.pkl").exists()
                else ""
            )
            raise ConfigError(
                f"data.root={root} has no {META}.{pkl} Pass the vocabulary size as "
                "data.vocab_size=N (and data.dtype=uint32 if the ids need 32 bits), or "
                f'write {root}/{META} with {{"vocab_size": N, "dtype": "uint16"}}; '
                "python -m ddp_utils.prepare_text writes one."
            )
        return TokenMeta(cfg.vocab_size, cfg.dtype or DEFAULT_DTYPE)
    vocab = cfg.vocab_size if cfg.vocab_size is not None else meta.vocab_size
    if vocab < meta.vocab_size:
        raise ConfigError(
            f"data.vocab_size={cfg.vocab_size} is smaller than {root}/{META}'s vocab_size="
            f"{meta.vocab_size}: ids up to {meta.vocab_size - 1} would have no embedding. "
            "Drop data.vocab_size, or give one at least that large."
        )
    return replace(meta, vocab_size=vocab, dtype=cfg.dtype or meta.dtype)


def _read_meta_file(cfg: TokenData) -> TokenMeta | None:
    root = where(cfg)
    if not is_url(cfg.root) and not token_root(cfg).is_dir():
        raise ConfigError(
            f"data.root={root} is not a folder: give the folder that holds train.bin, "
            "val.bin and meta.json (python -m ddp_utils.prepare_text OUT TEXT... makes one)."
        )
    text = read_text(cfg, META)
    if text is None:
        return None
    path = f"{root}/{META}"
    try:
        meta = json.loads(text)
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
        spec = {"kind": "bpe", "json": read_text(cfg, spec["file"])}
    token_bytes = meta.get("token_bytes")
    return TokenMeta(vocab, dtype, spec, tuple(token_bytes) if token_bytes else None)


def split_files(cfg: TokenData, split: str) -> list[Path]:
    """The split's token files, read as one stream in this order: ``ROOT/<split>.bin``, else
    the ``*.bin`` shards of ``ROOT/<split>/`` by name. From a URL each file is downloaded
    once per node into the node cache (``data.cache_dir``; the windows are drawn from the
    whole split, so it is all kept)."""
    if is_url(cfg.root):
        store = open_store(cfg)
        single = f"{split}.bin"
        names = [(single, store.size(single))] if store.exists(single) else \
            store.listing(split, "bin")  # fmt: skip
        cache = NodeCache(Path(cfg.cache_dir or default_cache_dir()) / "tokens", KEEP_ALL)
        return [cache.get(store, name, size) for name, size in names]
    root = token_root(cfg)
    if (root / f"{split}.bin").is_file():
        return [root / f"{split}.bin"]
    shards = sorted((root / split).glob("*.bin")) if (root / split).is_dir() else []
    if not shards:
        raise ConfigError(
            f"{root / f'{split}.bin'}: no such file, and no {root / split}/*.bin shards. "
            "data.root needs train.bin and val.bin (flat arrays of token ids), or train/ and "
            "val/ folders of .bin shards; python -m ddp_utils.prepare_text OUT TEXT... writes "
            "them."
        )
    return shards


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


def llmc_tokens(path: Path, size: int) -> int | None:
    """The token count of an llm.c shard (a 256 x int32 header: magic 20240520, version 1,
    the count; then uint16 ids), None for a flat file."""
    if size < LLMC_HEADER:
        return None
    with open(path, "rb") as f:
        magic, version, count = np.frombuffer(f.read(12), dtype="<i4").tolist()
    if magic == LLMC_MAGIC and version == 1 and size == LLMC_HEADER + 2 * count:
        return count
    return None


class TokenFile:
    """A split's token files as one stream, each a memmap: nothing is read until a window is
    gathered; a window may span two files."""

    def __init__(self, paths: list[Path], dtype: str, vocab_size: int, name: str) -> None:
        self.path, self.vocab_size = name, vocab_size
        self.parts: list[np.ndarray] = []
        self.names = [str(p) for p in paths]
        for path in paths:
            size, width = path.stat().st_size, np.dtype(dtype).itemsize
            count = llmc_tokens(path, size) if dtype == "uint16" else None
            if count is not None:
                self.parts.append(np.memmap(path, "uint16", "r", LLMC_HEADER, (count,)))
                continue
            if size % width:
                raise ConfigError(
                    f"{path} has {size} bytes, not a whole number of {dtype} ids: is "
                    "data.dtype (or meta.json's dtype) the one it was written with?"
                )
            self.parts.append(
                np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
            )
        self.ends = np.cumsum([len(p) for p in self.parts])
        self.tokens = self.parts[0] if len(self.parts) == 1 else None  # one file: fancy indexing

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def span(self, a: int, b: int) -> np.ndarray:
        """Tokens ``[a, b)`` of the stream."""
        if self.tokens is not None:
            return self.tokens[a:b]
        pieces, k = [], int(np.searchsorted(self.ends, a, side="right"))
        while a < b:
            start = int(self.ends[k - 1]) if k else 0
            take = min(b, int(self.ends[k])) - a
            pieces.append(self.parts[k][a - start : a - start + take])
            a, k = a + take, k + 1
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]

    def locate(self, position: int) -> tuple[str, int]:
        """(file, position within it) of a stream position."""
        k = int(np.searchsorted(self.ends, position, side="right"))
        return self.names[k], position - (int(self.ends[k - 1]) if k else 0)

    def check_sample(self, limit: int) -> None:
        """Refuse ids >= vocab_size in up to ``limit`` tokens spread over the stream."""
        n = len(self)
        chunks = 16
        step = max(1, limit // chunks)
        starts = [0] if n <= limit else np.linspace(0, n - step, chunks).astype(np.int64)
        for start in starts:
            part = self.span(int(start), int(start) + (n if n <= limit else step))
            if len(part) and int(part.max()) >= self.vocab_size:
                at = int(start + np.argmax(part >= self.vocab_size))
                raise self.bad_id(at, int(self.span(at, at + 1)[0]))

    def bad_id(self, position: int, value: int) -> ConfigError:
        name, at = self.locate(position)
        return ConfigError(
            f"{name} holds token id {value} at position {at}, but the vocabulary "
            f"has {self.vocab_size} ids (data.vocab_size / meta.json's vocab_size). The file "
            "was written with another tokenizer or dtype: prepare it again, or give the right "
            "data.vocab_size and data.dtype."
        )

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The windows of ``length`` tokens at ``starts``, as int64, checked against the
        vocabulary on the host (one max per batch: no device sync)."""
        if self.tokens is not None:
            rows = self.tokens[starts[:, None] + np.arange(length)].astype(np.int64)
        else:
            rows = np.stack([self.span(int(a), int(a) + length) for a in starts]).astype(np.int64) \
                if len(starts) else np.zeros((0, length), np.int64)  # fmt: skip
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
    paths = split_files(cfg, split)
    name = f"{where(cfg)}/{split}.bin" if paths[0].name == f"{split}.bin" else \
        f"{where(cfg)}/{split}/ ({len(paths)} shards)"  # fmt: skip
    file = TokenFile(paths, meta.dtype, meta.vocab_size, name)
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
