"""Measuring one model's DDP variants, as ``ddp_benchmark.py`` runs them on every rank: interleaved timed rounds
of freshly built replicas, then each variant's memory, profile and trace, pooled into one flat row per variant.

    rows = run(ctx, args, ["cnn", "resnet18"], kinds())   # every rank returns the same rows
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
from torch.autograd.profiler import record_function

from dpkit.bench import harness, transport_choice
from dpkit.bench.ddp_memory import measure_memory
from dpkit.bench.ddp_replicas import fresh_module, gpt_config, input_shape, make_batch, make_replica, model_facts
from dpkit.bench.ddp_step import PYTORCH_DEFAULT_BUCKET_MB, Replica
from dpkit.bench.ddp_variants import Variant, default_transports, round_iters, schedule, variants_for
from dpkit.bench.measure import (PHASES, chrome_trace, gather_rows, op_breakdown, oversubscribed, percentile,
                                 time_iterations)
from dpkit.bench.results import write_durably
from dpkit.comm import transport
from dpkit.comm.process_groups import progress
from dpkit.models import build_model

PERCENTILES = (50, 75, 90, 95)  # a row's sec/iter and ex/sec percentiles (seed 004's benchmark table)
PROFILE_ITERS = 3
BUDGET_S = {"cpu": 0.0, "cuda": 60.0}  # --budget: seconds of timed and warm-up iterations per model; 0: none
PROBE_ITERS = 2  # no-DDP iterations timed (after one warm-up) to size a model's iterations within the budget


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


def write_trace(ctx, args, name: str, variant: Variant, replica: Replica,
                trim: Callable[[dict], dict] | None = None) -> str:
    """A Chrome trace of PROFILE_ITERS iterations of a warmed-up replica, one file per rank; returns its path.
    ``trim`` (--trim-traces: the report's ``plots.trim_trace``, passed in since measurement may not import the
    report) rewrites the file with only the events it keeps."""
    path = os.path.join(args.profile, f"{name}-{ctx.world_size}ranks-{variant.slug}-rank{ctx.rank}.json")
    with chrome_trace(path, ctx.device):
        for i in range(PROFILE_ITERS):
            with record_function(f"iteration {i}"):
                replica.step()
    if trim is not None:
        with open(path) as f:
            text = json.dumps(trim(json.load(f)))
        write_durably(path, lambda f: f.write(text.encode()))
    return path


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
    replica = make_replica(Variant(), fresh_module(args, name, ctx.device), batch, {})
    return statistics.median(time_iterations(replica.step, PROBE_ITERS, 1, ctx.device).samples)


def model_iters(ctx, args, name: str, variants: list[Variant], batch) -> int:
    """--iters, or fewer where --budget (default: BUDGET_S for the device) says so."""
    budget = BUDGET_S[ctx.device.type] if args.budget is None else args.budget
    if not budget:
        return args.iters
    return iters_within(budget, step_seconds(ctx, args, name, batch), len(variants), args.rounds, args.warmup,
                        args.iters)


def benchmark_model(ctx, args, name: str, variants: list[Variant], made: dict[str, transport.Transport],
                    trim: Callable[[dict], dict] | None = None) -> list[dict]:
    """Every variant on one model: interleaved timed rounds; after a variant's last round, its memory
    (and trace, trimmed by ``trim``) from the same, warmed-up replica."""
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
                write_trace(ctx, args, name, variant, replica, trim)
        del replica  # freed before the next one is built: one model at a time in memory
    with torch.device("meta"):  # sizes only: no memory, no initialisation work
        facts = {"model": name, "batch_size": args.batch_size, "input": input_shape(name, args),
                 **model_facts(build_model(name, gpt_config(args)))}
    return [make_row(ctx, args, facts, v, rounds[v], memory[v]) for v in variants]


def block_key(row: dict) -> tuple:
    """What a row's block of the report shares: (model, batch size per rank, input shape)."""
    return row["model"], row["batch_size"], row["input"]


def make_row(ctx, args, facts: dict, variant: Variant, rounds: list[RoundResult], memory: dict) -> dict:
    """One flat result row (times in seconds, memory in bytes), pooled over the variant's rounds."""
    times = torch.cat([r.times for r in rounds], dim=1)  # (world, iters)
    waits = torch.cat([r.waits for r in rounds], dim=1)
    wait_times = torch.cat([r.wait_times for r in rounds], dim=1)
    samples = times.max(dim=0).values.tolist()  # an iteration lasts as long as its slowest rank
    global_batch = args.batch_size * ctx.world_size
    memory = dict(memory)
    # The identity as fields (path: as the memory iterations recorded it), then the label formatted from them.
    row = {**facts, **variant.fields(memory.pop("path")), "label": variant.label, "world_size": ctx.world_size,
           "global_batch": global_batch, "device": ctx.device.type,
           "iters": len(samples), "rounds": args.rounds, "warmup": args.warmup, **memory}
    for p in PERCENTILES:
        row[f"p{p}_s"] = percentile(samples, p)
        row[f"p{p}_ex_per_s"] = global_batch / row[f"p{p}_s"]
    readable = variant.impl == "ours"  # variants whose wait a host clock can isolate
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


def run(ctx, args, models: list[str], kinds, trim: Callable[[dict], dict] | None = None) -> list[dict]:
    """Every model and variant on this process group; every rank returns the same rows. ``trim``: see
    ``write_trace``."""
    names = default_transports(args, ctx.device)
    variants = variants_for(kinds, args.bucket_sizes, names)
    needed = {v.transport for v in variants if v.transport}  # made in the registry's order on every rank
    made = transport_choice.make(needed, ctx.device) if ctx.world_size > 1 else \
        {name: transport.resolve("torch") for name in names}  # one process: nothing travels
    rows = []
    for name in models:
        rows += benchmark_model(ctx, args, name, variants, made, trim)
        harness.keep(ctx, rows)
    for wire in made.values():
        wire.close()
    return rows