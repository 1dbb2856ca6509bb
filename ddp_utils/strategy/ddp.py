"""``trainer.strategy=ddp``: a replica of the model on every rank, gradients all-reduced in
buckets during the backward (DistributedDataParallel), SyncBatchNorm with ``trainer.ddp.sync_bn``,
and torch's gradient compression hooks with ``trainer.ddp.comm_hook`` (fp16 | bf16: each
bucket all-reduced in half the bytes; powersgd: a low-rank approximation with error feedback,
whose per-rank state is checkpointed per parameter so that a resume stays exact).

A single process trains its module directly: DDP at world size 1 changes no number (its
all-reduce over one rank is the identity) and only adds its reducer's hooks to every backward."""

from __future__ import annotations

import inspect
import math
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_utils.strategy.base import Strategy
from ddp_utils.strategy.powersgd import PowerSGD, mean_errors, powersgd_hook

# torch 2.14 renamed the argument (the old name warns); older versions know only the old one.
NO_FORWARD_BUFFER_SYNC = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else "broadcast_buffers"
)


def compression_hook(name: str) -> object:
    """torch's built-in stateless DDP communication hook ``name``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    return hooks[name]


class DDPStrategy(Strategy):
    reads = ("ddp.comm_hook", "ddp.powersgd_rank", "ddp.powersgd_start_iter", "ddp.sync_bn",
             "ddp.bucket_cap_mb", "ddp.gradient_as_bucket_view", "ddp.static_graph")  # fmt: skip
    powersgd: PowerSGD | None = None

    def prepare(self, raw_model: nn.Module) -> nn.Module:
        if self.trainer.ddp.sync_bn:
            return nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
        return raw_model

    def distribute(self, raw_model: nn.Module) -> nn.Module:
        if self.rt.world_size == 1:
            return raw_model
        opts, options = self.trainer.ddp, self.ddp_options()
        if opts.comm_hook == "powersgd" and self.rt.backend == "gloo":
            # torch's PowerSGD hook issues its factors' all-reduces from future callbacks,
            # which gloo's worker threads run in no fixed order: with two buckets the ranks'
            # collectives cross and gloo aborts. All gradients in one bucket.
            mib = sum(p.numel() * p.element_size() for p in raw_model.parameters()) / 2**20
            options["bucket_cap_mb"] = max(options["bucket_cap_mb"], math.ceil(mib) + 1)
        model = DDP(raw_model, **options)
        if opts.comm_hook == "powersgd":
            self.powersgd = PowerSGD(raw_model, opts.powersgd_rank, opts.powersgd_start_iter)
            model.register_comm_hook(self.powersgd, powersgd_hook)
        elif opts.comm_hook is not None:
            model.register_comm_hook(None, compression_hook(opts.comm_hook))
        return model

    def state_dict(self) -> dict[str, Any]:
        """Every rank's PowerSGD state, gathered on the main rank (the one that writes)."""
        if self.powersgd is None:
            return {}
        gathered: list[Any] | None = [None] * self.rt.world_size if self.rt.is_main else None
        dist.gather_object(self.powersgd.state_dict(), gathered, dst=0)
        return {"powersgd": gathered} if self.rt.is_main else {}

    def load_state_dict(self, state: dict[str, Any], world_size: int) -> None:
        """This rank's PowerSGD state; saved at another world size, the ranks' mean error
        (only the mean enters the all-reduced update)."""
        saved = state.get("powersgd")
        if not saved or self.powersgd is None:
            return
        mine = saved[self.rt.rank] if world_size == self.rt.world_size else {
            **saved[0], "error": mean_errors(saved)}  # fmt: skip
        self.powersgd.load_state_dict(mine, self.rt.device)

    def ddp_options(self) -> dict[str, Any]:
        """DistributedDataParallel's arguments (a subclass adds its own)."""
        t, rt = self.trainer, self.rt
        return {
            "device_ids": [rt.device.index] if rt.device.type == "cuda" else None,
            "bucket_cap_mb": t.ddp.bucket_cap_mb,
            "gradient_as_bucket_view": t.ddp.gradient_as_bucket_view,
            "static_graph": t.ddp.static_graph,
            # No broadcast of rank 0's buffers before every forward (a collective and a wait
            # each step): rank 0's own running statistics follow the same course without it,
            # and every rank is given them before each validation and checkpoint
            # (sync_buffers), so what is scored and saved is unchanged.
            NO_FORWARD_BUFFER_SYNC: False,
        }

    def no_sync(self) -> AbstractContextManager:
        """DDP's ``no_sync``: gradients kept local until the group's last micro-batch."""
        inner = getattr(self.model, "_orig_mod", self.model)  # under torch.compile
        return inner.no_sync() if isinstance(inner, DDP) else nullcontext()
