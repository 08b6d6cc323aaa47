"""What ZeRO stages 1 and 2 hold beside the parameters and their gradients, counted from outside, against AdamW's state.

    python tests/test_zero_memory.py      # prints the bytes each rank's optimizer holds

ONE spawned group of 4 workers: the whole world, then ranks {0, 1} and {2, 3} as two 2-rank subgroups. Each
builds four 512x512 Linear layers, gives every parameter a gradient of 0.5 (stage 1: set by hand, as DDP would
leave it; stage 2: by a backward, reduce-scattered) and steps once with ``ShardedOptimizer(AdamW)`` at each stage
on transport "torch" and on "auto" (shared memory here), then with the plain ``torch.optim.AdamW`` on the same
model (the oracle). Stage 2's gradients are its shares (``gradient_shares()``): counted apart, not as held. What
an optimizer holds: every tensor reachable from it
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
from dpkit.comm import transport
from dpkit.engines import zero

WORLD = 4
KINDS = ("torch", "auto")
STAGES = (1, 2)
# Everything ZeRO over n ranks may hold beside parameters and gradients, over AdamW's whole state: its 1/n of
# that state, and a margin for the rows' padding and alignment and, at stage 2, the reduce-scatter pool (no
# buffer the size of the parameters).
LIMITS = {2: 0.55, 4: 0.30}
# Stage 2's gradients on a rank: its 1/n of the parameters' gradient bytes, plus a used-flag per piece and the
# padding of its row (a few elements): at most this many bytes more.
SHARE_SLACK = 1024


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])


def _reachable(root) -> tuple[list[torch.Tensor], list[transport.Transport]]:
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
        elif isinstance(obj, transport.Transport):
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


def _one_step(model: nn.Module, optimizer, stage: int = 1) -> None:
    """Every gradient 0.5: at stage 2 through backward (d/dp of sum(0.5 p)), whose average over any n of 2 or 4
    ranks is 0.5 exactly; else set by hand."""
    if stage == 2:
        sum((0.5 * p).sum() for p in model.parameters()).backward()
    else:
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
    optimizer.step()


def _case(group, kind: str, stage: int) -> dict:
    model = _model()
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-3,
                                      transport=kind, stage=stage)
    _one_step(model, optimizer, stage)
    plain_model = _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    _one_step(plain_model, plain)
    params_equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    shares = sum(t.numel() * t.element_size() for t in optimizer.gradient_shares())
    result = {"held": held_bytes(optimizer, model) - shares, "shares": shares, "adamw": held_bytes(plain, plain_model),
              "grads": sum(p.numel() * p.element_size() for p in plain_model.parameters()),
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
            for stage in STAGES:
                out[n, kind, stage] = {**_case(group, kind, stage), "rank": dist.get_rank(group)}
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_workers(_grid, WORLD)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", sorted(LIMITS))
def test_zero_holds_its_share_of_adamws_state_and_no_buffer_the_size_of_the_parameters(ranks, n, kind, stage):
    """Each rank at most LIMITS[n] x what AdamW holds; the ranks of a group together at least AdamW's state (the
    count sees the sharded state: it is not blind), and the parameters after the step are AdamW's, bit for bit."""
    for group_start in range(0, WORLD, n):
        cases = [outcome[n, kind, stage] for outcome in ranks[group_start:group_start + n]]
        for case in cases:
            assert case["transport"] == ("Torch" if kind == "torch" else "SharedMemory"), case
            assert case["params_equal"], case
            assert case["held"] <= LIMITS[n] * case["adamw"], (n, kind, case)
        assert sum(case["held"] for case in cases) >= cases[0]["adamw"], (n, kind, cases)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", sorted(LIMITS))
def test_zero_stage2_keeps_its_1_nth_of_the_gradients_and_stage1_none(ranks, n, kind):
    """Stage 2's gradient shares are 1/n of the gradients' bytes and a few used-flags and padding; stage 1 has none
    (the gradients are the parameters' .grad, DDP's)."""
    for outcome in ranks:
        assert outcome[n, kind, 1]["shares"] == 0
        case = outcome[n, kind, 2]
        assert case["grads"] / n <= case["shares"] <= case["grads"] / n + SHARE_SLACK, (n, kind, case)


if __name__ == "__main__":
    for rank, outcome in enumerate(run_workers(_grid, WORLD)):
        for (n, kind, stage), case in outcome.items():
            print(f"rank {rank} (rank {case['rank']} of its {n}), stage {stage}, transport {kind!r} "
                  f"({case['transport']}): ShardedOptimizer holds {case['held']:,} bytes beside parameters and "
                  f"gradients (gradient shares {case['shares']:,}), torch.optim.AdamW {case['adamw']:,} "
                  f"({case['held'] / case['adamw']:.3f}x)")
