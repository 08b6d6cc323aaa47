"""Slots: the ranks of one host exchange messages through two slots per rank in one shared file.

    slots = Slots.open(store, rank, size, timeout_s)   # a collective over a c10d store; None without the file
    slots.all_reduce(t, "sum")                         # in place; also every other kind of KINDS
    slots.break_group("gloo failed")                   # a failure elsewhere: every peer's next wait raises

Set-up (``shared_file``): rank 0 makes an anonymous file in /dev/shm and publishes through the store
only its pid, start time, PID namespace and descriptor; every rank maps it after checking it is that
file. Nothing ever has a name, so no kill leaves a file behind. Without room in /dev/shm, or when a
rank refuses the file (warned, saying why), ``open`` returns None on every rank.

The scheme is DeepSpeed's "symmetric naive" all-reduce. Every rank owns a header (a counter, per slot the
descriptor of the message in it, who it is) and two data slots. A call of E pieces is E epochs: a rank copies its
piece into slot ``epoch % 2``, writes the descriptor, then its counter; it waits until every peer's counter reaches
the epoch, checks the descriptors, and reduces every rank's slot (its own part read in its tensor: one array fewer
through the cache) straight into its output, in rank order, so every rank gets the same bits. A rank writes slot s
again two epochs later, when every peer has posted the epoch between and so has finished reading it. x86 keeps a
core's stores in order, so a peer that sees the counter sees the data. A piece is a slice of the message, or, for
a reduce-scatter or all-to-all past one piece, a column of every rank's block (``exchange_columns``).

The wait (``shared_file.wait_for``) raises ``PeerFailedError`` naming the ranks that hold it up: at once
when one broke, within a tenth of a second when one's process is gone, at the timeout otherwise. Broken
means broken: once a call raised on a rank, for whatever reason, its header says so (``broken`` word,
with a code) and its every later call raises at once, naming the first failure, so no call can ever
pair with another rank's call of another step (``mismatch_breaks=False``, the transport's: ranks that
called different collectives all raise and go on). The C++ face runs this protocol too (``native_layout``).
"""

from __future__ import annotations

import datetime
import errno
import functools
import mmap
import os
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dpkit import native
from dpkit.comm import shared_file
from dpkit.comm.process_groups import PeerFailedError
from dpkit.comm.shared_file import SHM_DIRECTORY

SLOT_BYTES = 1 << 21  # one slot (the backend's); a message longer than its slot goes piece by piece
HEADER_WORDS = shared_file.RECORD_WORDS  # int64 words per rank: counter, descriptors, identity, broken word
_DESCRIPTOR = 1  # the descriptor of slot p: words [1 + 5p, 6 + 5p): kind, dtype, numel, op, root
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool)
KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "reduce", "all_to_all")
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "none", "avg_divided_first")
# avg: sum, then divide (the backend's ReduceOp.AVG); avg_divided_first: each contribution divided, then summed (the
# transports' "avg": no sum of large values overflows). Two roundings of one average, so each has its index.
# All-reduces, and broadcasts and reduces of at most a slot, go in pieces of this many bytes (piece_numel): in a
# broadcast or reduce one rank copies a piece while another copies or sums the one before it; in an all-reduce a
# piece's copy in and its sum meet the core's cache, not memory.
PIPELINED = ("broadcast", "reduce")
PIPELINED_PIECE_BYTES = 1 << 19
# A call copies into its output past the caches (``stream_copy``, where C++ is built) once the outputs of its ranks
# together fill half the host's last-level cache (``streamed_bytes``), and from STREAMED_BYTES (32 slots) on whatever
# the cache: an ordinary store reads each line before it writes it, and an output the cache cannot keep until the
# next call is back in memory by the time its caller reads it. A smaller one may still be in the cache when the
# caller reads or writes it next, which stores past the caches would lose. The cap: a virtual machine may report the
# whole cache of a host whose other machines use it too. Only copies of whole pieces: sums keep ordinary stores,
# their output is also an input.
STREAMED_BYTES = 32 * SLOT_BYTES
CACHE_DIRECTORY = "/sys/devices/system/cpu/cpu0/cache"  # Linux's description of the first CPU's caches
SPINS = 50  # polls before yielding the core, when the host has a core per rank
NATIVE_SUMS = (torch.float32, torch.float64, torch.int32, torch.int64)  # what c10d_backend.cpp's sums take
FILE_KEY = "slots/file"  # where rank 0 publishes the file's words in the store (or _NO_ROOM, or _FAILED and why)
_MAPPED, _NO_ROOM, _FAILED = "slots/mapped/", "no room", "failed: "


def reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: str, in_out: int | None = None) -> None:
    """``out`` <- ``op`` over ``parts`` (every rank's piece), left to right in rank order. ``in_out``: the rank
    whose part ``out`` holds already (an all-reduce's or a reduce root's own tensor, posted from it): rank 0 or 1
    of a sum reads it there, not from its slot, as c10d_backend.cpp's reduce_slots does: the same values, so the
    same bits, and one array fewer through the cache. (Rank 2's part and later ones are added after ``out`` is
    overwritten: from their slots.)"""
    if in_out is not None and own_part_unread(in_out, len(parts), op):
        parts = [out if r == in_out else part for r, part in enumerate(parts)]
    if op == "avg_divided_first":
        scale = 1.0 / len(parts)
        torch.mul(parts[0], scale, out=out)
        for part in parts[1:]:
            out.add_(part, alpha=scale)
        return
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


def own_part_unread(rank: int, size: int, op: str) -> bool:
    """Whether a sum (or mean) over ``size`` ranks into ``rank``'s own tensor reads that rank's part there, not
    from its slot (``reduce_into``'s ``in_out``; c10d_backend.cpp's reduce_slots does the same): rank 0 or 1 of
    two or more."""
    return op in ("sum", "avg") and rank in (0, 1) and size > 1


def piece_numel(kind: str, numel: int, itemsize: int, slot_bytes: int) -> int:
    """The elements of each piece of a call ``kind`` of ``numel`` elements of ``itemsize`` bytes (the last may be
    shorter): PIPELINED_PIECE_BYTES for an all-reduce and for a broadcast or reduce that fits one slot, else a
    slot's worth (at most a slot's either way). The C++ face splits as this does (``Slots::piece_numel`` there), so
    that a call one rank runs there and another here pairs."""
    per = slot_bytes // itemsize
    if kind == "all_reduce" or (kind in PIPELINED and numel * itemsize <= slot_bytes):
        return max(1, min(per, PIPELINED_PIECE_BYTES // itemsize))
    return per


def stream_copy() -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """``stream_copy(dst, src)`` of dpkit/native/c10d_backend.cpp: a copy whose stores go past the caches (x86's
    non-temporal stores), for long outputs (``streamed_bytes``); None without C++, as ``native_sums``."""
    module = native.load_extension("c10d_backend")
    return None if module is None else module.stream_copy


def last_level_cache_bytes(directory: str = CACHE_DIRECTORY) -> int | None:
    """The bytes of the first CPU's last-level data cache, as Linux describes it (``index*/level``, ``type``,
    ``size`` such as "32768K"); None where it does not."""
    found = {}
    for index in Path(directory).glob("index*"):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
            if kind != "Instruction":
                found[int(level)] = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1:], 0)
        except (OSError, ValueError):
            continue
    return found[max(found)] if found else None


def streamed_bytes(size: int, cache_bytes: int | None) -> int:
    """The output bytes from which a call of ``size`` ranks copies into its output past the caches: the ranks'
    outputs together fill half of ``cache_bytes``, the last-level cache; STREAMED_BYTES at most, and where the
    cache is unknown (None)."""
    return STREAMED_BYTES if cache_bytes is None else min(STREAMED_BYTES, cache_bytes // (2 * size))


def native_sums() -> Callable | None:
    """The all-reduce of these slots in C++ (``slots_all_reduce`` of dpkit/native/c10d_backend.cpp, built at first
    use: call this before a rank's first wait for a peer, so that none times out while it compiles); None where
    ``dpkit.native`` gives no C++ (no compiler, ``DPKIT_NATIVE=0``), and the Python path sums."""
    module = native.load_extension("c10d_backend")
    return None if module is None else module.slots_all_reduce


def _described(kind: int, dtype: int, numel: int, op: int, root: int) -> str:
    """A descriptor in words: "all_reduce of 16 bytes of torch.float32 (op 'sum')"."""
    rooted = f", root {root}" if KINDS[kind] in ("broadcast", "reduce") else ""
    return f"{KINDS[kind]} of {numel * DTYPES[dtype].itemsize} bytes of {DTYPES[dtype]} (op {OPS[op]!r}{rooted})"


class Slots:
    """The slots of ``size`` ranks of one host (see the module docstring). Make it with ``Slots.open``."""

    def __init__(self, mapping: mmap.mmap, rank: int, size: int, timeout_s: float, slot_bytes: int = SLOT_BYTES,
                 mismatch_breaks: bool = True, sums: Callable | None = None):
        self.rank, self.size, self.timeout_s, self.slot_bytes = rank, size, timeout_s, slot_bytes
        self._sums = sums  # native_sums(): the short all-reduces in C++, or None
        self._stream = stream_copy() if sums is not None else None  # the same C++'s copy past the caches
        self._streamed_bytes = streamed_bytes(size, last_level_cache_bytes())  # outputs it copies into past them
        self._mismatch_breaks = mismatch_breaks  # else ranks that called different collectives all raise, and the
        # slots go on (every rank posted the call and read the same table: the next call pairs as it should)
        self._mapping = mapping
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        words = np.frombuffer(mapping, np.int64, count=HEADER_WORDS * size)
        self._headers = words.reshape(size, HEADER_WORDS)  # live: peers write theirs
        self._counters = self._headers[:, shared_file.COUNTER]
        self._mine = self._headers[rank]
        shared_file.sign(self._mine)
        self._epoch = 0  # the last call this rank completed; the C++ fast path completes some: read from the counter
        self._views: dict[tuple, torch.Tensor] = {}
        self._spins = SPINS if size <= len(os.sched_getaffinity(0)) else 0  # oversubscribed: yield at once
        self._layout = self.native_layout()
        self._broken: str | None = None  # the first failure: every later call refuses, naming it

    @staticmethod
    def open(store, rank: int, size: int, timeout_s: float, directory: str = SHM_DIRECTORY,
             sums: Callable | None = None) -> "Slots | None":
        """Rank 0 makes the shared file and publishes its words through ``store``; every rank checks and maps it.
        None on every rank when /dev/shm has no room for it or a rank refused it (warned on rank 0, saying why).
        A collective over the ranks of ``store``. (The ``SharedMemory`` transport maps its slots with its own
        files, and makes ``Slots`` over that mapping.)"""
        timeout = datetime.timedelta(seconds=timeout_s)
        own, published = _make(file_bytes(size), directory) if rank == 0 else (None, "")
        try:
            if rank == 0:
                store.set(FILE_KEY, published)  # rank 0 keeps its own words: it never reads them back
            else:
                store.wait([FILE_KEY], timeout)
                published = store.get(FILE_KEY).decode()
            if published == _NO_ROOM:
                return None
            slots, why = _map(published, own, rank, size, timeout_s, sums)
            store.set(f"{_MAPPED}{rank}", why)  # "": mapped
            store.wait([f"{_MAPPED}{r}" for r in range(size)], timeout)
            refusals = [(r, store.get(f"{_MAPPED}{r}").decode()) for r in range(size)]
        finally:
            if own is not None:
                os.close(own)  # every peer holds the file now, or gave up: the mappings keep it
        if any(why for _, why in refusals):
            _refused(slots, rank, [(r, why) for r, why in refusals if why])
            return None
        return slots

    # ---- one exchange: post a piece, wait for every rank's, use them

    def slot(self, rank: int, parity: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Rank ``rank``'s slot ``parity`` as ``numel`` elements of ``dtype`` (views kept: making one costs
        microseconds, and a training loop exchanges the same shapes every step)."""
        key = (rank, parity, dtype, numel)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 1024:
                self._views.clear()
            start = 8 * HEADER_WORDS * self.size + (2 * rank + parity) * self.slot_bytes
            view = self._views[key] = self._bytes[start:start + numel * dtype.itemsize].view(dtype)
        return view

    def _counted(self) -> int:
        """The last call this rank posted (its counter; the C++ fast path posts and completes calls too): between
        two calls, also the last it completed."""
        self._epoch = int(self._mine[shared_file.COUNTER])
        return self._epoch

    def native_layout(self) -> tuple:
        """What the C++ fast path (dpkit/native/c10d_backend.cpp) needs to run the same protocol on these slots:
        (the mapping's address, rank, ranks, words per record, the broken word, bytes per slot, whether to poll
        before yielding the core)."""
        return (self._bytes.data_ptr(), self.rank, self.size, HEADER_WORDS, shared_file.BROKEN, self.slot_bytes,
                self._spins > 0)

    def exchange(self, kind: str, flat: torch.Tensor, op: str, root: int, post: bool,
                 use: Callable[[int, int, list[torch.Tensor]], None], announced: int | None = None,
                 unposted: tuple[int, int] = (0, 0), until: int | None = None) -> None:
        """For each piece [lo, hi) of ``flat`` (1-D, contiguous; ``piece_numel``): copy it into this rank's slot
        (when ``post``), wait for every rank, then ``use(lo, hi, every rank's slot)``. The descriptor is checked
        once. Whatever raises here breaks the slots (a peer may have posted its piece, or be waiting for this
        rank's). ``announced``: the C++ fast path posted the piece that starts at this element (data, descriptor,
        counter), every piece before it done, then handed the call over; ``unposted``: the elements [start, end) of
        ``flat`` that no peer reads (an all-to-all's own block), never copied into the slot; ``until``: the pieces
        from this element on are left to the caller (C++: ``all_reduce``). ``flat`` is never a view of this rank's
        slots: a result written there would overwrite what the peers are reading."""
        self._guarded(self._exchange, kind, flat, op, root, post, use, announced, unposted, until)

    def exchange_columns(self, kind: str, flat: torch.Tensor, op: str,
                         use: Callable[[int, int, list[torch.Tensor]], None]) -> None:
        """``exchange`` with a piece that holds a column of every block, for a call past one piece whose ``flat``
        is ``size`` blocks of m (block j for rank j): for each column [c0, c1) (as wide as a slot holds ``size``
        of), copy column [c0, c1) of every other rank's block into this rank's slot (block j at j * (c1 - c0); its
        own stays out: no peer reads it), wait for every rank, then ``use(c0, c1, every rank's slot)``. Every rank
        then works on every piece, where in pieces of ``flat`` the rank whose block a piece holds reads or sums it
        while its peers only post. (The C++ face takes none of these: it runs calls of one piece.)"""
        self._guarded(self._columns, kind, flat, op, use)

    def _guarded(self, run: Callable, *args) -> None:
        """``run(*args)``, an exchange, on slots that are not broken; whatever it raises breaks them (a peer may
        have posted its piece, or be waiting for this rank's)."""
        self._refuse_if_broken()
        try:
            run(*args)
        except BaseException as error:
            mismatch = getattr(error, "mismatch", False)
            if not mismatch or self._mismatch_breaks:  # a mismatch: every rank sees the same table, so all break
                self._break("mismatch" if mismatch else "other", f"{type(error).__name__}: {error}")
            raise

    def _per_piece(self, kind: str, flat: torch.Tensor) -> int:
        """The elements of each piece of a call ``kind`` of ``flat`` on these slots (``piece_numel``)."""
        return piece_numel(kind, flat.numel(), flat.element_size(), self.slot_bytes)

    def _exchange(self, kind, flat, op, root, post, use, announced, unposted, until) -> None:
        total = flat.numel()
        per = self._per_piece(kind, flat)
        code = (KINDS.index(kind), DTYPES.index(flat.dtype), total, OPS.index(op), root)
        if total <= per:  # the small message: no slicing
            fill = functools.partial(_copy_around, piece=flat, a=unposted[0], b=unposted[1]) if post else None
            self._piece(code, flat.dtype, total, fill, use, 0, total, announced == 0)
            return
        for lo in range(announced or 0, total if until is None else min(until, total), per):
            hi = min(total, lo + per)
            fill = functools.partial(_copy_around, piece=flat[lo:hi], a=max(unposted[0], lo) - lo,
                                     b=min(unposted[1], hi) - lo) if post else None
            self._piece(code, flat.dtype, hi - lo, fill, use, lo, hi, announced == lo)

    def _columns(self, kind, flat, op, use) -> None:
        n, total = self.size, flat.numel()
        m = total // n
        width = max(1, self._per_piece(kind, flat) // n)
        blocks = flat.view(n, m)
        code = (KINDS.index(kind), DTYPES.index(flat.dtype), total, OPS.index(op), 0)
        for c0 in range(0, m, width):
            c1 = min(m, c0 + width)
            self._piece(code, flat.dtype, n * (c1 - c0), functools.partial(self._post_columns, blocks, c0, c1), use,
                        c0, c1)

    def _post_columns(self, blocks: torch.Tensor, c0: int, c1: int, slot: torch.Tensor) -> None:
        """``slot`` <- column [c0, c1) of every other rank's block of ``blocks`` (size, m), block j at j * width."""
        width = c1 - c0
        for j in range(self.size):
            if j != self.rank:
                slot[j * width:(j + 1) * width].copy_(blocks[j, c0:c1])

    def _piece(self, code: tuple, dtype: torch.dtype, numel: int, fill: Callable[[torch.Tensor], None] | None,
               use: Callable, lo: int, hi: int, announced: bool = False) -> None:
        """One epoch: ``fill(this rank's slot)`` (None: nothing to post), the descriptor, the counter; wait for every
        rank; ``use(lo, hi, every rank's slot as numel elements of dtype)``."""
        epoch = self._counted() + (0 if announced else 1)
        parity = epoch % 2
        parts = self._parts(parity, dtype, numel)
        base = _DESCRIPTOR + 5 * parity
        if not announced:
            if fill is not None and hi > lo:
                fill(parts[self.rank])
            self._mine[base:base + 5] = code
            self._mine[shared_file.COUNTER] = epoch  # after the data and the descriptor: a peer that sees it sees them
        if min(self._counters.tolist()) < epoch:  # a peer is late, or broke (its counter went negative)
            shared_file.wait_for(self._headers, epoch, self.rank, self.timeout_s, self._spins)
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

    def _check(self, base: int) -> None:
        """ValueError on every rank when the ranks' descriptors of this call differ, naming each rank's (its
        ``mismatch`` attribute True)."""
        table = self._headers[:, base:base + 5].tolist()
        if all(row == table[self.rank] for row in table):
            return
        rows = "; ".join(f"rank {r}: {_described(*row)}" for r, row in enumerate(table))
        error = ValueError(f"rank {self.rank}/{self.size}: the ranks called different shared-memory collectives (a "
                           f"peer diverged): {rows}")
        error.mismatch = True
        raise error

    # ---- broken means broken

    def break_group(self, why: str) -> None:
        """A call of this group failed outside the slots (in gloo, say): every later call here refuses, naming
        ``why``, and every peer's next wait raises at once, naming this rank."""
        self._break("other", why)

    @property
    def broken(self) -> str | None:
        """The first failure of these slots on this rank (None while they work)."""
        return self._broken

    def peer_broken(self) -> str | None:
        """Which peers' headers say they broke, and why (None while none did): a call that would not reach the
        slots (one that goes to gloo) asks first, so that it too refuses at once."""
        if self._headers is None:
            return None
        words = self._headers[:, shared_file.BROKEN]
        if not words.any():
            return None
        codes = {r: shared_file.BREAKS[min(int(w), len(shared_file.BREAKS) - 1)] for r, w in enumerate(words) if w}
        return "; ".join(f"rank {r} broke the group ({code})" for r, code in codes.items())

    def _break(self, code: str, why: str) -> None:
        if self._broken is None:
            self._broken = why
        if self._mine is not None:  # not closed
            # Past the last call this rank posted (its data is in the slots: a peer still waiting for it completes
            # it); the counter, not ``_epoch``, which lags the calls C++ completed.
            shared_file.mark_broken(self._mine, code, int(self._mine[shared_file.COUNTER]))

    def _refuse_if_broken(self) -> None:
        if self._broken is not None:
            raise PeerFailedError(f"rank {self.rank}/{self.size}: refused: these shared-memory slots broke in an "
                                  f"earlier call ({self._broken}), so the ranks no longer agree on which call is "
                                  "which; make a new group")

    # ---- the collectives, on contiguous 1-D tensors of a dtype in DTYPES

    def all_reduce(self, flat: torch.Tensor, op: str = "sum", announced: int | None = None) -> None:
        """``flat`` <- ``op`` over every rank's ``flat``, piece by piece. Where C++ sums (``native_sums``), it runs
        every piece it can; a piece it posted but left (a peer late, descriptors that differ), or ``announced``
        (the C++ face's hand-over), is finished here as any hand-over is (waited for, checked, summed), and C++
        goes on from the next piece."""
        if not self._sums_natively(flat, op):
            self.exchange("all_reduce", flat, op, 0, True, _summing_into(flat, op, self.rank), announced)
            return
        self._refuse_if_broken()
        left = announced if announced is not None else self._sums(self._layout, flat, op == "avg", 0)
        if left < 0:  # C++ ran every piece: the usual call, which makes nothing more
            return
        take, per = _summing_into(flat, op, self.rank), self._per_piece("all_reduce", flat)
        while left >= 0:  # the piece at ``left`` is posted; its peers were not all there in time
            self.exchange("all_reduce", flat, op, 0, True, take, announced=left, until=left + per)
            left = self._sums(self._layout, flat, op == "avg", left + per) if left + per < flat.numel() else -1

    def _sums_natively(self, flat: torch.Tensor, op: str) -> bool:
        """Whether C++ (``native_sums``) sums this all-reduce."""
        return (self._sums is not None and op in ("sum", "avg") and flat.dtype in NATIVE_SUMS
                and (op == "sum" or flat.is_floating_point()) and flat.numel() > 0)

    def _copier(self, output: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], object]:
        """How a call copies whole pieces into ``output`` (contiguous): ``copy(dst, src)``, past the caches when
        ``output`` holds at least ``streamed_bytes`` and C++ is built (``stream_copy``), else ``Tensor.copy_``."""
        if self._stream is None or output.numel() * output.element_size() < self._streamed_bytes:
            return torch.Tensor.copy_
        stream = self._stream

        def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
            if dst.data_ptr() != src.data_ptr():  # an in-place all-gather's own block is where it goes already
                stream(dst, src)
        return copy

    def broadcast(self, flat: torch.Tensor, root: int, announced: int | None = None) -> None:
        copy = self._copier(flat)

        def take(lo, hi, parts):
            if self.rank != root:
                copy(flat[lo:hi], parts[root])
        self.exchange("broadcast", flat, "none", root, self.rank == root, take, announced=announced)

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor, announced: int | None = None) -> None:
        """``out`` (size * n) <- every rank's ``flat`` (n), in rank order."""
        rows, copy = out.view(self.size, -1), self._copier(out)

        def take(lo, hi, parts):  # this rank's own block from ``flat`` (in place: the same memory), as in C++
            for r, part in enumerate(parts):
                copy(rows[r, lo:hi], flat[lo:hi] if r == self.rank else part)
        self.exchange("all_gather", flat, "none", 0, True, take, announced=announced)

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: str = "sum",
                       announced: int | None = None) -> None:
        """``out`` (m) <- this rank's m-slice of ``op`` over every rank's ``flat`` (size * m)."""
        m = out.numel()
        start, end = self.rank * m, (self.rank + 1) * m
        if flat.numel() > self._per_piece("reduce_scatter", flat):
            mine = flat[start:end]

            def columns(c0, c1, parts):  # this rank's column from its own block, the others' from their slots
                w = self.rank * (c1 - c0)
                reduce_into(out[c0:c1], [mine[c0:c1] if r == self.rank else p[w:w + c1 - c0]
                                         for r, p in enumerate(parts)], op)
            self.exchange_columns("reduce_scatter", flat, op, columns)
            return

        def take(lo, hi, parts):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                reduce_into(out[a - start:b - start], [p[a - lo:b - lo] for p in parts], op)
        self.exchange("reduce_scatter", flat, op, 0, True, take, announced=announced)

    def reduce(self, flat: torch.Tensor, op: str, root: int, announced: int | None = None) -> None:
        """``flat`` <- ``op`` over every rank's ``flat``, on ``root`` only (the others' stay as they are). A root
        that sums its own part where it is (``own_part_unread``) posts nothing: no rank reads its slot."""
        def take(lo, hi, parts):
            if self.rank == root:
                reduce_into(flat if hi - lo == flat.numel() else flat[lo:hi], parts, op, root)
        posts = not (self.rank == root and own_part_unread(root, self.size, op))
        self.exchange("reduce", flat, op, root, posts, take, announced=announced)

    def all_to_all(self, out: torch.Tensor, flat: torch.Tensor, announced: int | None = None) -> None:
        """``out`` (size * m): block j <- this rank's block of rank j's ``flat`` (size * m), as
        ``all_to_all_single`` with even splits."""
        m = out.numel() // self.size
        start, end = self.rank * m, (self.rank + 1) * m
        rows, copy = out.view(self.size, m), self._copier(out)
        if flat.numel() > self._per_piece("all_to_all", flat):
            copy(rows[self.rank], flat[start:end])  # once, before any wait: no peer needs it

            def columns(c0, c1, parts):  # column [c0, c1) of this rank's block of every peer's input
                w = self.rank * (c1 - c0)
                for j, part in enumerate(parts):
                    if j != self.rank:
                        copy(rows[j, c0:c1], part[w:w + c1 - c0])
            self.exchange_columns("all_to_all", flat, "none", columns)
            return

        def take(lo, hi, parts):  # this rank's own block from ``flat``: only the others' are posted, on both paths
            a, b = max(lo, start), min(hi, end)
            if a < b:
                for j, part in enumerate(parts):
                    copy(rows[j, a - start:b - start], flat[a:b] if j == self.rank else part[a - lo:b - lo])
        self.exchange("all_to_all", flat, "none", 0, True, take, announced=announced, unposted=(start, end))

    def barrier(self, announced: int | None = None) -> None:
        self.exchange("barrier", _NOTHING, "none", 0, False, _ignore, announced=announced)

    def held_bytes(self) -> int:
        """This rank's share of the file's pages (all allocated at set-up): its header and its two slots."""
        return file_bytes(self.size, self.slot_bytes) // self.size

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


def _copy_around(slot: torch.Tensor, piece: torch.Tensor, a: int, b: int) -> None:
    """``slot`` <- ``piece``, but for the elements [a, b) (none when a >= b)."""
    if a >= b:
        slot.copy_(piece)
        return
    slot[:a].copy_(piece[:a])
    slot[b:].copy_(piece[b:])


def _summing_into(flat: torch.Tensor, op: str, rank: int) -> Callable[[int, int, list[torch.Tensor]], None]:
    """What an all-reduce's exchange does with every rank's piece [lo, hi): ``op`` over them, into ``flat``."""
    def take(lo: int, hi: int, parts: list[torch.Tensor]) -> None:
        reduce_into(flat if hi - lo == flat.numel() else flat[lo:hi], parts, op, rank)
    return take


def _ignore(lo: int, hi: int, parts: list[torch.Tensor]) -> None:
    pass


def file_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    """The bytes of the slots file of ``size`` ranks: every rank's header, then every rank's two slots."""
    return 8 * HEADER_WORDS * size + 2 * slot_bytes * size


def _make(nbytes: int, directory: str) -> tuple[int | None, str]:
    """Rank 0's file (pages allocated) and what it publishes: its words, or why there is none."""
    try:
        fd = shared_file.make(nbytes, allocate=True, directory=directory)
    except OSError as error:
        return None, _NO_ROOM if error.errno == errno.ENOSPC else f"{_FAILED}rank 0 cannot make it ({error})"
    return fd, shared_file.to_text(shared_file.describe(fd))


def _map(published: str, own: int | None, rank: int, size: int, timeout_s: float,
         sums: Callable | None) -> tuple[Slots | None, str]:
    """(the slots over the file, "") or (None, why this rank cannot use it). ``own``: rank 0's descriptor of it."""
    if published.startswith(_FAILED):
        return None, published
    nbytes = file_bytes(size)
    try:
        fd = own if own is not None else shared_file.attach(shared_file.from_text(published), nbytes)
    except shared_file.Refused as error:
        return None, str(error)
    try:
        return Slots(mmap.mmap(fd, nbytes), rank, size, timeout_s, sums=sums), ""
    finally:
        if fd != own:
            os.close(fd)


def _refused(slots: Slots | None, rank: int, refusals: list[tuple[int, str]]) -> None:
    """Let go of the file that some rank could not use; rank 0 says which and why."""
    if slots is not None:
        slots.close()
    if rank == 0:
        warnings.warn(f"shared-memory slots: not used: {'; '.join(f'rank {r}: {why}' for r, why in refusals)}",
                      RuntimeWarning, stacklevel=3)
