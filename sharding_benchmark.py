"""Sharded data parallelism, measured: time per iteration and what each rank holds, for DDP, ZeRO and
FSDP (ours and PyTorch's), on resnet18 and the GPT model, with AdamW.

    python sharding_benchmark.py                                   # spawns 1, 2 and 4 processes in turn
    python sharding_benchmark.py --quick --json results/sharding.json                   # about a minute
    python sharding_benchmark.py --procs 2 --models gpt --variants "zero ours" "zero pytorch"
    python sharding_benchmark.py --procs 2 --models gpt --variants "fsdp ours" "fsdp ours inline"  # overlap A/B
    python sharding_benchmark.py --procs 2 --variants "ddp ours" "zero ours" "zero ours in step" "zero ours blocking"
    torchrun --standalone --nproc_per_node 2 sharding_benchmark.py   # the world torchrun starts

An iteration: forward, cross-entropy, backward, gradient synchronisation, ``AdamW.step``,
``zero_grad(set_to_none=True)``; random inputs made once per rank outside the timed region.
Every variant of the registry ``VARIANTS`` is built once per model (same seed), warmed up,
then timed in ``--rounds`` rounds, each timing every variant in a rotated order
(``measure.time_interleaved``): an iteration starts at a barrier and lasts as long as its
slowest rank. Ratios (ours / PyTorch's for the same sharding, ZeRO / DDP) are the median of
the per-round p50 ratios with a 95 % bootstrap interval (``measure.paired_ratio``), and
their targets read met / missed / inconclusive.

Memory, per rank (maximum over ranks), counted from the tensors the rank really holds after
one untimed iteration (distinct storages, so a tied weight or a bucket holding every gradient
counts once): parameters; gradients (after synchronisation); optimizer state; activations
(what autograd saves in forward, parameters excluded); peak = what is kept between iterations
(parameters, optimizer state, the variant's own buffers: DDP's gradient buckets, ours and
PyTorch's alike) + the most bytes allocated above it during an iteration (``measure.PeakMemory``). "Ideal" is the model states (parameters +
gradients + AdamW's two moments) a rank must hold under that sharding: all of them for DDP,
1/n of the optimizer state for ZeRO, 1/n of everything plus the largest gathered unit for FSDP.
FSDP's gathered weights that autograd saves count as activations for PyTorch's ``fully_shard`` (its
saved tensors are the gathered parameters) and for ours with ``keep`` (kept for backward), not for
ours with resharding (it saves where to find them again, and gathers them in backward).

A variant is a builder registered with ``@variant``: a new sharding (FSDP) plugs in as more
builders with their own ideal and targets.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
# At the top, before the process group exists: imported after it, one of its functions would keep the
# default group as a default argument after teardown (see dist_utils._teardown).
from torch.distributed.optim import ZeroRedundancyOptimizer

import zero
from ddp import DDP, sync_gradients
from fsdp import FSDP
from dist_utils import add_common_args, distributed, launch, print0, progress, resolve_backend
from measure import (PeakMemory, format_ratio, gather_rows, oversubscribed, paired_ratio, percentile, saved_tensor_bytes,
                     time_interleaved, verdict)
from models import NUM_CLASSES, GPTConfig, build_model
from results import environment, format_environment, markdown_table, write_results

BENCHMARK = "sharding_benchmark"
MODELS = ("resnet18", "gpt")
LR = 1e-4  # AdamW; small, so many steps on random labels stay finite
DEFAULTS = dict(procs=[1, 2, 4], models=list(MODELS), batch_size=16, image_size=64, gpt_vocab=8192, gpt_seq_len=64, gpt_width=256,
                gpt_depth=4, gpt_heads=4, iters=30, rounds=6, warmup=3)
# Quick: the small GPT only, at every world size; --models adds resnet18 (run_experiments.py runs it at 2 ranks).
QUICK = dict(procs=[1, 2, 4], models=["gpt"], batch_size=4, image_size=32, gpt_vocab=2048, gpt_seq_len=32,
             gpt_width=128, gpt_depth=2, gpt_heads=4, iters=20, rounds=10, warmup=1)
TARGET_VS_PYTORCH = 1.00  # ours / PyTorch's sec/iter, the same sharding
TARGET_ZERO_VS_DDP = 1.05  # ZeRO / DDP sec/iter, the same implementation
TARGET_STATE_VS_IDEAL = 1.10  # per-rank model-state bytes / ideal


# --------------------------------------------------------------------------- the variants


@dataclass
class Setup:
    """A built variant on this rank: the model to call, its optimizer, and what the benchmark asks of it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    exposed_s: Callable[[], float | None] = lambda: None  # the last iteration's exposed communication, if measurable
    kept: Callable[[], list[torch.Tensor]] = list  # buffers kept between iterations besides parameters and state
    state: Callable[[], list[torch.Tensor]] | None = None  # optimizer-state tensors (default: optimizer.state)

    def state_tensors(self) -> list[torch.Tensor]:
        if self.state is not None:
            return self.state()
        return [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


@dataclass(frozen=True)
class Variant:
    name: str
    sharding: str  # a key of IDEAL
    build: Callable[[nn.Module], Setup]
    targets: tuple[tuple[str, float | None], ...] = ()  # (other variant, limit of this / other sec/iter or None)
    default: bool = True  # measured unless --variants says otherwise


VARIANTS: dict[str, Variant] = {}


def variant(name: str, sharding: str, targets: tuple[tuple[str, float | None], ...] = (), default: bool = True):
    """Register a builder ``f(module) -> Setup`` (module: seeded, on this rank's device) under ``name``."""
    def register(build):
        VARIANTS[name] = Variant(name, sharding, build, targets, default)
        return build
    return register


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _pytorch_ddp(module: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(module, forward_sync_buffers=False)  # like ours: buffers synced once


def _reducer_buckets(model: nn.parallel.DistributedDataParallel) -> list[torch.Tensor]:
    """Tensors the size of PyTorch's DDP's gradient buckets, which it keeps between iterations as ours does.

    Its Reducer allocates one flat tensor per bucket at construction (again when it rebuilds them after
    the first iteration) and keeps it; with ``gradient_as_bucket_view=False`` (the default, used here)
    that is besides ``param.grad``, copied into the bucket and back. Left out, PyTorch's peak would lack
    the bucket bytes that ours counts. No public API reaches the buckets: the Reducer's private one
    returns zeros of their sizes (allocated while counting, outside ``PeakMemory``)."""
    return [bucket.buffer() for bucket in model.reducer._get_zeros_like_grad_buckets()]


@variant("ddp ours", "ddp", targets=(("ddp pytorch", TARGET_VS_PYTORCH),))
def ddp_ours(module: nn.Module) -> Setup:
    model = DDP(module)
    return Setup(model, adamw(model.parameters()), exposed_s=lambda: model.last_wait_s,
                 kept=lambda: [b.flat for b in model.buckets])  # the buckets, which hold the gradients


@variant("ddp pytorch", "ddp")
def ddp_pytorch(module: nn.Module) -> Setup:
    model = _pytorch_ddp(module)
    return Setup(model, adamw(model.parameters()), kept=lambda: _reducer_buckets(model))


def _zero_ours(module: nn.Module, overlap_forward: bool = True, **options) -> Setup:
    """Our DDP and our ZeRO over it; ``overlap_forward``: the all-gathers overlap the next forward
    (``ShardedOptimizer.overlap_with_forward``), else step() waits for them."""
    model = DDP(module)
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, **options)
    if overlap_forward:
        optimizer.overlap_with_forward(model)
    return Setup(model, optimizer, exposed_s=lambda: model.last_wait_s + optimizer.last_share_s,
                 kept=lambda: [b.flat for b in model.buckets])


@variant("zero ours", "zero", targets=(("zero pytorch", TARGET_VS_PYTORCH), ("ddp ours", TARGET_ZERO_VS_DDP)))
def zero_ours(module: nn.Module) -> Setup:
    return _zero_ours(module)


@variant("zero ours in step", "zero", targets=(("zero ours", None),), default=False)
def zero_ours_in_step(module: nn.Module) -> Setup:
    """The default ShardedOptimizer: step() waits (only the update of later buckets overlaps the all-gathers)."""
    return _zero_ours(module, overlap_forward=False)


@variant("zero ours blocking", "zero", targets=(("zero ours", None),), default=False)
def zero_ours_blocking(module: nn.Module) -> Setup:
    """Before buckets and overlap: one all-gather per dtype, inline, at the end of step()."""
    return _zero_ours(module, overlap_forward=False, comm_thread=False, bucket_cap_mb=float("inf"))


@variant("zero ours broadcast", "zero", targets=(("zero ours", None),), default=False)
def zero_ours_broadcast(module: nn.Module) -> Setup:
    """The alternative update: one broadcast per owner instead of the ring all-gather (measured, not chosen)."""
    setup = zero_ours(module)
    setup.optimizer.update = "broadcast"
    return setup


@variant("zero ours tensor", "zero", targets=(("zero ours", None),), default=False)
def zero_ours_tensor(module: nn.Module) -> Setup:
    """Whole tensors per rank (exact for per-tensor optimizers): uneven when one tensor is a large part of the model."""
    return _zero_ours(module, partition="tensor")


@variant("zero pytorch", "zero", targets=(("ddp pytorch", TARGET_ZERO_VS_DDP),))
def zero_pytorch(module: nn.Module) -> Setup:
    model = _pytorch_ddp(module)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return Setup(model, optimizer, kept=lambda: _reducer_buckets(model),
                 state=lambda: [t for s in optimizer.optim.state.values() for t in s.values()
                                if torch.is_tensor(t)])  # its local optimizer's


# FSDP shards these layers (ours and PyTorch's alike): every linear and embedding layer of the GPT, every
# convolution and the classifier of resnet18; norms stay replicated.
FSDP_SHARD_TYPES = (nn.Linear, nn.Embedding, nn.Conv2d)


def _fsdp_ours(module: nn.Module, **options) -> Setup:
    model = FSDP(module, shard_types=FSDP_SHARD_TYPES, **options)
    return Setup(model, adamw(model.parameters()), exposed_s=lambda: model.last_wait_s,
                 kept=lambda: [b.flat for b in model._replicated.buckets])  # the replicated parameters' gradients


def _fsdp_pytorch(module: nn.Module, compute_dtype=None, reshard_after_forward=True) -> Setup:
    """``fully_shard`` on each ``FSDP_SHARD_TYPES`` layer, then the root (its norms), as ours shards."""
    # Like ours: each sharded layer's floating inputs cast to the compute dtype and its outputs back to
    # float32, the root's norms in float32. By default the outputs would stay in the compute dtype and
    # the root's parameters would be cast too: norms, logits and loss in it, a smaller computation.
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                  output_dtype=None if compute_dtype is None else torch.float32)
    for layers in _tied_groups([m for m in module.modules() if isinstance(m, FSDP_SHARD_TYPES)]):
        # fully_shard refuses a parameter in two groups: layers sharing one (GPT's head and embedding) form one
        fully_shard(layers if len(layers) > 1 else layers[0], reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    model = fully_shard(module, reshard_after_forward=reshard_after_forward,
                        mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    return Setup(model, adamw(model.parameters()))


def _tied_groups(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """``layers`` (those with parameters) in groups: layers that share a parameter end up in the same group."""
    groups: list[tuple[set[int], list[nn.Module]]] = []
    for layer in layers:
        ids = {id(p) for p in layer.parameters()}
        if not ids:
            continue
        joined = [g for g in groups if g[0] & ids]
        for g in joined:
            groups.remove(g)
        groups.append((ids.union(*(g[0] for g in joined)), [m for g in joined for m in g[1]] + [layer]))
    return [members for _, members in groups]


@variant("fsdp ours inline", "fsdp", targets=(("fsdp ours", None),), default=False)
def fsdp_ours_inline(module: nn.Module) -> Setup:
    """Our collectives on the calling thread instead of the communication thread: what overlap buys."""
    return _fsdp_ours(module, comm_thread=False)


for _name, _options in (("", {}), (" keep", dict(reshard_after_forward=False)),
                        (" bf16", dict(compute_dtype=torch.bfloat16)),
                        (" bf16 keep", dict(compute_dtype=torch.bfloat16, reshard_after_forward=False))):
    # "keep": reshard_after_forward=False (gathered once per step, kept for backward); "bf16": gathered
    # and computed in bfloat16, float32 master shards, gradients and AdamW. The bf16 keep pair is opt-in.
    variant(f"fsdp ours{_name}", "fsdp", targets=((f"fsdp pytorch{_name}", TARGET_VS_PYTORCH),),
            default=_name != " bf16 keep")(functools.partial(_fsdp_ours, **_options))
    variant(f"fsdp pytorch{_name}", "fsdp", default=_name != " bf16 keep")(functools.partial(_fsdp_pytorch, **_options))


def ideal_bytes(sharding: str, full: dict, n: int) -> int:
    """Model-state bytes one rank must hold: parameters, gradients and optimizer state of the whole model (``full``)."""
    p, g, s = full["params"], full["grads"], full["state"]
    if sharding == "ddp":
        return p + g + s
    if sharding == "zero":  # stage 1: the optimizer state sharded
        return p + g + s // n
    if sharding == "fsdp":  # stage 3: everything sharded, one unit gathered at a time
        return (p + g + s) // n + full["largest_unit"]
    raise ValueError(f"no ideal for sharding {sharding!r}")


# --------------------------------------------------------------------------- models and data


def gpt_config(args) -> GPTConfig:
    return GPTConfig(args.gpt_vocab, args.gpt_seq_len, args.gpt_width, args.gpt_depth, args.gpt_heads)


def make_batch(name: str, args, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets): random, different on every rank, made once."""
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    if name == "gpt":
        tokens = torch.randint(args.gpt_vocab, (args.batch_size, args.gpt_seq_len + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T): predict the next token
    else:
        inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
        targets = torch.randint(NUM_CLASSES, (args.batch_size,), generator=generator)
    return inputs.contiguous().to(device), targets.contiguous().to(device)


def fresh_module(name: str, args, device: torch.device) -> nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights for every variant and rank
    return build_model(name, gpt_config(args)).to(device).train()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its local shard for a DTensor (PyTorch's FSDP), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight or a shared bucket counts once)."""
    storages = {}
    for t in tensors:
        if t is not None:
            t = _local(t)
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def full_sizes(module: nn.Module, shard_types=FSDP_SHARD_TYPES) -> dict:
    """The whole model's state, counted from shapes (not from any rank's tensors): the ideal's inputs.

    AdamW keeps two moments per trainable element, plus a scalar step count per tensor.
    ``largest_unit``: the biggest parameters of one ``shard_types`` module, what FSDP gathers at once."""
    params = list(module.parameters())  # a tied weight counts once
    trainable = [p for p in params if p.requires_grad]
    step_bytes = torch.empty((), dtype=torch.float32).element_size()
    units = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
             for m in module.modules() if isinstance(m, shard_types)]
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.numel() * p.element_size() for p in trainable),
            "state": sum(2 * p.numel() * p.element_size() + step_bytes for p in trainable),
            "largest_unit": max(units, default=0)}


# --------------------------------------------------------------------------- one iteration


@dataclass
class Run:
    """A built variant with its batch; ``step()`` is one iteration, ``exposed`` its exposed communication."""

    setup: Setup
    inputs: torch.Tensor
    targets: torch.Tensor
    exposed: list[float] = field(default_factory=list)

    def forward(self) -> torch.Tensor:
        logits = self.setup.model(self.inputs)
        return F.cross_entropy(logits.flatten(0, -2), self.targets.flatten())

    def finish(self, loss: torch.Tensor) -> None:
        loss.backward()
        sync_gradients(self.setup.model)
        self.setup.optimizer.step()
        self.setup.optimizer.zero_grad(set_to_none=True)
        wait = self.setup.exposed_s()
        self.exposed.append(float("nan") if wait is None else wait)

    def step(self) -> None:
        self.finish(self.forward())

    def memory(self, device: torch.device) -> dict:
        """One untimed iteration, counting what this rank holds; then one under PeakMemory."""
        model, optimizer = self.setup.model, self.setup.optimizer
        params = list(model.parameters())
        box = []
        activations = saved_tensor_bytes(lambda: box.append(self.forward()), exclude=[_local(p) for p in params])
        box[0].backward()
        sync_gradients(model)
        grads = storage_bytes(p.grad for p in params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts = {"params_bytes": storage_bytes(params), "grads_bytes": grads,
                  "state_bytes": storage_bytes(self.setup.state_tensors()), "activation_bytes": activations}
        kept = storage_bytes([*params, *self.setup.state_tensors(), *self.setup.kept()])
        with PeakMemory(device) as peak:
            self.step()
        counts["peak_bytes"] = kept + peak.bytes
        return counts


# --------------------------------------------------------------------------- one model, every variant


def benchmark_model(ctx, args, name: str, names: list[str]) -> list[dict]:
    """Build every variant, time them in interleaved rounds, count their memory; rows for this model."""
    batch = make_batch(name, args, ctx.rank, ctx.device)
    full = full_sizes(fresh_module(name, args, ctx.device))
    runs = {v: Run(VARIANTS[v].build(fresh_module(name, args, ctx.device)), *batch) for v in names}
    timings = time_interleaved({v: runs[v].step for v in names}, args.iters, args.warmup, rounds=args.rounds,
                               device=ctx.device)
    per_round = {v: _round_p50s(timings[v].samples, args.iters, args.rounds) for v in names}
    rows = []
    for v in names:
        counts = runs[v].memory(ctx.device)
        per_rank = gather_rows(list(counts.values()))  # (world, counts)
        worst = per_rank.max(0).values.tolist()  # each count's maximum over ranks
        exposed = gather_rows(runs[v].exposed[-args.iters:]).max(0).values.tolist()
        samples = timings[v].samples
        row = {"model": name, "world_size": ctx.world_size, "variant": v, "sharding": VARIANTS[v].sharding,
               "p50_s": percentile(samples, 50), "p95_s": percentile(samples, 95), "round_p50_s": per_round[v],
               "exposed_comm_s": None if any(e != e for e in exposed) else percentile(exposed, 50),
               **{key: int(value) for key, value in zip(counts, worst)},
               "state_bytes_per_rank": [int(b) for b in per_rank[:, list(counts).index("state_bytes")]],
               "ideal_bytes": ideal_bytes(VARIANTS[v].sharding, full, ctx.world_size),
               "oversubscribed": oversubscribed(ctx.world_size, ctx.device)}
        row["model_state_bytes"] = row["params_bytes"] + row["grads_bytes"] + row["state_bytes"]
        row["state_vs_ideal"] = row["model_state_bytes"] / row["ideal_bytes"]
        rows.append(row)
    del runs
    return rows + target_rows(rows)


def _round_p50s(samples: list[float], iters: int, rounds: int) -> list[float]:
    """The p50 of each round's iterations (``time_interleaved`` times a variant's rounds in order)."""
    rounds = max(1, min(rounds, iters))
    sizes = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
    starts = [sum(sizes[:r]) for r in range(rounds)]
    return [percentile(samples[s:s + k], 50) for s, k in zip(starts, sizes)]


def target_rows(rows: list[dict]) -> list[dict]:
    """Every target of every variant measured, as rows: the paired ratio and its verdict."""
    by_name = {row["variant"]: row for row in rows}
    out = []
    for row in rows:
        for other, limit in VARIANTS[row["variant"]].targets:
            if other in by_name:
                ratio = paired_ratio(row["round_p50_s"], by_name[other]["round_p50_s"])
                out.append({"model": row["model"], "world_size": row["world_size"], "target": f"{row['variant']} / {other}",
                            "limit": limit, "ratio": ratio, "verdict": "-" if limit is None else verdict(ratio, limit)})
        out.append({"model": row["model"], "world_size": row["world_size"], "target": f"{row['variant']} state / ideal",
                    "limit": TARGET_STATE_VS_IDEAL, "ratio": None,
                    "verdict": "met" if row["state_vs_ideal"] <= TARGET_STATE_VS_IDEAL else "missed",
                    "value": row["state_vs_ideal"]})
    return out


def worker(ctx, args) -> list[dict]:
    rows = []
    for name in progress(args.models, desc=f"{ctx.world_size} processes"):
        rows += benchmark_model(ctx, args, name, args.variants)
    return rows


# --------------------------------------------------------------------------- report


MIB = 2 ** 20
COLUMNS = [("world_size", "procs", "d"), ("model", "model", "s"), ("variant", "variant", "s"), ("p50_ms", "p50 ms", ".1f"),
           ("p95_ms", "p95 ms", ".1f"), ("exposed_ms", "exposed comm ms", ".1f"), ("params_mib", "params MiB", ".1f"),
           ("grads_mib", "grads MiB", ".1f"), ("state_mib", "opt state MiB", ".1f"), ("activation_mib", "activations MiB", ".1f"),
           ("peak_mib", "peak MiB", ".1f"), ("ideal_mib", "ideal MiB", ".1f"), ("state_vs_ideal", "states / ideal", ".2f")]


def report(rows: list[dict]) -> str:
    shown = []
    for row in (r for r in rows if "variant" in r):
        line = {**row, "p50_ms": row["p50_s"] * 1e3, "p95_ms": row["p95_s"] * 1e3,
                "exposed_ms": None if row["exposed_comm_s"] is None else row["exposed_comm_s"] * 1e3}
        for key in ("params", "grads", "state", "activation", "peak", "ideal"):
            line[f"{key}_mib"] = row[f"{key}_bytes"] / MIB
        line["world_size"] = f"{row['world_size']}{' (oversubscribed)' if row['oversubscribed'] else ''}"
        shown.append(line)
    columns = [("world_size", "procs", "s"), *COLUMNS[1:]]
    lines = [markdown_table(shown, columns), "", "targets (ratios: median of per-round p50 ratios, 95 % bootstrap CI):"]
    for row in (r for r in rows if "target" in r):
        value = format_ratio(row["ratio"]) if row["ratio"] else f"{row['value']:.2f}x"
        limit = "no target" if row["limit"] is None else f"target <= {row['limit']:.2f}"
        lines.append(f"  {row['world_size']} procs, {row['model']}: {row['target']} = {value} ({limit}): {row['verdict']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- entry points


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", help=f"process counts to spawn in turn; ignored under torchrun "
                        f"(default: {DEFAULTS['procs']}, quick {QUICK['procs']})")
    parser.add_argument("--models", nargs="+", choices=MODELS,
                        help=f"(default: {DEFAULTS['models']}, quick {QUICK['models']})")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=[v.name for v in VARIANTS.values() if v.default],
                        help="(default: %(default)s)")
    for flag, kind, text in (("batch-size", int, "samples per rank"), ("image-size", int, "resnet18 input side"),
                             ("gpt-vocab", int, "GPT vocabulary"), ("gpt-seq-len", int, "GPT tokens per sample"),
                             ("gpt-width", int, "GPT width"), ("gpt-depth", int, "GPT blocks"), ("gpt-heads", int, "GPT heads"),
                             ("iters", int, "timed iterations per variant"), ("rounds", int, "rounds they are split into"),
                             ("warmup", int, "untimed iterations first")):
        key = flag.replace("-", "_")
        parser.add_argument(f"--{flag}", type=kind, help=f"{text} (default: {DEFAULTS[key]}, quick {QUICK[key]})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small and fast settings (explicit flags win)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:  # explicit flags win over --quick
            setattr(args, key, value)
    if min(args.procs) < 1 or args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.batch_size < 1:
        parser.error("--procs, --iters, --rounds and --batch-size must be at least 1, --warmup at least 0")
    return args


def finish(rows: list[dict], env: dict, args) -> None:
    print(report(rows), flush=True)
    if args.json:
        write_results(args.json, BENCHMARK, env, {k: v for k, v in vars(args).items() if k != "json"}, rows)


def main(args: argparse.Namespace) -> list[dict]:
    if "RANK" in os.environ:
        with distributed(args.backend, args.timeout) as ctx:
            env = environment(ctx.backend, ctx.device, ctx.world_size)
            print0(format_environment(env))
            rows = worker(ctx, args)
            if ctx.is_master:
                finish(rows, env, args)
        return rows
    backend = resolve_backend(args.backend)
    device = "cuda" if backend == "nccl" else "cpu"
    env = environment(backend, device, max(args.procs), threads=1, procs=args.procs)
    print(format_environment(env) + f"\n* models {args.models}, variants {args.variants}", flush=True)
    rows = []
    for n in args.procs:
        rows += launch(worker, n, args, backend=backend, timeout_s=3600, pg_timeout_s=args.timeout)[0]
    finish(rows, env, args)
    return rows


if __name__ == "__main__":
    main(parse_args())
