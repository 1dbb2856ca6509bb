"""Text files to token files (``train.bin``, ``val.bin``, ``meta.json``): what
``python -m ddp_utils.prepare_text`` and ``data=pystdlib`` write. Files are read one at a time,
so the input may be larger than memory."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ddp_utils.config import ConfigError
from ddp_utils.data.text.tokenizer import (
    TOKENIZER_KINDS,
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    train_bpe,
)
from ddp_utils.files import atomic_write_text

CHUNK = 1 << 22  # tokens copied at a time when splitting


def text_files(sources: list[Path]) -> list[Path]:
    """The files of ``sources``: each file as given, each folder's files in sorted order."""
    files: list[Path] = []
    for src in sources:
        if src.is_dir():
            files += sorted(p for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif src.is_file():
            files.append(src)
        else:
            raise ConfigError(f"{src}: no such file or folder.")
    return files


def read_text(path: Path) -> str:
    """A file's text; a binary or non-UTF-8 file is refused by name."""
    data = path.read_bytes()
    if b"\0" in data:
        raise ConfigError(f"{path} is binary (it holds NUL bytes), not text: give text files only.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {e.start}: {data[e.start : e.start + 1]!r}); "
            "convert it (iconv -t utf-8) or leave it out."
        ) from None


def texts(files: list[Path], progress: bool, desc: str) -> Iterator[str]:
    """Each file's text, with a progress bar over bytes; a newline ends each file that a
    next one follows (one file is read as it is: nanoGPT's bytes for nanoGPT's text)."""
    total = sum(p.stat().st_size for p in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        for i, path in enumerate(files):
            text = read_text(path)
            bar.update(path.stat().st_size)
            last = i == len(files) - 1
            yield text if last or text.endswith("\n") or not text else text + "\n"


def learn_tokenizer(
    kind: str, files: list[Path], vocab_size: int | None, progress: bool
) -> Tokenizer:
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "char":
        chars: set[str] = set()
        for text in texts(files, progress, "characters"):
            chars.update(text)
        return CharTokenizer(chars)
    if not vocab_size:
        raise ConfigError("--tokenizer=bpe needs --vocab_size=N (e.g. 4096).")
    return train_bpe(texts(files, progress, "learning bpe"), vocab_size)


# What prepare writes: a folder that holds any of them is another preparation's.
PREPARED = ("train.bin", "val.bin", "meta.json", "meta.pkl", "tokenizer.json")


def prepare(
    out: Path,
    files: list[Path],
    kind: str = "char",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    progress: bool = True,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write OUT's files from ``files``; returns meta.json's contents. ``extra`` goes into
    meta.json too (data=pystdlib's source description)."""
    if kind not in TOKENIZER_KINDS:
        raise ConfigError(f"--tokenizer={kind}: choose one of {', '.join(TOKENIZER_KINDS)}.")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"--val_fraction={val_fraction} must lie strictly between 0 and 1.")
    if not files or sum(p.stat().st_size for p in files) == 0:
        raise ConfigError("no text to prepare: the sources are empty; give non-empty text files.")
    taken = sorted(set(PREPARED) & {p.name for p in out.iterdir()}) if out.is_dir() else []
    if taken and not overwrite:
        raise ConfigError(f"{out} already holds prepared files ({', '.join(taken)}): choose a "
                          "new folder, or pass --overwrite to replace them.")  # fmt: skip
    tokenizer = learn_tokenizer(kind, files, vocab_size, progress)
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    out.mkdir(parents=True, exist_ok=True)
    whole = out / "all.bin.tmp"
    with open(whole, "wb") as f:
        for text in texts(files, progress, "tokenizing"):
            f.write(tokenizer.encode(text).astype(dtype).tobytes())
    tokens = np.memmap(whole, dtype=dtype, mode="r")
    n = len(tokens)
    # nanoGPT's rule (data/*/prepare.py): training is the first int(n * 0.9) tokens.
    n_val = n - int(n * (1.0 - val_fraction))
    if n_val < 1 or n_val >= n:
        whole.unlink()
        raise ConfigError(f"--val_fraction={val_fraction} of {n} tokens leaves an empty split; "
                          "give more text or another fraction.")  # fmt: skip
    for name, part in (("train.bin", tokens[: n - n_val]), ("val.bin", tokens[n - n_val :])):
        with open(out / name, "wb") as f:
            for i in range(0, len(part), CHUNK):
                f.write(part[i : i + CHUNK].tobytes())
    del tokens
    whole.unlink()
    spec = tokenizer.spec()
    if kind == "bpe":
        (out / "tokenizer.json").write_text(spec.pop("json"))
        spec["file"] = "tokenizer.json"
    meta = {
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype,
        "tokenizer": spec,
        "token_bytes": tokenizer.token_bytes(),
        "train_tokens": n - n_val,
        "val_tokens": n_val,
        **(extra or {}),
    }
    if kind == "char":  # nanoGPT's sample.py reads this; we never unpickle it
        with open(out / "meta.pkl", "wb") as f:
            itos = dict(enumerate(tokenizer.chars))
            pickle.dump(
                {
                    "vocab_size": tokenizer.vocab_size,
                    "itos": itos,
                    "stoi": {c: i for i, c in itos.items()},
                },
                f,
            )
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=1))  # last: complete now
    return meta
