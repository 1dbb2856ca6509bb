"""Whether a run continues from a checkpoint, and from which: ``resume=auto`` (the newest that
loads), ``resume=never``, or ``resume=PATH``; a checkpoint of another experiment (another
model, data set or seed) is refused with the keys that differ."""

from __future__ import annotations

from typing import Any

from ddp_utils.checkpoint.format import load_checkpoint, newest_loadable
from ddp_utils.checkpoint.state import TrainingState, restore
from ddp_utils.checkpoint.storage import Storage
from ddp_utils.config import ConfigError, TrainConfig, UserError, as_plain_dict, option_defaults
from ddp_utils.config.schema import DEPRECATED_KEYS
from ddp_utils.data.classes import class_difference
from ddp_utils.dist import broadcast_object
from ddp_utils.logs import log
from ddp_utils.run.records import set_aside_metrics, trim_metrics


def identity_keys(cfg: TrainConfig) -> tuple[str, ...]:
    """Keys whose change makes a checkpoint belong to another experiment: the model (all of
    it), what the data and task options declare (``identity``: the data set, its split, the
    objective), and the seed (it decides every epoch's sample order, which a mid-epoch resume
    continues)."""
    return ("seed", "model.", *(f"data.{k}" for k in type(cfg.data).identity),
            *(f"task.{k}" for k in type(cfg.task).identity))  # fmt: skip


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _is_identity(key: str, identity: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k if k.endswith(".") else f"{k}.") for k in identity)


# Not compared: where to resume from, and the deprecated flat keys (their values moved).
UNCOMPARED = {"resume", *(f"trainer.{k}" for k in DEPRECATED_KEYS)}


def config_changes(stored: dict[str, Any], cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(refused, allowed) changes between a checkpoint's config and this run's, as 'key: a -> b'.

    A key the checkpoint's release did not have yet (``task.*`` before tasks existed) counts
    as its default then: what that release did. A key this run's option has no longer (older
    releases stored every data option's keys) is not compared."""
    plain = as_plain_dict(cfg)
    new = _flatten(plain)
    base = as_plain_dict(TrainConfig())  # a group the checkpoint lacks had its default option
    record = {g: stored.get(g, base[g]) for g in base} | stored
    old = _flatten(as_plain_dict(option_defaults(cfg))) | _flatten(record)
    old = {k: v for k, v in old.items() if _field_of(k, plain)}
    refused, allowed, identity = [], [], identity_keys(cfg)
    for key in sorted(old.keys() | new.keys()):
        if key in UNCOMPARED or old.get(key) == new.get(key):
            continue
        change = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        is_identity = _is_identity(key, identity)
        (refused if is_identity else allowed).append(change)
    return refused, allowed


def _field_of(key: str, cfg: dict[str, Any]) -> bool:
    """Whether ``key``'s group and field (``data.kwargs`` of ``data.kwargs.limit``) are in
    ``cfg``."""
    node: Any = cfg
    for part in key.split(".")[:2]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def pick_checkpoint(
    resume_from: str, storage: Storage, storage_options: dict[str, Any]
) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint ``resume`` names, loaded, or None to start fresh (main rank)."""
    if resume_from == "never":
        if storage.holds_any():
            raise ConfigError(
                f"resume=never but {storage.where} already holds checkpoints. Continue the "
                "run with resume=auto, or start fresh with another run_dir=PATH (and "
                "trainer.checkpoint.dir)."
            )
        return None
    if resume_from == "auto":
        return newest_loadable(storage, log.warning)
    return resume_from, load_checkpoint(resume_from, storage_options=storage_options)


def resume(tr: TrainingState) -> None:
    """Restore ``tr`` from the checkpoint that ``resume`` names, if any (same on every rank).

    The main rank chooses (and loads) it; the others learn the path, or the error, from it.
    """
    picked, error = None, None
    if tr.rt.is_main:
        try:
            picked = pick_checkpoint(tr.cfg.resume, tr.checkpointer.storage,
                                     tr.cfg.trainer.checkpoint.storage_options)  # fmt: skip
        except UserError as e:
            error = str(e)
    path, error = broadcast_object((picked[0] if picked else None, error))
    if error:
        raise ConfigError(error)
    if path is None:
        set_aside_metrics(tr.run_dir / "metrics.jsonl", tr.rt)
        return
    options = tr.cfg.trainer.checkpoint.storage_options
    ckpt = picked[1] if picked else load_checkpoint(path, storage_options=options)
    refused, allowed = config_changes(ckpt["config"], tr.cfg)
    if refused:
        raise ConfigError(
            f"cannot resume from {path}: this run changes the model, data set or seed:\n  "
            + "\n  ".join(refused)
            + "\nResume with the checkpoint's settings, or start a new run (another run_dir)."
        )
    stored_classes = ckpt.get("classes")
    if (
        stored_classes is not None
        and tr.data.classes is not None
        and stored_classes != tr.data.classes
    ):
        diff = class_difference(stored_classes, tr.data.classes, "the checkpoint", "the data")
        raise ConfigError(
            f"cannot resume from {path}: its classes differ from the data's now ({diff}). "
            "Restore the class folders, or start a new run (another run_dir)."
        )
    if allowed:
        log.info("resuming with changed settings: %s", "; ".join(allowed))
    restore(tr, ckpt)
    trim_metrics(tr.run_dir / "metrics.jsonl", tr.step, tr.rt)
    log.info(
        "resumed from %s: epoch %d, step %d, %d samples into the epoch (saved at world size %d)",
        path, tr.epoch, tr.step, tr.sample_offset, ckpt["world_size"],
    )  # fmt: skip
