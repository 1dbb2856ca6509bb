"""``hydra/sweeper=optuna``: an Optuna search as a Hydra sweep, on every way we launch.

(No `from __future__ import annotations`: Hydra imports plugin modules outside sys.modules,
where dataclasses cannot resolve string annotations.)

    torchrun --standalone --nproc_per_node=2 train.py -m +hparams_search=digits_optuna
    python train.py -m +hparams_search=digits_optuna hydra/launcher=torchrun \\
        hydra.launcher.nproc_per_node=2
    python train.py -m +hparams_search=digits_optuna hydra/launcher=submitit_ddp

Under torchrun with Hydra's basic launcher, every rank runs this sweeper and every trial:
global rank 0 asks the study and broadcasts the trials, so all ranks train the same
parameters. With a launcher that runs each trial as its own job, this process is the only
one that touches the study. The official hydra-optuna-sweeper's keys are kept; it pins
optuna<3, whose database storage fails under SQLAlchemy 2 (see the README).
"""

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.ddp_recipes_launcher.optuna_sweeper.OptunaSweeper"
    # The sampler and pruner arrive as specs, built by the search: a continued study's seeded
    # sampler is built with its seed advanced past the trials the study holds.
    _recursive_: bool = False
    sampler: Any = None  # {_target_: optuna.samplers.TPESampler, seed: 0}; null: TPE, unseeded
    direction: Any = None  # minimize | maximize; null: from task.monitor_mode
    storage: Any = None  # null (in memory) | sqlite:///PATH (or any RDB URL): resumable
    study_name: str | None = None  # null: the job's name (train)
    n_trials: int = 20
    n_jobs: int = 1  # trials asked (and launched) together
    # {KEY: interval(...) | choice(...) | range(...)}; more from the command line as
    # KEY=interval(...) (typed Any: a typed null dict cannot take a command line's {...})
    params: Any = None
    custom_search_space: str | None = None  # path of fn(cfg, trial) for conditional params
    pruner: Any = None  # {_target_: optuna.pruners.MedianPruner, n_warmup_steps: 50}


class OptunaSweeper(Sweeper):
    def __init__(self, **sweeper: Any) -> None:
        self.sweeper = sweeper

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher

        from ddp_utils.sweep.driver import run_search

        in_process = isinstance(self.launcher, BasicLauncher)
        run_search(self.config, self.sweeper, arguments, self._launch, in_process)

    def _launch(self, overrides: list[list[str]], first_number: int) -> list[JobReturn]:
        return list(self.launcher.launch(overrides, initial_job_idx=first_number))


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf)
