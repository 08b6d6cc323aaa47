"""``SharedMemory``: collectives through this host's shared memory, for ranks that all run on one host (CPU).

    t = SharedMemory(group)                          # a collective: every rank makes it
    flat = t.allocate((n,), dtype=torch.float32)     # in this rank's arena, which every peer maps
    t.all_reduce(flat, op="avg")                    # each rank sums its chunk where the buffers lie

Every rank owns an arena that every other rank maps; a tensor ``allocate`` returned lives there, so
a sum reads each rank's buffer where it lies, with no copy in or out. Any other tensor is staged
through the arena; ranks meet through a control file (counters and descriptors of the call in progress). An
all-reduce of at most ``SLOTS_BYTES`` goes through ``Slots`` instead, the backend "dpkit"'s protocol: one wait
instead of two. The files are ``shared_file``'s: anonymous, made in /dev/shm, reached through the maker's
/proc/<pid>/fd and checked before they are mapped (``NotOneHost`` on every rank, saying why, when a
rank cannot); no kill leaves one behind. A peer that dies, breaks or stops answering fails the call on
every rank, naming it, and the transport refuses every later call. Without room in /dev/shm every
collective goes through ``torch_transport``'s.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import platform
import threading
import warnings
import weakref
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from dpkit.comm import shared_file, torch_transport
from dpkit.comm.checks import bounds
from dpkit.comm.comm_thread import group_timeout
from dpkit.comm.hosts import HOSTS_ENV, host_indices
from dpkit.comm.interface import (Transport, claim_memory, flat_view, forget_memory, owner_of, profiler_range,
                                  profiling)
from dpkit.comm.process_groups import DEFAULT_TIMEOUT_S, PeerFailedError
from dpkit.comm.shared_file import COUNTER, SHM_DIRECTORY
from dpkit.comm.slots import NATIVE_SUMS, Slots, file_bytes, native_sums
from dpkit.comm.torch_transport import Torch

OPS = ("sum", "avg")
_SUMMED_IN_CPP = frozenset(NATIVE_SUMS)  # the dtypes of ``_short_sum``: a set, as it is asked at every call
# Under the profiler every shared-memory collective is a range of this name (gloo's collectives have theirs).
SHARED_MEMORY_RANGE = "shared_memory:{}"
_RANGES = {kind: SHARED_MEMORY_RANGE.format(kind) for kind in ("all_reduce", "reduce_scatter", "all_gather")}

# Every rank owns an arena: a sparse anonymous file of /dev/shm as large as /dev/shm itself, mapped by every
# rank of the group (virtual memory only: a page exists once it is allocated). ``allocate`` hands out pieces
# of the caller's arena, allocating their pages first (posix_fallocate: a full /dev/shm says ENOSPC there,
# not SIGBUS at the first write). A control file (group rank 0's) holds one 128-byte record per rank: a
# counter of the synchronisations it reached, the descriptor of its part of the call in progress (which
# collective, dtype, bytes, where its data lies in its arena), and ``shared_file``'s identity and broken words.

# x86 keeps a core's stores in order, so a peer that sees a rank's counter also sees the data written
# before it: ranks wait for each other by polling counters. Elsewhere they synchronise with a message.
POLLS = platform.machine().lower() in ("x86_64", "amd64")
ALIGN = 64  # bytes: every allocation starts on a cache line
# An all-reduce of at most this goes through ``Slots`` (the backend "dpkit"'s protocol: one wait, each rank sums
# the whole message) rather than the control file (two waits, each rank sums a chunk): short messages cost
# their synchronisations, not their sums. Its slots hold this much per rank, twice.
SLOTS_BYTES = 64 << 10
# A chunk is summed and copied to the peers block by block, so the copies read the sum from the cache.
BLOCK_BYTES = 1 << 20
_RECORD = shared_file.RECORD_WORDS  # int64 words per rank in the control file
_KIND, _DTYPE, _NBYTES, _OP, _STATUS, _OFFSET = range(1, 7)  # after the counter; [_KIND, _OP] must agree
_KINDS = ("all_reduce", "reduce_scatter", "all_gather")
_OK, _NO_ROOM = 0, 1
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64)


class _Arena:
    """This rank's arena: first-fit allocation of ``ALIGN``-aligned blocks, freed when their tensor's storage is.

    Each block is a numpy array over the mapping; the tensor made from it keeps it alive, so the
    block returns to the free list only when the last view of the tensor is gone (``weakref.finalize``).
    """

    def __init__(self, fd: int, size: int, mapping: mmap.mmap):
        self.fd, self.size, self.mapping = fd, size, mapping
        self.free = [(0, size)]    # (offset, bytes), sorted, coalesced
        self.allocated_to = 0      # bytes [0, allocated_to) have their pages (posix_fallocate)
        self.lock = threading.Lock()  # finalizers run on whichever thread frees the last view
        self.observers: list[Callable[[int, int, bool], None]] = []  # see SharedMemory.observe_blocks

    def take(self, nbytes: int) -> tuple[int, np.ndarray] | None:
        """(offset, the block as uint8 numpy array), or None when /dev/shm has no room for it."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self.lock:
            index = next((i for i, (_, length) in enumerate(self.free) if length >= size), None)
            if index is None:
                return None
            offset, length = self.free[index]
            end = offset + size
            if end > self.allocated_to:
                try:
                    os.posix_fallocate(self.fd, self.allocated_to, end - self.allocated_to)
                except OSError:
                    return None
                self.allocated_to = end
            self.free[index:index + 1] = [(end, length - size)] if length > size else []
        block = np.frombuffer(self.mapping, np.uint8, count=size, offset=offset)
        weakref.finalize(block, self.give_back, offset, size)
        for observe in self.observers:
            observe(offset, size, True)
        return offset, block

    def give_back(self, offset: int, size: int) -> None:
        for observe in self.observers:
            observe(offset, size, False)
        with self.lock:
            self.free.append((offset, size))
            self.free.sort()
            merged = [self.free[0]]
            for start, length in self.free[1:]:
                last_start, last_length = merged[-1]
                if last_start + last_length == start:
                    merged[-1] = (last_start, last_length + length)
                else:
                    merged.append((start, length))
            self.free = merged


class SharedMemory(Transport):
    """Collectives through this host's shared memory, for a group whose ranks all run on this host (CPU).

    ``SharedMemory(group)`` is a collective: it makes and maps the files and raises ``NotOneHost`` (a
    ValueError) on every rank if the ranks are on several hosts (``hosts.host_indices``: real ones or
    simulated by ``DPKIT_HOSTS``) or one rank cannot see the files (/dev/shm is not shared).
    When /dev/shm has no room, it warns once and every collective goes through ``Torch``; a single
    call that finds no room to stage a tensor does the same, on every rank.

    The sums (all-reduce, reduce-scatter) are made by one rank per chunk, every rank reading each
    other's data where it lies: for a tensor that ``allocate`` returned, its own buffer; for any other,
    a copy staged in the arena. Rank r adds chunk r over the ranks (its own contribution first, then
    the others in rank order) and, for the all-reduce, writes the sum into every rank's buffer. Two
    synchronisations per call (the data is ready; every rank is done with the others' data), each
    bounded by the group's timeout: a rank that stops answering fails the call naming it.
    """

    name = "shared_memory"
    zero_copy = True
    _skips_empty = False

    def __init__(self, group=None, *, background: bool = False, directory: str = SHM_DIRECTORY):
        super().__init__(group, background=background)
        self.timeout_s = group_timeout(group, torch.device("cpu")) or DEFAULT_TIMEOUT_S
        self._fallback: Torch | None = None
        self._warned = False
        self._syncs = 0
        self._peer_views: dict[tuple, torch.Tensor] = {}  # (rank, offset, bytes, dtype) -> view (``_peer``)
        self._chunk_views: dict[tuple, tuple] = {}  # (offsets, bytes, dtype) -> this rank's chunks (``_chunks``)
        self._staging: tuple[int, torch.Tensor] | None = None  # (offset, uint8 block) kept for later calls
        self._slots: Slots | None = None  # the short all-reduces' (SLOTS_BYTES)
        if self.world_size > 1:
            self._sums = native_sums()  # built (or found) before this rank first waits for a peer
            self._check_one_host()
            self._map(directory)

    # ---- set-up (collective)

    def _map(self, directory: str) -> None:
        n, rank = self.world_size, self.rank
        size, control_size = _arena_size(directory), 8 * _RECORD * (n + 1)
        control_sizes = (control_size, file_bytes(n, SLOTS_BYTES))  # rank 0's files
        status, why, made = _make_files(size, control_sizes if rank == 0 else (), directory)
        mappings, whys = [], []
        try:
            everyone = _gather((status, [shared_file.describe(fd) for fd in made]), self.group)
            status = max(theirs for theirs, _ in everyone)
            if status == _SETUP_OK:
                mappings, why = _attach_all([words for _, words in everyone], made, rank, size, control_sizes)
            if mappings:
                shared_file.sign(_records(mappings[0], n)[rank])  # before any peer can wait for this rank
            whys = _gather(why, self.group)  # every rank mapped every file, or failed: the makers may let go
        finally:
            used = status == _SETUP_OK and bool(whys) and not any(whys)
            for fd in made[1 if used else 0:]:  # the mappings keep the files; a used arena's fd allocates pages
                os.close(fd)
        if used:
            self._install(mappings, made[0], size)
            return
        for mapping in mappings:
            mapping.close()
        if status == _SETUP_NO_ROOM:
            self._fall_back(f"/dev/shm has no room for the control file of {n} ranks")
            return
        raise NotOneHost(f"transport 'shared_memory' needs every rank of the group on this host, able to map the "
                         f"files the others made: {'; '.join(w for w in whys if w)}; use transport 'torch' "
                         "(or 'auto') for a group that spans hosts")

    def _install(self, mappings: list[mmap.mmap], arena_fd: int, size: int) -> None:
        """Use the mapped files: [control, slots, arena of rank 0, ..., of rank n-1]; ``arena_fd``: this rank's
        arena."""
        control, slots, arenas = mappings[0], mappings[1], mappings[2:]
        self._control = _records(control, self.world_size)  # record per rank
        if POLLS:  # elsewhere a peer may see a slot's counter before its data
            self._slots = Slots(slots, self.rank, self.world_size, self.timeout_s, SLOTS_BYTES, mismatch_breaks=False,
                                sums=self._sums)
        self._arena = _Arena(arena_fd, size, arenas[self.rank])
        self._views = [torch.frombuffer(m, dtype=torch.uint8) for m in arenas]  # every rank's arena, bytes
        self._base = self._views[self.rank].data_ptr()
        self._size = size
        for view in self._views:
            claim_memory(view.data_ptr(), size, self)
        weakref.finalize(self, _forget_arenas, [view.data_ptr() for view in self._views], os.close, arena_fd)

    def _check_one_host(self) -> None:
        """NotOneHost on every rank when the group's ranks are on several (real or simulated) hosts."""
        spread = host_indices(self.group)
        if len(set(spread)) > 1:
            simulated = f" (simulated: {HOSTS_ENV}={os.environ[HOSTS_ENV]})" if HOSTS_ENV in os.environ else ""
            raise NotOneHost(f"transport 'shared_memory' needs every rank of the group on this host: ranks "
                             f"{self.ranks} are on {len(set(spread))} hosts{simulated}; use transport 'auto' "
                             "or 'hierarchical' (or 'torch') for a group that spans hosts")

    def _collective_group(self):
        """The group a fallback through torch uses: the communication thread's own when there is one, so that
        its collectives never interleave with the caller's on ``group``."""
        return self._comm.group if self._comm is not None else self.group

    def _fall_back(self, why: str) -> None:
        self._fallback = Torch(self._collective_group())
        self._warn(f"the shared-memory transport over ranks {self.ranks} goes through torch.distributed instead: {why}")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            if self.rank == 0:
                warnings.warn(message, RuntimeWarning, stacklevel=4)

    # ---- buffers

    def allocate(self, shape, *, dtype, device=None):
        """A tensor in this rank's arena (CPU only): the collectives read and write it where it lies.
        Without room in /dev/shm, a plain tensor (then staged through the arena, one copy each way)."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"{self!r} allocates CPU tensors, not on {device}: use transport 'torch' for GPUs")
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        numel = int(np.prod(shape)) if shape else 1
        if self.world_size == 1 or self._fallback is not None or numel == 0:
            return torch.empty(shape, dtype=dtype)
        taken = self._arena.take(numel * dtype.itemsize)
        if taken is None:
            self._warn(f"/dev/shm has no room for a buffer of {numel} {dtype} elements: it is a plain tensor, "
                       "copied through the shared memory at each call")
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(taken[1]).view(dtype)[:numel].view(shape)

    def owns(self, tensor):
        return owner_of(tensor) is self and self._offset(tensor) is not None

    def held_bytes(self) -> int:
        """Bytes of this rank's arena with pages in /dev/shm (RAM that a profiler of torch's allocator does not
        see): every block taken so far, the buffers ``allocate`` returned and the staging block among them; a block
        given back keeps its pages for the next one."""
        arena = getattr(self, "_arena", None)  # none: one rank, or no room in /dev/shm at set-up
        return (0 if arena is None else arena.allocated_to) + (0 if self._slots is None else self._slots.held_bytes())

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging block (in /dev/shm, where a memory profiler does not look)."""
        return 0 if self._staging is None else self._staging[1].numel()

    def release_staging(self) -> None:
        """Give the staging block back to the arena (the next staged call takes one again)."""
        self._staging = None

    @contextlib.contextmanager
    def observe_blocks(self, callback: Callable[[int, int, bool], None]):
        """Within the block, ``callback(offset, nbytes, taken)`` whenever this rank's arena hands out a block
        (``taken``) or gets one back, on whichever thread that happens. Memory in /dev/shm is not torch's: a
        profiler of torch's allocator (``measure.PeakMemory``) sees it only through such a callback."""
        if self.world_size == 1 or self._fallback is not None:
            yield
            return
        self._arena.observers.append(callback)
        try:
            yield
        finally:
            self._arena.observers.remove(callback)

    def close(self) -> None:
        super().close()  # the communication thread first: no call of it is on the slots afterwards
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def supports(self, device):
        return (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cpu"

    def describe(self) -> str:
        return "shared_memory" if self._fallback is None else "shared_memory (through torch: no room)"

    def _offset(self, flat: torch.Tensor) -> int | None:
        """Where a contiguous tensor lies in this rank's arena, or None if elsewhere."""
        if self.world_size == 1 or self._fallback is not None or not flat.is_contiguous():
            return None
        offset = flat.data_ptr() - self._base
        return offset if 0 <= offset and offset + flat.numel() * flat.element_size() <= self._size else None

    def _peer(self, rank: int, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s data of the call in progress, as a 1-D tensor of ``dtype`` (in its arena). Kept for
        the next call: engines sum the same buffers step after step, and a view costs microseconds to make."""
        key = (rank, offset, nbytes, dtype)
        view = self._peer_views.get(key)
        if view is None:
            if len(self._peer_views) > 4096:  # buffers come and go (FSDP's gathers): forget the old ones
                self._peer_views.clear()
            view = self._peer_views[key] = self._views[rank][offset:offset + nbytes].view(dtype)
        return view

    def _chunks(self, offsets: tuple, nbytes: int, dtype: torch.dtype, numel: int):
        """For an all-reduce whose ranks posted their data at ``offsets``: (this rank's whole data, every rank's
        chunk ``rank`` of it, this rank's first). Kept for the next call, like ``_peer``'s views."""
        key = (offsets, nbytes, dtype)
        found = self._chunk_views.get(key)
        if found is None:
            if len(self._chunk_views) > 4096:
                self._chunk_views.clear()
            data = [self._views[r][offset:offset + nbytes].view(dtype) for r, offset in enumerate(offsets)]
            b = bounds(numel, self.world_size)
            lo, hi = b[self.rank], b[self.rank + 1]
            order = [self.rank] + [r for r in range(self.world_size) if r != self.rank]
            found = self._chunk_views[key] = (data[self.rank], [data[r][lo:hi] for r in order])
        return found

    # ---- one call: post where my data lies, meet, work on everyone's data, meet

    def _post(self, flat: torch.Tensor) -> tuple[int, int]:
        """Put this rank's data where the peers can read it; returns (status, offset): ``flat`` in the arena
        is used where it lies, any other tensor is copied into the staging block."""
        nbytes = flat.numel() * flat.element_size()
        offset = self._offset(flat)
        if offset is not None or nbytes == 0:
            return _OK, offset or 0
        staging = self._stage(nbytes)
        if staging is None:
            return _NO_ROOM, -1
        offset = staging[0]
        self._peer(self.rank, offset, nbytes, flat.dtype).copy_(flat)
        return _OK, offset

    def _stage(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """The staging block, grown to ``nbytes`` (kept for later calls), or None without room."""
        if self._staging is None or self._staging[1].numel() < nbytes:
            self._staging = None  # give the old block back before taking a larger one
            taken = self._arena.take(max(nbytes, 1 << 20))
            if taken is None:
                return None
            self._staging = (taken[0], torch.from_numpy(taken[1]))
        return self._staging

    def _meet_descriptors(self, kind: str, dtype: torch.dtype, nbytes: int, op: str, status: int,
                          offset: int) -> np.ndarray:
        """Post this rank's descriptor, wait for every rank's, check that they describe one call; returns them."""
        record = self._control[self.rank]
        record[_KIND], record[_DTYPE], record[_NBYTES] = _KINDS.index(kind), _DTYPES.index(dtype), nbytes
        record[_OP], record[_STATUS], record[_OFFSET] = OPS.index(op), status, offset
        self._meet()
        table = self._control.copy()
        if (table[:, _KIND:_OP + 1] != table[0, _KIND:_OP + 1]).any():
            self._meet()  # let every rank read the table before any can overwrite its record
            rows = "; ".join(f"rank {r}: {_KINDS[k]} of {b} bytes of {_DTYPES[d]} (op {OPS[o]!r})"
                             for r, (k, d, b, o) in enumerate(table[:, [_KIND, _DTYPE, _NBYTES, _OP]].tolist()))
            raise ValueError(f"rank {self.rank}/{self.world_size}: the ranks called different shared-memory "
                             f"collectives (a peer diverged): {rows}")
        return table

    def _meet(self) -> None:
        """Returns on every rank once every rank has called it as often. Else ``PeerFailedError`` naming the ranks
        that hold it up (``shared_file.wait_for``: one that broke, one whose process is gone, one late past the
        group's timeout), and the transport refuses every later call: the ranks' meetings no longer pair up."""
        self._syncs += 1
        if not POLLS:
            dist.all_reduce(torch.zeros(1), group=self._comm.group if self._comm is not None else self.group)
            return
        self._control[self.rank, COUNTER] = self._syncs
        try:
            shared_file.wait_for(self._control, self._syncs, self.rank, self.timeout_s)
        except PeerFailedError as error:
            self._break(str(error))
            raise

    def _through_slots(self, call: Callable[..., None], *args) -> None:
        """``call(*args)`` on the slots; once it fails, the transport refuses every later call (the slots' waits name
        the peer that failed, on every rank), unless the ranks called different collectives: then every rank raised,
        and the next call pairs as on the control file."""
        try:
            call(*args)
        except BaseException as error:
            if not getattr(error, "mismatch", False):
                self._break(f"{type(error).__name__}: {error}")
            raise

    def _break(self, why: str) -> None:
        """Refuse every later call, naming ``why``, and mark this rank broken in the control file and in the slots:
        a peer's next wait on either path stops at once, naming this rank (the first failure stays)."""
        self._broken = why
        shared_file.mark_broken(self._control[self.rank], "other", self._syncs)
        if self._slots is not None:
            self._slots.break_group(why)

    def _fall_back_for_call(self, table: np.ndarray, fallback: Callable[[], None]) -> bool:
        """After the first meet: True if the call went through ``Torch`` (a rank had no room to stage)."""
        if not table[:, _STATUS].any():
            return False
        self._meet()  # every rank has read the table
        self._warn("/dev/shm had no room to stage a tensor of this call on some rank: it went through "
                   "torch.distributed, and so does every later call that finds no room")
        fallback()
        return True

    # ---- the three collectives

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        """As ``Transport.all_reduce``; a short sum the caller waits for goes straight to the slots (``_short_sum``)."""
        if op == "sum" and not async_op and self._short_sum(tensor):
            return None
        return super().all_reduce(tensor, op, async_op=async_op)

    def _short_sum(self, tensor) -> bool:
        """Sum ``tensor`` over the slots, in place, if it is a call the usual path (checks, then ``_all_reduce``)
        would send there anyway with no work of its own around it: a contiguous CPU tensor of a dtype C++ sums,
        of at most SLOTS_BYTES, untracked by autograd, that no other transport allocated, on slots this caller's
        thread runs (no communication thread), with no profiler to name the range. True if summed; False,
        having touched nothing, for every other call: the usual path takes it, refusals included. (Each
        attribute the usual path reads costs a share of a short call: this reads each once.)"""
        if (type(tensor) is not torch.Tensor or tensor.dtype not in _SUMMED_IN_CPP or self._slots is None
                or self._fallback is not None or self._comm is not None or self._broken is not None or self._closed
                or profiling()):
            return False
        if (not tensor.is_cpu or tensor.requires_grad or not tensor.is_contiguous()
                or not 0 < tensor.nbytes <= SLOTS_BYTES or owner_of(tensor) not in (None, self)):
            return False
        self._through_slots(self._slots.all_reduce, flat_view(tensor), "sum")
        return True

    def _all_reduce(self, flat, op):
        if self._fallback is not None:
            return self._fallback.all_reduce(flat, op)
        nbytes, n = flat.numel() * flat.element_size(), self.world_size
        if self._slots is not None and nbytes <= SLOTS_BYTES and (op == "sum" or flat.is_floating_point()):
            with profiler_range(_RANGES["all_reduce"]):
                self._through_slots(self._slots.all_reduce, flat, "avg_divided_first" if op == "avg" else op)
            return
        with profiler_range(_RANGES["all_reduce"]):
            staged = nbytes and self._offset(flat) is None
            status, offset = self._post(flat)
            table = self._meet_descriptors("all_reduce", flat.dtype, nbytes, op, status, offset)
            if self._fall_back_for_call(table, lambda: torch_transport.all_reduce(flat, op, self._collective_group())):
                return
            mine, chunks = self._chunks(tuple(table[:, _OFFSET].tolist()), nbytes, flat.dtype, flat.numel())
            sum_chunk(chunks, flat.element_size(), scale=1.0 / n if op == "avg" else None)
            self._meet()  # every chunk is in every rank's buffer
            if staged:  # the result comes back
                flat.copy_(mine)

    def _reduce_scatter(self, out, flat, op):
        if self._fallback is not None:
            return self._fallback.reduce_scatter(out, flat, op)
        nbytes, n, m = flat.numel() * flat.element_size(), self.world_size, out.numel()
        with profiler_range(_RANGES["reduce_scatter"]):
            status, offset = self._post(flat)
            table = self._meet_descriptors("reduce_scatter", flat.dtype, nbytes, op, status, offset)
            fallback = lambda: torch_transport.reduce_scatter(out, flat, op, self._collective_group())
            if self._fall_back_for_call(table, fallback):
                return
            lo, hi = self.rank * m, (self.rank + 1) * m
            mine = [self._peer(r, int(table[r, _OFFSET]), nbytes, flat.dtype)[lo:hi] for r in range(n)]
            order = [self.rank] + [r for r in range(n) if r != self.rank]  # own first: ``out`` may be it
            scale = 1.0 / n if op == "avg" else None
            if scale is None:
                if out.data_ptr() != mine[self.rank].data_ptr():
                    out.copy_(mine[self.rank])
                for r in order[1:]:
                    out.add_(mine[r])
            else:
                torch.mul(mine[self.rank], scale, out=out)
                for r in order[1:]:
                    out.add_(mine[r], alpha=scale)
            self._meet()  # no rank reads my input any more: the caller may change it

    def _all_gather(self, out, flat):
        if self._fallback is not None:
            return self._fallback.all_gather(out, flat)
        nbytes, n = flat.numel() * flat.element_size(), self.world_size
        with profiler_range(_RANGES["all_gather"]):
            status, offset = self._post(flat)
            table = self._meet_descriptors("all_gather", flat.dtype, nbytes, "sum", status, offset)
            if self._fall_back_for_call(table, lambda: torch_transport.all_gather(out, flat, self._collective_group())):
                return
            rows = out.view(n, -1)
            for r in range(n):
                source = flat if r == self.rank else self._peer(r, int(table[r, _OFFSET]), nbytes, flat.dtype)
                if rows[r].data_ptr() != source.data_ptr():
                    rows[r].copy_(source)
            self._meet()  # no rank reads my input any more


_SETUP_OK, _SETUP_NO_ROOM, _SETUP_NOT_SHARED = 0, 1, 2


class NotOneHost(ValueError):
    """The ranks of a group cannot share memory (not one host, or no common /dev/shm): raised on every rank."""


def _arena_size(directory: str) -> int:
    """The virtual size of every arena: all of /dev/shm (pages exist only once allocated)."""
    stats = os.statvfs(directory)
    return max(1 << 20, stats.f_blocks * stats.f_frsize) // ALIGN * ALIGN


def _make_files(size: int, control_sizes: tuple[int, ...], directory: str) -> tuple[int, str | None, list[int]]:
    """This rank's arena (sparse) and, with ``control_sizes`` (group rank 0), the control file and the slots'
    (allocated: they are written at once): (status, why not, their descriptors)."""
    made = []
    try:
        made.append(shared_file.make(size, directory=directory))
        for nbytes in control_sizes:
            made.append(shared_file.make(nbytes, allocate=True, directory=directory))
    except OSError as error:
        for fd in made:
            os.close(fd)
        if error.errno == errno.ENOSPC:
            return _SETUP_NO_ROOM, "/dev/shm has no room", []
        return _SETUP_NOT_SHARED, f"cannot make a file in {directory} ({error})", []
    return _SETUP_OK, None, made


def _attach_all(words: list[list], made: list[int], rank: int, size: int,
                control_sizes: tuple[int, int]) -> tuple[list[mmap.mmap], str | None]:
    """[the control file, the slots' file, the arena of rank 0, ..., of rank n-1] mapped, or ([], why this rank
    could not). ``words[r]``: what rank r published for the files it made (its arena; on rank 0 then the control
    file and the slots')."""
    wanted = [(0, 1, control_sizes[0], "control file"), (0, 2, control_sizes[1], "slots file")]
    wanted += [(r, 0, size, "arena") for r in range(len(words))]
    mappings = []
    for maker, which, nbytes, what in wanted:
        try:
            fd = made[which] if maker == rank else shared_file.attach(words[maker][which], nbytes)
            try:
                mappings.append(mmap.mmap(fd, nbytes))
            finally:
                if maker != rank:
                    os.close(fd)
        except (shared_file.Refused, OSError) as error:
            for mapping in mappings:
                mapping.close()
            return [], f"rank {rank} cannot map rank {maker}'s {what}: {error}"
    return mappings, None


def _records(control: mmap.mmap, n: int) -> np.ndarray:
    """The control file's records, one row per rank (after a first record that stays unused)."""
    return np.frombuffer(control, np.int64)[_RECORD:].reshape(n, _RECORD)


def _gather(value, group) -> list:
    """Every rank's ``value``, in group rank order, on every rank (a collective)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _forget_arenas(bases: list[int], close: Callable[[int], None], fd: int) -> None:
    forget_memory(bases)
    close(fd)


def sum_chunk(chunks: list[torch.Tensor], element_size: int, scale: float | None = None) -> None:
    """``chunks[0]`` (this rank's chunk of its own data) becomes the sum of every rank's chunk (its own first,
    then the others in rank order), each contribution times ``scale`` when given (the mean: 1/n; exact for a
    power of two, so at 2 ranks the same bits as dividing first); then the sum is copied into every other
    rank's chunk. Block by block, so each copy reads the sum from the cache. Each element is summed by one
    rank only: every rank gets the same bits."""
    mine = chunks[0]
    step = max(1, BLOCK_BYTES // element_size)
    for start in range(0, mine.numel(), step):
        blocks = [c[start:start + step] for c in chunks] if mine.numel() > step else chunks
        if scale is None:
            for other in blocks[1:]:
                blocks[0].add_(other)
        else:
            blocks[0].mul_(scale)
            for other in blocks[1:]:
                blocks[0].add_(other, alpha=scale)
        for other in blocks[1:]:
            other.copy_(blocks[0])

