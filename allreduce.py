"""Homework Task 4: all-reduce over point-to-point messages only: ring, butterfly and halving-doubling.

    python allreduce.py                  # the homework comparison (spawns 1 to 32 workers itself)
    python allreduce.py --quick          # a small subset, about a minute on two cores
    python allreduce.py --world-sizes 1 2 4 --sizes 1000 100000 --repeats 20 --json results/allreduce.json

Every algorithm has the contract of ``torch.distributed.all_reduce``, restricted to
what the homework asks::

    f(tensor, op="mean", group=None) -> tensor

It reduces ``tensor`` in place over all ranks of ``group`` (``"sum"``, or ``"mean"``: the
sum in the tensor's dtype divided once by the group size), and returns the same tensor.
Only ``isend``/``irecv``/``batch_isend_irecv`` are used, never a collective. Any world
size, any number of elements (fewer than ranks, not divisible, or none), any floating
dtype (integers too with ``op="sum"``), contiguous or not: a non-contiguous tensor is
reduced in a contiguous copy that is copied back, which costs ``numel`` extra elements.

* ``ring_allreduce``: reduce-scatter then all-gather around the ring; each rank sends
  2(n-1)/n of the tensor, and the transfers are pipelined with the additions.
* ``butterfly_allreduce``: the homework's algorithm: rank i owns chunk i, every rank sends
  chunk i straight to rank i, which reduces what it receives and sends the result to all.
* ``halving_doubling_allreduce``: Rabenseifner's recursive halving reduce-scatter then
  recursive doubling all-gather; a world size that is not a power of two folds its extra
  ranks into partners first.
* ``torch_allreduce``: the reference, ``torch.distributed.all_reduce`` with the same contract.

Running the file spawns its own workers (one launch per world size, one intra-op thread
each) and prints the homework's two tables: the three algorithms for 1 to 32 workers, and
ring against ``torch.distributed.all_reduce`` for 1 to 16 processes and 1,000 to 100,000
elements. Columns: time (maximum over ranks, median of the repeats after warm-up),
memory (the extra bytes the call allocates, measured in a separate untimed call with the
scratch buffers of earlier calls released first) and the
accuracy of averaging (maximum absolute difference from the exact mean computed in
float64, every rank holding different random data).

The last section holds the two halves of the ring as collectives of their own, for sharded
training: ``reduce_scatter(output, input, op, group)`` and ``all_gather(output, input, group)``
(the contracts of ``torch.distributed.reduce_scatter_tensor`` and ``all_gather_into_tensor``),
each rank sending (n-1)/n of the full tensor; ``collectives_benchmark.py --collective`` times them.
"""

from __future__ import annotations

import argparse
import functools
import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dist_utils import add_common_args, launch, progress, resolve_backend
from measure import PeakMemory, gather_rows, time_interleaved
from results import environment, format_environment, markdown_table, write_results

OPS = ("mean", "sum")

# Pipelining on gloo/CPU. A gloo point-to-point message costs far more than a step of gloo's own
# all-reduce (on 2 cores each dependent hop waits for a scheduler wake-up), so segments must be
# large: 1-2 MiB segments left 4 processes at 10 MB at 1.2-1.3x torch's time. Same-run A/B (the
# configurations taking turns call by call, 40-50 calls, receives posted early, scratch kept):
# 4 MiB with 4 in flight beat 8 MiB with 2 in 5 of 5 pairs at 10 MB (ring/torch 1.00-1.11 against
# 1.05-1.15 with 2 and 4 processes) and gave 0.80-0.88 at 100 MB. Re-tune on other machines with
# ``collectives_benchmark.py --segment-bytes ... --in-flight ...``.
SEGMENT_BYTES = 4 << 20
IN_FLIGHT = 4


# --------------------------------------------------------------------------- the common frame


def _check(tensor: torch.Tensor, op: str) -> None:
    """Refuse bad input before any message is sent, so no peer is left waiting for half a protocol."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: choose one of {', '.join(OPS)}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"cannot all-reduce a {tensor.dtype} tensor: use a floating (or, with op='sum', integer) dtype")
    if op == "mean" and not tensor.is_floating_point():
        raise TypeError(f"op='mean' needs a floating dtype, got {tensor.dtype}: the mean of integers is not an integer")


def _group_rank(group) -> tuple[int, int]:
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group it was asked to all-reduce over")
    return rank, dist.get_world_size(group)


def bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` near-equal contiguous pieces of ``numel`` elements (sizes differ by at most one).

    Piece i is ``[b[i], b[i+1])``; the first ``numel % parts`` pieces are the longer ones.
    """
    quotient, remainder = divmod(numel, parts)
    return [i * quotient + min(i, remainder) for i in range(parts + 1)]


def _allreduce(tensor: torch.Tensor, op: str, group, algorithm: Callable[..., None], **options) -> torch.Tensor:
    """Validate, handle the trivial cases, run ``algorithm(flat, rank, n, op, group)`` on a contiguous 1-D view."""
    _check(tensor, op)
    rank, n = _group_rank(group)
    if tensor.numel() == 0 or n == 1:
        return tensor  # nothing to exchange; the mean of one rank is its own value
    # A non-contiguous tensor has no flat view: reduce a contiguous copy (numel extra elements), copy it back.
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    with torch.no_grad():
        algorithm(work.view(-1), rank, n, op, group, **options)
        if work is not tensor:
            tensor.copy_(work)
    return tensor


# --------------------------------------------------------------------------- pipelined exchanges


@dataclass
class _Tick:
    """One step of a pairwise exchange: send one piece to a peer, receive one piece from a peer.

    ``recv`` is where the received piece belongs: with ``reduce`` it arrives in a scratch
    buffer and is added there, otherwise it is received in place. ``divide`` is applied to
    ``recv`` after the addition (the mean's single division). ``needs`` is the index of the
    last tick that must be finished before this one is posted: the one that produced the
    data ``send`` reads. Either side may be None (an empty piece, or a one-way step).
    """

    send: torch.Tensor | None
    send_peer: int
    recv: torch.Tensor | None
    recv_peer: int
    reduce: bool
    divide: int | None
    needs: int


class _Exchange:
    """Runs a list of ticks with up to ``in_flight`` of them in flight.

    Two schedules, one per backend, both posting every rank's receives and sends in tick
    order, so the per-pair order of messages agrees between sender and receiver:

    * gloo (``_run_early_receives``): receives are posted up to ``in_flight`` ticks ahead of
      the one being finished, independently of the sends. A gloo message moves only once its
      receive is posted (the receiver tells the sender it is ready), so a receive posted late
      puts one more round trip, and a scheduler wake-up on an oversubscribed machine, on the
      critical path of every dependent step. Posting it early is safe for our schedules: an
      in-place receive gets data that causally follows every earlier send from that region
      (the ring's all-gather carries sums that include what this rank sent), and a reduced
      piece lands in a scratch slot that is reused only after the tick using it finished.
      Measured on 2 cores with 4 processes, 10 MB: the ring went from 1.2x to about 1.05x
      the time of ``torch.distributed.all_reduce``.
    * NCCL and others (``_run_lockstep``): each tick is one ``batch_isend_irecv``, and the
      peers of a tick post the matching tick in the same position of their own lists. NCCL
      needs that lock-step: a receive queued alone on the stream would block the sends queued
      behind it, and a batch completes only when its peers' batches do.

    Scratch memory: ``in_flight`` buffers of the largest reduced piece, taken from the calling
    thread's scratch buffer (see ``_scratch``), which outlives the call.
    """

    def __init__(self, ticks: list[_Tick], group, in_flight: int):
        self.ticks, self.group, self.in_flight = ticks, group, max(1, in_flight)
        reduced = [t.recv.numel() for t in ticks if t.reduce and t.recv is not None]
        like = next((t.recv for t in ticks if t.recv is not None), None)
        slots = min(self.in_flight, len(reduced))
        # (slots, largest piece): tick j uses row (j-th reduce tick) % slots; a row is reused only after the
        # tick that used it was finished, because at most in_flight ticks are ever outstanding.
        self.scratch = _scratch(like, slots, max(reduced)) if reduced else None
        self.next_slot = 0

    def run(self) -> None:
        if dist.get_backend(self.group) == dist.Backend.GLOO:
            self._run_early_receives()
        else:
            self._run_lockstep()

    def _run_early_receives(self) -> None:
        """gloo: receives posted ``in_flight`` ticks ahead; a send posted as soon as the tick it needs is finished."""
        ticks, receives, sends = self.ticks, {}, []
        next_receive = next_send = 0
        for index, tick in enumerate(ticks):
            while next_receive < min(len(ticks), index + self.in_flight):
                receives[next_receive] = self._post_receive(ticks[next_receive])
                next_receive += 1
            while next_send < len(ticks) and ticks[next_send].needs < index:  # ticks before ``index`` are finished
                if ticks[next_send].send is not None:
                    sends.append(dist.isend(ticks[next_send].send, group=self.group, group_dst=ticks[next_send].send_peer))
                next_send += 1
            target, work = receives.pop(index)
            if work is not None:
                work.wait()
            self._reduce(tick, target)
        for work in sends:
            work.wait()

    def _post_receive(self, tick: _Tick):
        target = self._target(tick)
        if target is None:
            return None, None
        return target, dist.irecv(target, group=self.group, group_src=tick.recv_peer)

    def _target(self, tick: _Tick) -> torch.Tensor | None:
        """Where the tick's piece arrives: in place, or a scratch slot when it is to be added."""
        if tick.recv is None or not tick.reduce:
            return tick.recv
        target = self.scratch[self.next_slot, :tick.recv.numel()]
        self.next_slot = (self.next_slot + 1) % self.scratch.shape[0]
        return target

    @staticmethod
    def _reduce(tick: _Tick, target: torch.Tensor | None) -> None:
        if tick.recv is not None and tick.reduce:
            tick.recv.add_(target)
        if tick.recv is not None and tick.divide is not None:
            tick.recv.div_(tick.divide)

    def _run_lockstep(self) -> None:
        pending: deque = deque()
        for index, tick in enumerate(self.ticks):
            while pending and (len(pending) >= self.in_flight or pending[0][0] <= tick.needs):
                self._finish(*pending.popleft()[1:])
            pending.append((index, tick, *self._post(tick)))
        while pending:
            self._finish(*pending.popleft()[1:])

    def _post(self, tick: _Tick):
        """Post the tick's receive, then its send (the receive first, so the sender never waits to be matched)."""
        ops, target = [], self._target(tick)
        if target is not None:
            ops.append(dist.P2POp(dist.irecv, target, group=self.group, group_peer=tick.recv_peer))
        if tick.send is not None:
            ops.append(dist.P2POp(dist.isend, tick.send, group=self.group, group_peer=tick.send_peer))
        return target, dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def _finish(tick, target, works) -> None:
        # gloo returns one work per op (receive first), NCCL one for the whole batch. Add as soon as the
        # receive is done; the send must be done before the tick counts as finished, because a finished
        # tick's pieces may be overwritten.
        first = 1 if tick.recv is not None and len(works) == 2 else len(works)
        for work in works[:first]:
            work.wait()
        _Exchange._reduce(tick, target)
        for work in works[first:]:
            work.wait()


_SCRATCH = threading.local()  # .buffers: {(dtype, device): 1-D tensor}, one set per thread


def _scratch(like: torch.Tensor, rows: int, columns: int, purpose: str = "exchange") -> torch.Tensor:
    """A (rows, columns) view of this thread's scratch buffer for ``like``'s dtype and device, grown as needed.

    Kept from call to call, as gloo and NCCL keep their own buffers: a fresh buffer of a few MB
    is paid for again in page faults on first touch (about 0.6 ms for 10 MB here, 5 % of a 10 MB
    all-reduce; a same-run A/B over 40 calls: ring/torch 1.01-1.15 with the buffer kept, 1.07-1.28
    without). It holds ``in_flight`` segments of the largest call so far, O(numel / n) as before;
    ``release_scratch()`` frees it. Per thread, so concurrent calls from two threads never share it.
    """
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    key, needed = (like.dtype, like.device, purpose), rows * columns  # one buffer per use that may coexist
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < needed:
        buffer = buffers[key] = like.new_empty(needed)
    return buffer[:needed].view(rows, columns)


def release_scratch() -> None:
    """Free the calling thread's scratch buffers (the next ring or halving-doubling call allocates them again)."""
    _SCRATCH.__dict__.pop("buffers", None)


def _segments(piece: torch.Tensor, count: int) -> list[torch.Tensor | None]:
    """``piece`` cut into ``count`` near-equal views; an empty one is None (nothing to send)."""
    b = bounds(piece.numel(), count)
    return [piece[b[i]:b[i + 1]] if b[i + 1] > b[i] else None for i in range(count)]


def _segment_count(numel: int, element_size: int, segment_bytes: int) -> int:
    return max(1, math.ceil(numel * element_size / max(1, segment_bytes)))


# --------------------------------------------------------------------------- ring


def _ring_ticks(flat: torch.Tensor, rank: int, n: int, op: str, segment_bytes: int) -> list[_Tick]:
    """Reduce-scatter then all-gather around the ring, each chunk cut into the same number of segments.

    Reduce-scatter step s (0..n-2): send chunk (rank - s), receive chunk (rank - s - 1) from the left
    and add it; after n-1 steps this rank holds the full sum of chunk (rank + 1), divided there for
    the mean. All-gather step s: send chunk (rank + 1 - s), receive chunk (rank - s) in place.
    Segment k of a step forwards what segment k of the previous step received, so tick t needs
    tick t - K and the K segments of a step stream through the ring one behind the other.
    """
    b = bounds(flat.numel(), n)
    chunks = [flat[b[i]:b[i + 1]] for i in range(n)]
    per_chunk = _segment_count(b[1] - b[0], flat.element_size(), segment_bytes)
    segments = [_segments(chunk, per_chunk) for chunk in chunks]
    right, left = (rank + 1) % n, (rank - 1) % n
    ticks = []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            if phase == "reduce-scatter":
                send_chunk, recv_chunk = (rank - s) % n, (rank - s - 1) % n
                divide = n if op == "mean" and s == n - 2 else None
            else:
                send_chunk, recv_chunk, divide = (rank + 1 - s) % n, (rank - s) % n, None
            for k in range(per_chunk):
                ticks.append(_Tick(segments[send_chunk][k], right, segments[recv_chunk][k], left,
                                   reduce=phase == "reduce-scatter", divide=divide, needs=len(ticks) - per_chunk))
    return ticks


def _ring(flat, rank, n, op, group, segment_bytes=SEGMENT_BYTES, in_flight=IN_FLIGHT) -> None:
    _Exchange(_ring_ticks(flat, rank, n, op, segment_bytes), group, in_flight).run()


def ring_allreduce(tensor: torch.Tensor, op: str = "mean", group=None, *, segment_bytes: int = SEGMENT_BYTES,
                   in_flight: int = IN_FLIGHT) -> torch.Tensor:
    """Ring all-reduce in place: reduce-scatter then all-gather, pipelined in segments.

    Each rank sends 2(n-1) chunks of ceil(numel/n) elements at most (bandwidth-optimal), in
    messages of about ``segment_bytes``, with up to ``in_flight`` segments posted ahead of the
    one being added. Extra memory: ``in_flight`` segments, never more than ``in_flight`` chunks
    (plus ``numel`` for a non-contiguous input), in a scratch buffer kept for the next call
    (``release_scratch()`` frees it).
    """
    return _allreduce(tensor, op, group, _ring, segment_bytes=segment_bytes, in_flight=in_flight)


# --------------------------------------------------------------------------- halving-doubling


def _halving_doubling_ticks(flat: torch.Tensor, rank: int, n: int, op: str, segment_bytes: int) -> list[_Tick]:
    """Rabenseifner over the largest power of two p <= n, with the n - p extra ranks folded in.

    Fold: extra rank p + i sends its tensor to rank i, which adds it. Recursive halving: at
    distance d = p/2, ..., 1 a rank keeps the half of its current block range on its side of
    the partner (rank ^ d) and sends the other half, adding what it receives; afterwards rank
    r holds the sum of block r of p. Recursive doubling (d = 1, ..., p/2) swaps the ranges
    back in place. Unfold: rank i sends the result to rank p + i. Reduced pieces are segmented
    (bounded scratch, overlapped additions); each step waits for the previous one to finish.
    """
    p = 1 << (n.bit_length() - 1)
    divide = n if op == "mean" else None
    ticks: list[_Tick] = []

    def exchange(send, recv, peer, reduce, last_step=False):
        largest = max(x.numel() if x is not None else 0 for x in (send, recv))
        count = _segment_count(largest, flat.element_size(), segment_bytes) if reduce else 1
        sends = _segments(send, count) if send is not None else [None] * count
        recvs = _segments(recv, count) if recv is not None else [None] * count
        start = len(ticks)
        for s, r in zip(sends, recvs):
            if s is not None or r is not None:
                ticks.append(_Tick(s, peer, r, peer, reduce, divide if last_step else None, needs=start - 1))

    if rank >= p:  # an extra rank: hand the data over, get the result back
        exchange(flat, None, rank - p, reduce=True)
        exchange(None, flat, rank - p, reduce=False)
        return ticks
    if rank < n - p:
        exchange(None, flat, rank + p, reduce=True)
    blocks = bounds(flat.numel(), p)
    lo, hi = 0, p  # the blocks this rank is responsible for: [lo, hi)
    distance = p // 2
    while distance >= 1:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        exchange(flat[blocks[give[0]]:blocks[give[1]]], flat[blocks[keep[0]]:blocks[keep[1]]], rank ^ distance,
                 reduce=True, last_step=distance == 1)
        lo, hi = keep
        distance //= 2
    distance = 1
    while distance < p:
        width = hi - lo
        partner_lo = lo + width if (rank & distance) == 0 else lo - width
        exchange(flat[blocks[lo]:blocks[hi]], flat[blocks[partner_lo]:blocks[partner_lo + width]], rank ^ distance,
                 reduce=False)
        lo, hi = min(lo, partner_lo), max(hi, partner_lo + width)
        distance *= 2
    if rank < n - p:
        exchange(flat, None, rank + p, reduce=False)
    return ticks


def _halving_doubling(flat, rank, n, op, group, segment_bytes=SEGMENT_BYTES, in_flight=IN_FLIGHT) -> None:
    _Exchange(_halving_doubling_ticks(flat, rank, n, op, segment_bytes), group, in_flight).run()


def halving_doubling_allreduce(tensor: torch.Tensor, op: str = "mean", group=None, *,
                               segment_bytes: int = SEGMENT_BYTES, in_flight: int = IN_FLIGHT) -> torch.Tensor:
    """Recursive halving reduce-scatter + recursive doubling all-gather (Rabenseifner) in place.

    With n a power of two each rank sends 2(n-1)/n of the tensor in 2 log2(n) exchanges
    (vs 2(n-1) for the ring: fewer, larger messages). Otherwise the n - p ranks beyond the
    largest power of two p send their tensor to a partner and get the result back: they send
    one tensor, their partners one tensor more than the 2(p-1)/p of the others.
    Extra memory: ``in_flight`` pieces of at most ``segment_bytes`` and at most half the tensor.
    """
    return _allreduce(tensor, op, group, _halving_doubling, segment_bytes=segment_bytes, in_flight=in_flight)


# --------------------------------------------------------------------------- butterfly


def _butterfly(flat: torch.Tensor, rank: int, n: int, op: str, group) -> None:
    """Rank i owns chunk i: everyone sends chunk i to rank i (all at once), rank i adds the n - 1
    chunks it receives in rank order, then sends its reduced chunk to everyone."""
    b = bounds(flat.numel(), n)
    chunks = [flat[b[i]:b[i + 1]] for i in range(n)]
    own = chunks[rank]
    peers = [j for j in range(n) if j != rank]
    received = own.new_empty((n - 1, own.numel()))  # the homework's buffer: (n-1)/n of the tensor
    scatter = [dist.P2POp(dist.isend, chunks[j], group=group, group_peer=j) for j in peers if chunks[j].numel()]
    if own.numel():
        scatter += [dist.P2POp(dist.irecv, received[i], group=group, group_peer=j) for i, j in enumerate(peers)]
    works = dist.batch_isend_irecv(scatter) if scatter else []
    for work in works:
        work.wait()  # sends too: chunk j is overwritten below
    for row in received:
        own.add_(row)
    if op == "mean":
        own.div_(n)
    gather = [dist.P2POp(dist.isend, own, group=group, group_peer=j) for j in peers if own.numel()]
    gather += [dist.P2POp(dist.irecv, chunks[j], group=group, group_peer=j) for j in peers if chunks[j].numel()]
    for work in (dist.batch_isend_irecv(gather) if gather else []):
        work.wait()


def butterfly_allreduce(tensor: torch.Tensor, op: str = "mean", group=None) -> torch.Tensor:
    """The homework's butterfly all-reduce, for tensors of any size, in place.

    Each rank sends 2(n-1)/n of the tensor like the ring, but as n-1 simultaneous messages per
    phase, and keeps all n-1 received chunks at once: (n-1)/n of the tensor in extra memory.
    """
    return _allreduce(tensor, op, group, _butterfly)


# --------------------------------------------------------------------------- reference


def torch_allreduce(tensor: torch.Tensor, op: str = "mean", group=None) -> torch.Tensor:
    """``torch.distributed.all_reduce`` with the same contract (gloo has no AVG: sum, then divide once)."""
    _check(tensor, op)
    dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group)
    if op == "mean":
        tensor.div_(dist.get_world_size(group))
    return tensor


ALGORITHMS: dict[str, Callable[..., torch.Tensor]] = {
    "torch": torch_allreduce,
    "ring": ring_allreduce,
    "butterfly": butterfly_allreduce,
    "halving_doubling": halving_doubling_allreduce,
}


# --------------------------------------------------------------------------- sharded collectives
# reduce_scatter and all_gather, the two halves of the ring all-reduce as separate calls: what a
# sharded optimizer (each rank updates 1/n of the parameters) and sharded parameters need.


@dataclass
class _ContributingTick(_Tick):
    """A reduce-scatter tick: ``recv`` (a partial-sum slot) first receives this rank's own
    contribution ``own`` (divided by ``scale`` for the mean), then the peer's partial sum is added."""

    own: torch.Tensor | None = None
    scale: int | None = None


class _ContributingExchange(_Exchange):
    """Writes a tick's own contribution into its slot just before the tick's receive is posted, so the
    copy (or division) overlaps the messages in flight and no slot holds a copy before it is needed."""

    def _target(self, tick: _Tick) -> torch.Tensor | None:
        if tick.reduce and tick.recv is not None:
            _contribute(tick.recv, tick.own, tick.scale)
        return super()._target(tick)


def _contribute(out: torch.Tensor, own: torch.Tensor, scale: int | None) -> None:
    # The mean divides every contribution before the sum (not the sum once): a float16 sum of n large values overflows.
    if scale is None:
        out.copy_(own)
    else:
        torch.div(own, scale, out=out)


def _check_sharded(output, input, op: str, group, gathering: bool) -> tuple[int, int]:
    """Refuse what would fail halfway (or hang a peer) before the first message; returns (rank, world size)."""
    _check(input, op)
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor output, got {type(output).__name__}")
    if output.dtype != input.dtype or output.device != input.device:
        raise TypeError(f"output ({output.dtype}, {output.device}) and input ({input.dtype}, {input.device}) "
                        "must have the same dtype and device")
    rank, n = _group_rank(group)
    shard, full = (input, output) if gathering else (output, input)
    if full.numel() != n * shard.numel():
        name = "output" if gathering else "input"
        raise ValueError(f"{name} has {full.numel()} elements, expected world size x shard = {n} x {shard.numel()}: "
                         "pad the full tensor to a multiple of the world size")
    if _overlaps(output, input) and not _is_own_chunk(shard, full, rank):
        raise ValueError("output and input overlap: only the in-place form is allowed, the shard being chunk "
                         "`rank` of the full tensor (both contiguous)")
    return rank, n


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) a tensor may touch in its storage."""
    start = t.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return start, start + extent * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _is_own_chunk(shard: torch.Tensor, full: torch.Tensor, rank: int) -> bool:
    return (shard.is_contiguous() and full.is_contiguous()
            and shard.data_ptr() == full.data_ptr() + rank * shard.numel() * shard.element_size())


def _sharded(output: torch.Tensor, input: torch.Tensor, run: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """Run ``run(flat_output, flat_input)`` on contiguous 1-D views; a non-contiguous output is filled in a copy."""
    work = output if output.is_contiguous() else output.contiguous()
    with torch.no_grad():
        run(work.view(-1), input.contiguous().view(-1))  # a non-contiguous input is read through a copy
        if work is not output:
            output.copy_(work)
    return output


def _reduce_scatter_ticks(out: torch.Tensor, chunks: list[torch.Tensor], rank: int, n: int, op: str,
                          segment_bytes: int) -> list[_ContributingTick]:
    """The ring's reduce-scatter: at step s rank r sends its partial sum of chunk r-s-1 to the right
    and adds its own part of chunk r-s-2 to the partial sum arriving from the left; after n-1 steps
    the partial sum of chunk r, arrived last, is the whole sum. Partial sums in transit live in
    n-2 scratch rows (one more for the mean's divided first send), the last one in ``out``."""
    m, scale = out.numel(), n if op == "mean" else None
    per_chunk = min(m, _segment_count(m, out.element_size(), segment_bytes))
    rows = _scratch(out, n - 2 + (scale is not None), m, purpose="reduce_scatter")
    first = chunks[(rank - 1) % n]
    if scale is not None:  # the first send is a contribution too: divided before it leaves
        first = torch.div(first, scale, out=rows[n - 2])
    slots = {(rank - s - 2) % n: rows[s] for s in range(n - 2)} | {rank: out}
    sent = _segments(first, per_chunk)
    ticks = []
    for s in range(n - 1):
        received = (rank - s - 2) % n
        for k, (send, recv, own) in enumerate(zip(sent, _segments(slots[received], per_chunk),
                                                  _segments(chunks[received], per_chunk))):
            ticks.append(_ContributingTick(send, (rank + 1) % n, recv, (rank - 1) % n, reduce=True, divide=None,
                                           needs=len(ticks) - per_chunk, own=own, scale=scale))
        sent = _segments(slots[received], per_chunk)
    return ticks


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "mean", group=None, *,
                   segment_bytes: int = SEGMENT_BYTES, in_flight: int = IN_FLIGHT) -> torch.Tensor:
    """Ring reduce-scatter: group rank r's ``output`` becomes chunk r of the sum (or mean) of every rank's ``input``.

    The contract of ``torch.distributed.reduce_scatter_tensor`` (``reduce_scatter_single``):
    ``input.numel() == world size x output.numel()``, chunk r being ``input.view(-1)[r m:(r+1) m]``
    with m = ``output.numel()`` (a caller with a length not divisible by the world size pads it, as
    with torch). ``input`` is not modified; ``output`` may be ``input``'s own chunk r (in place).
    ``op="mean"`` divides every contribution by the world size before adding (no float16 overflow).

    Each rank sends n-1 chunks, (n-1)/n of the input (half an all-reduce), in pipelined segments of
    about ``segment_bytes``. Extra memory: n-2 chunks of partial sums (n-1 for the mean) and
    ``in_flight`` segments, kept for the next call like the ring's scratch (``release_scratch()``).
    """
    rank, n = _check_sharded(output, input, op, group, gathering=False)

    def run(out: torch.Tensor, flat: torch.Tensor) -> None:
        if out.numel() == 0:
            return
        chunks = flat.view(n, -1).unbind(0)  # (n, m): chunk j is what rank j ends with
        if n == 1:
            _contribute(out, chunks[0], None)  # the mean of one rank is its own value
            return
        ticks = _reduce_scatter_ticks(out, chunks, rank, n, op, segment_bytes)
        _ContributingExchange(ticks, group, in_flight).run()

    return _sharded(output, input, run)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, *, segment_bytes: int = SEGMENT_BYTES,
               in_flight: int = IN_FLIGHT) -> torch.Tensor:
    """Ring all-gather: ``output`` becomes every group rank's ``input``, concatenated in rank order.

    The contract of ``torch.distributed.all_gather_into_tensor`` (``all_gather_single``):
    ``output.numel() == world size x input.numel()``; ``input`` may be ``output``'s own chunk r (in
    place). At step s rank r forwards chunk r-s to the right and receives chunk r-s-1 in place from
    the left: each rank sends n-1 chunks, (n-1)/n of the output, in pipelined segments, with no
    extra memory (plus a copy of a non-contiguous output or input).
    """
    rank, n = _check_sharded(output, input, "sum", group, gathering=True)

    def run(out: torch.Tensor, flat: torch.Tensor) -> None:
        if out.numel() == 0:
            return
        chunks = out.view(n, -1).unbind(0)
        if flat.data_ptr() != chunks[rank].data_ptr():
            chunks[rank].copy_(flat)
        per_chunk = min(flat.numel(), _segment_count(flat.numel(), out.element_size(), segment_bytes))
        ticks = []
        for s in range(n - 1):
            sends, recvs = _segments(chunks[(rank - s) % n], per_chunk), _segments(chunks[(rank - s - 1) % n], per_chunk)
            for send, recv in zip(sends, recvs):
                ticks.append(_Tick(send, (rank + 1) % n, recv, (rank - 1) % n, reduce=False, divide=None,
                                   needs=len(ticks) - per_chunk))
        _Exchange(ticks, group, in_flight).run()

    return _sharded(output, input, run)


def torch_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "mean", group=None) -> torch.Tensor:
    """``torch.distributed.reduce_scatter_single`` (formerly ``reduce_scatter_tensor``) with the same contract:
    gloo has no AVG, so the mean is the sum divided once."""
    _check_sharded(output, input, op, group, gathering=False)
    dist.reduce_scatter_single(output, input, dist.ReduceOp.SUM, group=group)
    if op == "mean":
        output.div_(dist.get_world_size(group))
    return output


def torch_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """``torch.distributed.all_gather_single`` (formerly ``all_gather_into_tensor``) with the same contract."""
    _check_sharded(output, input, "sum", group, gathering=True)
    dist.all_gather_single(output, input, group=group)
    return output


# name -> f(output, input, op, group) and f(output, input, group)
REDUCE_SCATTERS: dict[str, Callable[..., torch.Tensor]] = {"torch": torch_reduce_scatter, "ring": reduce_scatter}
ALL_GATHERS: dict[str, Callable[..., torch.Tensor]] = {"torch": torch_all_gather, "ring": all_gather}


# --------------------------------------------------------------------------- the homework comparison

CUSTOM = ("ring", "butterfly", "halving_doubling")
QUICK = dict(world_sizes=[1, 2, 4], sizes=[1000, 100_000], repeats=5, warmup=2)
# Seed 000's second table compares with torch on 1 to 16 processes.
TORCH_TABLE_MAX_WORLD = 16


def rank_data(seed: int, numel: int, rank: int) -> torch.Tensor:
    """The float64 data rank ``rank`` contributes: different on every rank, reproducible anywhere."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + numel * 1009 + rank)
    return torch.randn(numel, generator=generator, dtype=torch.float64)


def _measure_size(ctx, numel: int, algorithms: list[str], dtype: torch.dtype, repeats: int, warmup: int,
                  seed: int) -> list[dict]:
    """Accuracy, memory and time of every algorithm on one size; every rank calls this with the same arguments."""
    mine = rank_data(seed, numel, ctx.rank).to(dtype)
    # The exact mean of what the ranks hold (after rounding to dtype), in float64: the oracle.
    exact = torch.stack([rank_data(seed, numel, r).to(dtype).double() for r in range(ctx.world_size)]).mean(0)
    saved = mine.to(ctx.device)
    x = saved.clone()
    measured = []  # per algorithm: max abs error, peak extra bytes
    for name in algorithms:
        x.copy_(saved)
        ALGORITHMS[name](x, "mean")
        error = (x.cpu().double() - exact).abs().max().item() if numel else 0.0
        x.copy_(saved)
        release_scratch()  # count the scratch the call needs, not what an earlier call left
        with PeakMemory(ctx.device) as peak:  # a separate call: profiling slows the timed one down
            ALGORITHMS[name](x, "mean")
        measured += [error, float(peak.bytes)]
    worst = gather_rows(measured).max(0).values.tolist()
    # The algorithms take turns call by call, each on the same saved input: load drifts hit all alike.
    timings = time_interleaved({name: functools.partial(ALGORITHMS[name], x, "mean") for name in algorithms},
                               repeats, warmup, rounds=repeats, device=ctx.device, setup=lambda: x.copy_(saved))
    return [{"world_size": ctx.world_size, "numel": numel, "dtype": str(dtype).replace("torch.", ""), "algorithm": name,
             "time_s": timings[name].median, "time_p90_s": timings[name].percentile(90),
             "memory_bytes": int(worst[2 * i + 1]), "max_abs_error": worst[2 * i]}
            for i, name in enumerate(algorithms)]


def compare_worker(ctx, sizes: list[int], algorithms: list[str], repeats: int, warmup: int, seed: int,
                   dtype: str) -> list[dict]:
    """Every size and algorithm for one world size, in one spawned group (spawning costs seconds)."""
    return [row for numel in sizes
            for row in _measure_size(ctx, numel, algorithms, getattr(torch, dtype), repeats, warmup, seed)]


def _pivot(rows: list[dict], max_world: int | None = None) -> list[dict]:
    """One row per (world size, numel) with '<algorithm>_<metric>' columns."""
    table: dict[tuple[int, int], dict] = {}
    for row in rows:
        if max_world is not None and row["world_size"] > max_world:
            continue
        line = table.setdefault((row["world_size"], row["numel"]), {"world_size": row["world_size"], "numel": row["numel"]})
        name = row["algorithm"]
        line[f"{name}_ms"] = row["time_s"] * 1e3
        line[f"{name}_kib"] = row["memory_bytes"] / 1024
        line[f"{name}_err"] = row["max_abs_error"]
    for line in table.values():
        if "torch_ms" in line and "ring_ms" in line and line["torch_ms"] > 0:
            line["ring_vs_torch"] = line["ring_ms"] / line["torch_ms"]
    return [table[key] for key in sorted(table)]


def report(rows: list[dict]) -> str:
    """Seed 000's two tables: the custom algorithms for every world size, and ring against torch."""
    short = {"ring": "ring", "butterfly": "bfly", "halving_doubling": "HD", "torch": "torch"}
    custom = [("world_size", "world", "d"), ("numel", "elements", "d")]
    for metric, unit, spec in (("ms", "time ms", ".3f"), ("kib", "mem KiB", ".1f"), ("err", "max err", ".2e")):
        custom += [(f"{name}_{metric}", f"{short[name]} {unit}", spec) for name in CUSTOM]
    versus = [("world_size", "world", "d"), ("numel", "elements", "d"), ("torch_ms", "torch ms", ".3f"),
              ("ring_ms", "ring ms", ".3f"), ("ring_vs_torch", "ring/torch", ".2f"), ("butterfly_ms", "bfly ms", ".3f"),
              ("halving_doubling_ms", "HD ms", ".3f"), ("torch_kib", "torch KiB", ".1f"), ("ring_kib", "ring KiB", ".1f"),
              ("torch_err", "torch err", ".2e"), ("ring_err", "ring err", ".2e")]
    return "\n\n".join([
        "## Ring vs butterfly vs halving-doubling (time: median of max over ranks; memory: extra bytes allocated; "
        "error: max |result - exact float64 mean|)",
        markdown_table(_pivot(rows), custom),
        f"## Ring vs torch.distributed.all_reduce (1 to {TORCH_TABLE_MAX_WORLD} processes)",
        markdown_table(_pivot(rows, TORCH_TABLE_MAX_WORLD), versus),
    ])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="numbers of worker processes, one spawned group each (default: %(default)s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000],
                        help="numbers of elements per tensor (default: %(default)s)")
    parser.add_argument("--algorithms", nargs="+", choices=tuple(ALGORITHMS), default=list(ALGORITHMS),
                        help="what to compare (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before them (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"), default="float32",
                        help="element type (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every rank's random data (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small fast subset for regenerating the report: {QUICK} (explicit flags win)")
    add_common_args(parser)
    parser.set_defaults(backend="gloo")  # the homework compares CPU speed; nccl allows one process per GPU only
    args = parser.parse_args(argv)
    if args.quick:  # the quick subset replaces the defaults; flags given explicitly still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if min(args.world_sizes) < 1 or min(args.sizes) < 0 or args.repeats < 1 or args.warmup < 0:
        parser.error("world sizes and --repeats must be at least 1, sizes and --warmup at least 0")
    return args


def main(args: argparse.Namespace) -> list[dict]:
    backend = resolve_backend(args.backend)
    if backend == "nccl" and max(args.world_sizes) > torch.cuda.device_count():
        raise SystemExit(f"nccl runs one process per GPU: world sizes above {torch.cuda.device_count()} need --backend gloo")
    device = "cuda" if backend == "nccl" else "cpu"
    env = environment(backend, device, max(args.world_sizes), threads=1, world_sizes=args.world_sizes)
    print(format_environment(env) + f"\n* world sizes {args.world_sizes}, sizes {args.sizes} elements of {args.dtype}",
          flush=True)
    rows = []
    for world_size in progress(args.world_sizes, desc="world sizes"):
        # A generous whole-group limit: 32 oversubscribed workers spend most of a minute importing torch.
        results = launch(compare_worker, world_size, args.sizes, args.algorithms, args.repeats, args.warmup, args.seed,
                         args.dtype, backend=backend, timeout_s=600 + 60 * world_size, pg_timeout_s=args.timeout)
        rows += results[0]
    print(report(rows), flush=True)
    if args.json:
        write_results(args.json, "allreduce", env, {k: v for k, v in vars(args).items() if k != "json"}, rows)
    return rows


if __name__ == "__main__":
    main(parse_args())
