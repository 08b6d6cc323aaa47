"""The cluster model (dpkit/bench/cluster.py): its algebra against hand-derived costs."""

import math

import numpy as np
import pytest

from dpkit.bench import cluster
from dpkit.bench.cluster import Cluster, Link

INSIDE, NETWORK = Link(2e-6, 1e-10), Link.from_network(gbit_per_s=100, latency_s=10e-6)
MiB = 2 ** 20


def test_a_network_link_is_its_stated_latency_and_bandwidth():
    assert NETWORK.alpha_s == 10e-6 and NETWORK.beta_s_per_byte == pytest.approx(8 / 100e9)
    assert NETWORK.gbps() == pytest.approx(12.5)


def test_fitting_a_measured_ring_recovers_its_latency_and_bandwidth():
    sizes = np.array([4e3, 64e3, 1e6, 1e7, 1e8])
    for ranks in (2, 4):
        seconds = 2 * (ranks - 1) * 3e-5 + 2 * (ranks - 1) / ranks * sizes * 2e-10
        fitted = Link.fit(sizes, seconds, ranks)
        assert fitted.alpha_s == pytest.approx(3e-5, rel=1e-6)
        assert fitted.beta_s_per_byte == pytest.approx(2e-10, rel=1e-6)


def test_a_fit_never_gives_a_negative_term():
    fitted = Link.fit([1e3, 1e6], [2e-3, 1e-3], ranks=2)  # faster when larger: a negative beta, unconstrained
    assert fitted.beta_s_per_byte == 0 and fitted.alpha_s > 0


def test_one_host_is_a_ring_over_memory():
    c = Cluster(1, 4, INSIDE, NETWORK)
    step = INSIDE.alpha_s + 25 * MiB * INSIDE.beta_s_per_byte  # a quarter of the message over one link
    assert cluster.flat_ring(c, 100 * MiB) == pytest.approx(2 * 3 * step)
    assert cluster.collective(c, 100 * MiB, 2) == cluster.flat_ring(c, 100 * MiB)


@pytest.mark.parametrize("hosts, per_host", [(2, 8), (16, 8), (64, 4)])
def test_hierarchical_sends_each_hosts_share_across_the_network_once_per_half(hosts, per_host):
    c = Cluster(hosts, per_host, INSIDE, Link(0.0, NETWORK.beta_s_per_byte))
    inside_only = cluster.hierarchical(Cluster(1, per_host, INSIDE, NETWORK), 100 * MiB)
    network = cluster.hierarchical(c, 100 * MiB) - inside_only
    # Each host's link carries (hosts - 1) / hosts of the buffer, twice (the two halves), in all its ranks' shards.
    assert network == pytest.approx(2 * (hosts - 1) / hosts * 100 * MiB * NETWORK.beta_s_per_byte)


def test_the_flat_ring_pays_the_network_latency_at_every_one_of_its_steps():
    c = Cluster(16, 8, INSIDE, Link(NETWORK.alpha_s, 0.0))
    assert cluster.flat_ring(c, 1024) == pytest.approx(2 * (c.ranks - 1) * NETWORK.alpha_s)
    assert cluster.hierarchical(c, 1024) < cluster.flat_ring(c, 1024) / 5  # 2(hosts-1) network steps instead


@pytest.mark.parametrize("hosts", (1, 2, 8, 64))
def test_zero_stage_2_moves_one_all_reduces_bytes_and_stage_1_half_as_much_again(hosts):
    c = Cluster(hosts, 8, Link(0.0, INSIDE.beta_s_per_byte), Link(0.0, NETWORK.beta_s_per_byte))
    ddp, zero1, zero2 = (cluster.communication_seconds(e, c, 100 * MiB) for e in ("ddp", "zero1", "zero2"))
    assert zero2 == pytest.approx(ddp) and zero1 == pytest.approx(1.5 * ddp)


def test_hsdp_gathers_parameters_inside_the_host_and_sends_only_gradients_between_hosts():
    c = Cluster(8, 8, Link(0.0, INSIDE.beta_s_per_byte), Link(0.0, NETWORK.beta_s_per_byte))
    p = 100 * MiB
    one_host = cluster.communication_seconds("fsdp", Cluster(1, 8, c.inside, c.between), p)
    between = cluster.communication_seconds("hsdp", c, p) - one_host
    assert between == pytest.approx(2 * 7 / 8 * p * NETWORK.beta_s_per_byte)  # an all-reduce of G between hosts
    assert cluster.communication_seconds("hsdp", c, p) < cluster.communication_seconds("fsdp", c, p)


def test_a_step_is_compute_plus_communication_and_unknown_engines_are_named():
    c = Cluster(2, 2, INSIDE, NETWORK)
    communication = cluster.communication_seconds("ddp", c, MiB)
    assert cluster.step_seconds("ddp", c, MiB, 0.25) == pytest.approx(0.25 + communication)
    with pytest.raises(ValueError, match="unknown engine 'zero3'"):
        cluster.communication_seconds("zero3", c, MiB)
    assert math.isfinite(cluster.step_seconds("hsdp", Cluster(64, 8, INSIDE, NETWORK), 500 * MiB, 0.1))


def test_a_flat_ring_across_hosts_is_paced_by_its_slower_hop():
    slow_memory = Link(0.0, 10 * NETWORK.beta_s_per_byte)
    c = Cluster(4, 2, slow_memory, Link(0.0, NETWORK.beta_s_per_byte))
    assert cluster.flat_ring(c, 80 * MiB) == pytest.approx(2 * 7 * 10 * MiB * slow_memory.beta_s_per_byte)


@pytest.mark.parametrize("engine", cluster.engines())
def test_cutting_an_engines_bytes_into_pieces_adds_only_latency(engine):
    c = Cluster(4, 8, INSIDE, NETWORK)
    bandwidth_only = Cluster(4, 8, Link(0.0, INSIDE.beta_s_per_byte), Link(0.0, NETWORK.beta_s_per_byte))
    one, ten = (cluster.communication_seconds(engine, c, 100 * MiB, pieces) for pieces in (1, 10))
    assert ten > one
    assert cluster.communication_seconds(engine, bandwidth_only, 100 * MiB, 10) == pytest.approx(
        cluster.communication_seconds(engine, bandwidth_only, 100 * MiB, 1))
