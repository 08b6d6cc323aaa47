"""A toy transport for the tests that show a registered transport appears everywhere transports are compared:
torch.distributed's collectives under another name, what a user's own transport is to the benchmarks and the
report. ``register()`` is what a user's start-up code calls; ``registered()`` registers it for a test only."""

from __future__ import annotations

from contextlib import contextmanager

from dpkit.bench import sharding_variants
from dpkit.comm import registry, transport

NAME = "toy"


class Toy(transport.Wrapped):
    """torch.distributed's collectives under another name."""

    name = NAME


def register() -> None:
    registry.register(NAME, lambda group, option: Toy(transport.Torch(group)), devices=("cpu",))


@contextmanager
def registered():
    register()
    try:
        yield NAME
    finally:
        registry.unregister(NAME)
        sharding_variants.from_registry()  # forget the toy's variants: later tests in this process list VARIANTS

