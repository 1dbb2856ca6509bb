"""How a script ends: its exit codes, one message for the user's errors (``report``: global
rank 0 prints it, torchrun's error file holds it), a rank that stops for a lost peer, and the
end of a finished script without the interpreter's teardown (``leave``).

Exit codes (docs/resume.md): 0 finished, 1 a crash (with its traceback) or a rank stopped for
a lost peer, 2 a user's mistake, 3 a diverged run (non-finite loss or weights), 4 an
unwritable run_dir, 75 stopped on request (SIGTERM, SIGUSR1/2: relaunch to resume), 130
stopped by Ctrl-C (SIGINT; relaunch to resume).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
from typing import NoReturn

from ddp_utils.dist import read_launch_env
from ddp_utils.lifecycle.peers import write_error_file
from ddp_utils.lifecycle.preemption import StoppedEarly
from ddp_utils.logs import log_to_files

USER_ERROR_EXIT = 2
PEER_LOST_EXIT = 1  # this rank stopped because another one failed
NON_MAIN_EXIT_DELAY_S = 2.0


def report(message: str, exit_code: int, rank_specific: bool = False) -> NoReturn:
    """Print a user-facing error once (global rank 0, or every rank for a rank's own error)
    and exit. Under torchrun it also becomes the error file that ``record`` would write, so
    that torchrun's failure summary shows this line as the root cause, not a traceback."""
    rank = read_launch_env().rank
    if rank == 0 or rank_specific:
        log_to_files(logging.ERROR, message)  # train.log keeps it with the run
        line = f"[rank {rank}] error: {message}" if rank else f"error: {message}"
        print(line, file=sys.stderr, flush=True)
        write_error_file(line)
    else:
        # torchrun stops the whole group as soon as one worker exits: give rank 0 time to
        # print the shared message (and be the first failure) first.
        time.sleep(NON_MAIN_EXIT_DELAY_S)
    sys.exit(exit_code)


def exit_stuck(stop: StoppedEarly) -> NoReturn:
    """A stop signal the main thread could not take (it waits in C++ on a peer that already
    left on the same signal): the job's one line from global rank 0, then this process ends at
    once, with the stop's exit code. Nothing was training, so nothing is lost."""
    rank = read_launch_env().rank
    if rank == 0:
        line = f"error: {stop}"
        print(line, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            log_to_files(logging.ERROR, str(stop))
            write_error_file(line)
    sys.stdout.flush()
    exit_now(stop.exit_code)


def stop_for_lost_peer(why: str, launcher_acted: bool = False) -> NoReturn:
    """The failing rank printed its own message (and is torchrun's root cause): this rank
    adds one line, not the collective's traceback, and exits after it.

    ``launcher_acted``: torchrun's stop signal already came, so it has its first failure and
    waits only for this rank, which then skips the interpreter's teardown: with a peer gone,
    the process group's and the loader workers' destructors wait on what can no longer finish;
    the logs are flushed first, and nothing of the run is
    written at exit (checkpoints are whole files, renamed into place). Before that signal,
    the failing rank may still be on its way out (its own teardown): this one waits, and
    leaves the usual way, so that the failing rank stays torchrun's first failure."""
    print(f"[rank {read_launch_env().rank}] stopping: {why} (its message says why)",
          file=sys.stderr, flush=True)  # fmt: skip
    if launcher_acted:
        exit_now(PEER_LOST_EXIT)
    time.sleep(NON_MAIN_EXIT_DELAY_S)
    sys.exit(PEER_LOST_EXIT)


def exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's teardown, the logs and output flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_leaving: int | None = None  # set by leave(): the interpreter's exit ends at _skip_teardown


def leave(code: int = 0) -> NoReturn:
    """A script's end after it finished: the interpreter's own exit (threading's exit hooks,
    which tell a ThreadPoolExecutor's workers, such as torch.compile's, to finish; non-daemon
    threads joined; the atexit handlers: multiprocessing's children, the trackers' clients),
    then exit 0 without tearing down every module, which takes over a second with torch,
    torchvision and torchmetrics loaded. Only public means: ``_skip_teardown`` is an atexit
    handler registered when this module is first imported, so it runs after every handler
    registered later and ends the process before the module teardown."""
    global _leaving
    _leaving = code
    sys.exit(code)


def _skip_teardown() -> None:
    if _leaving is not None:
        exit_now(_leaving)  # logging's own handler (registered before this one) would run after it


atexit.register(_skip_teardown)
