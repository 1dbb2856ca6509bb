"""How the model is distributed: ``trainer.strategy``, a registered name or your own
``pkg.module.MyStrategy`` (a ``ddp_utils.strategy.Strategy`` subclass).

``ddp`` (``ddp_utils.strategy.ddp``) is the built-in one; a new strategy is one module beside
it and one line in ``STRATEGIES``; the loop, resume and checkpoints only call its methods.
"""

from __future__ import annotations

from hydra.utils import get_class

from ddp_utils.config import ConfigError, TrainerConfig
from ddp_utils.dist import Runtime
from ddp_utils.strategy.base import Strategy

__all__ = ["STRATEGIES", "Strategy", "build_strategy", "strategy_class"]

STRATEGIES = {
    "ddp": "ddp_utils.strategy.ddp.DDPStrategy",
    "fsdp2": "ddp_utils.strategy.fsdp2.FSDP2Strategy",
}


def strategy_class(trainer: TrainerConfig) -> type[Strategy]:
    """The class ``trainer.strategy`` names; ConfigError naming the key when there is none."""
    path = STRATEGIES.get(trainer.strategy, trainer.strategy)
    try:
        cls = get_class(path) if "." in path else None
    except (ImportError, ValueError) as e:
        raise ConfigError(
            f"trainer.strategy={trainer.strategy}: {path} could not be imported ({e}). Check "
            "that the module is importable from where you launch (PYTHONPATH)."
        ) from None
    if cls is None or not issubclass(cls, Strategy):
        raise ConfigError(
            f"trainer.strategy={trainer.strategy} is neither a strategy of this package "
            f"({' | '.join(STRATEGIES)}) nor a ddp_utils.strategy.Strategy subclass "
            "(pkg.module.MyStrategy)."
        )
    return cls


def build_strategy(trainer: TrainerConfig, rt: Runtime) -> Strategy:
    """The strategy ``trainer.strategy`` names, for this run's trainer keys and runtime."""
    return strategy_class(trainer)(trainer, rt)
