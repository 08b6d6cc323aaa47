"""The rows of ``ddp_benchmark.py``: each DDP variant, named as the engine registry names rows, at its bucket sizes
and on its transports, and the order the rounds run them in.

    variants = variants_for(kinds(), [25.0], ["torch", "shared_memory"])   # no ddp first, then every kind
    variants[1].label                                                       # "ddp pytorch 25M [torch]"
    variants[1].fields("staged")                                            # {"engine": "ddp", "impl": ...}
    for round_, variant in schedule(variants, rounds=4): ...                # rotated from round to round
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from dpkit.bench import row_identity
from dpkit.bench.ddp_step import DDP_FIELDS, DDP_KINDS, OURS, PYTORCH, PYTORCH_BEST_KIND, PYTORCH_DEFAULT_BUCKET_MB
from dpkit.engines import registry


def registered_kinds() -> tuple[str, ...]:
    """The variants of the DDP engines registered beside our own ("toy ours" for an engine "toy" that shards
    nothing, with our implementation: ``engines.registry``): each runs as ``ddp ours`` does, wrapped by the
    registry, at PyTorch's default bucket cap, on every transport but "torch:dpkit"."""
    return tuple(f"{name} ours" for name in registry.names("ours")
                 if name != "ddp" and registry.get(name).shards == 0 and not registry.get(name).hybrid)


def kinds() -> tuple[str, ...]:
    """Every variant this benchmark can run, in row order: the built-in ones, then the registered engines'."""
    return (*DDP_KINDS, *registered_kinds())


def variant(kind: str, bucket_mb: float | None = None, transport: str | None = None) -> "Variant":
    """The variant ``kind`` names ("ddp pytorch best", "toy ours") at a bucket cap, on a transport."""
    fields = DDP_FIELDS.get(kind) or (kind.removesuffix(" ours"), "ours", None)  # a registered engine's: ours
    return Variant(*fields, bucket_mb, transport)


# How the gradients travel (a column of every row), by the registry's names (``transport_choice.choices()``):
# "torch", torch.distributed's collectives on the process group's backend (gloo here, NCCL on GPUs);
# "shared_memory", this host's shared memory, summed in the caller's thread; "shared_memory:thread", the same on
# a communication thread (asynchronous, so it can overlap); "torch:dpkit", torch.distributed's collectives on a
# process group of the backend "dpkit", which only PyTorch's DDP runs on (as its process group).
SHARED, THREAD, ON_DPKIT = "shared_memory", "shared_memory:thread", "torch:dpkit"
CPU_TRANSPORTS = ("torch", SHARED)  # the default on a CPU; on a GPU only "torch"
ASYNCHRONOUS = ("torch", THREAD)  # the transports whose sums can hide behind backward


@dataclass(frozen=True)
class Variant:
    """One row of a benchmark block: the engine (None: no DDP, the model alone), its implementation and option
    as the registry names them, its bucket size in MiB and the transport its gradients travel through (a
    registry name; None for no DDP)."""

    engine: str | None = None
    impl: str | None = None
    option: str | None = None  # "best", "naive", "flat", "overlap"; None: the engine as it is
    bucket_mb: float | None = None  # ddp ours, ddp pytorch and registered engines; 0 for ddp ours overlap
    transport: str | None = None

    def fields(self, path: str | None = None) -> dict:
        """The row's identity (``rows.IDENTITY``), with the ``path`` the benchmark recorded on shared memory."""
        return {"engine": self.engine, "impl": self.impl, "option": self.option, "bucket_cap_mb": self.bucket_mb,
                "transport": self.transport, "path": path}

    @property
    def kind(self) -> str:
        return row_identity.name(self.fields())  # "ddp pytorch best", "no ddp": --variants' names

    @property
    def label(self) -> str:
        return row_identity.label(self.fields())

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
    variants, registered = [Variant()], registered_kinds()
    for kind in (k for k in (*DDP_KINDS, *registered) if k in kinds):
        inline = [t for t in transports if t not in (THREAD, ON_DPKIT)]
        if kind == PYTORCH:
            variants += [variant(kind, mb, "torch") for mb in sorted({PYTORCH_DEFAULT_BUCKET_MB, *bucket_sizes})]
        elif kind == PYTORCH_BEST_KIND:
            variants += [variant(kind, PYTORCH_DEFAULT_BUCKET_MB, t) for t in [*inline, ON_DPKIT] if t in transports]
        elif kind == OURS:
            variants += [variant(kind, mb, t) for t in transports if t != ON_DPKIT for mb in bucket_sizes]
        elif kind in registered:
            variants += [variant(kind, PYTORCH_DEFAULT_BUCKET_MB, t) for t in transports if t != ON_DPKIT]
        else:
            overlap = kind == "ddp ours overlap"
            variants += [variant(kind, 0.0 if overlap else None, t)
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


def default_transports(args: argparse.Namespace, device: torch.device) -> list[str]:
    """--transports, or every transport the device can use: shared memory only for CPU tensors."""
    if args.transports:
        return list(args.transports)
    return list(CPU_TRANSPORTS if device.type == "cpu" else ("torch",))
