"""allreduce.reduce_scatter and allreduce.all_gather (the ring) against the exact result computed in float64.
(The shared-memory transport's are tested in test_transport.py.)

World sizes 1 to 5 run in ONE spawned group of 5 workers (spawning costs seconds of importing
torch per process, a case milliseconds): 2 and 3, then 4 and 1, are disjoint subgroups running at
the same time, members scrambled so that group ranks differ from global ranks, and 5 is the whole
world. Each group runs the whole grid and returns every member's results; the parent rebuilds every
member's input from the same seed and checks the results against the exact sum or mean.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import allreduce
from common import CollectiveCounter, assert_refused, refused, run_in_subgroups
from test_allreduce import exact

# Rounds of groups over a world of 5; None is the default group (all 5).
ROUNDS = ([[3, 0], [4, 1, 2]], [[2, 4, 0, 1], [3]], [None])
WORLD = 5
WORLD_SIZES = (1, 2, 3, 4, 5)
# Shard sizes: none, one element, odd; every rank's input holds world size x shard elements.
SHARDS = (0, 1, 7, 1001)
DTYPES = ("float32", "float64", "float16", "bfloat16")
# The defaults, and tiny segments so that a 1001-element shard takes 8 to 32 pipelined segments.
VARIANTS = {"ring": {}, "ring_segmented": {"segment_bytes": 256, "in_flight": 3}}
SEED = 11


def rank_input(numel: int, rank: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """What group rank ``rank`` contributes: different on every rank, rounded to ``dtype``."""
    return allreduce.rank_data(SEED + salt, numel, rank).to(getattr(torch, dtype))


def cases(world_size: int):
    """(collective, variant, shard numel, dtype, op): every shard size, dtype and op with the defaults;
    the segmented variant on the largest shard (a case costs its number of dependent message hops)."""
    for variant in VARIANTS:
        for m in SHARDS if variant != "ring_segmented" else SHARDS[-1:]:
            for dtype in DTYPES:
                for op in allreduce.OPS:
                    yield "reduce_scatter", variant, m, dtype, op
                yield "all_gather", variant, m, dtype, None


def _call(collective, variant, output, input, op, group):
    if collective == "reduce_scatter":
        return allreduce.reduce_scatter(output, input, op, group, **VARIANTS[variant])
    return allreduce.all_gather(output, input, group, **VARIANTS[variant])


def _run_case(group, collective, variant, m, dtype, op) -> dict:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if collective == "reduce_scatter":
        input, output = rank_input(n * m, rank, dtype), torch.full((m,), float("nan"), dtype=getattr(torch, dtype))
    else:
        input, output = rank_input(m, rank, dtype), torch.full((n * m,), float("nan"), dtype=getattr(torch, dtype))
    before = input.clone()
    with CollectiveCounter() as counter:
        returned = _call(collective, variant, output, input, op, group)
    return {"result": output, "returns_output": returned is output, "input_untouched": torch.equal(input, before),
            "calls": dict(counter.calls), "collectives": counter.collectives, "sent_bytes": counter.sent_bytes}


def _in_place(group) -> dict:
    """The in-place forms: the shard is the full tensor's own chunk; and a non-contiguous output and input."""
    rank, n, m = dist.get_rank(group), dist.get_world_size(group), 7
    full = rank_input(n * m, rank, "float64", salt=1)
    scattered = full.clone()
    allreduce.reduce_scatter(scattered[rank * m:(rank + 1) * m], scattered, "sum", group)
    gathered = torch.zeros(n * m, dtype=torch.float64)
    gathered[rank * m:(rank + 1) * m] = full[:m]
    allreduce.all_gather(gathered, gathered[rank * m:(rank + 1) * m], group)
    strided_in = torch.stack([full, -full], 1)  # (n m, 2): column 0 is the input, every other element
    strided_out = torch.zeros(m, 2, dtype=torch.float64)
    allreduce.reduce_scatter(strided_out[:, 0], strided_in[:, 0], "sum", group)
    gathered_strided = torch.zeros(n * m, 2, dtype=torch.float64)
    allreduce.all_gather(gathered_strided[:, 0], strided_in[:m, 0], group)
    return {"full": full, "scattered": scattered, "gathered": gathered, "strided_out": strided_out,
            "gathered_strided": gathered_strided}


def _no_float16_overflow(group) -> torch.Tensor:
    """60000 on every rank (float16's largest value is 65504): the sum overflows, the mean must not."""
    n = dist.get_world_size(group)
    out = torch.empty(3, dtype=torch.float16)
    return allreduce.reduce_scatter(out, torch.full((3 * n,), 60000.0, dtype=torch.float16), "avg", group)


def _bad_inputs(group) -> dict:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    x, shard = torch.ones(4 * n), torch.ones(4)
    base = torch.ones(4 * n + 1)  # a full tensor, and a shard one element off its own chunk
    full, shifted = base[:4 * n], base[rank * 4 + 1:rank * 4 + 5]
    return {
        "reduce_scatter numel": refused(lambda: allreduce.reduce_scatter(shard, torch.ones(4 * n + 1), "sum", group)),
        "all_gather numel": refused(lambda: allreduce.all_gather(torch.ones(4 * n + 1), shard, group)),
        "dtype": refused(lambda: allreduce.reduce_scatter(shard.double(), x, "sum", group)),
        "int mean": refused(lambda: allreduce.reduce_scatter(torch.ones(4, dtype=torch.int64),
                                                              torch.ones(4 * n, dtype=torch.int64), "avg", group)),
        "unknown op": refused(lambda: allreduce.reduce_scatter(shard, x, "max", group)),
        "not a tensor": refused(lambda: allreduce.all_gather([0.0] * 4 * n, shard, group)),
        # A shard overlapping the full tensor anywhere but its own chunk would be overwritten while read.
        "overlap": refused(lambda: allreduce.all_gather(full, shifted, group)),
    }


def _grid_in(group) -> dict:
    """Every case of this file on one group, as seen by one member."""
    n = dist.get_world_size(group)
    return {"cases": {case: _run_case(group, *case) for case in cases(n)},
            "in_place": _in_place(group), "float16_mean": _no_float16_overflow(group), "refused": _bad_inputs(group)}


@pytest.fixture(scope="module")
def grids() -> dict[int, list[dict]]:
    """Group size -> each member's results, in group-rank order."""
    by_size = run_in_subgroups(_grid_in, WORLD, ROUNDS)
    assert sorted(by_size) == list(WORLD_SIZES)
    return by_size


# --------------------------------------------------------------------------- the oracle


def tolerance(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The worst-case rounding error of the ring's sum (or mean) in the inputs' dtype, per element.

    Any order of n - 1 additions has |fl(sum) - sum| <= gamma(n-1) sum |x_i|, gamma(k) = k u / (1 - k u)
    with u the dtype's unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, 4.2).
    The mean first divides each term by n (one rounding each): together at most gamma(n) sum |x_i| / n,
    plus half a subnormal step per term where x_i / n falls below the normal range (float16). The
    float64 oracle itself is rounded once more: 2 u64 |exact|.
    """
    n, info = len(inputs), torch.finfo(inputs[0].dtype)
    u = info.eps / 2

    def gamma(k: int) -> float:
        return k * u / (1 - k * u)

    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    if op == "avg":
        bound = gamma(n) * magnitude / n + n * u * info.smallest_normal
    else:
        bound = gamma(n - 1) * magnitude
    return bound + 2 * torch.finfo(torch.float64).eps / 2 * exact(inputs, op).abs()


def assert_exact(got: torch.Tensor, inputs: list[torch.Tensor], op: str) -> None:
    want, bound = exact(inputs, op), tolerance(inputs, op)
    error = (got.double() - want).abs()
    if got.numel() == 0:
        return
    worst = (error - bound).argmax()
    assert torch.all(error <= bound), (f"element {worst.item()}: got {got[worst].item()!r}, exact "
                                       f"{want[worst].item()!r}, "
                                      f"error {error[worst].item():.3e} > bound {bound[worst].item():.3e}")


ALL_CASES = [(n, *case) for n in WORLD_SIZES for case in cases(n)]


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("n, collective, variant, m, dtype, op", ALL_CASES)
def test_every_rank_holds_its_part_of_the_exact_result(grids, n, collective, variant, m, dtype, op):
    if collective == "reduce_scatter":  # rank r holds chunk r of the reduction of the full inputs
        inputs = [rank_input(n * m, r, dtype) for r in range(n)]
        got = torch.cat([grids[n][r]["cases"][collective, variant, m, dtype, op]["result"] for r in range(n)])
        assert got.dtype == inputs[0].dtype and got.shape == (n * m,)
        assert_exact(got, inputs, op)
    else:  # every rank holds every rank's shard, in rank order, bit for bit
        want = torch.cat([rank_input(m, r, dtype) for r in range(n)])
        for ranks_out in grids[n]:
            assert torch.equal(ranks_out["cases"][collective, variant, m, dtype, op]["result"], want)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_output_is_returned_and_the_input_untouched(grids, n):
    for case in cases(n):
        for ranks_out in grids[n]:
            outcome = ranks_out["cases"][case]
            assert outcome["returns_output"] and outcome["input_untouched"], case


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_each_rank_sends_exactly_n_minus_1_shards_point_to_point(grids, n):
    """Half the bytes of an all-reduce: (n-1)/n of the full tensor, and no collective."""
    for case in cases(n):
        _, _, m, dtype, _ = case
        shard_bytes = m * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        for ranks_out in grids[n]:
            outcome = ranks_out["cases"][case]
            assert outcome["collectives"] == 0, (case, outcome["calls"])
            assert set(outcome["calls"]) <= {"isend", "irecv", "batch_isend_irecv"}, (case, outcome["calls"])
            assert outcome["sent_bytes"] == (n - 1) * shard_bytes, case
            if n == 1 or m == 0:
                assert outcome["calls"] == {}, "nothing to exchange: no messages"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_in_place_and_strided_forms_give_the_same_result(grids, n):
    m, fulls = 7, [grids[n][r]["in_place"]["full"] for r in range(n)]
    for rank, ranks_out in enumerate(grids[n]):
        got = ranks_out["in_place"]
        chunk = slice(rank * m, (rank + 1) * m)
        assert_exact(got["scattered"][chunk], [x[chunk] for x in fulls], "sum")
        others = torch.ones(n * m, dtype=torch.bool)
        others[chunk] = False
        assert torch.equal(got["scattered"][others], fulls[rank][others]), "only the own chunk is written"
        assert torch.equal(got["strided_out"][:, 0], got["scattered"][chunk])
        assert torch.equal(got["strided_out"][:, 1], torch.zeros(m, dtype=torch.float64)), "neighbours untouched"
        want = torch.cat([x[:m] for x in fulls])
        assert torch.equal(got["gathered"], want)
        assert torch.equal(got["gathered_strided"][:, 0], want)
        assert torch.equal(got["gathered_strided"][:, 1], torch.zeros(n * m, dtype=torch.float64))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_float16_mean_divides_before_it_adds_so_it_cannot_overflow(grids, n):
    for ranks_out in grids[n]:
        assert torch.equal(ranks_out["float16_mean"], torch.full((3,), 60000.0, dtype=torch.float16))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_bad_input_is_refused_before_any_message(grids, n):
    expected = {"reduce_scatter numel": "ValueError: input has", "all_gather numel": "ValueError: output has",
                "dtype": "TypeError: output (torch.float64", "int mean": "TypeError: op='avg' needs a floating dtype",
                "unknown op": "ValueError: unknown op 'max'",
                "not a tensor": "TypeError: expected a torch.Tensor output",
                "overlap": "ValueError: output and input overlap"}
    for ranks_out in grids[n]:
        assert_refused(ranks_out["refused"], expected)


def test_the_tolerance_is_tight_enough_to_catch_a_missing_contribution():
    """The oracle's bound must be far below the size of one rank's contribution, or the tests above prove nothing."""
    for dtype in DTYPES:
        inputs = [rank_input(1001, r, dtype) for r in range(5)]
        without_last = exact(inputs[:-1], "sum")
        with pytest.raises(AssertionError):
            assert_exact(without_last, inputs, "sum")
        assert math.isfinite(tolerance(inputs, "avg").max().item())
