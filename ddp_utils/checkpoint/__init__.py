"""Checkpoints, in one room: what one holds (``state``), its formats (``format``: one whole
file, or a DCP folder when the strategy shards parameters), where its bytes go
(``storage``: a local folder or an fsspec URL), how a save runs (``save``: in the step or
in the background), what is never written (``finite``), whether and from
which a run continues (``resume``), a checkpoint as a model for eval.py and generate.py
(``inference``), and the command line (``export``: ``python -m ddp_utils.checkpoint``).

The training loop calls ``save(training)`` and ``resume(training)``; a strategy hands over
and takes back state dicts and knows nothing of formats."""

from ddp_utils.checkpoint.finite import DIVERGED_EXIT, NonFiniteError, all_finite, diverged
from ddp_utils.checkpoint.format import CorruptCheckpointError, load_checkpoint
from ddp_utils.checkpoint.inference import inference_model
from ddp_utils.checkpoint.resume import resume
from ddp_utils.checkpoint.save import finish_saves, save
from ddp_utils.checkpoint.storage import step_checkpoints

__all__ = [
    "DIVERGED_EXIT", "CorruptCheckpointError", "NonFiniteError", "all_finite", "diverged",
    "finish_saves", "inference_model", "load_checkpoint", "resume", "save", "step_checkpoints",
]  # fmt: skip
