"""Time and memory of synchronized BatchNorm, forward + backward: the engine on each transport, and the transports.

    python syncbn_benchmark.py                    # spawns 2 workers itself (gloo on CPU; nccl when GPUs are visible)
    python syncbn_benchmark.py --quick            # the same grid with fewer iterations
    python syncbn_benchmark.py --quick --settings workers --dtypes float32   # the workers' targets only
    python syncbn_benchmark.py --baseline main    # also times syncbn.py as of a git revision: the A/B of a change
    torchrun --standalone --nproc_per_node 2 syncbn_benchmark.py --json results/syncbn.json

Two axes, never mixed. Every synchronized implementation sums through each transport of ``--transports``
(the registry's names), made once per run: "torch" (``transport.Torch``, rows ``[torch]``) and "shared_memory"
when the workers share a CPU host (rows ``[shared_memory]``) by default. The engine: ours [t] against
``BatchNorm1d + 2 all_reduce`` [t], BatchNorm1d plus the two sums of 2C + 1 values any synchronized BatchNorm
makes, on the same transport t, each in buffers t allocates (as ours: on shared memory summed where they lie,
zero copy); the targets (``CPU_TARGET`` at every size, ``TARGET_GRID`` over the grid) hold per transport and
judged dtype (``JUDGED``). The transport: ours [shared_memory] / ours [torch], for information. The floor [t]
(``_FloorFunction``: BatchNorm's kernels in a Python autograd.Function making the same two sums) bounds what a
layer of this design costs. ``BatchNorm1d (local)`` has no communication; on CUDA ``torch.nn.SyncBatchNorm``.

The homework's setup: a global batch of B samples split evenly over the workers, H channels, standard
normal inputs, loss = sum of the outputs over the first B/2 samples of the global batch. One iteration
= forward + backward after a barrier, as long as its slowest rank, implementations interleaved in
rounds; a ratio is the median of per-round ratios with a 95 % bootstrap interval, judged met / missed /
inconclusive. With one process the layer is ``F.batch_norm``, timed also with cold caches (``COLD``).
Peak memory, bytes saved for backward, operators dispatched per iteration (``operators``: with the calls into
``syncbn_channels.c``; CUDA: kernels launched), a per-operator profile and one iteration cut at its two sums
(``phases``): separate passes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dpkit.bench import harness
from dpkit.bench import transport_choice
from dpkit.bench.measure import (PeakMemory, gather_rows, op_breakdown, oversubscribed, percentile, saved_tensor_bytes,
                                 synchronize, time_iterations)
from dpkit.bench.results import format_environment
from dpkit.bench.syncbn_report import report
from dpkit.bench.syncbn_verdicts import (COLD, DTYPES, FLOOR, JUDGED, LOCAL, OURS, PATH_IMPLS, PATHS, PHASES, REFERENCE,
                                         SHM, SINGLE, SYNC_PATH, TORCH, TORCH_SYNC, WORKERS, bounds, ratios, targets)
from dpkit.comm import transport
from dpkit.comm import process_groups
from dpkit.comm.process_groups import add_common_args, parse_checked, progress
from dpkit.native import syncbn_channels
import syncbn
from syncbn import SyncBatchNorm

EVICT_BYTES = 16 << 20  # written before each COLD iteration: several times a core's own caches (L1 and L2)
TRANSPORTS = (TORCH, SHM)  # the default --transports (shared memory where it can serve)
PROFILE_ITERS = 20
OPERATOR_ITERS = 3  # iterations whose dispatched operators (CUDA: kernel launches) are counted, per iteration
# One process times this many times --iters (warm caches): its iterations are a few tens of microseconds, several
# times shorter than the workers', and their ratios to BatchNorm1d's need more of them to settle.
SINGLE_ITERS_FACTOR = 8
PHASE_ITERS = 200
NORMAL = {"iters": 2000, "rounds": 40, "warmup": 20}
QUICK = {"iters": 240, "rounds": 24, "warmup": 5}  # enough rounds that an interval can decide CPU_TARGET

Contender = tuple[str, "str | None"]  # (impl, transport name or None)




# --------------------------------------------------------------------------- the transports


class Stamped(transport.Wrapped):
    """``inner`` with the clock appended to ``stamps`` before and after the caller is blocked on each all_reduce:
    around the call when it returns done (a blocking call; shared memory sums in the caller's thread), else around
    the ``wait()`` of the work it returns (what runs in between is the caller's, overlapped). On a GPU the device
    is synchronised first, so a stamp means the work is done. Every rank must wrap alike."""

    name = "stamped"

    def __init__(self, inner: transport.Transport, stamps: list[float], device: torch.device):
        super().__init__(inner)
        self.stamps, self.device = stamps, device

    def clock(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        start = self.clock()
        work = self.inner.all_reduce(tensor, op, async_op=async_op)
        if work is None or work.is_completed():
            self.stamps += [start, self.clock()]
            return work
        return _StampedWork(work, self)


class _StampedWork(transport.Work):
    """A collective's work whose ``wait`` is stamped (see ``Stamped``)."""

    def __init__(self, work: transport.Work, stamped: Stamped):
        self.work, self.stamped = work, stamped

    def wait(self) -> bool:
        start = self.stamped.clock()
        self.work.wait()
        self.stamped.stamps += [start, self.stamped.clock()]
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


# --------------------------------------------------------------------------- the implementations


def _load_baseline(revision: str):
    """``syncbn.py`` as of a git revision, imported as a separate module (for an A/B in the same run)."""
    source = subprocess.run(["git", "show", f"{revision}:syncbn.py"], capture_output=True, text=True, check=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="syncbn_baseline_"), "syncbn_baseline.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("syncbn_baseline", path)
    module = importlib.util.module_from_spec(spec)
    # A revision from before the package imported its modules from the root: give it them under those names.
    missing = {old: new for old, new in BEFORE_THE_PACKAGE.items() if old not in sys.modules}
    sys.modules.update(missing)
    try:
        spec.loader.exec_module(module)
    finally:
        for old in missing:
            sys.modules.pop(old, None)
    if "transport" not in inspect.signature(module.SyncBatchNorm).parameters:
        # Such a revision chooses its own communication inside, so it cannot be timed over the run's transports.
        raise ValueError(f"--baseline {revision}: syncbn.py at that revision predates the transport seam "
                         "(SyncBatchNorm(..., transport=)); give a later revision")
    return module


# The root modules syncbn.py imported before they moved into dpkit, and where they are now.
BEFORE_THE_PACKAGE = {"transport": transport, "dist_utils": process_groups}


def _ours(module, hidden: int, wire: transport.Transport | None) -> torch.nn.Module:
    if wire is None:  # one process: nobody to synchronise with
        return module.SyncBatchNorm(hidden)
    return module.SyncBatchNorm(hidden, transport=wire)


class _WithoutCollectives(SyncBatchNorm):
    """SyncBatchNorm's Function with no transport: all of its work but the two sums across ranks."""

    def __init__(self, hidden: int, function):
        super().__init__(hidden)
        self.function = function

    def forward(self, x):
        return self.function.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                   self.momentum, None)


class _FloorFunction(torch.autograd.Function):
    """A timing device, not a layer: what any synchronized BatchNorm written as a Python autograd.Function
    (``syncbn.SyncBatchNormFunction``, ``torch.nn.SyncBatchNorm``'s) pays at least with the same sums.

    BatchNorm's own fused kernels (``native_batch_norm`` in training mode, which also updates the running
    statistics, and its backward), with a sum across ranks through ``transport`` of 2C + 1 float64 values
    inside forward and of 2C inside backward, where a synchronized layer must make them: before the output
    exists, and before the input gradient does. It normalizes with the local batch's statistics and sends
    zeros (buffers the transport allocated, made once, outside the timed region). Ours does this and the
    synchronisation's own arithmetic (packing, the float64 combination, the global terms of dx): ours / floor is that
    arithmetic's price; floor / (BatchNorm1d + 2 all_reduce) on the same transport is what the Function and
    the sums' place in the graph cost, which no layer of this design goes below.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, sums, transport):
        y, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
        transport.all_reduce(sums[0])  # (2C + 1,) float64: the forward's statistics
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.eps, ctx.sums, ctx.transport = eps, sums, transport
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        grads = torch.ops.aten.native_batch_norm_backward(dy, x, weight, None, None, mean, invstd, True, ctx.eps,
                                                          list(ctx.needs_input_grad[:3]))
        ctx.transport.all_reduce(ctx.sums[1])  # (2C,) float64: the backward's two sums
        return (*grads, None, None, None, None, None, None)


class Floor(torch.nn.BatchNorm1d):
    """BatchNorm1d's parameters and buffers through ``_FloorFunction``, summing through ``transport``."""

    def __init__(self, hidden: int, wire: transport.Transport, device: torch.device | None = None):
        super().__init__(hidden)
        self.transport = wire
        self.sums = tuple(_sum_buffer(wire, n, torch.float64, device) for n in (2 * hidden + 1, 2 * hidden))

    def forward(self, x):
        return _FloorFunction.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                    self.momentum, self.sums, self.transport)


def _make_layer(impl: str, hidden: int, device: torch.device, wire: transport.Transport | None = None,
                baseline=None) -> torch.nn.Module:
    module = baseline if "@" in impl else syncbn
    if impl == FLOOR:
        layer = Floor(hidden, wire, device)
    elif impl.startswith(SYNC_PATH):
        layer = _WithoutCollectives(hidden, module.SyncBatchNormFunction)
    elif impl.startswith(OURS):
        layer = _ours(module, hidden, wire)
    elif impl == TORCH_SYNC:
        layer = torch.nn.SyncBatchNorm(hidden)
    else:
        layer = torch.nn.BatchNorm1d(hidden)
    return layer.to(device).train()


def _sum_buffer(wire: transport.Transport, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros in memory ``transport`` allocated (``Transport.allocate``), made once, outside the timed region."""
    return wire.allocate(numel, dtype=dtype, device=device).zero_()


def _make_step(impl: str, layer: torch.nn.Module, x: torch.Tensor, loss_rows: int,
               wire: transport.Transport | None = None) -> Callable[[], None]:
    """One iteration: forward, the homework's loss over this rank's share of the first B/2 samples, backward."""
    path = {name: p for p, name in PATH_IMPLS.items() if name != SYNC_PATH}.get(impl)  # a path forced by name
    if path is not None:
        def forced_step():
            x.grad = None
            with syncbn.forced_path(path):  # forward and backward
                layer(x)[:loss_rows].sum().backward()
        return forced_step
    if impl != REFERENCE or wire is None:
        def step():
            x.grad = None
            layer(x)[:loss_rows].sum().backward()
        return step

    # BatchNorm's own work plus the two sums a synchronized BatchNorm cannot avoid, in buffers the transport
    # allocates, as ours sums its statistics (on shared memory: where they lie, no copy in or out).
    channels = x.size(1)
    forward_stats, backward_stats = (_sum_buffer(wire, 2 * channels + 1, torch.float32, x.device)
                                     for _ in range(2))

    def reference_step():
        x.grad = None
        y = layer(x)
        wire.all_reduce(forward_stats)
        y[:loss_rows].sum().backward()
        wire.all_reduce(backward_stats)
    return reference_step


def contenders(device: torch.device, transport_names, baseline: str | None, dtype: str) -> list[Contender]:
    """The timed (implementation, transport) pairs of the workers: on each transport ours, the reference and (float32:
    it attributes the targets' misses) the floor; BatchNorm1d without communication; on CUDA torch's SyncBatchNorm.
    float16/bfloat16 (information) run on one transport, the one "auto" picks (the last made), which keeps the
    quick run's time."""
    names = list(transport_names)
    out: list[Contender] = []
    for t in names if dtype == "float32" else names[-1:]:
        out += [(OURS, t), (REFERENCE, t)] + ([(FLOOR, t)] if dtype in JUDGED else [])
        out += [(f"{OURS}@{baseline}", t)] if baseline else []
    out.append((LOCAL, None))
    return out + ([(TORCH_SYNC, TORCH)] if device.type == "cuda" else [])


# --------------------------------------------------------------------------- one case


def _local_input(rank: int, world: int, batch: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    """This rank's rows of the global (batch, hidden) input, and how many of them are in the first batch/2."""
    local = batch // world
    generator = torch.Generator().manual_seed(1000 * rank + hidden + batch)
    x = torch.randn(local, hidden, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    return x, max(0, min(local, batch // 2 - rank * local))


def dispatch_counter():
    """A context manager class whose instances count the aten operators dispatched on this thread (``count``),
    or None where this torch lacks the hook: the benchmark's one private torch name (a Python dispatch mode),
    imported here only, so a torch without it loses the count and nothing else."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return None

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))
    return Counter


def _kernel_launches(step: Callable[[], None], iters: int) -> float:
    """CUDA: the kernel launches of ``iters`` calls of ``step`` (the profiler's runtime events), per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return sum("LaunchKernel" in e.name for e in profiler.events()) / iters


@contextlib.contextmanager
def _counting_c_calls():
    """Counts the calls into syncbn_channels.c (``dpkit.native``) while it is open: ``yield``s a list whose one
    element is the count. Each call is one step of the layer done in C where PyTorch would dispatch several."""
    counted, originals = [0], []
    for functions in filter(None, map(syncbn_channels.for_dtype, (torch.float32, torch.float64))):
        for name, function in list(vars(functions).items()):
            def counting(*args, _function=function):
                counted[0] += 1
                return _function(*args)
            originals.append((functions, name, function))
            setattr(functions, name, counting)
    try:
        yield counted
    finally:
        for functions, name, function in originals:
            setattr(functions, name, function)


def operators(step: Callable[[], None], device: torch.device, iters: int = OPERATOR_ITERS) -> float:
    """What one iteration dispatches: on the CPU the aten operators called on this thread (the autograd
    engine runs the CPU backward here too; a transport's own threads are not counted) plus the calls into
    syncbn_channels.c, on CUDA the kernels launched. -1 where it cannot be counted (a warning says why): the
    count is information, not a verdict."""
    try:
        if device.type == "cuda":
            return _kernel_launches(step, iters)
        counter = dispatch_counter()
        if counter is None:
            return -1.0
        with counter() as mode, _counting_c_calls() as c_calls:
            for _ in range(iters):
                step()
        return (mode.count + c_calls[0]) / iters
    except Exception as error:  # a profiler or dispatch mode this torch refuses: no count, the run goes on
        warnings.warn(f"syncbn_benchmark: operators not counted ({type(error).__name__}: {error})")
        return -1.0


def _memory(step: Callable[[], None], layer: torch.nn.Module, x: torch.Tensor,
            device: torch.device) -> tuple[int, int, float]:
    """(peak bytes of one iteration, bytes saved for backward by one forward, ``operators`` per iteration);
    maxima over ranks.

    The peak is the least of 3 iterations' (``measure.PeakMemory`` on the CPU can only overstate)."""
    step()  # warm: first-call allocations (e.g. cached constants) are not the steady state
    peaks = []
    for _ in range(3):
        with PeakMemory(device) as peak:
            step()
        peaks.append(peak.bytes)
    saved = saved_tensor_bytes(lambda: layer(x))
    ops = operators(step, device)
    most = gather_rows([min(peaks), saved, ops]).max(dim=0).values  # ranks differ (rank 0 holds the loss rows)
    return int(most[0]), int(most[1]), float(most[2])


def run_case(rank: int, world: int, device: torch.device, impls: list[Contender], batch: int, hidden: int,
             dtype_name: str, args, baseline=None, setting: str | None = None, setup=None,
             made: dict[str, transport.Transport] | None = None) -> list[dict]:
    """Every (implementation, transport) of ``impls`` on one (batch, hidden, dtype), timed in interleaved rounds;
    one row each. ``made`` maps a transport name to the transport (``transport_choice.make``).

    ``setup`` runs before every iteration, outside the timed region; ``setting`` labels the rows
    (default: WORKERS with a process group, else SINGLE)."""
    made = made or {}
    x, loss_rows = _local_input(rank, world, batch, hidden, DTYPES[dtype_name], device)
    layers = {c: _make_layer(c[0], hidden, device, made.get(c[1]), baseline) for c in impls}
    steps = {c: _make_step(c[0], layers[c], x, loss_rows, made.get(c[1])) for c in impls}
    per_round = max(1, args.iters // args.rounds)
    samples: dict[Contender, list[list[float]]] = {c: [] for c in impls}
    for round_ in range(args.rounds):
        shift = round_ % len(impls)
        for c in impls[shift:] + impls[:shift]:
            timing = time_iterations(steps[c], per_round, warmup=args.warmup if round_ == 0 else 2, device=device,
                                     setup=setup)
            samples[c].append(timing.samples)  # per iteration, the slowest rank's time
    rows = []
    for c in impls:
        impl, t = c
        flat = [s for r in samples[c] for s in r]
        peak, saved, ops = _memory(steps[c], layers[c], x, device)
        rows.append({"kind": "time", "impl": impl, "transport": t,
                     "transport_detail": made[t].describe() if t in made else None,
                     "setting": setting or (WORKERS if world > 1 else SINGLE),
                     "dtype": dtype_name, "device": device.type, "batch": batch, "hidden": hidden, "workers": world,
                     "local_batch": x.size(0), "iters": len(flat), "rounds": args.rounds,
                     "time_s": float(np.median(flat)), "p10_s": percentile(flat, 10), "p90_s": percentile(flat, 90),
                     **{f"round_p{q}_s": [percentile(r, q) for r in samples[c]] for q in (10, 50, 90)},
                     "peak_bytes": peak, "saved_bytes": saved, "operators": ops})
    return rows


def breakdown(rank: int, world: int, device: torch.device, impls: list[Contender], batch: int, hidden: int,
              made: dict[str, transport.Transport] | None = None, iters: int = PROFILE_ITERS) -> list[dict]:
    """Per-operator CPU time of one forward + backward (profiled, rank 0's), ours against BatchNorm1d."""
    made = made or {}
    x, loss_rows = _local_input(rank, world, batch, hidden, torch.float32, device)
    rows = []
    for impl, t in impls:
        step = _make_step(impl, _make_layer(impl, hidden, device, made.get(t)), x, loss_rows, made.get(t))
        step()
        profile = op_breakdown(step, iters, top=12, device=device)
        rows.append({"kind": "breakdown", "impl": impl, "transport": t, "setting": WORKERS if world > 1 else SINGLE,
                     "dtype": "float32", "device": device.type, "batch": batch, "hidden": hidden, "workers": world,
                     "iters": iters, "ops": profile["ops"], "top_self_s": sum(o["self_s"] for o in profile["ops"])})
    return rows


def phase_medians(stamps: list[float], iters: int) -> np.ndarray:
    """The median duration of each of ``PHASES`` over the last ``iters`` iterations (earlier ones: warm-up),
    then the median of the iterations' whole durations (not the sum of the phases' medians: the phases
    of one iteration are not independent, and the sum of their medians understates it).

    ``stamps`` holds, per iteration, its start, the start and end of each collective, and its end."""
    durations = np.diff(np.array(stamps).reshape(-1, len(PHASES) + 1)[-iters:], axis=1)
    return np.append(np.median(durations, axis=0), np.median(durations.sum(axis=1)))


def phases(rank: int, world: int, device: torch.device, impls: list[Contender], batch: int, hidden: int,
           iters: int, made: dict[str, transport.Transport]) -> list[dict]:
    """Each implementation's iteration cut into ``PHASES`` (median seconds per phase, and of the whole
    iteration, each the maximum over ranks), its transport wrapped in ``Stamped``.

    The profiler charges a collective's wait to whatever called it (SyncBatchNormFunction's
    "self" time); this shows the compute between the collectives apart from the waiting.
    """
    x, loss_rows = _local_input(rank, world, batch, hidden, torch.float32, device)
    rows = []
    for impl, t in impls:
        stamps: list[float] = []
        stamped = Stamped(made[t], stamps, device)
        step = _make_step(impl, _make_layer(impl, hidden, device, stamped), x, loss_rows, stamped)

        def stamped_step():
            stamps.append(time.perf_counter())
            step()
            synchronize(device)
            stamps.append(time.perf_counter())
        time_iterations(stamped_step, iters, warmup=2, device=device)
        *slowest, iteration = map(float, gather_rows(list(phase_medians(stamps, iters))).max(dim=0).values)
        rows.append({"kind": "phases", "impl": impl, "transport": t, "setting": WORKERS, "dtype": "float32",
                     "device": device.type, "batch": batch, "hidden": hidden, "workers": world, "iters": iters,
                     "phases_s": dict(zip(PHASES, slowest)), "iteration_s": iteration})
    return rows


def run(ctx, args, profile_iters: int = PROFILE_ITERS, phase_iters: int = PHASE_ITERS) -> list[dict]:
    """Every rank runs the whole grid; returns the rows (the same on every rank: times are maxima over ranks)."""
    baseline = _load_baseline(args.baseline) if args.baseline else None
    made = transport_choice.make(args.transports, ctx.device, optional=True)  # shared memory where it can serve
    try:
        cases = [(d, b, h) for d in args.dtypes for b in args.batch for h in args.hidden]
        rows = []
        for dtype_name, batch, hidden in progress(cases, desc="syncbn benchmark, workers"):
            impls = contenders(ctx.device, made, args.baseline, dtype_name)
            rows += run_case(ctx.rank, ctx.world_size, ctx.device, impls, batch, hidden, dtype_name, args, baseline,
                             made=made)
            harness.keep(ctx, rows)
        for batch, hidden in _profiled_sizes(args):
            engines = [(impl, t) for t in made for impl in (OURS, REFERENCE)]
            rows += breakdown(ctx.rank, ctx.world_size, ctx.device, engines + [(LOCAL, None)], batch, hidden, made,
                              profile_iters)
            cut = [(impl, t) for t in made for impl in (OURS, REFERENCE, FLOOR)]
            rows += phases(ctx.rank, ctx.world_size, ctx.device, cut, batch, hidden, phase_iters, made)
        return rows
    finally:
        for made_one in made.values():
            made_one.close()


def _profiled_sizes(args) -> list[tuple[int, int]]:
    """The smallest and the largest size of the grid."""
    return sorted({(min(args.batch), min(args.hidden)), (max(args.batch), max(args.hidden))})


def _evictor(device: torch.device) -> Callable[[], None]:
    """Before each COLD iteration: write EVICT_BYTES, which leaves none of the layer's code or data in the
    core's own caches, as a collective's threads and system calls leave them for the work that follows it."""
    scratch = torch.zeros(EVICT_BYTES // 4, device=device)
    return lambda: scratch.add_(1.0)


def run_single_process(device: torch.device, args) -> list[dict]:
    """Ours against BatchNorm1d in this process, with no process group (float32, the whole grid), and the
    synchronized computation without its collectives (what the layer costs beyond BatchNorm's kernels); on
    the CPU, at the smallest and the largest size, the latter two again with cold caches (COLD)."""
    assert not dist.is_initialized()
    baseline = _load_baseline(args.baseline) if args.baseline else None
    impls = [(OURS, None), (LOCAL, None), (SYNC_PATH, None)]
    impls += [(f"{SYNC_PATH}@{args.baseline}", None)] if args.baseline else []
    warm = argparse.Namespace(**{**vars(args), "iters": SINGLE_ITERS_FACTOR * args.iters})
    rows = []
    for batch, hidden in progress([(b, h) for b in args.batch for h in args.hidden],
                                  desc="syncbn benchmark, 1 process"):
        rows += run_case(0, 1, device, impls, batch, hidden, "float32", warm, baseline)
    for batch, hidden in _profiled_sizes(args):
        if device.type == "cpu":
            rows += run_case(0, 1, device, [(LOCAL, None), (SYNC_PATH, None)], batch, hidden, "float32", args,
                             setting=COLD, setup=_evictor(device))
        rows += breakdown(0, 1, device, [(OURS, None), (LOCAL, None), (SYNC_PATH, None)], batch, hidden)
    return rows


def run_paths(device: torch.device, args) -> list[dict]:
    """The synchronized path without collectives on each of ``syncbn.PATHS`` (``PATH_IMPLS``), one process, float32,
    the whole grid, timed in interleaved rounds as the single process is."""
    assert not dist.is_initialized()
    impls = [(impl, None) for impl in PATH_IMPLS.values()]
    warm = argparse.Namespace(**{**vars(args), "iters": SINGLE_ITERS_FACTOR * args.iters})
    rows = []
    for batch, hidden in progress([(b, h) for b in args.batch for h in args.hidden],
                                  desc="syncbn benchmark, each path"):
        rows += run_case(0, 1, device, impls, batch, hidden, "float32", warm, setting=PATHS)
    return rows


# --------------------------------------------------------------------------- ratios, targets, attribution




# --------------------------------------------------------------------------- report


def header(env: dict, args) -> str:
    """The environment and how the times were taken, printed before measuring."""
    oversub = oversubscribed(env["world_size"], env["device"])
    return (f"{format_environment(env)}\n"
            f"* {args.iters} iterations per implementation and size ({SINGLE_ITERS_FACTOR}x as many with one process "
            f"and warm caches) in {args.rounds} interleaved rounds; "
            "times are medians of the per-iteration maximum over ranks; [torch]: torch.distributed's all_reduce, "
            "[shared_memory]: this host's shared memory"
            + ("; OVERSUBSCRIBED (more processes than cores): timings say little" if oversub else ""))


# --------------------------------------------------------------------------- entry points


def worker(ctx, args) -> list[dict]:
    """One of the workers: the whole grid on every transport (``run``); no rows with --settings single."""
    for batch in args.batch:
        if batch % ctx.world_size:
            raise ValueError(f"--batch {batch} is not divisible by the {ctx.world_size} workers")
    return run(ctx, args) if WORKERS in args.settings else []


def measured_here(args, device: torch.device) -> list[dict]:
    """With --settings single: one process with no process group (``run_single_process``); with --settings paths,
    the synchronized path on each of syncbn's paths (``run_paths``)."""
    return ((run_single_process(device, args) if "single" in args.settings else [])
            + (run_paths(device, args) if "paths" in args.settings and device.type == "cpu" else []))


def complete(rows: list[dict], env: dict, args) -> list[dict]:
    """The measured rows, then the ratios, the targets and the bounds derived from them."""
    time_rows = [r for r in rows if r["kind"] in ("time", "breakdown", "phases")]
    ratio_rows = ratios(time_rows)
    return time_rows + ratio_rows + targets(ratio_rows, time_rows) + bounds(ratio_rows)


def time_budget(args, world_size: int) -> float:
    """A generous bound on the workers' whole run: the process-group timeout catches a stuck peer much sooner."""
    return 600 + 0.1 * args.iters * len(args.batch) * len(args.hidden) * len(args.dtypes)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2,
                        help="processes to spawn when not under torchrun (default: %(default)s)")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64],
                        help="global batch sizes (default: %(default)s)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="numbers of channels (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                        help="input dtypes timed with the workers: float32 on every transport, the others on the one "
                             f"'auto' picks; targets judge {' and '.join(JUDGED)}; parameters stay float32 (default: "
                             "%(default)s)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per implementation, transport and "
                        f"size, {SINGLE_ITERS_FACTOR}x as many with one process (default: {NORMAL['iters']}; "
                        f"{QUICK['iters']} with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds the iterations are split into "
                        f"(default: {NORMAL['rounds']}; {QUICK['rounds']} with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations before the first round "
                        f"(default: {NORMAL['warmup']}; {QUICK['warmup']} with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default: %(default)s)")
    parser.add_argument("--settings", nargs="+", choices=[WORKERS, "single", "paths"], default=[WORKERS, "single"],
                        help="what to time: the spawned workers (on every transport: torch.distributed, and shared "
                             "memory when they share a CPU host), one process without a process group, and/or (on "
                             "the CPU, on request) the synchronized path without collectives on each of syncbn.PATHS "
                             "(default: %(default)s)")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also time syncbn.py as of this git revision, as 'ours@REV', on every transport; a "
                             "revision whose SyncBatchNorm takes transport= (default: none)")
    parser.add_argument("--transports", nargs="+", type=transport_choice.argument, choices=transport_choice.choices(),
                        default=list(TRANSPORTS), metavar="NAME",
                        help="what the synchronized layers sum through, by the registry's names ("
                             + ", ".join(transport_choice.choices()) + "); shared memory only where the workers share "
                             "a CPU host (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="a fast run: the --quick defaults above; flags given explicitly win (default: off)")
    add_common_args(parser)
    args = parse_checked(parser, argv)
    for key, value in (QUICK if args.quick else NORMAL).items():  # defaults only where no flag was given
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workers < 1 or args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--workers, --iters, --rounds and --threads must be at least 1, --warmup at least 0")
    if args.rounds > args.iters:
        parser.error("--rounds must not exceed --iters")
    return args


def main(args) -> list[dict]:
    """Measure, print and write (``BENCHMARK``); without torchrun, a --batch that does not split over the
    --workers to spawn is refused first."""
    if "RANK" not in os.environ:
        for batch in args.batch:
            if batch % args.workers:
                sys.exit(f"error: --batch {batch} is not divisible by --workers {args.workers}")
    return harness.run(BENCHMARK, args)


# Under torchrun this process is one of the workers; without it, --workers processes are spawned. The rows of one
# process without a process group are measured afterwards in this process (rank 0's under torchrun). The results
# file names its one process count in world_size alone, as it always has (no procs).
BENCHMARK = harness.Benchmark(
    "syncbn_benchmark", worker, world_sizes=lambda args: [args.workers] if WORKERS in args.settings else [],
    report=report, timeout_s=time_budget, config_leaves_out=(), threads=lambda args: args.threads,
    local=measured_here, complete=complete, header=header,
    environment=lambda env, args: {k: v for k, v in env.items() if k != "procs"},
    # Every implementation sums in buffers its transport allocated: the report reads [shared_memory] rows as
    # zero copy from this key (files written before it summed tensors the layer made: staged).
    config_adds=lambda args: {"sums": "zero copy"})


if __name__ == "__main__":
    main(parse_args())
