"""Collectives in the conventions of nccl-tests, on three axes, every row labelled.

    python collectives_benchmark.py --procs 2 4 --json results/collectives.json --plot-dir results/plots
    python collectives_benchmark.py --quick --plot-dir results/plots           # a few sizes
    python collectives_benchmark.py --axis transports --procs 2 --sizes 10MB 100MB   # or --axis algorithms
    python collectives_benchmark.py --collective reduce_scatter --procs 2 --sizes 10MB 100MB   # or all_gather
    python collectives_benchmark.py --axis backends --procs 2 4              # torch.distributed on "dpkit" / gloo
    python collectives_benchmark.py --axis backends --procs 2 --anchors --json results/backend_anchors.json
    python collectives_benchmark.py --tune                                      # results/crossover.json (auto's)
    python collectives_benchmark.py --from-json results/collectives.json --plot-dir results/plots
    torchrun --standalone --nproc_per_node 4 collectives_benchmark.py        # the world torchrun starts

* Algorithms (all-reduce): every point-to-point algorithm of ``allreduce.py`` and ``auto`` against
  ``torch.distributed.all_reduce``, all over gloo: algorithm against algorithm on the same wire.
* Transports (the registry's names, ``--transports``; all-reduce, reduce-scatter, all-gather): "torch" (gloo)
  against "shared_memory" on buffers from its ``allocate()`` (zero copy), "shared_memory:staged" (plain tensors,
  copied in and out), "p2p" (auto for the all-reduce, else the ring), and any transport registered: each on the
  buffers it allocates. Shared memory sums chunk r on rank r.
* Backends: torch.distributed's calls (``BACKEND_CALLS``) on a "dpkit" group against gloo, the latency floor
  (``dpkit.bench.backend_latency``), and ``--anchors`` beside them: Open MPI under mpirun, DeepSpeed's shm.

Without torchrun the script spawns each process count of ``--procs`` itself. Per size (float32, 1 MB = 2^20
bytes) and axis: one untimed call on a pattern exact in float32 (any error is a bug), then timed calls in turns,
each as slow as its slowest rank, paired round by round with the axis's reference (torch's call; gloo's on the
backend axis): the median ratio with its 95 % bootstrap interval, judged against ``TARGETS``, stored with the
rows. busbw = algbw x ``bus_factor`` (nccl-tests). Algorithms: T = steps x alpha + bytes x beta (``model_terms``).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import allreduce
from dpkit.bench.collectives import (AXIS_TITLES, BACKEND, NAMES, TRANSPORTS, allreduce_rows, bus_factor, format_size,
                                     labelled, parse_size, ratio_of)
from dpkit import compat
from dpkit.bench import anchors, backend_latency, harness
from dpkit.bench import transport_choice
from dpkit.bench.measure import Timing, format_ratio, oversubscribed, paired_ratio, time_interleaved, verdict
from dpkit.bench.results import incomplete_note, markdown_table, read_results, write_results
from dpkit.comm import backend, transport
from dpkit.comm.process_groups import add_common_args, message_device, parse_checked, print0, progress

DEFAULT_SIZES = ["4000", "64KB", "1MB", "10MB", "100MB"]
QUICK = dict(sizes=["4000", "64KB", "1MB", "10MB"], procs=[2, 4], iters=10, warmup=2)
SMALL_BYTES, SMALL_CALLS = 1 << 20, 4  # messages up to 1 MiB: 4 times the timed calls (``calls``)
TUNE_SIZES = ["4000", "16KB", "64KB", "256KB", "1MB", "4MB", "16MB", "64MB"]
TUNE_PROCS = [2, 3, 4, 8]
PERIOD = 1024  # the correctness pattern repeats every PERIOD elements
LARGE = (10 << 20, 100 << 20)
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")
AXES = {"algorithms": ("algorithm",), "transports": ("transport",), "both": ("algorithm", "transport"),
        "backends": ("backend",), "all": ("algorithm", "transport", "backend")}
# The backend axis: torch.distributed's call of each collective (tensor forms) on a "dpkit" group and on a gloo
# group over the same ranks, from one element up (a barrier once); the all-reduce's latency floor at FLOOR_SIZES.
BACKEND_CALLS = {"allreduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce",
                 "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
                 "all_to_all": "all_to_all_single", "barrier": "barrier"}
BACKEND_SIZES = ["4", "4KB", "64KB", "1MB", "10MB", "100MB"]
BACKEND_REPEAT, BACKEND_BATCH_BYTES = 64, 1 << 20  # calls timed back to back: up to 64, about 1 MiB in all
FLOOR_SIZES, FLOOR_ROUNDS, FLOOR_CALLS = (4 << 10, 64 << 10), 5, 500
ZERO_COPY = "shared_memory"  # the transport on the buffers it allocates
# (axis, label, sizes it applies to or None for every size, process counts or None for any, largest p50 /
# torch's p50 on that axis). Algorithms: the ring within 10 % of torch at 10 and 100 MB (the first
# all-reduce work), auto within 10 % from the homework's 1,000 elements up and no slower at 10 and 100 MB.
# Transports: the all-reduce of a buffer the shared-memory transport allocated (no copy in or out), 2 ranks.
TARGET = 1.10
TARGETS = [("algorithm", "ring", LARGE, None, TARGET), ("algorithm", "auto", None, None, TARGET),
           ("algorithm", "auto", LARGE, None, 1.00),
           ("transport", ZERO_COPY, (10 << 20,), (2,), 0.45), ("transport", ZERO_COPY, (100 << 20,), (2,), 0.30),
           ("backend", BACKEND, (4 << 10, 64 << 10), (2,), 0.25)]  # dist.all_reduce on "dpkit" / on gloo, 2 ranks
# Reduce-scatter and all-gather: p2p (the ring) at 10 and 100 MB. gloo emulates reduce-scatter with a full
# all-reduce (twice the bytes of a ring reduce-scatter), so ours should be well under torch's time there.
COLLECTIVE_TARGETS = {"reduce_scatter": 0.70, "all_gather": 1.10}


# --------------------------------------------------------------------------- correctness pattern


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


# --------------------------------------------------------------------------- the harness: check, time, one row each


def calls(nbytes: int, iters: int) -> int:
    """Timed calls (rounds) for one size: ``iters``, and SMALL_CALLS times as many for messages up to SMALL_BYTES.

    A call of up to 1 MiB lasts at most a few milliseconds here and varies from call to call by
    about as much (scheduling, wake-ups), so the few rounds that suit the large sizes leave a
    small size's ratio with a wide interval; its extra rounds cost little time.
    """
    return iters * SMALL_CALLS if nbytes <= SMALL_BYTES else iters


@dataclass
class Contender:
    """One line of a comparison: the row's labels, a no-argument call, and ``check``: one untimed call on
    the exact pattern that returns this rank's largest error."""

    label: str
    transport: str
    algorithm: str
    call: Callable[[], object]
    check: Callable[[], float]
    choice: str | None = None
    inputs: tuple[torch.Tensor, ...] = ()  # the tensors it works on
    repeat: int = 1  # calls ``call`` makes back to back: its time is divided by it
    fields: dict = field(default_factory=dict)  # added to its row as they are (an anchor's name and version)


def _worst(ctx, error: float) -> float:
    """The largest of every rank's ``error``."""
    value = torch.tensor([error], dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(value, torch.distributed.ReduceOp.MAX)
    return value.item()


def measure(ctx, collective: str, axis: str, contenders: list[Contender], size: int, iters: int, warmup: int,
            setup: Callable[[], object] | None = None, reference: str = "torch") -> list[dict]:
    """Check every contender, then time them taking turns call by call (``calls`` rounds; ``setup`` refills
    the inputs, untimed, before each call); one row each, the same on every rank, its ratio (``vs_torch``)
    paired with the calls of the contender labelled ``reference`` in the same rounds."""
    errors = {c.label: _worst(ctx, c.check()) for c in contenders}
    rounds = calls(size, iters)
    timings = time_interleaved({c.label: c.call for c in contenders}, rounds, warmup, rounds=rounds, device=ctx.device,
                               setup=setup)
    n, rows = ctx.world_size, []
    timings = {c.label: Timing(timings[c.label].per_rank / c.repeat) for c in contenders}  # seconds per call
    for c in contenders:
        timing = timings[c.label]
        algbw = size / timing.mean / 1e9
        ratio = paired_ratio(timing.samples, timings[reference].samples) if reference in timings else None
        rows.append({"backend": ctx.backend, "world_size": n, "collective": collective, "axis": axis,
                     "transport": c.transport, "algorithm": c.algorithm, "label": c.label, "bytes": size,
                     "dtype": "float32", "avg_s": timing.mean, "p50_s": timing.median, "p95_s": timing.percentile(95),
                     "min_s": min(timing.samples), "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(n, collective),
                     "vs_torch": ratio["median"] if ratio else None,
                     "vs_torch_ci_low": ratio["ci_low"] if ratio else None,
                     "vs_torch_ci_high": ratio["ci_high"] if ratio else None,
                     "rounds": len(timing.samples), "round_p50_s": timing.samples,  # one timed call per round
                     "calls_per_round": c.repeat,
                     "oversubscribed": oversubscribed(n, ctx.device), "choice": c.choice,
                     "max_abs_error": errors[c.label], "correct": errors[c.label] == 0.0, **c.fields})
    return rows


def _summing(ctx, label: str, transport_name: str, algorithm: str, function, x: torch.Tensor,
             choice: str | None = None) -> Contender:
    """An all-reduce ``function(x, "sum")`` in place, checked on the pattern."""
    call = functools.partial(function, x, "sum")

    def check() -> float:
        fill_pattern(x, ctx.rank)
        call()
        return pattern_error(x, ctx.world_size)
    return Contender(label, transport_name, algorithm, call, check, choice, (x,))


# --------------------------------------------------------------------------- algorithms (all-reduce, one wire)


def _algorithm(name: str, pipeline: dict):
    """The all-reduce called ``name``; ring and halving-doubling with the given segment size and depth."""
    function = allreduce.ALGORITHMS[name]
    return functools.partial(function, **pipeline) if name in ("ring", "halving_doubling") else function


def benchmark_size(ctx, nbytes: int, algorithms: list[str], iters: int, warmup: int, pipeline: dict) -> list[dict]:
    """The algorithm axis at one size: every all-reduce of ``algorithms`` over the group's backend (one input)."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
    choice = allreduce.auto_algorithm(x) if ctx.world_size > 1 else None
    contenders = [_summing(ctx, name, ctx.backend, name, _algorithm(name, pipeline), x,
                           choice if name == "auto" else None) for name in algorithms]
    # Summing in place makes x grow n-fold per call: refill it (untimed) before each one.
    return measure(ctx, "allreduce", "algorithm", contenders, x.numel() * 4, iters, warmup,
                   setup=functools.partial(x.fill_, 1.0))


# --------------------------------------------------------------------------- transports (all three collectives)


def make_transports(ctx, names: list[str]) -> dict[str, transport.Transport]:
    """``--transports`` name -> its transport over the whole world (``transport_choice.make``, a collective).
    Shared memory only where it can serve (CPU tensors, every rank on this host); with one process, only
    transports that move nothing but copies: those of one process."""
    if ctx.world_size == 1:
        names = [n for n in names if not n.startswith("shared_memory")]
    return transport_choice.make(names, ctx.device, optional=True)


def _algorithm_of(made: transport.Transport, collective: str) -> str:
    """What runs inside a transport: torch's own collective, shared memory's direct sums, the p2p algorithm
    (the ring but for the all-reduce), else the transport's name."""
    inner = made.inner if isinstance(made, transport.Wrapped) else made
    if isinstance(inner, allreduce.MessagePassing):
        return inner.algorithm if collective == "allreduce" else "ring"
    return {transport.SharedMemory: "direct", transport.Torch: "torch"}.get(type(inner), made.name)


def transport_contenders(ctx, collective: str, nbytes: int, transports: dict[str, transport.Transport]
                         ) -> tuple[list[Contender], Callable[[], object] | None, int]:
    """The transport axis at one size: (contenders, the refill before each timed call or None, bytes).

    Each transport on the buffers its ``allocate()`` gives: shared memory's own (zero copy); the others', plain
    tensors, one set shared by all (shared_memory:staged copies them into its arena and back). Reduce-scatter and
    all-gather:    ``nbytes`` is the full tensor, rounded down to a multiple of the world size (nccl-tests)."""
    n = ctx.world_size
    numel = nbytes // 4 // n * n if collective != "allreduce" else nbytes // 4

    def tensors(make) -> tuple[torch.Tensor, ...]:
        full = make((numel,), dtype=torch.float32)
        return (full,) if collective == "allreduce" else (full, make((numel // n,), dtype=torch.float32))

    plain = tensors(functools.partial(torch.empty, device=ctx.device))
    contenders = []
    for name, made in transports.items():
        label, algorithm = name, _algorithm_of(made, collective)
        own = tensors(made.allocate)
        inputs = own if made.owns(own[0]) else plain
        if collective == "allreduce":
            choice = allreduce.auto_algorithm(inputs[0]) if algorithm == "auto" and n > 1 else None
            contender = _summing(ctx, label, made.describe(), algorithm, made.all_reduce, inputs[0], choice)
        else:
            full, shard = inputs
            call = (functools.partial(made.reduce_scatter, shard, full, "sum") if collective == "reduce_scatter"
                    else functools.partial(made.all_gather, full, shard))
            contender = Contender(label, made.describe(), algorithm, call,
                                  functools.partial(_sharded_error, ctx, collective, call, full, shard), None, inputs)
        contenders.append(contender)
    # The all-reduce sums in place: every input is refilled (untimed) before each call. The others keep theirs.
    fulls = list({id(c.inputs[0]): c.inputs[0] for c in contenders}.values())
    setup = (lambda: [full.fill_(1.0) for full in fulls]) if collective == "allreduce" else None
    return contenders, setup, numel * 4


def benchmark_transports_size(ctx, collective: str, nbytes: int, transports: dict[str, transport.Transport],
                              iters: int, warmup: int) -> list[dict]:
    """The transport axis at one size (``transport_contenders``), one row per transport."""
    contenders, setup, size = transport_contenders(ctx, collective, nbytes, transports)
    return measure(ctx, collective, "transport", contenders, size, iters, warmup, setup)


def _sharded_error(ctx, collective: str, call, full: torch.Tensor, shard: torch.Tensor) -> float:
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


def benchmark_worker(ctx, sizes: list[int], algorithms: list[str], iters: int, warmup: int, pipeline: dict,
                     collective: str = "allreduce", transports: list[str] = ()) -> list[dict]:
    """Every size, on each axis asked for (``algorithms`` and ``transports`` empty: that axis is not measured),
    for this world (one spawned group, or the world torchrun started)."""
    made = make_transports(ctx, list(transports))
    rows = []
    try:
        for nbytes in progress(sizes, desc=f"{ctx.world_size} processes"):
            if algorithms and collective == "allreduce":
                rows += benchmark_size(ctx, nbytes, algorithms, iters, warmup, pipeline)
            if made:
                rows += benchmark_transports_size(ctx, collective, nbytes, made, iters, warmup)
            harness.keep(ctx, rows)
    finally:
        for t in {id(t): t for t in made.values()}.values():
            t.close()
    return rows


# --------------------------------------------------------------------------- backends (torch.distributed's own calls)


def backend_groups() -> dict[str, object]:
    """Row label -> a group over the world's ranks: gloo's, the reference, and the backend "dpkit"'s (made once
    per world, in this order on every rank: ``new_group`` is a collective)."""
    return {"gloo": dist.new_group(backend="gloo"), BACKEND: dist.new_group(backend=backend.NAME)}


def _backend_numel(collective: str, nbytes: int, n: int) -> int:
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


def backend_error(ctx, collective: str, call, full: torch.Tensor, part: torch.Tensor) -> float:
    """One untimed call on an exact pattern: this rank's largest error (a barrier moves no data: 0)."""
    n = ctx.world_size
    if collective in ("all_gather", "reduce_scatter"):
        return _sharded_error(ctx, collective, call, full, part)
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
    refill before each timed call or None, bytes)."""
    n = ctx.world_size
    numel = _backend_numel(collective, nbytes, n)
    full = torch.empty(numel, dtype=torch.float32)
    part = torch.empty(numel // n if collective in ("all_gather", "reduce_scatter") else numel, dtype=torch.float32)
    # Short calls are timed back to back, BACKEND_BATCH_BYTES at a time (as nccl-tests times a loop): one call
    # alone would time mostly how far apart the ranks leave the barrier before it.
    repeat = max(1, min(BACKEND_REPEAT, BACKEND_BATCH_BYTES // max(4, numel * 4)))
    contenders = []
    for label, group in groups.items():
        call = backend_call(collective, group, full, part)
        contenders.append(Contender(label, dist.get_backend(group), f"dist.{BACKEND_CALLS[collective]}",
                                    functools.partial(_repeated, call, repeat),
                                    functools.partial(backend_error, ctx, collective, call, full, part), None,
                                    (full, part), repeat))
    for anchor in (made or {}).values():
        call = anchor.call(collective, full, part)
        if call is not None:
            contenders.append(Contender(anchor.label, anchor.name, anchor.algorithm(collective),
                                        functools.partial(_repeated, call, repeat),
                                        functools.partial(backend_error, ctx, collective, call, full, part), None,
                                        (full, part), repeat, anchor.fields))
    # All-reduce and reduce sum in place: zeros (refilled, untimed, before each timed batch) stay zeros.
    setup = full.zero_ if collective in ("allreduce", "reduce") else None
    return contenders, setup, numel * 4


def _repeated(call: Callable[[], object], times: int) -> None:
    for _ in range(times):
        call()


def backend_worker(ctx, collectives: list[str], sizes: list[int], iters: int, warmup: int, floor_calls: int,
                   earlier: list[dict] = (), anchor_names: list[str] = ()) -> list[dict]:
    """The backend axis: every collective at every size (a barrier once, of no bytes), with the anchors of
    ``anchor_names`` beside gloo and "dpkit", then the latency floor of the backend's all-reduce at FLOOR_SIZES
    (``backend_latency.floor_rows``). CPU tensors only. ``earlier``: the rows this world measured before, kept
    with these (``harness.keep``)."""
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
                                                    setup, reference="gloo"), BACKEND)
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


# --------------------------------------------------------------------------- the latency-bandwidth model


def point_to_point(ctx, iters: int, warmup: int, sizes=(4, 64 << 20)) -> list[dict]:
    """Two processes: one step of our engine (an exchange of n bytes each way with isend/irecv, as recursive
    doubling makes it) against one step of gloo's all_reduce (its ring on 2 ranks makes 2 steps of n/2 bytes)."""
    rows = []
    wire = message_device(ctx.device)  # a step is a message on the wire: host memory where gloo carries it
    for nbytes in sizes:
        x, y = torch.ones(nbytes // 4, device=wire), torch.empty(nbytes // 4, device=wire)
        timings = time_interleaved({"ours": lambda: allreduce.pair_exchange(x, y, 1 - ctx.rank, None),
                                    "gloo": lambda: torch.distributed.all_reduce(x)},
                                   iters, warmup, rounds=iters, device=wire, setup=functools.partial(x.fill_, 1.0))
        for engine, steps, step_bytes in (("ours", 1, nbytes), ("gloo", 2, nbytes / 2)):
            step = timings[engine].median / steps
            rows.append({"backend": ctx.backend, "engine": engine, "bytes": nbytes, "step_s": step,
                         "step_gbps": step_bytes / step / 1e9})
    return rows


# --------------------------------------------------------------------------- the crossover table


def crossover_table(rows: list[dict]) -> dict[int, tuple]:
    """Per world size: the fastest point-to-point algorithm at each measured size, in the form of
    ``allreduce.CROSSOVER``; consecutive sizes with the same winner merge, and a bound between two
    sizes sits at their geometric mean.

    The winner at a size minimises its p50 relative to the fastest, averaged (geometrically) over
    that size and its two neighbours: on a shared machine single sizes flip between algorithms
    within a few per cent, and a table that flips with them would be noise, not a crossover.
    """
    table = {}
    for n in sorted({r["world_size"] for r in rows if r["world_size"] > 1}):
        mine = [r for r in rows if r["world_size"] == n and r["algorithm"] in allreduce.CUSTOM
                and r.get("axis", "algorithm") == "algorithm"]
        sizes = sorted({r["bytes"] for r in mine})
        names = sorted({r["algorithm"] for r in mine})
        p50 = {(r["algorithm"], r["bytes"]): r["p50_s"] for r in mine}
        # log(p50 / fastest p50) per (algorithm, size); an algorithm not measured at a size never wins there.
        relative = {(a, s): math.log(p50[a, s] / min(p50[b, s] for b in names if (b, s) in p50))
                    if (a, s) in p50 else math.inf
                    for a in names for s in sizes}
        winners = []
        for i, size in enumerate(sizes):
            around = sizes[max(0, i - 1):i + 2]
            winners.append(min(names, key=lambda a: (relative[a, size] == math.inf,
                                                     sum(relative[a, s] for s in around) / len(around))))
        entries = []
        for i, name in enumerate(winners):
            if i + 1 < len(winners) and winners[i + 1] != name:
                entries.append((int(math.sqrt(sizes[i] * sizes[i + 1])), name))
        entries.append((None, winners[-1]))
        table[n] = tuple(entries)
    return table


def format_table(table: dict[int, tuple]) -> str:
    """One line per world size: which algorithm auto runs up to which size."""
    return "\n".join(f"{n} processes: " + ", ".join(f"{name} up to {format_size(bound)}" if bound else f"{name} above"
                                                   for bound, name in entries) for n, entries in table.items())


# --------------------------------------------------------------------------- report


COLUMNS = {
    "algorithm": [("world_size", "procs", "d"), ("size", "size", "s"), ("label", "algorithm", "s"),
                  ("avg_ms", "avg ms", ".3f"), ("p50_ms", "p50 ms", ".3f"), ("p95_ms", "p95 ms", ".3f"),
                  ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"),
                  ("ratio", "p50 / torch [95% CI]", "s"), ("choice", "auto ran", "s"),
                  ("max_abs_error", "max error", ".1e")],
    "transport": [("world_size", "procs", "d"), ("size", "size", "s"), ("label", "transport", "s"),
                  ("algorithm", "algorithm", "s"), ("avg_ms", "avg ms", ".3f"), ("p50_ms", "p50 ms", ".3f"),
                  ("p95_ms", "p95 ms", ".3f"), ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"),
                  ("ratio", "p50 / torch [95% CI]", "s"), ("choice", "auto ran", "s"),
                  ("max_abs_error", "max error", ".1e")],
    "backend": [("world_size", "procs", "d"), ("algorithm", "call", "s"), ("size", "size", "s"),
                ("label", "backend", "s"), ("avg_ms", "avg ms", ".3f"), ("p50_ms", "p50 ms", ".3f"),
                ("p95_ms", "p95 ms", ".3f"), ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"),
                ("ratio", "p50 / gloo [95% CI]", "s"), ("max_abs_error", "max error", ".1e")],
}
FLOOR_COLUMNS = [("world_size", "procs", "d"), ("size", "size", "s"), ("case", "case", "s"),
                 ("us", "us per call", ".1f")]
# The row each axis's ratios divide by.
REFERENCES = {"algorithm": "torch", "transport": "torch", "backend": "gloo"}
MODEL_COLUMNS = [("world_size", "procs", "d"), ("algorithm", "algorithm", "s"), ("alpha_us", "alpha us/step", ".1f"),
                 ("gbps", "1/beta GB/s", ".3f"), ("max_rel_error", "worst |pred - meas| / meas", ".2f")]


def _ratio_text(row: dict) -> str:
    return "-" if row.get("vs_torch") is None else format_ratio(ratio_of(row))


def target_checks(rows: list[dict]) -> list[dict]:
    """One check per (target, process count, size): the ratio to torch on the row's axis, its interval and
    met / missed / inconclusive.

    All-reduce rows meet ``TARGETS``; reduce-scatter and all-gather rows p2p's ``COLLECTIVE_TARGETS`` at
    10 and 100 MB (their sizes are rounded down to a multiple of the world size, as in nccl-tests)."""
    checks = []
    for row in map(labelled, rows):
        collective = row.get("collective", "allreduce")
        targets = TARGETS if collective == "allreduce" else [
            ("transport", "p2p", LARGE, None, COLLECTIVE_TARGETS[collective])
        ] if collective in COLLECTIVE_TARGETS else []
        for axis, label, sizes, worlds, limit in targets:
            if (row["axis"], row["label"]) != (axis, label) or row.get("vs_torch") is None:
                continue
            if worlds is not None and row["world_size"] not in worlds:
                continue
            near = min(sizes, key=lambda size: abs(size - row["bytes"])) if sizes is not None else row["bytes"]
            if abs(near - row["bytes"]) >= 64:
                continue
            checks.append({"collective": collective, "axis": axis, "label": label, "algorithm": row["algorithm"],
                           "world_size": row["world_size"], "bytes": near, "limit": limit, "ratio": ratio_of(row),
                           "reference": REFERENCES[axis],
                           "verdict": verdict(ratio_of(row), limit), "oversubscribed": bool(row.get("oversubscribed")),
                           "row": row})
    return checks


def target_line(check: dict) -> str:
    """One check of ``target_checks`` as a printed line."""
    name = check["label"] if check["axis"] == "algorithm" else f"{NAMES[check['collective']]} through {check['label']}"
    label = (f" [oversubscribed: {check['world_size']} processes on {os.cpu_count()} cores]"
             if check["oversubscribed"] else "")
    reference = check.get("reference", "torch")
    return (f"target {name} <= {check['limit']:.2f}x {reference}, {check['world_size']} processes, "
            f"{format_size(check['bytes'])}: {_ratio_text(check['row'])} {check['verdict']}{label}")


def target_lines(rows: list[dict]) -> list[str]:
    """``target_checks`` as one printed line each."""
    return [target_line(check) for check in target_checks(rows)]


def stored_targets(rows: list[dict]) -> list[dict]:
    """``target_checks`` as the results file keeps them: each check without its row, with its printed line."""
    return [{**{k: v for k, v in check.items() if k != "row"}, "text": target_line(check)}
            for check in target_checks(allreduce_rows(rows))]


def floor_table(rows: list[dict]) -> list[str]:
    """The backend's latency floor (rows of ``backend_latency.floor_rows``), one table, oversubscribed runs said so."""
    floor = [r for r in rows if r.get("kind") == "latency floor"]
    if not floor:
        return []
    crowded = sorted({r["world_size"] for r in floor if r.get("oversubscribed")})
    note = f" (oversubscribed: {', '.join(map(str, crowded))} processes on {os.cpu_count()} cores)" if crowded else ""
    shown = [{**r, "size": format_size(r["bytes"]), "us": r["seconds_per_call"] * 1e6} for r in floor]
    return ["", f"## the all-reduce's latency floor on {backend.NAME!r} and what it is made of "
                f"(dpkit/bench/backend_latency.py){note}", "", markdown_table(shown, FLOOR_COLUMNS)]


def report(rows: list[dict], p2p: list[dict] | None = None) -> str:
    """One table per axis, the correctness line, the targets, the model, the one-step rows and the backend's
    latency floor."""
    floor = floor_table(rows)
    rows = allreduce_rows(rows)
    lines = []
    for axis in ("algorithm", "transport", "backend"):
        mine = [row for row in rows if row["axis"] == axis]
        if not mine:
            continue
        backends = ", ".join(sorted({row["backend"] for row in mine}))
        collectives = ", ".join(NAMES[c] for c in dict.fromkeys(row.get("collective", "allreduce") for row in mine))
        shown = [{**row, "size": format_size(row["bytes"]), "avg_ms": row["avg_s"] * 1e3, "p50_ms": row["p50_s"] * 1e3,
                  "p95_ms": row["p95_s"] * 1e3, "ratio": _ratio_text(row)} for row in mine]
        crowded = sorted({row["world_size"] for row in mine if row.get("oversubscribed")})
        note = (f" (oversubscribed: {', '.join(map(str, crowded))} processes on {os.cpu_count()} cores)"
                if crowded else "")
        lines += [f"## {collectives}: {AXIS_TITLES[axis].format(backend=backends)}{note}", "",
                  markdown_table(shown, COLUMNS[axis]), ""]
    wrong = [row for row in rows if not row["correct"]]
    lines.append(f"correctness: {'all exact' if not wrong else f'{len(wrong)} WRONG results: ' + str(wrong)}")
    lines += target_lines(rows) + anchors.ratio_lines(rows)
    fits = allreduce.fit_model(rows)
    if fits:
        lines += ["", "latency-bandwidth model T = steps x alpha + bytes x beta, fitted per algorithm (model_terms):",
                  markdown_table([{**f, "alpha_us": f["alpha_s"] * 1e6} for f in fits], MODEL_COLUMNS)]
    for row in p2p or []:
        lines.append(f"one step, {row['engine']:>4}: {format_size(row['bytes']):>6}: {row['step_s'] * 1e6:10.1f} us, "
                     f"{row['step_gbps']:.3f} GB/s")
    return "\n".join(lines + floor)


# --------------------------------------------------------------------------- entry points


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=None,
                        help="process counts to spawn, one group each; ignored under torchrun "
                             f"(default: 2 4; with --tune {' '.join(map(str, TUNE_PROCS))})")
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                        help=f"message sizes in bytes, KB, MB or GB (powers of 2) (default: {' '.join(DEFAULT_SIZES)}; "
                             f"with --tune {' '.join(TUNE_SIZES)})")
    parser.add_argument("--collective", choices=COLLECTIVES, default="allreduce",
                        help="what to time; reduce_scatter and all_gather are compared on the transport axis only "
                             "(default: %(default)s)")
    parser.add_argument("--axis", choices=tuple(AXES), default=None,
                        help="algorithms: allreduce.py's all-reduces and auto against torch.distributed.all_reduce, "
                             "all over one backend; transports: the registry's (--transports); backends: "
                             "torch.distributed's collectives on a \"dpkit\" group against a gloo group "
                             "(--backend-collectives); all: the three (default: both for allreduce, transports for "
                             "the others, algorithms with --tune)")
    parser.add_argument("--algorithms", nargs="+", choices=tuple(allreduce.ALGORITHMS), default=None,
                        help="the algorithm axis; 'torch' is torch.distributed.all_reduce, the reference "
                             f"(default: {' '.join(allreduce.ALGORITHMS)}; with --tune {' '.join(allreduce.CUSTOM)})")
    parser.add_argument("--transports", nargs="+", type=transport_choice.argument, default=None,
                        choices=transport_choice.choices(), metavar="NAME",
                        help="the transport axis, by the registry's names: " + ", ".join(transport_choice.choices())
                             + "; each on the buffers it allocates; 'torch' is the reference (default: "
                             + " ".join(TRANSPORTS) + ")")
    parser.add_argument("--backend-collectives", nargs="+", choices=tuple(BACKEND_CALLS), default=None,
                        help=f"the backend axis: these calls, each on a {backend.NAME!r} group and a gloo group "
                             "(default: all)")
    parser.add_argument("--backend-sizes", type=parse_size, nargs="+", default=None,
                        help=f"the backend axis's message sizes (default: {' '.join(BACKEND_SIZES)})")
    parser.add_argument("--anchors", nargs="*", choices=anchors.ANCHORS, default=None, metavar="NAME",
                        help="the backend axis: other libraries' collectives timed beside gloo and \"dpkit\" in the "
                             "same ranks: openmpi (Open MPI through mpi4py; each world is started by mpirun), "
                             "deepspeed (DeepSpeed's shared-memory all-reduce); no name: both; one missing is "
                             "skipped, saying why (default: none)")
    parser.add_argument("--floor-calls", type=int, default=FLOOR_CALLS,
                        help="the backend axis: back-to-back calls per round of the latency floor "
                             f"(backend_latency.py) at {', '.join(map(format_size, FLOOR_SIZES))}; 0: none "
                             "(default: %(default)s)")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed calls (rounds) per size and contender, {SMALL_CALLS} times as many up to "
                             f"{SMALL_BYTES >> 20} MiB (default: 20; --quick {QUICK['iters']})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed calls before them (default: 5; --quick {QUICK['warmup']})")
    parser.add_argument("--segment-bytes", type=parse_size, default=allreduce.SEGMENT_BYTES,
                        help="algorithm axis, ring and halving-doubling: bytes per pipelined message, for tuning "
                             "(default: %(default)s)")
    parser.add_argument("--in-flight", type=int, default=allreduce.IN_FLIGHT,
                        help="algorithm axis, ring and halving-doubling: messages posted ahead of the one being added "
                             "(default: %(default)s)")
    parser.add_argument("--tune", action="store_true",
                        help="time the point-to-point algorithms on a finer sweep and write auto's crossover table to "
                             "--crossover-json")
    parser.add_argument("--crossover-json", metavar="PATH", default=allreduce.CROSSOVER_FILE,
                        help="with --tune: where the crossover table goes (default: results/crossover.json, which "
                             "allreduce.py reads)")
    parser.add_argument("--quick", action="store_true", help=f"small and fast: {QUICK} (explicit flags win)")
    parser.add_argument("--plot-dir", metavar="DIR", default=None,
                        help="save the time, bus-bandwidth and model charts here as PNG (default: none)")
    parser.add_argument("--from-json", metavar="PATH", default=None,
                        help="measure nothing: print (and plot) the results in this file (default: none)")
    add_common_args(parser)
    args = parse_checked(parser, argv)
    sharded = args.collective != "allreduce"
    if sharded and (args.axis not in (None, "transports") or args.algorithms is not None):
        parser.error(f"--collective {args.collective} compares transports only (--transports), not algorithms")
    if args.tune and (args.axis not in (None, "algorithms") or sharded):
        parser.error("--tune times the point-to-point all-reduces: no --axis transports, no --collective")
    defaults = {"procs": TUNE_PROCS if args.tune else [2, 4], "sizes": TUNE_SIZES if args.tune else DEFAULT_SIZES,
                "axis": "algorithms" if args.tune else "transports" if sharded else "both",
                "algorithms": list(allreduce.CUSTOM) if args.tune else list(allreduce.ALGORITHMS),
                "transports": list(TRANSPORTS), "backend_collectives": list(BACKEND_CALLS),
                "backend_sizes": BACKEND_SIZES, "iters": 20, "warmup": 5}
    if args.quick:
        defaults.update(QUICK)
    for key, value in defaults.items():  # explicit flags win over --quick and --tune
        if getattr(args, key) is None:
            setattr(args, key, [parse_size(v) for v in value] if key in ("sizes", "backend_sizes") else value)
    if (args.iters < 1 or args.warmup < 0 or min(args.procs) < 1 or min(args.sizes + args.backend_sizes) < 4
            or args.in_flight < 1 or args.floor_calls < 0):
        parser.error("--iters, --procs and --in-flight must be at least 1, --warmup and --floor-calls at least 0, "
                     "sizes at least 4 bytes")
    if sharded and args.axis in ("backends", "all"):
        parser.error(f"--collective {args.collective} is of the transport axis; the backend axis takes "
                     "--backend-collectives")
    # What is measured, as the results file's config will say: an axis left out measures nothing.
    if "algorithm" not in AXES[args.axis] or sharded:
        args.algorithms = []
    if "transport" not in AXES[args.axis]:
        args.transports = []
    if "backend" not in AXES[args.axis]:
        args.backend_collectives = []
    args.anchors = [] if args.anchors is None else args.anchors or list(anchors.ANCHORS)
    if args.anchors and not args.backend_collectives:
        parser.error("--anchors are timed on the backend axis: add --axis backends (or all)")
    return args


def pipeline(args: argparse.Namespace) -> dict:
    return {"segment_bytes": args.segment_bytes, "in_flight": args.in_flight}


def worker(ctx, args: argparse.Namespace) -> list[dict]:
    """One rank: the sweep's rows, then (2 processes, the algorithm axis, not --tune) one step of our engine
    against one of gloo's (rows with "engine")."""
    rows = benchmark_worker(ctx, args.sizes, args.algorithms, args.iters, args.warmup, pipeline(args), args.collective,
                            args.transports)
    if args.backend_collectives:
        rows += backend_worker(ctx, args.backend_collectives, args.backend_sizes, args.iters, args.warmup,
                               args.floor_calls, rows, args.anchors)
    steps = ctx.world_size == 2 and args.collective == "allreduce" and args.algorithms and not args.tune
    return rows + (point_to_point(ctx, args.iters, args.warmup) if steps else [])


def _stored_rows(path: str) -> list[dict]:
    """The rows of a results file, none when it does not exist yet: another device's crossover rows are kept."""
    return read_results(path)["results"] if os.path.exists(path) else []


def extra(rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    """With --tune, auto's crossover table (results/crossover.json, which allreduce.py reads); with --plot-dir,
    the charts."""
    if args.tune:
        table = crossover_table(allreduce_rows(rows))
        config = {k: v for k, v in vars(args).items() if k not in ("json", "plot_dir", "from_json")}
        measured = allreduce.crossover_rows(table, env["device"])
        others = [row for row in _stored_rows(args.crossover_json) if row.get("device", "cpu") != env["device"]]
        write_results(args.crossover_json, "collectives_benchmark --tune", env, config, others + measured)
        print(f"\nauto's crossover table, written to {args.crossover_json} (allreduce.py reads it at import; a world "
              "size it lacks keeps allreduce.DEFAULT_CROSSOVER's row):\n" + format_table(table), flush=True)
    if args.plot_dir:
        from dpkit.report.collective_plots import plot  # imported here: the benchmark itself needs no matplotlib

        charts = plot(rows, args.plot_dir, allreduce.fit_model(allreduce_rows(rows)))
        print("charts: " + ", ".join(charts), flush=True)


BENCHMARK = harness.Benchmark(
    "collectives_benchmark", worker, world_sizes=lambda args: args.procs,
    report=lambda rows: report(rows, [r for r in rows if "engine" in r]), targets=stored_targets, extra=extra,
    describe=lambda args: f"{args.collective}, axis {args.axis}, process counts {args.procs}"
                          + (f", anchors {' '.join(args.anchors)}" if args.anchors else ""),
    config_leaves_out=("json", "plot_dir", "from_json"), launcher=lambda args: anchors.launcher(args.anchors))


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.from_json:  # measure nothing: the file's rows, printed (and charted) again
        document = read_results(arguments.from_json)
        if incomplete_note(document):  # a stopped run's rows: printed, and said to be what it finished
            print(incomplete_note(document), flush=True)
        harness.finish(BENCHMARK, document["results"], document["env"], arguments)
    else:
        if arguments.anchors:  # which can run here (DeepSpeed's op compiled now, before any rank starts)
            arguments.anchors, skipped = anchors.available(arguments.anchors, under_torchrun="RANK" in os.environ)
            if skipped and os.environ.get("RANK", "0") == "0":  # under torchrun, once
                print("\n".join(skipped), flush=True)
        harness.run(BENCHMARK, arguments)
