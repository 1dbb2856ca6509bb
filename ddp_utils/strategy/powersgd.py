"""``trainer.ddp.comm_hook=powersgd``: torch's PowerSGD hook (each large gradient matrix
all-reduced as a rank-r factorisation, the residual fed back into the next step's gradient,
the factors warm-started from the last step) with a state that a checkpoint restores exactly.

torch keeps that state per DDP bucket index. A restarted process's DDP runs its first step on
its initial buckets and only then rebuilds them in the order gradients became ready, so a state
saved per bucket would land on other parameters for one step. Here the state is cut into one
piece per parameter whenever the buckets under it change, and joined again in the order
torch's hook reads it: the error as the bucket's flat gradient buffer, the P and Q factors of
the bucket's compressed matrices grouped by shape. A checkpoint holds the pieces.

Only the mean of the ranks' errors enters the all-reduced update (P = mean(M) Q and
Q = mean(M)^T P are linear in each rank's M = gradient + error), so a resume at another world
size gives every rank the saved errors' mean: the same updates up to rounding.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with the classes.
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

KINDS = ("error", "p", "q")


def split(flat: torch.Tensor, segments: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """A bucket's flat tensor as one view per parameter."""
    parts = flat.split([length for _, length in segments])
    return {name: part for (name, _), part in zip(segments, parts, strict=True)}


class PowerSGD:
    """torch's ``PowerSGDState`` (``state``) with its per-bucket tensors kept in step with the
    buckets DDP hands the hook. Register with ``ddp.register_comm_hook(it, powersgd_hook)``."""

    def __init__(self, model: nn.Module, rank: int, start_iter: int) -> None:
        self.state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
        )
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.shapes = {n: p.shape for n, p in model.named_parameters()}
        self.layout: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameters' names
        self.pieces: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}

    def _dicts(self) -> dict[str, dict[int, torch.Tensor]]:
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def segments(self, names: tuple[str, ...]) -> dict[str, list[tuple[str, int]]]:
        """(name, length) in the order torch's hook lays each kind out in a bucket of
        ``names``: the flat gradients; P (n x r) and Q (m x r) of the matrices it compresses,
        grouped by their (n, m) shape in order of first appearance."""
        s, groups = self.state, {}
        for name in names:
            shape = self.shapes[name]
            n = shape[0]
            m = shape.numel() // n
            r = min(n, m, s.matrix_approximation_rank)
            if psgd._should_compress(n, m, r, s.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n * r, m * r))
        factors = [item for group in groups.values() for item in group]
        return {
            "error": [(name, self.shapes[name].numel()) for name in names],
            "p": [(name, p) for name, p, _ in factors],
            "q": [(name, q) for name, _, q in factors],
        }

    def cut(self, index: int) -> None:
        """Bucket ``index``'s tensors into per-parameter pieces; the bucket is forgotten."""
        segments = self.segments(self.layout.pop(index))
        for kind, held in self._dicts().items():
            flat = held.pop(index, None)
            if flat is not None and segments[kind]:
                self.pieces[kind].update(split(flat, segments[kind]))

    def join(self, index: int, names: tuple[str, ...], like: torch.Tensor) -> None:
        """Bucket ``index``'s tensors from the pieces of its parameters ``names``. A bucket
        with nothing to compress gets empty factors once factors exist (as torch made them):
        a missing entry would make the hook draw new ones from the RNG."""
        segments = self.segments(names)
        factors_exist = self.state.iter > self.state.start_powerSGD_iter
        for kind, held in self._dicts().items():
            have = [name in self.pieces[kind] for name, _ in segments[kind]]
            assert all(have) or not any(have), f"PowerSGD {kind} pieces of a bucket are partial"
            if segments[kind] and all(have):
                held[index] = torch.cat([self.pieces[kind].pop(n) for n, _ in segments[kind]])
            elif not segments[kind] and factors_exist:
                held[index] = like.new_empty(0)
        self.layout[index] = names

    def lay_out(self, bucket: dist.GradBucket) -> None:
        """Make the state under ``bucket.index()`` that of the bucket's parameters. Buckets
        whose parameters overlap it belong to the previous layout and are not in flight."""
        index = bucket.index()
        names = tuple(self.names[id(p)] for p in bucket.parameters())
        if self.layout.get(index) == names:
            return
        for other, held in list(self.layout.items()):
            if other == index or not set(held).isdisjoint(names):
                self.cut(other)
        self.join(index, names, bucket.buffer())

    def state_dict(self) -> dict[str, Any]:
        """This rank's state per parameter (error, P, Q), the step count and the RNG that
        draws new factors; plain tensors. Call between steps (no bucket in flight)."""
        out = {kind: {n: t.detach().cpu().clone() for n, t in self.pieces[kind].items()}
               for kind in KINDS}  # fmt: skip
        for index, names in self.layout.items():
            segments = self.segments(names)
            for kind, held in self._dicts().items():
                if index in held and segments[kind]:
                    for name, part in split(held[index], segments[kind]).items():
                        out[kind][name] = part.detach().cpu().clone()
        _, keys, pos, has_gauss, cached = self.state.rng.get_state()
        rng = [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
        return {"iter": self.state.iter, "rng": rng, **out}

    def load_state_dict(self, saved: dict[str, Any], device: torch.device) -> None:
        for held in self._dicts().values():
            held.clear()
        self.layout.clear()
        self.pieces = {kind: {n: t.to(device) for n, t in saved[kind].items()} for kind in KINDS}
        self.state.iter = saved["iter"]
        keys, pos, has_gauss, cached = saved["rng"]
        keys = keys.numpy().astype(np.uint32)
        self.state.rng.set_state(("MT19937", keys, pos, has_gauss, cached))

    def compression_rate(self) -> float:
        """Gradient values over values all-reduced, as torch's hook counted them."""
        return self.state.compression_stats()[0]


def powersgd_hook(hook: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: torch's ``powerSGD_hook`` on a state laid out for ``bucket``."""
    if hook.state.iter >= hook.state.start_powerSGD_iter:
        hook.lay_out(bucket)
    return psgd.powerSGD_hook(hook.state, bucket)


def mean_errors(saved: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every parameter's error feedback averaged over the ranks that saved it."""
    return {n: torch.stack([s["error"][n] for s in saved]).mean(0) for n in saved[0]["error"]}
