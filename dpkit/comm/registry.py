"""The one place a transport is chosen: ``resolve("auto" | name | object, group, device)``, over one registry of
names in which every transport, built in or not, is registered alike (``register``).

    t = resolve("auto", group, device)     # shared memory on one CPU host, hierarchical across hosts, else torch
    t = resolve("p2p:ring", group)         # by name: ``names()`` lists them
    register("mine", lambda group, option: Mine(group))   # then resolve("mine") makes it, and every benchmark
    unregister("mine")                                     # a test's toy, once the test is done

``resolve`` is a collective: every rank learns every rank's choice first, so ranks that ask for
different transports, or an unknown name, all raise the same ValueError before any data moves.
The built-in names are registered when this module is imported, so they exist as soon as ``resolve`` can
be called: "torch" ("torch:dpkit": on a new group of the torch.distributed backend "dpkit"), "shared_memory"
(":thread": on a communication thread; ":staged": handed plain tensors, copied in), "hierarchical", "p2p"
("p2p:<algorithm>"). ``checked`` reads a name a user typed: one not in ``names()`` is refused, listing them.
"""

from __future__ import annotations

import datetime
import weakref
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from dpkit.comm.hierarchical import Hierarchical
from dpkit.comm.hosts import host_indices
from dpkit.comm.comm_thread import group_timeout
from dpkit.comm.interface import Staged, Transport
from dpkit.comm.message_passing import SUMS, MessagePassing
from dpkit.comm.shared_memory import NotOneHost, SharedMemory
from dpkit.comm.torch_transport import Torch


class Entry(NamedTuple):
    """How ``resolve`` makes a registered transport: ``factory(group, option)`` for "name" (option "") and
    "name:option"; ``devices``: the device types whose tensors it takes (None: every one)."""

    factory: Callable[..., Transport]
    options: tuple[str, ...]
    devices: tuple[str, ...] | None


BUILT_IN = ("torch", "shared_memory", "hierarchical", "p2p")  # registered below, once: no one replaces them
_REGISTERED: dict[str, Entry] = {}


def register(name: str, factory: Callable[..., Transport], options: Sequence[str] = (),
             devices: Sequence[str] | None = None) -> None:
    """Let ``resolve`` make ``factory(group, option)`` for ``name`` (option "") and ``name:option``, for tensors
    on ``devices`` (device types; None: any). Call it once, where the transport is defined or at start-up."""
    if name == "auto" or ":" in name or (name in BUILT_IN and name in _REGISTERED):
        raise ValueError(f"cannot register {name!r}: a built-in name, or one with a ':'")
    _REGISTERED[name] = Entry(factory, tuple(options), None if devices is None else tuple(devices))


def unregister(name: str) -> None:
    """Forget a name ``register`` added (not a built-in one): a test's toy transport, once the test is done."""
    if name in BUILT_IN or name not in _REGISTERED:
        raise ValueError(f"cannot unregister {name!r}: a built-in name, or one not registered")
    del _REGISTERED[name]


def names() -> tuple[str, ...]:
    """Every name ``resolve`` takes now: "auto", then the registered ones with their options."""
    return ("auto", *(n for name, entry in _REGISTERED.items()
                      for n in (name, *(f"{name}:{option}" for option in entry.options))))


def checked(name: str) -> str:
    """``name`` if ``names()`` has it; else a ValueError that lists the known names."""
    if name not in names():
        raise ValueError(f"unknown transport {name!r}: choose one of {', '.join(names())}")
    return name


def factory(name: str, engine: str = "Hierarchical") -> Callable[..., Transport]:
    """``factory(group)`` that resolves ``name`` over the group it is given (CPU tensors): how ``Hierarchical``
    takes its transport between hosts by name (``Hierarchical(group, outer=factory("p2p:ring"))``)."""
    if name not in names():
        raise ValueError(f"{engine}: unknown outer transport {name!r}: choose one of {', '.join(names())}")
    return lambda group: resolve(name, group, "cpu", engine=engine)


# (id of the group, spec, device type) -> the transport made for it, while some engine holds it. Weak: a
# transport holds its group, and a cache that kept either would keep the group past destroy_process_group.
_CHOSEN: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def resolve(spec="auto", group=None, device=None, *, engine: str = "this engine", shared: bool = True) -> Transport:
    """The transport ``spec`` names for ``group`` and tensors on ``device`` (a collective: every rank calls it).

    ``spec``: ``"auto"`` (for tensors on the CPU: shared memory when every rank of the group is on
    this host, ``Hierarchical`` when the group spans hosts and some host holds two or more of its
    ranks; else ``Torch``), a name of ``names()``, or a ``Transport`` over the same ranks.
    Every rank learns every rank's choice and device type first, so all of them raise ValueError,
    with the same message, for an unknown name, ranks asking for different transports or putting
    their tensors on different device types, ``"shared_memory"`` or ``"hierarchical"`` for GPU
    tensors, ``"shared_memory"`` for a group that spans hosts, or a transport over other ranks.
    Transports chosen by name are made once per group and shared by the engines of this process
    (they run in the caller's thread, in turn); ``shared=False`` makes a new one (memory of its own).
    """
    device = torch.device("cpu" if device is None else device)
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    key = (id(group), spec, device.type) if isinstance(spec, str) and shared else None
    cached = _CHOSEN.get(key) if key is not None else None
    if cached is not None and (cached.ranks != ranks or _group_of(cached) is not group or cached._closed):
        cached = None
    # Every rank's choice, device type, the ranks of a transport object, and whether it holds a made transport
    # for this choice: a transport is made collectively, so the cache serves only if it serves every rank.
    mine = (spec.describe() if isinstance(spec, Transport) else spec if isinstance(spec, str) else repr(spec),
            device.type, spec.ranks if isinstance(spec, Transport) else None, cached is not None)
    everyone: list = [None] * len(ranks)
    if len(ranks) > 1:
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    _check_choices([entry[:3] for entry in everyone], ranks, engine)
    if isinstance(spec, Transport):
        if spec.world_size > 1 and not spec.supports(device):
            raise ValueError(f"{engine}: {spec!r} cannot serve tensors on {device}: use transport 'torch' for GPUs")
        return spec
    if key is None:
        return _make(spec, group, device, engine)
    if cached is None or not all(entry[3] for entry in everyone):
        cached = _CHOSEN[key] = _make(spec, group, device, engine)
    return cached


def _group_of(chosen: Transport):
    return chosen.group if chosen.group is not None else dist.group.WORLD


def _check_choices(everyone: list, ranks: list[int], engine: str) -> None:
    chosen, devices, over = zip(*everyone)
    for r, name in enumerate(chosen):
        if over[r] is None and name not in names():
            raise ValueError(f"{engine}: unknown transport {name!r} (on group rank {r}): choose one of "
                             f"{', '.join(names())}, or pass a Transport")
    for r, theirs in enumerate(over):  # a transport object over other ranks than the engine's group
        if theirs is not None and list(theirs) != list(ranks):
            raise ValueError(f"{engine}: the transport is over ranks {list(theirs)} (on group rank {r}), the engine's "
                             f"group over {list(ranks)}: make the transport over the engine's process group")
    if len(set(chosen)) > 1 or len(set(map(str, over))) > 1:
        table = ", ".join(f"rank {ranks[r]}: {name}" for r, name in enumerate(chosen))
        raise ValueError(f"{engine}: the ranks chose different transports ({table}): every rank must use the same")
    if len(set(devices)) > 1:
        table = ", ".join(f"rank {ranks[r]}: {kind}" for r, kind in enumerate(devices))
        raise ValueError(f"{engine}: the ranks hold their tensors on different device types ({table})")


def _make(name: str, group, device: torch.device, engine: str) -> Transport:
    if name == "auto":
        return _automatic(group, device)
    registered, _, option = name.partition(":")
    entry = _REGISTERED[registered]
    if entry.devices is not None and device.type not in entry.devices:
        raise ValueError(f"{engine}: transport {name!r} takes {'/'.join(d.upper() for d in entry.devices)} tensors, "
                         f"not {device.type} ones: use 'torch' (NCCL) or 'auto'")
    return entry.factory(group, option)


def _automatic(group, device: torch.device) -> Transport:
    """What "auto" makes for CPU tensors, from where the ranks are (``host_indices``, a collective): one host,
    shared memory (torch if the ranks cannot share a file after all); several hosts with two or more ranks
    on some host, hierarchical; one rank per host, torch (there is nothing to share inside a host)."""
    if device.type != "cpu" or dist.get_world_size(group) == 1:
        return Torch(group)
    spread = host_indices(group)
    if len(set(spread)) == 1:
        try:
            return SharedMemory(group)
        except NotOneHost:
            return Torch(group)
    if len(set(spread)) < len(spread):
        return Hierarchical(group)
    return Torch(group)


def _torch(group, backend: str) -> Torch:
    """torch.distributed's collectives on ``group`` ("torch"), or on a new group of ``backend`` over the same ranks
    with its timeout ("torch:dpkit": what PyTorch's own engines are given as their process group there)."""
    if not backend:
        return Torch(group)
    if dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(f"transport 'torch:{backend}' is made over the whole world (dist.new_group), not a subgroup")
    seconds = group_timeout(group, torch.device("cpu"))
    timeout = None if seconds is None else datetime.timedelta(seconds=seconds)
    return Torch(dist.new_group(backend=backend, timeout=timeout))


def _shared_memory(group, option: str) -> Transport:
    made = SharedMemory(group, background=option == "thread")
    return Staged(made) if option == "staged" else made


register("torch", _torch, options=("dpkit",))
register("shared_memory", _shared_memory, options=("thread", "staged"), devices=("cpu",))
register("hierarchical", lambda group, option: Hierarchical(group), devices=("cpu",))
register("p2p", lambda group, algorithm: MessagePassing(group, algorithm or "auto"), options=tuple(SUMS))
