"""What ZeRO stage 1 holds beside the parameters and their gradients, counted from outside, against AdamW's state.

    python tests/test_zero_memory.py      # prints the bytes each rank's optimizer holds

ONE spawned group of 4 workers: the whole world, then ranks {0, 1} and {2, 3} as two 2-rank subgroups. Each
builds four 512x512 Linear layers, gives every parameter a gradient and steps once with
``ShardedOptimizer(AdamW)`` on transport "torch" and on "auto" (shared memory here), then with the plain
``torch.optim.AdamW`` on the same model (the oracle). What an optimizer holds: every tensor reachable from it
(attributes followed through gc referents; types, modules and nn.Modules not followed), storages deduplicated
by address, less the bytes of the parameters and gradients lying in them (a buffer the parameters are views of
counts its padding only). A transport is not walked (a shared-memory one maps every rank's whole arena: virtual
memory); it adds ``held_bytes()`` (its arena's pages) less the parameters lying there, and a tensor it owns is
not counted again.
"""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from common import run_workers
from dpkit.comm import transport as transports
from dpkit.engines import zero

WORLD = 4
KINDS = ("torch", "auto")
# Everything ZeRO stage 1 over n ranks may hold beside parameters and gradients, over AdamW's whole state: its
# 1/n of that state, and a margin for the rows' padding and alignment (no buffer the size of the parameters).
LIMITS = {2: 0.55, 4: 0.30}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])


def _reachable(root) -> tuple[list[torch.Tensor], list[transports.Transport]]:
    """Every tensor reachable from ``root``, and the transports met on the way (not walked)."""
    skip = {id(m.__dict__) for m in list(sys.modules.values()) if m is not None}
    seen, stack, tensors, found = set(), [root], [], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in skip:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, transports.Transport):
            found.append(obj)
        elif not isinstance(obj, (type, types.ModuleType, nn.Module)):
            stack.extend(gc.get_referents(obj))
    return tensors, found


def _whole(storage) -> torch.Tensor:
    """A byte tensor over a whole storage: what ``Transport.owns`` is asked about."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def held_bytes(optimizer, model: nn.Module) -> int:
    """Bytes ``optimizer`` holds beside ``model``'s parameters and their gradients (see the module docstring)."""
    tensors, found = _reachable(optimizer)
    exempt = {id(t): t for p in model.parameters() for t in (p, p.grad) if t is not None}.values()
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and not any(tr.owns(_whole(storage)) for tr in found):
            storages[storage.data_ptr()] = storage.nbytes()
    total = sum(storages.values()) + sum(tr.held_bytes() for tr in found)
    for t in exempt:  # a parameter or gradient: in a counted storage, or in a transport's memory
        if t.untyped_storage().data_ptr() in storages or any(tr.owns(t) for tr in found):
            total -= t.numel() * t.element_size()
    return total


def _one_step(model: nn.Module, optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    optimizer.step()


def _case(group, kind: str) -> dict:
    model = _model()
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-3,
                                      transport=kind)
    _one_step(model, optimizer)
    plain_model = _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    _one_step(plain_model, plain)
    params_equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    result = {"held": held_bytes(optimizer, model), "adamw": held_bytes(plain, plain_model),
              "transport": type(optimizer.transport).__name__, "params_equal": params_equal}
    optimizer.close()
    if kind != "torch":  # "auto" made a transport of its own here
        optimizer.transport.close()
    return result


def _grid(ctx) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    out = {}
    for n, group in ((2, pairs[ctx.rank // 2]), (WORLD, None)):
        for kind in KINDS:
            out[n, kind] = _case(group, kind)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_workers(_grid, WORLD)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", sorted(LIMITS))
def test_zero_holds_its_share_of_adamws_state_and_no_buffer_the_size_of_the_parameters(ranks, n, kind):
    """Each rank at most LIMITS[n] x what AdamW holds; the ranks of a group together at least AdamW's state (the
    count sees the sharded state: it is not blind), and the parameters after the step are AdamW's, bit for bit."""
    for group_start in range(0, WORLD, n):
        cases = [outcome[n, kind] for outcome in ranks[group_start:group_start + n]]
        for case in cases:
            assert case["transport"] == ("Torch" if kind == "torch" else "SharedMemory"), case
            assert case["params_equal"], case
            assert case["held"] <= LIMITS[n] * case["adamw"], (n, kind, case)
        assert sum(case["held"] for case in cases) >= cases[0]["adamw"], (n, kind, cases)


if __name__ == "__main__":
    for rank, outcome in enumerate(run_workers(_grid, WORLD)):
        for (n, kind), case in outcome.items():
            print(f"rank {rank} of {n} ranks, transport {kind!r} ({case['transport']}): ShardedOptimizer holds "
                  f"{case['held']:,} bytes, torch.optim.AdamW {case['adamw']:,} ({case['held'] / case['adamw']:.3f}x)")
