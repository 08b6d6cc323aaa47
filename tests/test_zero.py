"""zero.ShardedOptimizer against the unsharded optimizer, bit for bit.

ONE spawned group of 3 workers (spawning costs seconds of importing torch per process): the
whole world runs every case with 3 ranks, then ranks 1 and 2 run them again as a 2-rank
subgroup while rank 0 runs them alone (a 1-rank subgroup). Gradients are a fixed function of
the step and the parameter's name, the same on every rank (what data-parallel averaging hands
the optimizer), so the oracle is the plain optimizer run in the parent on the same model for
the same steps.
"""

from __future__ import annotations

import io
import threading
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import allreduce
import zero
from common import CollectiveCounter, assert_refused, refused, run_workers

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
STEPS = 4  # the late param group joins after step LATE
LATE = 2
TINY_BUCKETS_MB = 100 / 2 ** 20  # 100 bytes: most parameters in a bucket of their own, each cut among the ranks
LAYERS = ("embed", "hidden", "out", "frozen")
GROUPS = ((3, None), (2, [1, 2]), (1, [0]))  # (world size, members of the subgroup or None for the world)


class Toy(nn.Module):
    """Uneven tensor sizes (so the partition is uneven), a tied weight, a frozen layer, a parameter
    that never gets a gradient, a float64 parameter, and one added to the optimizer later."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 7)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight  # tied: one parameter
        self.frozen = nn.Linear(7, 6).requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(5))
        self.scale = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.late = nn.Parameter(torch.randn(4, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B,) token ids -> (B, 11) logits
        return self.out(self.frozen(self.hidden(self.embed(tokens))))


def make_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def param_groups(model: Toy) -> list[dict]:
    """Two groups with their own options; ``late`` is left out (added with add_param_group)."""
    return [{"params": [model.embed.weight, model.hidden.weight], "lr": 0.05},
            {"params": [model.hidden.bias, model.frozen.weight, model.frozen.bias, model.unused, model.scale],
             "weight_decay": 0.0}]


def set_gradients(model: Toy, step: int) -> None:
    for index, (name, p) in enumerate(model.named_parameters()):
        if p.requires_grad and name != "unused":
            generator = torch.Generator().manual_seed(1000 * step + index)
            p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)


def train(model: Toy, optimizer, first: int, last: int) -> None:
    """Steps ``first`` to ``last - 1``: zero_grad (both ways), gradients, step; the late group joins after LATE."""
    for step in range(first, last):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        set_gradients(model, step)
        optimizer.step()
        if step + 1 == LATE:
            optimizer.add_param_group({"params": [model.late], "lr": 0.02})


def checkpoint(state) -> dict:
    """Through torch.save / torch.load, as a file would take it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def state_of(model: Toy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --------------------------------------------------------------------------- workers


def _sharded(model: Toy, name: str, group, partition: str) -> zero.ShardedOptimizer:
    cls, options = OPTIMIZERS[name]
    return zero.ShardedOptimizer(param_groups(model), cls, process_group=group, partition=partition, **options)


def _case(name: str, partition: str, group) -> dict:
    """STEPS steps; a consolidated checkpoint and a resume from it; a resume from the plain optimizer's checkpoint."""
    model = make_model()
    optimizer = _sharded(model, name, group, partition)
    with CollectiveCounter() as counter:
        train(model, optimizer, 0, STEPS)
    local_state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    owned = sum(piece.end - piece.start for piece in optimizer.pieces if piece.owner == optimizer.rank)
    saved = checkpoint(optimizer.state_dict())
    params_at_checkpoint = checkpoint(model.state_dict())

    resumed = make_model()
    resumed.load_state_dict(params_at_checkpoint)
    resumed_optimizer = _sharded(resumed, name, group, partition)
    resumed_optimizer.add_param_group({"params": [resumed.late], "lr": 0.02})
    resumed_optimizer.load_state_dict(checkpoint(saved))  # a copy: loaded state is trained on in place
    train(resumed, resumed_optimizer, STEPS, STEPS + 2)

    # The plain optimizer's checkpoint, loaded into a sharded one.
    plain_model = make_model()
    cls, options = OPTIMIZERS[name]
    plain = cls(param_groups(plain_model), **options)
    train(plain_model, plain, 0, STEPS)
    from_plain = make_model()
    from_plain.load_state_dict(plain_model.state_dict())
    from_plain_optimizer = _sharded(from_plain, name, group, partition)
    from_plain_optimizer.add_param_group({"params": [from_plain.late], "lr": 0.02})
    from_plain_optimizer.load_state_dict(checkpoint(plain.state_dict()))
    train(from_plain, from_plain_optimizer, STEPS, STEPS + 2)
    return {"params": state_of(model), "state_dict": saved, "resumed": state_of(resumed),
            "from_plain": state_of(from_plain), "local_state_elements": local_state, "owned_elements": owned,
            "calls": dict(counter.calls), "collectives": counter.collectives}


def _apart(group) -> dict:
    """AdamW as if the ranks were on different hosts: the updates travel by our ring all-gather."""
    with mock.patch.object(allreduce, "shares_memory", lambda group=None, nbytes=0: False):
        probe = _sharded(make_model(), "adamw", group, "flat")
        outcome = _case("adamw", "flat", group)
    return {**outcome, "gather": probe._all_gather.__name__}


def _comm_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("zero-comm")}


def _bucketed_case(name: str, group, overlap: bool) -> dict:
    """Tiny buckets. Per step: the parameters read right after step() (without overlap), or what
    each layer saw when its forward ran (with overlap: the forward after the step waits per layer).
    Then the parameters read through ``model.state_dict()``, and what close() leaves behind."""
    model = make_model()
    cls, options = OPTIMIZERS[name]
    threads = _comm_threads()
    optimizer = zero.ShardedOptimizer(param_groups(model), cls, process_group=group, bucket_cap_mb=TINY_BUCKETS_MB,
                                      **options)
    if overlap:
        optimizer.overlap_with_forward(model)
    seen: list[dict] = []
    for layer in LAYERS:  # registered after the optimizer's hooks: they run after its wait
        getattr(model, layer).register_forward_pre_hook(
            lambda m, args, layer=layer: seen[-1].update({f"{layer}.{n}": p.detach().clone()
                                                          for n, p in m.named_parameters(recurse=False)}))
    after_step, in_flight = [], 0
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        set_gradients(model, step)
        optimizer.step()
        in_flight += sum(bucket.future is not None for bucket in optimizer.buckets)
        if not overlap:
            after_step.append(state_of(model))
        if step + 1 == LATE:
            optimizer.add_param_group({"params": [model.late], "lr": 0.02})
        seen.append({})
        with torch.no_grad():
            model(torch.arange(5))
    final = {name: t.clone() for name, t in model.state_dict().items()}
    share_s = optimizer.last_share_s
    buckets = len(optimizer.buckets)
    optimizer.close()
    return {"after_step": after_step, "seen": seen, "final": final, "buckets": buckets, "share_s": share_s,
            "in_flight": in_flight,
            "threads_left": len(_comm_threads() - threads),  # this optimizer's; others may end meanwhile
            "hooks_left": sum(
                len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_pre_hooks)
                + len(m._load_state_dict_pre_hooks) for m in model.modules()) - len(LAYERS)}


def lone_bucket_params(model: Toy) -> list[nn.Parameter]:
    """One param group of one dtype, well under the default bucket cap: a single bucket."""
    return [p for p in model.parameters() if p.dtype == torch.float32]


def _lone_bucket_case(group) -> dict:
    """AdamW over one bucket with overlap_with_forward: step() shares it inline (see ShardedOptimizer._launch)."""
    model = make_model()
    optimizer = zero.ShardedOptimizer(lone_bucket_params(model), torch.optim.AdamW, process_group=group, lr=0.01)
    optimizer.overlap_with_forward(model)
    in_flight = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        set_gradients(model, step)
        optimizer.step()
        in_flight += sum(bucket.future is not None for bucket in optimizer.buckets)
    buckets, share_s = len(optimizer.buckets), optimizer.last_share_s
    optimizer.close()
    return {"params": state_of(model), "buckets": buckets, "in_flight": in_flight, "share_s": share_s}


def _bad_inputs(group) -> dict:
    model = make_model()
    w, b = model.hidden.weight, model.hidden.bias
    elsewhere = nn.Parameter(torch.empty(3, device="meta"))
    optimizer = zero.ShardedOptimizer([w], torch.optim.SGD, process_group=group, lr=0.1)
    return {
        "no parameters": refused(lambda: zero.ShardedOptimizer([], torch.optim.SGD, process_group=group, lr=0.1)),
        "empty groups": refused(lambda: zero.ShardedOptimizer([{"params": []}], torch.optim.SGD, process_group=group)),
        "not a class": refused(lambda: zero.ShardedOptimizer([w], torch.optim.SGD([b], lr=0.1), process_group=group)),
        "not an optimizer": refused(lambda: zero.ShardedOptimizer([w], nn.Linear, process_group=group)),
        "twice in a group": refused(lambda: zero.ShardedOptimizer([w, b, w], torch.optim.SGD, process_group=group, lr=1)),
        "twice across groups": refused(lambda: zero.ShardedOptimizer([{"params": [w]}, {"params": [b, w]}],
                                                                      torch.optim.SGD, process_group=group, lr=1)),
        "twice when added": refused(lambda: optimizer.add_param_group({"params": [w]})),
        "partition": refused(lambda: zero.ShardedOptimizer([w], torch.optim.SGD, group, partition="rows", lr=1)),
        "not contiguous": refused(lambda: zero.ShardedOptimizer([nn.Parameter(torch.ones(4, 3).t())], torch.optim.SGD,
                                                                 process_group=group, lr=1)),
        "devices": refused(lambda: zero.ShardedOptimizer([w, elsewhere], torch.optim.SGD, process_group=group, lr=1)),
        "bucket cap": refused(lambda: zero.ShardedOptimizer([w], torch.optim.SGD, group, bucket_cap_mb=-1, lr=1)),
    }


def _grid(ctx) -> dict:
    out = {}
    for n, members in GROUPS:
        group = dist.new_group(members) if members is not None else None  # every rank creates every group
        if members is None or ctx.rank in members:
            out[n] = {"rank": dist.get_rank(group),
                      "cases": {(name, partition): _case(name, partition, group)
                                for name in OPTIMIZERS for partition in zero.PARTITIONS},
                      "apart": _apart(group), "lone bucket": _lone_bucket_case(group),
                      "bucketed": {(name, overlap): _bucketed_case(name, group, overlap)
                                   for name in ("sgd", "adamw") for overlap in (False, True)},
                      "refused": _bad_inputs(group)}
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, list[dict]]:
    """World size -> each member's results, in group-rank order."""
    by_size: dict[int, list] = {}
    for per_rank in run_workers(_grid, 3):
        for n, outcome in per_rank.items():
            by_size.setdefault(n, [None] * n)[outcome["rank"]] = outcome
    assert sorted(by_size) == [1, 2, 3] and all(None not in members for members in by_size.values())
    return by_size


def oracle(name: str, steps: int) -> tuple[Toy, torch.optim.Optimizer]:
    model = make_model()
    cls, options = OPTIMIZERS[name]
    optimizer = cls(param_groups(model), **options)
    train(model, optimizer, 0, steps)
    return model, optimizer


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


# --------------------------------------------------------------------------- the specification


@pytest.mark.parametrize("partition", zero.PARTITIONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_rank_holds_the_unsharded_optimizers_parameters_bit_for_bit(ranks, n, name, partition):
    model, _ = oracle(name, STEPS)
    want = state_of(model)
    assert not torch.equal(want["embed.weight"], make_model().embed.weight), "the steps changed the parameters"
    assert torch.equal(want["unused"], make_model().unused) and torch.equal(want["frozen.weight"],
                                                                            make_model().frozen.weight)
    for outcome in ranks[n]:
        assert_same_bits(outcome["cases"][name, partition]["params"], want)


@pytest.mark.parametrize("partition", zero.PARTITIONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_consolidated_state_dict_is_the_unsharded_optimizers(ranks, n, name, partition):
    _, optimizer = oracle(name, STEPS)
    want = optimizer.state_dict()
    for outcome in ranks[n]:
        got = outcome["cases"][name, partition]["state_dict"]
        assert got["param_groups"] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys()
        for index, state in want["state"].items():
            assert got["state"][index].keys() == state.keys()
            for key, value in state.items():
                assert torch.equal(got["state"][index][key], value), (index, key)


@pytest.mark.parametrize("partition", zero.PARTITIONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_training_resumed_from_a_checkpoint_continues_the_unsharded_trajectory(ranks, n, name, partition):
    """From the sharded optimizer's own checkpoint and from the plain optimizer's."""
    model, optimizer = oracle(name, STEPS)
    train(model, optimizer, STEPS, STEPS + 2)
    want = state_of(model)
    for outcome in ranks[n]:
        assert_same_bits(outcome["cases"][name, partition]["resumed"], want)
        assert_same_bits(outcome["cases"][name, partition]["from_plain"], want)


@pytest.mark.parametrize("partition", zero.PARTITIONS)
@pytest.mark.parametrize("name", ["adam", "adamw"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_rank_keeps_the_state_of_its_own_parameters_only(ranks, n, name, partition):
    """Adam's two moments per owned element; the shares add up to the whole, none is empty."""
    trained = sum(p.numel() for nm, p in make_model().named_parameters()
                  if p.requires_grad and nm not in ("unused", "out.weight"))
    local = [outcome["cases"][name, partition]["local_state_elements"] for outcome in ranks[n]]
    owned = [outcome["cases"][name, partition]["owned_elements"] for outcome in ranks[n]]
    assert sum(local) == 2 * trained
    assert all(0 < share <= o * 2 for share, o in zip(local, owned))
    assert sum(owned) == sum(p.numel() for p in make_model().parameters())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_flat_partition_gives_every_rank_the_same_number_of_elements_to_one_per_group_and_dtype(ranks, n):
    """Three param groups, one with a float64 parameter: four flat ranges cut in n, each to within one element."""
    owned = [outcome["cases"]["adamw", "flat"]["owned_elements"] for outcome in ranks[n]]
    assert max(owned) - min(owned) <= 4, owned


@pytest.mark.parametrize("n", [2, 3])
def test_on_one_host_the_update_is_shared_through_its_memory_without_messages_where_stores_stay_in_order(ranks, n):
    for outcome in ranks[n]:
        for name, case in outcome["cases"].items():
            assert case["collectives"] == 0, (name, case["calls"])
            assert (case["calls"] == {}) if allreduce.POLLS else (case["calls"].get("isend", 0) > 0), name


@pytest.mark.parametrize("n", [2, 3])
def test_on_different_hosts_the_update_is_shared_by_the_ring_with_point_to_point_messages_only(ranks, n):
    want, _ = oracle("adamw", STEPS)
    for outcome in ranks[n]:
        case = outcome["apart"]
        assert case["gather"] == "all_gather"
        assert case["collectives"] == 0, case["calls"]
        assert case["calls"].keys() <= {"isend", "irecv", "batch_isend_irecv"} and case["calls"]
        assert_same_bits(case["params"], state_of(want))


def test_a_single_rank_owns_every_piece_and_shares_nothing(ranks):
    """Not even through the communication thread: step() leaves nothing in flight, with overlap too."""
    (outcome,) = ranks[1]
    for name, case in outcome["cases"].items():
        assert case["collectives"] == 0 and not case["calls"], (name, case["calls"])
    for key, case in outcome["bucketed"].items():
        assert case["in_flight"] == 0, key


@pytest.mark.parametrize("n", [1, 2, 3])
def test_bad_input_is_refused_on_every_rank_before_any_message(ranks, n):
    expected = {"no parameters": "ValueError: ShardedOptimizer got an empty parameter list",
                "empty groups": "ValueError: ShardedOptimizer got no parameters",
                "not a class": "TypeError: optimizer_cls must be a torch.optim.Optimizer subclass",
                "not an optimizer": "TypeError: optimizer_cls must be a torch.optim.Optimizer subclass",
                "twice in a group": "ValueError: a parameter of shape (7, 6) appears twice",
                "twice across groups": "ValueError: a parameter of shape (7, 6) appears twice",
                "twice when added": "ValueError: a parameter of shape (7, 6) appears twice",
                "devices": "ValueError: parameters on different devices",
                "partition": "ValueError: unknown partition 'rows'",
                "not contiguous": "ValueError: a parameter of shape (3, 4) is not contiguous",
                "bucket cap": "ValueError: bucket_cap_mb must be at least 0, got -1"}
    for outcome in ranks[n]:
        assert_refused(outcome["refused"], expected)


def test_the_partition_gives_the_largest_tensors_first_to_the_least_loaded_rank():
    load = [0, 0, 0]
    assert zero.partition([3, 10, 7, 7], load) == [1, 0, 1, 2] and load == [10, 10, 7]
    assert zero.partition([4, 4], load) == [2, 0] and load == [14, 10, 11], "later groups balance against earlier ones"
    assert zero.partition([5, 0], [0, 0]) == [0, 1], "ties go to the lowest rank"


# --------------------------------------------------------------------------- buckets and overlap


def oracle_trajectory(name: str) -> list[dict[str, torch.Tensor]]:
    """The plain optimizer's parameters after each of STEPS steps."""
    model = make_model()
    cls, options = OPTIMIZERS[name]
    optimizer = cls(param_groups(model), **options)
    states = []
    for step in range(STEPS):
        train(model, optimizer, step, step + 1)
        states.append(state_of(model))
    return states


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_with_small_buckets_a_read_right_after_step_sees_the_updated_parameters(ranks, n, name):
    """By default step() returns once every bucket's all-gather is in: nothing is left in flight."""
    want = oracle_trajectory(name)
    for outcome in ranks[n]:
        case = outcome["bucketed"][name, False]
        assert case["buckets"] >= 6, "most parameters in a bucket of their own"
        for step in range(STEPS):
            assert_same_bits(case["after_step"][step], want[step])


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_with_overlap_each_layer_sees_its_updated_parameters_when_the_next_forward_reaches_it(ranks, n, name):
    """overlap_with_forward: step() returns before the all-gathers end, each layer's forward waits for
    its bucket; what every layer saw, at every step, is the unsharded optimizer's, bit for bit."""
    want = oracle_trajectory(name)
    for outcome in ranks[n]:
        case = outcome["bucketed"][name, True]
        for step in range(STEPS):
            seen = case["seen"][step]
            assert {key.split(".")[0] for key in seen} == set(LAYERS)
            tied = {"out.weight": "embed.weight"}  # named_parameters() lists a tied parameter once
            assert_same_bits(seen, {key: want[step][tied.get(key, key)] for key in seen})


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_lone_bucket_is_shared_inside_step_even_with_overlap_and_bit_for_bit(ranks, n):
    """Nothing to overlap it with: no all-gather is left in flight after step(), and the time it took counts as
    exposed; the parameters are the unsharded AdamW's."""
    model = make_model()
    plain = torch.optim.AdamW(lone_bucket_params(model), lr=0.01)
    for step in range(STEPS):
        plain.zero_grad()
        set_gradients(model, step)
        plain.step()
    for outcome in ranks[n]:
        case = outcome["lone bucket"]
        assert case["buckets"] == 1 and case["in_flight"] == 0
        assert case["share_s"] > 0.0 if n > 1 else case["share_s"] == 0.0
        assert_same_bits(case["params"], state_of(model))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_bucketed_training_ends_with_the_unsharded_parameters_and_close_leaves_nothing_running(ranks, n, name,
                                                                                               overlap):
    """module.state_dict() waits too; close() joins the communication thread and removes every hook."""
    model = make_model()
    cls, options = OPTIMIZERS[name]
    optimizer = cls(param_groups(model), **options)
    train(model, optimizer, 0, STEPS)
    want = {key: t.clone() for key, t in model.state_dict().items()}
    for outcome in ranks[n]:
        case = outcome["bucketed"][name, overlap]
        assert_same_bits(case["final"], want)
        assert case["threads_left"] == 0 and case["hooks_left"] == 0
        assert case["share_s"] >= 0.0
