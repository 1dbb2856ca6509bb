"""``trainer.strategy=fsdp2``: each rank holds a shard of every parameter, of its gradient and of
the optimizer's state (torch's FSDP2, ``fully_shard``), so a model too large for one device
trains over several. The units (``trainer.fsdp.wrap``, or the model's own blocks) are sharded
one by one, then the root: a unit's parameters are all-gathered just before its forward (and
again for its backward with ``trainer.fsdp.reshard_after_forward``), its gradients
reduce-scattered after its backward.

Checkpoints are torch.distributed.checkpoint folders: every rank writes its own shards and
nobody gathers the model (``ddp_utils.checkpoint.format``); a resume at another world
size reshards them. Every forward is a collective, so evaluation runs in lockstep: a rank
whose shard ends early repeats its last batch, uncounted, until every rank is done
(``lockstep_eval``). The EMA is a second sharded copy, updated shard by shard.
"""

from __future__ import annotations

import copy
import ctypes
import itertools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ddp_utils.config import ConfigError, TrainerConfig, UserError
from ddp_utils.dist import Runtime, broadcast_buffers
from ddp_utils.logs import log
from ddp_utils.models import memory_format_of
from ddp_utils.models.saved import saves_frozen
from ddp_utils.strategy.base import Strategy, model_units


class ShardedEMA:
    """An EMA of a sharded model: a second model sharded as the first, each rank averaging its
    own shards (``torch.optim.swa_utils``' EMA, element by element: the same numbers as
    ``ddp_utils.models.ema.EMA`` on whole tensors)."""

    def __init__(self, twin: nn.Module, decay: float, every_steps: int) -> None:
        self.module, self.decay, self.every_steps = twin, decay, every_steps
        self.n_averaged = torch.zeros((), dtype=torch.long)
        for p in twin.parameters():
            p.requires_grad_(False)

    @staticmethod
    def tensors(model: nn.Module) -> Iterator[torch.Tensor]:
        yield from model.parameters()
        yield from model.buffers()

    @torch.no_grad()
    def update(self, model: nn.Module, step: int, in_warmup: bool) -> None:
        if step % self.every_steps:
            return
        for ema, current in zip(self.tensors(self.module), self.tensors(model), strict=True):
            if self.n_averaged == 0 or not ema.is_floating_point():
                ema.copy_(current.detach())
            else:
                ema.lerp_(current.detach(), 1 - self.decay)
        self.n_averaged += 1
        if in_warmup:
            self.n_averaged.fill_(0)

    def state_dict(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.module), "n_averaged": self.n_averaged.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state["model"])
        self.n_averaged.copy_(torch.as_tensor(state["n_averaged"]))


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """On a CPU (glibc), allocate blocks from ``nbytes`` up with mmap and give them back when
    freed. glibc otherwise raises its mmap threshold after each large free, so the unit-sized
    buffers FSDP2 all-gathers and frees every forward and backward end up in the heap, which
    is not returned: a sharded rank then holds as much resident memory as DDP's whole replica
    (make bench-memory shows it)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to set
        return
    libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD: fixed, which also stops its adjustment


class ShardedScaler(ShardedGradScaler):
    """torch's sharded gradient scaler, made whole for a fused optimizer (AdamW with
    fused=True), which unscales inside its own kernel: the scaler then only checks the shards
    for overflows (``_check_inf_per_device``), which torch's sharded scaler does not reduce
    over the ranks, and its flags must be scalars, as the optimizer's step counts are."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)  # reduced over the ranks there
        if self._enabled:  # a disabled scaler (no fp16) keeps no state
            self._as_scalars(optimizer)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        for found in super()._check_inf_per_device(optimizer).values():
            on_device = found.to(self._device) if found.device.type != self._device else found
            dist.all_reduce(on_device, group=self.process_group)
            found.copy_(on_device)
        return self._as_scalars(optimizer)

    def _as_scalars(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = self._per_optimizer_states[id(optimizer)]
        found = state.get("found_inf_per_device", {})
        state["found_inf_per_device"] = {d: f.reshape(()) for d, f in found.items()}
        return state["found_inf_per_device"]


def mesh_shape(replicate: int, world_size: int, local_world_size: int) -> tuple[int, ...]:
    """The device mesh of ``trainer.fsdp.replicate`` at this world size: ``(world_size,)``
    for one group, else ``(groups, ranks a group)``; -1 takes a group a node."""
    groups = world_size // local_world_size if replicate == -1 else replicate
    if world_size % groups:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"trainer.fsdp.replicate={replicate} does not divide the world size {world_size}: "
            f"each replica group takes an equal share of the ranks. Set one of "
            f"{', '.join(map(str, divisors))}, or -1 for one group a node."
        )
    return (world_size,) if groups == 1 else (groups, world_size // groups)


def buffers_to(module: nn.Module, device: torch.device) -> None:
    """Move every buffer of ``module`` (not its parameters) to ``device``."""
    for m in module.modules():
        for name, buf in m._buffers.items():
            if buf is not None and buf.device != device:
                m._buffers[name] = buf.to(device)


class FSDP2Strategy(Strategy):
    lockstep_eval = True
    shards_parameters = True
    reads = ("fsdp.reshard_after_forward", "fsdp.cpu_offload", "fsdp.replicate")

    @classmethod
    def check(cls, trainer: TrainerConfig, rt: Runtime) -> None:
        super().check(trainer, rt)
        mesh_shape(trainer.fsdp.replicate, rt.world_size, rt.local_world_size)

    def build(self, make: Callable[[], nn.Module]) -> nn.Module:
        """The main rank builds the model whole, in host memory; every other rank on the meta
        device, which allocates nothing: its shards are filled with the main rank's weights
        after sharding (``distribute``), so the weights are the ones DDP would train. A model
        that cannot be built on the meta device is built whole on every rank."""
        self.make = make
        if self.rt.is_main:
            return make()
        try:
            with torch.device("meta"):
                return make()
        except UserError:  # the user's mistake, raised as on the main rank
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a model's own code on meta
            log.warning("the model could not be built on the meta device (%s): built whole "
                        "on every rank instead", e)  # fmt: skip
            return make()

    def whole_model(self) -> nn.Module | None:
        """The shards gathered into a new model on the main rank, in host memory first (a
        forward of the sharded model there alone would wait for the other ranks)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.raw_model, options=options)  # every rank
        if not self.rt.is_main:
            return None
        whole = self.make()
        whole.load_state_dict(state)
        return whole.to(self.rt.device, memory_format=memory_format_of(self.trainer.channels_last))

    def place(self, raw_model: nn.Module) -> None:
        """Nothing moves whole onto the device: ``fully_shard`` moves each unit's shards."""
        raw_model.to(memory_format=memory_format_of(self.trainer.channels_last))

    def distribute(self, raw_model: nn.Module) -> nn.Module:
        if self.rt.device.type == "cpu":
            fixed_mmap_threshold()
        whole = raw_model.state_dict() if self.rt.is_main else {}
        # The EMA twin is copied before sharding and sharded the same way, so that its
        # shards line up with the model's.
        twin = copy.deepcopy(raw_model) if self.trainer.ema_decay is not None else None
        shape = mesh_shape(self.trainer.fsdp.replicate, self.rt.world_size,
                           self.rt.local_world_size)  # fmt: skip
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh(self.rt.device.type, shape, mesh_dim_names=names)
        if len(shape) == 2:
            log.info("fsdp2: %d replica groups of %d ranks, each holding the model sharded "
                     "over its ranks (HSDP)", *shape)  # fmt: skip
        for module in (raw_model, twin) if twin is not None else (raw_model,):
            self.shard(module, mesh)
            self.fill(module, whole)
        self.ema_twin = twin
        return raw_model

    def fill(self, module: nn.Module, whole: dict[str, torch.Tensor]) -> None:
        """Every rank's shards of the main rank's ``whole`` state dict; its buffers (also
        those no state dict holds) broadcast from the main rank."""
        if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            module.to_empty(device="cpu" if self.trainer.fsdp.cpu_offload else self.rt.device)
            # Offload keeps parameters in host memory, never buffers: fully_shard put the main
            # rank's on the device, where the forward (BatchNorm) and the broadcast expect them.
            buffers_to(module, self.rt.device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        # A copy: torch puts the shards it made into the dict it is given (the EMA twin is
        # filled from the same one).
        set_model_state_dict(module, dict(whole), options=options)
        broadcast_buffers([module])

    def shard(self, module: nn.Module, mesh: Any) -> None:
        opts = self.trainer.fsdp
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.trainer.precision)
        # Parameters gathered in the autocast dtype, gradients reduced in fp32 (full precision:
        # both None, FSDP2's default). The units' inputs are left as they are: autocast casts
        # what its ops compute in the lower dtype, and a detector's target boxes, an input
        # too, must stay float32.
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                                  cast_forward_inputs=False)  # fmt: skip
        offload = CPUOffloadPolicy() if opts.cpu_offload else OffloadPolicy()
        kwargs = {"reshard_after_forward": opts.reshard_after_forward, "offload_policy": offload}
        # BatchNorm's running statistics are buffers, which FSDP never casts: in the autocast
        # dtype its weights would meet float32 statistics, which the kernels refuse in eval
        # mode. Units of their own keep them in float32 (as under DDP's autocast).
        batch_norm = nn.modules.batchnorm._BatchNorm
        norms = [m for m in module.modules() if dtype is not None and isinstance(m, batch_norm)]
        full = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
        for norm in norms:
            fully_shard(norm, mesh=mesh, mp_policy=full, **kwargs)
        for unit in model_units(module, opts.wrap, "trainer.fsdp.wrap"):
            if not any(unit is norm for norm in norms):  # a unit of its own already
                fully_shard(unit, mesh=mesh, mp_policy=mp, **kwargs)
        if not any(module is norm for norm in norms):
            fully_shard(module, mesh=mesh, mp_policy=mp, **kwargs)

    def make_scaler(self, enabled: bool) -> torch.amp.GradScaler:
        """Each rank checks only its gradient shards for overflows: the sharded scaler
        all-reduces what it found, so that every rank skips the same steps."""
        # Its overflow flag has shape (1,), which DTensor's dispatch warns about at every
        # unscale (and then handles as a replicated value, which it is).
        warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1", UserWarning)
        return ShardedScaler(self.rt.device.type, enabled=enabled)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients kept unreduced until the accumulation group's last micro-batch."""
        self.raw_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.raw_model.set_requires_gradient_sync(True)

    def make_ema(self, decay: float, every_steps: int) -> ShardedEMA:
        assert self.ema_twin is not None, "the twin is made when trainer.ema_decay is set"
        return ShardedEMA(self.ema_twin, decay, every_steps)

    def model_state_dict(self) -> dict[str, Any]:
        frozen_out = not saves_frozen(self.raw_model)
        options = StateDictOptions(ignore_frozen_params=frozen_out)
        return get_model_state_dict(self.raw_model, options=options)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        options = StateDictOptions(strict=saves_frozen(self.raw_model))
        set_model_state_dict(self.raw_model, state, options=options)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return get_optimizer_state_dict(self.raw_model, optimizer)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        set_optimizer_state_dict(self.raw_model, optimizer, state)
