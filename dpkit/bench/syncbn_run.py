"""Measuring a SyncBatchNorm benchmark's settings, as ``syncbn_benchmark.py`` runs them: the workers' grid on every
transport (every rank), one process without a process group, and each of the layer's paths, into rows.

    rows = run(ctx, args, Sources(syncbn))                 # on every rank of the workers: the same rows
    rows = run_single_process(device, args, Sources(syncbn))
    rows = run_paths(device, args, Sources(syncbn))

``args`` carries the grid (``batch``, ``hidden``, ``dtypes``), the timing (``iters``, ``rounds``, ``warmup``),
``transports`` and ``baseline``; ``Sources`` is where the layer's code comes from (``syncbn_contenders``).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.distributed as dist

from dpkit.bench import harness, transport_choice
from dpkit.bench.syncbn_case import PROFILE_ITERS, breakdown, run_case
from dpkit.bench.syncbn_contenders import Sources, contenders
from dpkit.bench.syncbn_phases import phases
from dpkit.bench.syncbn_verdicts import COLD, FLOOR, LOCAL, OURS, PATH_IMPLS, PATHS, REFERENCE, SYNC_PATH
from dpkit.comm.process_groups import progress

EVICT_BYTES = 16 << 20  # written before each COLD iteration: several times a core's own caches (L1 and L2)
# One process times this many times --iters (warm caches): its iterations are a few tens of microseconds, several
# times shorter than the workers', and their ratios to BatchNorm1d's need more of them to settle.
SINGLE_ITERS_FACTOR = 8
PHASE_ITERS = 200


def run(ctx, args, sources: Sources, profile_iters: int = PROFILE_ITERS, phase_iters: int = PHASE_ITERS) -> list[dict]:
    """Every rank runs the whole grid; returns the rows (the same on every rank: times are maxima over ranks)."""
    made = transport_choice.make(args.transports, ctx.device, optional=True)  # shared memory where it can serve
    try:
        cases = [(d, b, h) for d in args.dtypes for b in args.batch for h in args.hidden]
        rows = []
        for dtype_name, batch, hidden in progress(cases, desc="syncbn benchmark, workers"):
            impls = contenders(ctx.device, made, args.baseline, dtype_name)
            rows += run_case(ctx.rank, ctx.world_size, ctx.device, impls, batch, hidden, dtype_name, args, sources,
                             made=made)
            harness.keep(ctx, rows)
        for batch, hidden in profiled_sizes(args):
            engines = [(impl, t) for t in made for impl in (OURS, REFERENCE)]
            rows += breakdown(ctx.rank, ctx.world_size, ctx.device, engines + [(LOCAL, None)], batch, hidden, sources,
                              made, profile_iters)
            cut = [(impl, t) for t in made for impl in (OURS, REFERENCE, FLOOR)]
            rows += phases(ctx.rank, ctx.world_size, ctx.device, cut, batch, hidden, phase_iters, made, sources)
        return rows
    finally:
        for made_one in made.values():
            made_one.close()


def profiled_sizes(args) -> list[tuple[int, int]]:
    """The smallest and the largest size of the grid."""
    return sorted({(min(args.batch), min(args.hidden)), (max(args.batch), max(args.hidden))})


def _evictor(device: torch.device) -> Callable[[], None]:
    """Before each COLD iteration: write EVICT_BYTES, which leaves none of the layer's code or data in the
    core's own caches, as a collective's threads and system calls leave them for the work that follows it."""
    scratch = torch.zeros(EVICT_BYTES // 4, device=device)
    return lambda: scratch.add_(1.0)


def _warm(args) -> argparse.Namespace:
    """``args`` with SINGLE_ITERS_FACTOR times its iterations: one process with warm caches."""
    return argparse.Namespace(**{**vars(args), "iters": SINGLE_ITERS_FACTOR * args.iters})


def run_single_process(device: torch.device, args, sources: Sources) -> list[dict]:
    """Ours against BatchNorm1d in this process, with no process group (float32, the whole grid), and the
    synchronized computation without its collectives (what the layer costs beyond BatchNorm's kernels); on
    the CPU, at the smallest and the largest size, the latter two again with cold caches (COLD)."""
    assert not dist.is_initialized()
    impls = [(OURS, None), (LOCAL, None), (SYNC_PATH, None)]
    impls += [(f"{SYNC_PATH}@{args.baseline}", None)] if args.baseline else []
    rows = []
    for batch, hidden in progress([(b, h) for b in args.batch for h in args.hidden],
                                  desc="syncbn benchmark, 1 process"):
        rows += run_case(0, 1, device, impls, batch, hidden, "float32", _warm(args), sources)
    for batch, hidden in profiled_sizes(args):
        if device.type == "cpu":
            rows += run_case(0, 1, device, [(LOCAL, None), (SYNC_PATH, None)], batch, hidden, "float32", args,
                             sources, setting=COLD, setup=_evictor(device))
        rows += breakdown(0, 1, device, [(OURS, None), (LOCAL, None), (SYNC_PATH, None)], batch, hidden, sources)
    return rows


def run_paths(device: torch.device, args, sources: Sources) -> list[dict]:
    """The synchronized path without collectives on each of ``syncbn.PATHS`` (``PATH_IMPLS``), one process, float32,
    the whole grid, timed in interleaved rounds as the single process is."""
    assert not dist.is_initialized()
    impls = [(impl, None) for impl in PATH_IMPLS.values()]
    rows = []
    for batch, hidden in progress([(b, h) for b in args.batch for h in args.hidden],
                                  desc="syncbn benchmark, each path"):
        rows += run_case(0, 1, device, impls, batch, hidden, "float32", _warm(args), sources, setting=PATHS)
    return rows
