"""One iteration of a SyncBatchNorm benchmark cut at its two sums (``syncbn_verdicts.PHASES``): the compute before,
between and after them apart from the waiting in each, which the profiler charges to whatever called the collective.

    rows = phases(rank, world, device, [(OURS, "torch")], 32, 1024, iters, made, sources)

The cut is made by ``Stamped``, a transport that records the clock around each wait of the one it wraps.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from dpkit.bench.measure import gather_rows, synchronize, time_iterations
from dpkit.bench.syncbn_case import local_input
from dpkit.bench.syncbn_contenders import Contender, Sources, make_layer, make_step
from dpkit.bench.syncbn_verdicts import PHASES, WORKERS
from dpkit.comm import transport


class Stamped(transport.Wrapped):
    """``inner`` with the clock appended to ``stamps`` before and after the caller is blocked on each all_reduce:
    around the call when it returns done (a blocking call; shared memory sums in the caller's thread), else around
    the ``wait()`` of the work it returns (what runs in between is the caller's, overlapped). On a GPU the device
    is synchronised first, so a stamp means the work is done. Every rank must wrap alike."""

    name = "stamped"

    def __init__(self, inner: transport.Transport, stamps: list[float], device: torch.device):
        super().__init__(inner)
        self.stamps, self.device = stamps, device

    def clock(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        start = self.clock()
        work = self.inner.all_reduce(tensor, op, async_op=async_op)
        if work is None or work.is_completed():
            self.stamps += [start, self.clock()]
            return work
        return _StampedWork(work, self)


class _StampedWork(transport.Work):
    """A collective's work whose ``wait`` is stamped (see ``Stamped``)."""

    def __init__(self, work: transport.Work, stamped: Stamped):
        self.work, self.stamped = work, stamped

    def wait(self) -> bool:
        start = self.stamped.clock()
        self.work.wait()
        self.stamped.stamps += [start, self.stamped.clock()]
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def phase_medians(stamps: list[float], iters: int) -> np.ndarray:
    """The median duration of each of ``PHASES`` over the last ``iters`` iterations (earlier ones: warm-up),
    then the median of the iterations' whole durations (not the sum of the phases' medians: the phases
    of one iteration are not independent, and the sum of their medians understates it).

    ``stamps`` holds, per iteration, its start, the start and end of each collective, and its end."""
    durations = np.diff(np.array(stamps).reshape(-1, len(PHASES) + 1)[-iters:], axis=1)
    return np.append(np.median(durations, axis=0), np.median(durations.sum(axis=1)))


def phases(rank: int, world: int, device: torch.device, impls: list[Contender], batch: int, hidden: int,
           iters: int, made: dict[str, transport.Transport], sources: Sources) -> list[dict]:
    """Each implementation's iteration cut into ``PHASES`` (median seconds per phase, and of the whole
    iteration, each the maximum over ranks), its transport wrapped in ``Stamped``."""
    x, loss_rows = local_input(rank, world, batch, hidden, torch.float32, device)
    rows = []
    for impl, t in impls:
        stamps: list[float] = []
        stamped = Stamped(made[t], stamps, device)
        step = make_step(impl, make_layer(impl, hidden, device, sources, stamped), x, loss_rows, sources, stamped)

        def stamped_step():
            stamps.append(time.perf_counter())
            step()
            synchronize(device)
            stamps.append(time.perf_counter())
        time_iterations(stamped_step, iters, warmup=2, device=device)
        *slowest, iteration = map(float, gather_rows(list(phase_medians(stamps, iters))).max(dim=0).values)
        rows.append({"kind": "phases", "impl": impl, "transport": t, "setting": WORKERS, "dtype": "float32",
                     "device": device.type, "batch": batch, "hidden": hidden, "workers": world, "iters": iters,
                     "phases_s": dict(zip(PHASES, slowest)), "iteration_s": iteration})
    return rows
