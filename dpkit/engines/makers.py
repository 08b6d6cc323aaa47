"""How each registered engine (``registry``) wraps a model and builds its optimizer, ours and PyTorch's, on one
transport. ``registry`` names them; these functions only build.

    model = wrap_zero1_ours(module, "auto", Options())
    optimizer = sharded_optimizer(model, torch.optim.SGD, "auto", lr=0.01)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
# At the top, before the process group exists: imported after it, one of its functions would keep the
# default group as a default argument after teardown (see process_groups.teardown).
from torch.distributed.optim import ZeroRedundancyOptimizer

from dpkit.comm import transport
from dpkit.engines.ddp import DDP, broadcast_module_state, make_ddp
from dpkit.engines.fsdp import FSDP
from dpkit.engines.zero import ShardedOptimizer


@dataclass(frozen=True)
class Options:
    """What a wrap may use: DDP's gradient buckets (MiB), the layer types FSDP shards as units."""

    bucket_cap_mb: float = 25.0
    shard_types: tuple[type, ...] = (nn.Linear, nn.Embedding, nn.Conv2d)


def plain_optimizer(model: nn.Module, optimizer_class: type, transport, **options) -> torch.optim.Optimizer:
    return optimizer_class(model.parameters(), **options)


@dataclass(frozen=True)
class Impl:
    """One implementation: ``wrap(module, transport, options) -> model``; ``optimizer(model, optimizer_class,
    transport, **optimizer_options)`` over what this rank updates (default: ``optimizer_class`` over all)."""

    wrap: Callable[[nn.Module, object, Options], nn.Module]
    optimizer: Callable[..., torch.optim.Optimizer] = plain_optimizer


def ddp_ours(module: nn.Module, transport, options: Options) -> nn.Module:
    return DDP(module, options.bucket_cap_mb, transport=transport)


def ddp_pytorch(module: nn.Module, transport, options: Options) -> nn.Module:
    """PyTorch's DDP, our transport through its comm hook unless "torch" (``make_ddp``)."""
    return make_ddp("pytorch", module, options.bucket_cap_mb, transport=transport)


def unwrapped(module: nn.Module, transport, options: Options) -> nn.Module:
    """ZeRO stage 2: no wrapper, the optimizer's hooks reduce-scatter the gradients."""
    return module


def sharded_optimizer(model: nn.Module, optimizer_class: type, transport, **options) -> torch.optim.Optimizer:
    return ShardedOptimizer(model.parameters(), optimizer_class, transport=transport, **options)


def sharded_optimizer_stage2(model: nn.Module, optimizer_class: type, transport, **options) -> torch.optim.Optimizer:
    return ShardedOptimizer(model.parameters(), optimizer_class, transport=transport, stage=2, **options)


def zero_redundancy(model: nn.Module, optimizer_class: type, transport, **options) -> torch.optim.Optimizer:
    """PyTorch's ZeRO-1: it broadcasts the parameters through torch.distributed itself (takes no transport)."""
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **options)


def fsdp_ours(module: nn.Module, transport, options: Options) -> nn.Module:
    return FSDP(module, shard_types=options.shard_types, transport=transport)


def hsdp_ours(module: nn.Module, transport, options: Options) -> nn.Module:
    return FSDP(module, shard_types=options.shard_types, transport=transport, shard="host")


def fsdp_pytorch(module: nn.Module, spec, options: Options) -> nn.Module:
    """``fully_shard`` on each ``options.shard_types`` layer and the root, from rank 0's parameters; a transport
    other than "torch" carries its collectives (``use_with_fully_shard``)."""
    broadcast_module_state(module)  # fully_shard shards what each rank holds: make it rank 0's first
    for layer in module.modules():
        if isinstance(layer, options.shard_types):
            fully_shard(layer)
    model = fully_shard(module)
    chosen = transport.resolve(spec, None, next(model.parameters()).device, engine="fully_shard")
    if not isinstance(chosen, transport.Torch):
        transport.use_with_fully_shard(model, chosen)
    return model
