"""All-reduce benchmark in the conventions of nccl-tests: torch.distributed.all_reduce beside every all-reduce of
allreduce.py (ring, butterfly, halving-doubling, recursive doubling, tree, shared memory, and ``auto``, the measured choice).

    torchrun --standalone --nproc_per_node 4 collectives_benchmark.py        # the world torchrun starts
    python collectives_benchmark.py --procs 2 4 --json results/collectives.json --plot-dir results/plots
    python collectives_benchmark.py --quick --plot-dir results/plots           # a few sizes, a few minutes
    python collectives_benchmark.py --tune                                      # re-derive allreduce.CROSSOVER
    python collectives_benchmark.py --from-json results/collectives.json --plot-dir results/plots
    python collectives_benchmark.py --collective reduce_scatter --procs 2 4 --sizes 10MB 100MB   # or all_gather

Backend gloo on CPU, nccl on GPU when one is present (``--backend``). Without torchrun the script
spawns each process count of ``--procs`` itself. For each size of a geometric sweep (float32; 1 MB
= 2^20 bytes as in nccl-tests; the smallest default, 4000 bytes, is the homework's 1,000 elements)
and each algorithm: warm-up calls, then timed calls (``--iters``, 4 times as many up to 1 MiB:
``calls``), each starting at a barrier with the input refilled outside the timed region; a call
takes as long as its slowest rank. The algorithms take turns call by call (A B C, then B C A,
...), so a change of machine load hits all of them alike, and each round gives one ratio to
torch's call of the same round: the ratio reported is the median over rounds with its 95 %
bootstrap interval (``measure.paired_ratio``).

Columns, as in nccl-tests: average time, p50 and p95; algbw = bytes / average time; busbw =
algbw x 2(n-1)/n, the bytes each rank must move in an all-reduce over the time; p50 / torch's
p50 with its interval; and the largest error of one untimed call on a pattern whose sum is exact
in float32 (any error at all is a bug, not rounding). Then the targets (``auto`` <= 1.10x torch at
every size, <= 1.00x at 10 and 100 MB) with met / missed / inconclusive, and the latency-bandwidth
model T = steps x alpha + bytes x beta fitted to every algorithm (``model_terms`` gives each one's
steps and bytes on the critical path).

``--tune`` times the point-to-point algorithms over a finer sweep and prints the crossover table
(the fastest algorithm by size, per process count) in the form of ``allreduce.CROSSOVER``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re

import numpy as np
import torch

import allreduce
from dist_utils import add_common_args, distributed, launch, print0, progress, resolve_backend
from measure import format_ratio, oversubscribed, paired_ratio, time_interleaved, verdict
from results import environment, format_environment, markdown_table, read_results, write_results

DEFAULT_SIZES = ["4000", "64KB", "1MB", "10MB", "100MB"]
QUICK = dict(sizes=["4000", "64KB", "1MB", "10MB"], procs=[2, 4], iters=10, warmup=2)
SMALL_BYTES, SMALL_CALLS = 1 << 20, 4  # messages up to 1 MiB: 4 times the timed calls (``calls``)
TUNE_SIZES = ["4000", "16KB", "64KB", "256KB", "1MB", "4MB", "16MB", "64MB"]
TUNE_PROCS = [2, 3, 4, 8]
UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
PERIOD = 1024  # the correctness pattern repeats every PERIOD elements
LARGE = (10 << 20, 100 << 20)
# (algorithm, sizes it applies to, largest p50 / torch's p50): the ring's target of the first all-reduce
# work, and auto's: within 10 % of torch from the homework's 1,000 elements up, no slower at 10 and 100 MB.
TARGET = 1.10
TARGETS = [("ring", LARGE, TARGET), ("auto", None, TARGET), ("auto", LARGE, 1.00)]
# The sharded collectives: gloo emulates reduce-scatter with a full all-reduce (twice the bytes of a ring
# reduce-scatter), so ours should be well under torch's time there; its all-gather is a real one.
COLLECTIVE_TARGETS = {"allreduce": TARGET, "reduce_scatter": 0.70, "all_gather": 1.10}


def parse_size(text: str) -> int:
    """'10MB' or '10MiB' -> 10 * 2**20 bytes (binary units, as nccl-tests); a bare number is bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)I?(B?)\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64KiB, 10MiB, 1GiB; KB = KiB)")
    return int(float(match.group(1)) * UNITS[match.group(2) + "B" if match.group(2) else ""])


def format_size(nbytes: int) -> str:
    """65536 -> '64KiB': binary units, written as such."""
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit[0]}iB"
    return f"{nbytes}B"


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
    expected = world_size * torch.arange(PERIOD, dtype=torch.float64, device=x.device) + world_size * (world_size - 1) / 2
    worst = 0.0
    for _, block in _blocks(x):
        full = block.numel() // PERIOD
        rows = block[:full * PERIOD].view(full, PERIOD).double() - expected
        tail = block[full * PERIOD:].double() - expected[:block.numel() - full * PERIOD]
        worst = max(worst, rows.abs().max().item() if full else 0.0, tail.abs().max().item() if tail.numel() else 0.0)
    return worst


# --------------------------------------------------------------------------- one world size


def _check(ctx, x: torch.Tensor, function) -> float:
    fill_pattern(x, ctx.rank)
    function(x, "sum")
    error = torch.tensor([pattern_error(x, ctx.world_size)], dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(error, torch.distributed.ReduceOp.MAX)  # the worst rank's error
    return error.item()


def _algorithm(name: str, pipeline: dict):
    """The all-reduce called ``name``; ring and halving-doubling with the given segment size and depth."""
    function = allreduce.ALGORITHMS[name]
    return functools.partial(function, **pipeline) if name in ("ring", "halving_doubling") else function


def bus_factor(world_size: int) -> float:
    """busbw / algbw for an all-reduce: each rank must send and receive 2(n-1)/n of the tensor (nccl-tests)."""
    return 2 * (world_size - 1) / world_size


def calls(nbytes: int, iters: int) -> int:
    """Timed calls (rounds) for one size: ``iters``, and SMALL_CALLS times as many for messages up to SMALL_BYTES.

    A call of up to 1 MiB lasts at most a few milliseconds here and varies from call to call by
    about as much (scheduling, wake-ups), so the few rounds that suit the large sizes leave a
    small size's ratio with a wide interval; its extra rounds cost little time.
    """
    return iters * SMALL_CALLS if nbytes <= SMALL_BYTES else iters


def benchmark_size(ctx, nbytes: int, algorithms: list[str], iters: int, warmup: int, pipeline: dict) -> list[dict]:
    """One size: a correctness call per algorithm, then timed calls taking turns (``calls``); the same rows on
    every rank."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
    errors = {name: _check(ctx, x, _algorithm(name, pipeline)) for name in algorithms}
    # Summing in place makes x grow n-fold per call: refill it (untimed) before each one. One call per
    # algorithm per round, so round r of every algorithm ran under the same load: paired ratios.
    rounds = calls(nbytes, iters)
    timings = time_interleaved({name: functools.partial(_algorithm(name, pipeline), x, "sum") for name in algorithms},
                               rounds, warmup, rounds=rounds, device=ctx.device, setup=functools.partial(x.fill_, 1.0))
    n, size = ctx.world_size, x.numel() * x.element_size()
    rows = []
    for name in algorithms:
        timing = timings[name]
        algbw = size / timing.mean / 1e9
        ratio = paired_ratio(timing.samples, timings["torch"].samples) if "torch" in timings else None
        rows.append({"backend": ctx.backend, "world_size": n, "algorithm": name, "bytes": size, "dtype": "float32",
                     "avg_s": timing.mean, "p50_s": timing.median, "p95_s": timing.percentile(95), "min_s": min(timing.samples),
                     "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(n),
                     "vs_torch": ratio["median"] if ratio else None, "vs_torch_ci_low": ratio["ci_low"] if ratio else None,
                     "vs_torch_ci_high": ratio["ci_high"] if ratio else None,
                     "rounds": len(timing.samples), "round_p50_s": timing.samples,  # one call per round
                     "oversubscribed": oversubscribed(n, ctx.device),
                     "choice": allreduce.auto_algorithm(x) if name == "auto" and n > 1 else None,
                     "max_abs_error": errors[name], "correct": errors[name] == 0.0})
    return rows


def benchmark_worker(ctx, sizes: list[int], algorithms: list[str], iters: int, warmup: int, pipeline: dict,
                     collective: str = "allreduce") -> list[dict]:
    """Every size and algorithm for this world (one spawned group, or the world torchrun started)."""
    rows = []
    for nbytes in progress(sizes, desc=f"{ctx.world_size} processes"):
        if collective == "allreduce":
            rows += [{**row, "collective": collective}
                     for row in benchmark_size(ctx, nbytes, algorithms, iters, warmup, pipeline)]
        else:
            rows += benchmark_sharded_size(ctx, collective, nbytes, algorithms, iters, warmup, pipeline)
    return rows


# --------------------------------------------------------------------------- reduce-scatter and all-gather


def sharded_implementations(collective: str) -> dict:
    """name -> f(output, input, [op,] group) for a sharded collective of allreduce.py."""
    return {"reduce_scatter": allreduce.REDUCE_SCATTERS, "all_gather": allreduce.ALL_GATHERS}[collective]


def _sharded_call(collective: str, name: str, pipeline: dict, full: torch.Tensor, shard: torch.Tensor):
    """A no-argument call of one implementation: full -> shard (reduce-scatter, summing) or shard -> full."""
    function = sharded_implementations(collective)[name]
    options = pipeline if name == "ring" else {}
    if collective == "reduce_scatter":
        return functools.partial(function, shard, full, "sum", **options)
    return functools.partial(function, full, shard, **options)


def _sharded_error(ctx, collective: str, call, full: torch.Tensor, shard: torch.Tensor) -> float:
    """One untimed call on the exact pattern, the largest error over all ranks and elements.

    Reduce-scatter: every rank's full tensor holds the pattern, the shards are gathered back (with
    torch) and compared with the pattern's sum. All-gather: rank r contributes chunk r of that sum."""
    n = ctx.world_size
    if collective == "reduce_scatter":
        fill_pattern(full, ctx.rank)
        call()
        torch.distributed.all_gather_single(full, shard)
    else:
        fill_pattern(full, 0)  # i mod PERIOD: times n plus n(n-1)/2 is the pattern's sum, exact in float32
        full.mul_(n).add_(n * (n - 1) / 2)
        shard.copy_(full.view(n, -1)[ctx.rank])
        full.zero_()
        call()
    error = torch.tensor([pattern_error(full, n)], dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(error, torch.distributed.ReduceOp.MAX)
    return error.item()


def benchmark_sharded_size(ctx, collective: str, nbytes: int, algorithms: list[str], iters: int, warmup: int,
                           pipeline: dict) -> list[dict]:
    """One size of reduce-scatter or all-gather, ``nbytes`` being the full tensor (rounded down to a
    multiple of the world size, as in nccl-tests); busbw = algbw x (n-1)/n, the share each rank sends."""
    n = ctx.world_size
    full = torch.empty(nbytes // 4 // n * n, dtype=torch.float32, device=ctx.device)
    shard = torch.empty(full.numel() // n, dtype=torch.float32, device=ctx.device)
    functions = {name: _sharded_call(collective, name, pipeline, full, shard) for name in algorithms}
    errors = {name: _sharded_error(ctx, collective, functions[name], full, shard) for name in algorithms}
    # Neither collective changes its input: no refill between calls.
    rounds = calls(nbytes, iters)
    timings = time_interleaved(functions, rounds, warmup, rounds=rounds, device=ctx.device)
    size = full.numel() * full.element_size()
    rows = []
    for name in algorithms:
        timing = timings[name]
        algbw = size / timing.mean / 1e9
        ratio = paired_ratio(timing.samples, timings["torch"].samples) if "torch" in timings else None
        rows.append({"backend": ctx.backend, "world_size": n, "collective": collective, "algorithm": name, "bytes": size,
                     "dtype": "float32", "avg_s": timing.mean, "p50_s": timing.median, "p95_s": timing.percentile(95),
                     "min_s": min(timing.samples), "algbw_gbps": algbw, "busbw_gbps": algbw * (n - 1) / n,
                     "vs_torch": ratio["median"] if ratio else None,
                     "vs_torch_ci_low": ratio["ci_low"] if ratio else None,
                     "vs_torch_ci_high": ratio["ci_high"] if ratio else None,
                     "rounds": len(timing.samples), "round_p50_s": timing.samples,
                     "oversubscribed": oversubscribed(n, ctx.device),
                     "max_abs_error": errors[name], "correct": errors[name] == 0.0})
    return rows


# --------------------------------------------------------------------------- the latency-bandwidth model


def model_terms(algorithm: str, n: int, nbytes: int) -> tuple[float, float]:
    """(dependent steps, bytes one rank moves on the critical path) of one all-reduce of ``nbytes`` on n ranks.

    The model is T = steps x alpha + bytes x beta: alpha the cost of one dependent message
    (software and wake-up latency), beta the seconds per byte (copying, adding, the transport).
    p is the largest power of two <= n; a world that is not one folds in with two extra steps
    of the whole tensor. Pipelined algorithms add one step per extra segment.
    """
    p = 1 << (n.bit_length() - 1)
    fold = 0 if n == p else 2
    log_p = p.bit_length() - 1
    if algorithm in ("ring", "torch"):  # gloo's all_reduce is a ring too
        segments = max(1, math.ceil(nbytes / n / allreduce.SEGMENT_BYTES)) if algorithm == "ring" else 1
        return 2 * (n - 1) + segments - 1, bus_factor(n) * nbytes
    if algorithm == "butterfly":  # n - 1 messages out and n - 1 back per phase, all posted at once
        return 2 * (n - 1), bus_factor(n) * nbytes
    if algorithm == "halving_doubling":
        return 2 * log_p + fold, (bus_factor(p) + fold) * nbytes
    if algorithm == "recursive_doubling":
        return log_p + fold, (log_p + fold) * nbytes
    if algorithm == "tree":  # up and down a heap of height h in k segments; an inner rank takes two per step
        height, k = n.bit_length() - 1, max(1, math.ceil(nbytes / allreduce.TREE_SEGMENT_BYTES))
        return 2 * (height + k - 1), 2 * (height + k - 1) / k * min(2, n - 1) * nbytes
    raise ValueError(f"no model for {algorithm!r}")


def fit_model(rows: list[dict]) -> list[dict]:
    """Least-squares alpha and beta (both >= 0) per (backend, world size, algorithm) from the measured p50s."""
    fits = []
    groups = sorted({(r["backend"], r["world_size"], r["algorithm"]) for r in rows
                     if r["algorithm"] in ("torch", *allreduce.CUSTOM)})  # auto is a mix of them: no model of its own
    for backend, n, name in groups:
        points = [r for r in rows if (r["backend"], r["world_size"], r["algorithm"]) == (backend, n, name)]
        if n < 2 or len(points) < 2:
            continue
        terms = np.array([model_terms(name, n, r["bytes"]) for r in points])
        times = np.array([r["p50_s"] for r in points])
        # Relative least squares (each row divided by its time): small sizes weigh as much as large ones.
        alpha, beta = _nonnegative_lstsq(terms / times[:, None], np.ones(len(times)))
        predicted = terms @ np.array([alpha, beta])
        fits.append({"backend": backend, "world_size": n, "algorithm": name, "alpha_s": alpha, "beta_s_per_byte": beta,
                     "gbps": 1e-9 / beta if beta > 0 else None,
                     "max_rel_error": float(np.max(np.abs(predicted - times) / times))})
    return fits


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """min |a x - b| over x >= 0 for two unknowns: the free solution, or the better one-term fit."""
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    if np.all(x >= 0):
        return float(x[0]), float(x[1])
    candidates = []
    for column in (0, 1):
        value = max(0.0, float(a[:, column] @ b / (a[:, column] @ a[:, column])))
        solution = [0.0, 0.0]
        solution[column] = value
        candidates.append((float(np.sum((a @ np.array(solution) - b) ** 2)), solution))
    return tuple(min(candidates)[1])


def predict(fit: dict, nbytes: int) -> float:
    steps, moved = model_terms(fit["algorithm"], fit["world_size"], nbytes)
    return steps * fit["alpha_s"] + moved * fit["beta_s_per_byte"]


def point_to_point(ctx, iters: int, warmup: int, sizes=(4, 64 << 20)) -> list[dict]:
    """Two processes: one step of our engine (an exchange of n bytes each way with isend/irecv, as recursive
    doubling makes it) against one step of gloo's all_reduce (its ring on 2 ranks makes 2 steps of n/2 bytes)."""
    rows = []
    for nbytes in sizes:
        x, y = torch.ones(nbytes // 4, device=ctx.device), torch.empty(nbytes // 4, device=ctx.device)
        timings = time_interleaved({"ours": lambda: allreduce._pair_exchange(x, y, 1 - ctx.rank, None),
                                    "gloo": lambda: torch.distributed.all_reduce(x)},
                                   iters, warmup, rounds=iters, device=ctx.device, setup=functools.partial(x.fill_, 1.0))
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
        mine = [r for r in rows if r["world_size"] == n and r["algorithm"] in allreduce.CUSTOM]
        sizes = sorted({r["bytes"] for r in mine})
        names = sorted({r["algorithm"] for r in mine})
        p50 = {(r["algorithm"], r["bytes"]): r["p50_s"] for r in mine}
        # log(p50 / fastest p50) per (algorithm, size); an algorithm not measured at a size never wins there.
        relative = {(a, s): math.log(p50[a, s] / min(p50[b, s] for b in names if (b, s) in p50)) if (a, s) in p50 else math.inf
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
    lines = ["CROSSOVER: dict[int, tuple[tuple[int | None, str], ...]] = {"]
    for n, entries in table.items():
        lines.append(f"    {n}: ({', '.join(f'({bound}, {name!r})' for bound, name in entries)},),")
    return "\n".join(lines + ["}"])


# --------------------------------------------------------------------------- report


COLUMNS = [("world_size", "procs", "d"), ("size", "size", "s"), ("algorithm", "algorithm", "s"),
           ("avg_ms", "avg ms", ".3f"), ("p50_ms", "p50 ms", ".3f"), ("p95_ms", "p95 ms", ".3f"),
           ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"), ("ratio", "p50 / torch [95% CI]", "s"),
           ("choice", "auto ran", "s"), ("max_abs_error", "max error", ".1e")]
MODEL_COLUMNS = [("world_size", "procs", "d"), ("algorithm", "algorithm", "s"), ("alpha_us", "alpha us/step", ".1f"),
                 ("gbps", "1/beta GB/s", ".3f"), ("max_rel_error", "worst |pred - meas| / meas", ".2f")]


def _ratio_of(row: dict) -> dict:
    """The row's ratio to torch in the form of ``measure.paired_ratio``; a row of an older file without
    an interval counts as one measurement (its interval is the point)."""
    low, high = row.get("vs_torch_ci_low"), row.get("vs_torch_ci_high")
    if low is None or high is None:
        return {"median": row["vs_torch"], "ci_low": row["vs_torch"], "ci_high": row["vs_torch"], "rounds": 1}
    return {"median": row["vs_torch"], "ci_low": low, "ci_high": high, "rounds": row.get("rounds") or 2}


def _ratio_text(row: dict) -> str:
    return "-" if row.get("vs_torch") is None else format_ratio(_ratio_of(row))


def target_checks(rows: list[dict]) -> list[dict]:
    """One check per (target, process count, size): the ratio to torch, its interval and met / missed / inconclusive.

    All-reduce rows meet ``TARGETS``; reduce-scatter and all-gather rows their ring's ``COLLECTIVE_TARGETS``
    at 10 and 100 MB (their sizes are rounded down to a multiple of the world size, as in nccl-tests)."""
    checks = []
    for row in rows:
        collective = row.get("collective", "allreduce")
        targets = TARGETS if collective == "allreduce" else [("ring", LARGE, COLLECTIVE_TARGETS[collective])]
        near = min(LARGE, key=lambda size: abs(size - row["bytes"]))
        for algorithm, sizes, target in targets:
            if row["algorithm"] != algorithm or row.get("vs_torch") is None:
                continue
            if sizes is not None and abs(near - row["bytes"]) >= 64:
                continue
            checks.append({"collective": collective, "algorithm": algorithm, "world_size": row["world_size"],
                           "bytes": near if sizes is not None else row["bytes"], "limit": target,
                           "ratio": _ratio_of(row), "verdict": verdict(_ratio_of(row), target),
                           "oversubscribed": bool(row.get("oversubscribed")), "row": row})
    return checks


def target_lines(rows: list[dict]) -> list[str]:
    """``target_checks`` as one printed line each."""
    lines = []
    for c in target_checks(rows):
        name = c["algorithm"] if c["collective"] == "allreduce" else f"{c['algorithm']} {c['collective']}"
        label = f" [oversubscribed: {c['world_size']} processes on {os.cpu_count()} cores]" if c["oversubscribed"] else ""
        lines.append(f"target {name} <= {c['limit']:.2f}x torch, {c['world_size']} processes, {format_size(c['bytes'])}: "
                     f"{_ratio_text(c['row'])} {c['verdict']}{label}")
    return lines


def allreduce_rows(rows: list[dict]) -> list[dict]:
    """The all-reduce rows of a results file (it also holds the one-step rows of ``point_to_point``)."""
    return [row for row in rows if "algorithm" in row]


def report(rows: list[dict], p2p: list[dict] | None = None) -> str:
    rows = allreduce_rows(rows)
    shown = [{**row, "size": format_size(row["bytes"]), "avg_ms": row["avg_s"] * 1e3, "p50_ms": row["p50_s"] * 1e3,
              "p95_ms": row["p95_s"] * 1e3, "ratio": _ratio_text(row)} for row in rows]
    lines = [markdown_table(shown, COLUMNS), ""]
    wrong = [row for row in rows if not row["correct"]]
    lines.append(f"correctness: {'all exact' if not wrong else f'{len(wrong)} WRONG results: ' + str(wrong)}")
    lines += target_lines(rows)
    fits = fit_model(rows)
    if fits:
        lines += ["", "latency-bandwidth model T = steps x alpha + bytes x beta, fitted per algorithm (model_terms):",
                  markdown_table([{**f, "alpha_us": f["alpha_s"] * 1e6} for f in fits], MODEL_COLUMNS)]
    for row in p2p or []:
        lines.append(f"one step, {row['engine']:>4}: {format_size(row['bytes']):>6}: {row['step_s'] * 1e6:10.1f} us, "
                     f"{row['step_gbps']:.3f} GB/s")
    return "\n".join(lines)


def draw_per_size(ax, rows: list[dict], backend: str, world_size: int, key: str = "p50_s", scale: float = 1e3,
                  bound: float | None = None) -> None:
    """``key`` x ``scale`` against size on log axes: one line per algorithm in its report colour, with a 95 %
    bootstrap interval over its per-call rounds where the row has them; ``auto``'s measured calls as black
    crosses, a ring around the algorithm ``auto`` chose at each size, and ``bound`` as a dashed line."""
    import plots  # imported here: the benchmark itself needs no matplotlib

    mine = [r for r in rows if (r["backend"], r["world_size"]) == (backend, world_size)]
    for algorithm in dict.fromkeys(r["algorithm"] for r in mine):
        points = sorted((r for r in mine if r["algorithm"] == algorithm), key=lambda r: r["bytes"])
        xs, ys = [r["bytes"] for r in points], [r[key] * scale for r in points]
        if algorithm == "auto":
            ax.plot(xs, ys, "kx", markersize=9, label="auto (measured)")
            continue
        spans = [plots.interval(r, key) for r in points]  # None where the row has no per-round values
        errors = [(0.0, 0.0) if span is None else (y - span[0] * scale, span[1] * scale - y) for y, span in zip(ys, spans)]
        ax.errorbar(xs, ys, yerr=np.array(errors).T, marker="o", markersize=4, capsize=2, color=plots.colour(algorithm),
                    label=algorithm.replace("_", " "))
    chosen = [(a["bytes"], r[key] * scale) for a in mine if a["algorithm"] == "auto" and a.get("choice")
              for r in mine if r["algorithm"] == a["choice"] and r["bytes"] == a["bytes"]]
    if chosen:
        ax.plot(*zip(*chosen), "o", markersize=13, markerfacecolor="none", markeredgecolor="k", label="auto's choice")
    if bound:
        ax.axhline(bound, color="#555555", linestyle="--", linewidth=1, label="loopback: one large message")
    sizes = sorted({r["bytes"] for r in mine})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plots.log_axis(ax.xaxis, sizes, lambda v, _: plots.format_bytes(v))
    plots.log_axis(ax.yaxis)
    ax.tick_params(axis="x", labelrotation=45)
    suffix = " (oversubscribed)" if any(r.get("oversubscribed") for r in mine) else ""
    ax.set_title(f"{backend}, {world_size} processes{suffix}")
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def draw_model(ax, rows: list[dict], fits: list[dict], backend: str, world_size: int) -> None:
    """Measured p50 (points) and the fitted model's prediction (lines), one colour per algorithm."""
    import plots  # imported here: the benchmark itself needs no matplotlib

    sizes = sorted({r["bytes"] for r in rows if (r["backend"], r["world_size"]) == (backend, world_size)})
    grid = np.geomspace(sizes[0], sizes[-1], 50)
    for fit in (f for f in fits if (f["backend"], f["world_size"]) == (backend, world_size)):
        colour = plots.colour(fit["algorithm"])
        ax.plot(grid, [predict(fit, s) * 1e3 for s in grid], color=colour, label=f"{fit['algorithm']} (model)")
        measured = sorted((r["bytes"], r["p50_s"] * 1e3) for r in rows
                          if (r["backend"], r["world_size"], r["algorithm"]) == (backend, world_size, fit["algorithm"]))
        ax.plot(*zip(*measured), "o", color=colour)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{backend}, {world_size} processes: model (lines) vs p50 (points)")
    ax.set_xlabel("message size (bytes)")
    ax.grid(True, which="both", alpha=0.3)


def plot(rows: list[dict], directory: str) -> list[str]:
    """Three charts, one panel per backend and process count: p50 time per size with auto's choice marked,
    bus bandwidth per size, and the fitted model against the measurements. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    # The bus bandwidth's ceiling here: the fastest single large point-to-point message measured on this
    # machine's loopback (our engine's or gloo's; rows with "engine", written with the 2-process sweep).
    bound = max((r["step_gbps"] for r in rows if r.get("engine") and r["bytes"] >= 2**20), default=None)
    rows = allreduce_rows(rows)
    panels = sorted({(row["backend"], row["world_size"]) for row in rows})
    fits = fit_model(rows)
    paths = []
    collective = rows[0].get("collective", "allreduce") if rows else "allreduce"
    charts = [("time", "p50 time (ms)"), ("busbw", "bus bandwidth (GB/s)")]
    charts += [("model", "time (ms)")] if fits and collective == "allreduce" else []  # the model is all-reduce's
    for chart, label in charts:
        figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 2.5, 4.2), squeeze=False,
                                    layout="constrained")
        for ax, (backend, world) in zip(axes[0], panels):
            if chart == "time":
                draw_per_size(ax, rows, backend, world)
            elif chart == "busbw":
                draw_per_size(ax, rows, backend, world, key="busbw_gbps", scale=1.0, bound=bound)
            else:
                draw_model(ax, rows, fits, backend, world)
        axes[0][0].set_ylabel(label)
        handles = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
        figure.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize="small", frameon=False)
        figure.suptitle(f"{collective.replace('_', '-')}: {label} against size")
        path = os.path.join(directory, f"{collective}_{chart}.png")
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- entry points


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=None,
                        help="process counts to spawn, one group each; ignored under torchrun "
                             f"(default: 2 4; with --tune {' '.join(map(str, TUNE_PROCS))})")
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                        help=f"message sizes in bytes, KB, MB or GB (powers of 2) (default: {' '.join(DEFAULT_SIZES)}; "
                             f"with --tune {' '.join(TUNE_SIZES)})")
    parser.add_argument("--algorithms", nargs="+", choices=tuple(allreduce.ALGORITHMS), default=None,
                        help="what to measure; 'torch' is torch.distributed.all_reduce "
                             f"(default: {' '.join(allreduce.ALGORITHMS)}; with --tune {' '.join(allreduce.CUSTOM)})")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed calls (rounds) per size and algorithm, {SMALL_CALLS} times as many up to "
                             f"{SMALL_BYTES >> 20} MiB (default: 20; --quick {QUICK['iters']})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed calls before them (default: 5; --quick {QUICK['warmup']})")
    parser.add_argument("--segment-bytes", type=parse_size, default=allreduce.SEGMENT_BYTES,
                        help="ring and halving-doubling: bytes per pipelined message, for tuning (default: %(default)s)")
    parser.add_argument("--in-flight", type=int, default=allreduce.IN_FLIGHT,
                        help="ring and halving-doubling: messages posted ahead of the one being added (default: %(default)s)")
    parser.add_argument("--tune", action="store_true",
                        help="time the point-to-point algorithms on a finer sweep and print allreduce.CROSSOVER")
    parser.add_argument("--collective", choices=("allreduce", "reduce_scatter", "all_gather"), default="allreduce",
                        help="what to time; reduce_scatter and all_gather compare allreduce.py's rings (and its "
                             "shared-memory all-gather) with torch's reduce_scatter_tensor and all_gather_into_tensor "
                             "(algorithms 'torch', 'ring' and, for all_gather, 'shared_memory') "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"small and fast: {QUICK} (explicit flags win)")
    parser.add_argument("--plot-dir", metavar="DIR", default=None,
                        help="save the time, bus-bandwidth and model charts here as PNG (default: none)")
    parser.add_argument("--from-json", metavar="PATH", default=None,
                        help="measure nothing: print (and plot) the results in this file (default: none)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    defaults = {"procs": TUNE_PROCS if args.tune else [2, 4], "sizes": TUNE_SIZES if args.tune else DEFAULT_SIZES,
                "algorithms": list(allreduce.CUSTOM) if args.tune else list(allreduce.ALGORITHMS), "iters": 20, "warmup": 5}
    if args.quick:
        defaults.update(QUICK)
    for key, value in defaults.items():  # explicit flags win over --quick and --tune
        if getattr(args, key) is None:
            setattr(args, key, [parse_size(v) for v in value] if key == "sizes" else value)
    if args.iters < 1 or args.warmup < 0 or min(args.procs) < 1 or min(args.sizes) < 4 or args.in_flight < 1:
        parser.error("--iters, --procs and --in-flight must be at least 1, --warmup at least 0, sizes at least 4 bytes")
    if args.collective != "allreduce":
        names = list(sharded_implementations(args.collective))
        if args.algorithms == list(allreduce.ALGORITHMS):  # the all-reduce default: take every implementation
            args.algorithms = names
        elif set(args.algorithms) - set(names):
            parser.error(f"--collective {args.collective} has the algorithms {names} only")
    return args


def pipeline(args: argparse.Namespace) -> dict:
    return {"segment_bytes": args.segment_bytes, "in_flight": args.in_flight}


def finish(rows: list[dict], env: dict, args: argparse.Namespace, p2p: list[dict] | None = None) -> None:
    """Rank 0 (or the spawning parent): the table, the targets, the model, the JSON file, the charts."""
    print(report(rows, p2p), flush=True)
    if args.tune:
        print("\n# paste into allreduce.py (measured by: python collectives_benchmark.py --tune"
              f" --procs {' '.join(map(str, args.procs))}):\n" + format_table(crossover_table(rows)), flush=True)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "plot_dir", "from_json")}
        write_results(args.json, "collectives_benchmark", env, config, rows + (p2p or []))
    if args.plot_dir:
        print("charts: " + ", ".join(plot(rows + (p2p or []), args.plot_dir)), flush=True)


def _with_point_to_point(ctx, sizes, algorithms, iters, warmup, pipeline_options,
                         collective: str = "allreduce") -> tuple[list[dict], list[dict]]:
    """The sweep, then (2 processes, all-reduce) one step of our engine against one of gloo's."""
    rows = benchmark_worker(ctx, sizes, algorithms, iters, warmup, pipeline_options, collective)
    return rows, point_to_point(ctx, iters, warmup) if ctx.world_size == 2 and collective == "allreduce" else []


def run_spawned(args: argparse.Namespace) -> None:
    """Without torchrun: spawn each process count in turn."""
    backend = resolve_backend(args.backend)
    device = "cuda" if backend == "nccl" else "cpu"
    env = environment(backend, device, max(args.procs), threads=1, procs=args.procs)
    print(format_environment(env) + f"\n* {args.collective}, process counts {args.procs}", flush=True)
    rows, p2p = [], []
    for n in args.procs:
        result = launch(_with_point_to_point, n, args.sizes, args.algorithms, args.iters, args.warmup, pipeline(args),
                        args.collective, backend=backend, timeout_s=3600, pg_timeout_s=args.timeout)[0]
        rows += result[0]
        p2p += [] if args.tune else result[1]
    finish(rows, env, args, p2p)


def run_under_torchrun(args: argparse.Namespace) -> None:
    with distributed(args.backend, args.timeout) as ctx:
        env = environment(ctx.backend, ctx.device, ctx.world_size)
        print0(format_environment(env))
        rows, p2p = _with_point_to_point(ctx, args.sizes, args.algorithms, args.iters, args.warmup, pipeline(args),
                                         args.collective)
        if ctx.is_master:
            finish(rows, env, args, p2p)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.from_json:
        document = read_results(arguments.from_json)
        results = document["results"]
        finish(allreduce_rows(results), document["env"], arguments, [r for r in results if "engine" in r])
    elif "RANK" in os.environ:
        run_under_torchrun(arguments)
    else:
        run_spawned(arguments)
