"""The data-parallel engines by name, in one place: what each shards, its label, and how each implementation
(``ours``, ``pytorch``) wraps a model and builds its optimizer. Every flag, results field, legend and test id
takes its names from here, and a benchmark that compares engines lists ``names()``.

    from dpkit.engines import registry
    registry.names()                                  # ("ddp", "zero1", "zero2", "fsdp", "hsdp")
    model = registry.wrap("zero1", "ours", module, transport="auto")
    optimizer = registry.optimizer("zero1", "ours", model, torch.optim.SGD, transport="auto", lr=0.01)
    registry.register(registry.Engine("mine", shards=0, label="my DDP", impls={"ours": registry.Impl(wrap_mine)}))

``shards`` is the engine's ZeRO stage (0: nothing, 1: the optimizer state, 2: and the gradients, 3: and the
parameters); ``hybrid``: sharded inside a host, replicated across hosts. Old spellings (``selfmade``,
``none``, ``zero``) are read as the new ones with a FutureWarning for one release
(``canonical``); ``current_label`` and ``current_ddp_label`` rename the labels of results files written before.
A benchmark row is "<engine> <ours|pytorch>[ option][ <cap>M] [<transport>]": "zero1 ours [shared_memory]",
"fsdp pytorch bf16 [torch]", "ddp ours 25M [torch]" (bucketed, 25 MiB buckets), "ddp ours overlap|flat|naive
[torch]" (DDP's baselines: options of "ddp ours", named as ``ddp.make_ddp`` names them), "ddp pytorch best 25M
[torch]" (PyTorch's DDP at its best settings); "no ddp" is the model alone.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from dpkit.engines import makers
from dpkit.engines.makers import Impl, Options

IMPLS = ("ours", "pytorch")
IMPL_LABELS = {"ours": "ours", "pytorch": "PyTorch's"}
# Old spelling -> new, accepted with a FutureWarning until the release after this one.
OLD_IMPLS = {"selfmade": "ours"}
OLD_ENGINES = {"none": "ddp", "zero": "zero1"}


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
    return _ENGINES[canonical(name, "engine")]


def canonical(name: str, kind: str) -> str:
    """The current spelling of an engine (``kind`` "engine") or an implementation ("impl"): an old spelling
    with a FutureWarning, an unknown one a ValueError that lists the known ones."""
    known, old = (names(), OLD_ENGINES) if kind == "engine" else (IMPLS, OLD_IMPLS)
    return respell(name, kind, known, old)


def respell(name: str, kind: str, known, old: Mapping[str, str]) -> str:
    """``name`` if ``known``; ``old[name]`` with a FutureWarning; else a ValueError listing ``known``."""
    if name in old:
        warnings.warn(f"{kind} {name!r} is now spelled {old[name]!r}; the old spelling goes in the next release",
                      FutureWarning, stacklevel=3)
        name = old[name]
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}: choose one of {', '.join(known)}")
    return name


def impl(name: str, impl_name: str) -> Impl:
    engine, impl_name = get(name), canonical(impl_name, "impl")
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


def current_field(key: str, value):
    """A field of a results file or checkpoint written before the names were unified, in today's names:
    ``current_label`` on strings (and lists of them), and the trainer's old ``sharding`` "none" as "ddp"."""
    if isinstance(value, list):
        return [current_field(key, v) for v in value]
    if key == "sharding" and value == "none":
        return "ddp"
    return current_label(value) if isinstance(value, str) else value


# A whole word; "zero copy" (a shared-memory path) is not an engine.
_OLD_WORD = re.compile(r"\b(zero|selfmade)\b(?![-\w]| copy)")


def current_label(text: str) -> str:
    """A label or field of a results file written before the names were unified, in today's names:
    "zero ours [shm]" -> "zero1 ours [shm]", "selfmade" -> "ours" (without a warning: the file is not
    the reader's to respell)."""
    old = {**OLD_IMPLS, "zero": "zero1"}
    return _OLD_WORD.sub(lambda m: old[m.group(1)], text)


# DDP benchmark rows written before: the algorithm's word, now "ddp" and ``ddp.make_ddp``'s name for it.
OLD_DDP_VARIANTS = {"pytorch": "ddp pytorch", "pytorch-best": "ddp pytorch best", "naive": "ddp ours naive",
                    "flat": "ddp ours flat", "overlap": "ddp ours overlap", "bucketed": "ddp ours"}
_OLD_DDP_WORD = re.compile(r"^(pytorch-best|pytorch|naive|flat|overlap|bucketed)(?= |$)")


def current_ddp_label(text: str) -> str:
    """A label or variant of a DDP benchmark file written before, in today's names: "bucketed 25M [shm]" ->
    "ddp ours 25M [shm]", "pytorch-best" -> "ddp pytorch best"; today's labels and "no ddp" as they are. Only
    for that benchmark's rows: elsewhere "pytorch" alone is an implementation."""
    return _OLD_DDP_WORD.sub(lambda m: OLD_DDP_VARIANTS[m.group(1)], text)


for _engine in (
        Engine("ddp", 0, "DDP", {"ours": Impl(makers.ddp_ours), "pytorch": Impl(makers.ddp_pytorch)}),
        Engine("zero1", 1, "ZeRO-1", {"ours": Impl(makers.ddp_ours, makers.sharded_optimizer),
                                      "pytorch": Impl(makers.ddp_pytorch, makers.zero_redundancy)}),
        Engine("zero2", 2, "ZeRO-2", {"ours": Impl(makers.unwrapped, makers.sharded_optimizer_stage2)}),
        Engine("fsdp", 3, "FSDP", {"ours": Impl(makers.fsdp_ours), "pytorch": Impl(makers.fsdp_pytorch)}),
        Engine("hsdp", 3, "HSDP", {"ours": Impl(makers.hsdp_ours)}, hybrid=True)):
    register(_engine)
