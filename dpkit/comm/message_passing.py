"""Message passing: all-reduce over point-to-point messages only (``isend``/``irecv``/``batch_isend_irecv``),
and ``MessagePassing``, the transport ("p2p") that runs them.

    allreduce(t, "avg", group, algorithm="auto")    # or ring, butterfly, halving_doubling, ...
    t = MessagePassing(group, "ring")                # resolve("p2p:ring") makes the same

Every algorithm has the contract of ``torch.distributed.all_reduce``, ``f(tensor, op="avg", group=None)
-> tensor``: any world size, any number of elements, any dtype, contiguous or not; bad input is refused
before the first message. ``ring_allreduce``, ``butterfly_allreduce``, ``halving_doubling_allreduce``
(Rabenseifner), ``recursive_doubling_allreduce``, ``tree_allreduce`` (pipelined); ``allreduce`` runs
one by name, or "auto": the one ``CROSSOVER`` names for the size and world size (results/crossover.json,
which ``collectives_benchmark.py --tune`` writes, over ``DEFAULT_CROSSOVER``; read at auto's first use, not at
import). ``reduce_scatter`` and ``all_gather`` are the ring's two halves. The homework's script,
``allreduce.py``, compares them.
"""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dpkit import compat
from dpkit.comm.checks import OPS, bounds, check_input, check_sharded, group_rank
from dpkit.comm.interface import Transport
from dpkit.comm.process_groups import message_device


# Pipelining on gloo/CPU. A gloo point-to-point message costs far more than a step of gloo's own
# all-reduce (on few cores each dependent hop waits for a scheduler wake-up), so segments must be
# large, with several in flight. Tune them on a machine with
# ``collectives_benchmark.py --segment-bytes ... --in-flight ...`` (configurations interleaved call by call).
SEGMENT_BYTES = 4 << 20
IN_FLIGHT = 4
# The tree streams its two phases only when a tensor spans several segments, so its segments are
# smaller; compare settings with ``collectives_benchmark.py --algorithms tree --segment-bytes ...``.
TREE_SEGMENT_BYTES = 1 << 20


# --------------------------------------------------------------------------- the common frame


def _allreduce(tensor: torch.Tensor, op: str, group, algorithm: Callable[..., None], check: bool = False,
               **options) -> torch.Tensor:
    """Validate, handle the trivial cases, run ``algorithm(flat, rank, n, group)`` (a sum) on a contiguous 1-D view.

    The mean divides every rank's contribution by n BEFORE the sum, as ddp.py does: the sum of
    n float16 values near 65504 / n cannot overflow, where summing first would reach inf.
    """
    check_input(tensor, op)
    rank, n = group_rank(group)
    on_host = staged(tensor, group)
    if check and n > 1:
        _check_same_input(tensor, op, algorithm, group, rank, n, torch.device("cpu") if on_host else tensor.device)
    if tensor.numel() == 0 or n == 1:
        return tensor  # nothing to exchange; the mean of one rank is its own value
    # A non-contiguous tensor has no flat view: reduce a contiguous copy (numel extra elements), copy it back.
    work = _flat_work(tensor, on_host)
    with torch.no_grad():
        if op == "avg":
            work.div_(n)
        algorithm(work.view(-1), rank, n, group, **options)
        if work is not tensor:
            tensor.copy_(work)
    return tensor


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64)


def staged(tensor: torch.Tensor, group=None) -> bool:
    """Whether ``tensor``'s messages go through a host copy (``process_groups.message_device``)."""
    return message_device(tensor.device, group) != tensor.device


def _flat_work(tensor: torch.Tensor, to_host: bool) -> torch.Tensor:
    """A contiguous tensor the algorithm can view flat: ``tensor`` itself when it is one, else a copy (on the
    host when ``to_host``); the caller copies a copy back."""
    if to_host:
        return tensor.detach().to("cpu", memory_format=torch.contiguous_format)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _check_same_input(tensor: torch.Tensor, op: str, algorithm, group, rank: int, n: int,
                      wire: torch.device) -> None:
    """One small exchange before the data: every rank learns every rank's (numel, dtype, op, algorithm).

    Without it, mismatched sizes make gloo abort the receiving process with no Python traceback,
    and mismatched algorithms deadlock. Each rank writes its row of an (n, 4) int64 table of zeros;
    a recursive-doubling sum (exact in int64) gives every rank the whole table, so all ranks raise
    the same error, naming both sides, and none is left waiting. ``wire``: where the backend's messages
    live (CUDA with NCCL).
    """
    name = getattr(algorithm, "__name__", str(algorithm))
    row = [tensor.numel(), _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1, OPS.index(op),
           zlib.crc32(name.encode())]
    table = torch.zeros(n, 4, dtype=torch.int64, device=wire)
    table[rank] = torch.tensor(row, device=wire)
    _recursive_doubling(table.view(-1), rank, n, group)
    table = table.cpu()
    differs = [r for r in range(n) if not torch.equal(table[r], table[0])]
    if differs:
        def describe(r):
            numel, dtype, op_index, _ = table[r].tolist()
            kind = _DTYPES[dtype] if dtype >= 0 else "another dtype"
            return f"rank {r} has {numel} elements of {kind} (op={OPS[op_index]!r})"
        other = differs[0]
        what = "the same input" if not torch.equal(table[other, :3], table[0, :3]) else "the same algorithm"
        raise ValueError(f"all-reduce needs {what} on every rank: {describe(0)}, {describe(other)}"
                         + ("" if what == "the same input" else " but a different algorithm than rank 0"))


# --------------------------------------------------------------------------- pipelined exchanges


@dataclass
class _Tick:
    """One step of a pairwise exchange: send one piece to a peer, receive one piece from a peer.

    ``recv`` is where the received piece belongs: with ``reduce`` it arrives in a scratch
    buffer and is added there, otherwise it is received in place. ``needs`` is the index of the
    last tick that must be finished before this one is posted: the one that produced the
    data ``send`` reads. Either side may be None (an empty piece, or a one-way step).
    """

    send: torch.Tensor | None
    send_peer: int
    recv: torch.Tensor | None
    recv_peer: int
    reduce: bool
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
                    sends.append(dist.isend(ticks[next_send].send, group=self.group,
                                            group_dst=ticks[next_send].send_peer))
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


_SCRATCH = threading.local()  # .buffers: {(dtype, device, purpose): 1-D tensor}, one set per thread


def _scratch(like: torch.Tensor, rows: int, columns: int, purpose: str = "exchange") -> torch.Tensor:
    """A (rows, columns) view of this thread's scratch buffer for ``like``'s dtype and device and for ``purpose``
    (buffers used at the same time need different purposes), grown as needed.

    Kept from call to call, as gloo and NCCL keep their own buffers: a fresh buffer of a few MB
    is paid for again in page faults on first touch, a visible share of a large all-reduce. It
    holds ``in_flight`` segments of the largest call so far, O(numel / n); ``release_scratch()`` frees it.
    Per thread, so concurrent calls from two threads never share it.
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


def scratch_bytes() -> int:
    """Bytes of the calling thread's scratch buffers: what its calls keep from one call to the next."""
    return sum(t.numel() * t.element_size() for t in _SCRATCH.__dict__.get("buffers", {}).values())


def _segments(piece: torch.Tensor, count: int) -> list[torch.Tensor | None]:
    """``piece`` cut into ``count`` near-equal views; an empty one is None (nothing to send)."""
    b = bounds(piece.numel(), count)
    return [piece[b[i]:b[i + 1]] if b[i + 1] > b[i] else None for i in range(count)]


def _segment_count(numel: int, element_size: int, segment_bytes: int) -> int:
    return max(1, math.ceil(numel * element_size / max(1, segment_bytes)))


# --------------------------------------------------------------------------- ring


def _ring_ticks(flat: torch.Tensor, rank: int, n: int, segment_bytes: int) -> list[_Tick]:
    """Reduce-scatter then all-gather around the ring, each chunk cut into the same number of segments.

    Reduce-scatter step s (0..n-2): send chunk (rank - s), receive chunk (rank - s - 1) from the left
    and add it; after n-1 steps this rank holds the full sum of chunk (rank + 1). All-gather step s:
    send chunk (rank + 1 - s), receive chunk (rank - s) in place.
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
            else:
                send_chunk, recv_chunk = (rank + 1 - s) % n, (rank - s) % n
            for k in range(per_chunk):
                ticks.append(_Tick(segments[send_chunk][k], right, segments[recv_chunk][k], left,
                                   reduce=phase == "reduce-scatter", needs=len(ticks) - per_chunk))
    return ticks


def _ring(flat, rank, n, group, segment_bytes=SEGMENT_BYTES, in_flight=IN_FLIGHT) -> None:
    _Exchange(_ring_ticks(flat, rank, n, segment_bytes), group, in_flight).run()


def ring_allreduce(tensor: torch.Tensor, op: str = "avg", group=None, *, segment_bytes: int = SEGMENT_BYTES,
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


def _halving_doubling_ticks(flat: torch.Tensor, rank: int, n: int, segment_bytes: int) -> list[_Tick]:
    """Rabenseifner over the largest power of two p <= n, with the n - p extra ranks folded in.

    Fold: extra rank p + i sends its tensor to rank i, which adds it. Recursive halving: at
    distance d = p/2, ..., 1 a rank keeps the half of its current block range on its side of
    the partner (rank ^ d) and sends the other half, adding what it receives; afterwards rank
    r holds the sum of block r of p. Recursive doubling (d = 1, ..., p/2) swaps the ranges
    back in place. Unfold: rank i sends the result to rank p + i. Reduced pieces are segmented
    (bounded scratch, overlapped additions); each step waits for the previous one to finish.
    """
    p = 1 << (n.bit_length() - 1)
    ticks: list[_Tick] = []

    def exchange(send, recv, peer, reduce):
        largest = max(x.numel() if x is not None else 0 for x in (send, recv))
        count = _segment_count(largest, flat.element_size(), segment_bytes) if reduce else 1
        sends = _segments(send, count) if send is not None else [None] * count
        recvs = _segments(recv, count) if recv is not None else [None] * count
        start = len(ticks)
        for s, r in zip(sends, recvs):
            if s is not None or r is not None:
                ticks.append(_Tick(s, peer, r, peer, reduce, needs=start - 1))

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
                 reduce=True)
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


def _halving_doubling(flat, rank, n, group, segment_bytes=SEGMENT_BYTES, in_flight=IN_FLIGHT) -> None:
    _Exchange(_halving_doubling_ticks(flat, rank, n, segment_bytes), group, in_flight).run()


def halving_doubling_allreduce(tensor: torch.Tensor, op: str = "avg", group=None, *,
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


def _butterfly(flat: torch.Tensor, rank: int, n: int, group) -> None:
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
    gather = [dist.P2POp(dist.isend, own, group=group, group_peer=j) for j in peers if own.numel()]
    gather += [dist.P2POp(dist.irecv, chunks[j], group=group, group_peer=j) for j in peers if chunks[j].numel()]
    for work in (dist.batch_isend_irecv(gather) if gather else []):
        work.wait()


def butterfly_allreduce(tensor: torch.Tensor, op: str = "avg", group=None) -> torch.Tensor:
    """The homework's butterfly all-reduce, for tensors of any size, in place.

    Each rank sends 2(n-1)/n of the tensor like the ring, but as n-1 simultaneous messages per
    phase, and keeps all n-1 received chunks at once: (n-1)/n of the tensor in extra memory.
    """
    return _allreduce(tensor, op, group, _butterfly)


# --------------------------------------------------------------------------- recursive doubling


def pair_exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> None:
    """Send ``send`` to ``peer`` and receive ``recv`` from it at the same time; wait for both.

    gloo: the send is posted before the receive, which measured faster than the other order with
    processes sharing cores (the time is in the waits, not in Python). NCCL runs a pair's operations
    in order on one stream, so two ranks each sending first would wait for each other: there the
    pair is one ``batch_isend_irecv``.
    """
    if dist.get_backend(group) == dist.Backend.GLOO:
        works = [dist.isend(send, group=group, group_dst=peer), dist.irecv(recv, group=group, group_src=peer)]
    else:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, group=group, group_peer=peer),
                                        dist.P2POp(dist.isend, send, group=group, group_peer=peer)])
    for work in works:
        work.wait()  # the send too: the caller adds into ``send`` next


def _recursive_doubling(flat: torch.Tensor, rank: int, n: int, group) -> None:
    """log2(p) exchanges of the whole vector with partner rank ^ d, d = 1, 2, ..., p/2, adding each time.

    p is the largest power of two <= n; extra rank p + i first hands its vector to rank i (which
    adds it) and gets the result back at the end, as in halving-doubling. Partners add the same
    two values in either order, and addition is commutative, so all ranks hold the same bits.
    """
    p = 1 << (n.bit_length() - 1)
    if rank >= p:  # an extra rank: hand the tensor over, get the result back in place
        dist.isend(flat, group=group, group_dst=rank - p).wait()
        dist.irecv(flat, group=group, group_src=rank - p).wait()
        return
    received = _scratch(flat, 1, flat.numel())[0]
    if rank < n - p:
        dist.irecv(received, group=group, group_src=rank + p).wait()
        flat.add_(received)
    distance = 1
    while distance < p:
        pair_exchange(flat, received, rank ^ distance, group)
        flat.add_(received)
        distance *= 2
    if rank < n - p:
        dist.isend(flat, group=group, group_dst=rank + p).wait()


def recursive_doubling_allreduce(tensor: torch.Tensor, op: str = "avg", group=None) -> torch.Tensor:
    """Recursive doubling in place: log2(n) exchanges of the whole tensor (latency-optimal).

    With n a power of two each rank makes log2(n) dependent exchanges (the ring makes 2(n-1))
    but sends log2(n) whole tensors (the ring 2(n-1)/n of one): the choice for small messages.
    Otherwise the n - p ranks beyond the largest power of two p fold in first (two more steps).
    Extra memory: one tensor, in the scratch buffer kept for the next call.
    """
    return _allreduce(tensor, op, group, _recursive_doubling)


# --------------------------------------------------------------------------- tree


def _tree(flat: torch.Tensor, rank: int, n: int, group, segment_bytes: int = TREE_SEGMENT_BYTES,
          in_flight: int = IN_FLIGHT) -> None:
    """Pipelined binary-tree reduce to rank 0, then broadcast back down, segment by segment.

    The tree is a heap: the parent of rank r is (r - 1) // 2, its children 2r + 1 and 2r + 2.
    Reduce: a rank adds segment k of each child (received into one of ``in_flight`` scratch
    rows per child, posted ahead) to its own, then sends it up while segment k + 1 arrives.
    Broadcast: a rank receives segment k from its parent in place and sends it to its children.
    The broadcast receives are posted right after the last reduce send, so they wait for the
    data instead of the data waiting for them; on NCCL, whose pair operations run in order,
    that order also keeps each pair's sends and receives matched. Rank 0 makes the only sum
    of each segment and everyone receives a copy: all ranks hold the same bits.
    """
    parent = (rank - 1) // 2 if rank else None
    children = [child for child in (2 * rank + 1, 2 * rank + 2) if child < n]
    count = min(flat.numel(), _segment_count(flat.numel(), flat.element_size(), segment_bytes))
    segments = _segments(flat, count)
    depth = min(max(1, in_flight), count)
    # (depth x children, largest segment): segment k of child j arrives in row (k % depth) * len(children) + j.
    slots = _scratch(flat, depth * len(children), segments[0].numel()) if children else None

    def post_receives(k):
        rows = range((k % depth) * len(children), (k % depth + 1) * len(children))
        slices = [slots[row, :segments[k].numel()] for row in rows]
        return [(slot, dist.irecv(slot, group=group, group_src=child)) for slot, child in zip(slices, children)]

    sends, pending = [], deque(post_receives(k) for k in range(depth)) if children else deque()
    for k, segment in enumerate(segments):
        if children:
            for received, work in pending.popleft():
                work.wait()
                segment.add_(received)
            if k + depth < count:
                pending.append(post_receives(k + depth))  # into the rows segment k has just freed
        if parent is not None:
            sends.append(dist.isend(segment, group=group, group_dst=parent))
    receives = [] if parent is None else [dist.irecv(segment, group=group, group_src=parent) for segment in segments]
    for k, segment in enumerate(segments):
        if receives:
            receives[k].wait()
        sends += [dist.isend(segment, group=group, group_dst=child) for child in children]
    for work in sends:
        work.wait()


def tree_allreduce(tensor: torch.Tensor, op: str = "avg", group=None, *, segment_bytes: int = TREE_SEGMENT_BYTES,
                   in_flight: int = IN_FLIGHT) -> torch.Tensor:
    """Pipelined binary-tree reduce then broadcast in place (NCCL's choice for small and medium messages).

    2 floor(log2 n) dependent steps for one segment; with k segments of about ``segment_bytes``
    the two phases stream, about 2 (floor(log2 n) + k - 1) steps of numel / k elements. An inner
    rank receives two segments per step, so for large tensors the ring, which moves 2(n-1)/n of
    the tensor in total, wins. Extra memory: ``in_flight`` segments per child (at most two).
    """
    return _allreduce(tensor, op, group, _tree, segment_bytes=segment_bytes, in_flight=in_flight)


# --------------------------------------------------------------------------- automatic choice


# auto's table, per world size: ((largest message in bytes, algorithm), ...), the last bound None. Measured,
# so it lives in a results file: ``python collectives_benchmark.py --tune`` writes results/crossover.json on the
# machine it times (runs with more processes than cores order the algorithms under contention, not as they
# would on a cluster). A world size the file lacks, or a missing file, takes the row of DEFAULT_CROSSOVER,
# which an earlier --tune run on a 2-core machine gave. Read when auto first needs it (``crossover_for``), not at
# import: importing the package reads no results file.
# The checkout's results/ (beside the package), where the benchmark writes it.
CROSSOVER_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "results", "crossover.json")
DEFAULT_CROSSOVER: dict[int, tuple[tuple[int | None, str], ...]] = {
    2: ((8388608, "recursive_doubling"), (None, "halving_doubling")),
    3: ((131072, "tree"), (2097152, "recursive_doubling"), (None, "ring")),
    4: ((8388608, "tree"), (None, "ring")),
    8: ((8388608, "tree"), (None, "halving_doubling")),
}


def crossover_rows(table: dict[int, tuple], device: str = "cpu") -> list[dict]:
    """A crossover table as the rows of its results file: one per (world size, bound, algorithm), in order,
    each naming the device type it was measured on."""
    return [{"world_size": n, "up_to_bytes": bound, "algorithm": name, "device": device}
            for n, entries in table.items() for bound, name in entries]


def load_crossover(path: str = CROSSOVER_FILE, device: str = "cpu") -> dict[int, tuple]:
    """The table for tensors on ``device`` (a device type): on the CPU, ``DEFAULT_CROSSOVER`` with every world
    size of the results file ``path`` taken from the file (no file: the defaults); on a GPU only what the file
    measured there (often nothing: auto then takes PyTorch's collective). ValueError, naming the file, for an
    unknown algorithm or a row without an open end."""
    table = dict(DEFAULT_CROSSOVER) if device == "cpu" else {}
    if not os.path.exists(path):
        return table
    rows = [row for row in _stored_rows(path) if row.get("device", "cpu") == device]
    for n in sorted({row["world_size"] for row in rows}):
        entries = tuple((row["up_to_bytes"], row["algorithm"]) for row in rows if row["world_size"] == n)
        unknown = sorted({name for _, name in entries} - set(SUMS))
        if unknown or entries[-1][0] is not None:
            raise ValueError(f"{path}: the row of {n} processes " + (f"names unknown algorithms {unknown}" if unknown
                             else "has no open-ended last entry") + ": run `python collectives_benchmark.py --tune` "
                                                                    "again")
        table[n] = entries
    return table


def _stored_rows(path: str) -> list[dict]:
    """The rows of a results file (``dpkit.bench.results``' layout, read here without it: comm sits below bench)."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise ValueError(f"{path}: not a results file (it holds no list of results): run "
                         "`python collectives_benchmark.py --tune` again")
    return doc["results"]


def _nearest_world_size(world_size: int, table: dict, warn: bool = True) -> int:
    """The measured world size closest to ``world_size`` on a log scale (the smaller one on a tie)."""
    if world_size in table:
        return world_size
    nearest = min(table, key=lambda k: (abs(math.log2(k) - math.log2(world_size)), k))
    if warn and (world_size, nearest) not in _WARNED:
        _WARNED.add((world_size, nearest))
        warnings.warn(f"allreduce(algorithm='auto'): no crossover measured for {world_size} processes; using the "
                      f"table of {nearest} (re-derive it with: python collectives_benchmark.py --tune --procs "
                      f"{world_size})",
                      stacklevel=3)
    return nearest


_WARNED: set[tuple[int, int]] = set()


def reset_warnings() -> None:
    """Forget which world sizes ``choose_algorithm`` has warned about (it warns once per process for each)."""
    _WARNED.clear()


def choose_algorithm(nbytes: int, world_size: int, table: dict | None = None, warn: bool = True) -> str:
    """The algorithm ``allreduce(algorithm="auto")`` runs for a message of ``nbytes`` on ``world_size`` ranks.

    ``table`` (default ``CROSSOVER``) maps a world size to ((largest message in bytes, algorithm), ...),
    the last bound None. A world size it lacks uses the nearest measured one, with a warning once
    per process (``allreduce`` lets only group rank 0 warn).
    """
    table = crossover_for("cpu") if table is None else table
    for bound, name in table[_nearest_world_size(world_size, table, warn)]:
        if bound is None or nbytes <= bound:
            return name
    raise ValueError(f"crossover table for {world_size} processes has no open-ended last entry")


def allreduce(tensor: torch.Tensor, op: str = "avg", group=None, algorithm: str = "auto", *,
              check: bool = False) -> torch.Tensor:
    """All-reduce in place with the algorithm of ``algorithm``, or for ``"auto"`` the one measured fastest
    on this machine for the tensor's size in bytes and the group's size (``choose_algorithm``).

    ``op="avg"`` divides every contribution by the group size before the sum (so a float16
    mean overflows only if the mean does). With ``check=True`` the ranks first exchange their
    numel, dtype, op and algorithm (one small recursive-doubling exchange of 4 int64 per rank)
    and all raise ``ValueError`` naming both sides if any differs, instead of gloo aborting the
    process or the ranks waiting for each other. Every rank must call it with the same arguments.
    """
    if algorithm != "auto" and algorithm not in SUMS:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of {', '.join(('auto', *SUMS))}")
    check_input(tensor, op)
    rank, n = group_rank(group)
    if algorithm == "auto":
        algorithm = auto_algorithm(tensor, group)
        if algorithm == "torch":
            return torch_allreduce(tensor, op, group)
    return _allreduce(tensor, op, group, SUMS[algorithm], check=check)


def auto_algorithm(tensor: torch.Tensor, group=None) -> str:
    """What ``allreduce(algorithm="auto")`` runs for ``tensor``: ``choose_algorithm`` for its size in bytes and
    the group's size, from the table measured on its device type. A GPU without one takes "torch"
    (``torch.distributed.all_reduce``: NCCL's tuned collectives), and group rank 0 says so once.
    (Shared memory is not an algorithm but a transport: ``transport.SharedMemory``.)"""
    rank, n = group_rank(group)
    nbytes = tensor.numel() * tensor.element_size()
    if n == 1 or nbytes == 0:
        return "recursive_doubling"  # nothing is exchanged
    table = crossover_for(tensor.device.type)
    if not table:
        if rank == 0 and (0, tensor.device.type) not in _WARNED:
            _WARNED.add((0, tensor.device.type))
            warnings.warn(f"allreduce(algorithm='auto'): no crossover measured on {tensor.device.type}, so "
                          f"torch.distributed.all_reduce ({dist.get_backend(group)}) sums {tensor.device.type} "
                          f"tensors (measure one with: python collectives_benchmark.py --tune --device "
                          f"{tensor.device.type})", stacklevel=3)
        return "torch"
    return choose_algorithm(nbytes, n, table, warn=rank == 0)


_CROSSOVERS: dict[str, dict] = {}  # device type other than the CPU -> its table, read at first use
_CROSSOVER_READ = threading.Lock()  # two threads' first auto calls read the file once


def crossover_for(device: str) -> dict[int, tuple]:
    """auto's table for tensors on ``device`` (a device type), read from ``CROSSOVER_FILE`` the first time it is
    needed and kept: on the CPU it is ``CROSSOVER`` (which a test may set to its own table), else ``_CROSSOVERS``."""
    global CROSSOVER
    with _CROSSOVER_READ:
        if device != "cpu":
            if device not in _CROSSOVERS:
                _CROSSOVERS[device] = load_crossover(CROSSOVER_FILE, device)
            return _CROSSOVERS[device]
        try:
            return CROSSOVER
        except NameError:  # auto's first use on the CPU
            CROSSOVER = load_crossover(CROSSOVER_FILE)
            return CROSSOVER


def __getattr__(name: str):
    """``CROSSOVER`` (what auto uses on the CPU), read at its first use, ``from ... import CROSSOVER`` included."""
    if name == "CROSSOVER":
        return crossover_for("cpu")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- reference


def torch_allreduce(tensor: torch.Tensor, op: str = "avg", group=None) -> torch.Tensor:
    """``torch.distributed.all_reduce`` with the same contract (gloo has no AVG: divide by n, then sum)."""
    check_input(tensor, op)
    if op == "avg":
        tensor.div_(dist.get_world_size(group))
    dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group)
    return tensor


ALGORITHMS: dict[str, Callable[..., torch.Tensor]] = {
    "torch": torch_allreduce,
    "ring": ring_allreduce,
    "butterfly": butterfly_allreduce,
    "halving_doubling": halving_doubling_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
    "tree": tree_allreduce,
    "auto": allreduce,
}
# The point-to-point algorithms as ``allreduce(algorithm=...)`` runs them: f(flat, rank, n, group) sums in place.
SUMS: dict[str, Callable[..., None]] = {"ring": _ring, "butterfly": _butterfly, "halving_doubling": _halving_doubling,
                                          "recursive_doubling": _recursive_doubling, "tree": _tree}
# The homework's own algorithms (every one but torch's and auto's mix of them), in the order tables show them.
CUSTOM = tuple(SUMS)


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


def _sharded(output: torch.Tensor, input: torch.Tensor, run: Callable[[torch.Tensor, torch.Tensor], None],
             group=None) -> torch.Tensor:
    """Run ``run(flat_output, flat_input)`` on contiguous 1-D views; a non-contiguous output is filled in a copy
    (so is a CUDA one over gloo: ``staged``)."""
    on_host = staged(output, group)
    work = _flat_work(output, on_host)
    with torch.no_grad():
        run(work.view(-1), _flat_work(input, on_host).view(-1))  # a non-contiguous input is read through a copy
        if work is not output:
            output.copy_(work)
    return output


def _reduce_scatter_ticks(out: torch.Tensor, chunks: list[torch.Tensor], rank: int, n: int, op: str,
                          segment_bytes: int) -> list[_ContributingTick]:
    """The ring's reduce-scatter: at step s rank r sends its partial sum of chunk r-s-1 to the right
    and adds its own part of chunk r-s-2 to the partial sum arriving from the left; after n-1 steps
    the partial sum of chunk r, arrived last, is the whole sum. Partial sums in transit live in
    n-2 scratch rows (one more for the mean's divided first send), the last one in ``out``."""
    m, scale = out.numel(), n if op == "avg" else None
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
            ticks.append(_ContributingTick(send, (rank + 1) % n, recv, (rank - 1) % n, reduce=True,
                                           needs=len(ticks) - per_chunk, own=own, scale=scale))
        sent = _segments(slots[received], per_chunk)
    return ticks


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "avg", group=None, *,
                   segment_bytes: int = SEGMENT_BYTES, in_flight: int = IN_FLIGHT) -> torch.Tensor:
    """Ring reduce-scatter: group rank r's ``output`` becomes chunk r of the sum (or mean) of every rank's ``input``.

    The contract of ``torch.distributed.reduce_scatter_tensor`` (``reduce_scatter_single``):
    ``input.numel() == world size x output.numel()``, chunk r being ``input.view(-1)[r m:(r+1) m]``
    with m = ``output.numel()`` (a caller with a length not divisible by the world size pads it, as
    with torch). ``input`` is not modified; ``output`` may be ``input``'s own chunk r (in place).
    ``op="avg"`` divides every contribution by the world size before adding (no float16 overflow).

    Each rank sends n-1 chunks, (n-1)/n of the input (half an all-reduce), in pipelined segments of
    about ``segment_bytes``. Extra memory: n-2 chunks of partial sums (n-1 for the mean) and
    ``in_flight`` segments, kept for the next call like the ring's scratch (``release_scratch()``).
    """
    rank, n = check_sharded(output, input, op, group, gathering=False)

    def run(out: torch.Tensor, flat: torch.Tensor) -> None:
        if out.numel() == 0:
            return
        chunks = flat.view(n, -1).unbind(0)  # (n, m): chunk j is what rank j ends with
        if n == 1:
            _contribute(out, chunks[0], None)  # the mean of one rank is its own value
            return
        ticks = _reduce_scatter_ticks(out, chunks, rank, n, op, segment_bytes)
        _ContributingExchange(ticks, group, in_flight).run()

    return _sharded(output, input, run, group)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, *, segment_bytes: int = SEGMENT_BYTES,
               in_flight: int = IN_FLIGHT) -> torch.Tensor:
    """Ring all-gather: ``output`` becomes every group rank's ``input``, concatenated in rank order.

    The contract of ``torch.distributed.all_gather_into_tensor`` (``all_gather_single``):
    ``output.numel() == world size x input.numel()``; ``input`` may be ``output``'s own chunk r (in
    place). At step s rank r forwards chunk r-s to the right and receives chunk r-s-1 in place from
    the left: each rank sends n-1 chunks, (n-1)/n of the output, in pipelined segments, with no
    extra memory (plus a copy of a non-contiguous output or input).
    """
    rank, n = check_sharded(output, input, "sum", group, gathering=True)

    def run(out: torch.Tensor, flat: torch.Tensor) -> None:
        if out.numel() == 0:
            return
        chunks = out.view(n, -1).unbind(0)
        if flat.data_ptr() != chunks[rank].data_ptr():
            chunks[rank].copy_(flat)
        per_chunk = min(flat.numel(), _segment_count(flat.numel(), out.element_size(), segment_bytes))
        ticks = []
        for s in range(n - 1):
            sends = _segments(chunks[(rank - s) % n], per_chunk)
            recvs = _segments(chunks[(rank - s - 1) % n], per_chunk)
            for send, recv in zip(sends, recvs):
                ticks.append(_Tick(send, (rank + 1) % n, recv, (rank - 1) % n, reduce=False,
                                   needs=len(ticks) - per_chunk))
        _Exchange(ticks, group, in_flight).run()

    return _sharded(output, input, run, group)


def torch_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "avg", group=None) -> torch.Tensor:
    """``torch.distributed.reduce_scatter_single`` (formerly ``reduce_scatter_tensor``) with the same contract:
    gloo has no AVG, so the mean is the sum divided once."""
    check_sharded(output, input, op, group, gathering=False)
    compat.reduce_scatter_single(output, input, dist.ReduceOp.SUM, group=group)
    if op == "avg":
        output.div_(dist.get_world_size(group))
    return output


def torch_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """``torch.distributed.all_gather_single`` (formerly ``all_gather_into_tensor``) with the same contract."""
    check_sharded(output, input, "sum", group, gathering=True)
    compat.all_gather_single(output, input, group=group)
    return output


# name -> f(output, input, op, group) and f(output, input, group)
REDUCE_SCATTERS: dict[str, Callable[..., torch.Tensor]] = {"torch": torch_reduce_scatter, "ring": reduce_scatter}
ALL_GATHERS: dict[str, Callable[..., torch.Tensor]] = {"torch": torch_all_gather, "ring": all_gather}


# --------------------------------------------------------------------------- as a transport


class MessagePassing(Transport):
    """These algorithms as a transport any engine takes: ``algorithm`` for the all-reduce ("auto": by size and
    world size from ``CROSSOVER``), the ring for reduce-scatter and all-gather. Also made by name:
    ``resolve("p2p")`` or ``"p2p:<algorithm>"`` (``registry``)."""

    name = "p2p"

    def __init__(self, group=None, algorithm: str = "auto", *, background: bool = False):
        if algorithm != "auto" and algorithm not in SUMS:
            raise ValueError(f"unknown algorithm {algorithm!r}: choose one of auto, {', '.join(SUMS)}")
        super().__init__(group, background=background)
        self.algorithm = algorithm

    def _group(self):
        return self._comm.group if self._comm is not None else self.group

    def _all_reduce(self, flat, op):
        allreduce(flat, op, self._group(), self.algorithm)

    def _reduce_scatter(self, out, flat, op):
        reduce_scatter(out, flat, op, self._group())

    def _all_gather(self, out, flat):
        all_gather(out, flat, self._group())

    def describe(self) -> str:
        return f"p2p ({self.algorithm})"
