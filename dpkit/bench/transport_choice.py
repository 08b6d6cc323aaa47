"""The transports a benchmark runs on, named as the registry names them (``dpkit.comm.registry``): a transport
registered there is a choice of every benchmark's ``--transports`` and is made here, so it appears everywhere.

    parser.add_argument("--transports", nargs="+", type=transport_choice.argument, metavar="NAME")
    made = transport_choice.make(["torch", "shared_memory:thread"], device)   # a collective: name -> Transport
    mine = transport_choice.new("shared_memory", device)                        # one engine's own

Rows name the transport they ran on as the registry does (``"ddp ours [shared_memory]"``, field ``transport``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable

import torch

from dpkit.comm import registry
from dpkit.comm.interface import Transport


def choices() -> tuple[str, ...]:
    """Every name a benchmark can run on: the registry's but "auto" (a row names what it ran on)."""
    return tuple(name for name in registry.names() if name != "auto")


def checked(text: str) -> str:
    """``text`` if it names a transport a benchmark can run on; else a ValueError that lists those names."""
    if text not in choices():
        what = "a benchmark names what it runs on, not 'auto'" if text == "auto" else f"unknown transport {text!r}"
        raise ValueError(f"{what}: choose one of {', '.join(choices())}")
    return text


def argument(text: str) -> str:
    """``checked`` as an argparse ``type=``: an unknown name is a usage error listing the known ones."""
    try:
        return checked(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def in_order(names: Iterable[str]) -> list[str]:
    """``names`` (no repeats) in the registry's order: the order every rank makes them in (a set's differs
    between processes). A name the registry does not know (a results file's transport, registered by the run that
    wrote it) comes last."""
    known = choices()
    return sorted(set(names), key=lambda t: (known.index(t) if t in known else len(known), t))


def make(names: Iterable[str], device, group=None, *, optional: bool = False) -> dict[str, Transport]:
    """Name -> its transport over ``group`` for tensors on ``device``, one object per name for the whole run
    (a collective: every rank asks for the same names). Unknown names raise ValueError before any is made;
    a transport that cannot serve here (shared memory for GPU tensors or across hosts) raises on every rank
    alike, or with ``optional`` is left out, saying so."""
    names, device = [checked(name) for name in names], torch.device(device)
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
    return registry.resolve(checked(name), group, torch.device(device), engine="benchmark", shared=False)
