"""Language modelling: next-token cross-entropy summed over the target tokens with their
count, so the mean is exact under padding and gradient accumulation and at any world size.

Metrics: torchmetrics' ``Perplexity`` (exp of the exact mean loss over every validation token)
and, where the tokenizer says how many UTF-8 bytes each id stands for, ``bits_per_byte``
(the summed loss in bits over the summed bytes of the targets): comparable across tokenizers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics import Metric

from ddp_utils.config import ConfigError
from ddp_utils.data.samplers import IGNORE_LABEL
from ddp_utils.tasks.base import Batch, Task


class BitsPerByte(Metric):
    """Summed next-token loss in bits over the summed UTF-8 bytes of the target tokens."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, token_bytes: list[int], vocab_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Ids past the tokenizer's (a vocabulary padded for speed) stand for no bytes.
        table = torch.zeros(max(vocab_size, len(token_bytes)), dtype=torch.float64)
        table[: len(token_bytes)] = torch.tensor(token_bytes, dtype=torch.float64)
        self.register_buffer("table", table, persistent=False)
        self.add_state("nats", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state(
            "bytes", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        real = target != IGNORE_LABEL
        nll = F.cross_entropy(
            logits.flatten(0, -2).float(),
            target.flatten(),
            ignore_index=IGNORE_LABEL,
            reduction="sum",
        )
        self.nats += nll.double()
        self.bytes += (self.table[torch.where(real, target, 0)] * real).sum()

    def compute(self) -> torch.Tensor:
        return self.nats / math.log(2) / self.bytes.clamp(min=1)


PROBE_CONTEXT = 8


class LanguageModel(Task):
    """``task=language_model``: (N, T) ids to (N, T, vocab_size) logits against the ids
    shifted by one."""

    def __init__(
        self, vocab_size: int, block_size: int, token_bytes: list[int] | None = None
    ) -> None:
        self.vocab_size, self.block_size, self.token_bytes = vocab_size, block_size, token_bytes

    def loss_sum(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_LABEL, reduction="sum"
        )

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dim() == 3 and not getattr(getattr(model, "module", model), "packs_records",
                                             False):  # fmt: skip
            raise ConfigError(
                "data.packing=true: this model cannot keep packed records apart (a record "
                "would attend to the one before it); set data.packing=false, or use "
                "model=hf with an architecture whose transformers code builds its mask with "
                "create_causal_mask (Llama, Qwen2, Mistral, GPT-2, ...)."
            )
        return model(inputs)

    def train_loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss_sum(self.forward(model, batch.inputs), batch.target), batch.count()

    def eval_step(
        self, model: nn.Module, batch: Batch, metrics: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.forward(model, batch.inputs).float()
        metrics.update(logits, batch.target)  # the metrics take the ignore index themselves
        return self.loss_sum(logits, batch.target), batch.count()

    def metrics(self) -> dict[str, Any]:
        specs: dict[str, Any] = {
            "perplexity": {"_target_": "torchmetrics.text.Perplexity", "ignore_index": IGNORE_LABEL}
        }
        if self.token_bytes is not None:
            specs["bits_per_byte"] = BitsPerByte(list(self.token_bytes), self.vocab_size)
        return specs

    def probe_length(self) -> int:
        """The pre-flight probe's context: short, since the contract (ids in, one row of
        logits per position out) shows on a few positions, and a long block_size at full
        length would cost seconds to minutes before any step."""
        return min(self.block_size, PROBE_CONTEXT)

    def output_shape(self, n: int) -> tuple[int, ...]:
        return (n, self.probe_length(), self.vocab_size)

    def output_keys(self) -> str:
        return f"data.vocab_size={self.vocab_size} and data.block_size={self.block_size}"

    def blank_inputs(
        self, n: int, data: Any, device: torch.device, memory_format: torch.memory_format
    ) -> torch.Tensor:
        return torch.zeros(n, self.probe_length(), dtype=torch.long, device=device)

    def blank_target(self, n: int, size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(n, self.probe_length(), dtype=torch.long, device=device)
