"""data=sft: instruction records for supervised fine-tuning.

Records are JSONL lines or Parquet rows, each ``{"prompt": ..., "completion": ...}`` or chat
``{"messages": [{"role": ..., "content": ...}, ...]}``. A prompt/completion record is the
tokenizer's encoding of ``prompt + completion`` (its special tokens, then the end-of-sequence
token after the completion); a chat record is the model folder's own chat template rendered
and encoded as ``apply_chat_template`` does. With ``data.train_on=completion`` every token
but the completion's (the assistant turns', found by rendering each turn's prefix) carries
the ignore label, so the loss, a sum over labelled tokens with their count, is TRL's and
torchtune's.

Each node tokenizes once into its cache (``data.cache_dir``), keyed by the files, the
tokenizer and the keys that change the encoding; the ranks then read the arrays. Records are
samples of the resumable sampler (training) and of the exact evaluation shards, so the order,
resume and world-size guarantees are every family's. A batch is padded on the right to its
longest row: causal attention never lets a real token see a pad, and the pads' labels are
ignored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Sampler

from ddp_utils.config import ConfigError, SFTData
from ddp_utils.data.bundle import DataBundle, EvalData, Unit
from ddp_utils.data.samplers import IGNORE_LABEL, EvalShardSampler, training_sampler
from ddp_utils.data.text.tokenizer import HF_TOKENIZER_FILES
from ddp_utils.dist import Runtime
from ddp_utils.files import local_folder, made_once, user_cache
from ddp_utils.urls import fs_options, is_url

ENCODING = 1  # the rules below; a change makes older caches stale
SUFFIXES = (".jsonl", ".parquet")
CHUNK = 1024  # records encoded by the tokenizer at once


def tokenizer_folder(cfg: SFTData) -> Path:
    try:
        return local_folder(cfg.tokenizer, {}, "models")
    except FileNotFoundError:
        raise ConfigError(f"data.tokenizer={cfg.tokenizer}: no such folder on the store.") from None


def open_tokenizer(cfg: SFTData) -> Any:
    """The model folder's tokenizer, read without the network (once a process, while its
    files stay as they are)."""
    folder = tokenizer_folder(cfg)
    files = tuple((f, p.stat().st_mtime_ns, p.stat().st_size) for f in HF_TOKENIZER_FILES
                  if (p := folder / f).is_file())  # fmt: skip
    return _tokenizer(str(folder), files, cfg.tokenizer)


@functools.lru_cache(maxsize=4)
def _tokenizer(where: str, files: tuple, name: str) -> Any:
    from transformers import AutoTokenizer

    folder = Path(where)
    if not any(f in (HF_TOKENIZER_FILES[0], HF_TOKENIZER_FILES[1]) for f, _, _ in files):
        raise ConfigError(
            f"data.tokenizer={name} has no tokenizer (tokenizer.json or "
            "tokenizer_config.json): give the model folder its tokenizer files, or "
            "data.tokenizer=FOLDER of the tokenizer the model was trained with."
        )
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if not tok.is_fast:
        raise ConfigError(
            f"data.tokenizer={name}: its tokenizer has no fast (tokenizers) version, "
            "which data=sft needs for its offsets."
        )
    return tok


def model_vocab(cfg: SFTData, tok: Any) -> int:
    """The rows of the model's embedding (config.json's vocab_size: often padded past the
    tokenizer's ids), else the tokenizer's size; ``data.vocab_size`` overrides."""
    if cfg.vocab_size is not None:
        vocab = cfg.vocab_size
    else:
        config = tokenizer_folder(cfg) / "config.json"
        vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
        vocab = int(vocab or len(tok))
    if vocab < len(tok):
        raise ConfigError(
            f"data.tokenizer={cfg.tokenizer} has {len(tok)} ids but the vocabulary is {vocab} "
            "(data.vocab_size or the folder's config.json): ids past it would have no "
            "embedding. Use the model's own tokenizer."
        )
    return vocab


# ---- the files -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A records file: its name as messages give it, and how to open it."""

    where: str
    fs: Any
    path: str

    def identity(self) -> list[Any]:
        info = self.fs.info(self.path)
        return [self.where, info.get("size"), str(info.get("mtime") or info.get("ETag") or "")]


def sources(cfg: SFTData) -> tuple[Source, Source | None]:
    """(the training file, the validation file or None: split from the training one)."""
    import fsspec

    root = str(cfg.root).rstrip("/")
    options = fs_options(root, dict(cfg.storage_options)) if is_url(root) else {}
    fs, base = fsspec.core.url_to_fs(root, **options)
    if root.endswith(SUFFIXES):
        if not fs.isfile(base):
            raise ConfigError(f"data.root={root}: no such file.")
        return Source(root, fs, base), None
    if not fs.isdir(base):
        raise ConfigError(
            f"data.root={root} is neither a folder nor a .jsonl / .parquet file: give the "
            "folder holding train.jsonl and val.jsonl (or .parquet), or one records file."
        )
    found = {}
    for split in ("train", "val"):
        for suffix in SUFFIXES:
            if fs.isfile(f"{base}/{split}{suffix}"):
                found[split] = Source(f"{root}/{split}{suffix}", fs, f"{base}/{split}{suffix}")
                break
    if "train" not in found:
        raise ConfigError(f"data.root={root} has no train.jsonl or train.parquet: name the "
                          "training records so, or give one file as data.root.")  # fmt: skip
    return found["train"], found.get("val")


def read_records(source: Source) -> list[tuple[str, Any]]:
    """(where, record) of each record: ``file:line`` of a JSONL line, ``file row N`` of a
    Parquet row."""
    if source.path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with source.fs.open(source.path, "rb") as f:
            rows = pq.read_table(f).to_pylist()
        return [(f"{source.where} row {i + 1}", row) for i, row in enumerate(rows)]
    records = []
    with source.fs.open(source.path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append((f"{source.where}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{source.where}:{n} is not a JSON object ({e}).") from None
    if not records:
        raise ConfigError(f"{source.where} holds no records.")
    return records


# ---- encoding --------------------------------------------------------------------------------


class Encoder:
    """Records to (ids, labelled) arrays: the text the tokenizer encodes and the character
    spans whose tokens carry labels."""

    def __init__(self, tok: Any, cfg: SFTData) -> None:
        self.tok, self.cfg = tok, cfg

    def render(self, record: Any, where: str) -> tuple[str, list[tuple[int, int]], bool]:
        """(text, labelled spans, whether the tokenizer adds its special tokens)."""
        if isinstance(record, dict) and "messages" in record:
            return self.render_chat(record["messages"], where)
        if isinstance(record, dict) and "prompt" in record and "completion" in record:
            prompt, completion = record["prompt"], record["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise ConfigError(f"{where}: prompt and completion must be strings.")
            if not completion.strip():
                raise ConfigError(f"{where}: the completion is empty; a record needs an "
                                  "answer to learn (drop the record or fill it in).")  # fmt: skip
            return prompt + completion, [(len(prompt), len(prompt) + len(completion))], True
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f'{where}: a record is {{"prompt": ..., "completion": ...}} or {{"messages": '
            f'[{{"role": ..., "content": ...}}, ...]}}; this one has {keys}.'
        )

    def render_chat(self, messages: Any, where: str) -> tuple[str, list[tuple[int, int]], bool]:
        if not self.tok.chat_template:
            raise ConfigError(
                f"{where} is a chat record, but data.tokenizer={self.cfg.tokenizer} has no chat "
                "template: give a folder whose tokenizer_config.json (or chat_template.jinja) "
                "has one, or write the records as prompt/completion."
            )
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages
        ):  # fmt: skip
            raise ConfigError(f'{where}: "messages" must be a list of {{"role": ..., '
                              '"content": ...}} with string values.')  # fmt: skip
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise ConfigError(
                f"{where}: the chat has no assistant turn, so nothing to learn; add one "
                '({"role": "assistant", ...}) or drop the record.'
            )
        text = self.template(messages)
        if self.cfg.train_on == "all":
            return text, [], False  # every token labelled: no turn to find
        spans = []
        for i in turns:
            start = self.template(messages[:i], prompt=True) if i else ""
            end = self.template(messages[: i + 1])
            if not (text.startswith(end) and end.startswith(start)):
                raise ConfigError(
                    f"{where}: the chat template renders a turn differently once later turns "
                    "follow it, so the assistant's tokens cannot be found; use "
                    "data.train_on=all for this template."
                )
            spans.append((len(start), len(end)))
        return text, spans, False

    def template(self, messages: list[dict[str, Any]], prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=prompt)  # fmt: skip

    def encode(self, records: list[tuple[str, Any]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every record's ids and labelled mask, in order."""
        rendered = [self.render(record, where) for where, record in records]
        ids: list[np.ndarray] = [np.zeros(0, np.int64)] * len(records)
        labelled = list(ids)
        for special in (True, False):
            chosen = [i for i, r in enumerate(rendered) if r[2] == special]
            for a in range(0, len(chosen), CHUNK):
                part = chosen[a : a + CHUNK]
                enc = self.tok([rendered[i][0] for i in part], add_special_tokens=special,
                               return_offsets_mapping=True)  # fmt: skip
                for i, row, offsets in zip(part, enc["input_ids"], enc["offset_mapping"],
                                           strict=True):  # fmt: skip
                    ids[i], labelled[i] = self.mark(row, offsets, rendered[i][1], special)
        return ids, labelled

    def mark(
        self, row: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
        special: bool,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        ids = np.asarray(row, dtype=np.int64)
        starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
        ends = np.asarray([o[1] for o in offsets], dtype=np.int64)
        real = ends > starts  # special tokens have empty offsets
        mask = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            mask |= real & (starts >= a) & (starts < b)
        eos = self.tok.eos_token_id
        if special and eos is not None and (not len(ids) or ids[-1] != eos):
            # The model learns to stop after the completion
            ids, mask = np.append(ids, eos), np.append(mask, True)
        if self.cfg.train_on == "all":
            mask[:] = True
        return ids, mask


# ---- the per-node cache ----------------------------------------------------------------------


def cache_key(cfg: SFTData, files: list[Source]) -> str:
    folder = tokenizer_folder(cfg)
    tokenizer = [hashlib.sha1((folder / f).read_bytes()).hexdigest()
                 for f in HF_TOKENIZER_FILES if (folder / f).is_file()]  # fmt: skip
    parts = [ENCODING, [f.identity() for f in files], tokenizer, cfg.train_on, cfg.max_length,
             cfg.overflow, cfg.val_fraction, cfg.split_seed]  # fmt: skip
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:20]


def prepared(cfg: SFTData) -> Path:
    """The folder of this node's tokenized splits (train.npz, val.npz, stats.json), made by
    one process of the node."""
    train, val = sources(cfg)
    files = [train] + ([val] if val else [])
    base = Path(cfg.cache_dir) if cfg.cache_dir else user_cache("sft")
    return made_once(base / cache_key(cfg, files), lambda tmp: tokenize(cfg, train, val, tmp))


def tokenize(cfg: SFTData, train: Source, val: Source | None, out: Path) -> None:
    encoder = Encoder(open_tokenizer(cfg), cfg)
    stats = {"truncated": 0, "unlabelled": 0, "longest": 0, "chat": False}
    splits = {}
    for name, source in (("train", train), ("val", val)):
        if source is None:
            continue
        records = read_records(source)
        stats["chat"] |= any(isinstance(r, dict) and "messages" in r for _, r in records)
        ids, labelled = encoder.encode(records)
        splits[name] = fit(cfg, records, ids, labelled, stats)
    if val is None:
        splits["train"], splits["val"] = held_out(cfg, splits["train"], train.where)
    out.mkdir(parents=True)
    for name, (ids, labelled) in splits.items():
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in ids])]).astype(np.int64)
        np.savez(out / f"{name}.npz", ids=np.concatenate(ids).astype(np.int32),
                 labelled=np.concatenate(labelled), offsets=offsets)  # fmt: skip
    (out / "stats.json").write_text(json.dumps(stats))


def fit(cfg: SFTData, records: list[tuple[str, Any]], ids: list[np.ndarray],
        labelled: list[np.ndarray], stats: dict[str, Any]) -> tuple[list, list]:  # fmt: skip
    """Rows cut to ``data.max_length`` (or refused), counted in ``stats``."""
    for k, (where, _) in enumerate(records):
        n = len(ids[k])
        stats["longest"] = max(stats["longest"], n)
        if n > cfg.max_length:
            if cfg.overflow == "error":
                raise ConfigError(
                    f"{where} has {n} tokens, more than data.max_length={cfg.max_length}: "
                    "raise data.max_length, or set data.overflow=truncate to cut such records."
                )
            ids[k], labelled[k] = ids[k][: cfg.max_length], labelled[k][: cfg.max_length]
            stats["truncated"] += 1
        if not labelled[k][1:].any():  # the first token is never a target
            stats["unlabelled"] += 1
    return ids, labelled


def held_out(cfg: SFTData, split: tuple[list, list], where: str) -> tuple[tuple, tuple]:
    ids, labelled = split
    n = len(ids)
    order = np.random.default_rng(cfg.split_seed).permutation(n)
    k = max(1, round(n * cfg.val_fraction))
    if k >= n:
        raise ConfigError(f"{where} has {n} records: too few to hold out data.val_fraction="
                          f"{cfg.val_fraction} and train on the rest.")  # fmt: skip
    val, train = sorted(order[:k].tolist()), sorted(order[k:].tolist())
    return ([ids[i] for i in train], [labelled[i] for i in train]), \
        ([ids[i] for i in val], [labelled[i] for i in val])  # fmt: skip


class Records:
    """A tokenized split: record ``i`` is ``ids[offsets[i]:offsets[i + 1]]``. Packed
    (``pack``), sample ``k`` is the records ``rows[k]`` to ``rows[k + 1]``."""

    def __init__(self, path: Path, pack: int | None = None) -> None:
        with np.load(path) as f:
            self.ids, self.labelled, self.offsets = f["ids"], f["labelled"], f["offsets"]
        self.rows = packed_rows(np.diff(self.offsets), pack) if pack else None

    def __len__(self) -> int:
        return len(self.offsets) - 1 if self.rows is None else len(self.rows) - 1

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.labelled[a:b]

    def sample(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample ``k``'s inputs, targets and positions: each record's ids but its last, its
        ids shifted by one (ignored where unlabelled), positions from 0, record after record;
        so no target and no position crosses from one record into the next."""
        records = [k] if self.rows is None else range(self.rows[k], self.rows[k + 1])
        parts = [self.row(i) for i in records]
        x = np.concatenate([ids[:-1] for ids, _ in parts])
        y = np.concatenate([np.where(m[1:], ids[1:], IGNORE_LABEL) for ids, m in parts])
        positions = np.concatenate([np.arange(len(ids) - 1) for ids, _ in parts])
        return x, y, positions


def packed_rows(lengths: np.ndarray, width: int) -> np.ndarray:
    """Row boundaries over the records in their order: a row takes records while their inputs
    (a record's length less one) fit ``width - 1``, the inputs of one record at most."""
    bounds, used = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if used and used + n - 1 > width - 1:
            bounds.append(i)
            used = 0
        used += n - 1
    bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


class RecordLoader:
    """Batches of (inputs, targets): (rows, longest) int64 inputs, a record's ids but its
    last; targets the ids shifted by one, ignored where unlabelled or padded. Packed rows'
    inputs are (rows, 2, longest): the ids over their positions, which restart at 0 with
    each record (``CausalLM`` keeps records apart by them). The sampler's padding markers
    get all-ignored targets."""

    def __init__(self, records: Records, sampler: Sampler, batch_size: int,
                 device: torch.device, pad_id: int) -> None:  # fmt: skip
        self.dataset, self.sampler, self.batch_size = records, sampler, batch_size
        self.device, self.pad_id = device, pad_id

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = np.fromiter(iter(self.sampler), dtype=np.int64)
        pin = self.device.type == "cuda"
        for b in range(0, len(order), self.batch_size):
            x, y = self.batch(order[b : b + self.batch_size])
            if pin:
                x, y = x.pin_memory(), y.pin_memory()
            yield x.to(self.device, non_blocking=pin), y.to(self.device, non_blocking=pin)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        samples = [self.dataset.sample(int(i if i >= 0 else ~i)) for i in indices]
        width = max(len(x) for x, _, _ in samples)
        x = np.full((len(samples), width), self.pad_id, dtype=np.int64)
        y = np.full((len(samples), width), IGNORE_LABEL, dtype=np.int64)
        # The padding's positions start again from 0: a record of its own, seen by no other
        positions = np.tile(np.arange(width), (len(samples), 1))
        for k, (ids, targets, pos) in enumerate(samples):
            x[k, : len(ids)], positions[k, : len(ids)] = ids, pos
            if indices[k] >= 0:
                y[k, : len(ids)] = targets
        if self.dataset.rows is not None:
            x = np.stack([x, positions], axis=1)
        return torch.from_numpy(x), torch.from_numpy(y)


# ---- the family's functions (ddp_utils.data.registry) ----------------------------------------


def resolve(cfg: SFTData, rt: Runtime) -> SFTData:
    """Every rank: the vocabulary sized from the model folder, and the records tokenized (once
    per node) now, so that a bad record stops the run before anything is built."""
    tok = open_tokenizer(cfg)
    vocab = model_vocab(cfg, tok)
    folder = prepared(cfg)
    stats = json.loads((folder / "stats.json").read_text())
    if rt.is_main and (stats["truncated"] or stats["unlabelled"]):
        print(f"data=sft: {stats['truncated']} records cut to data.max_length={cfg.max_length} "
              f"(the longest has {stats['longest']} tokens); {stats['unlabelled']} have no "
              "labelled token left and add nothing to the loss.", flush=True)  # fmt: skip
    return replace(cfg, vocab_size=vocab, num_classes=vocab)


def pad_id(cfg: SFTData) -> int:
    tok = open_tokenizer(cfg)
    return int(next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0))


def eval_loader(cfg: SFTData, rt: Runtime, split: str) -> RecordLoader:
    """``split``'s records, a record a row, in exact evaluation shards."""
    records = Records(prepared(cfg) / f"{split}.npz")
    batch = cfg.eval_batch_size or cfg.batch_size
    sampler = EvalShardSampler(len(records), rt.world_size, rt.rank, batch)
    return RecordLoader(records, sampler, batch, rt.device, pad_id(cfg))


def tokenizer_spec(cfg: SFTData) -> dict[str, Any]:
    """What generate.py rebuilds the tokenizer from: the folder, and whether the records were
    chats (then prompts go through the chat template)."""
    stats = json.loads((prepared(cfg) / "stats.json").read_text())
    return {"kind": "hf", "folder": str(tokenizer_folder(cfg)), "source": cfg.tokenizer,
            "chat": bool(stats["chat"])}  # fmt: skip


def build(cfg: SFTData, rt: Runtime, seed: int, channels_last: bool | str) -> DataBundle:
    """Training rows (packed with data.packing) in the resumable sampler's order, and the
    validation records a record a row, so that its numbers are the unpacked ones."""
    train = Records(prepared(cfg) / "train.npz", cfg.max_length if cfg.packing else None)
    sampler = training_sampler(len(train), cfg, rt, seed)
    return DataBundle(
        RecordLoader(train, sampler, cfg.batch_size, rt.device, pad_id(cfg)),
        eval_loader(cfg, rt, "val"), sampler,
        nn.Identity(), nn.Identity(), unit=Unit("rec"),
        checkpoint_extras={"tokenizer": tokenizer_spec(cfg)},
    )  # fmt: skip


def build_eval(cfg: SFTData, rt: Runtime, seed: int, channels_last: bool | str) -> EvalData:
    return EvalData(eval_loader(cfg, rt, cfg.split), nn.Identity(), None)
