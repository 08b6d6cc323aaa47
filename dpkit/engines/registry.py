"""The data-parallel engines by name, in one place: what each shards, its label, and how each implementation
(``ours``, ``pytorch``) wraps a model and builds its optimizer. Every flag, results field, legend and test id
takes its names from here, and a benchmark that compares engines lists ``names()``.

    from dpkit.engines import registry
    registry.names()                                  # ("ddp", "zero1", "zero2", "fsdp", "hsdp")
    model = registry.wrap("zero1", "ours", module, transport="auto")
    optimizer = registry.optimizer("zero1", "ours", model, torch.optim.SGD, transport="auto", lr=0.01)
    registry.register(registry.Engine("mine", shards=0, label="my DDP", impls={"ours": registry.Impl(wrap_mine)}))

``shards`` is the engine's ZeRO stage (0: nothing, 1: the optimizer state, 2: and the gradients, 3: and the
parameters); ``hybrid``: sharded inside a host, replicated across hosts. A name that is not registered is a
ValueError that lists the registered ones (``checked``).
A benchmark row is "<engine> <ours|pytorch>[ option][ <cap>M] [<transport>]": "zero1 ours [shared_memory]",
"fsdp pytorch bf16 [torch]", "ddp ours 25M [torch]" (bucketed, 25 MiB buckets), "ddp ours overlap|flat|naive
[torch]" (DDP's baselines: options of "ddp ours", named as ``ddp.make_ddp`` names them), "ddp pytorch best 25M
[torch]" (PyTorch's DDP at its best settings); "no ddp" is the model alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from dpkit.engines import makers
from dpkit.engines.makers import Impl, Options

IMPLS = ("ours", "pytorch")
IMPL_LABELS = {"ours": "ours", "pytorch": "PyTorch's"}


@dataclass(frozen=True)
class Engine:
    name: str
    shards: int  # ZeRO stage: 0 nothing, 1 optimizer state, 2 + gradients, 3 + parameters
    label: str  # for legends and tables: "ZeRO-1"; an implementation adds " (PyTorch's)"
    impls: Mapping[str, Impl] = field(default_factory=dict)  # "ours" / "pytorch" -> how; may lack one
    hybrid: bool = False  # sharded inside each host, replicated (gradients all-reduced) across hosts


_ENGINES: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    """Add ``engine`` (or replace the one of its name); benchmarks and the trainer list it from now on."""
    if engine.shards not in (0, 1, 2, 3) or not set(engine.impls) <= set(IMPLS):
        raise ValueError(f"engine {engine.name!r}: shards must be 0 to 3 and implementations among {IMPLS}")
    _ENGINES[engine.name] = engine
    return engine


def unregister(name: str) -> None:
    """Forget ``name`` (a test's toy engine); nothing if it is not registered."""
    _ENGINES.pop(name, None)


def names(impl: str | None = None) -> tuple[str, ...]:
    """Every engine's name in registration order; with ``impl``, those that implementation provides."""
    return tuple(n for n, e in _ENGINES.items() if impl is None or impl in e.impls)


def get(name: str) -> Engine:
    return _ENGINES[checked(name, "engine")]


def checked(name: str, kind: str) -> str:
    """``name`` if it is a registered engine (``kind`` "engine") or an implementation ("impl"); else a
    ValueError that lists the known ones."""
    return one_of(name, kind, names() if kind == "engine" else IMPLS)


def one_of(name: str, kind: str, known) -> str:
    """``name`` if ``known`` has it; else a ValueError that lists ``known``."""
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}: choose one of {', '.join(known)}")
    return name


def impl(name: str, impl_name: str) -> Impl:
    engine, impl_name = get(name), checked(impl_name, "impl")
    if impl_name not in engine.impls:
        raise ValueError(f"engine {engine.name!r} has no {impl_name!r} implementation: it has "
                         f"{', '.join(engine.impls) or 'none (cluster model only)'}")
    return engine.impls[impl_name]


def wrap(name: str, impl_name: str, module: nn.Module, transport="auto", options: Options = Options()) -> nn.Module:
    """``module`` made data-parallel by engine ``name``'s ``impl_name`` implementation, on ``transport``."""
    return impl(name, impl_name).wrap(module, transport, options)


def optimizer(name: str, impl_name: str, model: nn.Module, optimizer_class: type, transport="auto",
              **optimizer_options) -> torch.optim.Optimizer:
    """The optimizer that goes with ``wrap``'s ``model``: ``optimizer_class`` over what this rank updates."""
    return impl(name, impl_name).optimizer(model, optimizer_class, transport, **optimizer_options)


def label(name: str, impl_name: str | None = None) -> str:
    """"ZeRO-1", or with an implementation "ZeRO-1 (ours)" / "ZeRO-1 (PyTorch's)"."""
    text = get(name).label
    return text if impl_name is None else f"{text} ({IMPL_LABELS.get(impl_name, impl_name)})"


for _engine in (
        Engine("ddp", 0, "DDP", {"ours": Impl(makers.ddp_ours), "pytorch": Impl(makers.ddp_pytorch)}),
        Engine("zero1", 1, "ZeRO-1", {"ours": Impl(makers.ddp_ours, makers.sharded_optimizer),
                                      "pytorch": Impl(makers.ddp_pytorch, makers.zero_redundancy)}),
        Engine("zero2", 2, "ZeRO-2", {"ours": Impl(makers.unwrapped, makers.sharded_optimizer_stage2)}),
        Engine("fsdp", 3, "FSDP", {"ours": Impl(makers.fsdp_ours), "pytorch": Impl(makers.fsdp_pytorch)}),
        Engine("hsdp", 3, "HSDP", {"ours": Impl(makers.hsdp_ours)}, hybrid=True)):
    register(_engine)
