"""What the entry scripts share: Hydra registration, the job's errors as one message
(``clean_exit``, ``user_errors``; the exits themselves are ddp_utils.lifecycle.exit's), and
eval.py's composition with a checkpoint's own options."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import zipfile
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from ddp_utils.config import UserError, register_configs
from ddp_utils.config.options import GROUPS, not_a_key, options_of_schema
from ddp_utils.dist import read_launch_env
from ddp_utils.lifecycle.exit import (
    USER_ERROR_EXIT,
    exit_stuck,
    leave,
    report,
    stop_for_lost_peer,
)
from ddp_utils.lifecycle.peers import (
    finish_together,
    lost_peer,
    stop_with_launcher,
)
from ddp_utils.lifecycle.preemption import (
    INTERRUPTED_EXIT,
    Preempted,
    StoppedEarly,
    pass_on,
    stop_signals_act_at_once,
)
from ddp_utils.sweep import (
    in_sweep,
    jobs_run_here,
    print_summary,
    register_sweep_configs,
    running_sweep,
)

# Flags that make Hydra print something and exit instead of running the job.
PRINT_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i")
_job_started = False  # composition errors come before the job; any later one is the job's


def register() -> None:
    """What Hydra needs before it composes train.yaml or eval.yaml: the schemas and the
    sweep resolvers."""
    register_configs()
    register_sweep_configs()


@contextlib.contextmanager
def clean_exit() -> Iterator[None]:
    """Inside the Hydra job: exit codes without tracebacks for everything but crashes.

    Every rank reaches the same config, data and checkpoint, so it raises the same error: only
    global rank 0 prints it, unless the error says it is this rank's alone.
    """
    global _job_started
    _job_started = True
    try:
        with stop_signals_act_at_once(on_stuck=exit_stuck):
            yield
    except Preempted as stop:
        pass_on(stop.signum)  # submitit's handler requeues the job here
        sys.exit(stop.exit_code)  # the trainer logged the stop; relaunching resumes
    except StoppedEarly as stop:
        pass_on(stop.signum)
        # torchrun's SIGTERM to the survivors of a failed rank often lands while this rank
        # is already unwinding from the lost collective: that loss is the cause to report.
        why = lost_peer(stop.__context__) if stop.__context__ is not None else None
        if why is not None:
            stop_for_lost_peer(why, launcher_acted=True)
        report(str(stop), stop.exit_code)
    except UserError as e:
        if in_sweep():
            raise  # Hydra records this job as failed and the sweep goes on to the next one
        report(str(e), getattr(e, "exit_code", USER_ERROR_EXIT), e.rank_specific)
    except KeyboardInterrupt:  # Ctrl-C before the training loop took over SIGINT
        try:
            report("interrupted (Ctrl-C) before training started; nothing to save",
                   INTERRUPTED_EXIT)  # fmt: skip
        except SystemExit:
            # Without the module teardown: a process group cut short in its start-up can
            # abort in its threads' destructors (SIGABRT instead of the exit code)
            leave(INTERRUPTED_EXIT)
    except Exception as e:
        why = lost_peer(e)
        if why is None or in_sweep():
            raise
        stop_for_lost_peer(why)


def user_errors(main: Callable[[], Any]) -> Callable[[], Any]:
    """Around ``@hydra.main``: Hydra's own errors (an unknown key or option, a wrong type, a
    malformed override) become one paragraph from global rank 0 and exit code 2, instead of
    Hydra's exit code 1 on every rank; ``--cfg`` / ``--help`` print once under torchrun."""

    @functools.wraps(main)
    def wrapper() -> Any:
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let its errors reach us
        stop_with_launcher()
        printing = any(a in PRINT_FLAGS or a.startswith("--cfg=") for a in sys.argv[1:])
        if printing and read_launch_env().rank != 0:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
        try:
            result = main()
        except Exception as e:
            if not _job_started and isinstance(e, (HydraException, OmegaConfBaseException)):
                report(hydra_error_paragraph(e), USER_ERROR_EXIT)
            if running_sweep() is None:
                raise  # a bug inside a job, with its traceback
            end_sweep()
            report_failed_sweep(e)
        if running_sweep() is not None:
            end_sweep()
        return result

    return wrapper


def with_checkpoint_options(main: Callable[[], Any]) -> Callable[[], Any]:
    """eval.py: compose with the checkpoint's own data, model and task options (for the groups
    the command line leaves alone), so that their keys, such as ``data.root``, are the ones
    that can be overridden. An unreadable checkpoint is one message, exit 2."""

    @functools.wraps(main)
    def wrapper() -> Any:
        try:
            _implied[:] = checkpoint_options(sys.argv[1:])
        except UserError as e:
            report(str(e), USER_ERROR_EXIT)
        sys.argv += _implied
        return main()

    return wrapper


_implied: list[str] = []  # what with_checkpoint_options added to the command line


def implied_options() -> list[str]:
    """The ``GROUP=OPTION`` overrides eval.py took from the checkpoint, not from the user: they
    choose the schemas, and leave the checkpoint's values alone."""
    return list(_implied)


def chosen_options(args: list[str]) -> dict[str, str]:
    """The ``GROUP=OPTION`` choices among command-line ``args`` (``+``/``~`` prefixes too); a
    ``KEY=VALUE`` such as ``data.root=x`` names no group, and the last choice counts."""
    return {m[1]: m[2] for a in args if (m := re.match(r"[+~]*(\w+)=(\w*)$", a))}


# The groups whose options decide how a checkpoint is scored (its optimizer and schedule do
# not): eval.py composes with the checkpoint's own.
SCORED_BY = ("data", "model", "task")


def checkpoint_options(args: list[str]) -> list[str]:
    """``GROUP=OPTION`` overrides of the options stored in the ``checkpoint=PATH`` that
    ``args`` name, for each of data, model and task that ``args`` do not choose."""
    paths = [a.split("=", 1)[1] for a in args if re.match(r"\+*checkpoint=", a)]
    if len(paths) != 1 or "," in paths[0]:  # none, or a sweep over checkpoints
        return []
    from ddp_utils.checkpoint import load_checkpoint  # torch: only now

    # Mapped, not read, where the file's format allows: only its config is wanted here.
    stored = load_checkpoint(paths[0], mmap=zipfile.is_zipfile(paths[0]))["config"]
    chosen = chosen_options(args)
    return [
        f"{group}={stored[group]['name']}"
        for group in SCORED_BY
        if group not in chosen and stored.get(group, {}).get("name") in GROUPS[group][1]
    ]


def end_sweep() -> None:
    """After a sweep whose jobs ran on every rank here, every rank waits for the others: global
    rank 0 may still be writing the summary."""
    if jobs_run_here():
        finish_together()


def report_failed_sweep(error: Exception) -> NoReturn:
    """The table and one line from rank 0, exit non-zero: not Hydra's re-raise of the first
    failure on every rank (each failure was logged as it happened)."""
    sweep_dir = running_sweep()
    assert sweep_dir is not None
    with contextlib.suppress(KeyError, OSError):  # `record` wrote the first failure's there
        os.remove(os.environ["TORCHELASTIC_ERROR_FILE"])
    failed, total = print_summary(sweep_dir)
    code = getattr(error, "exit_code", USER_ERROR_EXIT) if isinstance(error, UserError) else 1
    if isinstance(error, UserError) and not failed:  # the sweep's own: before or after jobs
        report(str(error), code)
    if not total:  # Hydra's own, before any job (a group override it cannot sweep, ...)
        report(f"the sweep stopped before its first job: {hydra_error_paragraph(error)}",
               USER_ERROR_EXIT)  # fmt: skip
    report(f"{failed} of {total} sweep jobs failed; see {sweep_dir / 'summary.csv'}", code)


def hydra_error_paragraph(e: BaseException, args: list[str] | None = None) -> str:
    """Hydra's multi-line message (and its cause's) as one paragraph with the fix; ``args``
    (the command line's) say which option of a group was chosen."""
    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return (f"{group}={option} is not an option; the options of {group} are: "
                f"{', '.join(e.options)} (python train.py --help lists the groups).")  # fmt: skip
    parts = [str(e)]
    if e.__cause__ is not None and str(e.__cause__) not in parts[0]:
        parts.append(str(e.__cause__))
    text = " ".join(" ".join(parts).split())
    # Hydra suggests `+key=value` for an unknown key, but the schema refuses those too.
    text = re.sub(r"To append to your config use \+\S+ ?", "", text)
    text = re.sub(r" ?(full_key: \S+|reference_type=\S+|object_type=\S+)", "", text)
    text = re.sub(r"^Error merging override (\S+) ", r"\1: ", text)
    if (m := re.search(r"Key '(\w+)' not in '(\w+)'", text)) and (
        owner := options_of_schema(m.group(2))
    ):
        group, options = owner
        chosen = chosen_options(sys.argv[1:] if args is None else args).get(group)
        where = chosen if chosen in options else " | ".join(options)
        return not_a_key(group, where, m.group(1))
    if "not in '" in text or "Could not override" in text:
        text = text.rstrip(".") + ". Check the spelling: python train.py --cfg job lists every key."
    return text
