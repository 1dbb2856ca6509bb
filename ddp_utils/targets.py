"""``_target_``s (models, tasks): import one, and call it with what its signature takes."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from hydra.utils import get_object

from ddp_utils.config import ConfigError


def why(e: BaseException) -> str:
    """An error (or its cause) in one line: its type and last line."""
    cause = e.__cause__ or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1][:300] if text else ''}"


def target_arguments(
    key: str, target: str, offered: Mapping[str, Any], given: Mapping[str, Any]
) -> dict[str, Any]:
    """The arguments for ``target`` (config ``key``): those of ``offered`` (the data's sizes,
    say) that its signature takes, then every ``given`` one (``+GROUP.NAME=VALUE``)."""
    try:
        fn: Callable = get_object(target)
    except Exception as e:
        raise ConfigError(
            f"{key}={target} cannot be imported ({why(e)}). Check the dotted path, and that "
            "its package is importable where you launch (PYTHONPATH)."
        ) from None
    params = inspect.signature(fn).parameters
    return {k: v for k, v in offered.items() if k in params} | dict(given)
