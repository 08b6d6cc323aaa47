"""Which engine makes the model data-parallel, named once: ours or PyTorch's, DDP, ZeRO (stage 1) or FSDP,
on one transport; and what differs between them when a trainer builds the optimizer or saves the state.

    parallel = Parallel(impl="selfmade", sharding="fsdp", transport="auto")
    model = parallel.wrap(net)                                   # rank 0's parameters on every rank
    optimizer = parallel.optimizer(model, lr=0.01, momentum=0.5)
    state = parallel.full_model_state(model, net)                # a collective when sharded

``resolve_sync_bn`` picks the BatchNorm that goes with the engine (the trainer converts the model to it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
# At the top, before the process group exists (half a second per process): imported after it, one of its
# functions would keep the default group as a default argument after teardown (see process_groups.teardown).
from torch.distributed.optim import ZeroRedundancyOptimizer

from dpkit.comm import transport as transports
from dpkit.engines.ddp import broadcast_module_state, make_ddp
from dpkit.engines.fsdp import FSDP
from dpkit.engines.zero import ShardedOptimizer

IMPLS = ("selfmade", "pytorch")
SHARDINGS = ("none", "zero", "fsdp")
# What sharding "fsdp" shards (ours and PyTorch's): nearly all of the CNN's and resnet18's parameters.
FSDP_SHARD_TYPES = (nn.Conv2d, nn.Linear)


@dataclass(frozen=True)
class Parallel:
    """The data-parallel engine of a run.

    ``impl``: "selfmade" (dpkit's engines) or "pytorch" (PyTorch's). ``sharding``: "none" (DDP),
    "zero" (DDP, optimizer state sharded) or "fsdp" (parameters, gradients and optimizer state
    sharded). ``bucket_cap_mb``: the DDPs' gradient buckets. ``transport``: how every engine's
    tensors travel (``transport.resolve``), PyTorch's through its comm hook or fully_shard's
    custom collectives, unless it is "torch" (their own).
    """

    impl: str = "selfmade"
    sharding: str = "none"
    bucket_cap_mb: float = 25.0
    transport: str = "auto"

    def __post_init__(self):
        if self.impl not in IMPLS or self.sharding not in SHARDINGS:
            raise ValueError(f"Parallel: impl must be one of {IMPLS} and sharding one of {SHARDINGS}, "
                             f"got {self.impl!r} and {self.sharding!r}")

    def wrap(self, model: nn.Module) -> nn.Module:
        """Our DDP or PyTorch's (also for "zero", which shards only the optimizer); for "fsdp" our ``FSDP``
        or PyTorch's ``fully_shard`` on each ``FSDP_SHARD_TYPES`` layer and the root. All take rank 0's
        parameters. PyTorch's DDP gets ``forward_sync_buffers=False`` (from ``make_ddp``), like ours:
        BatchNorm buffers are kept equal by SyncBatchNorm or per rank by choice, and a trainer hands every
        rank rank 0's buffers before validating; the default would add a broadcast per optimizer step.
        """
        if self.sharding != "fsdp":
            kind = "bucketed" if self.impl == "selfmade" else "pytorch"
            return make_ddp(kind, model, self.bucket_cap_mb, transport=self.transport)
        if self.impl == "selfmade":
            return FSDP(model, shard_types=FSDP_SHARD_TYPES, transport=self.transport)
        broadcast_module_state(model)  # fully_shard shards what each rank holds: make it rank 0's first
        for layer in model.modules():
            if isinstance(layer, FSDP_SHARD_TYPES):
                fully_shard(layer)
        model = fully_shard(model)
        chosen = transports.resolve(self.transport, None, next(model.parameters()).device, engine="fully_shard")
        if not isinstance(chosen, transports.Torch):
            transports.use_with_fully_shard(model, chosen)
        return model

    def optimizer(self, model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
        """SGD over what this rank updates of the wrapped ``model``; "zero" shards its state:
        ``ShardedOptimizer`` (ours) or ``ZeroRedundancyOptimizer`` (PyTorch's)."""
        options = dict(lr=lr, momentum=momentum)
        if self.sharding != "zero":
            return torch.optim.SGD(model.parameters(), **options)
        if self.impl == "selfmade":
            return ShardedOptimizer(model.parameters(), torch.optim.SGD, transport=self.transport, **options)
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, **options)

    def full_model_state(self, model: nn.Module, module: nn.Module) -> dict:
        """The unwrapped ``module``'s ``state_dict`` (full tensors, plain keys) for rank 0 to save, from the
        wrapped ``model``. A collective for "fsdp": every rank must call it."""
        if self.sharding != "fsdp":
            return module.state_dict()
        if self.impl == "selfmade":
            return model.full_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_state_options())

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """The optimizer state for rank 0 to save; every rank must call it (sharded states are collectives).

        Consolidated where the engine offers it (ours and PyTorch's ZeRO, PyTorch's FSDP); for our FSDP,
        whose optimizer holds the state of this rank's flat shards, the list of every rank's."""
        if self.sharding == "none" or (self.sharding == "zero" and self.impl == "selfmade"):
            return optimizer.state_dict()  # ShardedOptimizer.state_dict() consolidates on every rank
        if self.sharding == "zero":
            optimizer.consolidate_state_dict(to=0)
            return optimizer.state_dict() if dist.get_rank() == 0 else None
        if self.impl == "pytorch":
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(model, optimizer, options=_full_state_options())
        states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(optimizer.state_dict(), states, dst=0)
        return states

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state) -> None:
        """Load what ``full_optimizer_state`` saved, on every rank (each keeps its own part)."""
        if self.sharding == "fsdp" and self.impl == "pytorch":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
        elif self.sharding == "fsdp":
            optimizer.load_state_dict(state[dist.get_rank()])
        else:
            optimizer.load_state_dict(state)


def _full_state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)  # cpu_offload: the values on rank 0 only


def resolve_sync_bn(requested: str, impl: str, device: torch.device) -> tuple[str, list[str]]:
    """The BatchNorm flavour to use, and notices. PyTorch's SyncBatchNorm needs CUDA tensors."""
    if requested == "pytorch" and device.type != "cuda":
        raise RuntimeError("--sync-bn pytorch: torch.nn.SyncBatchNorm only runs on CUDA tensors and this job runs on "
                           f"{device.type}. Use --sync-bn selfmade (syncbn.py, runs on CPU), none, or auto.")
    if requested != "auto":
        return requested, []
    if impl == "selfmade":
        return "selfmade", []
    if device.type == "cuda":
        return "pytorch", []
    return "selfmade", ["--sync-bn auto with --distributed-impl pytorch on CPU: torch.nn.SyncBatchNorm cannot run "
                        "on CPU tensors, so BatchNorm is synchronised by syncbn.py (ours) instead"]
