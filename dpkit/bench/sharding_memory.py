"""What a rank holds under ``sharding_benchmark.py``'s variants, in bytes: distinct storages (``storage_bytes``),
with what the transport holds for them (``held_bytes``), against the ideal model-state bytes an engine must hold
(``ideal_bytes``), counted from the whole model's shapes (``full_sizes``).

    full = full_sizes(module)
    ideal_bytes("zero1", full, world_size)   # parameters + gradients + 1/n of AdamW's state
"""

from __future__ import annotations

import torch
from torch import nn

from dpkit.bench.sharding_setups import FSDP_SHARD_TYPES
from dpkit.comm import transport
from dpkit.engines import registry


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its local shard for a DTensor (PyTorch's FSDP), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight or a shared bucket counts once)."""
    storages = {}
    for t in tensors:
        if t is not None:
            t = local(t)
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _in_transport(t: torch.Tensor, wire: transport.Transport) -> bool:
    """Whether ``t``'s storage lies in memory ``transport`` holds itself (asked of the whole storage)."""
    t = local(t)
    storage = t.untyped_storage()
    return storage.nbytes() > 0 and wire.owns(t.new_empty(0, dtype=torch.uint8).set_(storage))


def held_bytes(tensors, wire: transport.Transport) -> int:
    """Bytes held by ``tensors`` (distinct storages) and by ``transport`` for them: the memory of its own
    (``Transport.held_bytes``: a shared-memory arena's pages in /dev/shm, with the buffers that lie there,
    counted once, its staging block, and blocks freed whose pages it keeps)."""
    outside = [t for t in tensors if t is not None and not _in_transport(t, wire)]
    return storage_bytes(outside) + wire.held_bytes()


def full_sizes(module: nn.Module, shard_types=FSDP_SHARD_TYPES) -> dict:
    """The whole model's state, counted from shapes (not from any rank's tensors): the ideal's inputs.

    AdamW keeps two moments per trainable element, plus a scalar step count per tensor.
    ``largest_unit``: the biggest parameters of one ``shard_types`` module, what FSDP gathers at once."""
    params = list(module.parameters())  # a tied weight counts once
    trainable = [p for p in params if p.requires_grad]
    step_bytes = torch.empty((), dtype=torch.float32).element_size()
    units = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
             for m in module.modules() if isinstance(m, shard_types)]
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.numel() * p.element_size() for p in trainable),
            "state": sum(2 * p.numel() * p.element_size() + step_bytes for p in trainable),
            "largest_unit": max(units, default=0)}


def ideal_bytes(engine: str, full: dict, n: int) -> int:
    """Model-state bytes one rank must hold: parameters, gradients and optimizer state of the whole model (``full``),
    by what ``engine`` shards (its ZeRO stage in the registry)."""
    p, g, s = full["params"], full["grads"], full["state"]
    shards = registry.get(engine).shards
    if shards == 0:  # DDP
        return p + g + s
    if shards == 1:  # the optimizer state sharded
        return p + g + s // n
    if shards == 2:  # the gradients too
        return p + (g + s) // n
    return (p + g + s) // n + full["largest_unit"]  # everything sharded, one unit gathered at a time
