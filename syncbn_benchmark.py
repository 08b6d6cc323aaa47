"""Time and memory of synchronized BatchNorm, forward + backward, ours against PyTorch.

    python syncbn_benchmark.py                    # spawns 2 workers itself (gloo on CPU; nccl when GPUs are visible)
    python syncbn_benchmark.py --quick            # the same grid with fewer iterations
    python syncbn_benchmark.py --baseline main    # also times syncbn.py as of a git revision: the A/B of a change
    torchrun --standalone --nproc_per_node 2 syncbn_benchmark.py --json results/syncbn.json

The homework's setup: a global batch of B samples split evenly over the workers, H channels,
standard normal inputs, loss = sum of the outputs over the first B/2 samples of the global
batch (with 2 workers rank 1's upstream gradient is zero; it still joins both collectives).
One iteration = forward + backward; inputs are made before the timed region; a barrier
precedes every iteration, which counts as long as its slowest rank. Implementations take
turns in interleaved rounds (the order rotated each round), so a change in the machine's
load hits them alike, and each ratio is the median of per-round ratios of round medians
with a 95 % bootstrap interval over rounds (``measure.paired_ratio``); a target is met when
the whole interval is at or below it, missed when it is all above, else inconclusive.

Implementations: ``ours`` (``syncbn.SyncBatchNorm``; with the workers on one host it sums through
shared memory, ``syncbn._sum_across``); ``BatchNorm1d (local)`` with no communication;
``BatchNorm1d + 2 all_reduce`` of 2C + 1 float32 values (after forward and after backward) with
``torch.distributed.all_reduce``: the cost of a synchronized BatchNorm with the communication it
cannot avoid, as the issue defines it, the reference on the CPU, where ``torch.nn.SyncBatchNorm``
refuses to run; ``BatchNorm1d + 2 shared-memory all_reduce`` (CPU, workers on one host): the same
with the communication ours uses (``allreduce.shared_memory_allreduce``), so that its ratio is what
the layer costs beyond BatchNorm and communication alike; beside it (same condition) the ``floor``:
BatchNorm's own kernels inside a Python ``torch.autograd.Function`` that makes the same two sums
where a synchronized layer must, the least any layer written that way can cost (``_FloorFunction``;
ours / floor and floor / that reference are printed as bounds, without targets); on CUDA
``torch.nn.SyncBatchNorm`` too. float32 rows carry the targets, against both references;
float16/bfloat16 rows (float32 parameters) are for information. The single-process rows run in the
launching process, with no process group: there the layer is ``F.batch_norm`` itself, and a third
row times ``SyncBatchNormFunction`` without its collectives (what the synchronized layer computes
beyond BatchNorm's kernels; with ``--baseline``, the same at the given revision). On the CPU, at
the smallest and the largest size, that row and ``BatchNorm1d (local)`` run once more with cold
caches (``COLD``: 16 MiB written before every iteration, untimed), as the work after a collective
finds them. Peak memory (``measure.PeakMemory``) and bytes saved for backward
(``measure.saved_tensor_bytes``) come from separate untimed passes; a per-operator profile of one
forward + backward (``measure.op_breakdown``) shows where the time goes, and with the workers one
iteration cut at its two collectives (``phases``) shows the compute between them apart from the
waiting.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import allreduce
from dist_utils import add_common_args, distributed, launch, progress, resolve_backend
from measure import (PeakMemory, format_ratio, gather_rows, op_breakdown, oversubscribed, paired_ratio, percentile,
                     saved_tensor_bytes, synchronize, time_iterations, verdict)
from results import environment, format_environment, markdown_table, write_results
import syncbn
from syncbn import SyncBatchNorm

OURS, LOCAL, REFERENCE, TORCH_SYNC = "ours", "BatchNorm1d (local)", "BatchNorm1d + 2 all_reduce", "torch.nn.SyncBatchNorm"
# The reference with the communication ours uses when the workers share a host (CPU).
SHARED_REFERENCE = "BatchNorm1d + 2 shared-memory all_reduce"
# The least a synchronized BatchNorm written as a Python autograd.Function pays with that communication (_FloorFunction).
FLOOR = "floor: BatchNorm in a Python Function + 2 shared-memory sums"
# With one process the layer is F.batch_norm; this row times the synchronized computation without its collectives.
SYNC_PATH = "ours, synchronized path without collectives"
WORKERS, SINGLE = "workers", "1 process"  # settings: the spawned group, and one process without a process group
# A third setting, one process again, with a core's own caches emptied before every iteration (``_evictor``): the
# state a collective leaves them in for the work after it. It separates the cold caches from the shared cores.
COLD = "1 process, cold caches"
EVICT_BYTES = 16 << 20  # written before each COLD iteration: several times a core's own caches (L1 and L2)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CPU targets (float32, 2 workers): ours / (BatchNorm1d + 2 all_reduce) per size and as the median over the
# grid; ours / BatchNorm1d with one process. CUDA: ours / torch.nn.SyncBatchNorm.
CPU_TARGET, TARGET_GRID, TARGET_SINGLE, TARGET_CUDA = 1.3, 1.15, 1.2, 1.0
# Bounds (the floor, CPU workers on one host), printed as medians over the grid without targets: what ours costs
# beyond the floor, and what the floor costs beyond BatchNorm1d and the same two sums made outside autograd.
BOUNDS = ((WORKERS, OURS, FLOOR, None), (WORKERS, FLOOR, SHARED_REFERENCE, None))
PROFILE_ITERS = 20
# One process times this many times --iters (warm caches): its iterations are a few tens of microseconds, several
# times shorter than the workers', and their ratios to BatchNorm1d's need more of them to settle.
SINGLE_ITERS_FACTOR = 8
PHASE_ITERS = 200
# One iteration with two collectives, cut where the caller blocks on each: what runs around them, how long each waits.
PHASES = ("compute before", "forward all_reduce", "compute between", "backward all_reduce", "compute after")
NORMAL = {"iters": 2000, "rounds": 40, "warmup": 20}
QUICK = {"iters": 96, "rounds": 12, "warmup": 5}


# --------------------------------------------------------------------------- one case


def _load_baseline(revision: str):
    """``syncbn.py`` as of a git revision, imported as a separate module (for an A/B in the same run)."""
    source = subprocess.run(["git", "show", f"{revision}:syncbn.py"], capture_output=True, text=True, check=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="syncbn_baseline_"), "syncbn_baseline.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("syncbn_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _WithoutCollectives(SyncBatchNorm):
    """SyncBatchNorm's Function with no group: all of its work but the two sums across ranks."""

    def __init__(self, hidden: int, function):
        super().__init__(hidden)
        self.function = function

    def forward(self, x):
        return self.function.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                   self.momentum, None)


class _FloorFunction(torch.autograd.Function):
    """A timing device, not a layer: what any synchronized BatchNorm written as a Python autograd.Function
    (``syncbn.SyncBatchNormFunction``, ``torch.nn.SyncBatchNorm``'s) pays at least with shared-memory sums.

    BatchNorm's own fused kernels (``native_batch_norm`` in training mode, which also updates the running
    statistics, and its backward), with a sum across ranks of 2C + 1 float64 values inside forward and of 2C
    inside backward, where a synchronized layer must make them: before the output exists, and before the input
    gradient does. It normalizes with the local batch's statistics and sends zeros (buffers made once, outside
    the timed region). Ours does this and the synchronisation's own arithmetic (packing, the float64
    combination, the global terms of dx): ours / floor is that arithmetic's price; floor / (BatchNorm1d + 2
    shared-memory all_reduce) is what the Function and the sums' place in the graph cost, which no layer of
    this design goes below.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, sums):
        y, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
        allreduce.shared_memory_allreduce(sums[0], "sum")  # (2C + 1,) float64: the forward's statistics
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.eps, ctx.sums = eps, sums
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        grads = torch.ops.aten.native_batch_norm_backward(dy, x, weight, None, None, mean, invstd, True, ctx.eps,
                                                          list(ctx.needs_input_grad[:3]))
        allreduce.shared_memory_allreduce(ctx.sums[1], "sum")  # (2C,) float64: the backward's two sums
        return (*grads, None, None, None, None, None)


class _Floor(torch.nn.BatchNorm1d):
    """BatchNorm1d's parameters and buffers through ``_FloorFunction`` (CPU, the workers on one host)."""

    def __init__(self, hidden: int):
        super().__init__(hidden)
        self.sums = (torch.zeros(2 * hidden + 1, dtype=torch.float64), torch.zeros(2 * hidden, dtype=torch.float64))

    def forward(self, x):
        return _FloorFunction.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                    self.momentum, self.sums)


def _make_layer(impl: str, hidden: int, device: torch.device, baseline=None) -> torch.nn.Module:
    module = baseline if "@" in impl else syncbn
    if impl == FLOOR:
        layer = _Floor(hidden)
    elif impl.startswith(SYNC_PATH):
        layer = _WithoutCollectives(hidden, module.SyncBatchNormFunction)
    elif impl.startswith(OURS):
        layer = module.SyncBatchNorm(hidden)
    elif impl == TORCH_SYNC:
        layer = torch.nn.SyncBatchNorm(hidden)
    else:
        layer = torch.nn.BatchNorm1d(hidden)
    return layer.to(device).train()


def _make_step(impl: str, layer: torch.nn.Module, x: torch.Tensor, loss_rows: int) -> Callable[[], None]:
    """One iteration: forward, the homework's loss over this rank's share of the first B/2 samples, backward."""
    if impl not in (REFERENCE, SHARED_REFERENCE) or not dist.is_initialized():
        def step():
            x.grad = None
            layer(x)[:loss_rows].sum().backward()
        return step

    # BatchNorm's own work plus the two collectives a synchronized BatchNorm cannot avoid.
    channels = x.size(1)
    forward_stats, backward_stats = (torch.zeros(2 * channels + 1, device=x.device) for _ in range(2))
    if impl == REFERENCE:
        def total(t):
            dist.all_reduce(t)
    else:
        def total(t):
            allreduce.shared_memory_allreduce(t, "sum")

    def reference_step():
        x.grad = None
        y = layer(x)
        total(forward_stats)
        y[:loss_rows].sum().backward()
        total(backward_stats)
    return reference_step


def _local_input(rank: int, world: int, batch: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    """This rank's rows of the global (batch, hidden) input, and how many of them are in the first batch/2."""
    local = batch // world
    generator = torch.Generator().manual_seed(1000 * rank + hidden + batch)
    x = torch.randn(local, hidden, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    return x, max(0, min(local, batch // 2 - rank * local))


def _memory(step: Callable[[], None], layer: torch.nn.Module, x: torch.Tensor, device: torch.device) -> tuple[int, int]:
    """(peak bytes of one iteration, bytes saved for backward by one forward); maxima over ranks.

    The peak is the least of 3 iterations' (``measure.PeakMemory`` on the CPU can only overstate)."""
    step()  # warm: first-call allocations (e.g. cached constants) are not the steady state
    peaks = []
    for _ in range(3):
        with PeakMemory(device) as peak:
            step()
        peaks.append(peak.bytes)
    saved = saved_tensor_bytes(lambda: layer(x))
    most = gather_rows([min(peaks), saved]).max(dim=0).values  # ranks differ (rank 0 holds the loss rows)
    return int(most[0]), int(most[1])


def run_case(rank: int, world: int, device: torch.device, impls: list[str], batch: int, hidden: int,
             dtype_name: str, args, baseline=None, setting: str | None = None, setup=None) -> list[dict]:
    """Every implementation on one (batch, hidden, dtype), timed in interleaved rounds; one row each.

    ``setup`` runs before every iteration, outside the timed region; ``setting`` labels the rows
    (default: WORKERS with a process group, else SINGLE)."""
    x, loss_rows = _local_input(rank, world, batch, hidden, DTYPES[dtype_name], device)
    layers = {impl: _make_layer(impl, hidden, device, baseline) for impl in impls}
    steps = {impl: _make_step(impl, layers[impl], x, loss_rows) for impl in impls}
    per_round = max(1, args.iters // args.rounds)
    samples: dict[str, list[list[float]]] = {impl: [] for impl in impls}
    for round_ in range(args.rounds):
        shift = round_ % len(impls)
        for impl in impls[shift:] + impls[:shift]:
            timing = time_iterations(steps[impl], per_round, warmup=args.warmup if round_ == 0 else 2, device=device,
                                     setup=setup)
            samples[impl].append(timing.samples)  # per iteration, the slowest rank's time
    rows = []
    for impl in impls:
        flat = [t for r in samples[impl] for t in r]
        peak, saved = _memory(steps[impl], layers[impl], x, device)
        rows.append({"kind": "time", "impl": impl, "setting": setting or (WORKERS if world > 1 else SINGLE),
                     "dtype": dtype_name, "device": device.type, "batch": batch, "hidden": hidden, "workers": world,
                     "local_batch": x.size(0), "iters": len(flat), "rounds": args.rounds,
                     "time_s": float(np.median(flat)), "p10_s": percentile(flat, 10), "p90_s": percentile(flat, 90),
                     **{f"round_p{q}_s": [percentile(r, q) for r in samples[impl]] for q in (10, 50, 90)},
                     "peak_bytes": peak, "saved_bytes": saved})
    return rows


def breakdown(rank: int, world: int, device: torch.device, impls: list[str], batch: int, hidden: int) -> list[dict]:
    """Per-operator CPU time of one forward + backward (profiled, rank 0's), ours against BatchNorm1d."""
    x, loss_rows = _local_input(rank, world, batch, hidden, torch.float32, device)
    rows = []
    for impl in impls:
        step = _make_step(impl, _make_layer(impl, hidden, device), x, loss_rows)
        step()
        profile = op_breakdown(step, PROFILE_ITERS, top=12, device=device)
        rows.append({"kind": "breakdown", "impl": impl, "setting": WORKERS if world > 1 else SINGLE,
                     "dtype": "float32", "device": device.type, "batch": batch, "hidden": hidden, "workers": world,
                     "iters": PROFILE_ITERS, "ops": profile["ops"], "top_self_s": sum(o["self_s"] for o in profile["ops"])})
    return rows


@contextlib.contextmanager
def _stamped_collectives(stamps: list[float], device: torch.device):
    """Append the clock before and after the caller is blocked on each ``torch.distributed.all_reduce`` or
    ``allreduce.shared_memory_allreduce`` (ours and the references call one of them) to ``stamps``: around the
    call itself, or for ``async_op=True`` around the ``wait()`` of the work it returns (what runs in between
    is the caller's, overlapped). On a GPU the device is synchronised first, so a stamp means the work is done."""
    real, real_shared = dist.all_reduce, allreduce.shared_memory_allreduce

    def blocked(call):
        synchronize(device)
        stamps.append(time.perf_counter())
        result = call()
        synchronize(device)
        stamps.append(time.perf_counter())
        return result

    def stamped(*args, **kwargs):
        if not kwargs.get("async_op"):
            return blocked(lambda: real(*args, **kwargs))
        work = real(*args, **kwargs)
        return _StampedWork(work, lambda *a, **k: blocked(lambda: work.wait(*a, **k)))
    with mock.patch.object(dist, "all_reduce", stamped), \
            mock.patch.object(allreduce, "shared_memory_allreduce", lambda *a, **k: blocked(lambda: real_shared(*a, **k))):
        yield


class _StampedWork:
    """A collective's work handle whose ``wait`` is stamped (see ``_stamped_collectives``)."""

    def __init__(self, work, wait):
        self._work, self.wait = work, wait

    def __getattr__(self, name):
        return getattr(self._work, name)


def _phase_medians(stamps: list[float], iters: int) -> np.ndarray:
    """The median duration of each of ``PHASES`` over the last ``iters`` iterations (earlier ones: warm-up),
    then the median of the iterations' whole durations (not the sum of the phases' medians: the phases
    of one iteration are not independent, and the sum of their medians understates it).

    ``stamps`` holds, per iteration, its start, the start and end of each collective, and its end."""
    durations = np.diff(np.array(stamps).reshape(-1, len(PHASES) + 1)[-iters:], axis=1)
    return np.append(np.median(durations, axis=0), np.median(durations.sum(axis=1)))


def phases(rank: int, world: int, device: torch.device, impls: list[str], batch: int, hidden: int,
           iters: int) -> list[dict]:
    """Each implementation's iteration cut into ``PHASES`` (median seconds per phase, and of the whole
    iteration, each the maximum over ranks).

    The profiler charges a collective's wait to whatever called it (SyncBatchNormFunction's
    "self" time); this shows the compute between the collectives apart from the waiting.
    """
    x, loss_rows = _local_input(rank, world, batch, hidden, torch.float32, device)
    rows = []
    for impl in impls:
        step, stamps = _make_step(impl, _make_layer(impl, hidden, device), x, loss_rows), []

        def stamped_step():
            stamps.append(time.perf_counter())
            step()
            synchronize(device)
            stamps.append(time.perf_counter())
        with _stamped_collectives(stamps, device):
            time_iterations(stamped_step, iters, warmup=2, device=device)
        *slowest, iteration = map(float, gather_rows(list(_phase_medians(stamps, iters))).max(dim=0).values)
        rows.append({"kind": "phases", "impl": impl, "setting": WORKERS, "dtype": "float32", "device": device.type,
                     "batch": batch, "hidden": hidden, "workers": world, "iters": iters,
                     "phases_s": dict(zip(PHASES, slowest)), "iteration_s": iteration})
    return rows


def implementations(device: torch.device, baseline: str | None, shared: bool = False) -> list[str]:
    """The timed implementations; ``shared``: the workers share this host's memory (a collective to find out)."""
    impls = [OURS, LOCAL, REFERENCE] + ([SHARED_REFERENCE, FLOOR] if shared else []) \
        + ([TORCH_SYNC] if device.type == "cuda" else [])
    return impls + ([f"{OURS}@{baseline}"] if baseline else [])


def run(ctx, args) -> list[dict]:
    """Every rank runs the whole grid; returns the rows (the same on every rank: times are maxima over ranks)."""
    torch.set_num_threads(args.threads)
    baseline = _load_baseline(args.baseline) if args.baseline else None
    shared = ctx.device.type == "cpu" and allreduce.shares_memory()
    impls = implementations(ctx.device, args.baseline, shared)
    references = [REFERENCE] + ([SHARED_REFERENCE] if shared else [])
    cases = [(d, b, h) for d in args.dtypes for b in args.batch for h in args.hidden]
    rows = []
    for dtype_name, batch, hidden in progress(cases, desc="syncbn benchmark, workers"):
        rows += run_case(ctx.rank, ctx.world_size, ctx.device, impls, batch, hidden, dtype_name, args, baseline)
    for batch, hidden in _profiled_sizes(args):
        rows += breakdown(ctx.rank, ctx.world_size, ctx.device, [OURS, LOCAL, *references], batch, hidden)
        rows += phases(ctx.rank, ctx.world_size, ctx.device, [OURS, *references] + ([FLOOR] if shared else []),
                       batch, hidden, PHASE_ITERS)
    return rows


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
    torch.set_num_threads(args.threads)
    baseline = _load_baseline(args.baseline) if args.baseline else None
    impls = [OURS, LOCAL, SYNC_PATH] + ([f"{SYNC_PATH}@{args.baseline}"] if args.baseline else [])
    warm = argparse.Namespace(**{**vars(args), "iters": SINGLE_ITERS_FACTOR * args.iters})
    rows = []
    for batch, hidden in progress([(b, h) for b in args.batch for h in args.hidden], desc="syncbn benchmark, 1 process"):
        rows += run_case(0, 1, device, impls, batch, hidden, "float32", warm, baseline)
    for batch, hidden in _profiled_sizes(args):
        if device.type == "cpu":
            rows += run_case(0, 1, device, [LOCAL, SYNC_PATH], batch, hidden, "float32", args, setting=COLD,
                             setup=_evictor(device))
        rows += breakdown(0, 1, device, [OURS, LOCAL, SYNC_PATH], batch, hidden)
    return rows


def _profiled_sizes(args) -> list[tuple[int, int]]:
    """The smallest and the largest size of the grid."""
    return sorted({(min(args.batch), min(args.hidden)), (max(args.batch), max(args.hidden))})


# --------------------------------------------------------------------------- ratios and targets


def _times(rows: list[dict], impl: str, setting: str, dtype: str) -> dict[tuple[int, int], dict]:
    return {(r["batch"], r["hidden"]): r for r in rows
            if r["kind"] == "time" and r["impl"] == impl and r["setting"] == setting and r["dtype"] == dtype}


def ratios(rows: list[dict]) -> list[dict]:
    """One row per (setting, dtype, size, comparison): the paired ratio of round medians, and a verdict when
    it carries a target (float32 only)."""
    device = rows[0]["device"]
    comparisons = [(WORKERS, OURS, REFERENCE, CPU_TARGET if device == "cpu" else None),
                   (WORKERS, OURS, SHARED_REFERENCE, CPU_TARGET), (WORKERS, OURS, LOCAL, None),
                   *BOUNDS,
                   (SINGLE, OURS, LOCAL, TARGET_SINGLE), (SINGLE, SYNC_PATH, LOCAL, None), (COLD, SYNC_PATH, LOCAL, None)]
    if device == "cuda":
        comparisons.append((WORKERS, OURS, TORCH_SYNC, TARGET_CUDA))
    # --baseline: the A/B of a change, ours now against ours at the given revision.
    for impl in dict.fromkeys(r["impl"] for r in rows):
        if "@" in impl:
            comparisons.append((WORKERS if impl.startswith(OURS + "@") else SINGLE, impl.split("@")[0], impl, None))
    out = []
    for setting, mine, versus, limit in comparisons:
        for dtype in sorted({r["dtype"] for r in rows if r["kind"] == "time" and r["setting"] == setting}):
            ours, theirs = _times(rows, mine, setting, dtype), _times(rows, versus, setting, dtype)
            for key in sorted(set(ours) & set(theirs)):
                ratio = paired_ratio(ours[key]["round_p50_s"], theirs[key]["round_p50_s"])
                target = limit if dtype == "float32" else None
                out.append({"kind": "ratio", "impl": mine, "versus": versus, "setting": setting, "dtype": dtype,
                            "device": device, "batch": key[0], "hidden": key[1], **ratio, "target": target,
                            "verdict": None if target is None else verdict(ratio, target),
                            "saved_ratio": ours[key]["saved_bytes"] / theirs[key]["saved_bytes"],
                            "peak_ratio": ours[key]["peak_bytes"] / max(1, theirs[key]["peak_bytes"])})
    return out


def _grid_ratio(entries: list[dict]) -> dict:
    """The median over the grid, round by round (round r of every size), summarised like one paired ratio."""
    per_round = np.median(np.array([e["per_round"] for e in entries]), axis=0)
    ratio = paired_ratio(list(per_round), [1.0] * len(per_round))
    return {**ratio, "sizes": len(entries)}


def targets(ratio_rows: list[dict], time_rows: list[dict]) -> list[dict]:
    """The issue's targets, each with its verdict (float32)."""
    out = []
    for setting, versus in dict.fromkeys((r["setting"], r["versus"]) for r in ratio_rows if r["target"] is not None):
        entries = [r for r in ratio_rows if r["setting"] == setting and r["versus"] == versus and r["target"]
                   and r["impl"] == OURS]
        limit = entries[0]["target"]
        verdicts = [e["verdict"] for e in entries]
        worst = "missed" if "missed" in verdicts else ("inconclusive" if "inconclusive" in verdicts else "met")
        out.append({"kind": "target", "name": f"{setting}: every size, ours / ({versus}) <= {limit}",
                    "setting": setting, "versus": versus, "limit": limit, "verdict": worst,
                    "sizes_met": verdicts.count("met"), "sizes": len(entries)})
        if setting == WORKERS and versus in (REFERENCE, SHARED_REFERENCE):
            grid = _grid_ratio(entries)
            out.append({"kind": "target", "name": f"{setting}: median over the grid, ours / ({versus}) <= {TARGET_GRID}",
                        "setting": setting, "versus": versus, "limit": TARGET_GRID, **grid,
                        "verdict": verdict(grid, TARGET_GRID)})
    for what in ("saved_bytes", "peak_bytes"):
        for setting in sorted({r["setting"] for r in time_rows if r["kind"] == "time"}):
            ours, local = _times(time_rows, OURS, setting, "float32"), _times(time_rows, LOCAL, setting, "float32")
            if not ours:  # COLD times the synchronized path only
                continue
            worse = [key for key in ours if key in local and ours[key][what] > local[key][what]]
            out.append({"kind": "target", "name": f"{setting}: {what} of ours <= BatchNorm1d's at every size",
                        "setting": setting, "limit": 1.0, "verdict": "missed" if worse else "met",
                        "sizes": len(ours), "sizes_met": len(ours) - len(worse)})
    return out


def bounds(ratio_rows: list[dict]) -> list[dict]:
    """The median over the grid of each of ``BOUNDS`` the rows hold (float32), without a target."""
    out = []
    for setting, mine, versus, _ in BOUNDS:
        entries = [r for r in ratio_rows if (r["setting"], r["impl"], r["versus"], r["dtype"]) ==
                   (setting, mine, versus, "float32")]
        if entries:
            out.append({"kind": "bound", "name": f"{setting}: median over the grid, {mine} / ({versus})",
                        "setting": setting, "impl": mine, "versus": versus, **_grid_ratio(entries)})
    return out


# --------------------------------------------------------------------------- report


RATIO_COLUMNS = [("setting", "setting", "s"), ("dtype", "dtype", "s"), ("batch", "batch", "d"),
                 ("hidden", "hidden", "d"), ("text", "ratio [95 % CI]", "s"), ("target", "target", "s"),
                 ("verdict", "verdict", "s"), ("saved_ratio", "saved ratio", ".2f"),
                 ("peak_ratio", "peak ratio", ".2f")]


def _time_table(rows: list[dict], setting: str, dtype: str) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["kind"] == "time" and r["setting"] == setting
                               and r["dtype"] == dtype))
    by_impl = {impl: _times(rows, impl, setting, dtype) for impl in impls}
    table = []
    for key in sorted(by_impl[impls[0]]):
        entry = {"batch": key[0], "hidden": key[1]}
        for impl in impls:
            entry[impl] = 1e3 * by_impl[impl][key]["time_s"]
            entry[impl + " peak"] = by_impl[impl][key]["peak_bytes"] / 1024
        table.append(entry)
    columns = [("batch", "batch", "d"), ("hidden", "hidden", "d")]
    columns += [(impl, f"{impl} (ms)", ".3f") for impl in impls]
    columns += [(impl + " peak", f"{impl} peak (KiB)", ".0f") for impl in impls]
    return markdown_table(table, columns)


def _breakdown_text(rows: list[dict]) -> list[str]:
    lines = []
    for row in (r for r in rows if r["kind"] == "breakdown"):
        ops = ", ".join(f"{o['op']} {1e6 * o['self_s']:.1f}us x{o['calls']:g}" for o in row["ops"])
        lines.append(f"  {row['setting']}, {row['batch']}x{row['hidden']}, {row['impl']}: top operators "
                     f"{1e6 * row['top_self_s']:.0f} us self CPU per iteration: {ops}")
    return lines


def _phases_table(rows: list[dict]) -> str:
    table = [{"size": f"{r['batch']}x{r['hidden']}", "impl": r["impl"], "iteration": 1e6 * r["iteration_s"],
              **{p: 1e6 * s for p, s in r["phases_s"].items()}} for r in rows if r["kind"] == "phases"]
    return markdown_table(table, [("size", "size", "s"), ("impl", "implementation", "s")]
                          + [(p, f"{p} (us)", ".0f") for p in PHASES] + [("iteration", "iteration (us)", ".0f")])


def report(rows: list[dict], env: dict, config: dict) -> None:
    print(format_environment(env))
    oversub = oversubscribed(env["world_size"], env["device"])
    print(f"* {config['iters']} iterations per implementation and size ({SINGLE_ITERS_FACTOR}x as many with one process "
          f"and warm caches) in {config['rounds']} interleaved rounds; "
          "times are medians of the per-iteration maximum over ranks" + ("; OVERSUBSCRIBED (more processes than "
                                                                         "cores): timings say little" if oversub else ""))
    for setting in (WORKERS, SINGLE, COLD):
        for dtype in DTYPES:
            if any(r["kind"] == "time" and r["setting"] == setting and r["dtype"] == dtype for r in rows):
                print(f"\n{setting}, {dtype}: median time per iteration and peak memory\n{_time_table(rows, setting, dtype)}")
    ratio_rows = [{**r, "text": format_ratio(r), "target": "-" if r["target"] is None else f"<= {r['target']}",
                   "verdict": r["verdict"] or "-"} for r in rows if r["kind"] == "ratio"]
    for mine, versus in dict.fromkeys((r["impl"], r["versus"]) for r in ratio_rows):
        table = [r for r in ratio_rows if r["impl"] == mine and r["versus"] == versus]
        print(f"\n{mine} / {versus}\n{markdown_table(table, RATIO_COLUMNS)}")
    print("\nWhere the time goes (profiled, self CPU time per iteration):")
    print("\n".join(_breakdown_text(rows)))
    if any(r["kind"] == "phases" for r in rows):
        print(f"\n{WORKERS}: one iteration cut at its two collectives (median per phase, slowest rank)\n"
              f"{_phases_table(rows)}")
    if any(r["kind"] == "bound" for r in rows):
        print("\nBounds (no target):")
        for b in (r for r in rows if r["kind"] == "bound"):
            print(f"  {b['name']}: {format_ratio(b)}")
    print("\nTargets:")
    for t in (r for r in rows if r["kind"] == "target"):
        detail = f" ({format_ratio(t)})" if "median" in t else f" ({t['sizes_met']} of {t['sizes']} sizes)"
        print(f"  {t['name']}: {t['verdict'].upper()}{detail}")


# --------------------------------------------------------------------------- entry points


def _worker(ctx, args):
    rows = run(ctx, args)
    return rows if ctx.is_master else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2,
                        help="processes to spawn when not under torchrun (default: %(default)s)")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64], help="global batch sizes (default: %(default)s)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="numbers of channels (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                        help="input dtypes timed with the workers; parameters stay float32 (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per implementation and size, "
                        f"{SINGLE_ITERS_FACTOR}x as many with one process (default: {NORMAL['iters']}; {QUICK['iters']} "
                        "with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds the iterations are split into "
                        f"(default: {NORMAL['rounds']}; {QUICK['rounds']} with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations before the first round "
                        f"(default: {NORMAL['warmup']}; {QUICK['warmup']} with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default: %(default)s)")
    parser.add_argument("--settings", nargs="+", choices=[WORKERS, "single"], default=[WORKERS, "single"],
                        help="what to time: the spawned workers, and/or one process without a process group "
                             "(default: %(default)s)")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also time syncbn.py as of this git revision, as 'ours@REV' (default: none)")
    parser.add_argument("--quick", action="store_true",
                        help="a fast run: the --quick defaults above; flags given explicitly win (default: off)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else NORMAL).items():  # defaults only where no flag was given
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workers < 1 or args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--workers, --iters, --rounds and --threads must be at least 1, --warmup at least 0")
    if args.rounds > args.iters:
        parser.error("--rounds must not exceed --iters")
    return args


def main(args) -> None:
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        with distributed(args.backend, args.timeout) as ctx:
            for batch in args.batch:
                if batch % ctx.world_size:
                    raise ValueError(f"--batch {batch} is not divisible by the {ctx.world_size} workers")
            rows = run(ctx, args) if WORKERS in args.settings else []
            env = environment(ctx.backend, ctx.device, ctx.world_size, threads=args.threads)
        if ctx.is_master:
            if "single" in args.settings:
                rows += run_single_process(ctx.device, args)
            finish(rows, env, args)
        return
    backend = resolve_backend(args.backend)
    for batch in args.batch:
        if batch % args.workers:
            sys.exit(f"error: --batch {batch} is not divisible by --workers {args.workers}")
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    # Generous bound on the whole run: the process-group timeout catches a stuck peer much sooner.
    budget = 600 + 0.05 * args.iters * len(args.batch) * len(args.hidden) * len(args.dtypes)
    rows = []
    if WORKERS in args.settings:
        rows += launch(_worker, args.workers, args, backend=backend, timeout_s=budget, pg_timeout_s=args.timeout,
                       threads=args.threads)[0]
    if "single" in args.settings:
        rows += run_single_process(device, args)
    finish(rows, environment(backend, device, args.workers, threads=args.threads), args)


def finish(rows: list[dict], env: dict, args) -> None:
    time_rows = [r for r in rows if r["kind"] in ("time", "breakdown", "phases")]
    ratio_rows = ratios(time_rows)
    rows = time_rows + ratio_rows + targets(ratio_rows, time_rows) + bounds(ratio_rows)
    config = vars(args)
    report(rows, env, config)
    if args.json:
        write_results(args.json, "syncbn_benchmark", env, config, rows)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main(parse_args())
