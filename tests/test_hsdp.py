"""FSDP(shard="host") (hybrid sharding): like one process on the global batch, on simulated hosts.

One spawned group per layout (``launch(..., hosts=...)``: the ranks as hosts of ``DPKIT_HOSTS``)
runs every case; the parent compares the full parameters after training with a single-process
oracle (test_fsdp's TinyLM: sharded embedding, linears and a tied head; a replicated LayerNorm
and free parameter) to a few float32 ulps, and checks what each rank sent through each of its
three transports (inside its host, among the hosts that hold its shard, over the whole group).

The default run is one 2x2 group (4 ranks) with plain SGD written out (``p -= lr * grad``): the
first torch.optim optimizer of a process imports torch._dynamo, seconds of CPU in each worker.
It also runs the bad inputs: hosts of different sizes, one rank per host (DDP across hosts: a
warning), a Transport object, an unknown scope. Marked slow: torch.optim's SGD with momentum and
AdamW on 2x2 and on 3x2 (6 ranks), where a group of two of the three hosts trains beside a
group of the third host alone.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist

from common import PG_TIMEOUT_S, WORKERS_TIMEOUT_S, CountingTransport
from dpkit.comm import transport
from dpkit.comm.process_groups import new_subgroups
from dpkit.comm.process_groups import launch
from dpkit.engines.fsdp import FSDP
from test_fsdp import (MICRO, OPTIMIZERS, STEPS, assert_few_ulps, build, expected_traffic, loss_of, oracle, tokens,
                       ulps)

PLAIN_LR = 0.1
# (optimizer, reshard_after_forward) trained by the whole world of each run: "plain" is SGD written out.
CASES = {"2x2": [("plain", True), ("plain", False)],
         "2x2 torch.optim": [("sgd", True), ("sgd", False), ("adamw", True), ("adamw", False)],
         "3x2 torch.optim": [("sgd", True), ("adamw", False)]}
HOSTS = {"2x2": (2, 2), "2x2 torch.optim": (2, 2), "3x2 torch.optim": (2, 2, 2)}  # ranks on each host
ROLES = ("host", "across", "group")  # FSDP's three transports: shard_transport, across, transport


def train(model, optimizer, rank, world, counters=()):
    """STEPS steps on rank ``rank``'s share of the global batch of ``world`` ranks; each step's counts of
    ``counters`` (CountingTransports, reset at each step) beside the full parameters at the end."""
    opt = Plain(model.parameters()) if optimizer == "plain" else OPTIMIZERS[optimizer][0](
        model.parameters(), **OPTIMIZERS[optimizer][1])
    steps = []
    for step in range(STEPS):
        for counter in counters:
            counter.reset()
        idx = tokens(step, world)[rank * MICRO:(rank + 1) * MICRO]
        loss_of(model(idx), idx).backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        steps.append([(dict(c.calls), dict(c.bytes)) for c in counters])
    return model.full_parameters(), steps


class Plain:
    """SGD without momentum, ``p -= PLAIN_LR * p.grad``: what torch.optim.SGD(lr=PLAIN_LR) does, without it."""

    def __init__(self, params):
        self.params = list(params)

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is not None:
                p.sub_(PLAIN_LR * p.grad)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


@functools.lru_cache(maxsize=None)
def reference(world, optimizer):
    """One process on the global batch of ``world`` ranks: test_fsdp's oracle, or with "plain" its float32 case
    written out with ``Plain``."""
    if optimizer != "plain":
        return oracle(world, optimizer)
    model = build(0)
    opt = Plain(model.parameters())
    for step in range(STEPS):
        idx = tokens(step, world)
        loss_of(model(idx), idx).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def counted(group):
    return CountingTransport("auto", group)


def hybrid(seed, group=None, **kwargs):
    """A hybrid FSDP of TinyLM, each of its transports a CountingTransport around "auto"."""
    return FSDP(build(seed), process_group=group, transport=counted, shard="host", **kwargs)


def describe(model):
    """Each transport's role -> (its ranks, the class it counts for); None for no transport among hosts."""
    return {role: t and (t.ranks, type(t.inner).__name__)
            for role, t in zip(ROLES, (model.shard_transport, model.across, model.transport))}


def _world(ctx, cases):
    """The whole world trains each case (rank-dependent initial weights: FSDP takes rank 0's); after the first,
    its full_state_dict is loaded into a fresh hybrid FSDP of other weights (``out["loaded"]``)."""
    out = {}
    for optimizer, reshard in cases:
        model = hybrid(ctx.rank, reshard_after_forward=reshard)
        counters = (model.shard_transport, model.across, model.transport)
        out[optimizer, reshard] = train(model, optimizer, ctx.rank, ctx.world_size, counters)
        out["transports"] = describe(model)
        if "loaded" not in out:
            fresh = hybrid(3)
            fresh.load_full_state_dict(model.full_state_dict())
            out["loaded"] = fresh.full_parameters()
            fresh.close()
        model.close()
    return out


def _groups(ctx, lists):
    """This rank's group among ``lists`` (global ranks; made by their members only) and its rank there."""
    made = [g for g in new_subgroups(dist.group.WORLD, lists, PG_TIMEOUT_S) if g is not None]
    return (made[0], dist.get_rank(made[0])) if made else (None, None)


def _subset(ctx, lists, optimizer):
    """Each group of ``lists`` trains on its own global batch (a group of fewer ranks than the world)."""
    group, rank = _groups(ctx, lists)
    if group is None:
        return None
    model = hybrid(0, group)
    params, _ = train(model, optimizer, rank, dist.get_world_size(group))
    out = {"params": params, "transports": describe(model), "world": dist.get_world_size(group)}
    model.close()
    return out


def _one_rank_per_host(ctx):
    """Ranks 0, 2 and 1, 3 (in a 2x2 job): two groups with one rank on each host."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _subset(ctx, [[0, 2], [1, 3]], "plain")
    out["warnings"] = [str(w.message) for w in caught]
    return out


def _errors(ctx):
    """The bad inputs, each message as this rank raised it (None: nothing raised)."""
    def message(fn):
        try:
            fn()
        except (TypeError, ValueError) as error:
            return f"{type(error).__name__}: {error}"
        return None

    group, _ = _groups(ctx, [[0, 1, 2]])  # 2 + 1 ranks on the two hosts
    out = {"uneven": message(lambda: hybrid(0, group)) if group is not None else "not a member"}
    out["transport object"] = message(lambda: FSDP(build(0), transport=transport.resolve("auto"), shard="host"))
    out["scope"] = message(lambda: FSDP(build(0), shard="rack"))
    return out


def _cases(ctx, run):
    """Every case of ``run`` (a key of CASES) in one spawned group."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning while training, save the one a case records
        out = {"world": _world(ctx, CASES[run])}
        if run == "2x2":
            out["errors"] = _errors(ctx)
        if run == "3x2 torch.optim":  # hosts 0 and 1 (ranks 0-3) as one group, host 2 (ranks 4, 5) alone beside it
            out["subset"] = _subset(ctx, [[0, 1, 2, 3], [4, 5]], "adamw")
    if run == "2x2":
        out["one per host"] = _one_rank_per_host(ctx)
    return out


@functools.lru_cache(maxsize=None)
def results(run):
    """Every rank's results of ``run``: spawned once, whichever fixture asks first."""
    hosts = HOSTS[run]
    return launch(_cases, sum(hosts), run, hosts=hosts, timeout_s=WORKERS_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)


@pytest.fixture(scope="module", params=["2x2", *(pytest.param(run, marks=pytest.mark.slow) for run in CASES
                                                  if run != "2x2")])
def layout(request):
    """(ranks on each host, the cases, every rank's results) of one run."""
    return HOSTS[request.param], CASES[request.param], results(request.param)


@pytest.fixture(scope="module")
def two_by_two():
    return results("2x2")


@pytest.fixture(scope="module")
def three_by_two():
    return results("3x2 torch.optim")


# --------------------------------------------------------------------------- the tests


def test_trains_like_one_process_on_the_global_batch(layout):
    hosts, cases, ranks = layout
    for optimizer, reshard in cases:
        expected = reference(sum(hosts), optimizer)
        for result in ranks:
            assert_few_ulps(result["world"][optimizer, reshard][0], expected)


def test_the_training_moves_parameters_far_beyond_the_tolerance():
    """So the ulp comparison above can fail: the plain steps change parameters by many thousand ulps (test_fsdp
    checks its oracle's)."""
    start, end = {n: p.detach() for n, p in build(0).named_parameters()}, reference(4, "plain")
    assert max(ulps(start[n], end[n]) for n in end) > 1e4


def test_every_rank_on_every_host_holds_the_same_parameters(layout):
    """Bit for bit: the shards of every host are averaged alike across the hosts."""
    _, cases, ranks = layout
    for case in cases:
        first = ranks[0]["world"][case][0]
        for result in ranks[1:]:
            for name, value in first.items():
                torch.testing.assert_close(result["world"][case][0][name], value, rtol=0, atol=0)


def test_shards_over_the_host_through_shared_memory_and_averages_across_hosts_through_torch(layout):
    hosts, _, ranks = layout
    n_hosts, per_host, world = len(hosts), hosts[0], sum(hosts)
    for rank, result in enumerate(ranks):
        host = rank // per_host
        assert result["world"]["transports"] == {
            "host": (list(range(host * per_host, (host + 1) * per_host)), "SharedMemory"),
            "across": ([rank % per_host + h * per_host for h in range(n_hosts)], "Torch"),
            "group": (list(range(world)), "Hierarchical")}


def test_only_gradient_shards_cross_hosts_and_parameters_are_gathered_inside_the_host(layout):
    """Per step: inside the host exactly plain FSDP's traffic over the host's ranks (``expected_traffic``);
    among the hosts one all-reduce of each reduce-scattered gradient shard (1/per_host of the flat gradient)
    and nothing else; over the whole group only the replicated parameters' all-reduce."""
    hosts, cases, ranks = layout
    per_host = hosts[0]
    for result in ranks:
        for optimizer, reshard in cases:
            calls, nbytes = expected_traffic(per_host, None, reshard)
            for host, across, group in result["world"][optimizer, reshard][1]:
                assert host == (calls, nbytes), (optimizer, reshard, host)
                assert across == ({"all_reduce": calls["reduce_scatter"]},
                                  {"all_reduce": nbytes["reduce_scatter"] // per_host}), (optimizer, reshard, across)
                assert set(group[0]) == {"all_reduce"} and group[0]["all_reduce"] >= 1, group


def test_full_state_dict_round_trips(layout):
    _, cases, ranks = layout
    for result in ranks:
        saved, loaded = result["world"][cases[0]][0], result["world"]["loaded"]
        assert saved.keys() == loaded.keys()
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)


def test_one_rank_per_host_is_ddp_across_hosts_and_says_so_once_per_group(two_by_two):
    for rank, result in enumerate(two_by_two):
        case = result["one per host"]
        assert case["world"] == 2
        assert case["transports"]["host"] == ([rank], "Torch")  # a shard group of one: the whole model
        assert_few_ulps(case["params"], reference(2, "plain"))
        if rank < 2:  # group rank 0 of [0, 2] and of [1, 3]
            assert len(case["warnings"]) == 1 and "which is DDP across hosts" in case["warnings"][0]
        else:
            assert case["warnings"] == []


def test_bad_input_raises_a_clear_error_on_every_rank(two_by_two):
    for rank, result in enumerate(two_by_two):
        errors = result["errors"]
        if rank < 3:
            assert errors["uneven"].startswith("ValueError: FSDP(shard='host'): the group's hosts hold different "
                                               "numbers of its ranks (2+1: host 0: ranks [0, 1]; host 1: ranks [2])")
        assert errors["transport object"].startswith("TypeError: FSDP(shard='host'): give transport as a name or")
        assert errors["scope"].startswith("ValueError: shard must be 'group'") and "'rack'" in errors["scope"]


@pytest.mark.slow
def test_a_group_of_some_hosts_and_a_group_of_one_host_train_like_one_process(three_by_two):
    for rank, result in enumerate(three_by_two):
        case = result["subset"]
        assert_few_ulps(case["params"], reference(case["world"], "adamw"))
        if rank < 4:  # hosts 0 and 1 of the three
            host = [rank - rank % 2, rank - rank % 2 + 1]
            assert case["world"] == 4 and case["transports"]["host"] == (host, "SharedMemory")
            assert case["transports"]["across"] == ([rank % 2, rank % 2 + 2], "Torch")
        else:  # one host: plain FSDP over the group, through its shared memory
            assert case["world"] == 2 and case["transports"]["host"] == ([4, 5], "SharedMemory")
