"""transport.py: Torch, SharedMemory and MessagePassing against exact oracles; resolve's refusals; shared
memory without room or across hosts; PyTorch's DDP and fully_shard over a transport.

The default run spawns ONE world of 3 ranks (spawning costs seconds, a case milliseconds): the whole
world runs every case, then a group of two of its ranks (global ranks 1 and 2, so group ranks differ
from global ones) runs them again while rank 0 waits, and in the first round every rank also runs the
single-rank cases on a group of its own. The inputs are reproducible (``rank_input``), so each rank
rebuilds every rank's contribution and checks its own result against their sum in float64, within
the rounding of the dtype: the oracle owes nothing to the transport under test. Ranks return what
they found; the tests below assert on it. A rank killed in the middle of a shared-memory all-reduce
runs in worlds of its own (``-m slow``).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import glob
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import warnings
import zlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

import allreduce
from common import CollectiveCounter, launch_expecting_peer_failure, refused, run_in_subgroups
from dpkit import compat
from dpkit.comm import process_groups, shared_file, shared_memory
from dpkit.comm import transport
from dpkit.comm.process_groups import PeerFailedError

WORLD = 3
ROUNDS = ([None], [[1, 2]])  # the whole world, then global ranks 1 and 2 as group ranks 0 and 1
SEED = 7
TRANSPORTS = ("torch", "shared_memory", "p2p")
THREADED = ("shared_memory+thread", "p2p+thread")  # background=True: every call on a communication thread
KINDS = ("all_reduce", "reduce_scatter", "all_gather")
FLOATS = ("float16", "bfloat16", "float32", "float64")
# Where each rank's buffers live: from the transport's allocate (zero copy for shared memory), plain
# tensors (staged), or allocated on even group ranks only.
PLACEMENTS = ("allocated", "plain", "mixed")
LAYOUTS = {"all_reduce": ("contiguous", "strided"), "reduce_scatter": ("contiguous", "strided", "in_place"),
           "all_gather": ("contiguous", "strided", "in_place")}
# Elements per rank: none, fewer than the ranks, a count that 2 and 3 do not divide; and a few MiB of
# float32 (an all-reduce's chunk then spans several of the shared memory's blocks).
SIZES = (0, 1, 1003)
BIG = {"all_reduce": (1 << 20) + 1, "reduce_scatter": (1 << 18) + 1, "all_gather": (1 << 18) + 1}
LATE_TIMEOUT_S = 1.0  # the group timeout of the cases where a peer does not come


def rank_input(numel: int, rank: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """What group rank ``rank`` contributes: different on every rank; integers are the data times 1000, rounded."""
    data = allreduce.rank_data(SEED + salt, numel, rank)
    if dtype == "int64":
        return (data * 1000).round().to(torch.int64)
    return data.to(getattr(torch, dtype))


def dtype_ops(kind: str) -> list[tuple[str, str]]:
    """Sum and mean of every float dtype, the integer sum (an integer mean is refused); the gather has no op."""
    if kind == "all_gather":
        return [(dtype, "sum") for dtype in (*FLOATS, "int64")]
    return [(dtype, op) for dtype in FLOATS for op in ("sum", "avg")] + [("int64", "sum")]


def placements(name: str) -> tuple[str, ...]:
    """Where buffers can lie for this transport: Torch's and message passing's ``allocate`` return plain
    tensors, so their placements would all run the same code; ``allocate`` is still what they get."""
    return PLACEMENTS if name.startswith("shared_memory") else ("allocated",)


def cases() -> list[tuple]:
    """(transport, kind, dtype, op, numel, placement, layout, async_op), numel being per rank's contribution
    (the shard of a reduce-scatter's output, of an all-gather's input)."""
    out = []
    for name in TRANSPORTS:  # the arithmetic: every dtype, op, size and placement
        for kind in KINDS:
            for dtype, op in dtype_ops(kind):
                for numel in SIZES:
                    for placement in placements(name):
                        out.append((name, kind, dtype, op, numel, placement, "contiguous", False))
    for name in TRANSPORTS + THREADED:  # every layout, blocking and asynchronous
        for kind in KINDS:
            for dtype, op in (("float32", "avg" if kind != "all_gather" else "sum"), ("int64", "sum")):
                for layout in LAYOUTS[kind]:
                    for placement in placements(name):
                        for async_op in (False, True):
                            out.append((name, kind, dtype, op, 1003, placement, layout, async_op))
    for name in TRANSPORTS:  # a few MiB: the mean (in allocated buffers), and for shared memory the sum staged
        for kind in KINDS:
            mean = "avg" if kind != "all_gather" else "sum"
            for op, placement in ((mean, "allocated"), ("sum", "plain"))[:2 if name == "shared_memory" else 1]:
                out.append((name, kind, "float32", op, BIG[kind], placement, "contiguous", True))
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------- the oracle

# Unit roundoff per dtype. float16 and bfloat16 arithmetic on the CPU computes in float32 and rounds
# the result to the dtype: two roundings, u_dtype + u_float32 (1 + u_dtype) < u_dtype + 2^-23.
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11 + 2.0 ** -23,
                 "bfloat16": 2.0 ** -8 + 2.0 ** -23}


def oracle(inputs: list[torch.Tensor], op: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound): the sum (or mean) of the ranks' values in float64, and the worst rounding error of
    any transport's arithmetic in ``dtype``, per element.

    Sum, in any order: |fl(sum) - sum| <= gamma(n-1) sum |x_i|, gamma(k) = k u / (1 - k u) (Higham,
    Accuracy and Stability of Numerical Algorithms, 4.2). Mean: each contribution is divided by n (or
    multiplied by 1/n rounded to the dtype: two roundings, 2u + u^2) before the sum, or the sum is
    divided once (gamma(n-1) + u, within the former); a quotient in the subnormal range errs by up
    to eta, half the smallest subnormal, more. The float64 oracle itself errs by at most n u64 sum |x_i|.
    A world of one returns its own value: exact. Integers are exact.
    """
    n = len(inputs)
    if dtype == "int64":
        total = torch.stack(inputs).sum(0)
        return total.double(), torch.zeros(total.shape, dtype=torch.float64)
    wide = torch.stack([x.double() for x in inputs])
    total = wide.sum(0) / n if op == "avg" else wide.sum(0)
    if n == 1:
        return total, torch.zeros_like(total)
    u = UNIT_ROUNDOFF[dtype]
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    magnitude = wide.abs().sum(0)
    slack = n * 2.0 ** -53 * magnitude
    if op == "sum":
        return total, gamma * magnitude + slack
    finfo = torch.finfo(getattr(torch, dtype))
    eta = finfo.smallest_normal * finfo.eps / 2
    per_term = 2 * u + u * u
    return total, (per_term + gamma * (1 + per_term)) * magnitude / n + 2 * n * eta * (1 + gamma) + slack


def mismatch(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> str | None:
    """Where ``got`` is further from ``want`` than ``bound`` (NaN counts as far), or None."""
    error = (got.double() - want).abs()
    bad = ~(error <= bound)
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    return (f"element {i} of {got.numel()}: got {got[i].item()!r}, exact {want[i].item()!r}, error "
            f"{error[i].item():.3e} > bound {bound[i].item():.3e} ({int(bad.sum())} elements off)")


_ORACLES: dict = {}


def summed(numel: int, dtype: str, op: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of an all-reduce of ``numel`` elements per rank over n ranks (cached: many cases share it)."""
    key = ("sum", numel, dtype, op, n)
    if key not in _ORACLES:
        _ORACLES[key] = oracle([rank_input(numel, r, dtype) for r in range(n)], op, dtype)
    return _ORACLES[key]


def gathered(numel: int, dtype: str, n: int) -> torch.Tensor:
    """What an all-gather of ``numel`` elements per rank returns: every rank's input in rank order, bit for bit."""
    key = ("gather", numel, dtype, n)
    if key not in _ORACLES:
        _ORACLES[key] = torch.cat([rank_input(numel, r, dtype) for r in range(n)])
    return _ORACLES[key]


def crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().view(-1).view(torch.uint8).numpy()) if tensor.numel() else 0


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------- one case, on one rank


def run_case(t: transport.Transport, group, case: tuple, allocate=None, during=contextlib.nullcontext) -> dict:
    """Run one case on this rank and check what it returned.

    ``allocate(shape, dtype)`` makes the "allocated" buffers (default: ``t.allocate``); ``during()`` is
    entered around the collective alone. Returns ``error`` (what the call raised), ``problems`` (each
    a sentence: a wrong element, a modified input, a touched neighbour, a wrong handle) and ``crc``
    (the result's bits).
    """
    _, kind, dtype, op, m, placement, layout, async_op = case
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    dt = getattr(torch, dtype)
    allocated = placement == "allocated" or (placement == "mixed" and rank % 2 == 0)
    make = allocate or (lambda shape, dtype: t.allocate(shape, dtype=dtype))
    mark = float("nan") if dt.is_floating_point else -7  # what an output holds until the call fills it

    def new(*shape) -> torch.Tensor:
        return (make(shape, dt) if allocated else torch.empty(shape, dtype=dt)).fill_(mark)

    def strided(data: torch.Tensor | None, salt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Column 0 of a (len, 2) buffer (the data, or the mark), column 1 a neighbour: (view, base, neighbour)."""
        length = data.numel() if data is not None else m
        base, neighbour = new(length, 2), rank_input(length, rank, dtype, salt=salt)
        if data is not None:
            base[:, 0] = data
        base[:, 1] = neighbour
        return base[:, 0], base, neighbour

    neighbours = []  # (base, neighbour): column 1 must come back untouched
    if kind == "all_reduce":
        mine = rank_input(m, rank, dtype)
        if layout == "strided":
            tensor, base, neighbour = strided(mine, 1)
            neighbours.append((base, neighbour))
        else:
            tensor = new(m).copy_(mine)
        call, result, source = (lambda: t.all_reduce(tensor, op, async_op=async_op)), tensor, None
    elif kind == "reduce_scatter":
        mine = rank_input(n * m, rank, dtype)
        if layout == "strided":
            source, base, neighbour = strided(mine, 1)
            result, out_base, out_neighbour = strided(None, 2)
            neighbours += [(base, neighbour), (out_base, out_neighbour)]
        else:
            source = new(n * m).copy_(mine)
            result = source[rank * m:(rank + 1) * m] if layout == "in_place" else new(m)
        call = lambda: t.reduce_scatter(result, source, op, async_op=async_op)
    else:
        mine = rank_input(m, rank, dtype)
        if layout == "strided":
            source, base, neighbour = strided(mine, 1)
            result, out_base, out_neighbour = strided(torch.full((n * m,), mark, dtype=dt), 2)
            neighbours += [(base, neighbour), (out_base, out_neighbour)]
        else:
            result = new(n * m)
            source = result[rank * m:(rank + 1) * m].copy_(mine) if layout == "in_place" else new(m).copy_(mine)
        call = lambda: t.all_gather(result, source, async_op=async_op)
    try:
        with during():
            returned = call()
        problems, completed = [], None
        if async_op:
            if not isinstance(returned, transport.Work):
                problems.append(f"async_op=True returned {returned!r}, not a handle")
            elif returned.wait() is not True:
                problems.append("the handle's wait() did not return True")
            else:
                completed = returned.is_completed()
        elif returned is not None:
            problems.append(f"a blocking call returned {returned!r}, not None")
    except Exception as error:  # noqa: BLE001 - recorded, asserted in the parent
        return {"error": describe(error), "problems": [], "crc": None, "completed": None}
    if kind == "all_gather":
        if not torch.equal(result, gathered(m, dtype, n)):
            problems.append("the gathered tensor is not every rank's input in rank order, bit for bit")
    else:
        want, bound = summed(m if kind == "all_reduce" else n * m, dtype, op, n)
        if kind == "reduce_scatter":
            want, bound = want[rank * m:(rank + 1) * m], bound[rank * m:(rank + 1) * m]
        wrong = mismatch(result, want, bound)
        if wrong:
            problems.append(wrong)
    if kind != "all_reduce" and layout != "in_place" and not torch.equal(source, mine):
        problems.append("the input was modified")
    if kind == "reduce_scatter" and layout == "in_place":
        others = torch.cat([mine[:rank * m], mine[(rank + 1) * m:]])
        if not torch.equal(torch.cat([source[:rank * m], source[(rank + 1) * m:]]), others):
            problems.append("the input's other chunks were modified")
    for base, neighbour in neighbours:
        if not torch.equal(base[:, 1], neighbour):
            problems.append("a neighbour of the strided view was modified")
    return {"error": None, "problems": problems, "crc": crc(result), "completed": completed}


def near_max(numel: int, rank: int, dtype: str) -> torch.Tensor:
    """Values near the dtype's largest finite one, different per rank: their sum overflows, their mean does not."""
    noise = allreduce.rank_data(SEED + 2, numel, rank)
    return (torch.finfo(getattr(torch, dtype)).max * (0.9 - 0.01 * rank + 0.001 * noise)).to(getattr(torch, dtype))


def _overflow(group, ts: dict[str, transport.Transport]) -> dict:
    """The mean of values whose sum the dtype cannot hold, by every transport, allocated and plain:
    None where it is finite and within the rounding bound, else what went wrong."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = {}
    for name, t in ts.items():
        for kind in ("all_reduce", "reduce_scatter"):
            for dtype in ("float16", "bfloat16"):
                for placement in ("allocated", "plain"):
                    numel = 1003 if kind == "all_reduce" else n * 1003
                    new = t.allocate if placement == "allocated" else torch.empty
                    source = new((numel,), dtype=getattr(torch, dtype)).copy_(near_max(numel, rank, dtype))
                    want, bound = oracle([near_max(numel, r, dtype) for r in range(n)], "avg", dtype)
                    if kind == "all_reduce":
                        t.all_reduce(source, "avg")
                        result = source
                    else:
                        result = new((1003,), dtype=getattr(torch, dtype))
                        t.reduce_scatter(result, source, "avg")
                        want, bound = want[rank * 1003:(rank + 1) * 1003], bound[rank * 1003:(rank + 1) * 1003]
                    out[name, kind, dtype, placement] = mismatch(result, want, bound)
    return out


def _tracked(group, ts: dict[str, transport.Transport]) -> dict:
    """Each collective of every transport with autograd tracking its tensor (a leaf that requires grad, or a
    strided view of one: the all-reduce's tensor, the sharded ones' input), short (the shared memory's slots) and
    past the slots (its arena, where torch's in-place ops sum): None where the call ran outside autograd (nothing
    raised, no graph on the result) and its result is right, else what went wrong."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = {}
    for name, t in ts.items():
        for kind in KINDS:
            for op in ("sum",) if kind == "all_gather" else ("sum", "avg"):
                for layout in ("contiguous", "strided") if kind == "all_reduce" else ("contiguous",):
                    for numel in (1003, BIG[kind]):
                        key = (name, kind, op, layout, numel)
                        try:
                            out[key] = _tracked_call(t, kind, op, layout == "strided", numel, rank, n)
                        except Exception as error:  # every rank raises alike: the next call pairs as before
                            out[key] = describe(error)
    return out


def _tracked_call(t: transport.Transport, kind: str, op: str, strided: bool, numel: int, rank: int,
                  n: int) -> str | None:
    """One collective of ``numel`` elements a rank (a reduce-scatter: ``numel`` out of ``n * numel``) on a tracked
    tensor (``strided``: every other element of a leaf twice as long): as ``_tracked``."""
    if kind == "all_reduce":
        stride = 2 if strided else 1
        leaf = rank_input(stride * numel, rank, "float32").requires_grad_()
        tracked = leaf[::stride] if strided else leaf  # (slicing makes a view even at a stride of one)
        t.all_reduce(tracked, op)  # an in-place op autograd recorded on a leaf, or a view of one, would raise
        want, bound = oracle([rank_input(stride * numel, r, "float32")[::stride] for r in range(n)], op, "float32")
        if leaf.grad_fn is not None:
            return f"autograd recorded the all-reduce: {leaf.grad_fn}"
        return mismatch(tracked.detach(), want, bound)
    tracked = rank_input(n * numel if kind == "reduce_scatter" else numel, rank, "float32").requires_grad_()
    if kind == "reduce_scatter":
        result = torch.empty(numel)
        t.reduce_scatter(result, tracked, op)
        want, bound = (x[rank * numel:(rank + 1) * numel] for x in summed(n * numel, "float32", op, n))
    else:
        result = torch.empty(n * numel)
        t.all_gather(result, tracked)
        want, bound = gathered(numel, "float32", n).double(), torch.zeros(n * numel, dtype=torch.float64)
    if result.requires_grad:
        return f"autograd recorded the {kind}: {result.grad_fn}"
    return mismatch(result, want, bound)


def make_transports(group) -> dict[str, transport.Transport]:
    """Every transport of the grid over ``group`` (collective: every member makes them in this order)."""
    return {"torch": transport.Torch(group), "shared_memory": transport.SharedMemory(group),
            "p2p": allreduce.MessagePassing(group),
            "shared_memory+thread": transport.SharedMemory(group, background=True),
            "p2p+thread": allreduce.MessagePassing(group, background=True)}


def run_grid(group, grid, ts: dict[str, transport.Transport] | None = None) -> dict:
    """Every case of ``grid`` on ``group``, through ``ts`` (default: transports made for it and closed after)."""
    made = ts is None
    ts = make_transports(group) if made else ts
    out = {}
    for case in grid:
        if case[4] == 0:  # an empty collective: also which torch.distributed calls it made
            with CollectiveCounter() as counter:
                out[case] = run_case(ts[case[0]], group, case)
            out[case]["calls"] = dict(counter.calls)
        else:
            out[case] = run_case(ts[case[0]], group, case)
    for t in ts.values() if made else ():
        t.close()
    return out


# --------------------------------------------------------------------------- the sections of a group


class TorchCalls(CollectiveCounter):
    """A ``CollectiveCounter`` that also sees the names through which the transport reaches torch's sharded
    collectives on this torch (``reduce_scatter_single`` and ``all_gather_single`` from 2.13: ``dpkit.compat``)."""

    EXTRA = (compat.REDUCE_SCATTER_SINGLE, compat.ALL_GATHER_SINGLE)

    def __enter__(self) -> "TorchCalls":
        super().__enter__()
        for name in self.EXTRA:
            wrapped = self._wrap(name, getattr(c10d, name))
            for module in (dist, c10d):
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapped)
        return self

    @property
    def torch_collectives(self) -> int:
        return sum(self.calls[name] for name in ("all_reduce", *self.EXTRA))


def _zero_copy(group) -> dict:
    """Ownership, staging and the life of allocations, on a fresh transport (no staging block yet)."""
    t, other = transport.SharedMemory(group), transport.SharedMemory(group)
    a = t.allocate((1003,), dtype=torch.float32)
    out = {"owns": {"allocated": t.owns(a), "a contiguous slice": t.owns(a[3:10]),
                    "a plain tensor": t.owns(torch.ones(4)),
                    "another transport's": t.owns(other.allocate(4, dtype=torch.float32)),
                    "by torch": transport.Torch(group).owns(a),
                    "by message passing": allreduce.MessagePassing(group).owns(a)}}
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    x = t.allocate((1003,), dtype=torch.float64).copy_(rank_input(1003, rank, "float64"))
    rs_in = t.allocate((n * 1003,), dtype=torch.float32).copy_(rank_input(n * 1003, rank, "float32"))
    rs_out = t.allocate((1003,), dtype=torch.float32)
    ag_out = t.allocate((n, 1003), dtype=torch.float32)
    t.all_reduce(x, "sum")
    t.reduce_scatter(rs_out, rs_in, "avg")
    t.all_gather(ag_out, ag_out[rank].copy_(rank_input(1003, rank, "float32")))
    out["staged after allocated buffers"] = t.staging_bytes
    out["all_reduce"] = mismatch(x, *summed(1003, "float64", "sum", n))
    want, bound = summed(n * 1003, "float32", "avg", n)
    out["reduce_scatter"] = mismatch(rs_out, want[rank * 1003:(rank + 1) * 1003], bound[rank * 1003:(rank + 1) * 1003])
    out["all_gather"] = torch.equal(ag_out.view(-1), gathered(1003, "float32", n))
    t.all_reduce(torch.ones(shared_memory.SLOTS_BYTES // 4 + 8))  # a short one goes through the slots, unstaged
    out["staged after a plain tensor"] = t.staging_bytes
    t.release_staging()
    out["staged after release_staging"] = t.staging_bytes

    # The life of an allocation: a view keeps it; the last view's death returns it; freed neighbours merge.
    fresh = transport.SharedMemory(group)
    a = fresh.allocate((1000,), dtype=torch.float32).fill_(5.0)
    first = a.data_ptr()
    view = a[10:20]
    del a
    b = fresh.allocate((1000,), dtype=torch.float32)
    out["a live view keeps its block"] = b.data_ptr() != first and bool(torch.all(view == 5.0))
    del view
    c = fresh.allocate((1000,), dtype=torch.float32)
    out["the freed block is reused"] = c.data_ptr() == first
    del b, c
    d = fresh.allocate((2000,), dtype=torch.float32)
    out["freed neighbours merge into one block"] = d.data_ptr() == first
    for tr in (t, other, fresh):
        tr.close()
    return out


def _short_sums(group) -> dict:
    """Which way each all-reduce on shared memory went (``SharedMemory._short_sum``): "short" straight to the
    slots, "usual" through the checks and ``_all_reduce``; and the short ones' results against the oracle."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    t = transport.SharedMemory(group)
    usual, inner = [], t._all_reduce
    t._all_reduce = lambda flat, op: (usual.append(op), inner(flat, op))[1]

    def way(call) -> str:
        before = len(usual)
        call()
        return "usual" if len(usual) > before else "short"

    x = rank_input(1003, rank, "float32").view(17, 59)
    owned = t.allocate((1003,), dtype=torch.int64).copy_(rank_input(1003, rank, "int64"))
    ways = {"float32 sum, 2-D": way(lambda: t.all_reduce(x)),
            "int64 sum, in its own buffer": way(lambda: t.all_reduce(owned)),
            "float32 mean": way(lambda: t.all_reduce(torch.ones(8), "avg")),
            "float16 sum": way(lambda: t.all_reduce(torch.ones(8, dtype=torch.float16))),
            "async_op": way(lambda: t.all_reduce(torch.ones(8), async_op=True).wait()),
            "strided": way(lambda: t.all_reduce(torch.ones(16)[::2])),
            "tracked by autograd": way(lambda: t.all_reduce(torch.ones(8, requires_grad=True))),
            "past the slots": way(lambda: t.all_reduce(torch.ones(shared_memory.SLOTS_BYTES // 4 + 1)))}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        ways["under the profiler"] = way(lambda: t.all_reduce(torch.ones(8)))
    named = any(e.name == shared_memory.SHARED_MEMORY_RANGE.format("all_reduce") for e in profile.events())
    results = {"float32": mismatch(x.view(-1), *summed(1003, "float32", "sum", n)),
               "int64": mismatch(owned, *summed(1003, "int64", "sum", n))}
    t.close()
    return {"ways": ways, "results": results, "the range is named under the profiler": named}


def _refusals(group) -> dict:
    """Bad arguments to each transport, each refused before any message; then a good call."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = {}
    foreign = transport.SharedMemory(group)
    for name, t in (("torch", transport.Torch(group)), ("shared_memory", transport.SharedMemory(group)),
                    ("p2p", allreduce.MessagePassing(group))):
        buffer = foreign.allocate((4,), dtype=torch.float32)
        full = torch.zeros(n * 4)
        calls = {
            "unknown op": lambda: t.all_reduce(torch.ones(4), "max"),
            "integer mean": lambda: t.all_reduce(torch.arange(4), "avg"),
            "bool tensor": lambda: t.all_reduce(torch.ones(4, dtype=torch.bool)),
            "reduce_scatter sizes": lambda: t.reduce_scatter(torch.zeros(4), torch.zeros(n * 4 + 1)),
            "all_gather sizes": lambda: t.all_gather(torch.zeros(n * 4 + 1), torch.zeros(4)),
            "dtypes differ": lambda: t.all_gather(torch.zeros(n * 4), torch.zeros(4, dtype=torch.float64)),
            "overlapping, not the own chunk": lambda: t.reduce_scatter(full[1:5], full),
            "another transport's buffer": lambda: t.all_reduce(buffer),
        }
        if name == "shared_memory":
            calls["a meta tensor"] = lambda: t.all_reduce(torch.empty(4, device="meta"))
            calls["allocate on cuda"] = lambda: t.allocate((4,), dtype=torch.float32, device="cuda")
        out[name] = {case: refused(call) for case, call in calls.items()}
        x = rank_input(5, rank, "float64")
        t.all_reduce(x)  # no rank is left half-way through a protocol: the next call is exact
        out[name, "after"] = mismatch(x, *summed(5, "float64", "sum", n))
        t.close()
        try:
            t.all_reduce(torch.ones(4))
            out[name, "closed"] = None
        except RuntimeError as error:
            out[name, "closed"] = describe(error)
    out["bad algorithm"] = refused(lambda: allreduce.MessagePassing(group, algorithm="fastest"))
    foreign.close()
    return out


def _diverging(group) -> dict:
    """Ranks that bring different sizes or dtypes to one shared-memory call; then a good call."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    t = transport.SharedMemory(group)
    dtype = torch.float32 if rank == 0 else torch.float64
    calls = {
        "all_reduce sizes": lambda: t.all_reduce(torch.ones(4 + rank)),
        "all_reduce dtypes": lambda: t.all_reduce(torch.ones(8 // dtype.itemsize, dtype=dtype)),  # 8 bytes each
        "reduce_scatter sizes": lambda: t.reduce_scatter(torch.ones(4 + rank), torch.ones(n * (4 + rank))),
        "all_gather sizes": lambda: t.all_gather(torch.ones(n * (4 + rank)), torch.ones(4 + rank)),
    }
    out = {case: refused(call) for case, call in calls.items()}
    mean = t.allocate((4 + rank,), dtype=torch.float32).fill_(3.0)  # allocated: the mean could divide it in place
    out["allocated mean"] = refused(lambda: t.all_reduce(mean, "avg"))
    out["allocated mean, untouched"] = bool(torch.all(mean == 3.0))
    x = rank_input(7, rank, "float32")
    t.all_reduce(x)
    out["after"] = mismatch(x, *summed(7, "float32", "sum", n))
    t.close()
    return out


def _resolve(group, alone) -> dict:
    """What resolve picks, and the choices every rank refuses alike (``alone``: a group of this rank only)."""
    rank = dist.get_rank(group)
    out = {"picked": {}}
    for spec, device in (("auto", "cpu"), ("auto", "meta"), ("torch", "cpu"), ("shared_memory", "cpu"), ("p2p", "cpu"),
                         ("p2p:ring", "cpu")):
        t = transport.resolve(spec, group, device)
        out["picked"][spec, device] = (type(t).__name__, getattr(t, "algorithm", None),
                                       transport.resolve(spec, group, device) is t)
    out["picked"]["auto", "alone"] = (type(transport.resolve("auto", alone)).__name__, None, True)
    given = transport.Torch(group)
    out["given is returned"] = transport.resolve(given, group) is given
    shared = transport.resolve("shared_memory", group)
    out["refused"] = {
        "unknown name": refused(lambda: transport.resolve("fastest", group)),
        "unknown name on rank 1": refused(lambda: transport.resolve("fastest" if rank == 1 else "torch", group)),
        "different names": refused(lambda: transport.resolve("torch" if rank == 0 else "shared_memory", group)),
        "different device types": refused(lambda: transport.resolve("auto", group, "meta" if rank == 0 else "cpu")),
        "shared_memory for cuda": refused(lambda: transport.resolve("shared_memory", group, "cuda")),
        "a shared-memory object for cuda": refused(lambda: transport.resolve(shared, group, "cuda")),
        "a transport over more ranks": refused(lambda: transport.resolve(transport.Torch(group), alone)),
        "transports over different ranks": refused(lambda: transport.resolve(transport.Torch(alone), group)),
    }
    return out


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@contextlib.contextmanager
def no_room(active: bool = True):
    """/dev/shm is full: posix_fallocate says ENOSPC (on this rank, if ``active``)."""
    with mock.patch.object(shared_memory.os, "posix_fallocate", _full) if active else contextlib.nullcontext():
        yield


def _caught(fn):
    """``fn()`` with its RuntimeWarnings recorded: (result, number of them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, sum(issubclass(w.category, RuntimeWarning) for w in caught)


NO_ROOM_CASES = [(None, kind, dtype, op, 1003, placement, "contiguous", async_op)
                 for kind in KINDS for dtype, op in (("float32", "sum"), ("float16", "avg"), ("int64", "sum"))
                 if kind != "all_gather" or op == "sum"
                 for placement in ("allocated", "mixed") for async_op in (False, True)]
# Rank 1 (odd: plain under "mixed") finds no room to stage; the even ranks' buffers are allocated or plain.
# An all-reduce stages only past the slots (``shared_memory.SLOTS_BYTES``).
LONG = shared_memory.SLOTS_BYTES // 2 + 3
STAGING_CASES = [(None, "all_reduce", "float32", "sum", LONG, "mixed", "contiguous", False),
                 (None, "all_reduce", "float32", "avg", LONG, "mixed", "contiguous", False),
                 (None, "all_reduce", "float16", "avg", LONG, "plain", "contiguous", True),
                 (None, "reduce_scatter", "float32", "avg", 1003, "plain", "contiguous", False),
                 (None, "reduce_scatter", "float32", "sum", 1003, "mixed", "in_place", False),
                 (None, "all_gather", "float32", "sum", 1003, "plain", "contiguous", False),
                 (None, "all_gather", "int64", "sum", 1003, "mixed", "in_place", True)]


def _without_room(group) -> dict:
    """/dev/shm full at construction, at allocate, or on rank 1 when it stages one call."""
    rank = dist.get_rank(group)
    out = {}
    # At construction: the control file finds no room.
    with no_room():
        t, warned = _caught(lambda: transport.SharedMemory(group))
    with TorchCalls() as counter:
        results, later = _caught(lambda: {case: run_case(t, group, case) for case in NO_ROOM_CASES})
    out["construction"] = {"warnings": warned, "later warnings": later, "describe": t.describe(),
                           "owns": t.owns(t.allocate((4,), dtype=torch.float32)), "results": results,
                           "torch collectives": counter.torch_collectives}
    t.close()
    # At allocate only: a plain tensor, staged at each call; the transport stays shared memory.
    t = transport.SharedMemory(group)
    taken = []

    def allocate_without_room(shape, dtype):
        with no_room():
            tensor, warned = _caught(lambda: t.allocate(shape, dtype=dtype))
        taken.append((t.owns(tensor), warned))
        return tensor
    with TorchCalls() as counter:
        results = {case: run_case(t, group, case, allocate=allocate_without_room) for case in NO_ROOM_CASES}
    out["allocate"] = {"owned": [owned for owned, _ in taken], "warnings": sum(w for _, w in taken),
                       "describe": t.describe(), "results": results, "torch collectives": counter.torch_collectives}
    t.close()
    # To stage, on rank 1 only, in one call: that call goes through torch on every rank; the next does not.
    out["staging"] = {}
    for case in STAGING_CASES:
        t = transport.SharedMemory(group)  # no staging block yet: the call must take one
        with TorchCalls() as counter:
            result, warned = _caught(lambda: run_case(t, group, case, during=lambda: no_room(rank == 1)))
        with TorchCalls() as after:
            x = rank_input(5, rank, "float32")
            t.all_reduce(x)
        out["staging"][case] = {"result": result, "warnings": warned, "torch collectives": counter.torch_collectives,
                                "next call's torch collectives": after.torch_collectives}
        t.close()
    return out


def _made(make) -> str | tuple[str, str]:
    """The class of what ``make()`` returned (closed at once, if a transport), or (the ValueError's class, message)."""
    try:
        made = make()
    except ValueError as error:
        return type(error).__name__, str(error)
    if isinstance(made, transport.Transport):
        made.close()
    return type(made).__name__


def _apart(group) -> dict:
    """Ranks that cannot map each other's files: rank 1 in another PID namespace (simulated), or blind to the
    others' (it cannot open another process's /proc/<pid>/fd); and each rank in a directory of its own, which
    is not apart: the files have no name there, a peer reaches them through /proc."""
    rank = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    directory = tempfile.mkdtemp(prefix="dp-kit-test-")
    out = {"directories": _made(lambda: transport.SharedMemory(group, directory=directory))}
    out["directory left"] = os.listdir(directory)
    shutil.rmtree(directory, ignore_errors=True)

    elsewhere = shared_file.pid_namespace() + 1
    with mock.patch.object(shared_file, "pid_namespace", lambda: elsewhere) if rank == 1 else contextlib.nullcontext():
        out["namespaces"] = _made(lambda: transport.SharedMemory(group))

    real_open = os.open

    def blind(path, flags, *args, **kwargs):  # this rank may not open another process's descriptors
        if path.startswith("/proc/") and "/fd/" in path:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)
    fresh = [dist.new_group(ranks, use_local_synchronization=True) for _ in range(2)]  # resolve caches per group
    with mock.patch.object(shared_memory.os, "open", blind) if rank == 1 else contextlib.nullcontext():
        for case, call in (("constructor", lambda: transport.SharedMemory(group)),
                           ("auto", lambda: transport.resolve("auto", fresh[0])),
                           ("shared_memory", lambda: transport.resolve("shared_memory", fresh[1]))):
            out[case] = _made(call)
    return out


def _late(group) -> dict:
    """A group whose timeout is short: group rank 0 never joins a call; then group rank 0 brings an empty
    tensor where rank 1 brings four elements, and both follow with a good call."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    short = dist.new_group(ranks, timeout=datetime.timedelta(seconds=LATE_TIMEOUT_S), use_local_synchronization=True)
    out = {}
    # Both made first, while the ranks are in step: the short group's own messages must not wait for a late rank.
    t, t2 = transport.SharedMemory(short), transport.SharedMemory(short)
    if rank != 0:
        start = time.monotonic()
        try:
            t.all_reduce(torch.ones(8))
            out["never arrives"] = None
        except PeerFailedError as error:
            out["never arrives"] = (str(error), time.monotonic() - start)
    dist.barrier(group=group)
    for name, x in (("empty on rank 0", torch.ones(0 if rank == 0 else 4)),
                    ("next call", t2.allocate((4,), dtype=torch.float32).fill_(rank + 1.0))):
        try:
            t2.all_reduce(x)
            out[name] = (None, x.tolist())
        except (ValueError, PeerFailedError) as error:
            out[name] = (describe(error), None)
    out["next call, exact"] = [float(sum(range(1, n + 1)))] * 4
    return out


# PyTorch's engines over a transport: a small MLP, each rank its own part of a global batch.


def mlp() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(model: nn.Module, rank: int, optimizer=torch.optim.SGD, steps: int = 3, **options) -> list[torch.Tensor]:
    """A few steps on this rank's part of each step's batch; the parameters after them."""
    opt = optimizer(model.parameters(), **(options or {"lr": 0.1}))
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp(group, alone) -> dict:
    """Parameters after training with PyTorch's DDP as it is, and with its communication hooked to a
    transport, from the same weights and data; at 2 ranks also a hook over another group (the error)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = {"pytorch": train(DDP(mlp(), process_group=group), rank)}
    for name, make in (("shared_memory", transport.SharedMemory), ("torch", transport.Torch)):
        model = DDP(mlp(), process_group=group)
        model.register_comm_hook(make(group), transport.ddp_comm_hook)
        out[name] = train(model, rank)
    if n == 2:  # once is enough
        model = DDP(mlp(), process_group=group)
        model.register_comm_hook(transport.SharedMemory(alone), transport.ddp_comm_hook)
        try:
            train(model, rank, steps=1)
            out["other group"] = None
        except Exception as error:  # noqa: BLE001 - whatever DDP wraps it in, asserted in the parent
            out["other group"] = describe(error)
    return out


class CountingSharedMemory(transport.SharedMemory):
    """SharedMemory that records, for each buffer fully_shard asks it for, whether it lies in the arena."""

    def __init__(self, group):
        super().__init__(group)
        self.owned: list[bool] = []

    def allocate(self, shape, *, dtype, device=None):
        tensor = super().allocate(shape, dtype=dtype, device=device)
        self.owned.append(self.owns(tensor))
        return tensor


def _fully_shard(group) -> dict:
    """Full parameters after training with plain fully_shard and with the transport's collectives, and
    whether every buffer fully_shard asked the transport for lies in its arena."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank(group)
    mesh = DeviceMesh.from_group(group, "cpu")

    def sharded() -> nn.Module:
        model = mlp()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def full(params) -> list[torch.Tensor]:
        return [p.full_tensor() for p in params]
    options = dict(optimizer=torch.optim.Adam, lr=0.01)
    plain = full(train(sharded(), rank, **options))
    model, t = sharded(), CountingSharedMemory(group)
    modules = transport.use_with_fully_shard(model, t)
    through = full(train(model, rank, **options))
    return {"plain": plain, "transport": through, "modules": modules, "owned": t.owned}


def grid_in(group) -> dict:
    """Every section on ``group``, as seen by one member (``None``: the world)."""
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    # PyTorch's engines first: the hook finds its DDP among the garbage collector's objects, fewer now.
    out = {"pid": os.getpid(), "ddp": _ddp(group, alone), "fully_shard": _fully_shard(group)}
    ts = make_transports(group)
    out.update(cases=run_grid(group, cases(), ts), overflow=_overflow(group, ts), tracked=_tracked(group, ts))
    for t in ts.values():
        t.close()
    if n == WORLD:  # every rank alone, at the same time: a world of one
        out["alone"] = run_grid(alone, [case for case in cases() if case[4] in (0, 1003)
                                        and case[2] in ("float32", "int64")])
    out.update(zero_copy=_zero_copy(group), short_sums=_short_sums(group), refusals=_refusals(group),
               diverging=_diverging(group),
               resolve=_resolve(group, alone), without_room=_without_room(group), apart=_apart(group))
    if n == 2:  # seconds of waiting: once is enough
        out["late"] = _late(group)
    return out


@pytest.fixture(scope="module")
def grids() -> dict[int, list[dict]]:
    """Group size -> each member's results, in group-rank order."""
    by_size = run_in_subgroups(grid_in, WORLD, ROUNDS)
    assert sorted(by_size) == [2, 3]
    return by_size


def failures(per_rank: list[dict], keep=lambda case: True) -> list[str]:
    """Every case (of those ``keep`` keeps) that raised or found a problem, on any rank."""
    found = []
    for rank, results in enumerate(per_rank):
        for case, outcome in results.items():
            if keep(case) and (outcome["error"] or outcome["problems"]):
                found.append(f"rank {rank} {case}: {outcome['error'] or '; '.join(outcome['problems'])}")
    return found


def placement_failures(grids, n: int, name: str, kind: str, placement: str) -> list[str]:
    """``failures`` of the world of ``n`` for one transport, one collective and one placement of the tensors."""
    return failures([out["cases"] for out in grids[n]], lambda c: c[:2] == (name, kind) and c[6] == placement)


def shown(found: list[str]) -> str:
    return f"{len(found)} failing, e.g.:\n" + "\n".join(found[:8])


SIZES_N = (2, 3)


# --------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_oracle_passes_a_rounded_sum_and_catches_the_slips_a_transport_could_make(dtype):
    """The bound lets through a sum rounded in the dtype, in any order, and a mean divided before the
    sum; it catches a sum rounded to a narrower dtype, a missing contribution, a mean that was not
    divided, and an output left as it was."""
    inputs = [rank_input(1003, r, dtype) for r in range(3)]
    want, bound = oracle(inputs, "sum", dtype)
    assert mismatch((inputs[0] + inputs[1]) + inputs[2], want, bound) is None
    assert mismatch(inputs[2] + (inputs[1] + inputs[0]), want, bound) is None
    mean, mean_bound = oracle(inputs, "avg", dtype)
    assert mismatch(sum(x / 3 for x in inputs), mean, mean_bound) is None
    narrower = {"float64": torch.float32, "float32": torch.float16, "float16": torch.float16,
                "bfloat16": torch.bfloat16}[dtype]
    if narrower != getattr(torch, dtype):
        assert mismatch(sum(x.to(narrower) for x in inputs), want, bound) is not None
    assert mismatch(inputs[0] + inputs[1], want, bound) is not None
    assert mismatch(sum(inputs), mean, mean_bound) is not None
    assert mismatch(torch.full((1003,), float("nan"), dtype=getattr(torch, dtype)), want, bound) is not None
    integers = [rank_input(1003, r, "int64") for r in range(3)]
    exact, zero = oracle(integers, "sum", "int64")
    assert mismatch(sum(integers), exact, zero) is None and mismatch(sum(integers) + 1, exact, zero) is not None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", TRANSPORTS + THREADED)
@pytest.mark.parametrize("n", SIZES_N)
def test_every_collective_is_exact_for_every_dtype_op_size_and_placement(grids, n, name, kind):
    """all_reduce, reduce_scatter and all_gather on contiguous buffers: every float dtype summed and
    averaged within the dtype's rounding of the float64 sum of every rank's input, int64 summed
    exactly, gathers bit for bit; 0, 1 and 1003 elements per rank and a few MiB; buffers from
    ``allocate`` (zero copy), plain (staged) or allocated on some ranks only; blocking and
    asynchronous. Inputs come back unmodified."""
    found = placement_failures(grids, n, name, kind, "contiguous")
    assert not found, shown(found)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", TRANSPORTS + THREADED)
@pytest.mark.parametrize("n", SIZES_N)
def test_a_strided_view_is_reduced_through_the_view_and_its_neighbours_are_untouched(grids, n, name, kind):
    """Column 0 of a (len, 2) buffer (allocated or plain) as input and output: the result is exact and
    column 1 keeps its values."""
    found = placement_failures(grids, n, name, kind, "strided")
    assert not found, shown(found)


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("name", TRANSPORTS + THREADED)
@pytest.mark.parametrize("n", SIZES_N)
def test_the_in_place_forms_are_exact(grids, n, name, kind):
    """reduce_scatter whose output is chunk ``rank`` of its input (the other chunks stay as they were);
    all_gather whose input is chunk ``rank`` of its output."""
    found = placement_failures(grids, n, name, kind, "in_place")
    assert not found, shown(found)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("name", TRANSPORTS + THREADED)
@pytest.mark.parametrize("n", SIZES_N)
def test_a_mean_whose_sum_overflows_the_dtype_is_still_exact(grids, n, name, kind):
    """Every contribution is divided by the world size before the sum (as PyTorch's DDP does): float16
    and bfloat16 values near the largest finite one average to a finite, correctly bounded mean."""
    for dtype in ("float16", "bfloat16"):
        total = sum(near_max(1003, r, dtype).double() for r in range(n))
        assert torch.all(total > torch.finfo(getattr(torch, dtype)).max), "the premise: the sum does not fit"
    for out in grids[n]:
        wrong = {key: found for key, found in out["overflow"].items() if key[:2] == (name, kind) and found}
        assert not wrong, wrong


@pytest.mark.parametrize("n", [2, 3])
def test_a_collective_on_tensors_autograd_tracks_runs_outside_autograd(grids, n):
    """No collective is a step of an autograd graph: a leaf that requires grad, or a strided view of one, is
    all-reduced in place, and a sharded collective's tracked input leaves no graph on its output, by every transport,
    through the shared memory's slots and its arena alike (gloo's own sharded calls do not hold to this on a tracked
    input: the Torch transport makes them untracked); the results exact as ever."""
    for out in grids[n]:
        # all-reduce: sum and mean, contiguous and strided; reduce-scatter: sum and mean; all-gather; 2 sizes each
        assert len(out["tracked"]) == len(TRANSPORTS + THREADED) * (4 + 2 + 1) * 2
        wrong = {key: found for key, found in out["tracked"].items() if found}
        assert not wrong, wrong


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", TRANSPORTS + THREADED)
def test_a_handle_says_it_is_completed_once_waited_on(grids, name, kind):
    """Every asynchronous case above: after ``wait()`` returned True, ``is_completed()`` is True."""
    waited = {(n, rank, case): outcome["completed"] for n in SIZES_N for rank, out in enumerate(grids[n])
              for case, outcome in out["cases"].items()
              if case[:2] == (name, kind) and outcome["completed"] is not None}
    assert waited, "no asynchronous case of this transport and collective returned a handle that waited"
    pending = [key for key, completed in waited.items() if not completed]
    assert not pending, pending[:5]


@pytest.mark.parametrize("n", SIZES_N)
def test_every_rank_of_an_all_reduce_holds_the_same_bits(grids, n):
    """Each element is summed once and copied (shared memory), or by the same algorithm on every rank:
    replicas cannot drift apart. All-gathers too."""
    compared = 0
    for case in cases():
        outcomes = [out["cases"][case] for out in grids[n]]
        wrong = any(o["error"] or o["problems"] for o in outcomes)  # asserted by the tests above
        if case[1] != "reduce_scatter" and not wrong:
            assert len({o["crc"] for o in outcomes}) == 1, case
            compared += 1
    assert compared > len(cases()) // 2


@pytest.mark.parametrize("n", SIZES_N)
def test_the_communication_thread_changes_when_a_sum_is_made_not_its_bits(grids, n):
    """``background=True`` runs the same arithmetic on another thread: the same bits as inline."""
    for case in cases():
        if case[0] in THREADED:
            inline = (case[0].removesuffix("+thread"), *case[1:])
            for out in grids[n]:
                assert out["cases"][case]["crc"] == out["cases"][inline]["crc"], case


@pytest.mark.parametrize("n", SIZES_N)
def test_an_empty_collective_returns_at_once_without_a_message(grids, n):
    """0 elements per rank: nothing to exchange, so no torch.distributed call (and, above, no error)."""
    for case in cases():
        if case[4] == 0:
            for out in grids[n]:
                assert out["cases"][case]["calls"] == {}, case


@pytest.mark.parametrize("name", TRANSPORTS + THREADED)
def test_a_world_of_one_returns_its_own_data(grids, name):
    """A group of one rank: the sum and the mean are the rank's own values, exactly (no division), the
    gather and the scatter copies of its input, in every layout."""
    found = failures([out["alone"] for out in grids[WORLD]], lambda c: c[0] == name)
    assert not found, shown(found)


# --------------------------------------------------------------------------- zero copy


@pytest.mark.parametrize("n", SIZES_N)
def test_allocate_returns_buffers_that_shared_memory_owns_and_no_other_transport_does(grids, n):
    """``owns``: a buffer from this transport's ``allocate`` (and a contiguous slice of it) lies in its
    arena; a plain tensor, or another transport's buffer, does not; Torch and message passing own nothing."""
    for out in grids[n]:
        assert out["zero_copy"]["owns"] == {
            "allocated": True, "a contiguous slice": True, "a plain tensor": False, "another transport's": False,
            "by torch": False, "by message passing": False}


@pytest.mark.parametrize("n", SIZES_N)
def test_collectives_on_allocated_buffers_stage_nothing(grids, n):
    """An all-reduce, a reduce-scatter and an all-gather on buffers from ``allocate``: exact, and the
    transport never took a staging block (``staging_bytes`` is 0: each rank read the others' buffers
    where they lie); the first plain tensor makes it take one, so the observation can tell."""
    for out in grids[n]:
        zero = out["zero_copy"]
        assert zero["all_reduce"] is None and zero["reduce_scatter"] is None and zero["all_gather"]
        assert zero["staged after allocated buffers"] == 0
        assert zero["staged after a plain tensor"] > 0 and zero["staged after release_staging"] == 0


@pytest.mark.parametrize("n", SIZES_N)
def test_a_short_sum_the_caller_waits_for_goes_straight_to_the_slots_every_other_call_the_usual_way(grids, n):
    """A contiguous CPU sum of a dtype C++ sums, of at most SLOTS_BYTES, untracked, waited for: the slots at once
    (any shape, in its own buffer or not), exact. A mean, another dtype, async_op, a strided or tracked tensor, a
    longer one, or a call under the profiler (whose range the usual path names): the usual path."""
    for out in grids[n]:
        short = out["short_sums"]
        assert short["ways"] == {"float32 sum, 2-D": "short", "int64 sum, in its own buffer": "short",
                                 "float32 mean": "usual", "float16 sum": "usual", "async_op": "usual",
                                 "strided": "usual", "tracked by autograd": "usual", "past the slots": "usual",
                                 "under the profiler": "usual"}
        assert short["results"] == {"float32": None, "int64": None}
        assert short["the range is named under the profiler"]


@pytest.mark.parametrize("n", SIZES_N)
def test_an_allocation_returns_to_the_arena_when_its_last_view_dies(grids, n):
    """A slice outlives its tensor and keeps the block (and its values); once the last view is gone the
    next allocation of that size takes the same block, and freed neighbours merge into one."""
    for out in grids[n]:
        zero = out["zero_copy"]
        assert zero["a live view keeps its block"] and zero["the freed block is reused"]
        assert zero["freed neighbours merge into one block"]


# --------------------------------------------------------------------------- refusals


REFUSALS = {
    "unknown op": "ValueError: unknown op 'max'",
    "integer mean": "TypeError: op='avg' needs a floating dtype",
    "bool tensor": "TypeError: cannot all-reduce a torch.bool tensor",
    "reduce_scatter sizes": "ValueError: input has",
    "all_gather sizes": "ValueError: output has",
    "dtypes differ": "TypeError: output (torch.float32, cpu) and input (torch.float64, cpu)",
    "overlapping, not the own chunk": "ValueError: output and input overlap",
    "another transport's buffer": "ValueError: a buffer allocated by SharedMemory(shared_memory",
    "a meta tensor": "ValueError: SharedMemory(shared_memory, ranks=",
    "allocate on cuda": "ValueError: SharedMemory(shared_memory, ranks=",
}


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize("n", SIZES_N)
def test_bad_arguments_are_refused_before_any_message_and_the_transport_stays_usable(grids, n, name):
    """Unknown op, integer mean, bool, sizes that are not world size x shard, mixed dtypes, overlapping
    buffers other than the in-place form, a buffer another transport allocated; for shared memory also a
    tensor that is not on the CPU and an allocation on cuda (no GPU needed to refuse it). Each raises
    without a torch.distributed call; the next good call is exact (no rank was left half-way)."""
    for out in grids[n]:
        got = out["refusals"][name]
        for case, outcome in got.items():
            assert outcome["error"] is not None and outcome["error"].startswith(REFUSALS[case]), (case, outcome)
            assert outcome["calls"] == {}, (case, outcome["calls"])
        assert out["refusals"][name, "after"] is None
        assert out["refusals"]["bad algorithm"]["error"].startswith(
            "ValueError: unknown algorithm 'fastest': choose one of auto, ring")
        if name == "shared_memory":
            assert "takes CPU tensors, got one on meta" in got["a meta tensor"]["error"]
            assert "allocates CPU tensors, not on cuda" in got["allocate on cuda"]["error"]


@pytest.mark.parametrize("name", ["torch", "shared_memory", "p2p"])
def test_a_closed_transport_refuses_calls(grids, name):
    """``close()``'s contract: the transport refuses calls afterwards."""
    for out in grids[WORLD]:
        assert out["refusals"][name, "closed"] is not None and "is closed" in out["refusals"][name, "closed"]


@pytest.mark.parametrize("n", SIZES_N)
def test_ranks_that_bring_different_sizes_or_dtypes_to_shared_memory_all_raise_naming_them(grids, n):
    """Without the check each rank would read its peers' data at its own length. Every rank raises
    ValueError with every rank's bytes and dtype, and the transport stays usable."""
    for rank, out in enumerate(grids[n]):
        got = out["diverging"]
        for case in ("all_reduce sizes", "reduce_scatter sizes", "all_gather sizes", "all_reduce dtypes",
                     "allocated mean"):
            error = got[case]["error"]
            assert error is not None and error.startswith(
                f"ValueError: rank {rank}/{n}: the ranks called different shared-memory collectives"), (case, error)
        element = {"all_reduce sizes": 4, "reduce_scatter sizes": 4 * n, "all_gather sizes": 4}
        for case, per_rank in element.items():
            for r in range(n):
                row = f"rank {r}: {case.split()[0]} of {(4 + r) * per_rank} bytes of torch.float32"
                assert row in got[case]["error"], (row, got[case]["error"])
        dtypes = got["all_reduce dtypes"]["error"]
        assert "rank 0: all_reduce of 8 bytes of torch.float32" in dtypes
        assert "rank 1: all_reduce of 8 bytes of torch.float64" in dtypes
        assert got["after"] is None


@pytest.mark.parametrize("n", SIZES_N)
def test_a_refused_shared_memory_mean_leaves_the_callers_buffer_untouched(grids, n):
    """A call refused because the ranks diverged must not have changed the caller's data."""
    for out in grids[n]:
        assert out["diverging"]["allocated mean"]["error"] is not None
        assert out["diverging"]["allocated mean, untouched"]


def test_an_empty_tensor_on_one_rank_is_refused_on_every_rank_and_the_next_call_is_exact(grids):
    """Group rank 0 brings 0 elements, rank 1 four: like any other size mismatch, every rank raises
    ValueError at once; and the next good call is exact, not a sum of calls that do not belong together."""
    for out in grids[2]:
        error, _ = out["late"]["empty on rank 0"]
        assert error is not None and error.startswith("ValueError"), error
    for out in grids[2]:
        assert out["late"]["next call"] == (None, out["late"]["next call, exact"])


def test_a_peer_that_never_arrives_fails_the_call_naming_it_within_the_group_timeout(grids):
    """Group rank 0 never calls; rank 1 raises PeerFailedError naming rank 0 once the group's timeout
    (short here) has passed, not before and not much later."""
    message, seconds = grids[2][1]["late"]["never arrives"]
    assert "rank(s) [0] did not reach the shared-memory collective" in message
    assert f"within the {LATE_TIMEOUT_S:g} s process-group timeout" in message
    assert LATE_TIMEOUT_S <= seconds < LATE_TIMEOUT_S + 10


# --------------------------------------------------------------------------- resolve


@pytest.mark.parametrize("n", SIZES_N)
def test_resolve_picks_shared_memory_on_one_cpu_host_and_makes_each_transport_once_per_group(grids, n):
    """"auto" is shared memory for CPU tensors of ranks on one host, torch for other devices and for a
    group of one; each name makes its transport once per group; a Transport passed in is returned."""
    for out in grids[n]:
        assert out["resolve"]["picked"] == {
            ("auto", "cpu"): ("SharedMemory", None, True), ("auto", "meta"): ("Torch", None, True),
            ("torch", "cpu"): ("Torch", None, True), ("shared_memory", "cpu"): ("SharedMemory", None, True),
            ("p2p", "cpu"): ("MessagePassing", "auto", True), ("p2p:ring", "cpu"): ("MessagePassing", "ring", True),
            ("auto", "alone"): ("Torch", None, True)}
        assert out["resolve"]["given is returned"]


RESOLVE_REFUSALS = {
    "unknown name": "ValueError: this engine: unknown transport 'fastest' (on group rank 0): choose one of "
                    + ", ".join(transport.names()) + ", or pass a Transport",
    "unknown name on rank 1": "ValueError: this engine: unknown transport 'fastest' (on group rank 1)",
    "different names": "ValueError: this engine: the ranks chose different transports (rank {0}: torch, "
                       "rank {1}: shared_memory",
    "different device types": "ValueError: this engine: the ranks hold their tensors on different device types "
                              "(rank {0}: meta, rank {1}: cpu",
    "shared_memory for cuda": "ValueError: this engine: transport 'shared_memory' takes CPU tensors, not cuda ones",
    "a shared-memory object for cuda": "ValueError: this engine: SharedMemory(shared_memory, ranks=",
    "transports over different ranks": "ValueError: this engine: the transport is over ranks",
}


@pytest.mark.parametrize("case", list(RESOLVE_REFUSALS))
@pytest.mark.parametrize("n", SIZES_N)
def test_resolve_refuses_a_bad_choice_on_every_rank_with_one_message(grids, n, case):
    """resolve exchanges every rank's choice and device type first, so a choice one rank gets wrong
    fails every rank, with the same message (no rank goes on to wait for the others)."""
    ranks = [1, 2] if n == 2 else [0, 1, 2]
    errors = [out["resolve"]["refused"][case]["error"] for out in grids[n]]
    assert errors[0] is not None and errors[0].startswith(RESOLVE_REFUSALS[case].format(*ranks)), errors[0]
    assert errors == [errors[0]] * n


@pytest.mark.parametrize("n", SIZES_N)
def test_resolve_refuses_a_transport_over_other_ranks_than_the_engines(grids, n):
    ranks = [1, 2] if n == 2 else [0, 1, 2]
    for rank, out in enumerate(grids[n]):
        assert out["resolve"]["refused"]["a transport over more ranks"]["error"] == (
            f"ValueError: this engine: the transport is over ranks {ranks} (on group rank 0), the engine's group over "
            f"[{ranks[rank]}]: make the transport over the engine's process group")


# --------------------------------------------------------------------------- /dev/shm without room


@pytest.mark.parametrize("n", SIZES_N)
def test_without_room_at_construction_it_warns_once_on_rank_0_and_computes_through_torch(grids, n):
    """posix_fallocate says ENOSPC for the control file: shared memory goes through torch.distributed,
    with one RuntimeWarning on group rank 0 (none on the others, none at later calls); ``allocate``
    hands out plain tensors; every collective is exact."""
    for rank, out in enumerate(grids[n]):
        got = out["without_room"]["construction"]
        assert got["warnings"] == (rank == 0) and got["later warnings"] == 0
        assert got["describe"] == "shared_memory (through torch: no room)" and got["owns"] is False
        assert got["torch collectives"] >= len(NO_ROOM_CASES)
        found = failures([got["results"]])
        assert not found, shown(found)


@pytest.mark.parametrize("n", SIZES_N)
def test_without_room_to_allocate_it_hands_out_plain_tensors_and_stays_exact(grids, n):
    """ENOSPC at ``allocate`` only: a plain tensor (warned once, on group rank 0), staged at each call
    through the shared memory, which the transport still uses (no torch.distributed collective)."""
    for rank, out in enumerate(grids[n]):
        got = out["without_room"]["allocate"]
        assert got["owned"] and not any(got["owned"])
        assert got["warnings"] == (rank == 0) and got["describe"] == "shared_memory"
        if transport.POLLS:
            assert got["torch collectives"] == 0
        found = failures([got["results"]])
        assert not found, shown(found)


@pytest.mark.parametrize("n", SIZES_N)
def test_a_rank_without_room_to_stage_sends_that_call_through_torch_on_every_rank(grids, n):
    """Group rank 1 cannot take a staging block for one call (its tensor is plain): every rank learns it
    from the descriptors and that call goes through torch.distributed on every rank, exact, whether the
    others' buffers were allocated (and, for a mean, already divided) or staged; rank 0 warns. The next
    call finds room and goes through shared memory again."""
    for rank, out in enumerate(grids[n]):
        for case, got in out["without_room"]["staging"].items():
            assert not failures([{case: got["result"]}]), (case, got["result"])
            assert got["torch collectives"] == 1, (case, got["torch collectives"])
            assert got["warnings"] == (rank == 0), case
            if transport.POLLS:
                assert got["next call's torch collectives"] == 0, case


# --------------------------------------------------------------------------- not one host


@pytest.mark.parametrize("n", SIZES_N)
def test_ranks_that_cannot_see_each_others_files_raise_not_one_host_on_every_rank(grids, n):
    """Rank 1 in another PID namespace, or blind to the files the others made: the constructor raises
    NotOneHost (a ValueError) on every rank, saying why; resolve "auto" falls back to torch, resolve
    "shared_memory" raises. A directory of its own for each rank is no obstacle, and holds nothing after."""
    for out in grids[n]:
        got = out["apart"]
        for case in ("namespaces", "constructor", "shared_memory"):
            assert got[case] is not None and got[case][0] == "NotOneHost", (case, got[case])
            assert "needs every rank of the group on this host" in got[case][1], case
        assert "ranks in different PID namespaces cannot open each other's shared file" in got["namespaces"][1]
        assert "rank 1 cannot map rank 0's control file: cannot open /proc/" in got["constructor"][1]
        assert got["auto"] == "Torch"
        assert got["directories"] == "SharedMemory" and got["directory left"] == []


def test_nothing_is_left_in_dev_shm(grids):
    """The files never have a name (``shared_file``): whatever happened, nothing named after a worker of this
    run is in /dev/shm."""
    pids = {out["pid"] for outs in grids.values() for out in outs}
    assert [path for pid in pids for path in glob.glob(f"{transport.SHM_DIRECTORY}/dp-kit-{pid}-*")] == []


# --------------------------------------------------------------------------- PyTorch's DDP and fully_shard


def test_ddp_over_shared_memory_trains_bit_for_bit_like_pytorchs_ddp_at_two_ranks(grids):
    """At 2 ranks the hook's mean and PyTorch's reducer both divide each gradient by 2, exactly (a power
    of two), and then add two numbers, which is commutative whatever order each makes it in: every
    parameter after every SGD step has the same bits. The Torch transport (the hook's asynchronous path:
    gloo's future) makes PyTorch's own call, divide then sum."""
    for out in grids[2]:
        for name in ("shared_memory", "torch"):
            assert all(torch.equal(a, b) for a, b in zip(out["ddp"]["pytorch"], out["ddp"][name])), name


def test_ddp_over_a_transport_trains_like_pytorchs_ddp_at_three_ranks_to_float32_round_off(grids):
    """At 3 ranks the division by 3 rounds and the three terms may be added in another order: the
    parameters agree to float32 round-off (a wrong bucket or a sum without the mean is far off)."""
    for out in grids[WORLD]:
        for name in ("shared_memory", "torch"):
            for a, b in zip(out["ddp"]["pytorch"], out["ddp"][name]):
                assert torch.allclose(b, a, rtol=1e-5, atol=1e-6), (name, (b - a).abs().max().item())


def test_a_ddp_hook_over_another_group_than_the_ddps_raises(grids):
    """DDP over the group, its hook's transport over this rank alone: the first bucket raises ValueError
    on every rank, naming both rank lists, instead of averaging over the wrong ranks."""
    for out in grids[2]:
        error = out["ddp"]["other group"]
        assert error is not None and "ValueError" in error, error
        assert "ddp_comm_hook: the transport is over ranks" in error
        assert "make the transport over the DDP's process group" in error


@pytest.mark.parametrize("n", SIZES_N)
def test_fully_shard_over_shared_memory_trains_like_plain_fully_shard_in_buffers_it_allocated(grids, n):
    """PyTorch's fully_shard on each Linear and the root, with the transport's all-gather and
    reduce-scatter: the same parameters as plain fully_shard after a few Adam steps, to float32
    round-off (the reduce-scatter may add in another order), and every buffer fully_shard allocated for
    its collectives came from the shared-memory arena."""
    for out in grids[n]:
        got = out["fully_shard"]
        assert got["modules"] == 3
        assert got["owned"] and all(got["owned"]), got["owned"]
        for a, b in zip(got["plain"], got["transport"]):
            assert torch.allclose(b, a, rtol=1e-5, atol=1e-6), (b - a).abs().max().item()


# --------------------------------------------------------------------------- a rank killed (slow)


def launch_to_the_end(fn, world_size: int, *args, pg_timeout_s: float, timeout_s: float = 120.0):
    """Run ``fn(ctx, *args)`` on spawned ranks as ``process_groups.launch`` does, but let every rank run to its
    end when one dies (``launch`` stops the others soon after a death, to report it as the root
    cause; here the survivors are the subject). Returns each rank's exit code, each rank's result
    (None without one), and the workers' pids."""
    spawn = multiprocessing.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="dpkit-transport-")
    store = os.path.join(tmp, "store")
    processes = [spawn.Process(target=process_groups.worker_main,
                               args=(fn, rank, world_size, store, "gloo", pg_timeout_s, 1, args, tmp))
                 for rank in range(world_size)]
    try:
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in processes):  # is_alive() reaps a dead rank at once, as a launcher does
            left = deadline - time.monotonic()
            assert left > 0, f"still running after {timeout_s:g} s"
            multiprocessing.connection.wait([p.sentinel for p in processes if p.is_alive()], timeout=left)
        results = [torch.load(path, weights_only=False) if os.path.exists(path) else None
                   for path in (os.path.join(tmp, f"result-{rank}.pt") for rank in range(world_size))]
        return [p.exitcode for p in processes], results, [p.pid for p in processes]
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)


def _killed_between_the_synchronisations(ctx, victim: int):
    """A whole all-reduce, then one in which ``victim`` kills itself after the first synchronisation."""
    t = transport.SharedMemory()
    x = t.allocate((1 << 16,), dtype=torch.float32).fill_(1.0)
    t.all_reduce(x)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    with mock.patch.object(shared_memory, "sum_chunk", die if ctx.rank == victim else shared_memory.sum_chunk):
        start = time.monotonic()
        try:
            t.all_reduce(x)
        except PeerFailedError as error:
            return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.slow
def test_a_rank_killed_in_the_middle_of_a_shared_memory_all_reduce_fails_the_others_naming_it():
    """Rank 1 of 3 dies (SIGKILL) between the call's two synchronisations: ranks 0 and 2 raise
    PeerFailedError naming rank 1 within the group's timeout (before it runs out, here: the peer's
    process is gone, which they can see), and no file is left in /dev/shm (the files never had a
    name, so not even a killed process can leave one)."""
    pg_timeout_s = 5.0
    codes, results, pids = launch_to_the_end(_killed_between_the_synchronisations, 3, 1, pg_timeout_s=pg_timeout_s)
    assert codes == [0, -signal.SIGKILL, 0], codes
    for rank in (0, 2):
        error, seconds = results[rank]["error"], results[rank]["seconds"]
        assert error is not None and "a peer failed" in error, error
        assert "rank(s) [1] did not reach the shared-memory collective" in error, error
        assert seconds < pg_timeout_s, seconds
    assert glob.glob(f"{transport.SHM_DIRECTORY}/dp-kit-{pids[0]}-*") == []


def _stops_answering(ctx, pid_file: str):
    """Rank 1 stops answering between the synchronisations of a shared-memory all-reduce; rank 0 waits."""
    if ctx.rank == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    t = transport.SharedMemory()
    silent = lambda *args, **kwargs: time.sleep(600)  # noqa: E731
    with mock.patch.object(shared_memory, "sum_chunk", silent if ctx.rank == 1 else shared_memory.sum_chunk):
        t.all_reduce(torch.ones(LONG))  # past the slots: through the control file, whose sums it silences


def _broken_on_one_path_seen_on_the_other(ctx) -> dict:
    """Rank 1's short all-reduce fails on the slots (a local error); rank 0 meanwhile starts a long one, through
    the control file."""
    t = transport.SharedMemory()
    start = time.monotonic()
    try:
        if ctx.rank == 1:
            def fail(*args, **kwargs):
                raise RuntimeError("a local failure")
            with mock.patch.object(t._slots, "all_reduce", fail):
                t.all_reduce(torch.ones(4))
        else:
            t.all_reduce(torch.ones(LONG))
    except Exception as error:  # noqa: BLE001  (what each rank raised is the result)
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    finally:
        t.close()
    return {"error": None}


@pytest.mark.slow
def test_a_failure_on_the_slots_stops_a_peer_waiting_in_the_control_file_at_once_naming_it():
    """The transport's two paths share its broken state: rank 0 does not wait out the 30 s timeout."""
    found = process_groups.launch(_broken_on_one_path_seen_on_the_other, 2, timeout_s=120, pg_timeout_s=30)
    assert found[1]["error"] == "RuntimeError: a local failure", found[1]
    error, seconds = found[0]["error"], found[0]["seconds"]
    assert error.startswith("PeerFailedError") and "rank 1 broke off" in error, error
    assert seconds < 10, seconds


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_the_job_through_the_launcher_within_the_timeout(tmp_path):
    """The launcher reports rank 0's PeerFailedError (naming rank 1 and the timeout) instead of hanging,
    and nothing is left in /dev/shm after it stopped the silent rank."""
    pid_file = str(tmp_path / "pid")
    message, seconds = launch_expecting_peer_failure(_stops_answering, 2, pid_file, rank=0, pg_timeout_s=5)
    assert "rank(s) [1] did not reach the shared-memory collective" in message and seconds < 60
    with open(pid_file) as f:
        assert glob.glob(f"{transport.SHM_DIRECTORY}/dp-kit-{f.read()}-*") == []
