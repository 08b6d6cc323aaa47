"""The backend axis of the collectives benchmark: torch.distributed's own calls on a group of the backend
"dpkit" against the same calls on a gloo group over the same ranks, the anchors (``anchors``) beside them,
then the latency floor of the backend's all-reduce (``backend_latency``). A timed call that sends a tensor it
does not write (every collective but the all-reduce, which writes its sum over what it sent) first writes it
(``written_first``), as a training step does.

    python collectives_benchmark.py --axis backends --procs 2 4
    rows = backend_worker(ctx, ["allreduce", "barrier"], [4, 4096], iters=20, warmup=5, floor_calls=500)
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from dpkit import compat
from dpkit.bench import anchors, backend_latency, harness
from dpkit.bench.collective_run import Contender, measure
from dpkit.bench.collectives import BACKEND
from dpkit.bench.exact_pattern import PERIOD, fill_pattern, pattern_error, sharded_error
from dpkit.bench.measure import BATCH_S, oversubscribed
from dpkit.comm import backend
from dpkit.comm.process_groups import print0, progress

# torch.distributed's call of each collective (tensor forms) on a "dpkit" group and on a gloo group over the
# same ranks, from one element up (a barrier once); the all-reduce's latency floor at FLOOR_SIZES. The sharded
# ones by the name compat calls on this torch (``*_single`` where it exists), so a row names what ran.
BACKEND_CALLS = {"allreduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce",
                 "all_gather": compat.ALL_GATHER_SINGLE, "reduce_scatter": compat.REDUCE_SCATTER_SINGLE,
                 "all_to_all": "all_to_all_single", "barrier": "barrier"}
FLOOR_SIZES, FLOOR_ROUNDS = (4 << 10, 64 << 10), 9


def backend_groups() -> dict[str, object]:
    """Row label -> a group over the world's ranks: gloo's, the reference, and the backend "dpkit"'s (made once
    per world, in this order on every rank: ``new_group`` is a collective)."""
    return {"gloo": dist.new_group(backend="gloo"), BACKEND: dist.new_group(backend=backend.NAME)}


def backend_numel(collective: str, nbytes: int, n: int) -> int:
    """float32 elements of the full tensor: nbytes / 4, at least one; for the sharded collectives and
    all-to-all a multiple of the world size, at least one element per rank (nccl-tests); none for a barrier."""
    if collective == "barrier":
        return 0
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return max(n, nbytes // 4 // n * n)
    return max(1, nbytes // 4)


def backend_call(collective: str, group, full: torch.Tensor, part: torch.Tensor) -> Callable[[], object]:
    """One torch.distributed call on ``group``; ``full`` is the whole tensor, ``part`` a shard (all-gather,
    reduce-scatter) or all-to-all's output. Broadcast and reduce: the group's first rank is the root."""
    root = dist.get_global_rank(group, 0)
    return {"allreduce": lambda: dist.all_reduce(full, group=group),
            "broadcast": lambda: dist.broadcast(full, root, group=group),
            "reduce": lambda: dist.reduce(full, root, group=group),
            "all_gather": lambda: compat.all_gather_single(full, part, group=group),
            "reduce_scatter": lambda: compat.reduce_scatter_single(part, full, group=group),
            "all_to_all": lambda: dist.all_to_all_single(part, full, group=group),
            "barrier": lambda: dist.barrier(group=group)}[collective]


def sent_unwritten(collective: str, full: torch.Tensor, part: torch.Tensor) -> torch.Tensor | None:
    """The tensor a call of ``collective`` sends but does not write (``backend_call``'s ``full`` and ``part``); None
    when the call writes what it sends (an all-reduce, in place) or sends nothing (a barrier). A broadcast's and a
    reduce's ``full`` on every rank: the root's is sent, a reduce's others' are sent and left as they were."""
    return {"broadcast": full, "reduce": full, "all_gather": part, "reduce_scatter": full,
            "all_to_all": full}.get(collective)


def written_first(sent: torch.Tensor, call: Callable[[], object]) -> None:
    """``call()`` after this rank writes ``sent`` (zeros), as a training step writes what it then sends. A sender's
    tensor left unchanged since the last call would still sit, clean, in its readers' caches: a single-copy
    reader (Open MPI reads the sender's tensor with ``process_vm_readv``, its CMA) then reads lines its own
    cache holds, which no step offers it; a copy through shared memory (gloo's sockets too) moves the bytes
    anew each call anyway."""
    sent.zero_()
    call()


def timed_call(sent: torch.Tensor | None, call: Callable[[], object]) -> Callable[[], object]:
    """What a batch times of ``call``: itself, or, when it sends a tensor it does not write, ``written_first``."""
    return call if sent is None else functools.partial(written_first, sent, call)


def backend_error(ctx, collective: str, call, full: torch.Tensor, part: torch.Tensor) -> float:
    """One untimed call on an exact pattern: this rank's largest error (a barrier moves no data: 0)."""
    n = ctx.world_size
    if collective in ("all_gather", "reduce_scatter"):
        return sharded_error(ctx, collective, call, full, part)
    if collective == "all_to_all":  # chunk j of rank r holds (i mod PERIOD) + PERIOD (r n + j); it lands at rank j
        chunks = full.view(n, -1)
        for j in range(n):
            fill_pattern(chunks[j], 0)
            chunks[j].add_(PERIOD * (ctx.rank * n + j))
        part.fill_(-1.0)
        call()
        expected = torch.empty_like(part).view(n, -1)
        for s in range(n):
            fill_pattern(expected[s], 0)
            expected[s].add_(PERIOD * (s * n + ctx.rank))
        return (part - expected.view(-1)).abs().max().item()
    if collective == "broadcast":  # the root holds the pattern's sum, the others zeros
        fill_pattern(full, 0)
        if ctx.rank == 0:
            full.mul_(n).add_(n * (n - 1) / 2)
        else:
            full.zero_()
    elif collective in ("allreduce", "reduce"):
        fill_pattern(full, ctx.rank)
    call()
    if collective == "barrier" or (collective == "reduce" and ctx.rank != 0):
        return 0.0  # reduce: only the root's result is defined
    return pattern_error(full, n)


def backend_contenders(ctx, collective: str, nbytes: int, groups: dict[str, object], made: dict | None = None
                       ) -> tuple[list[Contender], Callable[[], object] | None, int]:
    """The backend axis at one size: the same torch.distributed call on each group of ``groups``, then the
    collective of each anchor of ``made`` that has it (``anchors.make``), on the same tensors; (contenders, the
    refill before the counts and each timed batch or None, bytes)."""
    n = ctx.world_size
    numel = backend_numel(collective, nbytes, n)
    full = torch.zeros(numel, dtype=torch.float32)
    part = torch.zeros(numel // n if collective in ("all_gather", "reduce_scatter") else numel, dtype=torch.float32)
    sent = sent_unwritten(collective, full, part)
    fields = {"input_written_first": sent is not None}
    contenders = []
    for label, group in groups.items():
        call = backend_call(collective, group, full, part)
        check = functools.partial(backend_error, ctx, collective, call, full, part)
        contenders.append(Contender(label, dist.get_backend(group), f"dist.{BACKEND_CALLS[collective]}",
                                    timed_call(sent, call), check, None, (full, part), fields))
    for anchor in (made or {}).values():
        call = anchor.call(collective, full, part)
        if call is not None:  # checked as the collective it stands beside, or by its own check (the memory's)
            check = (anchor.check(call, full, part) if hasattr(anchor, "check") else
                     functools.partial(backend_error, ctx, collective, call, full, part))
            contenders.append(Contender(anchor.label, anchor.name, anchor.algorithm(collective),
                                        timed_call(sent, call), check, None, (full, part), {**anchor.fields, **fields}))
    # The all-reduce sums in place: zeros (refilled, untimed, before the counts and each timed batch) stay zeros.
    # A reduce's calls write their zeros first (``written_first``).
    setup = full.zero_ if collective == "allreduce" else None
    return contenders, setup, numel * 4


def backend_worker(ctx, collectives: list[str], sizes: list[int], iters: int, warmup: int, floor_calls: int,
                   earlier: list[dict] = (), anchor_names: list[str] = (), batch_s: float = BATCH_S) -> list[dict]:
    """The backend axis: every collective at every size (a barrier once, of no bytes), with the anchors of
    ``anchor_names`` beside gloo and "dpkit", each timed in batches of calls that last ``batch_s``, then the latency
    floor of the backend's all-reduce at FLOOR_SIZES (``backend_latency.floor_rows``). CPU tensors only. ``earlier``:
    the rows this world measured before, kept with these (``harness.keep``)."""
    if ctx.device.type != "cpu" or ctx.world_size < 2 or not collectives:
        print0(f"no backend rows: the backend {backend.NAME!r} compares CPU tensors between 2 or more processes")
        return []
    groups, made, rows = backend_groups(), {}, []
    try:
        made = anchors.make(ctx, list(anchor_names))
        for collective in progress(collectives, desc=f"{ctx.world_size} processes, backends"):
            for nbytes in sizes[:1] if collective == "barrier" else sizes:
                contenders, setup, size = backend_contenders(ctx, collective, nbytes, groups, made)
                rows += anchors.with_ratios(measure(ctx, collective, "backend", contenders, size, iters, warmup,
                                                    setup, reference="gloo", batch_s=batch_s), BACKEND)
                harness.keep(ctx, [*earlier, *rows])
        for nbytes in FLOOR_SIZES if floor_calls else ():
            rows += [{**row, "backend": ctx.backend, "kind": "latency floor",
                      "oversubscribed": oversubscribed(ctx.world_size, ctx.device)}
                     for row in backend_latency.floor_rows(ctx.world_size, nbytes, floor_calls, FLOOR_ROUNDS,
                                                           groups[BACKEND], groups["gloo"])]
            harness.keep(ctx, [*earlier, *rows])
    finally:  # the groups are this axis's alone: a sweep over worlds holds none of them afterwards
        for anchor in made.values():
            anchor.close()
        for group in groups.values():
            dist.destroy_process_group(group)
    return rows
