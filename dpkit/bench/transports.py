"""The transports a benchmark runs on, named as the registry names them (``dpkit.comm.registry``): a transport
registered there is a choice of every benchmark's ``--transports`` and is made here, so it appears everywhere.

    parser.add_argument("--transports", nargs="+", type=transports.argument, metavar="NAME")  # old names warn
    made = transports.make(["torch", "shared_memory:thread"], device)   # a collective: name -> Transport
    mine = transports.new("shared_memory", device)                        # one engine's own

Rows name the transport they ran on as the registry does (``"ddp ours [shared_memory]"``, field ``transport``).
``current_names`` reads a results file written with the old spellings (``[shm]``, ``[shm-thread]``,
``[dpkit]``, ``shared_memory (zero copy)``) as if written with these; ``results.read_results`` applies it.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Iterable

import torch

from dpkit.comm import registry
from dpkit.comm.interface import Transport


def choices() -> tuple[str, ...]:
    """Every name a benchmark can run on: the registry's but "auto" (a row names what it ran on)."""
    return tuple(name for name in registry.names() if name != "auto")


def canonical(text: str) -> str:
    """The registry's spelling of ``text``; an old spelling warns (DeprecationWarning) and is printed so (argparse
    hides warnings of a module that is not ``__main__``); an unknown name raises ValueError listing the known."""
    if text in registry.DEPRECATED:
        print(f"note: transport {text!r} is deprecated, say {registry.DEPRECATED[text]!r}", file=sys.stderr)
    name = registry.canonical(text)
    if name == "auto":
        raise ValueError(f"a benchmark names what it runs on, not 'auto': choose one of {', '.join(choices())}")
    return name


def argument(text: str) -> str:
    """``canonical`` as an argparse ``type=``: an unknown name is a usage error listing the known ones."""
    try:
        return canonical(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def in_order(names: Iterable[str]) -> list[str]:
    """``names`` (no repeats) in the registry's order: the order every rank makes them in (a set's differs
    between processes)."""
    known = choices()
    return sorted(set(names), key=known.index)


def make(names: Iterable[str], device, group=None, *, optional: bool = False) -> dict[str, Transport]:
    """Name -> its transport over ``group`` for tensors on ``device``, one object per name for the whole run
    (a collective: every rank asks for the same names). Unknown names raise ValueError before any is made;
    a transport that cannot serve here (shared memory for GPU tensors or across hosts) raises on every rank
    alike, or with ``optional`` is left out, saying so."""
    names, device = [canonical(name) for name in names], torch.device(device)
    made = {}
    for name in in_order(names):
        try:
            made[name] = registry.resolve(name, group, device, engine="benchmark")
        except ValueError as error:
            if not optional:
                raise
            print(f"no {name} rows: {error}", file=sys.stderr)
    return made


def new(name: str, device, group=None) -> Transport:
    """A new transport ``name`` for one engine alone (a collective): what it holds (a shared-memory arena, its
    staging block) is then that engine's, counted with it."""
    return registry.resolve(canonical(name), group, torch.device(device), engine="benchmark", shared=False)


# How files written before the names were one spell them. Labels: a bracket ("ddp ours [shm]") or a collectives
# row's path ("shared_memory (zero copy)"); the field "transport" of ddp, sharding and syncbn rows: the bare name.
_OLD_LABELS = re.compile(r"\[(shm-thread|shm|dpkit)\]|shared_memory \((zero copy|staged)\)")
_OLD_PATHS = {"zero copy": "shared_memory", "staged": "shared_memory:staged"}
_BARE = ("ddp_benchmark", "sharding_benchmark", "syncbn_benchmark")  # whose "transport" field is a --transports name
_BACKEND_ROWS = "dist."  # backend_latency's "dist.all_reduce [dpkit]": the backend "dpkit", not a transport


def _renamed(text: str) -> str:
    def new(m):
        if m.group(1):
            return m.group(0) if text.startswith(_BACKEND_ROWS) else f"[{registry.DEPRECATED[m.group(1)]}]"
        return _OLD_PATHS[m.group(2)]

    return _OLD_LABELS.sub(new, text)


def current_names(value, bare: bool = False):
    """``value`` (a results document or any part of it) with every old transport name in a string replaced by
    the registry's; so are the names of a "transports" list (the flag's), and with ``bare`` (set for the
    benchmarks whose row field is one) a "transport" field that is exactly an old name."""
    if isinstance(value, str):
        return _renamed(value)
    if isinstance(value, list):
        return [current_names(v, bare) for v in value]
    if not isinstance(value, dict):
        return value
    bare = bare or value.get("benchmark") in _BARE
    return {k: _flag(v) if k == "transports" or (bare and k == "transport") else current_names(v, bare)
            for k, v in value.items()}


def _flag(value):
    """A --transports name, or a list of them, in the registry's spelling."""
    if isinstance(value, list):
        return [_flag(v) for v in value]
    return registry.DEPRECATED.get(value, value) if isinstance(value, str) else value
