"""A Hydra launcher that runs each sweep job as its own torchrun job.

(No `from __future__ import annotations`: Hydra imports plugin modules outside sys.modules,
where dataclasses cannot resolve string annotations.)

Hydra finds it in the ``hydra_plugins`` namespace: ``python train.py -m
hydra/launcher=torchrun hydra.launcher.nproc_per_node=8 optim.lr=0.1,0.01``.
"""

import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from ddp_utils.sweep import best_monitored, task_overrides

log = logging.getLogger(__name__)


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.ddp_recipes_launcher.torchrun_launcher.TorchrunLauncher"
    nproc_per_node: int = 1
    # Extra torchrun flags, e.g. ["--max-restarts=2"].
    torchrun_args: list[str] = field(default_factory=list)


class TorchrunLauncher(Launcher):
    """Runs each sweep job as ``torchrun --standalone --nproc_per_node=N SCRIPT overrides``,
    one after the other, so that each job can use every GPU of the machine."""

    def __init__(self, nproc_per_node: int = 1, torchrun_args: list[str] | None = None) -> None:
        self.nproc_per_node = nproc_per_node
        self.torchrun_args = list(torchrun_args or [])

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        script = os.path.abspath(sys.argv[0])
        returns = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides)
            )
            with open_dict(job_cfg):
                job_cfg.hydra.job.id = job_cfg.hydra.job.num = idx
            job_dir = Path(job_cfg.hydra.sweep.dir) / str(job_cfg.hydra.sweep.subdir)
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={self.nproc_per_node}", *self.torchrun_args,
                script, *overrides, f"run_dir={job_dir}",
            ]  # fmt: skip
            log.info("sweep job #%d: %s", idx, " ".join(task_overrides(overrides)))
            code = subprocess.call(cmd)
            returns.append(self._job_return(job_cfg, list(overrides), job_dir, code))
            self.hydra_context.callbacks.on_job_end(config=job_cfg, job_return=returns[-1])
        return returns

    @staticmethod
    def _job_return(cfg: DictConfig, overrides: list[str], job_dir: Path, code: int) -> JobReturn:
        ret = JobReturn(overrides=overrides, cfg=cfg, working_dir=str(job_dir))
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(job_dir)
        if code == 0:
            ret.status = JobStatus.COMPLETED
            # The job's objective, as train.py returns it in-process: its best monitored value.
            task = cfg.get("task") or {}
            monitor, mode = task.get("monitor", "accuracy"), task.get("monitor_mode", "max")
            ret.return_value = best_monitored(job_dir, monitor, mode)
        else:
            ret.status = JobStatus.FAILED
            ret.return_value = RuntimeError(f"torchrun exited with code {code} (see its output)")
        return ret


ConfigStore.instance().store(group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf)
