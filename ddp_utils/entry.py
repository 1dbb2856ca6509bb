"""What the entry scripts share: Hydra registration, a clean exit on users' mistakes."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from ddp_utils.config import ConfigError, register_configs
from ddp_utils.dist import read_launch_env
from ddp_utils.preemption import PREEMPTED_EXIT, Preempted, pass_on
from ddp_utils.sweep import in_sweep, register_sweep_configs

USER_ERROR_EXIT = 2
NON_MAIN_EXIT_DELAY_S = 2.0


def register() -> None:
    """What Hydra needs before it composes train.yaml or eval.yaml: the schemas and the
    sweep resolvers."""
    register_configs()
    register_sweep_configs()


@contextlib.contextmanager
def clean_exit() -> Iterator[None]:
    """Exit codes without tracebacks: 2 for a user's mistake, 75 for a preempted run.

    Every rank reaches the same config, data and checkpoint, so it raises the same error: only
    global rank 0 prints it, unless the error says it is this rank's alone.
    """
    try:
        yield
    except Preempted as stop:
        pass_on(stop.signum)  # submitit's handler requeues the job here
        sys.exit(PREEMPTED_EXIT)  # the trainer logged the stop; relaunching resumes
    except ConfigError as e:
        if in_sweep():
            raise  # Hydra records this job as failed and the sweep goes on to the next one
        rank = read_launch_env().rank
        if rank == 0 or e.rank_specific:
            prefix = f"[rank {rank}] " if rank else ""
            print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops the whole group as soon as one worker exits: give rank 0 time
            # to print the shared message first.
            time.sleep(NON_MAIN_EXIT_DELAY_S)
        sys.exit(USER_ERROR_EXIT)
