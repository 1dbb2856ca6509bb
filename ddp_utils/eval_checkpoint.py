"""eval.py's phases: the checkpoint's config with the user's overrides, scoring, the report."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from ddp_utils.checkpoint import inference_model, load_checkpoint
from ddp_utils.config import (
    ConfigError,
    DataConfig,
    TrainConfig,
    as_plain_dict,
    from_record,
    to_schema,
)
from ddp_utils.data import build_eval_data, close_loader, resolve_data
from ddp_utils.data.classes import class_difference
from ddp_utils.dist import Runtime, init_distributed
from ddp_utils.evaluation import build_metrics, evaluate, scalars
from ddp_utils.files import atomic_write_text
from ddp_utils.lifecycle.disk import writing_into
from ddp_utils.lifecycle.watchdog import StepWatchdog
from ddp_utils.logs import log, setup_logging
from ddp_utils.models import memory_format_of
from ddp_utils.tasks import build_task, check_task, draw_predictions
from ddp_utils.train.precision import amp_context, resolve_precision, set_numerics
from ddp_utils.urls import is_url

EVAL_ONLY_KEYS = ("checkpoint", "output", "ema")
REPORT_COUNTS = ("num_samples", "skipped_images", "world_size")  # said in the first line


def command_line_keys(implied: Sequence[str] = ()) -> list[str]:
    """The keys (or groups) the user set on the command line, e.g. ``data.root`` or ``data``;
    not the ``implied`` ones, which eval.py added to compose with the checkpoint's options."""
    overrides = [o for o in HydraConfig.get().overrides.task if o not in implied]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [o.key_or_group for o in parsed]


def checkpoint_config(stored: dict[str, Any], cfg: DictConfig, keys: list[str]) -> TrainConfig:
    """The config the checkpoint was trained with, with the command line's keys taken from
    ``cfg`` (so ``data.root=...`` or a whole group such as ``data=mnist`` override it)."""
    merged = from_record(stored)
    for key in keys:
        if key.split(".")[0] in EVAL_ONLY_KEYS:
            continue
        OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False)
    return to_schema(merged)


def describe(cfg: dict[str, Any]) -> str:
    m, d = cfg["model"], cfg["data"]
    if "block_size" in d:
        return (f"model={m['name']} on data={d['name']} (blocks of {d['block_size']} tokens, "
                f"{d['num_classes']} ids)")  # fmt: skip
    shape = f"{d['in_channels']}x{d['image_size']}x{d['image_size']}"
    return f"model={m['name']} on data={d['name']} ({shape}, {d['num_classes']} classes)"


def default_output(checkpoint: str) -> Path:
    """``<run_dir>/eval.json`` for a checkpoint at ``<run_dir>/checkpoints/*.pt``; for one at
    a URL, ``eval.json`` in the working directory."""
    if is_url(checkpoint):
        return Path("eval.json").resolve()
    parent = Path(checkpoint).resolve().parent
    run_dir = parent.parent if parent.match("checkpoints") else parent
    return run_dir / "eval.json"


def run_eval(cfg: DictConfig, implied: Sequence[str] = ()) -> dict[str, Any]:
    """Load the checkpoint, join the process group, score the split on every rank, report.
    ``implied``: the overrides eval.py took from the checkpoint (``data=imagefolder``, ...)."""
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ConfigError(
            "checkpoint=PATH is required: python eval.py checkpoint=RUN/checkpoints/best.pt"
        )
    checkpoint = str(cfg.checkpoint)  # a path or a URL
    ckpt = load_checkpoint(checkpoint)
    train_cfg = checkpoint_config(ckpt["config"], cfg, command_line_keys(implied))
    rt = init_distributed(train_cfg.trainer)
    setup_logging(None, rt, "eval")
    train_cfg = dataclasses.replace(train_cfg, data=resolve_data(train_cfg.data, rt))
    task = build_task(train_cfg)
    fix = (f"It was trained as {describe(ckpt['config'])}; this run asks for "
           f"{describe(as_plain_dict(train_cfg))}. Drop the model/data overrides, or evaluate a "
           "checkpoint of that model and data.")  # fmt: skip
    model = inference_model(ckpt, checkpoint, train_cfg, cfg.ema, task.num_outputs(), fix)
    data = train_cfg.data
    # The memory format training validated in: the same kernels, so the same numbers.
    channels_last = train_cfg.trainer.channels_last
    loader, preprocess, classes, skip_bad = build_eval_data(data, rt, train_cfg.seed, channels_last)
    check_classes(ckpt.get("classes"), classes, checkpoint, data)
    precision = resolve_precision(train_cfg.trainer.precision, rt.device, train_cfg.model)
    set_numerics(train_cfg.trainer, rt.device, task.fixed_input_shapes)
    model.to(rt.device, memory_format=memory_format_of(channels_last))
    metrics = build_metrics(train_cfg.task, task, rt.device)
    # A head for another class count, or a metric that cannot take its output, stops here.
    check_task(task, model, metrics, train_cfg, rt.device, amp_context(precision, rt.device))
    watchdog = StepWatchdog(train_cfg.trainer.timeout_s, rt.rank)
    try:
        result = evaluate(model, loader, preprocess, rt, task, metrics,
                          amp_context(precision, rt.device), watchdog,
                          skip_bad=skip_bad)  # fmt: skip
    finally:
        watchdog.close()
        close_loader(loader)
    result.update(world_size=rt.world_size, checkpoint=str(checkpoint), ema=cfg.ema,
                  monitor=train_cfg.task.monitor)  # fmt: skip
    if classes is not None:
        result["classes"] = classes  # the names of the per-class vectors, in their order
    output = Path(cfg.output) if cfg.output else default_output(checkpoint)
    write_report(result, output, f"{data.name}/{data.split}", rt)
    with writing_into(output.parent, key="output"):
        draw_predictions(task, model, loader.dataset, preprocess, rt, classes, output.parent)
    if rt.is_main:
        report_to_tracker(ckpt, train_cfg, checkpoint, output, result)
    return result


def report_to_tracker(ckpt: dict[str, Any], train_cfg: TrainConfig, checkpoint: str,
                      output: Path, result: dict[str, Any]) -> None:  # fmt: skip
    """A checkpoint of a run logged to MLflow: its run gets the evaluation too (a failure
    only warns: eval.json is written)."""
    run_id = ((ckpt.get("trackers") or {}).get("mlflow") or {}).get("run_id")
    if not run_id or "mlflow" not in train_cfg.logger:
        return
    from ddp_utils.tracking.mlflow_tracker import log_evaluation

    files = [p for p in (output, output.parent / "confusion_matrix.png") if p.is_file()]
    numbers = {k: float(v) for k, v in scalars(result).items()}
    try:
        log_evaluation(dataclasses.asdict(train_cfg.logger_cfg.mlflow), run_id,
                       default_output(checkpoint).parent, files, numbers)  # fmt: skip
    except Exception as e:
        log.warning("eval.json not logged to MLflow run %s (%s: %s)", run_id,
                    type(e).__name__, e)  # fmt: skip


def check_classes(
    trained: list[str] | None, found: list[str] | None, checkpoint: str, data: DataConfig
) -> None:
    """Refuse a folder whose classes are not the ones the checkpoint was trained on."""
    if trained is None or found is None or trained == found:
        return
    diff = class_difference(trained, found, "the checkpoint", "the folder")
    raise ConfigError(
        f"the classes of data.root={data.root} ({data.split} split) differ from those "
        f"checkpoint={checkpoint} was trained on ({diff}). "
        "Evaluate on a folder with the same class sub-folders."
    )


def write_report(result: dict[str, Any], output: Path, what: str, rt: Runtime) -> None:
    """The main rank writes ``output`` once and prints a short table."""
    if not rt.is_main:
        return
    text = json.dumps(result, indent=2)
    from ddp_utils.plot import plot_confusion_matrix  # matplotlib: imported only when drawing

    picture = output.parent / "confusion_matrix.png"
    with writing_into(output.parent, key="output"):
        atomic_write_text(output, text)
        if "confusion_matrix" in result:
            plot_confusion_matrix(result["confusion_matrix"], picture)
    lines = [
        f"{result['checkpoint']} on {what}: {result['num_samples']} samples, "
        f"world size {result['world_size']}",
    ]
    numbers = {k: v for k, v in scalars(result).items() if k not in REPORT_COUNTS}
    lines += [f"  {key:<10} {value:.4f}" for key, value in numbers.items()]
    for key in ("per_class_accuracy", "per_class_iou"):
        if key in result:
            names = result.get("classes") or range(len(result[key]))
            per_class = "  ".join(f"{n}:{a:.3f}" for n, a in zip(names, result[key], strict=True))
            lines.append(f"  {key}  {per_class}")
    drawn = " (and confusion_matrix.png)" if "confusion_matrix" in result else ""
    lines.append(f"  written to {output}{drawn}")
    log.info("\n".join(lines))
