"""One size of a collectives comparison, measured: each contender checked once on the exact pattern, then
timed in batches of calls, in turns with the others, one row each in the layout of ``collectives_benchmark.py``'s
results file (nccl-tests' columns, the paired ratio to the axis's reference, the largest error).

    contenders = [summing(ctx, "ring", "gloo", "ring", ring_allreduce, x), ...]
    rows = measure(ctx, "allreduce", "algorithm", contenders, x.numel() * 4, iters=20, warmup=5)

The axes build their contenders: ``algorithm_axis``, ``transport_axis``, ``backend_axis``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from dpkit.bench.collectives import bus_factor
from dpkit.bench.exact_pattern import fill_pattern, pattern_error
from dpkit.bench.measure import BATCH_S, oversubscribed, paired_ratio, time_batches

SMALL_BYTES, SMALL_CALLS = 1 << 20, 4  # messages up to 1 MiB: 4 times the timed batches (``calls``)


def calls(nbytes: int, iters: int) -> int:
    """Timed batches (rounds) for one size: ``iters``, and SMALL_CALLS times as many for messages up to SMALL_BYTES.

    The time of a batch of short calls varies from batch to batch (scheduling, wake-ups), so the
    few rounds that suit the large sizes leave a small size's ratio with a wide interval; each
    extra round costs one batch per contender.
    """
    return iters * SMALL_CALLS if nbytes <= SMALL_BYTES else iters


@dataclass
class Contender:
    """One line of a comparison: the row's labels, a no-argument call, and ``check``: one untimed call on
    the exact pattern that returns this rank's largest error. ``call`` on inputs the axis's refill left
    (``measure``'s ``setup``) may be called many times in a row: an in-place sum of zeros stays zeros."""

    label: str
    transport: str
    algorithm: str
    call: Callable[[], object]
    check: Callable[[], float]
    choice: str | None = None
    inputs: tuple[torch.Tensor, ...] = ()  # the tensors it works on
    fields: dict = field(default_factory=dict)  # added to its row as they are (an anchor's name and version)


def _worst(ctx, error: float) -> float:
    """The largest of every rank's ``error``."""
    value = torch.tensor([error], dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(value, torch.distributed.ReduceOp.MAX)
    return value.item()


def measure(ctx, collective: str, axis: str, contenders: list[Contender], size: int, iters: int, warmup: int,
            setup: Callable[[], object] | None = None, reference: str = "torch", batch_s: float = BATCH_S
            ) -> list[dict]:
    """Check every contender, count its calls in a batch that lasts ``batch_s``, then time them taking turns
    batch by batch (``calls`` rounds; ``setup`` refills the inputs, untimed, before the counts and each batch);
    one row each, the same on every rank, its time per call, its ratio (``vs_torch``) paired with the batches of
    the contender labelled ``reference`` in the same rounds."""
    errors = {c.label: _worst(ctx, c.check()) for c in contenders}
    rounds = calls(size, iters)
    timings, repeat = time_batches({c.label: c.call for c in contenders}, rounds, warmup, rounds=rounds,
                                   device=ctx.device, setup=setup, seconds=batch_s)  # seconds per call
    n, rows = ctx.world_size, []
    for c in contenders:
        timing = timings[c.label]
        algbw = size / timing.mean / 1e9
        ratio = paired_ratio(timing.samples, timings[reference].samples) if reference in timings else None
        rows.append({"backend": ctx.backend, "world_size": n, "collective": collective, "axis": axis,
                     "transport": c.transport, "algorithm": c.algorithm, "label": c.label, "bytes": size,
                     "dtype": "float32", "avg_s": timing.mean, "p50_s": timing.median, "p95_s": timing.percentile(95),
                     "min_s": min(timing.samples), "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(n, collective),
                     "vs_torch": ratio["median"] if ratio else None,
                     "vs_torch_ci_low": ratio["ci_low"] if ratio else None,
                     "vs_torch_ci_high": ratio["ci_high"] if ratio else None,
                     "rounds": len(timing.samples), "round_p50_s": timing.samples,  # one timed batch per round
                     "calls_per_round": repeat[c.label],
                     "oversubscribed": oversubscribed(n, ctx.device), "choice": c.choice,
                     "max_abs_error": errors[c.label], "correct": errors[c.label] == 0.0, **c.fields})
    return rows


def summing(ctx, label: str, transport_name: str, algorithm: str, function, x: torch.Tensor,
             choice: str | None = None) -> Contender:
    """An all-reduce ``function(x, "sum")`` in place, checked on the pattern."""
    call = functools.partial(function, x, "sum")

    def check() -> float:
        fill_pattern(x, ctx.rank)
        call()
        return pattern_error(x, ctx.world_size)
    return Contender(label, transport_name, algorithm, call, check, choice, (x,))
