"""What a transport is: the collectives every engine communicates through, as one small interface.

    class Mine(Transport):                         # over the ranks of ``group``
        def _all_reduce(self, flat, op): ...       # blocking, on contiguous 1-D tensors
        def _reduce_scatter(self, out, flat, op): ...
        def _all_gather(self, out, flat): ...

A transport has the three collectives data parallelism needs (``all_reduce``, ``reduce_scatter``,
``all_gather``; the contracts of ``torch.distributed``'s, with ``op`` "sum" or "avg"), each
blocking or returning a ``Work`` to ``wait()`` on, and ``allocate`` for buffers. No collective is a step
of an autograd graph, even on tensors autograd tracks (``untracked``). ``Transport`` does
the checks and trivial cases and runs the implementation's blocking calls in the caller's thread or
on a communication thread; ``Wrapped`` watches another transport at work. A transport that hands out
buffers in memory of its own says so with ``claim_memory``, so that no other transport takes them.
The implementations: ``torch_transport``, ``shared_memory``, ``message_passing``, ``hierarchical``;
``registry`` chooses among them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dpkit.comm import process_groups
from dpkit.comm.checks import check_input, check_sharded
from dpkit.comm.comm_thread import CommThread

# --------------------------------------------------------------------------- handles


class Work:
    """A collective on its way. ``wait()`` returns True once it is done and raises its error if it failed."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ThreadWork(Work):
    """A collective submitted to a transport's communication thread."""

    def __init__(self, comm: CommThread, future):
        self.comm, self.future = comm, future

    def wait(self) -> bool:
        self.comm.wait(self.future)
        return True

    def is_completed(self) -> bool:
        return self.future.done()


DONE = Work()  # what a collective that had nothing to wait for returns with async_op=True
# The context of a call that needs none (``untracked``, ``profiler_range``): one, made once (it holds no state).
_NOTHING = contextlib.nullcontext()


# --------------------------------------------------------------------------- the interface


# Every transport not yet closed: teardown closes them, so none keeps a destroyed group alive.
_OPEN: "weakref.WeakSet[Transport]" = weakref.WeakSet()


def _close_every_transport() -> None:
    for transport in list(_OPEN):
        transport.close()


process_groups.before_teardown(_close_every_transport)


class Transport:
    """The collectives an engine takes its communication through, over the ranks of ``group``.

    Every rank of the group calls every collective, in the same order, with the same sizes.
    ``background=True`` (shared memory and message passing) runs every call on a communication
    thread with a process group of its own, so that ``async_op=True`` overlaps the caller's work;
    by default they run in the caller's thread and ``async_op=True`` returns a finished handle:
    on a CPU host the "communication" is copies and additions made by the cores that compute, so
    a thread adds hand-offs and takes a core from the computation.
    """

    name = "transport"
    # Whether ``allocate`` returns memory this transport's collectives use where it lies (a tensor from anywhere
    # else is copied in and out): an engine then makes its flat buffers there rather than hand it a tensor as is.
    zero_copy = False
    # Whether a collective of no elements returns at once. Shared memory meets anyway, so that a rank that
    # diverged (an empty tensor where its peers have data) fails every rank instead of shifting the meetings.
    _skips_empty = True

    def __init__(self, group=None, *, background: bool = False):
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised process group (process_groups.distributed)")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"{type(self).__name__}: this process is not a member of the group it was given")
        self.world_size = dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self._comm = CommThread(group, torch.device("cpu"), name=f"{self.name}-comm") if background else None
        self._closed = False
        _OPEN.add(self)
        self._broken: str | None = None  # why a peer failure made this transport unusable

    # ---- the collectives (contracts of torch.distributed's; every rank calls them alike)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False) -> Work | None:
        """``tensor`` becomes the sum (or, ``op="avg"``, the mean: contributions divided first) over the ranks."""
        check_input(tensor, op)
        self._check_tensor(tensor)
        if self.world_size == 1 or (self._skips_empty and tensor.numel() == 0):
            return DONE if async_op else None  # the mean of one rank is its own value
        return self._run(async_op, _in_place, self._all_reduce, tensor, op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                       async_op: bool = False) -> Work | None:
        """Group rank r's ``output`` becomes chunk r of the sum (or mean) of every rank's ``input``
        (``input.numel() == world size x output.numel()``); ``input`` is not modified."""
        check_sharded(output, input, op, self.group, gathering=False)
        self._check_tensor(input)
        self._check_tensor(output)
        if self.world_size == 1:
            output.copy_(input.view_as(output))
            return DONE if async_op else None
        if output.numel() == 0 and self._skips_empty:
            return DONE if async_op else None
        return self._run(async_op, _sharded, self._reduce_scatter, output, input, op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work | None:
        """``output`` becomes every rank's ``input``, concatenated in group-rank order; ``input`` may be
        ``output``'s own chunk (in place)."""
        check_sharded(output, input, "sum", self.group, gathering=True)
        self._check_tensor(input)
        self._check_tensor(output)
        if self.world_size == 1:
            if output.numel() and output.data_ptr() != input.data_ptr():
                output.view(-1).copy_(input.reshape(-1))
            return DONE if async_op else None
        if output.numel() == 0 and self._skips_empty:
            return DONE if async_op else None
        return self._run(async_op, _sharded, self._all_gather, output, input)

    def allocate(self, shape: Sequence[int] | int, *, dtype: torch.dtype, device=None) -> torch.Tensor:
        """An uninitialised tensor for this transport's collectives (here: a plain one)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in memory this transport allocated for zero-copy collectives."""
        return False

    def held_bytes(self) -> int:
        """Bytes of memory of its own this transport holds on this rank (here none: it allocates with torch).
        A tensor it ``owns`` lies in them: a count adding this must not count such tensors again."""
        return 0

    def supports(self, device: torch.device) -> bool:
        """Whether this transport takes tensors on ``device``: CPU always (``_check_tensor`` relies on it)."""
        return True

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        """Stop the communication thread, if any, and let go of the group; the transport refuses calls afterwards.
        ``process_groups.teardown`` closes every transport still open before it destroys the groups."""
        self._closed = True
        if self._comm is not None:
            self._comm.close()
        self.group = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()}, ranks={self.ranks})"

    def __deepcopy__(self, memo) -> "Transport":
        """A copy of a model shares its transport: it is where the ranks meet, not state of the model."""
        return self

    # ---- what an implementation provides: blocking, on contiguous 1-D tensors

    def _all_reduce(self, flat: torch.Tensor, op: str) -> None:
        raise NotImplementedError

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: str) -> None:
        raise NotImplementedError

    def _all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        raise NotImplementedError

    # ---- shared machinery

    def _usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._broken is not None:
            raise RuntimeError(f"{self!r} cannot be used after a peer failed in an earlier call ({self._broken}): "
                               "the ranks no longer agree on which call is which")

    def _run(self, async_op: bool, fn: Callable, *args) -> Work | None:
        self._usable()
        if self._comm is None:
            fn(*args)
            return DONE if async_op else None
        work = _ThreadWork(self._comm, self._comm.submit(fn, *args))
        if async_op:
            return work
        work.wait()
        return None

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        """Refuse a tensor on a device this transport cannot serve, or a buffer another transport allocated. Every
        transport serves CPU tensors: only another device is asked of ``supports`` (``tensor.device`` makes an
        object, a share of a short collective's time)."""
        if not tensor.is_cpu and not self.supports(tensor.device):
            raise ValueError(f"{self!r} takes CPU tensors, got one on {tensor.device}: use transport 'torch' "
                             "(NCCL) for GPU tensors")
        owner = owner_of(tensor)
        if owner is not None and owner is not self:
            raise ValueError(f"a buffer allocated by {owner!r} was handed to {self!r}: allocate it with the "
                             "transport that sums it, or pass a plain tensor")


def _in_place(run: Callable[[torch.Tensor, str], None], tensor: torch.Tensor, op: str) -> None:
    """``run(flat, op)`` on ``tensor`` as a contiguous 1-D tensor; a non-contiguous one is reduced in a copy that
    is copied back. (A function of the call's arguments, not a closure made at each call: a short collective
    pays for every object it makes.)"""
    with untracked(tensor.requires_grad):
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        run(flat_view(work), op)
        if work is not tensor:
            tensor.copy_(work)


def _sharded(run: Callable, output: torch.Tensor, input: torch.Tensor, *rest) -> None:
    """``run(out, flat, *rest)`` on contiguous 1-D tensors; a non-contiguous output is filled in a copy."""
    with untracked(output.requires_grad or input.requires_grad):
        work = output if output.is_contiguous() else output.contiguous()
        run(flat_view(work), flat_view(input.contiguous()), *rest)
        if work is not output:
            output.copy_(work)


def untracked(tracked: bool):
    """``torch.no_grad()`` when autograd tracks a tensor of the call (its writes are no step of any graph), else
    nothing: no op on untracked tensors is recorded anyway, and no_grad's two calls into torch are a share of a
    short collective's time."""
    return torch.no_grad() if tracked else _NOTHING


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor`` as 1-D: itself when it is 1-D already (a view is one more tensor made per call)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


# --------------------------------------------------------------------------- a transport around another


class Wrapped(Transport):
    """Passes every call to ``inner``, buffers included: subclass it to watch a transport at work (count its
    calls, time them) without changing what it does. Every rank must wrap alike."""

    name = "wrapped"

    def __init__(self, inner: Transport):  # no set-up of its own: the inner transport's group and state
        self.inner = inner
        self.group, self.rank, self.world_size, self.ranks = inner.group, inner.rank, inner.world_size, inner.ranks
        _OPEN.add(self)
        self._comm, self._closed, self._broken = None, False, None

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        return self.inner.all_reduce(tensor, op, async_op=async_op)

    def reduce_scatter(self, output, input, op="sum", *, async_op=False):
        return self.inner.reduce_scatter(output, input, op, async_op=async_op)

    def all_gather(self, output, input, *, async_op=False):
        return self.inner.all_gather(output, input, async_op=async_op)

    def allocate(self, shape, *, dtype, device=None):
        return self.inner.allocate(shape, dtype=dtype, device=device)

    @property
    def zero_copy(self) -> bool:
        return self.inner.zero_copy

    def owns(self, tensor) -> bool:
        return self.inner.owns(tensor)

    def held_bytes(self) -> int:
        return self.inner.held_bytes()

    def supports(self, device) -> bool:
        return self.inner.supports(device)

    def describe(self) -> str:
        return f"{self.name} {self.inner.describe()}"

    def close(self) -> None:
        self.inner.close()
        self.group = None


class Staged(Wrapped):
    """``inner`` handed tensors it did not allocate: ``allocate`` gives plain ones, so an engine's buffers lie
    outside ``inner``'s memory and each collective copies them in and out (the path PyTorch's DDP takes through
    ``ddp_comm_hook``). ``resolve("shared_memory:staged")`` makes one over shared memory."""

    name = "staged"
    zero_copy = False

    def allocate(self, shape, *, dtype, device=None):
        return torch.empty(shape, dtype=dtype, device=device)


# --------------------------------------------------------------------------- memory a transport owns


_CLAIMED: list[tuple[int, int, weakref.ref]] = []  # (base address, size, transport): whose buffer is this?


def claim_memory(base: int, size: int, transport: Transport) -> None:
    """Say that bytes [base, base + size) hold buffers of ``transport`` (held weakly): ``owner_of`` names it."""
    _CLAIMED.append((base, size, weakref.ref(transport)))


def forget_memory(bases: Sequence[int]) -> None:
    """Forget the claims that start at ``bases`` (the memory is unmapped)."""
    _CLAIMED[:] = [entry for entry in _CLAIMED if entry[0] not in bases]


def owner_of(tensor: torch.Tensor):
    """The live transport whose claimed memory (its own or a peer's mapping) holds ``tensor``, or None."""
    if not _CLAIMED or not tensor.is_cpu or tensor.numel() == 0:
        return None
    pointer = tensor.data_ptr()
    for base, size, owner in _CLAIMED:
        if base <= pointer < base + size:
            return owner()
    return None


def profiling() -> bool:
    """Whether a profiler may be recording (asking costs nanoseconds). ``_is_profiler_enabled`` is the profiler's
    own process-wide flag, true on every thread it records (private: where a release drops it, the answer is
    always yes)."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


def profiler_range(name: str):
    """A profiler range ``name`` while a profiler records (``profiling``), else nothing (a range costs
    microseconds)."""
    if profiling():
        return torch.profiler.record_function(name)
    return _NOTHING
