"""The groups whose options each have a schema (data, model, task, optim, sched): which
schema an option has, the keys it has of its own, and the messages and help text that name
them."""

from __future__ import annotations

import textwrap
from dataclasses import fields

from ddp_utils.config.data import DATA_OPTIONS
from ddp_utils.config.data.base import DataConfig
from ddp_utils.config.model import MODEL_OPTIONS, ModelConfig
from ddp_utils.config.optim import OPTIM_OPTIONS, SCHED_OPTIONS, OptimConfig, SchedConfig
from ddp_utils.config.task import TASK_OPTIONS, TaskConfig

# group -> (the keys every option has, {option: its schema})
GROUPS: dict[str, tuple[type, dict[str, type]]] = {
    "data": (DataConfig, DATA_OPTIONS),
    "model": (ModelConfig, MODEL_OPTIONS),
    "task": (TaskConfig, TASK_OPTIONS),
    "optim": (OptimConfig, OPTIM_OPTIONS),
    "sched": (SchedConfig, SCHED_OPTIONS),
}
ARGUMENTS = "kwargs"  # the custom options' +GROUP.NAME=VALUE arguments


def store_name(group: str, option: str) -> str:
    """The ConfigStore name of an option's schema, which ``conf/<group>/<option>.yaml`` lists
    first in its defaults as ``/<store_name>@_here_``."""
    return f"{group}_{option}_schema"


def option_schema(group: str, option: str | None) -> type:
    """The schema of ``group=option``; an option of the user's own, the group's base."""
    base, options = GROUPS[group]
    return options.get(option or "", base)


def keys_of(schema: type) -> list[str]:
    return [f.name for f in fields(schema)]


def own_keys(schema: type, group: str) -> list[str]:
    """The keys ``schema`` has besides those of every option of ``group``."""
    common = set(keys_of(GROUPS[group][0]))
    return [k for k in keys_of(schema) if k not in common]


def options_with_key(group: str, key: str) -> list[str]:
    return [o for o, schema in GROUPS[group][1].items() if key in keys_of(schema)]


def not_a_key(group: str, option: str | None, key: str) -> str:
    """One paragraph for ``group.key`` set on ``group=option``, which has no such key."""
    where = f"{group}={option}"
    owners = options_with_key(group, key)
    if owners:
        return (
            f"{group}.{key} is not a key of {where}: it belongs to {group}="
            f"{' | '.join(owners)}. Pick that option, or drop the key (python train.py --help "
            f"lists each option's keys)."
        )
    hint = ""
    if ARGUMENTS not in keys_of(option_schema(group, option)):
        hint = f" +{group}.NAME=VALUE arguments are for {group}=custom."
    return (
        f"{group}.{key} is not a key of {where}; check its spelling (python train.py --help "
        f"lists each option's keys).{hint}"
    )


def options_of_schema(class_name: str) -> tuple[str, list[str]] | None:
    """(group, its options) whose schema class is called ``class_name`` (Hydra's errors name
    the class)."""
    for group, (_, options) in GROUPS.items():
        names = [o for o, schema in options.items() if schema.__name__ == class_name]
        if names:
            return group, names
    return None


def options_help(width: int = 96) -> str:
    """Each option's own keys, group by group: --help and the list in docs/launching.md."""
    lines: list[str] = []
    for group, (base, options) in GROUPS.items():
        common = " ".join(keys_of(base))
        lines += textwrap.wrap(f"{group}, every option: {common}", width, subsequent_indent="    ")
        by_schema: dict[type, list[str]] = {}
        for option, schema in options.items():
            by_schema.setdefault(schema, []).append(option)
        for schema, names in by_schema.items():
            own = [f"+{group}.NAME=VALUE" if k == ARGUMENTS else k for k in own_keys(schema, group)]
            text = f"  {group}={' | '.join(names)}: {' '.join(own) if own else '(no others)'}"
            lines += textwrap.wrap(text, width, subsequent_indent="      ")
    return "\n".join(lines)
