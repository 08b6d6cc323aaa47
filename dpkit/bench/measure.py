"""Measurement: timing, percentiles, confidence intervals, peak memory and traces.

Every benchmark in this repository measures through these functions, so they all follow
the same rules: warm-up iterations first, a barrier before every timed iteration, GPU work
synchronised before the clock is read, an iteration as slow as its slowest rank (maximum
over ranks), inputs made by the caller outside the timed region, and configurations
interleaved in rounds so that a change in the machine's load hits every one alike. Collectives,
whose calls may be shorter than the gap between ranks leaving a barrier, are timed in
batches of back-to-back calls (``time_batches``).

Uncertainty: a ratio between two configurations measured in the same rounds is summarised
by ``paired_ratio``: the median of the per-round ratios and a 95 % percentile-bootstrap
interval over rounds (rounds resampled with replacement, the median recomputed each time).
``verdict`` turns it into met / missed / inconclusive against a target.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dpkit.comm.process_groups import synchronize


def gather_rows(values: Sequence[float], group=None) -> torch.Tensor:
    """Every rank's ``values`` (same length on all ranks) as a float64 (world, n) tensor on every rank."""
    local = torch.tensor(list(values), dtype=torch.float64)
    if not dist.is_initialized():
        return local.unsqueeze(0)
    world = dist.get_world_size(group)
    # nccl moves only GPU tensors; gloo only needs CPU ones.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else local.device
    local = local.to(device)
    rows = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows).cpu()


@dataclass
class Timing:
    """Per-iteration wall times. ``per_rank`` is (world, iters); ``samples`` its maximum over ranks.

    An iteration is as slow as its slowest rank, so statistics are taken over ``samples``.
    """

    per_rank: torch.Tensor

    @property
    def samples(self) -> list[float]:
        return self.per_rank.max(dim=0).values.tolist()

    def percentile(self, q: float) -> float:
        return percentile(self.samples, q)

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples))


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``samples``, linearly interpolated (numpy's default)."""
    if len(samples) == 0:
        raise ValueError("percentile of no samples")
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


def time_iterations(fn: Callable[[], Any], iters: int, warmup: int = 5, device: torch.device | str = "cpu",
                    group=None, barrier_each: bool = True, setup: Callable[[], Any] | None = None) -> Timing:
    """Time ``iters`` calls of ``fn`` after ``warmup`` untimed ones; every rank must call this.

    A barrier precedes the timed region (and, with ``barrier_each``, every iteration, so
    all ranks start each iteration together and a rank's time includes waiting for its
    slowest peer only inside ``fn``). GPU work is synchronised before the clock is read.
    Inputs must be made by the caller, outside ``fn``; ``setup``, if given, runs before
    every call (warm-up included) outside the timed region, e.g. to restore an input that
    an in-place ``fn`` changed.
    """
    device = torch.device(device)
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    synchronize(device)
    initialized = dist.is_initialized()
    if initialized:
        dist.barrier(group=group)
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
        if barrier_each and initialized:
            dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return Timing(gather_rows(times, group))


# Short calls are timed back to back, in batches that last at least BATCH_S (as OSU's and nccl-tests' loops time
# many calls): the ranks leave the barrier before a batch some way apart, which a batch charges to its calls. Each
# function's calls per batch are counted (``calls_lasting``): the shortest calls are timed thousands at a time, a
# call longer than a batch alone.
BATCH_S, MAX_CALLS_PER_BATCH = 0.02, 1 << 16


def calls_lasting(fn: Callable[[], Any], seconds: float, limit: int, group=None,
                  device: torch.device | str = "cpu", tries: int = 3) -> int:
    """How many back-to-back calls of ``fn`` last at least ``seconds`` (at most ``limit``), the same number on every
    rank: after one untimed call (a first call may set things up), the calls are doubled from one until they last
    that long. A batch timed after a barrier charges its calls with how far apart the ranks left the barrier; a batch
    this long makes that a small share of it, whatever one call costs. Three choices keep a stall from making the
    batch short: the count is the one that lasted the whole time, not scaled from a shorter try that a stall may
    have lengthened; it lasted the whole time in each of ``tries`` tries, since a stall lengthens one try, not the
    calls; and each try is timed on the rank the calls took least time on, since the last rank to start them
    waited for no one while the others waited for it. GPU work is synchronised before the clock is read: queued
    calls would look free."""
    device = torch.device(device)
    fn()
    calls = 1
    while calls < limit:
        # all() stops at the first short try: every rank sees the same least time, so all stop alike.
        if all(_least(_timed(fn, calls, device), group) >= seconds for _ in range(tries)):
            return calls
        calls = min(2 * calls, limit)
    return calls


def _timed(fn: Callable[[], Any], calls: int, device: torch.device) -> float:
    """Seconds that ``calls`` back-to-back calls of ``fn`` take, queued GPU work included."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return time.perf_counter() - start


def _least(value: float, group=None) -> float:
    """The smallest of every rank's ``value`` (``value`` itself without a process group)."""
    if not dist.is_initialized():
        return value
    return float(gather_rows([value], group).min())


def in_turn(names: list, round_: int) -> list:
    """``names`` in the order round ``round_`` times them: rotated by one each round, so that a change in the
    machine's load during a run hits every one alike."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def time_interleaved(fns: dict[str, Callable[[], Any]], iters: int, warmup: int = 5, rounds: int = 2,
                     device: torch.device | str = "cpu", group=None,
                     setup: Callable[[], Any] | None = None) -> dict[str, Timing]:
    """``time_iterations`` for several functions, their iterations split into ``rounds`` interleaved rounds.

    Round r times each function in turn (the order rotated every round), so a change in the
    machine's load during the run hits every function alike and their ratios stay meaningful.
    Each function gets ``iters`` timed calls in all (at least one per round) and ``warmup``
    untimed calls in its first round; every rank must call this with the same functions.
    """
    names = list(fns)
    rounds = max(1, min(rounds, iters))
    per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for r in range(rounds):
        for name in in_turn(names, r):
            timing = time_iterations(fns[name], per_round[r], warmup if r == 0 else 0, device, group, setup=setup)
            parts[name].append(timing.per_rank)
    return {name: Timing(torch.cat(parts[name], dim=1)) for name in names}


def time_batches(fns: dict[str, Callable[[], Any]], iters: int, warmup: int = 5, rounds: int = 2,
                 device: torch.device | str = "cpu", group=None, setup: Callable[[], Any] | None = None,
                 seconds: float = BATCH_S) -> tuple[dict[str, Timing], dict[str, int]]:
    """``time_interleaved`` of batches of back-to-back calls: each function's calls per batch counted to last
    ``seconds`` (``calls_lasting``, after one ``setup``), then ``iters`` timed batches of each (``setup`` before
    every batch); (each function's ``Timing`` per call, each function's calls per batch). Every rank must call
    this with the same functions."""
    if setup is not None:
        setup()
    counts = {name: calls_lasting(fn, seconds, MAX_CALLS_PER_BATCH, group, device) for name, fn in fns.items()}
    batches = {name: functools.partial(_repeated, fn, counts[name]) for name, fn in fns.items()}
    timings = time_interleaved(batches, iters, warmup, rounds, device, group, setup)
    return {name: Timing(timings[name].per_rank / counts[name]) for name in fns}, counts


def _repeated(fn: Callable[[], Any], times: int) -> None:
    for _ in range(times):
        fn()


def round_p50s(samples: Sequence[float], iters: int, rounds: int) -> list[float]:
    """The p50 of each round's iterations of one function timed by ``time_interleaved`` (``samples``: its
    ``Timing.samples``, whose rounds come in order, split as ``time_interleaved`` splits ``iters``)."""
    rounds = max(1, min(rounds, iters))
    sizes = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
    starts = [sum(sizes[:r]) for r in range(rounds)]
    return [percentile(samples[s:s + k], 50) for s, k in zip(starts, sizes)]


# What the profiler writes to fd 2 as it starts and stops: kineto's status lines
# ("USDT:2026-01-01 12:00:00 123:123 SyncActivityProfilerHandler.cpp:39] profiler_start") and
# the allocator's once-per-process warning about blocks allocated before profiling.
_PROFILER_NOISE = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] "
                             r"|Memory block of unknown size was allocated before the profiling started")


@contextmanager
def quiet_stderr():
    """Drop the profiler's status lines from fd 2 while it starts and stops, and only those.

    fd 2 is process-wide: another thread (gloo's) may report an error in this window. So fd 2
    goes to a temporary file, and afterwards every line that is not profiler noise is written
    to the real stderr.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _PROFILER_NOISE.search(line))
            if kept:
                os.write(2, kept.encode())


class PeakMemory:
    """Peak bytes of tensor memory that torch allocated inside the block, above the level at entry.

    On CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
    what was allocated at entry.
    On CPU: torch has no allocator statistics, and tracemalloc does not see its buffers.
    We record the block with the autograd profiler (``profile_memory=True``), which logs every
    allocation and free of torch's CPU allocator, and take the maximum of the running total
    in time order. It counts tensors, autograd's saved tensors and operator workspaces
    allocated on the thread that entered the block; it does not count Python objects or
    gloo's own transport buffers.
    Limitation: a tensor whose last reference is dropped on another thread (e.g. a gloo
    worker finishing a collective after the caller let go of its buffer) is freed without
    an event, so a block that ends such collectives can overstate the peak by that buffer.
    Measure steady-state steps (after construction broadcasts) where that matters.
    Wait for every asynchronous collective launched inside before the block ends: a gloo work
    that completes after the profiler stopped crashes the process when its handle is freed
    (seen with ZeRO's overlapped all-gathers on gloo: ``ShardedOptimizer.wait_for_parameters``).
    Memory in /dev/shm (``transport.SharedMemory``) is not torch's allocator's: see
    ``SharedMemory.observe_blocks``.
    Profiling slows the block down: measure memory and time in separate runs.

    Usage::

        with PeakMemory(device) as peak:
            step()
        peak.bytes
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            # The autograd profiler torch.profiler.profile wraps: the wrapper's start imports
            # torch._inductor, seconds of CPU in a process that has not imported torch._dynamo
            # yet (building a torch.optim optimizer imports that too).
            self._profiler = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True)
            with quiet_stderr():
                # The first free of a block allocated before profiling makes torch warn, once per
                # process ("Memory block of unknown size..."): a free we do not count anyway
                # (it is below the level at entry). Trigger that warning here, silenced.
                before = torch.empty(1)
                self._profiler.__enter__()
                del before
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        with quiet_stderr():
            self._profiler.__exit__(*exc)
        if exc[0] is not None:
            return
        events = [e for e in self._profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        self.bytes = peak


def _all_threads() -> dict:
    """The profiler's argument that records every Python thread (a communication thread's ranges too), not only
    the one that starts it; none where the running torch has moved or dropped that private class: the
    profile then covers the starting thread, and the benchmark runs on."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, AttributeError, TypeError):
        return {}


@contextmanager
def _profiled(device: torch.device):
    """The autograd profiler (every thread's host operators; on CUDA, every stream's kernels) around
    the block, queued GPU work waited for before it stops, kineto's status lines silenced. Yields the
    profiler, stopped once the block is over. It is what ``torch.profiler.profile`` wraps: the
    wrapper's start imports torch._inductor (seconds of CPU per process)."""
    profiler = torch.autograd.profiler.profile(use_kineto=True, use_device="cuda" if device.type == "cuda" else None,
                                               **_all_threads())
    with quiet_stderr():
        profiler.__enter__()
    try:
        yield profiler
        synchronize(device)
    finally:
        with quiet_stderr():
            profiler.__exit__(None, None, None)


@contextmanager
def chrome_trace(path: str, device: torch.device | str = "cpu"):
    """Profile the block and write a Chrome trace to ``path`` (chrome://tracing or ui.perfetto.dev).

    The trace holds the host operators of every thread (so gloo's collectives, which run
    on gloo's own threads, appear beside backward) and, on CUDA, the kernels of every
    stream (``_profiled``). Nothing is written if the block raises.
    """
    with _profiled(torch.device(device)) as profiler:
        yield
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with quiet_stderr():
        profiler.export_chrome_trace(path)


def saved_tensor_bytes(fn: Callable[[], Any], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of distinct tensor storage that autograd keeps for backward while ``fn`` runs.

    Counts each storage once (a tensor saved twice, or a view of a saved tensor, is free),
    including inputs and outputs that are saved because backward needs them, except the
    storages of ``exclude`` (e.g. the parameters, to count activations only).
    """
    # Keyed by the storage object, not its address: an engine that frees a storage's memory during fn
    # (fully_shard frees gathered weights with resize_) lets a later tensor reuse the same address.
    storages: dict[int, int] = {}
    excluded = {t.untyped_storage()._cdata for t in exclude}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage._cdata not in excluded:
            storages[storage._cdata] = storage.nbytes()
        # Detached: a saved output that refers to its own graph makes a cycle through autograd's C++ nodes that
        # Python's collector cannot see (pytorch/pytorch#115255), and fn's graph would never be freed.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


# --------------------------------------------------------------------------- uncertainty

# The record_function ranges of one training iteration, as the DDP benchmark's step names them and the
# report's timeline and breakdown draw them.
PHASES = ("forward", "backward", "sync_gradients", "optimizer_step")

BOOTSTRAP_RESAMPLES = 10_000
CI_METHOD = "median of per-round ratios; 95 % percentile bootstrap over rounds"


def bootstrap_ci(values: Sequence[float], stat: Callable = np.median, level: float = 0.95,
                 resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap ``level`` interval of ``stat`` over ``values`` (independent rounds).

    Fixed seed: the same data always gives the same interval, so a rendered report is
    reproducible. With one value the interval is that value (nothing to resample).
    """
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("confidence interval of no values")
    picks = np.random.default_rng(seed).integers(0, data.size, size=(resamples, data.size))
    estimates = stat(data[picks], axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(estimates, [tail, 100 - tail])
    return float(low), float(high)


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> dict:
    """Summarise ``ours / theirs`` for two configurations timed in the same rounds.

    ``ours[r]`` and ``theirs[r]`` are one statistic (usually the p50 time) of round r; the
    pairing cancels load that changed between rounds. Returns the median of the per-round
    ratios, its 95 % bootstrap interval over rounds, the number of rounds and the method.
    """
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired_ratio needs the same non-zero number of rounds, got {len(ours)} and {len(theirs)}")
    ratios = [a / b for a, b in zip(ours, theirs)]
    low, high = bootstrap_ci(ratios)
    return {"median": float(np.median(ratios)), "ci_low": low, "ci_high": high, "rounds": len(ratios),
            "per_round": ratios, "method": CI_METHOD}


def verdict(ratio: dict, target: float) -> str:
    """``met`` when the whole interval is at or below ``target``, ``missed`` when it is all above,
    ``inconclusive`` when it straddles the target (more rounds would decide)."""
    if ratio["ci_high"] <= target:
        return "met"
    if ratio["ci_low"] > target:
        return "missed"
    return "inconclusive"


def format_ratio(ratio: dict, against: float | None = None) -> str:
    """``<median>x [<low>, <high>]``: two decimals, because rounds differ by more than that. A single
    measurement (no interval) gets four, so a verdict against a target of 1.00 is visible in it. ``against``: the
    limit a sentence judges the interval by; where a bound on one side of it rounds to it, three decimals show the
    side ("[1.003, 1.200]", not "[1.00, 1.20]")."""
    if ratio["rounds"] == 1:
        return f"{ratio['median']:.4f}x (one measurement)"
    bounds = (ratio["ci_low"], ratio["ci_high"])
    digits = 3 if against is not None and any(f"{b:.2f}" == f"{against:.2f}" and b != against for b in bounds) else 2
    return f"{ratio['median']:.{digits}f}x [{ratio['ci_low']:.{digits}f}, {ratio['ci_high']:.{digits}f}]"


def oversubscribed(world_size: int, device: torch.device | str = "cpu", cpus: int | None = None) -> bool:
    """More CPU processes than cores: they time-share cores, so their timings say little about
    the algorithm. Never true on GPUs (one process per device, the CPU is not the bottleneck)."""
    if torch.device(device).type != "cpu":
        return False
    return world_size > (cpus or os.cpu_count() or 1)


# --------------------------------------------------------------------------- where the time goes


def op_breakdown(fn: Callable[[], Any], iters: int, ranges: Sequence[str] = (), top: int = 10,
                 device: torch.device | str = "cpu") -> dict:
    """Profile ``iters`` calls of ``fn``: per call, the CPU time of each named ``record_function``
    range in ``ranges`` (inclusive of what runs inside) and of the ``top`` operators by self time.

    Returns ``{"ranges": {name: seconds}, "ops": [{"op", "self_s", "calls"}, ...], "iters": iters}``,
    seconds per call. Self time counts each microsecond once, on the thread that spent it (gloo's
    collectives run on gloo's threads, so their time appears beside backward, not inside it).
    Profiling adds per-operator overhead: compare breakdowns with each other, not with timings.
    """
    with _profiled(torch.device(device)) as profiler:
        for _ in range(iters):
            fn()
    averages = profiler.key_averages()
    by_name = {e.key: e for e in averages}
    spans = {name: by_name[name].cpu_time_total / 1e6 / iters for name in ranges if name in by_name}
    operators = sorted((e for e in averages if e.key not in ranges and not e.key.startswith("iteration")),
                       key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    ops = [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6 / iters, "calls": e.count / iters} for e in operators]
    return {"ranges": spans, "ops": ops, "iters": iters}
