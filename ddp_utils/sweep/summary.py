"""Hydra sweeps under DDP: a shared sweep directory, a torchrun launcher, and a summary.

Two ways to sweep:
- ``torchrun ... train.py -m optim.lr=0.1,0.01``: every rank runs Hydra's basic launcher, so
  all ranks run the same jobs in the same order, in-process, reusing one process group. The
  sweep directory is named from torchrun's run id, so all ranks share it.
- ``python train.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 ...``: the
  launcher in ``hydra_plugins/ddp_recipes_launcher`` runs each job as its own torchrun job,
  one at a time.

Either way ``SweepSummary`` (a Hydra callback) writes ``job.json`` into each job's directory
and ``summary.csv`` / ``summary.json`` into the sweep directory, from global rank 0. An Optuna
sweep (``hydra/sweeper=optuna``, ``ddp_utils.sweep.driver``) adds each trial's number, state,
value and parameters to its job.json, and the best trial to the table.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ddp_utils.config import UserError
from ddp_utils.dist import read_launch_env
from ddp_utils.run.folder import run_tag
from ddp_utils.run.records import read_metrics

log = logging.getLogger(__name__)
# A job's final numbers in the summary: these, then every val/ scalar its task logged.
SUMMARY_KEYS = ("world_size", "epoch", "step", "train/loss")
DEFAULT_MONITOR = "val/accuracy"  # job.json files from before tasks name none
# Resolved once per process: a launcher re-resolves the sweep directory for every job.
_STARTED = time.strftime("%Y-%m-%d_%H-%M-%S")
_running_sweep: Path | None = None  # set on every rank when this process starts a sweep
_jobs_run_here = False  # Hydra's basic launcher: the sweep's jobs run inside this process


def sweep_dir_name() -> str:
    """``multirun/<run id>`` under torchrun (the same on every rank), else a timestamp."""
    run_id = read_launch_env().run_id
    if run_id and run_id != "none":
        return f"multirun/{run_tag(run_id)}"
    return f"multirun/{_STARTED}"


def task_overrides(overrides: Sequence[str]) -> list[str]:
    """A job's own overrides: without Hydra's (``hydra.``, ``+hydra.``, ``++hydra.``)."""
    return [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]


def in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def sweep_job_dir() -> str | None:
    """The job's own folder inside the sweep directory, when this process runs a sweep job."""
    return HydraConfig.get().runtime.output_dir if in_sweep() else None


def running_sweep() -> Path | None:
    """The sweep directory, once this process has started an in-process sweep."""
    return _running_sweep


def jobs_run_here() -> bool:
    """Whether the running sweep's jobs run in this process (on every rank), rather than as
    jobs of their own (the torchrun and submitit launchers)."""
    return _jobs_run_here


def final_metrics(job_dir: Path) -> dict[str, Any]:
    records = read_metrics(job_dir)
    last = records[-1] if records else {}
    return {k: v for k, v in last.items() if k in SUMMARY_KEYS or k.startswith("val/")}


def best_monitored(job_dir: Path, monitor: str, mode: str) -> float | None:
    """The run's best ``val/<monitor>`` in its metrics.jsonl (a sweep's objective)."""
    key = f"val/{monitor}"
    values = [r[key] for r in read_metrics(job_dir) if isinstance(r.get(key), (int, float))]
    finite = [v for v in values if math.isfinite(v)]
    return (max if mode == "max" else min)(finite) if finite else None


def add_to_job(job_dir: Path, fields: dict[str, Any]) -> None:
    """Merge ``fields`` into ``<job>/job.json`` (made if the job never wrote one)."""
    path = job_dir / "job.json"
    job = json.loads(path.read_text()) if path.exists() else {
        "job": fields.get("trial"), "overrides": [], "status": "FAILED"}  # fmt: skip
    job_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**job, **fields}, indent=2))


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    """Collect every ``<job>/job.json`` into ``summary.csv`` and ``summary.json``."""
    if not sweep_dir.is_dir():
        return []  # the sweep stopped before its first job
    rows = []
    for job_file in sorted(sweep_dir.glob("*/job.json"), key=lambda p: int(p.parent.name)):
        job = json.loads(job_file.read_text())
        rows.append({**job, **final_metrics(job_file.parent)})
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2))
    scores = dict.fromkeys(k for r in rows for k in r if k.startswith("val/"))
    trial = ["trial", "state", "value", "params"] if any("trial" in r for r in rows) else []
    columns = ["job", *trial, "overrides", "status", *SUMMARY_KEYS, *scores, "monitor", "error"]
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**r, "overrides": " ".join(r["overrides"]),
                          "params": params_text(r.get("params"))} for r in rows)  # fmt: skip
    return rows


def params_text(params: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in (params or {}).items())  # fmt: skip


def format_summary(rows: list[dict[str, Any]]) -> str:
    """One line a job: its status, the metric that picks its best.pt, its training loss."""
    monitors = {r.get("monitor", DEFAULT_MONITOR) for r in rows}
    head = monitors.pop() if len(monitors) == 1 else "monitor"
    width = max(12, len(head))
    lines = [f"{'job':>4}  {'status':<9} {head:>{width}} {'train/loss':>10}  overrides"]
    best = best_row(rows)
    for r in rows:
        monitor = r.get("monitor", DEFAULT_MONITOR)
        score = f"{r[monitor]:.4f}" if monitor in r else "-"
        if head == "monitor" and monitor in r:
            score = f"{monitor.removeprefix('val/')} {score}"
        loss = f"{r['train/loss']:.4f}" if "train/loss" in r else "-"
        overrides = params_text(r["params"]) if "params" in r else " ".join(r["overrides"])
        status = r.get("state", r["status"])  # an Optuna trial's: COMPLETE, PRUNED or FAIL
        lines.append(f"{r['job']:>4}  {status:<9} {score:>{width}} {loss:>10}  {overrides}")
    if best is not None:
        lines.append(f"best: trial {best['trial']} (job {best['job']}), objective "
                     f"{best['value']:.4f} ({best['monitor']}, the run's best), "
                     f"{params_text(best['params'])}")  # fmt: skip
    return "\n".join(lines)


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """An Optuna sweep's best COMPLETE trial (its ``direction`` is in every trial's row)."""
    done = [r for r in rows if r.get("state") == "COMPLETE" and r.get("value") is not None]
    if not done:
        return None
    pick = max if done[0].get("direction") == "maximize" else min
    return pick(done, key=lambda r: r["value"])


class SweepSummary(Callback):
    """Records each sweep job's status and, at the end, prints the sweep's table."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _running_sweep, _jobs_run_here
        _running_sweep = Path(config.hydra.sweep.dir)
        _jobs_run_here = config.hydra.launcher._target_.endswith(".BasicLauncher")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or read_launch_env().rank != 0:
            return
        job_dir = Path(config.hydra.runtime.output_dir)
        failed = job_return.status != JobStatus.COMPLETED
        job = {
            "job": int(config.hydra.job.num),
            "overrides": task_overrides(job_return.overrides or []),
            "status": "FAILED" if failed else "COMPLETED",
            "monitor": f"val/{OmegaConf.select(config, 'task.monitor', default='accuracy')}",
            "error": str(job_return._return_value) if failed else None,
        }
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / "job.json").write_text(json.dumps(job, indent=2))
        write_summary(Path(config.hydra.sweep.dir))
        if failed:
            error = job_return._return_value
            if isinstance(error, UserError):
                log.error("sweep job #%d failed: %s", job["job"], error)
            else:  # a crash: its traceback, once, since the sweep goes on
                trace = "".join(traceback.format_exception(error)).rstrip()
                log.error("sweep job #%d failed:\n%s", job["job"], trace)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print_summary(Path(config.hydra.sweep.dir))  # (Hydra skips this when a job failed)


def print_summary(sweep_dir: Path) -> tuple[int, int]:
    """Global rank 0 writes and prints the sweep's table and gets (failed jobs, jobs); the
    other ranks, which print nothing, get (0, 0)."""
    rows = write_summary(sweep_dir) if read_launch_env().rank == 0 else []
    if rows:
        print(f"sweep summary ({sweep_dir / 'summary.csv'}):\n{format_summary(rows)}", flush=True)
    return sum(r["status"] == "FAILED" for r in rows), len(rows)


def rank_zero_level() -> str:
    """Log level for Hydra's own messages: INFO on global rank 0, warnings only elsewhere."""
    return "INFO" if read_launch_env().rank == 0 else "WARNING"


def register_sweep_configs() -> None:
    if not OmegaConf.has_resolver("ddp_sweep_dir"):
        # Cached, so that Hydra copies the value resolved here into every job's config: a
        # submitit job resolving it again on its SLURM node would pick another directory.
        OmegaConf.register_new_resolver("ddp_sweep_dir", sweep_dir_name, use_cache=True)
    if not OmegaConf.has_resolver("ddp_rank_zero_level"):
        OmegaConf.register_new_resolver("ddp_rank_zero_level", rank_zero_level)
