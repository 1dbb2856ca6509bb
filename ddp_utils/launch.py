"""torchrun with the workers' exit codes and no traceback of its own.

    python -m ddp_utils.launch --standalone --nproc_per_node=2 train.py optim.lr=0.1
    ddp-run --standalone --nproc_per_node=2 train.py optim.lr=0.1      (the same, installed)

It takes torchrun's arguments and runs torchrun. Three things differ:
- a failed worker: torchrun exits 1 whatever the worker said; this exits with the root
  cause's own code (2 a user error, 3 a diverged run, 75 stopped on request, 130 Ctrl-C) and
  prints torchrun's failure summary without torchrun's Python traceback;
- an elastic or multi-node launch (``--nnodes=MIN:MAX``, ``--nnodes=N`` with N > 1) gets
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless it is set (docs/elasticity.md);
- a stop signal to torchrun itself (Ctrl-C, SIGTERM): torchrun forwards it to the workers,
  which checkpoint and stop, then prints a traceback of its own SignalException; this exits
  quietly with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM).
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

from ddp_utils.dist import nnodes_of


def main(argv: list[str] | None = None) -> None:
    nodes = nnodes_of(sys.argv[1:] if argv is None else argv)
    if nodes is not None and nodes[1] > 1:
        # Each restart attempt of an elastic or multi-node job gets a store of its own: with
        # torchrun's shared one, a returning node's agents wait on each other and fail.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(
            f"torchrun stopped by {name}: the workers were told to stop too (their log says "
            "where they checkpointed); relaunch the same command to resume.",
            file=sys.stderr,
        )
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        print(e.format_msg(), file=sys.stderr)
        sys.exit(failure.exitcode if 0 < failure.exitcode < 256 else 1)


if __name__ == "__main__":
    main()
