"""How ``sharding_benchmark.py`` builds each engine on one rank: a builder ``f(module, transport) -> Setup`` per
engine, implementation and option (module: seeded, on this rank's device), with AdamW, and what the benchmark asks
of the result (its exposed communication, the buffers it keeps, its optimizer state).

    setup = zero_ours(fresh_module, transport_choice.new("shared_memory", device))
    setup = registered("toy", "ours", fresh_module, wire)   # a registered engine with no builder of its own
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
# At the top, before the process group exists: imported after it, one of its functions would keep the
# default group as a default argument after teardown (see process_groups.teardown).
from torch.distributed.optim import ZeroRedundancyOptimizer

from dpkit import compat
from dpkit.comm import transport
from dpkit.engines import registry, zero
from dpkit.engines.ddp import DDP
from dpkit.engines.fsdp import FSDP

LR = 1e-4  # AdamW; small, so many steps on random labels stay finite
# FSDP shards these layers (ours and PyTorch's alike): every linear and embedding layer of the GPT, every
# convolution and the classifier of resnet18; norms stay replicated.
FSDP_SHARD_TYPES = (nn.Linear, nn.Embedding, nn.Conv2d)


@dataclass
class Setup:
    """A built variant on this rank: the model to call, its optimizer, and what the benchmark asks of it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    exposed_s: Callable[[], float | None] = lambda: None  # the last iteration's exposed communication, if measurable
    kept: Callable[[], list[torch.Tensor]] = list  # buffers kept between iterations besides parameters and state
    state: Callable[[], list[torch.Tensor]] | None = None  # optimizer-state tensors (default: optimizer.state)
    settle: Callable[[], None] = lambda: None  # waits for communication an iteration leaves in flight
    grads: Callable[[], list[torch.Tensor]] | None = None  # what holds the gradients after backward (default: .grad)

    def state_tensors(self) -> list[torch.Tensor]:
        if self.state is not None:
            return self.state()
        return [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]

    def grad_tensors(self) -> list[torch.Tensor]:
        if self.grads is not None:
            return self.grads()
        return [p.grad for p in self.model.parameters() if p.grad is not None]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _pytorch_ddp(module: nn.Module, wire: transport.Transport) -> nn.Module:
    """PyTorch's DDP: its own all-reduce on [torch] and [torch:dpkit] (on that transport's group), our transport
    through its communication hook otherwise."""
    own = isinstance(wire, transport.Torch)
    model = nn.parallel.DistributedDataParallel(module, process_group=wire.group if own else None,
                                                **compat.NO_BUFFER_SYNC)  # like ours: buffers synced once
    if not own:
        model.register_comm_hook(wire, transport.ddp_comm_hook)  # averages each bucket, as its own does
    return model


def _reducer_buckets(model: nn.parallel.DistributedDataParallel) -> list[torch.Tensor]:
    """Tensors the size of PyTorch's DDP's gradient buckets, which it keeps between iterations as ours does.

    Its Reducer allocates one flat tensor per bucket at construction (again when it rebuilds them after
    the first iteration) and keeps it; with ``gradient_as_bucket_view=False`` (the default, used here)
    that is besides ``param.grad``, copied into the bucket and back. Left out, PyTorch's peak would lack
    the bucket bytes that ours counts. No public API reaches the buckets: the Reducer's private one
    returns zeros of their sizes (allocated while counting, outside ``PeakMemory``)."""
    return [bucket.buffer() for bucket in model.reducer._get_zeros_like_grad_buckets()]


def ddp_ours(module: nn.Module, wire: transport.Transport) -> Setup:
    model = DDP(module, transport=wire)
    # kept: the buckets (the transport's), which hold the gradients
    return Setup(model, adamw(model.parameters()), exposed_s=lambda: model.last_wait_s,
                 kept=lambda: [b.flat for b in model.buckets])


def ddp_pytorch(module: nn.Module, wire: transport.Transport) -> Setup:
    model = _pytorch_ddp(module, wire)
    return Setup(model, adamw(model.parameters()), kept=lambda: _reducer_buckets(model))


def zero_ours(module: nn.Module, wire: transport.Transport, overlap_forward: bool = True, **options) -> Setup:
    """Our DDP and our ZeRO over it, on one transport; ``overlap_forward``: the all-gathers overlap the next
    forward (``ShardedOptimizer.overlap_with_forward``), else step() waits for them."""
    model = DDP(module, transport=wire)
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, transport=wire, **options)
    if overlap_forward:
        optimizer.overlap_with_forward(model)
    return Setup(model, optimizer, exposed_s=lambda: model.last_wait_s + optimizer.last_share_s,
                 kept=lambda: [b.flat for b in model.buckets]  # gradient buckets, then each all-gather buffer
                 + [b.buffer for b in optimizer.buckets if b.buffer is not None],
                 settle=optimizer.wait_for_parameters)  # overlap_with_forward: all-gathers still on their way


def zero_ours_in_step(module: nn.Module, wire: transport.Transport) -> Setup:
    """The default ShardedOptimizer: step() waits (only the update of later buckets overlaps the all-gathers)."""
    return zero_ours(module, wire, overlap_forward=False)


def zero_ours_broadcast(module: nn.Module, wire: transport.Transport) -> Setup:
    """The alternative update: one torch.distributed broadcast per owner instead of the all-gather (measured, not
    chosen). The broadcasts bypass the transport: only [torch] compares them with the default alone."""
    setup = zero_ours(module, wire)
    setup.optimizer.update = "broadcast"
    return setup


def zero_ours_tensor(module: nn.Module, wire: transport.Transport) -> Setup:
    """Whole tensors per rank (exact for per-tensor optimizers): uneven when one tensor is a large part of the model."""
    return zero_ours(module, wire, partition="tensor")


def zero2_ours(module: nn.Module, wire: transport.Transport) -> Setup:
    """ZeRO stage 2: no DDP; the optimizer's hooks reduce-scatter each bucket's gradients to their owners during
    backward (each rank keeps 1/n of them), its step all-gathers the parameters, overlapping the next forward."""
    optimizer = zero.ShardedOptimizer(module.parameters(), torch.optim.AdamW, lr=LR, transport=wire, stage=2)
    optimizer.overlap_with_forward(module)
    return Setup(module, optimizer, exposed_s=lambda: optimizer.last_reduce_wait_s + optimizer.last_share_s,
                 kept=lambda: optimizer.reduce_pool() + optimizer.gradient_shares(),  # (2, slot bytes), (width,)
                 settle=optimizer.wait_for_parameters, grads=optimizer.gradient_shares)


def zero_pytorch(module: nn.Module, wire: transport.Transport) -> Setup:
    """ZeroRedundancyOptimizer over PyTorch's DDP: it broadcasts the updated parameters through torch.distributed
    itself, so it cannot take our transport: [torch] only (ours is compared with it there)."""
    model = _pytorch_ddp(module, wire)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return Setup(model, optimizer, kept=lambda: _reducer_buckets(model),
                 state=lambda: [t for s in optimizer.optim.state.values() for t in s.values()
                                if torch.is_tensor(t)])  # its local optimizer's


def fsdp_ours(module: nn.Module, wire: transport.Transport, **options) -> Setup:
    model = FSDP(module, shard_types=FSDP_SHARD_TYPES, transport=wire, **options)
    return Setup(model, adamw(model.parameters()), exposed_s=lambda: model.last_wait_s,
                 kept=lambda: [b.flat for b in model.replicated_buckets])  # the replicated parameters' gradients


def fsdp_pytorch(module: nn.Module, wire: transport.Transport, compute_dtype=None,
                 reshard_after_forward=True) -> Setup:
    """``fully_shard`` on each ``FSDP_SHARD_TYPES`` layer, then the root (its norms), as ours shards; on a
    transport other than [torch], its all-gathers and reduce-scatters through it (``use_with_fully_shard``)."""
    # Like ours: each sharded layer's floating inputs cast to the compute dtype and its outputs back to
    # float32, the root's norms in float32. By default the outputs would stay in the compute dtype and
    # the root's parameters would be cast too: norms, logits and loss in it, a smaller computation.
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                  output_dtype=None if compute_dtype is None else torch.float32)
    mesh = _mesh(wire, module)
    for layers in _tied_groups([m for m in module.modules() if isinstance(m, FSDP_SHARD_TYPES)]):
        # fully_shard refuses a parameter in two groups: layers sharing one (GPT's head and embedding) form one
        fully_shard(layers if len(layers) > 1 else layers[0], mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    model = fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    if not isinstance(wire, transport.Torch) and transport.use_with_fully_shard(model, wire) == 0:
        raise RuntimeError("no FSDPModule took the transport")
    return Setup(model, adamw(model.parameters()))


def _mesh(wire: transport.Transport, module: nn.Module) -> DeviceMesh | None:
    """fully_shard's mesh on [torch:dpkit]: the transport's own group ("dpkit"); else None (the default group's)."""
    if not isinstance(wire, transport.Torch) or wire.group is None:
        return None
    return DeviceMesh.from_group(wire.group, next(module.parameters()).device.type)


def _tied_groups(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """``layers`` (those with parameters) in groups: layers that share a parameter end up in the same group."""
    groups: list[tuple[set[int], list[nn.Module]]] = []
    for layer in layers:
        ids = {id(p) for p in layer.parameters()}
        if not ids:
            continue
        joined = [g for g in groups if g[0] & ids]
        for g in joined:
            groups.remove(g)
        groups.append((ids.union(*(g[0] for g in joined)), [m for g in joined for m in g[1]] + [layer]))
    return [members for _, members in groups]


def registered(engine: str, impl: str, module: nn.Module, wire: transport.Transport) -> Setup:
    """An engine of the registry that has no builder above: its own wrap and optimizer, nothing more measured."""
    model = registry.wrap(engine, impl, module, wire, registry.Options(shard_types=FSDP_SHARD_TYPES))
    return Setup(model, registry.optimizer(engine, impl, model, torch.optim.AdamW, wire, lr=LR))
