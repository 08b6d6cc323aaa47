"""Hierarchical collectives for a group that spans hosts: shared memory inside each host, the network between.

    from dpkit.comm.hierarchical import Hierarchical
    t = Hierarchical(group)                     # what transport.resolve("auto") picks when hosts hold 2+ ranks
    t = Hierarchical(group, outer=transport.factory("p2p:ring"))   # between hosts: any factory(group)
    t.all_reduce(flat, op="avg")               # also reduce_scatter and all_gather (torch.distributed's)

An all-reduce of N elements, the largest host holding L ranks: every host cuts the data into L
shards; inside each host a reduce-scatter through the host's shared memory leaves each rank its
shard summed over the host; the ranks that serve the same shard on every host all-reduce it among
themselves (``torch.distributed`` by default); inside each host an all-gather hands every rank the
whole. Over H hosts, a rank sends 2 (H - 1) / H of its shard (about N / L elements) between hosts
through a ring, beside its host's other ranks. On a host with fewer ranks a rank serves several
shards, one after the other in shard order, as every rank does, so no two ranks wait for each other
in a cycle (``Plan``). ``reduce_scatter`` and ``all_gather`` go the same way, each rank's own chunk
crossing hosts in the group of its first shard.

The subgroups (one per host, one per shard) are made by their members only, so the group may be any
subset of the world. A host whose ranks cannot map one shared file computes through
``torch.distributed`` inside it: group rank 0 warns once, and ``describe`` says so on every rank.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dpkit.comm.comm_thread import group_timeout
from dpkit.comm.hosts import host_indices, ranks_by_host
from dpkit.comm.process_groups import DEFAULT_TIMEOUT_S, new_subgroups
from dpkit.comm.interface import Transport
from dpkit.comm.shared_memory import NotOneHost, SharedMemory
from dpkit.comm.torch_transport import Torch


class Plan:
    """Who serves which shard. ``hosts``: the group ranks on each host; ``global_ranks``: each group rank's
    global rank. A host's ranks are ordered by global rank (``local``), as ``new_group`` orders them.

    The data is cut into ``slots`` shards, as many as the largest host has ranks. Local rank i of a host
    of L ranks serves slots [first(h, i), first(h, i + 1)), first(h, i) = ceil(i slots / L): at least one,
    at most ``width(h)``. Slot j's outer group is the rank serving it on each host, ordered by global rank.
    A rank's first slot is its home, where its own chunk of a reduce-scatter or all-gather crosses hosts.
    """

    def __init__(self, hosts: Sequence[Sequence[int]], global_ranks: Sequence[int]):
        self.global_ranks = tuple(global_ranks)
        self.hosts = tuple(tuple(sorted(members, key=self.global_ranks.__getitem__)) for members in hosts)
        self.slots = max(len(members) for members in self.hosts)
        self.host_of = {r: h for h, members in enumerate(self.hosts) for r in members}
        self.local_of = {r: i for members in self.hosts for i, r in enumerate(members)}

    def first(self, h: int, i: int) -> int:
        return -(-i * self.slots // len(self.hosts[h]))

    def served(self, h: int, i: int) -> range:
        """The slots local rank i of host h serves, in the order every rank takes them."""
        return range(self.first(h, i), self.first(h, i + 1))

    def width(self, h: int) -> int:
        """The most slots a rank of host h serves: every rank's block of host h's buffers holds this many."""
        return -(-self.slots // len(self.hosts[h]))

    def outer(self, j: int) -> list[int]:
        """The group ranks of slot j's outer group, one per host, in the group's rank order."""
        servers = [members[j * len(members) // self.slots] for members in self.hosts]
        return sorted(servers, key=self.global_ranks.__getitem__)

    def rows(self, h: int) -> list[int]:
        """Where each group rank's chunk lies in host h's buffer of a reduce-scatter or all-gather: a block of
        ``width(h)`` slots per local rank, a row per member of the slot's outer group (its position there)."""
        found = []
        for r in range(len(self.global_ranks)):
            home = self.first(self.host_of[r], self.local_of[r])
            server = self.local_of[self.hosts[h][home * len(self.hosts[h]) // self.slots]]
            position = [self.host_of[peer] for peer in self.outer(home)].index(self.host_of[r])
            found.append((server * self.width(h) + home - self.first(h, server)) * len(self.hosts) + position)
        return found


def host_subgroups(plan: "Plan", parent, timeout_s: float) -> list:
    """``new_subgroups`` for ``plan``: one group per host (index h), then one per slot, the ranks serving it on
    every host (index ``len(plan.hosts) + j``); this rank's groups, None for the others (a collective)."""
    lists = [[plan.global_ranks[r] for r in members] for members in plan.hosts]
    lists += [[plan.global_ranks[r] for r in plan.outer(j)] for j in range(plan.slots)]
    return new_subgroups(parent, lists, timeout_s)


class Hierarchical(Transport):
    """Collectives over a group that spans hosts (CPU tensors): inside a host through its shared memory,
    between hosts through ``outer(group)`` (a factory: ``Torch``, or ``registry.factory(name)`` for a transport
    by name) among the ranks that serve the same shard. A collective to make: every rank of the group calls it alike.
    ``close`` closes the inner and outer transports and destroys the subgroups."""

    name = "hierarchical"

    def __init__(self, group=None, *, outer: Callable[..., Transport] = Torch):
        if isinstance(outer, Transport) or not callable(outer):
            raise TypeError(f"Hierarchical's outer must be a factory(group) -> Transport (one transport per shard's "
                            f"group is made; transport.factory(name) makes one by name), got a {type(outer).__name__}")
        super().__init__(group)
        self.inner: Transport | None = None
        self.outer: list[tuple[int, Transport]] = []  # (slot, its transport), in slot order
        self.subgroups: list = []
        self.plan = Plan(ranks_by_host(host_indices(group)), self.ranks)
        self.host, self.local = self.plan.host_of[self.rank], self.plan.local_of[self.rank]
        self._connect(outer)
        self.rows = self.plan.rows(self.host)
        total = len(self.plan.hosts[self.host]) * self.plan.width(self.host) * len(self.plan.hosts)
        self.blank_rows = sorted(set(range(total)) - set(self.rows))
        self._summary = self._agree()

    def _connect(self, outer) -> None:
        """Make the subgroups, this host's shared memory and this rank's outer transports (collective)."""
        plan, parent = self.plan, self.group if self.group is not None else dist.group.WORLD
        made = host_subgroups(plan, parent, group_timeout(parent, torch.device("cpu")) or DEFAULT_TIMEOUT_S)
        self.subgroups = [g for g in made if g is not None]
        try:
            self.inner = SharedMemory(made[self.host])
        except NotOneHost:
            self.inner = Torch(made[self.host])
        for j in plan.served(self.host, self.local):
            group = made[len(plan.hosts) + j]
            self.outer.append((j, outer(group)))

    def _agree(self) -> str:
        """Every rank learns which hosts went through torch inside and what carries the data between hosts:
        ``describe`` is then the same on every rank (resolve compares it), and group rank 0 warns once."""
        mine = (self.host, isinstance(self.inner, Torch), self.outer[0][1].describe())
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        fell_back = sorted({host for host, through_torch, _ in everyone if through_torch})
        between = " / ".join(sorted({d for _, _, d in everyone}))
        sizes = "+".join(str(len(members)) for members in self.plan.hosts)
        inside = "shared_memory" + (f", hosts {fell_back} through torch" if fell_back else "")
        if fell_back and self.rank == 0:
            warnings.warn(f"the hierarchical transport over ranks {self.ranks} goes through torch.distributed "
                          f"inside hosts {fell_back}: their ranks cannot map one shared file (not one host, or "
                          "no common /dev/shm)", RuntimeWarning, stacklevel=3)
        return f"hierarchical ({sizes} ranks on {len(self.plan.hosts)} hosts; inside: {inside}; between: {between})"

    def supports(self, device) -> bool:
        return (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cpu"

    def describe(self) -> str:
        return getattr(self, "_summary", self.name)

    def held_bytes(self) -> int:
        """What its transports inside the host and between hosts hold (the shared memory's staging block)."""
        return sum(t.held_bytes() for t in [self.inner, *(t for _, t in self.outer)] if t is not None)

    def close(self) -> None:
        if self._closed:
            return
        for transport in [self.inner, *(t for _, t in self.outer)]:
            if transport is not None:
                transport.close()
        if dist.is_initialized():
            for group in self.subgroups:
                dist.destroy_process_group(group)
        self.subgroups = []
        super().close()

    # ---- the three collectives, on contiguous 1-D tensors

    def _all_reduce(self, flat, op):
        plan, h, numel = self.plan, self.host, flat.numel()
        size = -(-numel // plan.slots)  # elements per shard; the last shards may be short, or empty
        divisor = self.world_size if op == "avg" else None  # the mean divides every contribution first
        blocks = self.inner.allocate((len(plan.hosts[h]), plan.width(h) * size), dtype=flat.dtype)
        for s, block in enumerate(blocks):  # a block per local rank: its shards, then zeros
            part = _shards(flat, plan.served(h, s), size)
            _put(block[:part.numel()], part, divisor)
            block[part.numel():].zero_()
        mine = blocks[self.local]
        self.inner.reduce_scatter(mine, blocks.view(-1), "sum")
        for t, (j, between) in enumerate(self.outer):
            length = _shards(flat, range(j, j + 1), size).numel()
            if length:  # every host knows the shard's length: all skip an empty one alike
                self._through(between.all_reduce, mine[t * size:t * size + length])
        self.inner.all_gather(blocks.view(-1), mine)
        for s, block in enumerate(blocks):
            part = _shards(flat, plan.served(h, s), size)
            part.copy_(block[:part.numel()])

    def _reduce_scatter(self, out, flat, op):
        m, hosts = out.numel(), len(self.plan.hosts)
        divisor = self.world_size if op == "avg" else None
        rows = self._rows(m, flat.dtype)
        for r, chunk in enumerate(flat.view(self.world_size, m)):
            _put(rows[self.rows[r]], chunk, divisor)
        mine = self._block(rows)
        self.inner.reduce_scatter(mine.view(-1), rows.view(-1), "sum")
        for t, (_, between) in enumerate(self.outer):  # the first slot is this rank's home: its own chunk
            source = mine[t * hosts:(t + 1) * hosts].view(-1)
            source = source.clone() if self.inner.owns(source) else source  # the outer transport's own memory
            between.reduce_scatter(out if t == 0 else torch.empty_like(out), source, "sum")

    def _all_gather(self, out, flat):
        m, hosts = flat.numel(), len(self.plan.hosts)
        rows = self._rows(m, flat.dtype)
        mine = self._block(rows)
        for t, (_, between) in enumerate(self.outer):  # this rank's chunk crosses at its home, zeros elsewhere
            gathered = torch.empty(hosts * m, dtype=flat.dtype)
            between.all_gather(gathered, flat if t == 0 else torch.zeros_like(flat))
            mine[t * hosts:(t + 1) * hosts].copy_(gathered.view(hosts, m))
        mine[len(self.outer) * hosts:].zero_()
        self.inner.all_gather(rows.view(-1), mine.view(-1))
        for r, chunk in enumerate(out.view(self.world_size, m)):
            chunk.copy_(rows[self.rows[r]])

    # ---- helpers

    def _rows(self, m: int, dtype: torch.dtype) -> torch.Tensor:
        """Host buffer for a reduce-scatter or all-gather of chunks of m elements: one row per chunk position,
        the rows no rank's chunk takes zeroed."""
        count = len(self.rows) + len(self.blank_rows)
        rows = self.inner.allocate((count, m), dtype=dtype)
        for row in self.blank_rows:
            rows[row].zero_()
        return rows

    def _block(self, rows: torch.Tensor) -> torch.Tensor:
        per_rank = self.plan.width(self.host) * len(self.plan.hosts)
        return rows[self.local * per_rank:(self.local + 1) * per_rank]

    def _through(self, collective: Callable, piece: torch.Tensor) -> None:
        """``collective(piece, "sum")`` on the outer transport, through a plain copy if ``piece`` lies in the
        inner transport's memory (a transport refuses another one's buffers)."""
        plain = piece.clone() if self.inner.owns(piece) else piece
        collective(plain, "sum")
        if plain is not piece:
            piece.copy_(plain)


def _shards(flat: torch.Tensor, slots: range, size: int) -> torch.Tensor:
    """The elements of shards ``slots`` (``size`` each, cut short at the end of ``flat``)."""
    numel = flat.numel()
    return flat[min(slots.start * size, numel):min(slots.stop * size, numel)]


def _put(target: torch.Tensor, source: torch.Tensor, divisor: int | None) -> None:
    if divisor is None:
        target.copy_(source)
    else:
        torch.div(source, divisor, out=target)
