"""The one driver every benchmark shares: a benchmark declares what it measures; ``run`` does the rest.

    BENCHMARK = Benchmark("sharding_benchmark", worker, world_sizes=lambda args: args.procs, report=report)
    rows = run(BENCHMARK, parse_args())     # under torchrun: this rank; else each process count, spawned in turn

What ``run`` does, the same for every benchmark: the process group (torchrun's, or ``launch``'s spawned
workers with the ``--timeout`` process-group timeout) at the benchmark's intra-op threads per process, the
environment header, every rank's rows (rank 0's are kept: the benchmarks gather what they need themselves),
the rows this process measures itself, the rows derived from them all, the printed report, and the results
file in the shared layout (``--json``) with the target checks stored beside the rows. What a benchmark
declares: its worker, the process counts to spawn, how to print its rows, its targets, anything else it
writes (charts, tables the code reads), and, where it needs them, the optional hooks ``Benchmark`` lists.

Rows are kept as they are measured: a worker calls ``keep(ctx, rows)`` after each configuration, and the
results file then holds the rows of every configuration finished, marked ``"complete": false`` until the run
ends. A run stopped by a timeout, SIGTERM or Ctrl-C stops its workers and leaves that file.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dpkit.bench.results import environment, format_environment, read_results, write_results
from dpkit.comm.process_groups import check_gpu_per_rank, distributed, launch, placement, print0, progress


def _nothing(*_) -> list:
    return []


def _as_they_are(rows: list[dict], *_) -> list[dict]:
    return rows


@dataclass(frozen=True)
class Benchmark:
    """What a benchmark declares. ``worker(ctx, args)`` runs on every rank and returns its rows;
    ``report(rows)`` is the text printed at the end; ``targets(rows)`` the checks stored with the rows;
    ``extra(rows, env, args)`` writes anything else (charts, a table the code reads).

    Optional hooks: ``threads(args)``, the intra-op threads of every process that measures (default 1);
    ``world_of_one_here``, a process count of 1 joins a world of one in this process instead of spawning it;
    ``local(args, device)``, rows this process measures with no process group, after the workers' (under
    torchrun, rank 0 once the group is closed); ``complete(rows, env, args)``, every row with those derived
    from them (ratios, verdicts): what is printed and stored; ``header(env, args)``, the text printed before
    measuring (default: the environment, then ``describe(args)``); ``environment(env, args)``, the environment
    as stored (default: as measured, with ``procs``, the process counts spawned); ``config_adds(args)``,
    settings stored in the config after the arguments (resolved defaults, constants of the run);
    ``launcher(args)``, what starts each world, with ``process_groups.launch``'s signature (default: that)."""

    name: str
    worker: Callable[[Any, argparse.Namespace], list[dict]]
    world_sizes: Callable[[argparse.Namespace], Sequence[int]]
    report: Callable[[list[dict]], str]
    targets: Callable[[list[dict]], list[dict]] = _nothing
    extra: Callable[[list[dict], dict, argparse.Namespace], Any] = _nothing
    describe: Callable[[argparse.Namespace], str] = field(default=lambda args: "")
    timeout_s: Callable[[argparse.Namespace, int], float] = field(default=lambda args, world_size: 3600.0)
    config_leaves_out: tuple[str, ...] = ("json",)
    threads: Callable[[argparse.Namespace], int] = field(default=lambda args: 1)
    world_of_one_here: bool = False
    local: Callable[[argparse.Namespace, torch.device], list[dict]] = _nothing
    complete: Callable[[list[dict], dict, argparse.Namespace], list[dict]] = _as_they_are
    header: Callable[[dict, argparse.Namespace], str] | None = None
    environment: Callable[[dict, argparse.Namespace], dict] = field(default=lambda env, args: env)
    config_adds: Callable[[argparse.Namespace], dict] = field(default=lambda args: {})
    launcher: Callable[[argparse.Namespace], Callable[..., list]] = field(default=lambda args: launch)


def run(benchmark: Benchmark, args: argparse.Namespace) -> list[dict]:
    """Measure, complete, print, write: under torchrun this process is one rank of its world; otherwise every
    process count of ``benchmark.world_sizes(args)`` is spawned in turn (gloo on CPU, NCCL where ``--backend``
    says so). Returns the completed rows (a rank other than 0 under torchrun: its own rows, uncompleted).
    Stopped (SIGTERM, Ctrl-C) or failed, it leaves the results file as the workers' ``keep`` last wrote it."""
    threads = benchmark.threads(args)
    with _stopped_cleanly(), _keeping(benchmark, args) as kept:
        if "RANK" in os.environ:
            with distributed(args.backend, args.timeout, _device_flag(args)) as ctx, _threads(threads):
                env = benchmark.environment(environment(ctx.backend, ctx.device, ctx.world_size), args)
                print0(_header(benchmark, env, args))
                if ctx.is_master:
                    kept(env, [])
                rows = benchmark.worker(ctx, args)
            if not ctx.is_master:
                return rows
            device = ctx.device
        else:
            backend, device_type = placement(args.backend, _device_flag(args))
            device = torch.device(device_type)
            sizes = list(benchmark.world_sizes(args))
            measured = environment(backend, device, max(sizes, default=1), threads=threads, procs=sizes)
            env = benchmark.environment(measured, args)
            print(_header(benchmark, env, args), flush=True)
            rows = []
            for world_size in progress(sizes, desc="process counts") if len(sizes) > 1 else sizes:
                kept(env, rows)
                rows += _world(benchmark, args, world_size, backend, device_type, threads)
        kept(env, rows)
        with _threads(threads):
            rows += benchmark.local(args, device)
        rows = benchmark.complete(rows, env, args)
        finish(benchmark, rows, env, args)
    return rows


# --------------------------------------------------------------------------- rows kept as they are measured

# Where a worker's ``keep`` writes: "<rows of earlier process counts in the file>:<path>", set by ``run`` (its
# workers inherit it); unset, nothing is kept.
KEEP_ENV = "DPKIT_KEEP_RESULTS"


def keep(ctx, rows: list[dict]) -> None:
    """Rank 0, after each configuration, with every row its world has measured so far: the results file
    (``--json``) rewritten with the rows of earlier process counts and these, ``"complete": false``. Other
    ranks, and a run without ``--json``: nothing. Not a collective: the other ranks go on at once."""
    where = os.environ.get(KEEP_ENV)
    if not where or ctx.rank != 0:
        return
    before, path = where.split(":", 1)
    doc = read_results(path)
    write_results(path, doc["benchmark"], doc["env"], doc["config"], doc["results"][:int(before)] + rows,
                  complete=False)


@contextmanager
def _keeping(benchmark: Benchmark, args: argparse.Namespace):
    """``kept(env, rows)``: the results file written incomplete with ``rows`` (those of the process counts
    done), and ``KEEP_ENV`` pointing the next workers at it; the variable as it was afterwards. Without
    ``--json`` both do nothing. On a failure, a note of what the file keeps."""
    path = getattr(args, "json", None)
    before = os.environ.pop(KEEP_ENV, None)  # never a file of an enclosing run

    def kept(env: dict, rows: list[dict]) -> None:
        if path:
            write_results(path, benchmark.name, env, config(benchmark, args), rows, complete=False)
            os.environ[KEEP_ENV] = f"{len(rows)}:{os.path.abspath(path)}"

    try:
        yield kept
    except BaseException:
        if path and KEEP_ENV in os.environ and os.path.exists(path):
            doc = read_results(path)
            if not doc["complete"]:
                count = len(doc["results"])
                print(f"\n{path} keeps the {count} row{'s' * (count != 1)} measured before the stop, marked "
                      "incomplete", file=sys.stderr, flush=True)
        raise
    finally:
        os.environ.pop(KEEP_ENV, None)
        if before is not None:
            os.environ[KEEP_ENV] = before


class Stopped(BaseException):
    """SIGTERM arrived: raised in the main thread so that every ``finally`` runs (``launch`` stops its workers)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


@contextmanager
def _stopped_cleanly():
    """SIGTERM (``timeout``, a batch system, torchrun stopping its workers) unwinds like Ctrl-C does, and both
    end the process with the shell's status for the signal (128 + its number). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    except (Stopped, KeyboardInterrupt) as stop:
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        raise SystemExit(128 + signum) from stop
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _world(benchmark: Benchmark, args: argparse.Namespace, world_size: int, backend: str, device: str,
           threads: int) -> list[dict]:
    """Rank 0's rows of one world of ``world_size`` processes: spawned, or a world of one in this process."""
    check_gpu_per_rank(backend, world_size)  # here, before any process starts: spawned ranks share this host
    if world_size == 1 and benchmark.world_of_one_here:
        with distributed(backend, args.timeout, device) as ctx, _threads(threads):
            return benchmark.worker(ctx, args)
    start = benchmark.launcher(args)
    return start(benchmark.worker, world_size, args, backend=backend, timeout_s=benchmark.timeout_s(args, world_size),
                 pg_timeout_s=args.timeout, threads=threads, device=device)[0]


def _device_flag(args: argparse.Namespace) -> str:
    """``--device`` (every script's, from ``add_common_args``; "auto" for a namespace made without it)."""
    return getattr(args, "device", "auto")


@contextmanager
def _threads(count: int):
    """This process at ``count`` intra-op threads, as a spawned worker is; its own count back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def finish(benchmark: Benchmark, rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    """The report, the results file (``--json``: rows, targets, the configuration) and the benchmark's extras."""
    print(benchmark.report(rows), flush=True)
    if getattr(args, "json", None):
        write_results(args.json, benchmark.name, env, config(benchmark, args), rows, targets=benchmark.targets(rows))
        print(f"\nwrote {args.json}", flush=True)
    benchmark.extra(rows, env, args)


def config(benchmark: Benchmark, args: argparse.Namespace) -> dict:
    """The configuration a results file stores: the arguments but ``config_leaves_out``, then ``config_adds``."""
    kept = {k: v for k, v in vars(args).items() if k not in benchmark.config_leaves_out}
    return {**kept, **benchmark.config_adds(args)}


def _header(benchmark: Benchmark, env: dict, args: argparse.Namespace) -> str:
    if benchmark.header is not None:
        return benchmark.header(env, args)
    described = benchmark.describe(args)
    return format_environment(env) + (f"\n* {described}" if described else "")
