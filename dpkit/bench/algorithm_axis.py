"""The algorithm axis of the collectives benchmark: every point-to-point all-reduce of
``dpkit.comm.message_passing`` and auto against ``torch.distributed.all_reduce``, all over the group's backend
(one wire), on one input.

    python collectives_benchmark.py --axis algorithms --procs 2 --sizes 10MB 100MB
    rows = benchmark_size(ctx, 10 << 20, ["torch", "ring", "auto"], iters=20, warmup=5, pipeline=pipeline)
"""

from __future__ import annotations

import functools

import torch

from dpkit.bench.collective_run import measure, summing
from dpkit.bench.measure import BATCH_S
from dpkit.comm.message_passing import ALGORITHMS, auto_algorithm


def _algorithm(name: str, pipeline: dict):
    """The all-reduce called ``name``; ring and halving-doubling with the given segment size and depth."""
    function = ALGORITHMS[name]
    return functools.partial(function, **pipeline) if name in ("ring", "halving_doubling") else function


def benchmark_size(ctx, nbytes: int, algorithms: list[str], iters: int, warmup: int, pipeline: dict,
                   batch_s: float = BATCH_S) -> list[dict]:
    """The algorithm axis at one size: every all-reduce of ``algorithms`` over the group's backend (one input),
    each timed in batches of calls that last ``batch_s``."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
    choice = auto_algorithm(x) if ctx.world_size > 1 else None
    contenders = [summing(ctx, name, ctx.backend, name, _algorithm(name, pipeline), x,
                          choice if name == "auto" else None) for name in algorithms]
    # Summing in place: zeros, refilled (untimed) before the counts and each timed batch, stay zeros.
    return measure(ctx, "allreduce", "algorithm", contenders, x.numel() * 4, iters, warmup, setup=x.zero_,
                   batch_s=batch_s)
