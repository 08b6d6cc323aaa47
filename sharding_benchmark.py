"""Sharded data parallelism, measured: time per iteration and what each rank holds for DDP, ZeRO and FSDP,
ours and PyTorch's, each on a named transport, on resnet18 and the GPT model, with AdamW.

    python sharding_benchmark.py                                     # spawns 1, 2 and 4 processes in turn
    python sharding_benchmark.py --quick --json results/sharding.json
    python sharding_benchmark.py --procs 2 --models gpt --variants "fsdp pytorch"   # [torch], [shared_memory]
    python sharding_benchmark.py --procs 2 --models gpt --variants "fsdp ours"      # and [shared_memory:thread]
    python sharding_benchmark.py --procs 2 --variants "zero1 ours [shared_memory]" \
        "zero1 ours in step [shared_memory]"
    python sharding_benchmark.py --procs 2 --variants "zero1 ours [shared_memory]" "zero2 ours [shared_memory]"
    torchrun --standalone --nproc_per_node 2 sharding_benchmark.py   # the world torchrun starts

A variant is a registered engine (``dpkit.engines.registry``) on a transport, "<engine> <ours|pytorch>[ option]
[<transport>]" (without the brackets: every transport it is registered on), by the registries' names: [torch]
(PyTorch's engines as they come), [shared_memory] (PyTorch's DDP through ``ddp_comm_hook``, ``fully_shard``
through ``use_with_fully_shard``), [shared_memory:thread], [torch:dpkit] (PyTorch's engines unchanged on a
"dpkit" process group), and any registered transport on request ("ddp ours [mine]"). "zero1 pytorch"
(``ZeroRedundancyOptimizer``) runs on [torch] only. Each target divides the times of two variants that differ
on one axis only (impl, engine, transport or an option: ``AXES``), so no ratio credits an engine with a
transport's gain. With one process there is no communication: only [torch] runs.

An iteration: forward, cross-entropy, backward, gradient synchronisation, ``AdamW.step``,
``zero_grad(set_to_none=True)``. Every variant is built once per model (same seed), warmed up, then
timed in rounds that interleave the variants; ratios are medians of per-round p50 ratios with 95 %
bootstrap intervals, judged met / missed / inconclusive against their targets. Memory is counted per
rank from the tensors it holds and what its transport holds for it (each variant has a transport of its own).
"""

from __future__ import annotations

import argparse

from dpkit.bench import harness
from dpkit.bench import transport_choice
from dpkit.bench.sharding_run import benchmark_model
from dpkit.bench.sharding_targets import GPT_DEFAULT
from dpkit.bench.sharding_variants import VARIANTS, defaults, from_registry, select
from dpkit.comm.process_groups import add_common_args, parse_checked, progress
from dpkit.report.sharding_printout import report

MODELS = ("resnet18", "gpt")
DEFAULTS = dict(procs=[1, 2, 4], models=list(MODELS), batch_size=16, image_size=64, **GPT_DEFAULT, iters=30,
                rounds=6, warmup=3)
# Quick: the small GPT only, at every world size; --models adds resnet18 (run_experiments.py runs it at 2 ranks).
# Its variants: each engine target on [torch] and on [shared_memory], ZeRO / DDP, the transport ratios; no keep / bf16.
QUICK = dict(procs=[1, 2, 4], models=["gpt"], batch_size=4, image_size=32, gpt_vocab=2048, gpt_seq_len=32,
             gpt_width=128, gpt_depth=2, gpt_heads=4, iters=20, rounds=10, warmup=1,
             variants=["ddp ours [torch]", "ddp ours [shared_memory]", "ddp pytorch [torch]",
                       "ddp pytorch [shared_memory]", "zero1 ours [torch]", "zero1 ours [shared_memory]",
                       "zero2 ours [torch]", "zero2 ours [shared_memory]", "zero1 pytorch [torch]",
                       "fsdp ours [torch]", "fsdp ours [shared_memory]", "fsdp pytorch [torch]",
                       "fsdp pytorch [shared_memory]", "ddp pytorch [torch:dpkit]", "fsdp pytorch [torch:dpkit]"])
SIZES = (("batch-size", "samples per rank"), ("image-size", "resnet18 input side"), ("gpt-vocab", "GPT vocabulary"),
         ("gpt-seq-len", "GPT tokens per sample"), ("gpt-width", "GPT width"), ("gpt-depth", "GPT blocks"),
         ("gpt-heads", "GPT heads"), ("iters", "timed iterations per variant"),
         ("rounds", "rounds they are split into"), ("warmup", "untimed iterations first"))


def worker(ctx, args) -> list[dict]:
    select(args.variants)  # in this process: engines registered since the import, variants made on request
    rows = []
    for name in progress(args.models, desc=f"{ctx.world_size} processes"):
        rows += benchmark_model(ctx, args, name, args.variants)
        harness.keep(ctx, rows)
    return rows


def variants_help() -> str:
    names = ", ".join(dict.fromkeys(v.base for v in VARIANTS.values()))
    opt_in = ", ".join(v.name for v in VARIANTS.values() if not v.default)
    return (f"each 'name [transport]' (quoted), or a name alone for every transport it runs on; names: {names}; "
            f"transports: {', '.join(transport_choice.choices())} (the registry's; not with one process, nor on "
            f"GPUs). Default: every name on [torch] and [shared_memory] (zero1 pytorch on [torch] only), but the "
            f"opt-in {opt_in}; quick: {', '.join(QUICK['variants'])}")


def build_parser() -> argparse.ArgumentParser:
    from_registry()  # engines registered since the import are named in the help
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", help=f"process counts to spawn in turn; ignored under torchrun "
                        f"(default: {DEFAULTS['procs']}, quick {QUICK['procs']})")
    parser.add_argument("--models", nargs="+", choices=MODELS,
                        help=f"(default: {DEFAULTS['models']}, quick {QUICK['models']})")
    parser.add_argument("--variants", nargs="+", metavar="VARIANT", help=variants_help())
    for flag, text in SIZES:
        key = flag.replace("-", "_")
        parser.add_argument(f"--{flag}", type=int, help=f"{text} (default: {DEFAULTS[key]}, quick {QUICK[key]})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small and fast settings (explicit flags win)")
    add_common_args(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_checked(parser, argv)
    for key, value in ({**DEFAULTS, "variants": defaults()} if not args.quick else QUICK).items():
        if getattr(args, key) is None:  # explicit flags win over --quick
            setattr(args, key, value)
    try:
        args.variants = select(args.variants)
    except ValueError as error:
        parser.error(str(error))
    if min(args.procs) < 1 or args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.batch_size < 1:
        parser.error("--procs, --iters, --rounds and --batch-size must be at least 1, --warmup at least 0")
    return args


BENCHMARK = harness.Benchmark("sharding_benchmark", worker, world_sizes=lambda args: args.procs, report=report,
                              describe=lambda args: f"models {args.models}, variants {args.variants}")


def main(args: argparse.Namespace) -> list[dict]:
    return harness.run(BENCHMARK, args)


if __name__ == "__main__":
    main(parse_args())
