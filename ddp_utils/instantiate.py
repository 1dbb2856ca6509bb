"""``_target_``s (models, tasks, callbacks, trackers): import one, call it with what its
signature takes, or build one and check what it is."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate

from ddp_utils.config import ConfigError


def why(e: BaseException) -> str:
    """An error (or its cause) in one line: its type and last line."""
    cause = e.__cause__ or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1][:300] if text else ''}"


@contextlib.contextmanager
def quiet_hydra_utils() -> Iterator[None]:
    """Hydra logs its own lines for a target that does not import before it raises; the
    error that follows is ours, one paragraph."""
    hydra_log = logging.getLogger("hydra.utils")
    was = hydra_log.disabled
    hydra_log.disabled = True
    try:
        yield
    finally:
        hydra_log.disabled = was


def build_instance(key: str, spec: Mapping[str, Any], base: type, fix: str) -> Any:
    """``instantiate(spec)`` (a mapping with a ``_target_``), which must be a ``base``; a target
    that cannot be built, or builds something else, is a ConfigError naming ``key``."""
    target = spec.get("_target_")
    try:
        with quiet_hydra_utils():
            built = instantiate(spec, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__ or e
        raise ConfigError(f"{key}: {target} could not be built ({type(cause).__name__}: "
                          f"{str(cause).strip()[:300]}); {fix}") from None  # fmt: skip
    if not isinstance(built, base):
        raise ConfigError(f"{key}: {target} is not a {base.__module__}.{base.__qualname__}.")
    return built


def target_arguments(
    key: str, target: str, offered: Mapping[str, Any], given: Mapping[str, Any]
) -> dict[str, Any]:
    """The arguments for ``target`` (config ``key``): those of ``offered`` (the data's sizes,
    say) that its signature takes, then every ``given`` one (``+GROUP.NAME=VALUE``)."""
    try:
        with quiet_hydra_utils():
            fn: Callable = get_object(target)
    except Exception as e:
        raise ConfigError(
            f"{key}={target} cannot be imported ({why(e)}). Check the dotted path, and that "
            "its package is importable where you launch (PYTHONPATH)."
        ) from None
    params = inspect.signature(fn).parameters
    return {k: v for k, v in offered.items() if k in params} | dict(given)
