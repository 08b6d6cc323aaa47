"""One case of a SyncBatchNorm benchmark, measured: every contender on one (batch, hidden, dtype), timed in
interleaved rounds, then its peak memory, bytes saved for backward and operators dispatched, one row each; and the
per-operator profile of one iteration.

    rows = run_case(rank, world, device, [(OURS, "torch"), (LOCAL, None)], 32, 1024, "float32", args, sources,
                    made=made)

``args`` carries ``iters``, ``rounds`` and ``warmup``; ``made`` maps a transport name to the transport
(``transport_choice.make``); ``sources`` is where the layer's code comes from (``syncbn_contenders.Sources``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from dpkit.bench.measure import (PeakMemory, gather_rows, in_turn, op_breakdown, percentile, saved_tensor_bytes,
                                 time_iterations)
from dpkit.bench.syncbn_contenders import Contender, Sources, make_layer, make_step
from dpkit.bench.syncbn_operators import operators
from dpkit.bench.syncbn_verdicts import DTYPES, SINGLE, WORKERS
from dpkit.comm import transport

PROFILE_ITERS = 20


def local_input(rank: int, world: int, batch: int, hidden: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, int]:
    """This rank's rows of the global (batch, hidden) input, and how many of them are in the first batch/2."""
    local = batch // world
    generator = torch.Generator().manual_seed(1000 * rank + hidden + batch)
    x = torch.randn(local, hidden, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    return x, max(0, min(local, batch // 2 - rank * local))


def _memory(step: Callable[[], None], layer: torch.nn.Module, x: torch.Tensor,
            device: torch.device) -> tuple[int, int, float]:
    """(peak bytes of one iteration, bytes saved for backward by one forward, ``operators`` per iteration);
    maxima over ranks.

    The peak is the least of 3 iterations' (``measure.PeakMemory`` on the CPU can only overstate)."""
    step()  # warm: first-call allocations (e.g. cached constants) are not the steady state
    peaks = []
    for _ in range(3):
        with PeakMemory(device) as peak:
            step()
        peaks.append(peak.bytes)
    saved = saved_tensor_bytes(lambda: layer(x))
    ops = operators(step, device)
    most = gather_rows([min(peaks), saved, ops]).max(dim=0).values  # ranks differ (rank 0 holds the loss rows)
    return int(most[0]), int(most[1]), float(most[2])


def _timed_rounds(steps: dict[Contender, Callable[[], None]], args, device: torch.device,
                  setup) -> dict[Contender, list[list[float]]]:
    """Per contender, per round, the slowest rank's time of each iteration: the contenders in turns, the order
    rotated from round to round, so that drift of a shared machine hits all alike."""
    impls = list(steps)
    per_round = max(1, args.iters // args.rounds)
    samples: dict[Contender, list[list[float]]] = {c: [] for c in impls}
    for round_ in range(args.rounds):
        for c in in_turn(impls, round_):
            timing = time_iterations(steps[c], per_round, warmup=args.warmup if round_ == 0 else 2, device=device,
                                     setup=setup)
            samples[c].append(timing.samples)
    return samples


def run_case(rank: int, world: int, device: torch.device, impls: list[Contender], batch: int, hidden: int,
             dtype_name: str, args, sources: Sources, setting: str | None = None, setup=None,
             made: dict[str, transport.Transport] | None = None) -> list[dict]:
    """Every (implementation, transport) of ``impls`` on one (batch, hidden, dtype), timed in interleaved rounds;
    one row each.

    ``setup`` runs before every iteration, outside the timed region; ``setting`` labels the rows
    (default: WORKERS with a process group, else SINGLE)."""
    made = made or {}
    x, loss_rows = local_input(rank, world, batch, hidden, DTYPES[dtype_name], device)
    layers = {c: make_layer(c[0], hidden, device, sources, made.get(c[1])) for c in impls}
    steps = {c: make_step(c[0], layers[c], x, loss_rows, sources, made.get(c[1])) for c in impls}
    samples = _timed_rounds(steps, args, device, setup)
    rows = []
    for c in impls:
        impl, t = c
        flat = [s for r in samples[c] for s in r]
        peak, saved, ops = _memory(steps[c], layers[c], x, device)
        rows.append({"kind": "time", "impl": impl, "transport": t,
                     "transport_detail": made[t].describe() if t in made else None,
                     "setting": setting or (WORKERS if world > 1 else SINGLE),
                     "dtype": dtype_name, "device": device.type, "batch": batch, "hidden": hidden, "workers": world,
                     "local_batch": x.size(0), "iters": len(flat), "rounds": args.rounds,
                     "time_s": float(np.median(flat)), "p10_s": percentile(flat, 10), "p90_s": percentile(flat, 90),
                     **{f"round_p{q}_s": [percentile(r, q) for r in samples[c]] for q in (10, 50, 90)},
                     "peak_bytes": peak, "saved_bytes": saved, "operators": ops})
    return rows


def breakdown(rank: int, world: int, device: torch.device, impls: list[Contender], batch: int, hidden: int,
              sources: Sources, made: dict[str, transport.Transport] | None = None,
              iters: int = PROFILE_ITERS) -> list[dict]:
    """Per-operator CPU time of one forward + backward (profiled, rank 0's), ours against BatchNorm1d."""
    made = made or {}
    x, loss_rows = local_input(rank, world, batch, hidden, torch.float32, device)
    rows = []
    for impl, t in impls:
        step = make_step(impl, make_layer(impl, hidden, device, sources, made.get(t)), x, loss_rows, sources,
                         made.get(t))
        step()
        profile = op_breakdown(step, iters, top=12, device=device)
        rows.append({"kind": "breakdown", "impl": impl, "transport": t, "setting": WORKERS if world > 1 else SINGLE,
                     "dtype": "float32", "device": device.type, "batch": batch, "hidden": hidden, "workers": world,
                     "iters": iters, "ops": profile["ops"], "top_self_s": sum(o["self_s"] for o in profile["ops"])})
    return rows
