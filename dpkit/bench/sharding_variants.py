"""The variants of ``sharding_benchmark.py``: a registered engine (``dpkit.engines.registry``), an implementation
("ours" or "pytorch"), an optional option word and a transport (``transport_choice``), each with its builder
(``sharding_setups``) and its targets, by label "<engine> <impl>[ <option>] [<transport>]" (``label``).

    names = select(["fsdp pytorch", "zero1 ours [shared_memory]"])   # a name without brackets: every transport
    VARIANTS[names[0]].engine, VARIANTS[names[0]].impl                # "fsdp", "pytorch"

Every engine and implementation of the registry is a variant ("toy ours" once a test registers "toy"); those with
no builder of their own run as the registry wraps them (``sharding_setups.registered``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from dpkit.bench import row_identity
from dpkit.bench import sharding_setups as setups
from dpkit.bench import transport_choice
from dpkit.bench.sharding_setups import Setup
from dpkit.bench.sharding_targets import TARGET_SHM_VS_TORCH, TARGET_VS_PYTORCH, TARGET_ZERO_VS_DDP, Target
from dpkit.comm import transport
from dpkit.engines import registry

# A variant's transport, by the registry's name in its brackets, made for each variant of each model (a
# collective): "torch", torch.distributed's collectives (gloo, NCCL); "shared_memory", this host's shared memory
# in the caller's thread; "shared_memory:thread", the same on a communication thread; "torch:dpkit", PyTorch's
# engines unchanged on a new process group of the backend "dpkit" (its collectives, on that group).
TORCH, SHARED, THREAD, ON_DPKIT = "torch", "shared_memory", "shared_memory:thread", "torch:dpkit"
# Transport targets made for every engine on two transports: shared memory against torch.distributed's,
# the communication thread against the caller's thread.
COMPARED_WITH = {SHARED: TORCH, THREAD: SHARED, ON_DPKIT: TORCH}
FIELDS = ("engine", "impl", "option", "transport")  # a variant's identity, and its row's


def label(engine: str, impl: str, option: str | None = None, transport: str | None = None) -> str:
    """A variant's label, ``row_identity.label``'s spelling: "zero1 ours in step [shared_memory]"; without a transport,
    its base."""
    return row_identity.label({"engine": engine, "impl": impl, "option": option, "transport": transport})


@dataclass(frozen=True)
class Versus:
    """A target before its transport is known: this variant over the one that differs in ``changes`` (fields of
    ``FIELDS``), on ``axis``; without a "transport" change, the other is on this variant's transport."""

    axis: str
    changes: dict
    limit: float | None = None
    scope: str | None = None


@dataclass(frozen=True)
class Variant:
    engine: str  # a registered engine: "ddp", "zero1", "zero2", "fsdp", ...
    impl: str  # "ours" or "pytorch" (``registry.IMPLS``)
    option: str | None  # "in step", "keep", "bf16", ...; None: the engine's default
    transport: str  # a registry name (``transport_choice.choices()``)
    build: Callable[[nn.Module, transport.Transport], Setup]
    targets: tuple[Target, ...] = ()  # resolved: each names its other variant's label
    default: bool = True  # measured unless --variants says otherwise

    @property
    def name(self) -> str:
        return label(self.engine, self.impl, self.option, self.transport)

    @property
    def base(self) -> str:
        return label(self.engine, self.impl, self.option)

    def fields(self) -> dict:
        return {key: getattr(self, key) for key in FIELDS}


VARIANTS: dict[str, Variant] = {}
# Bases that take any transport object (those registered on shared memory): "base [t]" for any registry name t is
# made on request (``select``), so a transport registered anywhere runs under every such engine.
OPEN: dict[str, tuple] = {}
ON_REQUEST: set[str] = set()  # the "base [t]" variants ``select`` made for a transport asked for by name


def variant(engine: str, impl: str, build, option: str | None = None, on: tuple[str, ...] = (TORCH, SHARED),
            versus: tuple[Versus, ...] = (), default: tuple[str, ...] = (TORCH, SHARED)) -> None:
    """Register ``build(module, transport) -> Setup`` as "<engine> <impl>[ option] [t]" for each transport ``t``
    of ``on`` (measured by default on those of ``default``).

    Every "[shared_memory]" variant is also compared with its "[torch]" self and every "[shared_memory:thread]" one
    with its "[shared_memory]" self (``COMPARED_WITH``, axis "transport"; for information unless ``versus`` says
    so)."""
    key = (engine, impl, option)
    if SHARED in on:
        OPEN[label(*key)] = (key, build, versus, on)
    for t in on:
        _add(key, t, build, versus, on, t in default)


def _resolved(key: tuple, t: str, versus: tuple[Versus, ...], on: tuple[str, ...]) -> tuple[Target, ...]:
    """``versus`` on transport ``t``, with the transport target of ``COMPARED_WITH`` if ``versus`` has none;
    never a target of the variant itself."""
    mine = dict(zip(FIELDS, (*key, t)))
    own = [Target(label(**{**mine, **v.changes}), v.axis, v.limit, v.scope) for v in versus]
    other = COMPARED_WITH.get(t)
    if other in on and not any(x.other == label(*key, other) for x in own):
        own.append(Target(label(*key, other), "transport"))
    return tuple(x for x in own if x.other != label(*key, t))


def _add(key: tuple, t: str, build, versus: tuple[Versus, ...], on: tuple[str, ...], default: bool) -> None:
    VARIANTS[label(*key, t)] = Variant(*key, t, build, _resolved(key, t, versus, on), default)


def _drop_missing_targets(names) -> None:
    """A target whose other variant does not exist (no "zero1 pytorch [shared_memory]") is dropped."""
    for name in names:
        v = VARIANTS[name]
        VARIANTS[name] = replace(v, targets=tuple(t for t in v.targets if t.other in VARIANTS))


def _on_request(base: str, t: str) -> str:
    """"base [t]" made for a transport asked for by name: its targets on its own transport only."""
    key, build, versus, on = OPEN[base]
    _add(key, t, build, tuple(v for v in versus if "transport" not in v.changes), on, False)
    ON_REQUEST.add(label(*key, t))
    return label(*key, t)


def _unknown(name: str) -> ValueError:
    bases = ", ".join(dict.fromkeys(v.base for v in VARIANTS.values()))
    return ValueError(f"unknown variant {name!r}: choose among {bases} (each on its transports, e.g. "
                      f"'fsdp ours [shared_memory]'; {', '.join(OPEN)} on any of "
                      f"{', '.join(transport_choice.choices())}; without brackets: every transport it runs on)")


def select(names: list[str]) -> list[str]:
    """Variant labels: each as given, or a name without "[transport]" as that variant on every transport it has.
    A bracket takes any name of the transport registry; an unknown one is a ValueError that lists them."""
    from_registry()
    out, made = [], []
    for name in names:
        base, bracket, t = name.rstrip("]").partition(" [")
        if bracket:
            name = f"{base} [{transport_choice.checked(t)}]"
            if name not in VARIANTS and base in OPEN:  # an open engine on a transport not built in here
                made.append(_on_request(base, transport_choice.checked(t)))
        # A name alone: its built-in transports; one made on request is this call's (its transport may be gone)
        matches = [name] if name in VARIANTS else [v.name for v in VARIANTS.values()
                                                   if v.base == name and v.name not in ON_REQUEST]
        if not matches:
            raise _unknown(name)
        out += [m for m in matches if m not in out]
    _drop_missing_targets(made)
    return out


def runnable(names: list[str], world_size: int, device: torch.device) -> list[str]:
    """The variants this world can run: one process has no communication (only [torch] runs), and shared memory
    takes CPU tensors."""
    return [v for v in names if VARIANTS[v].transport == TORCH or (world_size > 1 and device.type == "cpu")]


def defaults() -> list[str]:
    """The variants measured when --variants names none."""
    return [v.name for v in VARIANTS.values() if v.default]


def _zero_and_ddp() -> None:
    """DDP and ZeRO, ours and PyTorch's; ours also on a communication thread."""
    vs_pytorch = Versus("impl", {"impl": "pytorch"}, TARGET_VS_PYTORCH)
    vs_default = Versus("option", {"option": None})
    variant("ddp", "ours", setups.ddp_ours, on=(TORCH, SHARED, THREAD), versus=(vs_pytorch,))
    variant("ddp", "pytorch", setups.ddp_pytorch, on=(TORCH, SHARED, ON_DPKIT), default=(TORCH, SHARED, ON_DPKIT))
    variant("zero1", "ours", setups.zero_ours, on=(TORCH, SHARED, THREAD),
            versus=(vs_pytorch, Versus("engine", {"engine": "ddp"}, TARGET_ZERO_VS_DDP)))
    variant("zero1", "ours", setups.zero_ours_in_step, "in step", versus=(vs_default,), default=())
    # its broadcasts bypass the transport: [torch] only
    variant("zero1", "ours", setups.zero_ours_broadcast, "broadcast", on=(TORCH,), versus=(vs_default,), default=())
    variant("zero1", "ours", setups.zero_ours_tensor, "tensor", versus=(vs_default,), default=())
    variant("zero2", "ours", setups.zero2_ours, versus=(Versus("option", {"engine": "zero1"}),  # stage 2 / stage 1
                                                        Versus("engine", {"engine": "ddp"})))
    variant("zero1", "pytorch", setups.zero_pytorch, on=(TORCH,), default=(TORCH,),
            versus=(Versus("engine", {"engine": "ddp"}, TARGET_ZERO_VS_DDP),))


# "keep": reshard_after_forward=False (gathered once per step, kept for backward); "bf16": gathered and computed in
# bfloat16, float32 master shards, gradients and AdamW. The bf16 keep pair is opt-in.
FSDP_OPTIONS = {None: {}, "keep": dict(reshard_after_forward=False), "bf16": dict(compute_dtype=torch.bfloat16),
                "bf16 keep": dict(compute_dtype=torch.bfloat16, reshard_after_forward=False)}


def _fsdp() -> None:
    """FSDP, ours and fully_shard, at each option; ours at its default also on a communication thread (what
    overlap buys on a CPU host); fully_shard at its default also on a "dpkit" process group, where its transport
    target against gloo holds at the GPT's default size."""
    for option, kwargs in FSDP_OPTIONS.items():
        default = () if option == "bf16 keep" else (TORCH, SHARED)
        variant("fsdp", "ours", functools.partial(setups.fsdp_ours, **kwargs), option,
                on=(TORCH, SHARED) if option else (TORCH, SHARED, THREAD),
                versus=(Versus("impl", {"impl": "pytorch"}, TARGET_VS_PYTORCH),), default=default)
        variant("fsdp", "pytorch", functools.partial(setups.fsdp_pytorch, **kwargs), option,
                on=(TORCH, SHARED) if option else (TORCH, SHARED, ON_DPKIT),
                versus=() if option else (Versus("transport", {"transport": TORCH}, TARGET_SHM_VS_TORCH,
                                                 "gpt default"),),
                default=default if option else (*default, ON_DPKIT))


def from_registry() -> None:
    """Add "<engine> <impl>" on [torch] and [shared_memory] (opt-in) for every registered engine and implementation
    that no builder covers, and drop the variants made on request and those of an engine or transport no
    longer registered; called again where names are read, so an engine registered later appears."""
    gone = [n for n, v in VARIANTS.items() if n in ON_REQUEST or v.engine not in registry.names()
            or v.transport not in transport_choice.choices()]
    for name in gone:  # made on request (``select`` makes them again), or an engine or transport unregistered since
        del VARIANTS[name]
        ON_REQUEST.discard(name)
    built = {(v.engine, v.impl) for v in VARIANTS.values() if v.option is None}
    for engine in registry.names():
        for impl in registry.get(engine).impls:
            if (engine, impl) not in built:
                variant(engine, impl, functools.partial(setups.registered, engine, impl), default=())


_zero_and_ddp()
_fsdp()
_drop_missing_targets(list(VARIANTS))
from_registry()
