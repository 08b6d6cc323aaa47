"""allreduce.py: ring, butterfly, halving-doubling, recursive-doubling, tree and automatic all-reduce,
against the exact result computed in float64. (The shared-memory transport is tested in test_transport.py.)

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
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import allreduce
from common import CollectiveCounter, doubled_count, run_in_subgroups, run_workers
from dpkit.bench.measure import PeakMemory
from dpkit.comm import message_passing
from dpkit.comm.process_groups import WorkerError, launch

# Rounds of groups over a world of 8; None is the default group (all 8).
ROUNDS = ([[1, 5, 6], [0, 2, 3, 4, 7]], [[0, 3, 5, 6], [2, 7], [4]], [None])
WORLD = 8
WORLD_SIZES = (1, 2, 3, 4, 5, 8)
# Each algorithm with its defaults, and the pipelined ones with tiny segments so that even 1003
# elements take several segments (2 to 16 per chunk for the ring), reusing their scratch rows.
BASE = ("ring", "butterfly", "halving_doubling", "recursive_doubling", "tree", "auto")
VARIANTS = {
    **{name: (name, {}) for name in BASE},
    "ring_segmented": ("ring", {"segment_bytes": 256, "in_flight": 3}),
    "halving_doubling_segmented": ("halving_doubling", {"segment_bytes": 256, "in_flight": 3}),
    "tree_segmented": ("tree", {"segment_bytes": 256, "in_flight": 2}),
}
FLOATS = ("float32", "float64", "float16", "bfloat16")
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
    """(variant, numel, dtype, op): every size, float dtype and op for every algorithm; ``auto`` on every size in
    float32 (it runs one of those algorithms, chosen by bytes:
    ``test_auto_returns_the_bits_of_the_algorithm_it_names``);
    int64 sums; the segmented variants on the largest size only (where segments are many: a case is as slow as
    its number of dependent message hops on an oversubscribed machine)."""
    for variant in BASE:
        for numel in sizes(world_size):
            for dtype in FLOATS if variant != "auto" else ("float32",):
                for op in allreduce.OPS:
                    yield variant, numel, dtype, op
        yield variant, 1003, "int64", "sum"
    for variant in ("ring_segmented", "halving_doubling_segmented", "tree_segmented"):
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


def _column_memory(group) -> tuple[float, float]:
    """allreduce.py's memory column (``call_memory``) for the ring on 1003 float32 elements, after a call that left
    its scratch: (peak bytes, scratch kept)."""
    x = rank_input(1003, dist.get_rank(group), "float32")
    allreduce.ring_allreduce(x, "sum", group)
    return allreduce.call_memory(lambda: allreduce.ring_allreduce(x, "sum", group), "cpu")


def _overflow_inputs(numel: int, rank: int, dtype: str) -> torch.Tensor:
    """Values near the dtype's largest finite value, different per rank: their sum overflows, their mean does not."""
    top = torch.finfo(getattr(torch, dtype)).max
    noise = allreduce.rank_data(SEED + 2, numel, rank)
    return (top * (0.9 - 0.01 * rank + 0.001 * noise)).to(getattr(torch, dtype))


# A crossover table under which the sizes of AUTO_SIZES (float32) run every algorithm once, in this order.
AUTO_TABLE = ((4, "butterfly"), (8, "tree"), (2000, "recursive_doubling"), (4000, "halving_doubling"), (None, "ring"))
AUTO_SIZES = (1, 2, 500, 1000, 1003)


def _auto_against_named(group) -> dict:
    """Per (table, numel, dtype): the algorithm auto chose and whether its result has the bits of that algorithm's."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = {}
    saved = message_passing.CROSSOVER  # auto's table, where the package's allreduce reads it
    try:
        for table in ("real", "every algorithm"):
            if table != "real":
                message_passing.CROSSOVER = {n: AUTO_TABLE}
            for numel in AUTO_SIZES:  # float32: the choice depends on bytes only, the dtypes are the grid's
                auto, named = rank_input(numel, rank, "float32", salt=3), rank_input(numel, rank, "float32", salt=3)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a world size the real table lacks: tested separately
                    name = allreduce.auto_algorithm(auto, group)
                    allreduce.allreduce(auto, "avg", group)
                allreduce.ALGORITHMS[name](named, "avg", group)
                out[table, numel, "float32"] = (name, torch.equal(auto, named))
    finally:
        message_passing.CROSSOVER = saved
    return out


def _checked(group) -> dict:
    """allreduce(check=True) with matching inputs, then with one rank holding 3 elements more."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    matching = rank_input(1003, rank, "float64")
    allreduce.allreduce(matching, "sum", group, check=True)
    mismatched = torch.ones(1000 + 3 * (rank == n - 1))
    with CollectiveCounter() as counter:
        try:
            allreduce.allreduce(mismatched, "sum", group, check=True)
            error = None
        except ValueError as e:
            error = str(e)
    return {"matching": matching, "error": error, "untouched": bool(torch.all(mismatched == 1)),
            "calls": dict(counter.calls)}


def _grid_in(group) -> dict:
    """Every case of this file on one group, as seen by one member."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = {"cases": {case: _run_case(group, *case) for case in cases(n)},
           "noncontiguous": {}, "empty": {}, "refused": {}, "overflow": {}, "ring_scratch": _ring_scratch_bytes(group),
           "column_memory": _column_memory(group),
           "auto": _auto_against_named(group), "checked": _checked(group)}
    for variant in VARIANTS:
        # Every other element of a (1003, 2) matrix: strided, so reduced in a contiguous copy.
        matrix = rank_input(2006, rank, "float64", salt=1).view(1003, 2)
        returned = _call(variant, matrix[:, 0], "sum", group)
        out["noncontiguous"][variant] = (matrix, returned.data_ptr() == matrix.data_ptr(), returned.stride())
        empty = torch.empty(0)
        with CollectiveCounter() as counter:
            returned = _call(variant, empty, "avg", group)
        out["empty"][variant] = (returned is empty, dict(counter.calls))
        out["refused"][variant] = {"int_mean": _refused(variant, torch.arange(6), "avg", group),
                                   "unknown_op": _refused(variant, torch.ones(6), "max", group)}
        for dtype in ("float16", "bfloat16"):
            out["overflow"][variant, dtype] = _call(variant, _overflow_inputs(1003, rank, dtype), "avg", group)
    return out


@pytest.fixture(scope="module")
def grids() -> dict[int, list[dict]]:
    """Group size -> each member's results, in group-rank order."""
    by_size = run_in_subgroups(_grid_in, WORLD, ROUNDS)
    assert sorted(by_size) == list(WORLD_SIZES)
    return by_size


# --------------------------------------------------------------------------- the oracle


# Unit roundoff per dtype. float16 and bfloat16 arithmetic on the CPU computes in float32 and rounds
# the float32 result to the dtype: two roundings, u_dtype + u_float32 (1 + u_dtype) < u_dtype + 2^-23.
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11 + 2.0 ** -23,
                 "bfloat16": 2.0 ** -8 + 2.0 ** -23}


def exact(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The sum (or mean) of the ranks' values, correctly rounded to float64 (``math.fsum`` per element)."""
    columns = torch.stack([x.double() for x in inputs]).T.tolist()
    total = torch.tensor([math.fsum(column) for column in columns], dtype=torch.float64)
    return total / len(inputs) if op == "avg" else total


def tolerance(inputs: list[torch.Tensor], op: str, dtype: str) -> torch.Tensor:
    """The worst-case rounding error of the all-reduce's arithmetic in ``dtype``, in any order, per element.

    Sum: any order of n - 1 additions (a chain around the ring, a tree for halving-doubling) has
    |fl(sum) - sum| <= gamma(n-1) * sum |x_i|, with gamma(k) = k u / (1 - k u) and u the unit
    roundoff of dtype (Higham, Accuracy and Stability of Numerical Algorithms, 4.2).
    Mean: every rank divides its value by n before the sum; each quotient rounds once, by at most
    u |x_i| / n, or by eta (half the smallest subnormal) when it is subnormal, then the n quotients
    are summed as above: (u + gamma(n-1)(1 + u)) sum |x_i| / n + n eta (1 + gamma(n-1)).
    The oracle itself is rounded to float64 (twice for the mean): 2 u64 |exact| more. Integers
    must be exact.
    """
    if dtype == "int64":
        return torch.zeros(inputs[0].shape, dtype=torch.float64)
    n, u = len(inputs), UNIT_ROUNDOFF[dtype]
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    if op == "sum":
        bound = gamma * magnitude
    else:
        finfo = torch.finfo(getattr(torch, dtype))
        eta = finfo.smallest_normal * finfo.eps / 2
        bound = (u + gamma * (1 + u)) * magnitude / n + n * eta * (1 + gamma)
    return bound + 2 * UNIT_ROUNDOFF["float64"] * exact(inputs, op).abs()


def assert_exact(got: torch.Tensor, inputs: list[torch.Tensor], op: str, dtype: str, oracle=None,
                 what: str = "") -> None:
    """``got`` is within ``tolerance`` of ``exact``; ``oracle`` = (exact, tolerance) when already computed."""
    want, bound = oracle if oracle is not None else (exact(inputs, op), tolerance(inputs, op, dtype))
    error = (got.double() - want).abs()
    worst = (error - bound).argmax() if error.numel() else 0
    assert torch.all(error <= bound), (f"{what} element {worst.item()}: got {got[worst].item()!r}, exact "
                                       f"{want[worst].item()!r}, "
                                      f"error {error[worst].item():.3e} > bound {bound[worst].item():.3e}")


def bandwidth_optimal_bytes(numel: int, n: int, element_size: int) -> int:
    """Reduce-scatter + all-gather: 2(n-1) chunks, each at most ceil(numel/n) elements."""
    return 2 * (n - 1) * math.ceil(numel / n) * element_size


ALL_CASES = [(n, *case) for n in WORLD_SIZES for case in cases(n)]


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("n, numel, dtype, op", sorted({case[:1] + case[2:] for case in ALL_CASES}))
def test_every_rank_holds_the_exact_result(grids, n, numel, dtype, op):
    """Every variant on this input, against one oracle (computing it costs more than comparing)."""
    inputs = [rank_input(numel, r, dtype) for r in range(n)]
    want, bound = exact(inputs, op), tolerance(inputs, op, dtype)
    variants = [variant for variant, *rest in cases(n) if tuple(rest) == (numel, dtype, op)]
    for variant in variants:
        for rank, ranks_out in enumerate(grids[n]):
            got = ranks_out["cases"][variant, numel, dtype, op]["result"]
            assert got.dtype == inputs[0].dtype and got.shape == (numel,)
            assert_exact(got, inputs, op, dtype, (want, bound), f"{variant} on rank {rank}")


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
            if n == 1:
                assert outcome["calls"] == {}, "a world of one has nobody to talk to"
            else:
                assert outcome["p2p"] > 0, case


@pytest.mark.parametrize("variant", ["ring", "ring_segmented", "butterfly"])
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
            optimal = bandwidth_optimal_bytes(numel, n, element_size)
            assert all(r["cases"][variant, numel, dtype, op]["sent_bytes"] <= optimal for r in grids[n])


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_benchmarks_memory_column_counts_the_scratch_kept_between_calls(grids, n):
    """Measured on a warm ring (an earlier call's scratch still held, which the call would reuse without
    allocating): the column's peak still holds the scratch the call keeps, and that scratch is what the ring
    needs (see the test below)."""
    for out in grids[n]:
        peak, kept = out["column_memory"]
        if n == 1:
            assert peak == kept == 0  # nothing to exchange
        else:
            assert 0 < kept <= peak and kept == out["ring_scratch"][0], (peak, kept, out["ring_scratch"])


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


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_recursive_doubling_sends_the_whole_tensor_once_per_step(grids, n):
    """log2(p) exchanges of the whole tensor; a folded extra rank sends it once, its partner once more."""
    p = 1 << (n.bit_length() - 1)
    for _, numel, dtype, op in (c for c in cases(n) if c[0] == "recursive_doubling"):
        tensor_bytes = numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        for rank, ranks_out in enumerate(grids[n]):
            steps = 1 if rank >= p else (p.bit_length() - 1) + (rank < n - p)
            assert ranks_out["cases"]["recursive_doubling", numel, dtype, op]["sent_bytes"] == steps * tensor_bytes


@pytest.mark.parametrize("variant", ["tree", "tree_segmented"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_the_tree_sends_the_tensor_once_up_and_once_to_each_child(grids, n, variant):
    for _, numel, dtype, op in (c for c in cases(n) if c[0] == variant):
        tensor_bytes = numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        for rank, ranks_out in enumerate(grids[n]):
            children = sum(child < n for child in (2 * rank + 1, 2 * rank + 2))
            sends = (rank > 0) + children
            assert ranks_out["cases"][variant, numel, dtype, op]["sent_bytes"] == sends * tensor_bytes


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_auto_returns_the_bits_of_the_algorithm_it_names(grids, n):
    for ranks_out in grids[n]:
        for key, (name, same_bits) in ranks_out["auto"].items():
            assert same_bits, (key, name)
    if n > 1:  # the test table sends each size to a different algorithm: every branch of the choice is exercised
        chosen = [grids[n][0]["auto"]["every algorithm", numel, "float32"][0] for numel in AUTO_SIZES]
        assert chosen == [name for _, name in AUTO_TABLE]
        # The real choice is CROSSOVER's (the nearest measured world size's), whatever the host.
        for (table, numel, dtype), (name, _) in grids[n][0]["auto"].items():
            if table == "real":
                nbytes = numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
                assert name == allreduce.choose_algorithm(nbytes, n, warn=False), (numel, dtype, name)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [n for n in WORLD_SIZES if n > 1])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_mean_whose_sum_overflows_the_dtype_is_still_exact(grids, n, variant, dtype):
    """Each rank divides by n before the sum: values near the largest finite one average without inf."""
    inputs = [_overflow_inputs(1003, r, dtype) for r in range(n)]
    largest = torch.finfo(getattr(torch, dtype)).max
    assert torch.all(exact(inputs, "sum").abs() > largest), "the premise: the sum is not representable"
    for ranks_out in grids[n]:
        got = ranks_out["overflow"][variant, dtype]
        assert torch.isfinite(got).all()
        assert_exact(got, inputs, "avg", dtype)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_check_names_both_sizes_before_any_data_is_sent(grids, n):
    inputs = [rank_input(1003, r, "float64") for r in range(n)]
    for ranks_out in grids[n]:
        checked = ranks_out["checked"]
        assert_exact(checked["matching"], inputs, "sum", "float64")
        if n == 1:
            assert checked["error"] is None and checked["calls"] == {}
            continue
        assert checked["error"].startswith("all-reduce needs the same input on every rank"), checked["error"]
        assert "rank 0 has 1000 elements" in checked["error"] and f"rank {n - 1} has 1003 elements" in checked["error"]
        assert checked["untouched"], "refused before the data is reduced"
        assert checked["calls"].keys() <= {"isend", "irecv", "batch_isend_irecv"}, checked["calls"]


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
        assert refused["int_mean"]["error"].startswith("TypeError: op='avg' needs a floating dtype")
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


def test_an_unknown_algorithm_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown algorithm 'fastest': choose one of auto, ring, butterfly, "
                                         "halving_doubling, recursive_doubling, tree"):
        allreduce.allreduce(torch.ones(3), algorithm="fastest")


def test_a_world_size_without_a_measured_crossover_uses_the_nearest_and_says_so_once():
    table = {2: ((100, "recursive_doubling"), (None, "ring")), 8: ((1000, "tree"), (None, "halving_doubling"))}
    allreduce.reset_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = [allreduce.choose_algorithm(nbytes, 6, table) for nbytes in (50, 500, 5000)]
        assert allreduce.choose_algorithm(50, 3, table) == "recursive_doubling"  # log2(3) is nearer 1 than 3
    assert chosen == ["tree", "tree", "halving_doubling"]  # log2(6) = 2.58 is nearer 3 (8) than 1 (2)
    messages = [str(w.message) for w in caught]
    assert sum("no crossover measured for 6 processes; using the table of 8" in m for m in messages) == 1, messages
    assert sum("for 3 processes; using the table of 2" in m for m in messages) == 1, messages
    assert allreduce.choose_algorithm(10 ** 9, 2, table) == "ring" and len(caught) == 2


def test_the_homework_table_shows_auto_its_choice_and_its_ratio_to_torch_with_a_verdict():
    def row(algorithm, seconds, world, ratio=None, ci=(None, None), choice=None):
        return {"world_size": world, "numel": 1000, "dtype": "float32", "algorithm": algorithm, "time_s": seconds,
                "time_p90_s": seconds, "round_time_s": [seconds] * 8, "vs_torch": ratio, "vs_torch_ci_low": ci[0],
                "vs_torch_ci_high": ci[1], "choice": choice, "oversubscribed": world > 2, "memory_bytes": 0,
                "max_abs_error": 0.0, "axis": "algorithm", "transport": "gloo"}
    rows = [row("torch", 1e-3, 2, 1.0, (1.0, 1.0)), row("auto", 0.9e-3, 2, 0.9, (0.8, 1.0), "recursive_doubling"),
            row("torch", 1e-3, 4, 1.0, (1.0, 1.0)), row("auto", 1.3e-3, 4, 1.3, (1.2, 1.4), "tree"),
            row("torch", 1e-3, 8, 1.0, (1.0, 1.0)), row("auto", 1.3e-3, 8, 1.3, (1.0, 1.6), "tree")]
    text = allreduce.report(rows)
    assert text.startswith("## Every algorithm, all over gloo (")  # algorithm against algorithm, one wire
    assert "| 2 | 1000 | 1.000 | 0.900 | RD | 0.90x [0.80, 1.00] |" in text
    assert "target auto <= 1.10x torch, 2 processes, 1000 elements: 0.90x [0.80, 1.00] met" in text
    assert "target auto <= 1.10x torch, 4 processes, 1000 elements: 1.30x [1.20, 1.40] missed [oversubscribed" in text
    assert "8 processes, 1000 elements" not in text  # the target is stated for 2 and 4 processes
    stored = allreduce.targets(rows)  # what the results file keeps beside the rows
    assert [(t["world_size"], t["verdict"], t["oversubscribed"]) for t in stored] == [(2, "met", False),
                                                                                      (4, "missed", True)]
    assert allreduce.BENCHMARK.targets is allreduce.targets


def _homework_rows(ctx) -> list[dict]:
    return allreduce.compare_worker(ctx, [1000], ["torch", "ring", "auto"], repeats=3, warmup=1, seed=0,
                                    dtype="float32", batch_s=2e-3)


def test_the_homework_comparison_times_batches_of_calls_paired_round_by_round_with_torch():
    first, second = run_workers(_homework_rows, 2)
    assert first == second, "times and errors: each the worst rank's"
    assert [r["algorithm"] for r in first] == ["torch", "ring", "auto"]
    for row in first:
        assert doubled_count(row), row
        assert len(row["round_time_s"]) == 3 and row["time_s"] == pytest.approx(np.median(row["round_time_s"]))
        assert row["vs_torch"] == pytest.approx(np.median(np.divide(row["round_time_s"], first[0]["round_time_s"])))
        assert row["max_abs_error"] < 1e-6 and row["memory_bytes"] >= 0
    assert first[0]["vs_torch"] == 1.0 and first[2]["choice"] == allreduce.choose_algorithm(4000, 2, warn=False)


# --------------------------------------------------------------------------- auto's table, a results file


def test_auto_reads_its_crossover_from_the_results_file_and_keeps_the_defaults_for_world_sizes_it_lacks(tmp_path):
    from dpkit.bench.results import environment, write_results

    path = str(tmp_path / "crossover.json")
    assert allreduce.load_crossover(path) == allreduce.DEFAULT_CROSSOVER, "no file: the defaults"
    measured = {2: ((1 << 20, "tree"), (None, "ring")), 16: ((None, "butterfly"),)}
    write_results(path, "collectives_benchmark --tune", environment("gloo", "cpu", 2), {},
                  allreduce.crossover_rows(measured))
    table = allreduce.load_crossover(path)
    assert table[2] == measured[2] and table[16] == measured[16], "the file's rows win"
    assert table[4] == allreduce.DEFAULT_CROSSOVER[4], "a world size the file lacks keeps its default"
    assert allreduce.choose_algorithm(1 << 20, 2, table) == "tree"
    assert allreduce.choose_algorithm(2 << 20, 2, table) == "ring"


@pytest.mark.parametrize("entries, message", [(((None, "fastest"),), "unknown algorithms"),
                                               (((1 << 20, "ring"),), "no open-ended last entry")])
def test_a_crossover_file_that_auto_cannot_use_is_named_with_what_is_wrong(tmp_path, entries, message):
    from dpkit.bench.results import environment, write_results

    path = str(tmp_path / "crossover.json")
    write_results(path, "collectives_benchmark --tune", environment("gloo", "cpu", 2), {},
                  allreduce.crossover_rows({2: entries}))
    with pytest.raises(ValueError, match=f"crossover.json: the row of 2 processes .*{message}.*--tune"):
        allreduce.load_crossover(path)


def test_auto_on_a_gpu_takes_torch_unless_a_table_was_measured_on_that_device(tmp_path):
    from dpkit.bench.results import environment, write_results

    path = str(tmp_path / "crossover.json")
    assert allreduce.load_crossover(path, "cuda") == {}, "nothing measured on cuda: no table (auto takes torch)"
    on_cpu, on_gpu = {2: ((None, "tree"),)}, {2: ((1 << 20, "ring"), (None, "butterfly"))}
    rows = allreduce.crossover_rows(on_cpu) + allreduce.crossover_rows(on_gpu, "cuda")
    write_results(path, "collectives_benchmark --tune", environment("gloo", "cpu", 2), {}, rows)
    assert allreduce.load_crossover(path, "cuda") == on_gpu
    assert allreduce.load_crossover(path)[2] == on_cpu[2], "each device reads its own rows"
