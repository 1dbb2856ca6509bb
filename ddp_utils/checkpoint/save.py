"""``save(training)``: a checkpoint of the whole training state, in the format the strategy
calls for, published in the run's checkpoint folder. Every rank calls it."""

from __future__ import annotations

from ddp_utils.checkpoint.finite import check_state
from ddp_utils.checkpoint.format import write
from ddp_utils.checkpoint.state import LOSS_SUM, TrainingState, capture
from ddp_utils.checkpoint.storage import checkpoint_dir


def save(tr: TrainingState, also: tuple[str, ...] = ()) -> None:
    """Checkpoint from every rank's state; the main rank writes it (every rank its shards, when
    the strategy shards parameters) and publishes it as each name in ``also``, such as
    best.pt; everyone waits for it."""
    state = capture(tr)
    check_state(tr, state["epoch_totals"][LOSS_SUM])  # nothing non-finite is ever written
    t = tr.cfg.trainer
    path = write(state, checkpoint_dir(tr.run_dir), also, t.keep_last, tr.rt,
                 tr.strategy.shards_parameters, t.checkpoint.timeout_s)  # fmt: skip
    tr.callbacks.on_checkpoint(tr, path)
