"""allreduce.py: ring, butterfly and halving-doubling all-reduce, against the exact result computed in float64.

World sizes 1, 2, 3, 4, 5 and 8 all run in ONE spawned group of 8 workers (spawning costs seconds
of importing torch per process, a case milliseconds): sizes 1 to 5 are disjoint subgroups that
run at the same time, their members scrambled so that group ranks differ from global ranks, and
8 is the whole world through the default group. Each group runs the whole grid of cases and
returns every member's results; the parent rebuilds each member's input from the same seed and
checks the results against the exact sum or mean.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

import allreduce
from common import CollectiveCounter, run_workers
from dist_utils import WorkerError, launch
from measure import PeakMemory

# Rounds of groups over a world of 8; None is the default group (all 8).
ROUNDS = ([[1, 5, 6], [0, 2, 3, 4, 7]], [[0, 3, 5, 6], [2, 7], [4]], [None])
WORLD = 8
WORLD_SIZES = (1, 2, 3, 4, 5, 8)
# Each algorithm with its defaults, and ring and halving-doubling with tiny segments so that even
# 1003 elements take several pipelined segments (2 to 16 per chunk), reusing their scratch rows.
VARIANTS = {
    "ring": ("ring", {}),
    "butterfly": ("butterfly", {}),
    "halving_doubling": ("halving_doubling", {}),
    "ring_segmented": ("ring", {"segment_bytes": 256, "in_flight": 3}),
    "halving_doubling_segmented": ("halving_doubling", {"segment_bytes": 256, "in_flight": 3}),
}
FLOATS = ("float32", "float64")
SEED = 4


def sizes(world_size: int) -> list[int]:
    """1, fewer elements than ranks, and sizes that do and do not divide among the ranks."""
    return sorted({1, world_size - 1, 1000, 1003} - {0})


def rank_input(numel: int, rank: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """What group rank ``rank`` contributes: different on every rank; integers are the data times 1000, rounded."""
    data = allreduce.rank_data(SEED + salt, numel, rank)
    if dtype == "int64":
        return (data * 1000).round().to(torch.int64)
    return data.to(getattr(torch, dtype))


def cases(world_size: int):
    """(variant, numel, dtype, op): every size, float dtype and op for the three algorithms; int64 sums;
    the segmented variants on the largest size only (where segments are many: a case is as slow as its
    number of dependent message hops on an oversubscribed machine)."""
    for variant in ("ring", "butterfly", "halving_doubling"):
        for numel in sizes(world_size):
            for dtype in FLOATS:
                for op in allreduce.OPS:
                    yield variant, numel, dtype, op
        yield variant, 1003, "int64", "sum"
    for variant in ("ring_segmented", "halving_doubling_segmented"):
        for dtype in FLOATS:
            for op in allreduce.OPS:
                yield variant, 1003, dtype, op


def _call(variant: str, tensor: torch.Tensor, op: str, group):
    name, options = VARIANTS[variant]
    return allreduce.ALGORITHMS[name](tensor, op, group, **options)


def _run_case(group, variant, numel, dtype, op) -> dict:
    x = rank_input(numel, dist.get_rank(group), dtype)
    before, pointer = x.clone(), x.data_ptr()
    with CollectiveCounter() as counter:
        returned = _call(variant, x, op, group)
    return {"result": x, "is_input": returned is x and x.data_ptr() == pointer, "changed": not torch.equal(x, before),
            "calls": dict(counter.calls), "collectives": counter.collectives, "p2p": counter.point_to_point,
            "sent_bytes": counter.sent_bytes}


def _refused(variant, tensor, op, group) -> dict:
    with CollectiveCounter() as counter:
        try:
            _call(variant, tensor, op, group)
            error = None
        except (TypeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
    return {"error": error, "calls": dict(counter.calls)}


def _ring_scratch_bytes(group) -> list[int]:
    """Bytes the ring allocates on 1003 float32 elements with its scratch released, then on the next call."""
    x = rank_input(1003, dist.get_rank(group), "float32")
    allreduce.release_scratch()
    peaks = []
    for _ in range(2):
        with PeakMemory() as peak:
            allreduce.ring_allreduce(x, "sum", group)
        peaks.append(peak.bytes)
    return peaks


def _grid_in(group) -> dict:
    """Every case of this file on one group, as seen by one member."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = {"group_rank": rank, "cases": {case: _run_case(group, *case) for case in cases(n)},
           "noncontiguous": {}, "empty": {}, "refused": {}, "ring_scratch": _ring_scratch_bytes(group)}
    for variant in VARIANTS:
        # Every other element of a (1003, 2) matrix: strided, so reduced in a contiguous copy.
        matrix = rank_input(2006, rank, "float64", salt=1).view(1003, 2)
        returned = _call(variant, matrix[:, 0], "sum", group)
        out["noncontiguous"][variant] = (matrix, returned.data_ptr() == matrix.data_ptr(), returned.stride())
        empty = torch.empty(0)
        with CollectiveCounter() as counter:
            returned = _call(variant, empty, "mean", group)
        out["empty"][variant] = (returned is empty, dict(counter.calls))
        out["refused"][variant] = {"int_mean": _refused(variant, torch.arange(6), "mean", group),
                                   "unknown_op": _refused(variant, torch.ones(6), "max", group)}
    return out


def _grid(ctx) -> dict:
    """This rank's results for every group it belongs to, keyed by group size."""
    out = {}
    for groups in ROUNDS:
        # Every rank creates every group, in the same order; only members use it.
        handles = [dist.new_group(members) if members is not None else None for members in groups]
        for members, group in zip(groups, handles):
            if members is None or ctx.rank in members:
                out[len(members) if members is not None else ctx.world_size] = _grid_in(group)
    return out


@pytest.fixture(scope="module")
def grids() -> dict[int, list[dict]]:
    """Group size -> each member's results, in group-rank order."""
    by_size: dict[int, list] = {}
    for per_rank in run_workers(_grid, WORLD):
        for n, outcome in per_rank.items():
            by_size.setdefault(n, [None] * n)[outcome["group_rank"]] = outcome
    assert sorted(by_size) == list(WORLD_SIZES) and all(None not in members for members in by_size.values())
    return by_size


# --------------------------------------------------------------------------- the oracle


UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float64": 2.0 ** -53}


def exact(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The sum (or mean) of the ranks' values, correctly rounded to float64 (``math.fsum`` per element)."""
    columns = torch.stack([x.double() for x in inputs]).T.tolist()
    total = torch.tensor([math.fsum(column) for column in columns], dtype=torch.float64)
    return total / len(inputs) if op == "mean" else total


def tolerance(inputs: list[torch.Tensor], op: str, dtype: str) -> torch.Tensor:
    """The worst-case rounding error of summing n terms in ``dtype`` in any order, per element.

    Any order of n - 1 additions (a chain around the ring, a tree for halving-doubling) has
    |fl(sum) - sum| <= gamma(n-1) * sum |x_i|, with gamma(k) = k u / (1 - k u) and u the unit
    roundoff of dtype (Higham, Accuracy and Stability of Numerical Algorithms, 4.2). The mean
    divides that sum once: the error is divided by n and one more rounding, u |mean|, is added.
    The oracle itself is rounded to float64 (twice for the mean): 2 u64 |exact| more. Integers
    must be exact.
    """
    if dtype == "int64":
        return torch.zeros(inputs[0].shape, dtype=torch.float64)
    n, u = len(inputs), UNIT_ROUNDOFF[dtype]
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    result = exact(inputs, op).abs()
    bound = gamma * magnitude
    if op == "mean":  # |fl(fl(S)/n) - S/n| <= |fl(S) - S|/n (1 + u) + u |S/n|
        bound = bound / n * (1 + u) + u * result
    return bound + 2 * UNIT_ROUNDOFF["float64"] * result


def assert_exact(got: torch.Tensor, inputs: list[torch.Tensor], op: str, dtype: str) -> None:
    want = exact(inputs, op)
    error = (got.double() - want).abs()
    bound = tolerance(inputs, op, dtype)
    worst = (error - bound).argmax()
    assert torch.all(error <= bound), (f"element {worst.item()}: got {got[worst].item()!r}, exact {want[worst].item()!r}, "
                                      f"error {error[worst].item():.3e} > bound {bound[worst].item():.3e}")


def bandwidth_optimal_bytes(numel: int, n: int, element_size: int) -> int:
    """Reduce-scatter + all-gather: 2(n-1) chunks, each at most ceil(numel/n) elements."""
    return 2 * (n - 1) * math.ceil(numel / n) * element_size


ALL_CASES = [(n, *case) for n in WORLD_SIZES for case in cases(n)]


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("n, variant, numel, dtype, op", ALL_CASES)
def test_every_rank_holds_the_exact_result(grids, n, variant, numel, dtype, op):
    inputs = [rank_input(numel, r, dtype) for r in range(n)]
    for rank, ranks_out in enumerate(grids[n]):
        got = ranks_out["cases"][variant, numel, dtype, op]["result"]
        assert got.dtype == inputs[0].dtype and got.shape == (numel,)
        assert_exact(got, inputs, op, dtype)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_every_rank_holds_the_same_bits(grids, n):
    """Each chunk is reduced once, by its owner, and copied: replicas cannot drift apart."""
    for case in cases(n):
        first = grids[n][0]["cases"][case]["result"]
        assert all(torch.equal(r["cases"][case]["result"], first) for r in grids[n][1:]), case


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_input_tensor_is_reduced_in_place_and_returned(grids, n):
    for case in cases(n):
        for ranks_out in grids[n]:
            outcome = ranks_out["cases"][case]
            assert outcome["is_input"], case
            if n > 1:  # the sum of several ranks' random data differs from any one of them
                assert outcome["changed"], case


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_only_point_to_point_messages_are_used(grids, n):
    for case in cases(n):
        for ranks_out in grids[n]:
            outcome = ranks_out["cases"][case]
            assert outcome["collectives"] == 0, (case, outcome["calls"])
            assert set(outcome["calls"]) <= {"isend", "irecv", "batch_isend_irecv"}, (case, outcome["calls"])
            if n > 1:
                assert outcome["p2p"] > 0, case
            else:
                assert outcome["calls"] == {}, "a world of one has nobody to talk to"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if VARIANTS[v][0] != "halving_doubling"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_and_butterfly_send_at_most_2_n_minus_1_chunks(grids, n, variant):
    for _, numel, dtype, op in (c for c in cases(n) if c[0] == variant):
        element_size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        bound = bandwidth_optimal_bytes(numel, n, element_size)
        for rank, ranks_out in enumerate(grids[n]):
            sent = ranks_out["cases"][variant, numel, dtype, op]["sent_bytes"]
            assert sent <= bound, (rank, numel, dtype, sent, bound)
            if numel >= n > 1:
                assert sent >= 2 * (n - 1) * (numel // n) * element_size, "every rank sends its share"


@pytest.mark.parametrize("variant", ["halving_doubling", "halving_doubling_segmented"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_halving_doubling_sends_the_optimal_bytes_on_powers_of_two_and_the_fold_costs_one_tensor(grids, n, variant):
    """With p the largest power of two <= n: the p core ranks run Rabenseifner (2(p-1)/p of the
    tensor, within 2(n-1)/n); each extra rank sends its tensor once; its partner also returns the result."""
    p = 1 << (n.bit_length() - 1)
    for _, numel, dtype, op in (c for c in cases(n) if c[0] == variant):
        element_size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        core = bandwidth_optimal_bytes(numel, p, element_size)
        assert core <= bandwidth_optimal_bytes(numel, n, element_size) + 2 * element_size * n
        for rank, ranks_out in enumerate(grids[n]):
            sent = ranks_out["cases"][variant, numel, dtype, op]["sent_bytes"]
            if rank >= p:
                expected_max = numel * element_size
            elif rank < n - p:
                expected_max = core + numel * element_size
            else:
                expected_max = core
            assert sent <= expected_max, (rank, numel, dtype, sent, expected_max)
        if n == p:
            assert all(r["cases"][variant, numel, dtype, op]["sent_bytes"] <= bandwidth_optimal_bytes(numel, n, element_size)
                       for r in grids[n])


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_ring_needs_scratch_of_order_numel_over_n_and_keeps_it_for_the_next_call(grids, n):
    chunk_bytes = math.ceil(1003 / n) * 4
    for out in grids[n]:
        first, second = out["ring_scratch"]
        if n == 1:
            assert first == 0  # nothing to exchange
        else:  # at most in_flight chunks (one segment each at the default segment size)
            assert 0 < first <= min(allreduce.IN_FLIGHT, n - 1) * chunk_bytes
        assert second == 0


# --------------------------------------------------------------------------- other inputs


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_a_non_contiguous_tensor_is_reduced_and_its_neighbours_are_untouched(grids, n, variant):
    inputs = [rank_input(2006, r, "float64", salt=1).view(1003, 2) for r in range(n)]
    for rank, ranks_out in enumerate(grids[n]):
        matrix, same_storage, stride = ranks_out["noncontiguous"][variant]
        assert same_storage and stride == (2,), "the view itself is returned"
        assert_exact(matrix[:, 0], [x[:, 0] for x in inputs], "sum", "float64")
        assert torch.equal(matrix[:, 1], inputs[rank][:, 1]), "the other column is not this call's business"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_an_empty_tensor_returns_at_once_without_messages(grids, n, variant):
    for ranks_out in grids[n]:
        returned_input, calls = ranks_out["empty"][variant]
        assert returned_input and calls == {}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_bad_input_is_refused_before_any_message(grids, n, variant):
    for ranks_out in grids[n]:
        refused = ranks_out["refused"][variant]
        assert refused["int_mean"]["error"].startswith("TypeError: op='mean' needs a floating dtype")
        assert refused["unknown_op"]["error"].startswith("ValueError: unknown op 'max'")
        assert refused["int_mean"]["calls"] == {} and refused["unknown_op"]["calls"] == {}


def _mismatched_sizes(ctx):
    x = torch.ones(1000 + 3 * ctx.rank)
    allreduce.ring_allreduce(x, "sum")


def test_mismatched_sizes_fail_the_job_instead_of_hanging(capfd):
    """Rank 1 has 1003 elements, rank 0 has 1000: gloo refuses the larger message (it aborts the
    receiving process) and the launcher fails the whole job; nobody waits for gloo's 30 minutes."""
    start = time.monotonic()
    with pytest.raises(WorkerError) as failure:
        launch(_mismatched_sizes, 2, timeout_s=120, pg_timeout_s=5)
    assert time.monotonic() - start < 90
    assert "failed" in str(failure.value)
    assert "Received data size doesn't match expected size" in capfd.readouterr().err


def test_chunks_differ_by_at_most_one_element():
    for numel in (0, 1, 7, 1000, 1003):
        for parts in (1, 2, 3, 8):
            b = allreduce.bounds(numel, parts)
            lengths = [b[i + 1] - b[i] for i in range(parts)]
            assert b[0] == 0 and b[-1] == numel and max(lengths) - min(lengths) <= 1
