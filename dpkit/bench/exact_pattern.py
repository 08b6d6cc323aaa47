"""The exact pattern every collective of the collectives benchmark is checked on: small integers, so every
partial sum is exact in float32 and any error is a bug, not rounding.

    fill_pattern(x, rank); dist.all_reduce(x); pattern_error(x, world_size)   # 0.0, or the largest error
    sharded_error(ctx, "reduce_scatter", call, full, shard)                   # the same for a sharded call

``collectives_benchmark.py`` makes one untimed call of each contender on it before timing it
(``collective_run.measure``).
"""

from __future__ import annotations

import torch

from dpkit import compat

PERIOD = 1024  # the correctness pattern repeats every PERIOD elements


def _blocks(x: torch.Tensor, rows: int = 4096):
    """(offset, view) pieces of a flat tensor, PERIOD-aligned, so no temporary is as large as x."""
    step = rows * PERIOD
    for start in range(0, x.numel(), step):
        yield start, x[start:start + step]


def fill_pattern(x: torch.Tensor, rank: int) -> None:
    """x[i] = i mod PERIOD + rank: small integers, so every partial sum is exact in float32."""
    base = torch.arange(PERIOD, dtype=x.dtype, device=x.device) + rank
    for _, block in _blocks(x):
        full = block.numel() // PERIOD
        block[:full * PERIOD].view(full, PERIOD).copy_(base)
        block[full * PERIOD:].copy_(base[:block.numel() - full * PERIOD])


def pattern_error(x: torch.Tensor, world_size: int) -> float:
    """Largest |x - exact sum of every rank's pattern| (the sum is n (i mod PERIOD) + n(n-1)/2)."""
    expected = (world_size * torch.arange(PERIOD, dtype=torch.float64, device=x.device)
                + world_size * (world_size - 1) / 2)
    worst = 0.0
    for _, block in _blocks(x):
        full = block.numel() // PERIOD
        rows = block[:full * PERIOD].view(full, PERIOD).double() - expected
        tail = block[full * PERIOD:].double() - expected[:block.numel() - full * PERIOD]
        worst = max(worst, rows.abs().max().item() if full else 0.0, tail.abs().max().item() if tail.numel() else 0.0)
    return worst


def sharded_error(ctx, collective: str, call, full: torch.Tensor, shard: torch.Tensor) -> float:
    """One untimed call on the exact pattern: this rank's largest error over all elements.

    Reduce-scatter: every rank's full tensor holds the pattern, the shards are gathered back (with
    torch) and compared with the pattern's sum. All-gather: rank r contributes chunk r of that sum."""
    n = ctx.world_size
    if collective == "reduce_scatter":
        fill_pattern(full, ctx.rank)
        call()
        compat.all_gather_single(full, shard)
    else:
        fill_pattern(full, 0)  # i mod PERIOD: times n plus n(n-1)/2 is the pattern's sum, exact in float32
        full.mul_(n).add_(n * (n - 1) / 2)
        shard.copy_(full.view(n, -1)[ctx.rank])
        full.zero_()
        call()
    return pattern_error(full, n)
