"""data=pystdlib: an embedded text corpus that needs no download.

The running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``): every
``.py`` file below it except the folders named ``test``, ``tests``, ``idle_test`` and
``site-packages`` (and ``__pycache__``), in sorted order of their POSIX paths relative to the
stdlib folder, each closed by a newline. Prepared once per (Python version, tokenizer,
val_fraction) into ``data.root`` (null: ``$XDG_CACHE_HOME/ddp-recipes/pystdlib/...``, by default
under ``~/.cache``) and reused. The same Python version gives the same files and tokens on
every machine, unless a distribution patched its standard library.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

from ddp_utils.config import ConfigError, PyStdlibData
from ddp_utils.data.text.tokens import build, build_eval, offered
from ddp_utils.data.text.tokens import resolve as resolve_tokens
from ddp_utils.dist import Runtime, local_main_first
from ddp_utils.logs import log

__all__ = ["build", "build_eval", "offered", "prepare_pystdlib", "resolve"]

SKIPPED = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def stdlib_files() -> tuple[Path, list[Path]]:
    """The stdlib folder and its .py files, in the corpus' order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIPPED & set(p.relative_to(root).parts)]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def prepare_pystdlib(cfg: PyStdlibData) -> Path:
    """Write the corpus' token files unless the folder already holds this source's."""
    from ddp_utils.data.text.text import prepare

    out = cfg.folder()
    meta = out / "meta.json"
    key = cfg.source_key()
    source = json.loads(meta.read_text()).get("source", "") if meta.is_file() else ""
    if source == key:
        return out
    if out.is_dir() and any(out.iterdir()) and not source.startswith("python"):
        raise ConfigError(
            f"data.root={out} holds files that are not a data=pystdlib corpus; nothing there "
            "was changed. Point data.root at a new or empty folder (or drop it: the cache)."
        )
    stdlib, files = stdlib_files()
    log.info("data=pystdlib: tokenizing %d .py files of %s into %s (once)", len(files),
             stdlib, out)  # fmt: skip
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    prepare(tmp, files, cfg.tokenizer, None, cfg.val_fraction, progress=False,
            extra={"source": key, "files": len(files)})  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def resolve(cfg: PyStdlibData, rt: Runtime) -> PyStdlibData:
    """Every rank: the corpus prepared once per node, then read as data=tokens reads its files."""
    with local_main_first(rt):
        if rt.is_local_main:
            prepare_pystdlib(cfg)
    return resolve_tokens(cfg, rt)
