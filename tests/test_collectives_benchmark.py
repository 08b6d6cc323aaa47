"""collectives_benchmark.py: its size parsing, its exact correctness pattern and its report (no processes spawned:
the algorithms it times are tested in test_allreduce.py)."""

import pytest
import torch

import collectives_benchmark as bench


def test_sizes_are_powers_of_two_units_like_nccl_tests():
    assert [bench.parse_size(s) for s in ("4096", "64KB", "10MB", "1GB", "1.5MB")] == [4096, 65536, 10 << 20, 1 << 30, 3 << 19]
    assert [bench.format_size(n) for n in (65536, 10 << 20, 1 << 30, 1000)] == ["64KB", "10MB", "1GB", "1000B"]
    with pytest.raises(Exception, match="not a size"):
        bench.parse_size("ten megabytes")


@pytest.mark.parametrize("numel", [1, 1000, 1024, 5000, 4096 * 1024 + 3])
def test_the_pattern_sums_exactly_and_any_wrong_element_shows(numel):
    world = 6
    total = torch.zeros(numel, dtype=torch.float32)
    for rank in range(world):
        x = torch.empty(numel, dtype=torch.float32)
        bench.fill_pattern(x, rank)
        assert x[0].item() == rank and x[-1].item() == (numel - 1) % bench.PERIOD + rank
        total += x  # in float32, in rank order: the pattern's sums are exact whatever the order
    assert bench.pattern_error(total, world) == 0.0
    total[numel // 2] += 1
    assert bench.pattern_error(total, world) == 1.0


def _row(algorithm, seconds, nbytes=10 << 20, correct=True):
    return {"backend": "gloo", "world_size": 2, "algorithm": algorithm, "bytes": nbytes, "avg_s": seconds, "p50_s": seconds,
            "p95_s": seconds, "algbw_gbps": nbytes / seconds / 1e9, "busbw_gbps": nbytes / seconds / 1e9,
            "vs_torch": seconds / 0.1, "max_abs_error": 0.0 if correct else 2.0, "correct": correct}


def test_the_report_states_the_target_and_whether_it_is_met():
    text = bench.report([_row("torch", 0.1), _row("ring", 0.105), _row("ring", 0.2, nbytes=100 << 20)])
    assert "target ring <= 1.10 x torch, 2 processes, 10MB: 1.05 x (met)" in text
    assert "target ring <= 1.10 x torch, 2 processes, 100MB: 2.00 x (NOT met)" in text
    assert "correctness: all exact" in text
    assert "1 WRONG" in bench.report([_row("ring", 0.1, correct=False)])


def test_the_sharded_collectives_have_their_own_targets_and_sizes_rounded_to_the_world():
    rows = [{**_row("torch", 0.1), "collective": "reduce_scatter"},
            {**_row("ring", 0.06, nbytes=(10 << 20) - 8), "collective": "reduce_scatter"},
            {**_row("ring", 0.12), "collective": "all_gather"}]
    text = bench.report(rows)
    assert "target ring reduce_scatter <= 0.70 x torch, 2 processes, 10MB: 0.60 x (met)" in text
    assert "target ring all_gather <= 1.10 x torch, 2 processes, 10MB: 1.20 x (NOT met)" in text


def test_a_sharded_collective_takes_its_own_algorithms():
    assert bench.parse_args(["--collective", "all_gather"]).algorithms == ["torch", "ring"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--collective", "reduce_scatter", "--algorithms", "butterfly"])
