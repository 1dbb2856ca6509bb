"""What a checkpoint is on disk, and how it is read back: one whole file (``step_<N>.pt``,
written by the main rank) or, when the strategy shards parameters, a folder
(``step_<N>.dcp/``, written by every rank with torch.distributed.checkpoint). Loaded safely
(weights only, a torn file named).

A training checkpoint is a dict of plain tensors and containers: ``model``, ``optimizer``,
``scheduler``, ``scaler``, ``strategy`` (its own state: PowerSGD's), ``epoch``, ``step``,
``sample_offset``, ``epoch_totals``, ``sampler``, ``rng`` (every rank's), ``best``,
``best_ema``, ``model_ema`` (with EMA), ``world_size``, ``classes``, ``samples_seen``,
``trackers``, ``config`` (the run's whole config), and what the data adds for inference
(``tokenizer``).

A sharded checkpoint holds ``model``, ``optimizer`` and ``model_ema`` as shards
(``.metadata`` and one ``.distcp`` file a rank), the rest in ``meta.pt`` (the main rank's,
read with ``weights_only``). Any world size reads it (resharded to its own);
``python -m ddp_utils.checkpoint export`` turns it into one whole file. Where the bytes go,
and what makes a checkpoint complete, is ``storage``'s; how a save runs is ``save``'s."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from ddp_utils.checkpoint.storage import (
    META,
    SHARDED_SUFFIX,
    LocalFolder,
    ObjectStore,
    Storage,
    open_storage,
)
from ddp_utils.config import ConfigError, UserError, whole_sentences
from ddp_utils.urls import fs_options, is_url, local_path

SHARDED_KEYS = ("model", "optimizer", "model_ema")  # the states a sharded checkpoint shards
SHARDED_DIR = "sharded_dir"  # where a loaded sharded checkpoint's shards are
SHARDED_OPTIONS = "sharded_storage_options"  # and the fsspec options to read them with


def shard_reader(ckpt: dict[str, Any]) -> Any:
    """The DCP reader of a loaded sharded checkpoint's shards, in a folder or on a store."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    where = ckpt[SHARDED_DIR]
    if is_url(where):
        return FsspecReader(where, **fs_options(where, ckpt.get(SHARDED_OPTIONS) or {}))
    return dcp.FileSystemReader(where)


def read_sharded(ckpt: dict[str, Any], template: dict[str, Any], alone: bool = False) -> None:
    """Fill ``template`` (state dicts as the reader holds them: shards of its own world size,
    or whole tensors) from a sharded checkpoint. Every rank calls it, unless ``alone``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(template, storage_reader=shard_reader(ckpt), no_dist=alone)


def read_all_shards(ckpt: dict[str, Any]) -> dict[str, Any]:
    """Every sharded state of the checkpoint, whole, in this one process: what torch's
    ``format_utils.dcp_to_torch_save`` does, from a folder or a store."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    whole: dict[str, Any] = {}
    _load_state_dict(whole, storage_reader=shard_reader(ckpt),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)  # fmt: skip
    return whole


def newest_loadable(
    storage: Storage, warn: Callable[[str], None]
) -> tuple[str, dict[str, Any]] | None:
    """The newest complete checkpoint in ``storage`` that loads, with its contents; a torn one
    is skipped with a warning. None when there is none at all; when there are some but none
    loads, ConfigError with what was tried (training over the run would lose it). An unsafe
    file is not skipped: it raises, since someone put it there."""
    tried = []
    for name in storage.complete():
        ref = storage.ref(name)
        try:
            return ref, load_from(storage, name)
        except CorruptCheckpointError as e:
            warn(f"skipping a checkpoint that does not load: {e}")
            tried.append(f"{name} ({e.reason})")
    if not tried:
        return None
    others = ""
    if isinstance(storage, LocalFolder):
        names = sorted(p.name for p in storage.folder.glob("*.pt") if p.name not in tried)
        others = f" Other files there: {', '.join(names)}." if names else ""
    raise ConfigError(
        f"resume=auto found checkpoints in {storage.where} but none loads: {'; '.join(tried)}."
        f"{others} Nothing was trained over them. Resume from a file you trust with "
        "resume=PATH, or start a new run with resume=never and another run_dir=PATH."
    )


def summary(e: BaseException) -> str:
    """What went wrong: the first line of the error, in whole sentences, else its type."""
    text = str(e).strip()
    return whole_sentences(text.splitlines()[0] if text else "") or type(e).__name__


def _blocked_global(e: BaseException) -> str:
    for line in str(e).splitlines():
        if "Unsupported global" in line or "GLOBAL" in line:
            return whole_sentences(line.strip()) or "an unsupported global"
    return summary(e)


def load_checkpoint(path: str | Path, mmap: bool = False,
                    storage_options: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Load with ``weights_only=True``; a missing, corrupt or unsafe file raises ConfigError.
    ``path`` may be a URL (``s3://bucket/run/checkpoints/best.pt``: a step, or the step a
    ``last``/``best`` marker names). ``mmap``: map the tensors instead of reading them (to
    look at the config alone)."""
    if is_url(path):
        folder, _, name = str(path).rstrip("/").rpartition("/")
        return load_from(open_storage(folder, storage_options), name)
    path = Path(local_path(str(path)))
    if path.is_dir():
        return load_sharded_meta(path)
    if not path.is_file():
        raise ConfigError(
            f"checkpoint={path}: no such file; pass the path of a .pt file (or .dcp folder) "
            "written by train.py (e.g. outputs/<run>/checkpoints/best.pt), or its URL."
        )
    return torch_load(path, str(path), mmap)


def load_from(storage: Storage, name: str) -> dict[str, Any]:
    """The checkpoint ``name`` in ``storage`` (on a store: a complete step, or the step a
    marker names)."""
    if isinstance(storage, LocalFolder):
        return load_checkpoint(storage.folder / name)
    assert isinstance(storage, ObjectStore)
    try:
        name = storage.resolve(name)
        if not storage.is_complete(name):
            raise CorruptCheckpointError(
                f"checkpoint={storage.ref(name)} is not complete (its save did not finish: "
                "no commit marker). Use another checkpoint of the run.",
                "no commit marker",
            )
        if name.endswith(SHARDED_SUFFIX):
            meta = torch_load(storage.open(f"{name}/{META}"), storage.ref(name))
            return meta | {SHARDED_DIR: storage.ref(name), SHARDED_OPTIONS: storage.options}
        return torch_load(storage.open(name), storage.ref(name))
    except (UserError, PermissionError):
        raise
    except FileNotFoundError as e:
        raise _corrupt(storage.ref(name), e) from None
    except Exception as e:  # noqa: BLE001 - any transport error of any fsspec backend
        raise ConfigError(f"cannot read checkpoint={storage.ref(name)} ({summary(e)}). Check "
                          "the URL and the credentials (AWS_ACCESS_KEY_ID / "
                          "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).") from None  # fmt: skip


def torch_load(source: Path | IO[bytes], where: str, mmap: bool = False) -> dict[str, Any]:
    """``torch.load`` of a train.py checkpoint, refusing what would run code."""
    try:
        ckpt = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            # Never retried with weights_only=False: that would run whatever the file holds.
            raise ConfigError(
                f"checkpoint={where} refused: loading it would need arbitrary unpickling "
                f"({_blocked_global(e)}), which can run code. Load only checkpoints written "
                "by train.py."
            ) from None
        raise _corrupt(where, e) from None
    except Exception as e:  # torch.load reports torn files as RuntimeError, KeyError, EOFError...
        raise _corrupt(where, e) from None
    if (
        not isinstance(ckpt, dict)
        or "config" not in ckpt
        or not ("model" in ckpt or "sharded" in ckpt)
    ):
        raise ConfigError(f"checkpoint={where} was not written by train.py (no model/config keys).")
    return ckpt


def load_sharded_meta(path: Path) -> dict[str, Any]:
    """A sharded checkpoint's plain part, with where its shards are (``SHARDED_DIR``)."""
    for part in (".metadata", META):
        if not (path / part).is_file():
            raise _corrupt(path, FileNotFoundError(f"no {part} in {path.name}"))
    return load_checkpoint(path / META) | {SHARDED_DIR: str(path)}


class CorruptCheckpointError(UserError):
    """A checkpoint that is torn or unreadable (as opposed to unsafe or missing)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _corrupt(path: str | Path, e: BaseException) -> ConfigError:
    reason = summary(e)
    return CorruptCheckpointError(
        f"checkpoint={path} is corrupt or truncated ({reason}). Use another checkpoint of the "
        "run (last.pt, best.pt) or train again.",
        reason,
    )


def read_states(ckpt: dict[str, Any], templates: Callable[[], dict[str, Any]],
                shards_parameters: bool) -> dict[str, Any]:  # fmt: skip
    """The checkpoint's ``model``, ``optimizer`` and ``model_ema`` states as the strategy loads
    them: a whole file's as they are; a sharded folder's read into ``templates()`` (this run's
    own state dicts, resharded to this world size). Every rank calls it."""
    if SHARDED_DIR not in ckpt:
        return ckpt
    if not shards_parameters:
        raise ConfigError(
            f"{ckpt[SHARDED_DIR]} is a sharded checkpoint: resume it with the strategy "
            f"that wrote it (trainer.strategy={ckpt['config']['trainer']['strategy']})."
        )
    template = {k: v for k, v in templates().items() if k != "model_ema" or k in ckpt["sharded"]}
    read_sharded(ckpt, template)
    return template
