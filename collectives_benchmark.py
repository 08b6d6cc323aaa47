"""Collectives in the conventions of nccl-tests, on three axes, every row labelled.

    python collectives_benchmark.py --procs 2 4 --json results/collectives.json --plot-dir results/plots
    python collectives_benchmark.py --quick --plot-dir results/plots           # a few sizes
    python collectives_benchmark.py --axis transports --procs 2 --sizes 10MB 100MB   # or --axis algorithms
    python collectives_benchmark.py --collective reduce_scatter --procs 2 --sizes 10MB 100MB   # or all_gather
    python collectives_benchmark.py --axis backends --procs 2 4              # torch.distributed on "dpkit" / gloo
    python collectives_benchmark.py --axis backends --procs 2 --anchors      # results/backend_anchors.json: README
    python collectives_benchmark.py --tune                                      # results/crossover.json (auto's)
    python collectives_benchmark.py --from-json results/collectives.json --plot-dir results/plots
    torchrun --standalone --nproc_per_node 4 collectives_benchmark.py        # the world torchrun starts

* Algorithms (all-reduce): every point-to-point algorithm of ``allreduce.py`` and ``auto`` against
  ``torch.distributed.all_reduce``, all over gloo: algorithm against algorithm on the same wire.
* Transports (the registry's names, ``--transports``; all-reduce, reduce-scatter, all-gather): "torch" (gloo)
  against "shared_memory" on buffers from its ``allocate()`` (zero copy), "shared_memory:staged" (plain tensors,
  copied in and out), "p2p" (auto for the all-reduce, else the ring), and any transport registered: each on the
  buffers it allocates. Shared memory sums chunk r on rank r.
* Backends: torch.distributed's calls (``backend_axis.BACKEND_CALLS``) on a "dpkit" group against gloo, the
  latency floor, and ``--anchors`` beside them: Open MPI, DeepSpeed's shm, the memory's bound (``anchors``).

Without torchrun the script spawns each process count of ``--procs`` itself. Per size (float32, 1 MB = 2^20 bytes)
and axis: one untimed call on an exact pattern (any error is a bug), then batches of calls that last ``--batch-ms``
timed in turns, each as slow as its slowest rank, paired round by round with the axis's reference (torch's call;
gloo's on the backend axis): the median ratio with its 95 % bootstrap interval, judged against
``collective_targets``' targets, stored with the rows. busbw = algbw x ``bus_factor`` (nccl-tests).
"""

from __future__ import annotations

import argparse
import os

from dpkit.bench import anchors, harness, transport_choice
from dpkit.bench.algorithm_axis import benchmark_size
from dpkit.bench.backend_axis import BACKEND_CALLS, FLOOR_SIZES, backend_worker
from dpkit.bench.collective_run import SMALL_BYTES, SMALL_CALLS
from dpkit.bench.collective_tables import report
from dpkit.bench.collective_targets import stored_targets
from dpkit.bench.collectives import TRANSPORTS, allreduce_rows, format_size, parse_size
from dpkit.bench.crossover_table import crossover_table, format_table
from dpkit.bench.latency_model import fit_model
from dpkit.bench.measure import BATCH_S
from dpkit.bench.point_to_point import point_to_point, point_to_point_rows
from dpkit.bench.results import incomplete_note, read_results, write_results
from dpkit.bench.transport_axis import benchmark_transports_size, make_transports
from dpkit.comm import backend
from dpkit.comm.message_passing import ALGORITHMS, CROSSOVER_FILE, CUSTOM, IN_FLIGHT, SEGMENT_BYTES, crossover_rows
from dpkit.comm.process_groups import add_common_args, parse_checked, progress

DEFAULT_SIZES = ["4000", "64KB", "1MB", "10MB", "100MB"]
QUICK = dict(sizes=["4000", "64KB", "1MB", "10MB"], procs=[2, 4], iters=10, warmup=2)
TUNE_SIZES = ["4000", "16KB", "64KB", "256KB", "1MB", "4MB", "16MB", "64MB"]
TUNE_PROCS = [2, 3, 4, 8]
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")
AXES = {"algorithms": ("algorithm",), "transports": ("transport",), "both": ("algorithm", "transport"),
        "backends": ("backend",), "all": ("algorithm", "transport", "backend")}
BACKEND_SIZES = ["4", "4KB", "64KB", "1MB", "10MB", "100MB"]  # the backend axis's, from one element up
FLOOR_CALLS = 500  # back-to-back calls per round of the backend's latency floor


# --------------------------------------------------------------------------- the sweep of one world


def benchmark_worker(ctx, sizes: list[int], algorithms: list[str], iters: int, warmup: int, pipeline: dict,
                     collective: str = "allreduce", transports: list[str] = (), batch_s: float = BATCH_S) -> list[dict]:
    """Every size, on each axis asked for (``algorithms`` and ``transports`` empty: that axis is not measured),
    for this world (one spawned group, or the world torchrun started), in timed batches that last ``batch_s``."""
    made = make_transports(ctx, list(transports))
    rows = []
    try:
        for nbytes in progress(sizes, desc=f"{ctx.world_size} processes"):
            if algorithms and collective == "allreduce":
                rows += benchmark_size(ctx, nbytes, algorithms, iters, warmup, pipeline, batch_s)
            if made:
                rows += benchmark_transports_size(ctx, collective, nbytes, made, iters, warmup, batch_s)
            harness.keep(ctx, rows)
    finally:
        for t in {id(t): t for t in made.values()}.values():
            t.close()
    return rows


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
    parser.add_argument("--algorithms", nargs="+", choices=tuple(ALGORITHMS), default=None,
                        help="the algorithm axis; 'torch' is torch.distributed.all_reduce, the reference "
                             f"(default: {' '.join(ALGORITHMS)}; with --tune {' '.join(CUSTOM)})")
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
                             "deepspeed (DeepSpeed's shared-memory all-reduce), memory (each rank's own a + b -> c "
                             "over the all-reduce's bytes: the memory's bound); no name: all three; one missing is "
                             "skipped, saying why (default: none)")
    parser.add_argument("--batch-ms", type=float, default=BATCH_S * 1e3,
                        help="every axis: each contender's calls are timed back to back in batches that last "
                             "this long, so that how far apart the ranks leave the barrier before "
                             "a batch is a small share of it (default: %(default)s)")
    parser.add_argument("--floor-calls", type=int, default=FLOOR_CALLS,
                        help="the backend axis: back-to-back calls per round of the latency floor "
                             f"(backend_latency.py) at {', '.join(map(format_size, FLOOR_SIZES))}; 0: none "
                             "(default: %(default)s)")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed batches (rounds) per size and contender, {SMALL_CALLS} times as many up to "
                             f"{SMALL_BYTES >> 20} MiB (default: 20; --quick {QUICK['iters']})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed batches before them (default: 5; --quick {QUICK['warmup']})")
    parser.add_argument("--segment-bytes", type=parse_size, default=SEGMENT_BYTES,
                        help="algorithm axis, ring and halving-doubling: bytes per pipelined message, for tuning "
                             "(default: %(default)s)")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                        help="algorithm axis, ring and halving-doubling: messages posted ahead of the one being added "
                             "(default: %(default)s)")
    parser.add_argument("--tune", action="store_true",
                        help="time the point-to-point algorithms on a finer sweep and write auto's crossover table to "
                             "--crossover-json")
    parser.add_argument("--crossover-json", metavar="PATH", default=CROSSOVER_FILE,
                        help="with --tune: where the crossover table goes (default: results/crossover.json, which "
                             "allreduce(algorithm='auto') reads)")
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
                "algorithms": list(CUSTOM) if args.tune else list(ALGORITHMS),
                "transports": list(TRANSPORTS), "backend_collectives": list(BACKEND_CALLS),
                "backend_sizes": BACKEND_SIZES, "iters": 20, "warmup": 5}
    if args.quick:
        defaults.update(QUICK)
    for key, value in defaults.items():  # explicit flags win over --quick and --tune
        if getattr(args, key) is None:
            setattr(args, key, [parse_size(v) for v in value] if key in ("sizes", "backend_sizes") else value)
    if (args.iters < 1 or args.warmup < 0 or min(args.procs) < 1 or min(args.sizes + args.backend_sizes) < 4
            or args.in_flight < 1 or args.floor_calls < 0 or not args.batch_ms > 0):
        parser.error("--iters, --procs and --in-flight must be at least 1, --warmup and --floor-calls at least 0, "
                     "--batch-ms above 0, sizes at least 4 bytes")
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
                            args.transports, args.batch_ms / 1e3)
    if args.backend_collectives:
        rows += backend_worker(ctx, args.backend_collectives, args.backend_sizes, args.iters, args.warmup,
                               args.floor_calls, rows, args.anchors, args.batch_ms / 1e3)
    steps = ctx.world_size == 2 and args.collective == "allreduce" and args.algorithms and not args.tune
    return rows + (point_to_point(ctx, args.iters, args.warmup, batch_s=args.batch_ms / 1e3) if steps else [])


def _stored_rows(path: str) -> list[dict]:
    """The rows of a results file, none when it does not exist yet: another device's crossover rows are kept."""
    return read_results(path)["results"] if os.path.exists(path) else []


def extra(rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    """With --tune, auto's crossover table (results/crossover.json, which allreduce(algorithm="auto") reads);
    with --plot-dir, the charts."""
    if args.tune:
        table = crossover_table(allreduce_rows(rows), CUSTOM)
        config = {k: v for k, v in vars(args).items() if k not in ("json", "plot_dir", "from_json")}
        measured = crossover_rows(table, env["device"])
        others = [row for row in _stored_rows(args.crossover_json) if row.get("device", "cpu") != env["device"]]
        write_results(args.crossover_json, "collectives_benchmark --tune", env, config, others + measured)
        print(f"\nauto's crossover table, written to {args.crossover_json} (auto reads it at its first use; a world "
              "size it lacks keeps message_passing.DEFAULT_CROSSOVER's row):\n" + format_table(table), flush=True)
    if args.plot_dir:
        from dpkit.report.collective_plots import plot  # imported here: the benchmark itself needs no matplotlib

        charts = plot(rows, args.plot_dir, fit_model(allreduce_rows(rows)))
        print("charts: " + ", ".join(charts), flush=True)


BENCHMARK = harness.Benchmark(
    "collectives_benchmark", worker, world_sizes=lambda args: args.procs,
    report=lambda rows: report(rows, point_to_point_rows(rows), fit_model(allreduce_rows(rows))),
    targets=stored_targets, extra=extra,
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
