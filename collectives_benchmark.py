"""All-reduce bandwidth benchmark in the conventions of nccl-tests: torch.distributed.all_reduce beside
the ring, butterfly and halving-doubling all-reduce of allreduce.py.

    torchrun --standalone --nproc_per_node 4 collectives_benchmark.py        # the world torchrun starts
    python collectives_benchmark.py --procs 2 4 6 --json results/collectives.json --plot-dir results/plots
    python collectives_benchmark.py --quick --plot-dir results/plots           # small sizes, about a minute
    python collectives_benchmark.py --from-json results/collectives.json --plot-dir results/plots

Backend gloo on CPU, nccl on GPU when one is present (``--backend``). Without torchrun the script
spawns each process count of ``--procs`` itself. For each size of a geometric sweep (float32,
default 1 MB to 1 GB; 1 MB = 2^20 bytes as in nccl-tests) and each algorithm: warm-up calls,
then timed calls, each starting at a barrier with the input refilled outside the timed region;
a call takes as long as its slowest rank. The algorithms take turns call by call (A B C, then
B C A, ...), so a change of machine load hits all of them alike: timed in 2 blocks of calls per
algorithm, one configuration gave ring/torch 0.84x and 1.34x at 10 MB in consecutive runs on a
2-core machine.

Columns, as in nccl-tests: average time, p50 and p95; algbw = bytes / average time; busbw =
algbw x 2(n-1)/n, the bytes each rank must move in an all-reduce over the time, which makes
process counts comparable with each other and with the link's bandwidth; time / torch's time
(p50); and the largest error of one untimed call on a pattern whose sum is exact in float32
(so any error at all is a bug, not rounding).
"""

from __future__ import annotations

import argparse
import functools
import os
import re

import torch

import allreduce
from dist_utils import add_common_args, distributed, launch, print0, progress, resolve_backend
from measure import time_interleaved
from results import environment, format_environment, markdown_table, read_results, write_results

DEFAULT_SIZES = ["1MB", "10MB", "100MB", "1GB"]
QUICK = dict(sizes=["64KB", "1MB", "10MB"], procs=[2, 4], iters=16, warmup=2)
UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
PERIOD = 1024  # the correctness pattern repeats every PERIOD elements
TARGET = 1.10  # ring time / torch time at 10 MB and 100 MB (issue 4)


def parse_size(text: str) -> int:
    """'10MB' -> 10 * 2**20 bytes; a bare number is bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64KB, 10MB, 1GB)")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def format_size(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
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


def benchmark_size(ctx, nbytes: int, algorithms: list[str], iters: int, warmup: int, pipeline: dict) -> list[dict]:
    """One size: a correctness call per algorithm, then timed calls taking turns; the same rows on every rank."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
    errors = {name: _check(ctx, x, _algorithm(name, pipeline)) for name in algorithms}
    # Summing in place makes x grow n-fold per call: refill it (untimed) before each one.
    timings = time_interleaved({name: functools.partial(_algorithm(name, pipeline), x, "sum") for name in algorithms},
                               iters, warmup, rounds=iters, device=ctx.device, setup=functools.partial(x.fill_, 1.0))
    n, size = ctx.world_size, x.numel() * x.element_size()
    torch_p50 = timings["torch"].median if "torch" in timings else None
    rows = []
    for name in algorithms:
        timing = timings[name]
        algbw = size / timing.mean / 1e9
        rows.append({"backend": ctx.backend, "world_size": n, "algorithm": name, "bytes": size, "dtype": "float32",
                     "avg_s": timing.mean, "p50_s": timing.median, "p95_s": timing.percentile(95), "min_s": min(timing.samples),
                     "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n,
                     "vs_torch": timing.median / torch_p50 if torch_p50 else None,
                     "max_abs_error": errors[name], "correct": errors[name] == 0.0})
    return rows


def benchmark_worker(ctx, sizes: list[int], algorithms: list[str], iters: int, warmup: int, pipeline: dict) -> list[dict]:
    """Every size and algorithm for this world (one spawned group, or the world torchrun started)."""
    rows = []
    for nbytes in progress(sizes, desc=f"{ctx.world_size} processes"):
        rows += benchmark_size(ctx, nbytes, algorithms, iters, warmup, pipeline)
    return rows


# --------------------------------------------------------------------------- report


COLUMNS = [("world_size", "procs", "d"), ("size", "size", "s"), ("algorithm", "algorithm", "s"),
           ("avg_ms", "avg ms", ".3f"), ("p50_ms", "p50 ms", ".3f"), ("p95_ms", "p95 ms", ".3f"),
           ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"), ("vs_torch", "p50 / torch", ".2f"),
           ("max_abs_error", "max error", ".1e")]


def report(rows: list[dict]) -> str:
    shown = [{**row, "size": format_size(row["bytes"]), "avg_ms": row["avg_s"] * 1e3, "p50_ms": row["p50_s"] * 1e3,
              "p95_ms": row["p95_s"] * 1e3} for row in rows]
    lines = [markdown_table(shown, COLUMNS), ""]
    wrong = [row for row in rows if not row["correct"]]
    lines.append(f"correctness: {'all exact' if not wrong else f'{len(wrong)} WRONG results: ' + str(wrong)}")
    for row in rows:
        if row["algorithm"] == "ring" and row["bytes"] in (10 << 20, 100 << 20) and row["vs_torch"] is not None:
            verdict = "met" if row["vs_torch"] <= TARGET else "NOT met"
            lines.append(f"target ring <= {TARGET:.2f} x torch, {row['world_size']} processes, "
                         f"{format_size(row['bytes'])}: {row['vs_torch']:.2f} x ({verdict})")
    return "\n".join(lines)


def plot(rows: list[dict], directory: str) -> list[str]:
    """Seed 001's two charts (average time and bus bandwidth against size), one panel per backend and
    process count, one line per algorithm, log axes. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(directory, exist_ok=True)
    panels = sorted({(row["backend"], row["world_size"]) for row in rows})
    algorithms = list(dict.fromkeys(row["algorithm"] for row in rows))
    paths = []
    for key, label, name in (("avg_s", "average time (ms)", "allreduce_time.png"),
                             ("busbw_gbps", "bus bandwidth (GB/s)", "allreduce_busbw.png")):
        figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 4), squeeze=False, sharey=True)
        for ax, (backend, world) in zip(axes[0], panels):
            for algorithm in algorithms:
                points = sorted((r["bytes"], r[key] * (1e3 if key == "avg_s" else 1)) for r in rows
                                if (r["backend"], r["world_size"], r["algorithm"]) == (backend, world, algorithm))
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=algorithm)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            sizes = sorted({r["bytes"] for r in rows})
            ax.set_xticks(sizes, [format_size(s) for s in sizes], minor=False)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_title(f"{backend}, {world} processes")
            ax.set_xlabel("message size")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel(label)
        axes[0][-1].legend(fontsize="small")
        figure.suptitle(f"all-reduce: {label} against size")
        figure.tight_layout()
        path = os.path.join(directory, name)
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- entry points


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4, 6],
                        help="process counts to spawn, one group each; ignored under torchrun (default: %(default)s)")
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[parse_size(s) for s in DEFAULT_SIZES],
                        help=f"message sizes in bytes, KB, MB or GB (powers of 2) (default: {' '.join(DEFAULT_SIZES)})")
    parser.add_argument("--algorithms", nargs="+", choices=tuple(allreduce.ALGORITHMS), default=list(allreduce.ALGORITHMS),
                        help="what to measure; 'torch' is torch.distributed.all_reduce (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size and algorithm (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default: %(default)s)")
    parser.add_argument("--segment-bytes", type=parse_size, default=allreduce.SEGMENT_BYTES,
                        help="ring and halving-doubling: bytes per pipelined message, for tuning (default: %(default)s)")
    parser.add_argument("--in-flight", type=int, default=allreduce.IN_FLIGHT,
                        help="ring and halving-doubling: messages posted ahead of the one being added (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"small and fast: {QUICK} (explicit flags win)")
    parser.add_argument("--plot-dir", metavar="DIR", default=None,
                        help="save the time and bus-bandwidth charts here as PNG (default: none)")
    parser.add_argument("--from-json", metavar="PATH", default=None,
                        help="measure nothing: print (and plot) the results in this file (default: none)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.quick:  # the quick subset replaces the defaults; flags given explicitly still win
        parser.set_defaults(**{**QUICK, "sizes": [parse_size(s) for s in QUICK["sizes"]]})
        args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or min(args.procs) < 1 or min(args.sizes) < 4 or args.in_flight < 1:
        parser.error("--iters, --procs and --in-flight must be at least 1, --warmup at least 0, sizes at least 4 bytes")
    return args


def pipeline(args: argparse.Namespace) -> dict:
    return {"segment_bytes": args.segment_bytes, "in_flight": args.in_flight}


def finish(rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    """Rank 0 (or the spawning parent): the table, the JSON file, the charts."""
    print(report(rows), flush=True)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "plot_dir", "from_json")}
        write_results(args.json, "collectives_benchmark", env, config, rows)
    if args.plot_dir:
        print("charts: " + ", ".join(plot(rows, args.plot_dir)), flush=True)


def run_spawned(args: argparse.Namespace) -> None:
    """Without torchrun: spawn each process count in turn."""
    backend = resolve_backend(args.backend)
    device = "cuda" if backend == "nccl" else "cpu"
    env = environment(backend, device, max(args.procs), threads=1, procs=args.procs)
    print(format_environment(env) + f"\n* process counts {args.procs}", flush=True)
    rows = []
    for n in args.procs:
        rows += launch(benchmark_worker, n, args.sizes, args.algorithms, args.iters, args.warmup, pipeline(args),
                       backend=backend, timeout_s=3600, pg_timeout_s=args.timeout)[0]
    finish(rows, env, args)


def run_under_torchrun(args: argparse.Namespace) -> None:
    with distributed(args.backend, args.timeout) as ctx:
        env = environment(ctx.backend, ctx.device, ctx.world_size)
        print0(format_environment(env))
        rows = benchmark_worker(ctx, args.sizes, args.algorithms, args.iters, args.warmup, pipeline(args))
        if ctx.is_master:
            finish(rows, env, args)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.from_json:
        document = read_results(arguments.from_json)
        finish(document["results"], document["env"], arguments)
    elif "RANK" in os.environ:
        run_under_torchrun(arguments)
    else:
        run_spawned(arguments)
