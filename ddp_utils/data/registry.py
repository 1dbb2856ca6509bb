"""Data families: which module builds an option's loaders.

A data option's schema names its family (``DataConfig.family``, a module path). The module
defines
- ``build(cfg, rt, seed, channels_last) -> DataBundle``: the training and validation loaders;
- ``build_eval(cfg, rt, seed, channels_last) -> EvalData``: the loader of ``data.split``;
and where the data knows more than its config says,
- ``resolve(cfg, rt) -> cfg``: keys only the data can fill in (token data's vocab_size);
- ``offered(cfg) -> dict``: what tasks are offered besides ``cfg.sizes()``;
- ``samples(cfg, rt, split) -> Dataset``: its ``(uint8 CHW image, label)`` items, for
  ``python -m ddp_utils.shards write``.
``ddp_utils.data`` calls these and nothing else, so a new family needs no edit there.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import TypeVar

from ddp_utils.config import ConfigError, DataConfig

T = TypeVar("T")
NEEDED = ("build", "build_eval")


def family_of(cfg: DataConfig) -> ModuleType:
    """The module that builds ``cfg``'s loaders, checked for what ``ddp_utils.data`` calls."""
    path = type(cfg).family
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"data={cfg.name}: its family module {path} could not be imported ({e}); set "
            f"{type(cfg).__name__}.family to an importable module."
        ) from None
    missing = [f for f in NEEDED if not callable(getattr(module, f, None))]
    if missing:
        raise ConfigError(
            f"data={cfg.name}: its family module {path} lacks {', '.join(missing)} (a data "
            "family defines build and build_eval; see ddp_utils/data/registry.py)."
        )
    return module


def by_schema(registry: Mapping[type, T], cfg: object) -> T:
    """The entry of ``registry`` for ``cfg``'s schema or the nearest schema it extends."""
    for schema in type(cfg).__mro__:
        if schema in registry:
            return registry[schema]
    raise AssertionError(f"{type(cfg).__name__} is in none of {[c.__name__ for c in registry]}")
