"""Token folders for the language-model tests, written with numpy in nanoGPT's layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHARS = "abcdefghijklmnopqrstuvwxyz .,\n"


def markov_text(n: int, seed: int) -> str:
    """Text with structure to learn: each character mostly follows from the one before."""
    rng = np.random.default_rng(seed)
    nxt = rng.integers(len(CHARS), size=(len(CHARS), 3))
    ids, i = [], 0
    for r in rng.random(n):
        i = nxt[i, 0] if r < 0.6 else nxt[i, 1] if r < 0.85 else nxt[i, 2] if r < 0.95 else (
            rng.integers(len(CHARS)))  # fmt: skip
        ids.append(i)
    return "".join(CHARS[j] for j in ids)


def write_token_folder(root: Path, train_tokens: int, val_tokens: int, dtype: str = "uint16",
                       meta: bool = True, seed: int = 0) -> Path:  # fmt: skip
    """train.bin / val.bin of the char ids of ``markov_text`` and a char meta.json."""
    root.mkdir(parents=True, exist_ok=True)
    chars = sorted(CHARS)
    index = {c: i for i, c in enumerate(chars)}
    text = markov_text(train_tokens + val_tokens, seed)
    ids = np.array([index[c] for c in text], dtype=dtype)
    ids[:train_tokens].tofile(root / "train.bin")
    ids[train_tokens:].tofile(root / "val.bin")
    if meta:
        spec = {"kind": "char", "chars": chars}
        (root / "meta.json").write_text(json.dumps(
            {"vocab_size": len(chars), "dtype": dtype, "tokenizer": spec,
             "token_bytes": [1] * len(chars)}))  # fmt: skip
    return root


def split_into_shards(root, folder, cuts: list[int], llmc: int = -1):
    """``folder/train/*.bin`` and ``folder/val/*.bin``: the single files of ``root`` cut at
    ``cuts`` (shard ``llmc`` with llm.c's 1024-byte header), and the same meta.json."""
    for split in ("train", "val"):
        ids = np.fromfile(root / f"{split}.bin", dtype=np.uint16)
        (folder / split).mkdir(parents=True)
        edges = [0, *[c for c in cuts if c < len(ids)], len(ids)]
        for k, (a, b) in enumerate(zip(edges, edges[1:], strict=False)):
            with open(folder / split / f"part-{k:03d}.bin", "wb") as f:
                if k == llmc:
                    header = np.zeros(256, dtype="<i4")
                    header[:3] = [20240520, 1, b - a]
                    f.write(header.tobytes())
                f.write(ids[a:b].tobytes())
    (folder / "meta.json").write_text((root / "meta.json").read_text())
    return folder
