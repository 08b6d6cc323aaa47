"""A toy engine for the tests that show a registered engine appears everywhere engines are compared: our DDP
under another name (a subclass, so a test sees that the registry's wrap built it), registered only inside
``registered()`` so that no other test sees it."""

from __future__ import annotations

from contextlib import contextmanager

from dpkit.engines import registry
from dpkit.engines.ddp import DDP

NAME = "toy"


class ToyDDP(DDP):
    """Our DDP, unchanged."""


def _wrap(module, transport, options: registry.Options):
    return ToyDDP(module, options.bucket_cap_mb, transport=transport)


TOY = registry.Engine(NAME, shards=0, label="toy DDP", impls={"ours": registry.Impl(_wrap)})


def register() -> None:
    """What a user's start-up code calls."""
    registry.register(TOY)


@contextmanager
def registered():
    register()
    try:
        yield TOY
    finally:
        registry.unregister(NAME)
