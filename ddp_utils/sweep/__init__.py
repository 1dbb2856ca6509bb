"""Hydra sweeps under DDP: the shared sweep directory and its summary (``summary``), and the
Optuna search of ``hydra/sweeper=optuna`` (``optuna_search``: the space and the study;
``driver``: the loop every rank runs; ``pruning``: the callback inside a trial)."""

from ddp_utils.sweep.summary import (
    SweepSummary,
    best_monitored,
    final_metrics,
    format_summary,
    in_sweep,
    jobs_run_here,
    print_summary,
    register_sweep_configs,
    running_sweep,
    sweep_job_dir,
    task_overrides,
    write_summary,
)

__all__ = ["SweepSummary", "best_monitored", "final_metrics", "format_summary", "in_sweep",
           "jobs_run_here", "print_summary", "register_sweep_configs", "running_sweep",
           "sweep_job_dir", "task_overrides", "write_summary"]  # fmt: skip
