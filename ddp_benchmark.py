r"""Time per training iteration of every data-parallel variant of ddp.py against PyTorch's DDP.

    torchrun --standalone --nproc_per_node 2 ddp_benchmark.py                  # every variant; CNN + resnet18 on CPU
    torchrun --standalone --nproc_per_node 2 ddp_benchmark.py --quick --json results/ddp_quick.json
    python ddp_benchmark.py sweep --world-sizes 1 2 4 --json results/ddp_sweep.json   # 1, 2, 4 processes
    python ddp_benchmark.py diff results/base.json results/test.json                 # A/B: % change per row
    torchrun --standalone --nproc_per_node 2 ddp_benchmark.py --models resnet18 --profile traces/

    torchrun --standalone --nproc_per_node 2 ddp_benchmark.py --transports torch shared_memory shared_memory:thread
    torchrun --standalone --nproc_per_node 2 ddp_benchmark.py --models resnet18 --variants "ddp pytorch best" \
        --transports torch torch:dpkit

An iteration is forward, cross-entropy, backward, gradient synchronisation, SGD with momentum
and ``zero_grad(set_to_none=True)`` on random inputs made once per rank. Every variant, named as the engine
registry names rows ("no ddp"; "ddp pytorch" at its defaults, "ddp pytorch best" at its best settings; "ddp ours",
bucketed, at each bucket size, and its baselines "ddp ours overlap", "ddp ours flat", "ddp ours naive") runs on
each transport of ``--transports`` (the registry's names: gloo, this host's
shared memory, any registered; PyTorch's DDP reaches it through its communication hook), so that every
comparison is of one thing: engine against engine on one transport, or transport against transport under
one engine. Each is rebuilt from the same weights in each of ``--rounds`` rounds, the order
rotated from round to round, so drift of a shared machine hits all alike; ratios are the
median of per-round ratios with a 95 % bootstrap interval over rounds (``measure.paired_ratio``).
The printed legend defines every column; the report notebook explains the design.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

from dpkit.bench import harness
from dpkit.bench import transport_choice
from dpkit.bench.ddp_run import BUDGET_S, PROFILE_ITERS, run
from dpkit.bench.ddp_step import LR, MOMENTUM, PYTORCH_DEFAULT_BUCKET_MB
from dpkit.bench.ddp_targets import relate, target_checks
from dpkit.bench.ddp_variants import CPU_TRANSPORTS, default_transports, kinds, variants_for
from dpkit.bench.results import read_results
from dpkit.comm.process_groups import add_common_args, check_placement, placement, resolve_backend
from dpkit.models import MODELS
from dpkit.report import ddp_printout
from dpkit.report.ddp_tables import format_diff

CPU_MODELS = ("cnn", "resnet18")  # the default without a GPU; with one, all of MODELS
# Defaults of the measurement flags, and of --quick (explicit flags win over both).
NORMAL = {"batch_size": 32, "iters": 48, "rounds": 8, "warmup": 2}
QUICK = {"batch_size": 16, "iters": 8, "rounds": 4, "warmup": 1}
# On a GPU the defaults must finish in minutes, the GPT at its default size included: bucket caps at PyTorch's
# default only (the targets' size), and a time budget per model (ddp_run.BUDGET_S) that lowers --iters to what fits.
BUCKET_SIZES = {"cpu": [1.0, 10.0, 25.0, 100.0, 1000.0], "cuda": [PYTORCH_DEFAULT_BUCKET_MB]}


def default_models(args: argparse.Namespace, device: torch.device) -> list[str]:
    if args.models:
        return list(args.models)
    return list(MODELS if device.type == "cuda" else CPU_MODELS)


def sweep_sizes(args: argparse.Namespace) -> list[int]:
    """A sweep's world sizes, 1 included (its single-process no-ddp row is always measured); [1] for run, whose
    world without torchrun is this process."""
    return sorted({1, *args.world_sizes}) if args.command == "sweep" else [1]


def worker(ctx, args: argparse.Namespace) -> list[dict]:
    """One rank of a world: every model and variant, or, at world size 1 of a sweep whose --world-sizes leave
    1 out, the no-ddp row alone (the reference of every DDP overhead)."""
    alone = ctx.world_size == 1 and args.command == "sweep" and 1 not in args.world_sizes
    return run(ctx, args, default_models(args, ctx.device), () if alone else args.variants, trimmer(args))


def trimmer(args: argparse.Namespace) -> Callable[[dict], dict] | None:
    """--trim-traces: the report's ``plots.trim_trace``, which keeps a trace's overlap timeline; else None."""
    if not args.trim_traces:
        return None
    from dpkit.report import plots  # imported here: matplotlib is not needed otherwise

    return plots.trim_trace


def stored_environment(env: dict, args: argparse.Namespace) -> dict:
    """The environment as this benchmark stores it: a sweep's world_size lists its world sizes (so no
    ``procs``), and torchvision's version is kept when a resnet runs."""
    env = {k: v for k, v in env.items() if k != "procs"}
    if args.command == "sweep":
        env["world_size"] = sweep_sizes(args)
    if any(m.startswith("resnet") for m in default_models(args, torch.device(env["device"]))):
        import torchvision

        env["torchvision"] = torchvision.__version__
    return env


def settings(args: argparse.Namespace) -> dict:
    """What the results' config stores after the arguments: the models, transports, row labels and budget the
    flags resolve to on this device, the optimizer's constants, and a sweep's world sizes."""
    device = torch.device(placement(args.backend, args.device)[1])
    names = default_transports(args, device)
    out = {"models": default_models(args, device), "transports": names, "lr": LR, "momentum": MOMENTUM,
           "variants": [v.label for v in variants_for(args.variants, args.bucket_sizes, names)],
           "budget": BUDGET_S[device.type] if args.budget is None else args.budget}
    if args.command == "sweep":
        out["world_sizes"] = sweep_sizes(args)
    return out


def complete(rows: list[dict], env: dict, args: argparse.Namespace) -> list[dict]:
    """Every row with its overhead and its ratios to no DDP and to PyTorch's DDP (``relate``)."""
    relate(rows)
    return rows


def report(rows: list[dict]) -> str:
    """The tables of every model, then the targets as ``target_checks`` judges them."""
    return ddp_printout.report(rows, target_checks(rows))


def check_sweep(args: argparse.Namespace) -> None:
    """Refuse a sweep under torchrun, or one that needs more GPUs than are visible, before anything starts."""
    if "RANK" in os.environ:
        sys.exit("error: run the sweep with plain python, not torchrun: it starts every world size's processes itself")
    largest = sweep_sizes(args)[-1]
    if resolve_backend(args.backend, args.device) == "nccl" and largest > torch.cuda.device_count():
        sys.exit(f"error: world size {largest} needs {largest} GPUs with nccl; {torch.cuda.device_count()} visible")


def variant_argument(text: str) -> str:
    """A --variants name in the engine registry's words; another is a usage error listing them (quoted: they
    hold spaces)."""
    if text not in kinds():
        raise argparse.ArgumentTypeError(f"unknown DDP variant {text!r}: choose among "
                                         + ", ".join(f"'{k}'" for k in kinds()))
    return text


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def add_benchmark_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None,
                        help=f"models to benchmark (default: {' '.join(CPU_MODELS)} on CPU; {' '.join(MODELS)} on GPU)")
    parser.add_argument("--variants", nargs="+", type=variant_argument, default=list(kinds()), metavar="NAME",
                        help="DDP variants, quoted: " + ", ".join(f'"{k}"' for k in kinds()) + "; the no-ddp "
                             "baseline is always measured (default: all)")
    parser.add_argument("--transports", nargs="+", type=transport_choice.argument, choices=transport_choice.choices(),
                        default=None, metavar="NAME",
                        help="how the gradients travel, by the registry's names ("
                             + ", ".join(transport_choice.choices()) + "): torch (torch.distributed on the "
                             "backend: gloo's loopback TCP on one host, NCCL on GPUs), shared_memory (this host's "
                             "shared memory, summed in the caller's thread), shared_memory:thread (the same on a "
                             "communication thread), torch:dpkit (PyTorch's DDP unchanged on a process group of the "
                             "backend \"dpkit\": its rows only); every DDP row runs on each (default: "
                             f"{' '.join(CPU_TRANSPORTS)} on CPU, torch on GPU)")
    parser.add_argument("--bucket-sizes", nargs="+", type=_positive(float), default=None,
                        metavar="MIB", help="bucket caps in MiB for ddp ours and ddp pytorch; ddp pytorch also runs "
                                            f"at its default 25 (default: {BUCKET_SIZES['cpu']} on CPU, "
                                            f"{BUCKET_SIZES['cuda']} on GPU)")
    parser.add_argument("--batch-size", type=_positive(int), default=None,
                        help="examples (images or sequences) per rank per iteration "
                             f"(default: {NORMAL['batch_size']}; {QUICK['batch_size']} with --quick)")
    parser.add_argument("--image-size", type=_positive(int), default=32,
                        help="input height and width for the resnets; the CNN always takes 32 (default: %(default)s)")
    parser.add_argument("--gpt-width", type=_positive(int), default=768, help="GPT model width (default: %(default)s)")
    parser.add_argument("--gpt-depth", type=_positive(int), default=12, help="GPT blocks (default: %(default)s)")
    parser.add_argument("--gpt-heads", type=_positive(int), default=12,
                        help="GPT attention heads (default: %(default)s)")
    parser.add_argument("--gpt-seq-len", type=_positive(int), default=256,
                        help="GPT tokens per sequence (default: %(default)s)")
    parser.add_argument("--gpt-vocab", type=_positive(int), default=50304,
                        help="GPT vocabulary size (default: %(default)s)")
    parser.add_argument("--iters", type=_positive(int), default=None,
                        help="timed iterations per variant, over all rounds; with a --budget, the most "
                             f"(default: {NORMAL['iters']}; {QUICK['iters']} with --quick)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="per model: time one no-DDP iteration first, then lower --iters (to one per round at "
                             "least) so that every variant's timed and warm-up iterations take about this long; "
                             "each row stores its iters; 0: no budget "
                             f"(default: {BUDGET_S['cuda']:g} on GPU, none on CPU)")
    parser.add_argument("--rounds", type=_positive(int), default=None,
                        help="independent rounds the timed iterations are split into, variants rotated; ratios get a "
                             f"confidence interval over rounds (default: {NORMAL['rounds']}; {QUICK['rounds']} with "
                             "--quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed iterations before each round of each variant "
                             f"(default: {NORMAL['warmup']}; {QUICK['warmup']} with --quick)")
    parser.add_argument("--threads", type=_positive(int), default=1,
                        help="intra-op threads per process (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and the inputs (default: %(default)s)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help=f"write a Chrome trace of {PROFILE_ITERS} iterations per variant and rank here "
                             "(default: none)")
    parser.add_argument("--trim-traces", action="store_true",
                        help="with --profile: keep only the events of the overlap timeline (iterations, phases, "
                             "collectives), a few kB a file instead of MB, small enough to commit (default: off)")
    parser.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                        help=f"profile {PROFILE_ITERS} iterations of each 25M row for where the time goes "
                             "(default: on)")
    parser.add_argument("--quick", action="store_true",
                        help="a fast run: cnn and resnet18 and the --quick defaults above; flags given explicitly "
                             "still win (default: off)")
    add_common_args(parser)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for key, value in (QUICK if args.quick else NORMAL).items():  # defaults only where no flag was given
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick and args.models is None:
        args.models = list(CPU_MODELS)
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.rounds > args.iters:
        parser.error(f"--rounds ({args.rounds}) must not exceed --iters ({args.iters}): every round times an iteration")
    device = check_placement(parser, args)
    if args.transports and set(args.transports) - {"torch"} and device == "cuda":
        parser.error(f"--transports {' '.join(sorted(set(args.transports) - {'torch'}))} take CPU tensors: on CUDA "
                     "use --transports torch")
    if args.gpt_width % args.gpt_heads:
        parser.error(f"--gpt-width ({args.gpt_width}) must be divisible by --gpt-heads ({args.gpt_heads})")
    if args.batch_size < 2 and set(args.models or MODELS) - {"gpt"}:
        parser.error("--batch-size must be at least 2 for the CNN and resnets: BatchNorm needs 2 samples per rank "
                     "to train")
    args.bucket_sizes = sorted(set(args.bucket_sizes or BUCKET_SIZES[device]))
    if args.budget is not None and args.budget < 0:
        parser.error("--budget must be at least 0")
    if getattr(args, "world_sizes", None) and min(args.world_sizes) < 1:
        parser.error("--world-sizes must be at least 1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="{run,sweep,diff}",
                                     help="run (the default when no command is given), sweep or diff; "
                                          "'ddp_benchmark.py COMMAND --help' lists a command's flags")
    run_parser = commands.add_parser("run", help="measure on this process group (one rank under torchrun)",
                                     description="Measure every variant on the process group torchrun starts "
                                                 "(a world of one without torchrun).")
    add_benchmark_args(run_parser)
    sweep_parser = commands.add_parser("sweep", help="run every world size, plus the single-process no-ddp row",
                                       description="Run the benchmark at each world size (1 in this process, the "
                                                   "others spawned through process_groups.launch) into one report "
                                                   "and JSON.")
    add_benchmark_args(sweep_parser)
    sweep_parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4],
                              help="process counts to run (default: %(default)s)")
    sweep_parser.add_argument("--max-time", type=_positive(float), default=7200.0,
                              help="seconds after which a world size's processes are stopped; a stuck peer fails "
                                   "much sooner through --timeout (default: %(default)s)")
    diff_parser = commands.add_parser("diff", help="compare two result files side by side (seed 004's diff.py)",
                                      description="Print test's p75 and p95 sec/iter and ex/sec per row with the % "
                                                  "difference from baseline, after the settings of both runs.")
    diff_parser.add_argument("base", help="baseline results (JSON written with --json)")
    diff_parser.add_argument("test", help="test results (JSON written with --json)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse a command line; without a command (as under torchrun) the command is ``run``."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "sweep", "diff", "-h", "--help"):
        argv.insert(0, "run")
    args = parser.parse_args(argv)
    if args.command != "diff":
        commands = next(a for a in parser._actions if a.dest == "command")
        check_args(commands.choices[args.command], args)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "diff":
        try:
            print(format_diff(read_results(args.base), read_results(args.test)))
        except ValueError as error:
            sys.exit(f"error: {error}")
    else:
        if args.command == "sweep":
            check_sweep(args)
        harness.run(BENCHMARK, args)


# Under torchrun (run): this process is one rank. Without it: run measures a world of one in this process; a sweep
# measures world size 1 here too and spawns each other world size through process_groups.launch.
BENCHMARK = harness.Benchmark(
    "ddp_benchmark", worker, world_sizes=sweep_sizes, report=report, targets=target_checks,
    timeout_s=lambda args, world_size: args.max_time, config_leaves_out=("command", "world_sizes"),
    threads=lambda args: args.threads, world_of_one_here=True, complete=complete,
    header=lambda env, args: ddp_printout.header(env, harness.config(BENCHMARK, args)), environment=stored_environment,
    config_adds=settings)


if __name__ == "__main__":
    main()
