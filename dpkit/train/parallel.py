"""Which engine makes the model data-parallel, by its registered name (``dpkit.engines.registry``: ddp, zero1,
zero2, fsdp, hsdp, each ours or PyTorch's where it exists), on one transport; and what differs between them
when a trainer builds the optimizer or saves the state.

    parallel = Parallel(impl="ours", engine="fsdp", transport="auto")
    model = parallel.wrap(net)                                   # rank 0's parameters on every rank
    optimizer = parallel.optimizer(model, lr=0.01, momentum=0.5)
    state = parallel.full_model_state(model, net)                # a collective when sharded

``resolve_sync_bn`` picks the BatchNorm that goes with the engine (the trainer converts the model to it);
``named`` reads a flag's value: a known name, else a usage error that lists the known ones.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from dpkit.engines import registry

IMPLS = registry.IMPLS
SYNC_BNS = ("auto", "ours", "pytorch", "none")
# What an FSDP shards (ours and PyTorch's): nearly all of the CNN's and resnet18's parameters.
FSDP_SHARD_TYPES = (nn.Conv2d, nn.Linear)


def engines() -> tuple[str, ...]:
    """The engines a trainer can run: every registered one with an implementation."""
    return tuple(n for n in registry.names() if registry.get(n).impls)


def named(kind: str):
    """An argparse ``type`` for an "engine", "impl" or "sync_bn" flag: the value if it is a known name, else a
    usage error that lists the known ones (the engines are those registered when the flag is read)."""
    def parse(text: str) -> str:
        try:
            if kind == "sync_bn":
                return registry.one_of(text, "sync-bn", SYNC_BNS)
            return registry.checked(text, kind)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    parse.__name__ = kind
    return parse


@dataclass(frozen=True)
class Parallel:
    """The data-parallel engine of a run.

    ``impl``: "ours" (dpkit's engines) or "pytorch" (PyTorch's). ``engine``: an engine's name (``engines()``):
    "ddp", "zero1" (DDP, optimizer state sharded), "zero2" (gradients too), "fsdp" (parameters, gradients and
    optimizer state sharded), "hsdp" (FSDP inside a host); another name is a ValueError listing these.
    ``bucket_cap_mb``: the DDPs' gradient buckets. ``transport``: how every engine's tensors
    travel (``transport.resolve``), PyTorch's through its comm hook or fully_shard's custom collectives,
    unless it is "torch" (their own).
    """

    impl: str = "ours"
    engine: str = "ddp"
    bucket_cap_mb: float = 25.0
    transport: str = "auto"

    def __post_init__(self):
        try:
            registry.impl(self.engine, self.impl)
        except ValueError as error:
            raise ValueError(f"Parallel: {error}") from None

    @property
    def shards(self) -> int:
        """The engine's ZeRO stage: 0 (nothing sharded) to 3 (parameters sharded)."""
        return registry.get(self.engine).shards

    def wrap(self, model: nn.Module) -> nn.Module:
        """The engine's wrapper (``registry.wrap``), from rank 0's parameters; FSDPs shard each
        ``FSDP_SHARD_TYPES`` layer and the root. PyTorch's DDP gets ``forward_sync_buffers=False`` (from
        ``make_ddp``), like ours: BatchNorm buffers are kept equal by SyncBatchNorm or per rank by choice, and
        a trainer hands every rank rank 0's buffers before validating; the default would add a broadcast per
        optimizer step.
        """
        options = registry.Options(bucket_cap_mb=self.bucket_cap_mb, shard_types=FSDP_SHARD_TYPES)
        return registry.wrap(self.engine, self.impl, model, self.transport, options)

    def optimizer(self, model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
        """SGD over what this rank updates of the wrapped ``model``: sharded by ZeRO engines
        (``ShardedOptimizer``, ours, or ``ZeroRedundancyOptimizer``, PyTorch's)."""
        return registry.optimizer(self.engine, self.impl, model, torch.optim.SGD, self.transport,
                                  lr=lr, momentum=momentum)

    def full_model_state(self, model: nn.Module, module: nn.Module) -> dict:
        """The unwrapped ``module``'s ``state_dict`` (full tensors, plain keys) for rank 0 to save, from the
        wrapped ``model``. A collective when the parameters are sharded: every rank must call it."""
        if self.shards < 3:
            return module.state_dict()
        if self.impl == "ours":
            return model.full_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_state_options())

    def full_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """The optimizer state for rank 0 to save; every rank must call it (sharded states are collectives).

        Consolidated where the engine offers it (ours and PyTorch's ZeRO, PyTorch's FSDP); for our FSDP,
        whose optimizer holds the state of this rank's flat shards, the list of every rank's."""
        if self.shards == 0 or (self.shards < 3 and self.impl == "ours"):
            return optimizer.state_dict()  # ShardedOptimizer.state_dict() consolidates on every rank
        if self.shards < 3:
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
        if self.shards == 3 and self.impl == "pytorch":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
        elif self.shards == 3:
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
                           f"{device.type}. Use --sync-bn ours (syncbn.py, runs on CPU), none, or auto.")
    if requested != "auto":
        return requested, []
    if impl == "ours":
        return "ours", []
    if device.type == "cuda":
        return "pytorch", []
    return "ours", ["--sync-bn auto with --impl pytorch on CPU: torch.nn.SyncBatchNorm cannot run "
                        "on CPU tensors, so BatchNorm is synchronised by syncbn.py (ours) instead"]
