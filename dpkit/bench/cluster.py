"""A latency-bandwidth model of data parallelism on a cluster: two link classes, inside a host and between hosts.

    from dpkit.bench.cluster import Link, Cluster, step_seconds, engines
    inside = Link.fit(sizes, seconds, ranks=2)          # e.g. this host's shared-memory all-reduce, measured
    network = Link.from_network(gbit_per_s=100, latency_s=10e-6)
    cluster = Cluster(hosts=16, ranks_per_host=8, inside=inside, between=network)
    step_seconds("hsdp", cluster, param_bytes=4 * 11_689_512, compute_s=0.050)

A message of b bytes over a link costs alpha + b * beta. A ring over n ranks takes n - 1 dependent steps
per half (reduce-scatter, all-gather), each moving 1/n of the buffer. Inside a host the ranks talk through
memory; between hosts every rank's traffic leaves through its host's network link, which the host's
ranks share: when all of them send at once, each gets 1/ranks_per_host of it. So:

* flat ring over all N = hosts x ranks ranks: 2(N-1) steps, each paced by the slower of its hops (one
  per host over the network, the rest over memory, all at once);
* hierarchical: a reduce-scatter inside the host, an all-reduce of each 1/L shard between hosts (all L
  shards at once, sharing the link), an all-gather inside the host.

Engines (``engines()``: every one in ``dpkit.engines.registry``, costed by what it shards), per step, from
the bytes of the parameters P and of the gradients G (= P): DDP all-reduces G;
ZeRO stage 1 all-reduces G then all-gathers P; stage 2 reduce-scatters G then all-gathers P (one all-reduce's
bytes); FSDP all-gathers P twice (forward, backward) and reduce-scatters G over all ranks; HSDP does those
inside a host and all-reduces each rank's 1/L of G between hosts. Collectives of an engine use the
hierarchical form when a host has several ranks; ``pieces`` cuts them into that many calls (buckets,
units), each paying the latency. Nothing overlaps with compute: on a CPU host the cores
that compute also move the bytes, and on a GPU cluster it makes these times an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpkit.engines import registry


def engines() -> tuple[str, ...]:
    """Every registered engine's name (``registry.names()``), read when called: a registered one appears."""
    return registry.names()


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha_s`` per dependent message, ``beta_s_per_byte`` per byte."""

    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def from_network(cls, gbit_per_s: float, latency_s: float) -> "Link":
        return cls(latency_s, 8 / (gbit_per_s * 1e9))

    @classmethod
    def fit(cls, sizes, seconds, ranks: int) -> "Link":
        """The link under a measured ring-like all-reduce of ``ranks`` ranks: least squares of relative error of
        seconds = 2(n-1) alpha + 2(n-1)/n bytes beta, both terms kept at zero or above."""
        sizes, seconds = np.asarray(sizes, float), np.asarray(seconds, float)
        terms = np.stack([np.full_like(sizes, 2 * (ranks - 1)), 2 * (ranks - 1) / ranks * sizes], axis=1)
        weighted = terms / seconds[:, None]  # relative: small sizes weigh as much as large ones
        alpha, beta = np.linalg.lstsq(weighted, np.ones_like(seconds), rcond=None)[0]
        if alpha < 0 or beta < 0:  # refit the other term alone
            only = 1 if alpha < 0 else 0
            value = np.linalg.lstsq(weighted[:, only:only + 1], np.ones_like(seconds), rcond=None)[0][0]
            alpha, beta = (0.0, value) if only == 1 else (value, 0.0)
        return cls(float(alpha), float(beta))

    def gbps(self) -> float | None:
        return 1e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None


@dataclass(frozen=True)
class Cluster:
    hosts: int
    ranks_per_host: int
    inside: Link
    between: Link

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host


def _ring_half(n: int, nbytes: float, link: Link, sharing: int = 1) -> float:
    """A reduce-scatter or an all-gather of an ``nbytes`` buffer over n ranks on ``link``, ``sharing`` rings
    at once on it."""
    return (n - 1) * (link.alpha_s + nbytes / n * sharing * link.beta_s_per_byte) if n > 1 else 0.0


def flat_ring(c: Cluster, nbytes: float, halves: int = 2) -> float:
    """A ring over every rank (``halves`` = 2: all-reduce, 1: reduce-scatter or all-gather). Across hosts each
    step has one hop per host over the network and the others over memory, all at once: the slower paces it."""
    step_inside = _ring_half(2, 2 * nbytes / c.ranks, c.inside)  # one step: alpha + (nbytes / ranks) beta
    step = max(step_inside, _ring_half(2, 2 * nbytes / c.ranks, c.between)) if c.hosts > 1 else step_inside
    return halves * (c.ranks - 1) * step


def hierarchical(c: Cluster, nbytes: float, halves: int = 2) -> float:
    """Inside each host the ``halves`` ring halves over its ranks; between hosts, the same halves on each
    1/L shard, all L shards of a host at once on its network link."""
    inside = halves * _ring_half(c.ranks_per_host, nbytes, c.inside)
    between = halves * _ring_half(c.hosts, nbytes / c.ranks_per_host, c.between, sharing=c.ranks_per_host)
    return inside + between


def collective(c: Cluster, nbytes: float, halves: int) -> float:
    """What an engine's collective costs: the hierarchical form where a host has several ranks, else the ring."""
    return hierarchical(c, nbytes, halves) if c.ranks_per_host > 1 and c.hosts > 1 else flat_ring(c, nbytes, halves)


def communication_seconds(engine: str, c: Cluster, param_bytes: float, pieces: int = 1) -> float:
    """Seconds of communication per step of ``engine`` (gradients as large as the parameters), its bytes cut
    into ``pieces`` collectives of each kind (DDP's and ZeRO's buckets, FSDP's units), each paying its
    latency."""
    grads, each = param_bytes / pieces, param_bytes / pieces
    found = registry.get(engine)  # an unknown name: a ValueError listing the registered ones
    if found.hybrid:
        one_host = Cluster(1, c.ranks_per_host, c.inside, c.between)
        inside = 2 * flat_ring(one_host, each, 1) + flat_ring(one_host, grads, 1)
        between = 2 * _ring_half(c.hosts, grads / c.ranks_per_host, c.between, sharing=c.ranks_per_host)
        return pieces * (inside + between)
    if found.shards == 0:  # DDP
        return pieces * collective(c, grads, 2)
    if found.shards == 1:
        return pieces * (collective(c, grads, 2) + collective(c, each, 1))
    if found.shards == 2:
        return pieces * (collective(c, grads, 1) + collective(c, each, 1))
    return pieces * (2 * collective(c, each, 1) + collective(c, grads, 1))  # 3: FSDP


def step_seconds(engine: str, c: Cluster, param_bytes: float, compute_s: float, pieces: int = 1) -> float:
    """One training step: ``compute_s`` (forward, backward, optimizer) plus the engine's communication."""
    return compute_s + communication_seconds(engine, c, param_bytes, pieces)
