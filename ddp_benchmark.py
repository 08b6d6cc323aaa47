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
import json
import os
import statistics
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.profiler import record_function

from dpkit.bench import harness
from dpkit.bench.ddp_step import (DDP_KINDS, LR, MOMENTUM, NAIVE, OURS, PYTORCH, PYTORCH_BEST, PYTORCH_BEST_KIND,
                                   PYTORCH_DEFAULT_BUCKET_MB, PYTORCH_KINDS, Replica, sgd)
from dpkit.bench import transport_choice
from dpkit.bench.measure import (PHASES, PeakMemory, chrome_trace, format_ratio, gather_rows, op_breakdown,
                                 oversubscribed, paired_ratio, percentile, time_iterations, verdict)
from dpkit.bench.results import format_environment, read_results, write_durably
from dpkit.comm import transport
from dpkit.comm.process_groups import add_common_args, check_placement, placement, progress, resolve_backend
from dpkit.report.ddp_tables import PERCENTILES, block_key, format_diff, percentile_table, row_prefix
from dpkit.engines import registry
from dpkit.engines.ddp import DDP, FlatDDP, NaiveDDP, make_ddp
from dpkit.models import MODELS, NUM_CLASSES, GPTConfig, build_model

NO_DDP = "no_ddp"  # the model alone: its row's variant field (its label: "no ddp")
SIZED_KINDS = (*PYTORCH_KINDS, OURS)  # labelled with their bucket cap: "ddp ours 25M [torch]"


def registered_kinds() -> tuple[str, ...]:
    """The variants of the DDP engines registered beside our own ("toy ours" for an engine "toy" that shards
    nothing, with our implementation: ``engines.registry``): each runs as ``ddp ours`` does, wrapped by the
    registry, at PyTorch's default bucket cap, on every transport but "torch:dpkit"."""
    return tuple(f"{name} ours" for name in registry.names("ours")
                 if name != "ddp" and registry.get(name).shards == 0 and not registry.get(name).hybrid)


def kinds() -> tuple[str, ...]:
    """Every variant this benchmark can run, in row order: the built-in ones, then the registered engines'."""
    return (*DDP_KINDS, *registered_kinds())
CPU_MODELS = ("cnn", "resnet18")  # the default without a GPU; with one, all of MODELS
PROFILE_ITERS = 3
MEMORY_ITERS = 3
# Defaults of the measurement flags, and of --quick (explicit flags win over both).
NORMAL = {"batch_size": 32, "iters": 48, "rounds": 8, "warmup": 2}
QUICK = {"batch_size": 16, "iters": 8, "rounds": 4, "warmup": 1}
# On a GPU the defaults must finish in minutes, the GPT at its default size included: bucket caps at PyTorch's
# default only (the targets' size), and a time budget per model that lowers --iters to what fits.
BUCKET_SIZES = {"cpu": [1.0, 10.0, 25.0, 100.0, 1000.0], "cuda": [PYTORCH_DEFAULT_BUCKET_MB]}
BUDGET_S = {"cpu": 0.0, "cuda": 60.0}  # --budget: seconds of timed and warm-up iterations per model; 0: none
PROBE_ITERS = 2  # no-DDP iterations timed (after one warm-up) to size a model's iterations within the budget
TARGET_VS_PYTORCH = 1.00  # engine: ddp ours 25M p50 / the faster PyTorch 25M p50 on the same transport
TARGET_MEMORY = 1.00  # ddp ours 25M peak memory / the same PyTorch row's
TARGET_HIDDEN = 0.50  # exposed wait / naive's all-reduce time, for ddp ours (overlap too) on asynchronous transports
TARGET_HOOK = 0.95  # transport: PyTorch's DDP summing through our shared memory (its comm hook) / through gloo
TARGET_VS_NO_DDP = 1.15  # ddp ours 25M on the default transport / no DDP at all
TARGET_BACKEND = 0.93  # transport: PyTorch's DDP (best settings), unchanged, on a "dpkit" process group / on gloo
# How the gradients travel (a column of every row), by the registry's names (``transport_choice.choices()``):
# "torch", torch.distributed's collectives on the process group's backend (gloo here, NCCL on GPUs);
# "shared_memory", this host's shared memory, summed in the caller's thread; "shared_memory:thread", the same on
# a communication thread (asynchronous, so it can overlap); "torch:dpkit", torch.distributed's collectives on a
# process group of the backend "dpkit", which only PyTorch's DDP runs on (as its process group).
SHARED, THREAD, ON_DPKIT = "shared_memory", "shared_memory:thread", "torch:dpkit"
CPU_TRANSPORTS = ("torch", SHARED)  # the default on a CPU; on a GPU only "torch"
ASYNCHRONOUS = ("torch", THREAD)  # the transports whose sums can hide behind backward
MIB = 2**20


# --------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One row of a benchmark block: a kind (``NO_DDP`` or one of ``DDP_KINDS``), its bucket size in MiB and
    the transport its gradients travel through (a registry name; None for no_ddp)."""

    kind: str
    bucket_mb: float | None = None  # SIZED_KINDS; 0 for ddp ours overlap; None otherwise
    transport: str | None = None

    @property
    def label(self) -> str:
        if self.kind == NO_DDP:
            return "no ddp"
        name = f"{self.kind} {self.bucket_mb:g}M" if self.kind in SIZED_KINDS else self.kind
        return f"{name} [{self.transport}]"

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "-")


def variants_for(kinds, bucket_sizes, transports=CPU_TRANSPORTS) -> list[Variant]:
    """The no-ddp baseline, then the requested kinds in ``kinds()`` order, each at its bucket sizes and transports.

    PyTorch's DDP at its defaults runs at every bucket size (and its default 25) with its own communication
    (transport torch): seed 004's rows. At its best settings it runs at 25 only, the reference of the
    targets, on every transport (shared memory through ``transport.ddp_comm_hook``; "torch:dpkit": its process
    group) but the communication thread, which its hook cannot use. Ours naive and flat sum after backward: a
    thread adds nothing to them. Only PyTorch's DDP runs on "torch:dpkit": it is for engines that take a process
    group."""
    variants, registered = [Variant(NO_DDP)], registered_kinds()
    for kind in (k for k in (*DDP_KINDS, *registered) if k in kinds):
        inline = [t for t in transports if t not in (THREAD, ON_DPKIT)]
        if kind == PYTORCH:
            variants += [Variant(kind, mb, "torch") for mb in sorted({PYTORCH_DEFAULT_BUCKET_MB, *bucket_sizes})]
        elif kind == PYTORCH_BEST_KIND:
            variants += [Variant(kind, PYTORCH_DEFAULT_BUCKET_MB, t) for t in [*inline, ON_DPKIT] if t in transports]
        elif kind == OURS:
            variants += [Variant(kind, mb, t) for t in transports if t != ON_DPKIT for mb in bucket_sizes]
        elif kind in registered:
            variants += [Variant(kind, PYTORCH_DEFAULT_BUCKET_MB, t) for t in transports if t != ON_DPKIT]
        else:
            overlap = kind == "ddp ours overlap"
            variants += [Variant(kind, 0.0 if overlap else None, t)
                         for t in (transports if overlap else inline) if t != ON_DPKIT]
    return variants


def schedule(variants: list[Variant], rounds: int) -> list[tuple[int, Variant]]:
    """(round, variant) in run order. Round r starts at variant r * n / rounds, so over the
    rounds each variant takes positions spread over the whole order, and slow drift of a
    shared machine lands on every variant alike instead of on the last ones."""
    n = len(variants)
    return [(r, variants[(r * n // rounds + i) % n]) for r in range(rounds) for i in range(n)]


def round_iters(iters: int, rounds: int, round_: int) -> int:
    """Timed iterations in round ``round_``: ``iters`` split as evenly as possible."""
    return iters // rounds + (round_ < iters % rounds)


# --------------------------------------------------------------------------- models and data


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(args.gpt_vocab, args.gpt_seq_len, args.gpt_width, args.gpt_depth, args.gpt_heads)


def image_size(name: str, args: argparse.Namespace) -> int:
    return 32 if name == "cnn" else args.image_size  # the CNN's fc layer is sized for 32x32 inputs


def input_shape(name: str, args: argparse.Namespace) -> str:
    if name == "gpt":
        return f"{args.gpt_seq_len} tokens"
    size = image_size(name, args)
    return f"3x{size}x{size}"


def make_batch(name: str, args: argparse.Namespace, rank: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets): random, seeded per rank (ranks hold different data), made once."""
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    if name == "gpt":
        tokens = torch.randint(args.gpt_vocab, (args.batch_size, args.gpt_seq_len + 1), generator=generator)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T): predict the next token
    else:
        size = image_size(name, args)
        inputs = torch.randn(args.batch_size, 3, size, size, generator=generator)
        targets = torch.randint(NUM_CLASSES, (args.batch_size,), generator=generator)
    return inputs.to(device), targets.to(device)


# --------------------------------------------------------------------------- one variant on this rank


def fresh_module(args: argparse.Namespace, name: str, device: torch.device) -> nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights for every variant, round and rank
    return build_model(name, gpt_config(args)).to(device).train()


def make_replica(variant: Variant, module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                 made: dict[str, transport.Transport]) -> Replica:
    if variant.kind == NO_DDP:
        model = module
    elif variant.kind in registered_kinds():
        engine = variant.kind.removesuffix(" ours")
        model = registry.wrap(engine, "ours", module, made[variant.transport],
                              registry.Options(bucket_cap_mb=variant.bucket_mb))
    else:
        bucket_mb = PYTORCH_DEFAULT_BUCKET_MB if variant.bucket_mb is None else variant.bucket_mb
        options = PYTORCH_BEST if variant.kind == PYTORCH_BEST_KIND else {}
        # Every model here uses all its parameters: like both PyTorch rows (find_unused_parameters=False,
        # PyTorch's default), ours then needs no used-flags in its buckets. PyTorch's DDP on "torch" keeps
        # its own built-in communication (no hook).
        pytorch = variant.kind in PYTORCH_KINDS
        # On a Torch transport ("torch", "torch:dpkit") PyTorch's DDP keeps its built-in communication, on its group.
        own = pytorch and isinstance(made[variant.transport], transport.Torch)
        wire = None if own else made[variant.transport]
        group = made[variant.transport].group if own else None
        name = "pytorch" if pytorch else variant.kind.removeprefix("ddp ")  # make_ddp's: "ours", "ours naive", ...
        model = make_ddp(name, module, bucket_mb, process_group=group, find_unused_parameters=False,
                         transport=wire, **options)
    return Replica(model, sgd(model), *batch, waits=[])


def _pytorch_bucket_bytes(model: nn.parallel.DistributedDataParallel) -> list[int] | None:
    """The byte size of each of PyTorch's buckets, from its logging data (a private API: None if that
    changes). It rebuilds its buckets after the first step, and the logging data shows the rebuilt
    layout from the third step on."""
    try:
        data = model._get_ddp_logging_data()
        sizes = data["rebuilt_bucket_sizes" if data.get("has_rebuilt_buckets") else "bucket_sizes"]
        return [int(size) for size in sizes.split(",") if size.strip()]  # "29057424, 15853824"
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def communication_layout(model: nn.Module) -> tuple[int | None, int | None]:
    """(gradient all-reduces per synchronised step, bytes of communication buffers kept between steps)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if isinstance(model, DDP):  # the buckets, which also hold the gradients
        return len(model.buckets), sum(b.flat.numel() * b.flat.element_size() for b in model.buckets)
    if isinstance(model, NaiveDDP):
        return len(trainable), 0
    if isinstance(model, FlatDDP):  # its flat buffers, kept from step to step
        return len(model.flat_buffers), sum(f.numel() * f.element_size() for f in model.flat_buffers)
    if isinstance(model, nn.parallel.DistributedDataParallel):  # buckets besides the gradients
        sizes = _pytorch_bucket_bytes(model)
        return (None, None) if sizes is None else (len(sizes), sum(sizes))
    return 0, 0


@dataclass
class RoundResult:
    """Per-rank (world, iters) samples of one round."""

    times: torch.Tensor  # timed iterations
    waits: torch.Tensor  # exposed communication wait of each iteration
    wait_times: torch.Tensor  # the iterations the waits were taken in (``times`` itself on CPU)


def time_round(ctx, args, replica: Replica, iters: int) -> RoundResult:
    """Warm up and time ``iters`` iterations of a freshly built replica."""
    times = time_iterations(replica.step, iters, args.warmup, ctx.device).per_rank
    wait_times = times
    if ctx.device.type == "cuda" and hasattr(replica.model, "sync_device_for_timing"):
        # A host clock sees the device's all-reduce only if the device is synchronised around
        # the wait; those synchronisations would perturb the timed iterations above.
        replica.model.sync_device_for_timing = True
        wait_times = time_iterations(replica.step, iters, 0, ctx.device).per_rank
        replica.model.sync_device_for_timing = False
    return RoundResult(times, gather_rows(replica.waits[-iters:]), wait_times)


def measure_memory(ctx, replica: Replica) -> dict:
    """Memory of a warmed-up replica: MEMORY_ITERS more, untimed iterations under PeakMemory.

    ``iteration_peak_bytes``: the most tensor bytes above the level before the iteration
    (activations, gradients, communication temporaries). ``ddp_buffer_bytes``: what the
    DDP keeps between iterations (its buckets). ``peak_bytes``, their sum, compares the
    variants: ours keeps the gradients in its buckets, PyTorch's besides them.

    Why not from wrapping on (the level before the DDP exists)? On CPU, PeakMemory misses a
    free made on one of gloo's threads, and gloo's worker sometimes drops the last reference
    to a buffer after the caller has (the coalesced broadcast at construction): a whole
    model's worth, at random. In a steady-state iteration the caller holds its buffers
    longer than gloo does.
    """
    for wire in {id(t): t for t in (getattr(replica.model, "transport", None), _hook_state(replica.model))
                 if hasattr(t, "release_staging")}.values():
        wire.release_staging()  # a staging block left by another row's calls is not this row's
    peaks = []
    for _ in range(MEMORY_ITERS):
        with PeakMemory(ctx.device) as peak:
            replica.step()
        peaks.append(peak.bytes)
    all_reduces, buffers = communication_layout(replica.model)
    # PeakMemory can only overstate (a buffer freed on a gloo thread is missed), so the least of a few
    # identical iterations is the truest; then the most over ranks.
    iteration_peak = int(gather_rows([min(peaks)]).max())
    # The shared-memory transport's staging block (a copy of the largest tensor it was handed that it did not
    # allocate: PyTorch's buckets under the hook) lives in /dev/shm, which PeakMemory does not see.
    staging = getattr(getattr(replica.model, "transport", None) or _hook_state(replica.model), "staging_bytes", 0)
    return {"all_reduces": all_reduces, "iteration_peak_bytes": iteration_peak, "ddp_buffer_bytes": buffers,
            "transport_staging_bytes": staging,
            "peak_bytes": None if buffers is None else iteration_peak + buffers + staging}


def _hook_state(model: nn.Module):
    """The transport PyTorch's DDP was given as its communication hook's state, if any (a private attribute)."""
    hooks = getattr(model, "_comm_hooks", None) if isinstance(model, nn.parallel.DistributedDataParallel) else None
    return hooks[-1][1] if hooks else None


def write_trace(ctx, args, name: str, variant: Variant, replica: Replica) -> str:
    """A Chrome trace of PROFILE_ITERS iterations of a warmed-up replica, one file per rank; returns its path."""
    path = os.path.join(args.profile, f"{name}-{ctx.world_size}ranks-{variant.slug}-rank{ctx.rank}.json")
    with chrome_trace(path, ctx.device):
        for i in range(PROFILE_ITERS):
            with record_function(f"iteration {i}"):
                replica.step()
    if args.trim_traces:
        from dpkit.report import plots  # imported here: matplotlib is not needed otherwise

        with open(path) as f:
            text = json.dumps(plots.trim_trace(json.load(f)))
        write_durably(path, lambda f: f.write(text.encode()))
    return path


# --------------------------------------------------------------------------- one model, every variant


def model_facts(module: nn.Module) -> dict:
    params = list(module.parameters())  # a tied weight counts once
    trainable = [p for p in params if p.requires_grad]
    return {"params": sum(p.numel() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in trainable)}


def iters_within(budget_s: float, step_s: float, variants: int, rounds: int, warmup: int, most: int) -> int:
    """Timed iterations per variant such that every variant's timed and warm-up iterations, at ``step_s`` each,
    take about ``budget_s`` (not counted: building the replicas, memory, profiles, and on a GPU the second,
    synchronised pass that reads our variants' waits): at most ``most``
    (--iters), at least one per round. ``budget_s`` 0: ``most``."""
    if not budget_s:
        return most
    fit = int(budget_s / (step_s * variants)) - rounds * warmup
    return min(most, max(rounds, fit))


def step_seconds(ctx, args, name: str, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """A no-DDP iteration of model ``name``: the median of PROBE_ITERS after one warm-up, of the slowest rank
    (every rank gets the same value)."""
    replica = make_replica(Variant(NO_DDP), fresh_module(args, name, ctx.device), batch, {})
    return statistics.median(time_iterations(replica.step, PROBE_ITERS, 1, ctx.device).samples)


def model_iters(ctx, args, name: str, variants: list[Variant], batch) -> int:
    """--iters, or fewer where --budget (default: BUDGET_S for the device) says so."""
    budget = BUDGET_S[ctx.device.type] if args.budget is None else args.budget
    if not budget:
        return args.iters
    return iters_within(budget, step_seconds(ctx, args, name, batch), len(variants), args.rounds, args.warmup,
                        args.iters)


def benchmark_model(ctx, args, name: str, variants: list[Variant], made: dict[str, transport.Transport]) -> list[dict]:
    """Every variant on one model: interleaved timed rounds; after a variant's last round, its memory
    (and trace) from the same, warmed-up replica."""
    batch = make_batch(name, args, ctx.rank, ctx.device)
    iters = model_iters(ctx, args, name, variants, batch)
    rounds: dict[Variant, list[RoundResult]] = {v: [] for v in variants}
    memory: dict[Variant, dict] = {}
    steps = schedule(variants, args.rounds)
    for round_, variant in progress(steps, desc=f"{name}: {len(variants)} variants x {args.rounds} rounds"):
        replica = make_replica(variant, fresh_module(args, name, ctx.device), batch, made)
        rounds[variant].append(time_round(ctx, args, replica, round_iters(iters, args.rounds, round_)))
        if round_ == args.rounds - 1:
            memory[variant] = measure_memory(ctx, replica)
            if args.breakdown and variant.bucket_mb == PYTORCH_DEFAULT_BUCKET_MB:
                memory[variant]["breakdown"] = op_breakdown(replica.step, PROFILE_ITERS, PHASES, device=ctx.device)
            if args.profile:
                write_trace(ctx, args, name, variant, replica)
        del replica  # freed before the next one is built: one model at a time in memory
    with torch.device("meta"):  # sizes only: no memory, no initialisation work
        facts = {"model": name, "batch_size": args.batch_size, "input": input_shape(name, args),
                 **model_facts(build_model(name, gpt_config(args)))}
    return [make_row(ctx, args, facts, v, rounds[v], memory[v]) for v in variants]


def make_row(ctx, args, facts: dict, variant: Variant, rounds: list[RoundResult], memory: dict) -> dict:
    """One flat result row (times in seconds, memory in bytes), pooled over the variant's rounds."""
    times = torch.cat([r.times for r in rounds], dim=1)  # (world, iters)
    waits = torch.cat([r.waits for r in rounds], dim=1)
    wait_times = torch.cat([r.wait_times for r in rounds], dim=1)
    samples = times.max(dim=0).values.tolist()  # an iteration lasts as long as its slowest rank
    global_batch = args.batch_size * ctx.world_size
    row = {**facts, "variant": variant.kind, "bucket_cap_mb": variant.bucket_mb, "transport": variant.transport,
           "label": variant.label,
           "world_size": ctx.world_size, "global_batch": global_batch, "device": ctx.device.type,
           "iters": len(samples), "rounds": args.rounds, "warmup": args.warmup, **memory}
    for p in PERCENTILES:
        row[f"p{p}_s"] = percentile(samples, p)
        row[f"p{p}_ex_per_s"] = global_batch / row[f"p{p}_s"]
    readable = variant.kind not in (NO_DDP, *PYTORCH_KINDS)  # variants whose wait a host clock can isolate
    row["comm_wait_s"] = statistics.median(waits.mean(dim=0).tolist()) if readable else None
    # Sums over ranks and iterations, then one division: seed 002's ratio of totals.
    row["comm_share"] = (waits.sum() / wait_times.sum()).item() if readable else None
    # Each round's own p50 (and median wait): rows compared round by round ran minutes apart at
    # most, so ratios of these pair out the drift of a shared machine (measure.paired_ratio).
    row["round_p50_s"] = [statistics.median(r.times.max(dim=0).values.tolist()) for r in rounds]
    row["round_comm_wait_s"] = [statistics.median(r.waits.mean(dim=0).tolist()) for r in rounds] if readable else None
    row["oversubscribed"] = oversubscribed(ctx.world_size, ctx.device)
    row.update(samples_s=samples, per_rank_s=times.tolist(), comm_wait_per_rank_s=waits.tolist() if readable else None,
               comm_probe_per_rank_s=wait_times.tolist() if readable and wait_times is not times else None)
    return row


def run(ctx, args, models: list[str], kinds) -> list[dict]:
    """Every model and variant on this process group; every rank returns the same rows."""
    names = default_transports(args, ctx.device)
    variants = variants_for(kinds, args.bucket_sizes, names)
    needed = {v.transport for v in variants if v.transport}  # made in the registry's order on every rank
    made = transport_choice.make(needed, ctx.device) if ctx.world_size > 1 else \
        {name: transport.resolve("torch") for name in names}  # one process: nothing travels
    rows = []
    for name in models:
        rows += benchmark_model(ctx, args, name, variants, made)
        harness.keep(ctx, rows)
    for wire in made.values():
        wire.close()
    return rows


# --------------------------------------------------------------------------- comparisons within a run


def _peers(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Rows by (block, world size), then by label: the rows of one run that may be compared."""
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        groups.setdefault((block_key(row), row["world_size"]), {})[row["label"]] = row
    return groups


def faster_pytorch(by_label: dict[str, dict], transport: str) -> dict | None:
    """The PyTorch 25M row on ``transport`` with the lower p50, at its defaults or its best settings: the
    reference of our engine on that transport."""
    candidates = [by_label[Variant(kind, PYTORCH_DEFAULT_BUCKET_MB, transport).label] for kind in PYTORCH_KINDS
                  if Variant(kind, PYTORCH_DEFAULT_BUCKET_MB, transport).label in by_label]
    return min(candidates, key=lambda r: r["p50_s"], default=None)


def relate(rows: list[dict]) -> None:
    """Add to every row its DDP overhead (p50 minus the no-ddp p50 of the same block and world size), its
    time against no DDP, and against PyTorch's DDP at 25M on the same transport (engine against engine),
    at its defaults and at its best settings: the median of the per-round p50 ratios with a 95 % bootstrap
    interval over rounds (``measure.paired_ratio``)."""
    for by_label in _peers(rows).values():
        base = by_label.get(Variant(NO_DDP).label)
        for row in by_label.values():
            row["overhead_s"] = row["p50_s"] - base["p50_s"] if base else None
            row["overhead_frac"] = row["overhead_s"] / base["p50_s"] if base else None
            row["vs_no_ddp"] = paired_ratio(row["round_p50_s"], base["round_p50_s"]) if base else None
            for kind, key in ((PYTORCH, "vs_pytorch"), (PYTORCH_BEST_KIND, "vs_pytorch_best")):
                reference = by_label.get(Variant(kind, PYTORCH_DEFAULT_BUCKET_MB, row.get("transport")).label)
                row[key] = paired_ratio(row["round_p50_s"], reference["round_p50_s"]) if reference else None


def _check(block: tuple, world: int, target: str, label: str, reference: str, ratio: dict, limit: float | None,
           oversub: bool, note: str = "", axis: str = "engine") -> dict:
    """One comparison of a run: ``label`` / ``reference``; against ``limit`` when there is one (else the verdict
    is "information": a measurement the report states, with no target)."""
    model, batch, shape = block
    return {"model": model, "batch_size": batch, "input": shape, "world_size": world, "target": target,
            "axis": axis, "label": label, "reference": reference, "ratio": ratio, "limit": limit,
            "verdict": "information" if limit is None else verdict(ratio, limit), "oversubscribed": oversub,
            "note": note}


def _exact(value: float) -> dict:
    """A ratio measured once (memory is deterministic up to gloo's timing): its interval is itself."""
    return {"median": value, "ci_low": value, "ci_high": value, "rounds": 1, "method": "single measurement"}


def target_checks(rows: list[dict]) -> list[dict]:
    """The targets, evaluated on every block with at least 2 ranks that has the rows they need.

    Two axes, never mixed. Engine (one transport): ddp ours 25M against the faster of PyTorch's 25M rows
    on the same transport, time and memory. Transport (one engine): PyTorch's DDP at its best settings
    through our shared memory (its comm hook) against its own gloo; and our DDP on shared memory against
    no DDP at all. Overlap: on the asynchronous transports, the exposed wait of ours overlap and of ours at every
    bucket size against ours naive's all-reduce time on the same transport, paired by round. They are set
    for CPU, 2 ranks, resnet18; elsewhere they are reported for information.
    """
    checks = []
    for (block, world), by_label in _peers(rows).items():
        if world < 2:
            continue
        oversub = any(r["oversubscribed"] for r in by_label.values())
        for name in dict.fromkeys(r["transport"] for r in by_label.values() if r.get("transport")):
            ours, theirs = by_label.get(Variant(OURS, PYTORCH_DEFAULT_BUCKET_MB, name).label), \
                faster_pytorch(by_label, name)
            if ours and theirs:
                checks.append(_check(block, world, "p50 / faster pytorch p50, same transport", ours["label"],
                                     theirs["label"], paired_ratio(ours["round_p50_s"], theirs["round_p50_s"]),
                                     TARGET_VS_PYTORCH, oversub))
                if ours["peak_bytes"] and theirs["peak_bytes"]:
                    checks.append(_check(block, world, "peak memory / same pytorch row", ours["label"],
                                         theirs["label"], _exact(ours["peak_bytes"] / theirs["peak_bytes"]),
                                         TARGET_MEMORY, oversub))
        hooked, own, backed = (by_label.get(Variant(PYTORCH_BEST_KIND, PYTORCH_DEFAULT_BUCKET_MB, t).label)
                               for t in (SHARED, "torch", ON_DPKIT))
        if hooked and own:
            checks.append(_check(block, world, "p50 / the same engine on torch", hooked["label"], own["label"],
                                 paired_ratio(hooked["round_p50_s"], own["round_p50_s"]), TARGET_HOOK, oversub,
                                 axis="transport"))
        if backed and own:
            checks.append(_check(block, world, "p50 / the same engine on torch", backed["label"], own["label"],
                                 paired_ratio(backed["round_p50_s"], own["round_p50_s"]), TARGET_BACKEND, oversub,
                                 axis="transport"))
        ours, base = by_label.get(Variant(OURS, PYTORCH_DEFAULT_BUCKET_MB, SHARED).label), by_label.get("no ddp")
        if ours and base:
            checks.append(_check(block, world, "p50 / no DDP", ours["label"], base["label"], ours["vs_no_ddp"]
                                 or paired_ratio(ours["round_p50_s"], base["round_p50_s"]), TARGET_VS_NO_DDP, oversub,
                                 axis="overhead"))  # what data parallelism costs on top of the model, not a transport
        checks += _overlap_checks(block, world, by_label, oversub) + _thread_checks(block, world, by_label, oversub)
    return checks


def _thread_checks(block: tuple, world: int, by_label: dict[str, dict], oversub: bool) -> list[dict]:
    """Information: each variant summing on a communication thread (so that its sums can overlap backward)
    against the same sums made in the thread that completes each bucket."""
    checks = []
    for row in by_label.values():
        inline = by_label.get(row["label"].replace(f"[{THREAD}]", f"[{SHARED}]"))
        if row["transport"] == THREAD and inline:
            checks.append(_check(block, world, "p50 / the same sums in the backward hook", row["label"],
                                 inline["label"], paired_ratio(row["round_p50_s"], inline["round_p50_s"]), None,
                                 oversub, axis="overlap"))
    return checks


def _overlap_checks(block: tuple, world: int, by_label: dict[str, dict], oversub: bool) -> list[dict]:
    """Exposed wait against naive's all-reduce time on the same asynchronous transport. (On an inline one the
    sums run inside backward, on the critical path: a small wait there hides nothing; its overhead says more.)"""
    checks = []
    for name in ASYNCHRONOUS:
        # naive's sums on the same wire (it sums after backward: a thread would change nothing for it)
        naive = by_label.get(Variant(NAIVE, None, SHARED if name == THREAD else name).label)
        if not naive or not naive["comm_wait_s"]:
            continue
        for row in by_label.values():
            if row["variant"] in ("ddp ours overlap", OURS) and row["transport"] == name:
                ratio = paired_ratio(row["round_comm_wait_s"], naive["round_comm_wait_s"])
                note = ("one bucket holds every gradient: it is complete only when backward ends, so nothing can "
                        "overlap" if row["all_reduces"] == 1 and ratio["median"] > TARGET_HIDDEN else "")
                checks.append(_check(block, world, "exposed wait / naive's all-reduce time", row["label"],
                                     naive["label"], ratio, TARGET_HIDDEN, oversub, note, axis="overlap"))
    return checks


# --------------------------------------------------------------------------- report


def _seconds(value: float | None, width: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width - 1}.4f}s"


def _percent(value: float | None, width: int, sign: str = "") -> str:
    return f"{'-':>{width}s}" if value is None else f"{100 * value:{sign}{width - 1}.1f}%"


def _mib(value: int | None, width: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value / MIB:{width - 4}.1f} MiB"


def _ratio(value: dict | None, width: int) -> str:
    return f"{'-' if value is None else format_ratio(value):>{width}s}"


COMM_COLUMNS = ("p50 sec/iter", "comm wait", "of iter", "DDP overhead", "vs ddp pytorch 25M [95% CI]",
                "vs pytorch best 25M", "all-reduces", "peak memory")  # vs columns: PyTorch on the row's transport


def comm_table(rows: list[dict]) -> list[str]:
    """Communication, overhead, ratios against PyTorch and memory of each row."""
    widths = (13, 11, 9, 19, 29, 22, 12, 13)
    lines = [" " * len(row_prefix(rows[0])) + "".join(f"{h:>{w}s}" for h, w in zip(COMM_COLUMNS, widths))]
    for row in rows:
        overhead = "-" if row.get("overhead_s") is None or row["variant"] == NO_DDP else (
            f"{row['overhead_s']:+.4f}s {100 * row['overhead_frac']:+5.1f}%")
        reduces = "-" if row["all_reduces"] is None or row["variant"] == NO_DDP else str(row["all_reduces"])
        cells = (_seconds(row["p50_s"], widths[0]), _seconds(row["comm_wait_s"], widths[1]),
                 _percent(row["comm_share"], widths[2]), f"{overhead:>{widths[3]}s}",
                 _ratio(row.get("vs_pytorch"), widths[4]), _ratio(row.get("vs_pytorch_best"), widths[5]),
                 f"{reduces:>{widths[6]}s}", _mib(row["peak_bytes"], widths[7]))
        lines.append(row_prefix(row) + "".join(cells))
    return lines


def breakdown_table(rows: list[dict]) -> list[str]:
    """Where one iteration's time goes (rank 0, under the profiler) for the rows that carry a breakdown."""
    rows = [r for r in rows if r.get("breakdown")]
    if not rows:
        return []
    lines = ["", "Where the time goes (rank 0, profiled, CPU seconds per iteration; top operators by self time):"]
    for row in rows:
        spans = row["breakdown"]["ranges"]
        lines.append(row_prefix(row) + "".join(f"  {name} {spans.get(name, 0.0):.4f}s" for name in PHASES))
        lines.append(" " * 8 + ", ".join(f"{op['op']} {op['self_s']:.4f}s" for op in row["breakdown"]["ops"][:5]))
    return lines


def targets_text(checks: list[dict]) -> list[str]:
    lines = ["Targets (set for CPU, 2 ranks, resnet18), each on one axis. Engine, on one transport: ddp ours 25M p50 "
             f"<= {TARGET_VS_PYTORCH:.2f} x the faster PyTorch 25M row, peak memory <= {TARGET_MEMORY:.2f} x that "
             f"row's. Transport, under one engine: PyTorch's DDP (best settings) through our shared memory <= "
             f"{TARGET_HOOK:.2f} x through its own gloo, on a \"dpkit\" process group <= {TARGET_BACKEND:.2f} x on "
             f"gloo; ddp ours 25M on shared memory <= {TARGET_VS_NO_DDP:.2f} x "
             f"no DDP. Overlap, on asynchronous transports: exposed wait <= {TARGET_HIDDEN:.2f} x ours naive's "
             "all-reduce time. Ratios paired by round within one run, [95 % bootstrap interval over rounds]: met "
             "(interval at or below), missed (above), inconclusive (straddles)."]
    if not checks:
        return lines + ["  not evaluated: needs at least 2 ranks and the rows each target compares"]
    for c in checks:
        official = c["model"] == "resnet18" and c["world_size"] == 2 and not c["oversubscribed"]
        where = f"{c['model']}, {c['world_size']} ranks" + ("" if official else (
            " (oversubscribed: information)" if c["oversubscribed"] else " (information)"))
        note = f"  [{c['note']}]" if c["note"] else ""
        limit = "(information)" if c["limit"] is None else f"<= {c['limit']:.2f}: {c['verdict'].upper()}"
        lines.append(f"  {c['axis']:<9s} {where:<36s} {c['label']:>36s} {c['target']:<42s} vs {c['reference']:<36s} "
                     f"{format_ratio(c['ratio']):>20s} {limit}{note}")
    return lines


def legend(config: dict) -> list[str]:
    return [
        f"* {config['iters']} timed iterations per variant" + (" at most (each row says how many: see --budget)"
                                                                if config.get("budget", 0) else "")
        + f" in {config['rounds']} rotated rounds, each after "
        f"{config['warmup']} warm-up iterations of a freshly built variant; batch {config['batch_size']} per rank",
        "* sec/iter: percentiles over iterations of the slowest rank's time (forward, loss, backward, gradient "
        "sync, SGD step); ex/sec = global batch / sec/iter",
        "* comm wait: median per-iteration exposed communication wait (time in finish_gradient_synchronization, "
        "mean over ranks); of iter: total wait / total iteration time. PyTorch's DDP waits inside backward: "
        "compare all variants by DDP overhead = p50 - the no-ddp p50 of the same run",
        f"* ddp pytorch best: PyTorch's DDP with {', '.join(f'{k}={v}' for k, v in PYTORCH_BEST.items())}; "
        "ours and both PyTorch rows run with find_unused_parameters=False (no used-flags); "
        "vs columns: median of the per-round p50 ratios [95 % bootstrap interval over rounds]",
        f"* peak memory: the least over {MEMORY_ITERS} untimed iterations of the most tensor bytes above the level "
        "before each, max over ranks, plus what the DDP and its transport keep between iterations: its buckets "
        "(on [shared_memory] they lie in the transport's shared memory) and the shared-memory transport's staging "
        "block (in /dev/shm, which the profiler does not see)",
        "* [torch]: torch.distributed's collectives on the backend (gloo: loopback TCP between the processes of "
        "one host; PyTorch's DDP with its own built-in communication); [shared_memory]: this host's shared "
        "memory (transport.SharedMemory; PyTorch's DDP through transport.ddp_comm_hook), summed in the thread that "
        "completes a bucket; [shared_memory:thread]: the same on a communication thread; [torch:dpkit]: PyTorch's "
        "DDP unchanged on a process group of the backend \"dpkit\" (dpkit/comm/backend.py: this host's shared "
        "memory)",
        "* a * after the world size: more processes than CPU cores (oversubscribed): for information only",
    ]


def header(env: dict, config: dict) -> str:
    title = "Data-parallel benchmark: ddp.py's variants against PyTorch's DDP"
    variants = ", ".join(config["variants"])
    return "\n".join(["-" * len(title), title, "-" * len(title), "", format_environment(env),
                      f"* models: {' '.join(config['models'])}; variants: {variants}", *legend(config)])


def report(rows: list[dict]) -> str:
    """Per model block: seed 004's percentile table, then communication, overhead and memory; then the targets."""
    lines = []
    blocks: dict[tuple, list[dict]] = {}
    for row in rows:
        blocks.setdefault(block_key(row), []).append(row)
    for (model, batch, shape), block in blocks.items():
        block = sorted(block, key=lambda r: r["world_size"])  # stable: variant order kept within a world size
        first = block[0]
        lines += ["", f"Benchmark: {model} with batch size {batch} per rank, {shape} inputs; "
                      f"{first['params'] / 1e6:.2f}M parameters, {first['grad_bytes'] / MIB:.1f} MiB of gradients", ""]
        lines += percentile_table(block) + [""] + comm_table(block) + breakdown_table(block)
    return "\n".join(lines + [""] + targets_text(target_checks(rows)))


# --------------------------------------------------------------------------- diff (seed 004's diff.py)


# --------------------------------------------------------------------------- entry points


def default_transports(args: argparse.Namespace, device: torch.device) -> list[str]:
    """--transports, or every transport the device can use: shared memory only for CPU tensors."""
    if args.transports:
        return list(args.transports)
    return list(CPU_TRANSPORTS if device.type == "cpu" else ("torch",))


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
    return run(ctx, args, default_models(args, ctx.device), () if alone else args.variants)


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
    header=lambda env, args: header(env, harness.config(BENCHMARK, args)), environment=stored_environment,
    config_adds=settings)


if __name__ == "__main__":
    main()
