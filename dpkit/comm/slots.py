"""Slots: the ranks of one host exchange messages through two slots per rank in one shared file.

    slots = Slots(store, rank, size, timeout_s)     # a collective over a c10d store; None without room
    slots.all_reduce(t, "sum")                      # in place; also broadcast, all_gather, reduce_scatter
    slots.buffer(n, torch.float32)                  # a tensor in this rank's next slot: no copy in

The scheme is DeepSpeed's "symmetric naive" all-reduce. Every rank owns a header (an epoch counter
and, per slot, the descriptor of the message in it) and two data slots. A call of E pieces is E
epochs: a rank copies its piece into slot ``epoch % 2``, writes the descriptor, then its counter;
it waits until every peer's counter reaches the epoch, checks the descriptors against its own, and
reduces every rank's slot straight into its output, in rank order (so every rank gets the same bits).
One wait per piece, no second one: a rank writes slot s again two epochs later, when every peer has
posted the epoch between and so has finished reading it. A message longer than a slot goes piece by
piece. x86 keeps a core's stores in order, so a peer that sees the counter sees the data.

The wait is bounded: within the timeout, or at once when a late peer's process is gone, it raises
``PeerFailedError`` naming the ranks. The file is unlinked as soon as every rank mapped it.
"""

from __future__ import annotations

import datetime
import mmap
import os
import time
from typing import Callable

import numpy as np
import torch

from dpkit.comm.process_groups import PeerFailedError, start_time

SLOT_BYTES = 1 << 21  # one slot; a message longer than this goes piece by piece
HEADER_WORDS = 16  # int64 words per rank: two cache lines
_COUNTER, _PID, _STARTED = 0, 1, 2
_DESCRIPTOR = 3  # the descriptor of slot p: words [3 + 5p, 8 + 5p): kind, dtype, numel, op, root
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool)
KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "none")
SPINS = 50  # polls before yielding the core, when the host has a core per rank


def reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: str) -> None:
    """``out`` <- ``op`` over ``parts`` (every rank's piece), left to right in rank order."""
    if op in ("sum", "avg"):
        torch.add(parts[0], parts[1], out=out) if len(parts) > 1 else out.copy_(parts[0])
        for part in parts[2:]:
            out.add_(part)
        if op == "avg":
            out.div_(len(parts))
        return
    combine = {"product": torch.mul, "min": torch.minimum, "max": torch.maximum, "band": torch.bitwise_and,
               "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    out.copy_(parts[0])
    for part in parts[1:]:
        combine(out, part, out=out)


class Slots:
    """The slots of ``size`` ranks of one host (see the module docstring). Make it with ``Slots.open``."""

    def __init__(self, mapping: mmap.mmap, rank: int, size: int, timeout_s: float, label: str):
        self.rank, self.size, self.timeout_s, self.label = rank, size, timeout_s, label
        self._mapping = mapping
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        words = np.frombuffer(mapping, np.int64, count=HEADER_WORDS * size)
        self._headers = words.reshape(size, HEADER_WORDS)  # live: peers write theirs
        self._counters = self._headers[:, _COUNTER]
        self._mine = self._headers[rank]
        self._mine[_PID], self._mine[_STARTED] = os.getpid(), start_time(os.getpid())
        self._epoch = 0
        self._views: dict[tuple, torch.Tensor] = {}
        self._spins = SPINS if size <= len(os.sched_getaffinity(0)) else 0  # oversubscribed: yield at once
        self._peers_visible: bool | None = None

    @staticmethod
    def open(store, rank: int, size: int, timeout_s: float, directory: str = "/dev/shm") -> "Slots | None":
        """Make (rank 0), map (every rank) and unlink the shared file through ``store``; None on every rank
        when /dev/shm has no room for it. A collective over the ranks of ``store``."""
        timeout = datetime.timedelta(seconds=timeout_s)
        nbytes = 8 * HEADER_WORDS * size + 2 * SLOT_BYTES * size
        if rank == 0:
            store.set("slots/name", _make_file(directory, nbytes))
        store.wait(["slots/name"], timeout)
        name = store.get("slots/name").decode()
        if not name:
            return None
        try:
            fd = os.open(name, os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            store.set(f"slots/mapped/{rank}", "1")
            store.wait([f"slots/mapped/{r}" for r in range(size)], timeout)
        finally:
            if rank == 0 and os.path.exists(name):
                os.unlink(name)  # every rank mapped it (or one failed): nothing stays in /dev/shm
        return Slots(mapping, rank, size, timeout_s, os.path.basename(name))

    # ---- one exchange: post a piece, wait for every rank's, use them

    def slot(self, rank: int, parity: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Rank ``rank``'s slot ``parity`` as ``numel`` elements of ``dtype`` (views kept: making one costs
        microseconds, and a training loop exchanges the same shapes every step)."""
        key = (rank, parity, dtype, numel)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 1024:
                self._views.clear()
            start = 8 * HEADER_WORDS * self.size + (2 * rank + parity) * SLOT_BYTES
            view = self._views[key] = self._bytes[start:start + numel * dtype.itemsize].view(dtype)
        return view

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slot of the next epoch, for a message of at most one slot written in place:
        ``all_reduce(slots.buffer(n, dtype), op, posted=True)`` skips the copy in."""
        if numel * dtype.itemsize > SLOT_BYTES:
            raise ValueError(f"a slot holds {SLOT_BYTES} bytes, not {numel} elements of {dtype}")
        return self.slot(self.rank, (self._epoch + 1) % 2, dtype, numel)

    def exchange(self, kind: str, flat: torch.Tensor, op: str, root: int, post: bool,
                 use: Callable[[int, int, list[torch.Tensor]], None], posted: bool = False) -> None:
        """For each piece [lo, hi) of ``flat`` (1-D, contiguous): copy it into this rank's slot (when ``post``),
        wait for every rank, then ``use(lo, hi, every rank's slot)``. The descriptor is checked once."""
        total = flat.numel()
        per = SLOT_BYTES // flat.element_size()
        code = (KINDS.index(kind), DTYPES.index(flat.dtype), total, OPS.index(op), root)
        if total <= per:  # the small message: no slicing
            self._piece(code, flat, post and not posted, use, 0, total)
            return
        for lo in range(0, total, per):
            hi = min(total, lo + per)
            self._piece(code, flat[lo:hi], post, use, lo, hi)

    def _piece(self, code: tuple, piece: torch.Tensor, post: bool, use: Callable, lo: int, hi: int) -> None:
        epoch = self._epoch + 1
        parity = epoch % 2
        parts = self._parts(parity, piece.dtype, hi - lo)
        if post and hi > lo:
            parts[self.rank].copy_(piece)
        base = _DESCRIPTOR + 5 * parity
        self._mine[base:base + 5] = code
        self._mine[_COUNTER] = epoch  # after the data and the descriptor: a peer that sees it sees them
        if min(self._counters.tolist()) < epoch:
            self.wait(epoch)
        self._epoch = epoch
        if lo == 0:
            self._check(base)
        if hi > lo:
            use(lo, hi, parts)

    def _parts(self, parity: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Every rank's slot ``parity`` as ``numel`` elements of ``dtype`` (kept, like ``slot``'s views)."""
        key = (parity, dtype, numel)
        parts = self._views.get(key)
        if parts is None:
            parts = self._views[key] = [self.slot(r, parity, dtype, numel) for r in range(self.size)]
        return parts

    def wait(self, epoch: int) -> None:
        """Returns once every rank posted ``epoch``; raises PeerFailedError naming the late ranks when the
        timeout passes or when their process is gone."""
        counters, polls, deadline, look = self._counters, 0, 0.0, 0.0
        while min(counters.tolist()) < epoch:
            polls += 1
            if polls <= self._spins:
                continue
            if polls <= self._spins + 1000:
                os.sched_yield()  # a peer may need this core
                continue
            time.sleep(5e-5)
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now > look:
                look = now + 0.1
                self._fail_if_dead(epoch)
            if now > deadline:
                late = [r for r in range(self.size) if counters[r] < epoch]
                raise PeerFailedError(f"rank {self.rank}/{self.size}: a peer failed, diverged or stopped answering: "
                                      f"rank(s) {late} did not reach the shared-memory collective within the "
                                      f"{self.timeout_s:g} s process-group timeout")

    def _fail_if_dead(self, epoch: int) -> None:
        if self._peers_visible is None:  # same PID namespace: a dead peer can be told from a slow one
            self._peers_visible = all(start_time(int(h[_PID])) == int(h[_STARTED]) for h in self._headers
                                      if h[_PID] > 0)
        if not self._peers_visible:
            return
        dead = [r for r in range(self.size) if self._counters[r] < epoch and self._headers[r, _PID] > 0
                and start_time(int(self._headers[r, _PID])) != int(self._headers[r, _STARTED])]
        if dead:
            raise PeerFailedError(f"rank {self.rank}/{self.size}: a peer failed: rank(s) {dead} did not reach the "
                                  "shared-memory collective: their process is gone (killed or crashed)")

    def _check(self, base: int) -> None:
        """ValueError on every rank when the ranks' descriptors of this call differ, naming each rank's."""
        table = self._headers[:, base:base + 5].tolist()
        if all(row == table[self.rank] for row in table):
            return
        rows = "; ".join(f"rank {r}: {KINDS[k]} of {n} {DTYPES[d]} (op {OPS[o]}, root {root})"
                         for r, (k, d, n, o, root) in enumerate(table))
        raise ValueError(f"rank {self.rank}/{self.size}: the ranks called different collectives or passed tensors "
                         f"that differ in size or dtype: {rows}")

    # ---- the collectives, on contiguous 1-D tensors of a dtype in DTYPES

    def all_reduce(self, flat: torch.Tensor, op: str = "sum", posted: bool = False) -> None:
        def take(lo, hi, parts):
            reduce_into(flat if hi - lo == flat.numel() else flat[lo:hi], parts, op)
        self.exchange("all_reduce", flat, op, 0, True, take, posted)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        def take(lo, hi, parts):
            if self.rank != root:
                flat[lo:hi].copy_(parts[root])
        self.exchange("broadcast", flat, "none", root, self.rank == root, take)

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """``out`` (size * n) <- every rank's ``flat`` (n), in rank order."""
        rows = out.view(self.size, -1)

        def take(lo, hi, parts):
            for r, part in enumerate(parts):
                rows[r, lo:hi].copy_(part)
        self.exchange("all_gather", flat, "none", 0, True, take)

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: str = "sum") -> None:
        """``out`` (m) <- this rank's m-slice of ``op`` over every rank's ``flat`` (size * m)."""
        m = out.numel()
        start, end = self.rank * m, (self.rank + 1) * m

        def take(lo, hi, parts):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                reduce_into(out[a - start:b - start], [p[a - lo:b - lo] for p in parts], op)
        self.exchange("reduce_scatter", flat, op, 0, True, take)

    def barrier(self) -> None:
        self.exchange("barrier", _NOTHING, "none", 0, False, _ignore)

    def close(self) -> None:
        """Drop the mapping (later calls fail): the views go first, then the file's pages."""
        self._views.clear()
        self._headers = self._counters = self._mine = None
        self._bytes = None
        try:
            self._mapping.close()
        except BufferError:  # a caller still holds a tensor over a slot: the mapping goes with it
            pass


_NOTHING = torch.empty(0)


def _ignore(lo: int, hi: int, parts: list[torch.Tensor]) -> None:
    pass


def _make_file(directory: str, nbytes: int) -> str:
    """A new file of ``nbytes`` in ``directory`` with its pages allocated; "" when there is no room."""
    name = os.path.join(directory, f"dp-kit-slots-{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # a full /dev/shm says ENOSPC here, not SIGBUS at a first write
    except OSError:
        os.close(fd)
        os.unlink(name)
        return ""
    os.close(fd)
    return name
