"""The transport axis of the collectives benchmark: all-reduce, reduce-scatter and all-gather through each
transport of the registry (``--transports``), each on the buffers it allocates, against torch's ("torch").

    python collectives_benchmark.py --axis transports --procs 2 --sizes 10MB 100MB
    made = make_transports(ctx, ["torch", "shared_memory", "shared_memory:staged", "p2p"])
    rows = benchmark_transports_size(ctx, "reduce_scatter", 10 << 20, made, iters=20, warmup=5)
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from dpkit.bench import transport_choice
from dpkit.bench.collective_run import Contender, measure, summing
from dpkit.bench.exact_pattern import sharded_error
from dpkit.bench.measure import BATCH_S
from dpkit.comm import transport
from dpkit.comm.message_passing import MessagePassing, auto_algorithm


def make_transports(ctx, names: list[str]) -> dict[str, transport.Transport]:
    """``--transports`` name -> its transport over the whole world (``transport_choice.make``, a collective).
    Shared memory only where it can serve (CPU tensors, every rank on this host); with one process, only
    transports that move nothing but copies: those of one process."""
    if ctx.world_size == 1:
        names = [n for n in names if not n.startswith("shared_memory")]
    return transport_choice.make(names, ctx.device, optional=True)


def algorithm_of(made: transport.Transport, collective: str) -> str:
    """What runs inside a transport: torch's own collective, shared memory's direct sums, the p2p algorithm
    (the ring but for the all-reduce), else the transport's name."""
    inner = made.inner if isinstance(made, transport.Wrapped) else made
    if isinstance(inner, MessagePassing):
        return inner.algorithm if collective == "allreduce" else "ring"
    return {transport.SharedMemory: "direct", transport.Torch: "torch"}.get(type(inner), made.name)


def transport_contenders(ctx, collective: str, nbytes: int, transports: dict[str, transport.Transport]
                         ) -> tuple[list[Contender], Callable[[], object] | None, int]:
    """The transport axis at one size: (contenders, the refill before the counts and each timed batch or None,
    bytes).

    Each transport on the buffers its ``allocate()`` gives: shared memory's own (zero copy); the others', plain
    tensors, one set shared by all (shared_memory:staged copies them into its arena and back). Reduce-scatter and
    all-gather:    ``nbytes`` is the full tensor, rounded down to a multiple of the world size (nccl-tests)."""
    n = ctx.world_size
    numel = nbytes // 4 // n * n if collective != "allreduce" else nbytes // 4

    def tensors(make) -> tuple[torch.Tensor, ...]:
        full = make((numel,), dtype=torch.float32)
        return (full,) if collective == "allreduce" else (full, make((numel // n,), dtype=torch.float32))

    plain = tensors(functools.partial(torch.empty, device=ctx.device))
    contenders = []
    for name, made in transports.items():
        label, algorithm = name, algorithm_of(made, collective)
        own = tensors(made.allocate)
        inputs = own if made.owns(own[0]) else plain
        if collective == "allreduce":
            choice = auto_algorithm(inputs[0]) if algorithm == "auto" and n > 1 else None
            contender = summing(ctx, label, made.describe(), algorithm, made.all_reduce, inputs[0], choice)
        else:
            full, shard = inputs
            call = (functools.partial(made.reduce_scatter, shard, full, "sum") if collective == "reduce_scatter"
                    else functools.partial(made.all_gather, full, shard))
            contender = Contender(label, made.describe(), algorithm, call,
                                  functools.partial(sharded_error, ctx, collective, call, full, shard), None, inputs)
        contenders.append(contender)
    # The all-reduce sums in place: zeros, refilled (untimed) before the counts and each timed batch, stay zeros.
    # The others keep their inputs.
    fulls = list({id(c.inputs[0]): c.inputs[0] for c in contenders}.values())
    setup = (lambda: [full.zero_() for full in fulls]) if collective == "allreduce" else None
    return contenders, setup, numel * 4


def benchmark_transports_size(ctx, collective: str, nbytes: int, transports: dict[str, transport.Transport],
                              iters: int, warmup: int, batch_s: float = BATCH_S) -> list[dict]:
    """The transport axis at one size (``transport_contenders``), one row per transport, each timed in batches of
    calls that last ``batch_s``."""
    contenders, setup, size = transport_contenders(ctx, collective, nbytes, transports)
    return measure(ctx, collective, "transport", contenders, size, iters, warmup, setup, batch_s=batch_s)
