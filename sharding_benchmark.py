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
on one axis only (engine, sharding, transport or an option: ``AXES``), so no ratio credits an engine with a
transport's gain. With one process there is no communication: only [torch] runs.

An iteration: forward, cross-entropy, backward, gradient synchronisation, ``AdamW.step``,
``zero_grad(set_to_none=True)``. Every variant is built once per model (same seed), warmed up, then
timed in rounds that interleave the variants; ratios are medians of per-round p50 ratios with 95 %
bootstrap intervals, judged met / missed / inconclusive against their targets. Memory is counted per
rank from the tensors it holds and what its transport holds for it (each variant has a transport of its own).
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
# At the top, before the process group exists: imported after it, one of its functions would keep the
# default group as a default argument after teardown (see process_groups.teardown).
from torch.distributed.optim import ZeroRedundancyOptimizer

from dpkit.bench.measure import (PeakMemory, format_ratio, gather_rows, oversubscribed, paired_ratio, percentile,
                                 round_p50s, saved_tensor_bytes, time_interleaved, verdict)
from dpkit import compat
from dpkit.bench import harness
from dpkit.bench import transport_choice
from dpkit.bench.results import markdown_table
from dpkit.comm import transport
from dpkit.comm.process_groups import add_common_args, parse_checked, progress
from dpkit.engines import registry, zero
from dpkit.engines.ddp import DDP, sync_gradients
from dpkit.engines.fsdp import FSDP
from dpkit.models import NUM_CLASSES, GPTConfig, build_model

MODELS = ("resnet18", "gpt")
LR = 1e-4  # AdamW; small, so many steps on random labels stay finite
DEFAULTS = dict(procs=[1, 2, 4], models=list(MODELS), batch_size=16, image_size=64, gpt_vocab=8192, gpt_seq_len=64,
                gpt_width=256, gpt_depth=4, gpt_heads=4, iters=30, rounds=6, warmup=3)
# Quick: the small GPT only, at every world size; --models adds resnet18 (run_experiments.py runs it at 2 ranks).
# Its variants: each engine target on [torch] and on [shared_memory], ZeRO / DDP, the transport ratios; no keep / bf16.
QUICK = dict(procs=[1, 2, 4], models=["gpt"], batch_size=4, image_size=32, gpt_vocab=2048, gpt_seq_len=32,
             gpt_width=128, gpt_depth=2, gpt_heads=4, iters=20, rounds=10, warmup=1,
             variants=["ddp ours [torch]", "ddp ours [shared_memory]", "ddp pytorch [torch]",
                       "ddp pytorch [shared_memory]", "zero1 ours [torch]", "zero1 ours [shared_memory]",
                       "zero2 ours [torch]", "zero2 ours [shared_memory]", "zero1 pytorch [torch]",
                       "fsdp ours [torch]", "fsdp ours [shared_memory]", "fsdp pytorch [torch]",
                       "fsdp pytorch [shared_memory]", "ddp pytorch [torch:dpkit]", "fsdp pytorch [torch:dpkit]"])
GPT_SIZE = ("gpt_vocab", "gpt_seq_len", "gpt_width", "gpt_depth", "gpt_heads")  # the GPT's "default size"
TARGET_VS_PYTORCH = 1.00  # ours / PyTorch's sec/iter: the same sharding on the same transport
TARGET_ZERO_VS_DDP = 1.05  # ZeRO / DDP sec/iter: the same engine on the same transport
TARGET_SHM_VS_TORCH = 0.85  # fully_shard on our shared memory / fully_shard on gloo, the GPT at its default size
TARGET_STATE_VS_IDEAL = 1.10  # per-rank held bytes (model states, engine buffers, transport memory) / ideal

# What a target's two variants differ in (one thing only); every target row names its axis.
AXES = {"engine": "ours / PyTorch's: the same sharding on the same transport",
        "sharding": "ZeRO (stage 1 or 2) / DDP: the same engine on the same transport",
        "transport": "one engine: shared memory or a \"dpkit\" process group / torch.distributed (gloo), or on a "
                     "communication thread / inline",
        "option": "one engine on one transport: an option / its default",
        "memory": "bytes a rank holds (model states, the engine's buffers, its transport's memory) / the ideal"}
# Where a target's limit holds (elsewhere its ratio is shown for information): a reader's phrase and a test.
SCOPES = {"gpt default": ("the GPT at its default size",
                          lambda model, args: (model == "gpt"
                                               and all(getattr(args, k) == DEFAULTS[k] for k in GPT_SIZE)))}
# A variant's transport, by the registry's name in its brackets, made for each variant of each model (a
# collective): "torch", torch.distributed's collectives (gloo, NCCL); "shared_memory", this host's shared memory
# in the caller's thread; "shared_memory:thread", the same on a communication thread; "torch:dpkit", PyTorch's
# engines unchanged on a new process group of the backend "dpkit" (its collectives, on that group).
SHARED, THREAD, ON_DPKIT = "shared_memory", "shared_memory:thread", "torch:dpkit"


# --------------------------------------------------------------------------- the variants


@dataclass
class Setup:
    """A built variant on this rank: the model to call, its optimizer, and what the benchmark asks of it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    exposed_s: Callable[[], float | None] = lambda: None  # the last iteration's exposed communication, if measurable
    kept: Callable[[], list[torch.Tensor]] = list  # buffers kept between iterations besides parameters and state
    state: Callable[[], list[torch.Tensor]] | None = None  # optimizer-state tensors (default: optimizer.state)
    settle: Callable[[], None] = lambda: None  # waits for communication an iteration leaves in flight
    grads: Callable[[], list[torch.Tensor]] | None = None  # what holds the gradients after backward (default: .grad)

    def state_tensors(self) -> list[torch.Tensor]:
        if self.state is not None:
            return self.state()
        return [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]

    def grad_tensors(self) -> list[torch.Tensor]:
        if self.grads is not None:
            return self.grads()
        return [p.grad for p in self.model.parameters() if p.grad is not None]


@dataclass(frozen=True)
class Target:
    """This variant's sec/iter over ``other``'s, which differs from it on ``axis`` only."""

    other: str  # a variant's name; without "[transport]": the one on this variant's transport
    axis: str  # a key of AXES
    limit: float | None = None  # at most this; None: for information
    scope: str | None = None  # a key of SCOPES: where the limit holds


@dataclass(frozen=True)
class Variant:
    name: str  # "<base> [<transport>]"
    base: str  # "zero1 ours", "fsdp pytorch keep", ...
    sharding: str  # the engine's name in dpkit.engines.registry: "ddp", "zero1", "zero2", "fsdp", ...
    transport: str  # a registry name (``transport_choice.choices()``)
    build: Callable[[nn.Module, transport.Transport], Setup]
    targets: tuple[Target, ...] = ()  # with full names
    default: bool = True  # measured unless --variants says otherwise


VARIANTS: dict[str, Variant] = {}
# Transport targets made for every engine on two transports: shared memory against torch.distributed's,
# the communication thread against the caller's thread.
COMPARED_WITH = {SHARED: "torch", THREAD: SHARED, ON_DPKIT: "torch"}
# Bases that take any transport object (those registered on shared memory): "base [t]" for any registry name t is
# made on request (``select``), so a transport registered anywhere runs under every such engine.
OPEN: dict[str, tuple] = {}
ON_REQUEST: set[str] = set()  # the "base [t]" variants ``select`` made for a transport asked for by name


def variant(base: str, sharding: str, on: tuple[str, ...] = ("torch", SHARED), targets: tuple[Target, ...] = (),
            default: tuple[str, ...] = ("torch", SHARED)):
    """Register a builder ``f(module, transport) -> Setup`` (module: seeded, on this rank's device) as
    "base [t]" for each transport ``t`` of ``on`` (measured by default on those of ``default``).

    A target's other variant without "[...]" is taken on the same transport, so an engine or sharding
    target never compares two transports. Every "[shared_memory]" variant is also compared with its "[torch]"
    self and every "[shared_memory:thread]" one with its "[shared_memory]" self (axis "transport"; for
    information unless a target says so)."""
    def register(build):
        if SHARED in on:
            OPEN[base] = (sharding, build, targets, on)
        for t in on:
            _add(base, sharding, t, build, targets, on, t in default)
        return build
    return register


def _add(base: str, sharding: str, t: str, build, targets: tuple[Target, ...], on: tuple[str, ...],
         default: bool) -> None:
    own = [replace(x, other=x.other if x.other.endswith("]") else f"{x.other} [{t}]") for x in targets]
    other = COMPARED_WITH.get(t)
    if other in on and not any(x.other == f"{base} [{other}]" for x in own):
        own.append(Target(f"{base} [{other}]", "transport"))
    own = [x for x in own if x.other != f"{base} [{t}]"]  # e.g. a transport target of its own transport
    VARIANTS[f"{base} [{t}]"] = Variant(f"{base} [{t}]", base, sharding, t, build, tuple(own), default)


def select(names: list[str]) -> list[str]:
    """Variant names: each as given, or a name without "[transport]" as that variant on every transport it has.
    A bracket takes any name of the transport registry; an unknown one is a ValueError that lists them."""
    from_registry()
    out, made = [], []
    for name in names:
        base, bracket, t = name.rstrip("]").partition(" [")
        if bracket:
            name = f"{base} [{transport_choice.checked(t)}]"
            if name not in VARIANTS and base in OPEN:  # an open engine on a transport not built in here
                sharding, build, targets, on = OPEN[base]
                _add(base, sharding, name.rstrip("]").partition(" [")[2], build,
                     tuple(x for x in targets if not x.other.endswith("]")), on, False)
                made.append(name)
                ON_REQUEST.add(name)
        # A name alone: its built-in transports; one made on request is this call's (its transport may be gone)
        matches = [name] if name in VARIANTS else [v.name for v in VARIANTS.values()
                                                   if v.base == name and v.name not in ON_REQUEST]
        if not matches:
            bases = ", ".join(dict.fromkeys(v.base for v in VARIANTS.values()))
            raise ValueError(f"unknown variant {name!r}: choose among {bases} (each on its transports, e.g. "
                             f"'fsdp ours [shared_memory]'; {', '.join(OPEN)} on any of "
                             f"{', '.join(transport_choice.choices())}; without brackets: every transport it runs on)")
        out += [m for m in matches if m not in out]
    for name in made:  # as for the built-in ones: a target whose other variant does not exist is dropped
        kept = tuple(t for t in VARIANTS[name].targets if t.other in VARIANTS)
        VARIANTS[name] = replace(VARIANTS[name], targets=kept)
    return out


def runnable(names: list[str], world_size: int, device: torch.device) -> list[str]:
    """The variants this world can run: one process has no communication (only [torch] runs), and shared memory
    takes CPU tensors."""
    return [v for v in names if VARIANTS[v].transport == "torch" or (world_size > 1 and device.type == "cpu")]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _pytorch_ddp(module: nn.Module, wire: transport.Transport) -> nn.Module:
    """PyTorch's DDP: its own all-reduce on [torch] and [torch:dpkit] (on that transport's group), our transport
    through its communication hook otherwise."""
    own = isinstance(wire, transport.Torch)
    model = nn.parallel.DistributedDataParallel(module, process_group=wire.group if own else None,
                                                **compat.NO_BUFFER_SYNC)  # like ours: buffers synced once
    if not own:
        model.register_comm_hook(wire, transport.ddp_comm_hook)  # averages each bucket, as its own does
    return model


def _reducer_buckets(model: nn.parallel.DistributedDataParallel) -> list[torch.Tensor]:
    """Tensors the size of PyTorch's DDP's gradient buckets, which it keeps between iterations as ours does.

    Its Reducer allocates one flat tensor per bucket at construction (again when it rebuilds them after
    the first iteration) and keeps it; with ``gradient_as_bucket_view=False`` (the default, used here)
    that is besides ``param.grad``, copied into the bucket and back. Left out, PyTorch's peak would lack
    the bucket bytes that ours counts. No public API reaches the buckets: the Reducer's private one
    returns zeros of their sizes (allocated while counting, outside ``PeakMemory``)."""
    return [bucket.buffer() for bucket in model.reducer._get_zeros_like_grad_buckets()]


@variant("ddp ours", "ddp", on=("torch", SHARED, THREAD),
         targets=(Target("ddp pytorch", "engine", TARGET_VS_PYTORCH),))
def ddp_ours(module: nn.Module, wire: transport.Transport) -> Setup:
    model = DDP(module, transport=wire)
    # kept: the buckets (the transport's), which hold the gradients
    return Setup(model, adamw(model.parameters()), exposed_s=lambda: model.last_wait_s,
                 kept=lambda: [b.flat for b in model.buckets])


@variant("ddp pytorch", "ddp", on=("torch", SHARED, ON_DPKIT), default=("torch", SHARED, ON_DPKIT))
def ddp_pytorch(module: nn.Module, wire: transport.Transport) -> Setup:
    model = _pytorch_ddp(module, wire)
    return Setup(model, adamw(model.parameters()), kept=lambda: _reducer_buckets(model))


def _zero_ours(module: nn.Module, wire: transport.Transport, overlap_forward: bool = True, **options) -> Setup:
    """Our DDP and our ZeRO over it, on one transport; ``overlap_forward``: the all-gathers overlap the next
    forward (``ShardedOptimizer.overlap_with_forward``), else step() waits for them."""
    model = DDP(module, transport=wire)
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, transport=wire, **options)
    if overlap_forward:
        optimizer.overlap_with_forward(model)
    return Setup(model, optimizer, exposed_s=lambda: model.last_wait_s + optimizer.last_share_s,
                 kept=lambda: [b.flat for b in model.buckets]  # gradient buckets, then each all-gather buffer
                 + [b.buffer for b in optimizer.buckets if b.buffer is not None],
                 settle=optimizer.wait_for_parameters)  # overlap_with_forward: all-gathers still on their way


@variant("zero1 ours", "zero1", on=("torch", SHARED, THREAD),
         targets=(Target("zero1 pytorch", "engine", TARGET_VS_PYTORCH),
                  Target("ddp ours", "sharding", TARGET_ZERO_VS_DDP)))
def zero_ours(module: nn.Module, wire: transport.Transport) -> Setup:
    return _zero_ours(module, wire)


@variant("zero1 ours in step", "zero1", targets=(Target("zero1 ours", "option"),), default=())
def zero_ours_in_step(module: nn.Module, wire: transport.Transport) -> Setup:
    """The default ShardedOptimizer: step() waits (only the update of later buckets overlaps the all-gathers)."""
    return _zero_ours(module, wire, overlap_forward=False)


@variant("zero1 ours broadcast", "zero1", on=("torch",), targets=(Target("zero1 ours", "option"),), default=())
def zero_ours_broadcast(module: nn.Module, wire: transport.Transport) -> Setup:
    """The alternative update: one torch.distributed broadcast per owner instead of the all-gather (measured, not
    chosen). The broadcasts bypass the transport: only [torch] compares them with the default alone."""
    setup = _zero_ours(module, wire)
    setup.optimizer.update = "broadcast"
    return setup


@variant("zero1 ours tensor", "zero1", targets=(Target("zero1 ours", "option"),), default=())
def zero_ours_tensor(module: nn.Module, wire: transport.Transport) -> Setup:
    """Whole tensors per rank (exact for per-tensor optimizers): uneven when one tensor is a large part of the model."""
    return _zero_ours(module, wire, partition="tensor")


@variant("zero2 ours", "zero2", targets=(Target("zero1 ours", "option"), Target("ddp ours", "sharding")))
def zero2_ours(module: nn.Module, wire: transport.Transport) -> Setup:
    """ZeRO stage 2: no DDP; the optimizer's hooks reduce-scatter each bucket's gradients to their owners during
    backward (each rank keeps 1/n of them), its step all-gathers the parameters, overlapping the next forward."""
    optimizer = zero.ShardedOptimizer(module.parameters(), torch.optim.AdamW, lr=LR, transport=wire, stage=2)
    optimizer.overlap_with_forward(module)
    return Setup(module, optimizer, exposed_s=lambda: optimizer.last_reduce_wait_s + optimizer.last_share_s,
                 kept=lambda: optimizer.reduce_pool() + optimizer.gradient_shares(),  # (2, slot bytes), (width,)
                 settle=optimizer.wait_for_parameters, grads=optimizer.gradient_shares)


@variant("zero1 pytorch", "zero1", on=("torch",), targets=(Target("ddp pytorch", "sharding", TARGET_ZERO_VS_DDP),),
         default=("torch",))
def zero_pytorch(module: nn.Module, wire: transport.Transport) -> Setup:
    """ZeroRedundancyOptimizer over PyTorch's DDP: it broadcasts the updated parameters through torch.distributed
    itself, so it cannot take our transport: [torch] only (ours is compared with it there)."""
    model = _pytorch_ddp(module, wire)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return Setup(model, optimizer, kept=lambda: _reducer_buckets(model),
                 state=lambda: [t for s in optimizer.optim.state.values() for t in s.values()
                                if torch.is_tensor(t)])  # its local optimizer's


# FSDP shards these layers (ours and PyTorch's alike): every linear and embedding layer of the GPT, every
# convolution and the classifier of resnet18; norms stay replicated.
FSDP_SHARD_TYPES = (nn.Linear, nn.Embedding, nn.Conv2d)


def _fsdp_ours(module: nn.Module, wire: transport.Transport, **options) -> Setup:
    model = FSDP(module, shard_types=FSDP_SHARD_TYPES, transport=wire, **options)
    return Setup(model, adamw(model.parameters()), exposed_s=lambda: model.last_wait_s,
                 kept=lambda: [b.flat for b in model.replicated_buckets])  # the replicated parameters' gradients


def _fsdp_pytorch(module: nn.Module, wire: transport.Transport, compute_dtype=None,
                  reshard_after_forward=True) -> Setup:
    """``fully_shard`` on each ``FSDP_SHARD_TYPES`` layer, then the root (its norms), as ours shards; on a
    transport other than [torch], its all-gathers and reduce-scatters through it (``use_with_fully_shard``)."""
    # Like ours: each sharded layer's floating inputs cast to the compute dtype and its outputs back to
    # float32, the root's norms in float32. By default the outputs would stay in the compute dtype and
    # the root's parameters would be cast too: norms, logits and loss in it, a smaller computation.
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                  output_dtype=None if compute_dtype is None else torch.float32)
    mesh = _mesh(wire, module)
    for layers in _tied_groups([m for m in module.modules() if isinstance(m, FSDP_SHARD_TYPES)]):
        # fully_shard refuses a parameter in two groups: layers sharing one (GPT's head and embedding) form one
        fully_shard(layers if len(layers) > 1 else layers[0], mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    model = fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    if not isinstance(wire, transport.Torch) and transport.use_with_fully_shard(model, wire) == 0:
        raise RuntimeError("no FSDPModule took the transport")
    return Setup(model, adamw(model.parameters()))


def _mesh(wire: transport.Transport, module: nn.Module) -> DeviceMesh | None:
    """fully_shard's mesh on [torch:dpkit]: the transport's own group ("dpkit"); else None (the default group's)."""
    if not isinstance(wire, transport.Torch) or wire.group is None:
        return None
    return DeviceMesh.from_group(wire.group, next(module.parameters()).device.type)


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


for _name, _options in (("", {}), (" keep", dict(reshard_after_forward=False)),
                        (" bf16", dict(compute_dtype=torch.bfloat16)),
                        (" bf16 keep", dict(compute_dtype=torch.bfloat16, reshard_after_forward=False))):
    # "keep": reshard_after_forward=False (gathered once per step, kept for backward); "bf16": gathered
    # and computed in bfloat16, float32 master shards, gradients and AdamW. The bf16 keep pair is opt-in.
    # Ours also on a communication thread ([shared_memory:thread]: what overlap buys on a CPU host).
    _default = () if _name == " bf16 keep" else ("torch", SHARED)
    variant(f"fsdp ours{_name}", "fsdp", on=("torch", SHARED, THREAD) if not _name else ("torch", SHARED),
            targets=(Target(f"fsdp pytorch{_name}", "engine", TARGET_VS_PYTORCH),),
            default=_default)(functools.partial(_fsdp_ours, **_options))
    # The transport's target: fully_shard on our shared memory, and on a "dpkit" process group, against fully_shard
    # on gloo, at the GPT's default size.
    variant(f"fsdp pytorch{_name}", "fsdp", default=_default + ((ON_DPKIT,) if not _name else ()),
            on=("torch", SHARED, ON_DPKIT) if not _name else ("torch", SHARED),
            targets=((Target("fsdp pytorch [torch]", "transport", TARGET_SHM_VS_TORCH, "gpt default"),)
                     if not _name else ())
            )(functools.partial(_fsdp_pytorch, **_options))
# A target on a transport its other variant does not run on (no "zero1 pytorch [shared_memory]") is dropped.
VARIANTS.update({name: replace(v, targets=tuple(t for t in v.targets if t.other in VARIANTS))
                 for name, v in VARIANTS.items()})


def _registered(engine: str, impl: str, module: nn.Module, wire: transport.Transport) -> Setup:
    """An engine of the registry that has no builder above: its own wrap and optimizer, nothing more measured."""
    model = registry.wrap(engine, impl, module, wire, registry.Options(shard_types=FSDP_SHARD_TYPES))
    return Setup(model, registry.optimizer(engine, impl, model, torch.optim.AdamW, wire, lr=LR))


def from_registry() -> None:
    """Add "<engine> <impl>" on [torch] and [shared_memory] (opt-in) for every registered engine and implementation
    that no builder above covers, and drop the variants made on request and those of an engine or transport no
    longer registered; called again where names are read, so an engine registered later appears."""
    gone = [n for n, v in VARIANTS.items() if n in ON_REQUEST or v.sharding not in registry.names()
            or v.transport not in transport_choice.choices()]
    for name in gone:  # made on request (``select`` makes them again), or an engine or transport unregistered since
        del VARIANTS[name]
        ON_REQUEST.discard(name)
    built = {v.base for v in VARIANTS.values()}
    for engine in registry.names():
        for impl in registry.get(engine).impls:
            if f"{engine} {impl}" not in built:
                variant(f"{engine} {impl}", engine, default=())(functools.partial(_registered, engine, impl))


from_registry()


def ideal_bytes(sharding: str, full: dict, n: int) -> int:
    """Model-state bytes one rank must hold: parameters, gradients and optimizer state of the whole model (``full``),
    by what the engine ``sharding`` shards (its ZeRO stage in the registry)."""
    p, g, s = full["params"], full["grads"], full["state"]
    shards = registry.get(sharding).shards
    if shards == 0:  # DDP
        return p + g + s
    if shards == 1:  # the optimizer state sharded
        return p + g + s // n
    if shards == 2:  # the gradients too
        return p + (g + s) // n
    return (p + g + s) // n + full["largest_unit"]  # everything sharded, one unit gathered at a time


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


def _in_transport(t: torch.Tensor, wire: transport.Transport) -> bool:
    """Whether ``t``'s storage lies in memory ``transport`` holds itself (asked of the whole storage)."""
    t = _local(t)
    storage = t.untyped_storage()
    return storage.nbytes() > 0 and wire.owns(t.new_empty(0, dtype=torch.uint8).set_(storage))


def held_bytes(tensors, wire: transport.Transport) -> int:
    """Bytes held by ``tensors`` (distinct storages) and by ``transport`` for them: the memory of its own
    (``Transport.held_bytes``: a shared-memory arena's pages in /dev/shm, with the buffers that lie there,
    counted once, its staging block, and blocks freed whose pages it keeps)."""
    outside = [t for t in tensors if t is not None and not _in_transport(t, wire)]
    return storage_bytes(outside) + wire.held_bytes()


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
    """A built variant with its batch and transport; ``step()`` is one iteration, ``exposed`` its exposed
    communication."""

    setup: Setup
    transport: transport.Transport
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
        """One untimed iteration, counting what this rank holds (with what its transport holds for it, see
        ``held_bytes``); then one under PeakMemory."""
        model, optimizer = self.setup.model, self.setup.optimizer
        params = list(model.parameters())
        box = []
        activations = saved_tensor_bytes(lambda: box.append(self.forward()), exclude=[_local(p) for p in params])
        box[0].backward()
        sync_gradients(model)
        grads = self.setup.grad_tensors()
        # Model state and what holds it, with the gradients in: the engine's buffers and its transport's memory.
        held = held_bytes([*params, *grads, *self.setup.state_tensors(), *self.setup.kept()], self.transport)
        counts = {"params_bytes": storage_bytes(params), "grads_bytes": storage_bytes(grads)}
        del grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts.update(state_bytes=storage_bytes(self.setup.state_tensors()), activation_bytes=activations,
                      model_state_bytes=held)
        kept = held_bytes([*params, *self.setup.state_tensors(), *self.setup.kept()], self.transport)
        before = self.transport.held_bytes()
        with PeakMemory(device) as peak:
            self.step()
            # Nothing may still run when the profiler stops: a gloo collective launched under it and finished
            # after it (ZeRO's all-gathers on [torch]) leaves a worker process crashing later (SIGSEGV in
            # the profiler's ThreadLocalSubqueue destructor, when the collective's handle is freed).
            self.setup.settle()
        # PeakMemory sees torch's allocator only. An arena keeps its pages: the blocks the iteration took in
        # /dev/shm lie in what ``kept`` counted already, or grew it.
        counts["peak_bytes"] = kept + peak.bytes + self.transport.held_bytes() - before
        counts["shared_peak_bytes"] = self.transport.held_bytes()
        return counts


# --------------------------------------------------------------------------- one model, every variant


def benchmark_model(ctx, args, name: str, names: list[str]) -> list[dict]:
    """Build every variant, time them in interleaved rounds, count their memory; rows for this model."""
    names = runnable(names, ctx.world_size, ctx.device)
    batch = make_batch(name, args, ctx.rank, ctx.device)
    full = full_sizes(fresh_module(name, args, ctx.device))
    # A transport per variant (made in the variants' order on every rank): what one holds (a shared-memory
    # arena's pages, its staging block) is then its variant's alone, counted with it.
    made: dict[str, transport.Transport] = {}
    try:
        runs = {}
        for v in names:
            made[v] = transport_choice.new(VARIANTS[v].transport, ctx.device)
            runs[v] = Run(VARIANTS[v].build(fresh_module(name, args, ctx.device), made[v]), made[v], *batch)
        timings = time_interleaved({v: runs[v].step for v in names}, args.iters, args.warmup, rounds=args.rounds,
                                   device=ctx.device)
        rows = [_row(ctx, args, name, v, runs[v], timings[v].samples, full) for v in names]
        del runs
    finally:
        for t in made.values():
            t.close()
    return rows + target_rows(rows, args)


def _row(ctx, args, name: str, v: str, run: Run, samples: list[float], full: dict) -> dict:
    counts = run.memory(ctx.device)
    per_rank = gather_rows(list(counts.values()))  # (world, counts)
    worst = per_rank.max(0).values.tolist()  # each count's maximum over ranks
    exposed = gather_rows(run.exposed[-args.iters:]).max(0).values.tolist()
    row = {"model": name, "world_size": ctx.world_size, "variant": v, "sharding": VARIANTS[v].sharding,
           "transport": VARIANTS[v].transport, "transport_detail": run.transport.describe(),
           "p50_s": percentile(samples, 50), "p95_s": percentile(samples, 95),
           "round_p50_s": round_p50s(samples, args.iters, args.rounds),
           "exposed_comm_s": None if any(e != e for e in exposed) else percentile(exposed, 50),
           **{key: int(value) for key, value in zip(counts, worst)},
           "state_bytes_per_rank": [int(b) for b in per_rank[:, list(counts).index("state_bytes")]],
           "grads_bytes_per_rank": [int(b) for b in per_rank[:, list(counts).index("grads_bytes")]],
           "ideal_bytes": ideal_bytes(VARIANTS[v].sharding, full, ctx.world_size),
           "oversubscribed": oversubscribed(ctx.world_size, ctx.device)}
    row["state_vs_ideal"] = row["model_state_bytes"] / row["ideal_bytes"]
    return row


def target_rows(rows: list[dict], args) -> list[dict]:
    """Every target of every variant measured (its other variant measured too), as rows (no "variant" key: that
    marks the measured rows): the paired ratio, its axis and verdict; a limit outside its scope is shown for
    information (verdict "-")."""
    by_name = {row["variant"]: row for row in rows}
    out = []
    for row in rows:
        where = {"model": row["model"], "world_size": row["world_size"]}
        for target in VARIANTS[row["variant"]].targets:
            if target.other not in by_name:
                continue
            ratio = paired_ratio(row["round_p50_s"], by_name[target.other]["round_p50_s"])
            phrase, applies = SCOPES[target.scope] if target.scope else (None, lambda model, args: True)
            limit = target.limit if applies(row["model"], args) else None
            out.append({**where, "target": f"{row['variant']} / {target.other}", "axis": target.axis,
                        "numerator": row["variant"], "denominator": target.other, "limit": limit, "ratio": ratio,
                        "verdict": "-" if limit is None else verdict(ratio, limit),
                        "scope": phrase, "scoped_limit": target.limit if phrase else None})
        out.append({**where, "target": f"{row['variant']} state / ideal", "axis": "memory", "numerator": row["variant"],
                    "limit": TARGET_STATE_VS_IDEAL, "ratio": None,
                    "verdict": "met" if row["state_vs_ideal"] <= TARGET_STATE_VS_IDEAL else "missed",
                    "value": row["state_vs_ideal"]})
    return out


def worker(ctx, args) -> list[dict]:
    select(args.variants)  # in this process: engines registered since the import, variants made on request
    rows = []
    for name in progress(args.models, desc=f"{ctx.world_size} processes"):
        rows += benchmark_model(ctx, args, name, args.variants)
        harness.keep(ctx, rows)
    return rows


# --------------------------------------------------------------------------- report


MIB = 2 ** 20
COLUMNS = [("world_size", "procs", "s"), ("model", "model", "s"), ("variant", "variant", "s"),
           ("p50_ms", "p50 ms", ".1f"), ("p95_ms", "p95 ms", ".1f"), ("exposed_ms", "exposed comm ms", ".1f"),
           ("params_mib", "params MiB", ".1f"), ("grads_mib", "grads MiB", ".1f"),
           ("grads_per_rank_mib", "grads MiB per rank", "s"), ("state_mib", "opt state MiB", ".1f"),
           ("activation_mib", "activations MiB", ".1f"), ("peak_mib", "peak MiB", ".1f"),
           ("shared_peak_mib", "/dev/shm MiB", ".1f"), ("model_state_mib", "held MiB", ".1f"),
           ("ideal_mib", "ideal MiB", ".1f"), ("state_vs_ideal", "held / ideal", ".2f")]
MEMORY_NOTES = """\
memory, per rank (the largest rank), counted from the tensors it holds after one untimed iteration (distinct
storages: a tied weight or a bucket holding every gradient counts once): parameters (ZeRO's, at stages 1 and 2,
are views of its all-gather buffers: those, padding included); gradients (after synchronisation; "per rank": each
rank's, in rank order; ZeRO stage 2 keeps only its share's, with a used-flag per piece); optimizer state;
activations (what autograd saves in forward, parameters excluded: the gathered weights count for fully_shard,
whose saved tensors they are, and for ours with keep, not for ours resharding, which gathers them again in
backward). Held = everything the variant holds with its gradients in: parameters, gradients, optimizer state,
its own buffers (DDP's buckets, ours and PyTorch's; ZeRO's all-gather buffers, stage 2's reduce-scatter pool)
and what its transport holds for it (every variant has a transport of its own: for shared memory, the pages of
its arena in /dev/shm, which hold the buffers it allocated, its staging block and the blocks it took during
iterations, kept for reuse; a memory profiler does not see them; on [torch:dpkit] the backend's slots, two of
``slots.SLOT_BYTES`` per rank and group in /dev/shm, are the group's and not counted). Peak = the same between
iterations (gradients freed) + the most bytes torch's allocator held above it during an iteration + the pages the
arena grew by during it. "/dev/shm MiB": the transport's pages in /dev/shm (``Transport.held_bytes``).
Ideal = the model states (parameters + gradients + AdamW's two moments) a rank must hold: all of them for
DDP, 1/n of the optimizer state for ZeRO (stage 2: and of the gradients), 1/n of everything plus the largest
gathered unit for FSDP; "held / ideal" (the memory target) counts every byte an engine or its transport
keeps beside them against it."""


def report(rows: list[dict]) -> str:
    shown = []
    for row in (r for r in rows if "variant" in r):
        line = {**row, "p50_ms": row["p50_s"] * 1e3, "p95_ms": row["p95_s"] * 1e3,
                "exposed_ms": None if row["exposed_comm_s"] is None else row["exposed_comm_s"] * 1e3}
        for key in ("params", "grads", "state", "activation", "peak", "shared_peak", "model_state", "ideal"):
            line[f"{key}_mib"] = row[f"{key}_bytes"] / MIB
        line["world_size"] = f"{row['world_size']}{' (oversubscribed)' if row['oversubscribed'] else ''}"
        if row.get("grads_bytes_per_rank") is not None:  # (absent from files written before it was recorded)
            line["grads_per_rank_mib"] = " / ".join(f"{b / MIB:.2f}" for b in row["grads_bytes_per_rank"])
        shown.append(line)
    fallbacks = sorted({f"{r['variant']}: {r['transport_detail']}" for r in rows
                        if "transport_detail" in r and "through torch" in r["transport_detail"]})
    lines = [markdown_table(shown, COLUMNS), ""]
    if fallbacks:
        lines += ["NOTE: /dev/shm had no room, these shared-memory variants went through torch.distributed: "
                  + "; ".join(fallbacks), ""]
    lines.append("targets by axis (ratios: median of per-round p50 ratios, 95 % bootstrap CI):")
    targets = [r for r in rows if "target" in r]
    for axis, meaning in AXES.items():
        mine = [r for r in targets if r["axis"] == axis]
        if mine:
            lines.append(f"  {axis} ({meaning}):")
        for row in mine:
            value = format_ratio(row["ratio"]) if row["ratio"] else f"{row['value']:.2f}x"
            if row["limit"] is not None:
                limit = f"target <= {row['limit']:.2f}"
            elif row.get("scope"):
                limit = f"target <= {row['scoped_limit']:.2f} on {row['scope']} only: for information here"
            else:
                limit = "for information"
            lines.append(f"    {row['world_size']} procs, {row['model']}: {row['target']} = {value} ({limit}): "
                         f"{row['verdict']}")
    return "\n".join(lines + ["", MEMORY_NOTES])


# --------------------------------------------------------------------------- entry points


def parse_args(argv=None) -> argparse.Namespace:
    from_registry()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", help=f"process counts to spawn in turn; ignored under torchrun "
                        f"(default: {DEFAULTS['procs']}, quick {QUICK['procs']})")
    parser.add_argument("--models", nargs="+", choices=MODELS,
                        help=f"(default: {DEFAULTS['models']}, quick {QUICK['models']})")
    defaults = [v.name for v in VARIANTS.values() if v.default]
    parser.add_argument("--variants", nargs="+", metavar="VARIANT",
                        help="each 'name [transport]' (quoted), or a name alone for every transport it runs on; names: "
                             f"{', '.join(dict.fromkeys(v.base for v in VARIANTS.values()))}; transports: "
                             f"{', '.join(transport_choice.choices())} (the registry's; not with one process, nor on "
                             "GPUs). Default: every name on [torch] and [shared_memory] (zero1 pytorch on [torch] "
                             "only), but the opt-in "
                             f"{', '.join(v.name for v in VARIANTS.values() if not v.default)}; quick: "
                             f"{', '.join(QUICK['variants'])}")
    for flag, kind, text in (("batch-size", int, "samples per rank"), ("image-size", int, "resnet18 input side"),
                             ("gpt-vocab", int, "GPT vocabulary"), ("gpt-seq-len", int, "GPT tokens per sample"),
                             ("gpt-width", int, "GPT width"), ("gpt-depth", int, "GPT blocks"),
                             ("gpt-heads", int, "GPT heads"), ("iters", int, "timed iterations per variant"),
                             ("rounds", int, "rounds they are split into"),
                             ("warmup", int, "untimed iterations first")):
        key = flag.replace("-", "_")
        parser.add_argument(f"--{flag}", type=kind, help=f"{text} (default: {DEFAULTS[key]}, quick {QUICK[key]})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small and fast settings (explicit flags win)")
    add_common_args(parser)
    args = parse_checked(parser, argv)
    for key, value in ({**DEFAULTS, "variants": defaults} if not args.quick else QUICK).items():
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
