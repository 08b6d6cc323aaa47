"""The one driver every benchmark shares: a benchmark declares what it measures; ``run`` does the rest.

    BENCHMARK = Benchmark("sharding_benchmark", worker, world_sizes=lambda args: args.procs, report=report)
    rows = run(BENCHMARK, parse_args())     # under torchrun: this rank; else each process count, spawned in turn

What ``run`` does, the same for every benchmark: the process group (torchrun's, or ``launch``'s spawned
workers with the ``--timeout`` process-group timeout), the environment header, every rank's rows (rank 0's
are kept: the benchmarks gather what they need themselves), the printed report, and the results file in the
shared layout (``--json``) with the target checks stored beside the rows. What a benchmark declares: its
worker, the process counts to spawn, how to print its rows, its targets, and anything else it writes
(charts, tables the code reads).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dpkit.bench.results import environment, format_environment, write_results
from dpkit.comm.process_groups import distributed, launch, print0, progress, resolve_backend


def _nothing(*_) -> list:
    return []


@dataclass(frozen=True)
class Benchmark:
    """What a benchmark declares. ``worker(ctx, args)`` runs on every rank and returns its rows;
    ``report(rows)`` is the text printed at the end; ``targets(rows)`` the checks stored with the rows;
    ``extra(rows, env, args)`` writes anything else (charts, a table the code reads)."""

    name: str
    worker: Callable[[Any, argparse.Namespace], list[dict]]
    world_sizes: Callable[[argparse.Namespace], Sequence[int]]
    report: Callable[[list[dict]], str]
    targets: Callable[[list[dict]], list[dict]] = _nothing
    extra: Callable[[list[dict], dict, argparse.Namespace], Any] = _nothing
    describe: Callable[[argparse.Namespace], str] = field(default=lambda args: "")
    timeout_s: Callable[[argparse.Namespace, int], float] = field(default=lambda args, world_size: 3600.0)
    config_leaves_out: tuple[str, ...] = ("json",)


def run(benchmark: Benchmark, args: argparse.Namespace) -> list[dict]:
    """Measure, print, write: under torchrun this process is one rank of its world; otherwise every process
    count of ``benchmark.world_sizes(args)`` is spawned in turn (gloo on CPU, NCCL where ``--backend`` says so)."""
    if "RANK" in os.environ:
        with distributed(args.backend, args.timeout) as ctx:
            env = environment(ctx.backend, ctx.device, ctx.world_size)
            print0(_header(benchmark, env, args))
            rows = benchmark.worker(ctx, args)
            if ctx.is_master:
                finish(benchmark, rows, env, args)
        return rows
    backend = resolve_backend(args.backend)
    sizes = list(benchmark.world_sizes(args))
    env = environment(backend, "cuda" if backend == "nccl" else "cpu", max(sizes), threads=1, procs=sizes)
    print(_header(benchmark, env, args), flush=True)
    rows = []
    for world_size in progress(sizes, desc="process counts") if len(sizes) > 1 else sizes:
        rows += launch(benchmark.worker, world_size, args, backend=backend,
                       timeout_s=benchmark.timeout_s(args, world_size), pg_timeout_s=args.timeout)[0]
    finish(benchmark, rows, env, args)
    return rows


def finish(benchmark: Benchmark, rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    """The report, the results file (``--json``: rows, targets, the configuration) and the benchmark's extras."""
    print(benchmark.report(rows), flush=True)
    if getattr(args, "json", None):
        config = {k: v for k, v in vars(args).items() if k not in benchmark.config_leaves_out}
        write_results(args.json, benchmark.name, env, config, rows, targets=benchmark.targets(rows))
    benchmark.extra(rows, env, args)


def _header(benchmark: Benchmark, env: dict, args: argparse.Namespace) -> str:
    described = benchmark.describe(args)
    return format_environment(env) + (f"\n* {described}" if described else "")
