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
(``syncbn_floor``: BatchNorm's kernels in a Python autograd.Function making the same two sums) bounds what a
layer of this design costs. ``BatchNorm1d (local)`` has no communication; on CUDA ``torch.nn.SyncBatchNorm``.

The homework's setup: a global batch of B samples split evenly over the workers, H channels, standard
normal inputs, loss = sum of the outputs over the first B/2 samples of the global batch. One iteration
= forward + backward after a barrier, as long as its slowest rank, implementations interleaved in
rounds; a ratio is the median of per-round ratios with a 95 % bootstrap interval, judged met / missed /
inconclusive. With one process the layer is ``F.batch_norm``, timed also with cold caches (``COLD``).
Peak memory, bytes saved for backward, operators dispatched per iteration (``syncbn_operators``), a profile and
one iteration cut at its two sums (``syncbn_phases``): separate passes. The measuring is ``dpkit.bench``'s
(``syncbn_run``), handed ``syncbn.py`` (``syncbn_contenders.Sources``); the judging ``syncbn_verdicts``'.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from dpkit.bench import harness, transport_choice
from dpkit.bench.syncbn_baseline import load_baseline
from dpkit.bench.syncbn_contenders import Sources
from dpkit.bench.syncbn_report import header, report
from dpkit.bench.syncbn_run import SINGLE_ITERS_FACTOR, run, run_paths, run_single_process
from dpkit.bench.syncbn_verdicts import DTYPES, JUDGED, SHM, TORCH, WORKERS, judged
from dpkit.comm.process_groups import add_common_args, parse_checked
import syncbn

TRANSPORTS = (TORCH, SHM)  # the default --transports (shared memory where it can serve)
NORMAL = {"iters": 2000, "rounds": 40, "warmup": 20}
QUICK = {"iters": 240, "rounds": 24, "warmup": 5}  # enough rounds that an interval can decide CPU_TARGET


def sources(args) -> Sources:
    """The layer's code the package times: ``syncbn.py`` as imported, and as of --baseline's revision if given."""
    here = os.path.dirname(os.path.abspath(__file__))
    return Sources(syncbn, load_baseline(args.baseline, here) if args.baseline else None)


def worker(ctx, args) -> list[dict]:
    """One of the workers: the whole grid on every transport (``run``); no rows with --settings single."""
    for batch in args.batch:
        if batch % ctx.world_size:
            raise ValueError(f"--batch {batch} is not divisible by the {ctx.world_size} workers")
    return run(ctx, args, sources(args)) if WORKERS in args.settings else []


def measured_here(args, device: torch.device) -> list[dict]:
    """With --settings single: one process with no process group (``run_single_process``); with --settings paths,
    the synchronized path on each of syncbn's paths (``run_paths``)."""
    return ((run_single_process(device, args, sources(args)) if "single" in args.settings else [])
            + (run_paths(device, args, Sources(syncbn)) if "paths" in args.settings and device.type == "cpu" else []))


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
    local=measured_here, complete=lambda rows, env, args: judged(rows), header=header,
    environment=lambda env, args: {k: v for k, v in env.items() if k != "procs"},
    # Every implementation sums in buffers its transport allocated: the report reads [shared_memory] rows' path
    # from this key (``dpkit.report.paths``).
    config_adds=lambda args: {"sums": "zero copy"})


if __name__ == "__main__":
    main(parse_args())
