"""collectives_benchmark.py: what it measures (run on 2 spawned workers and checked against numbers the test
computes itself), its exact correctness pattern, the model fit, the crossover table, the targets and the chart."""

import math

import numpy as np
import pytest
import torch

import allreduce
import collectives_benchmark as bench
from common import run_workers

SIZES = (4000, 64 << 10)  # the homework's 1,000 float32 elements, and one size of several chunks


def _broken(tensor, op="mean", group=None):
    """A wrong all-reduce: the ring's result with rank 0's first element off by one."""
    allreduce.ring_allreduce(tensor, op, group)
    if torch.distributed.get_rank(group) == 0 and tensor.numel():
        tensor[0] += 1
    return tensor


def _measure(ctx) -> dict:
    allreduce.ALGORITHMS["broken"] = _broken  # this worker only: the benchmark looks algorithms up by name
    pipeline = {"segment_bytes": allreduce.SEGMENT_BYTES, "in_flight": allreduce.IN_FLIGHT}
    rows = [row for nbytes in SIZES
            for row in bench.benchmark_size(ctx, nbytes, [*allreduce.ALGORITHMS], iters=3, warmup=1, pipeline=pipeline)]
    return {"rows": rows, "p2p": bench.point_to_point(ctx, iters=3, warmup=1, sizes=(4, 4000))}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    """Every rank's rows from one spawned group of 2."""
    return run_workers(_measure, 2)


def test_every_rank_reports_the_same_rows(measured):
    first, second = measured
    assert [r["p50_s"] for r in first["rows"]] == [r["p50_s"] for r in second["rows"]]  # maxima over ranks


def test_each_size_has_one_row_per_algorithm_with_its_bytes(measured):
    rows = measured[0]["rows"]
    names = [*allreduce.ALGORITHMS, "broken"]  # the workers added the wrong one
    assert [(r["bytes"], r["algorithm"]) for r in rows] == [(s, a) for s in SIZES for a in names]
    assert all(r["world_size"] == 2 and not r["oversubscribed"] for r in rows)


def test_small_messages_get_more_timed_calls(measured):
    """Up to 1 MiB a size gets 4 times --iters rounds (one call each); above it, --iters."""
    assert bench.calls(4000, 3) == bench.calls(1 << 20, 3) == 12
    assert bench.calls((1 << 20) + 1, 3) == bench.calls(100 << 20, 3) == 3
    assert {r["rounds"] for r in measured[0]["rows"]} == {12}  # both measured sizes are small
    assert all(len(r["round_p50_s"]) == 12 for r in measured[0]["rows"])


def test_bandwidths_follow_from_bytes_and_time(measured):
    """algbw = bytes / mean time; busbw = algbw x 2(n-1)/n (nccl-tests), computed here from the row's own numbers."""
    for row in measured[0]["rows"]:
        algbw = row["bytes"] / row["avg_s"] / 1e9
        assert row["algbw_gbps"] == pytest.approx(algbw, rel=1e-12)
        assert row["busbw_gbps"] == pytest.approx(algbw * 2 * (2 - 1) / 2, rel=1e-12)
        assert 0 < row["min_s"] <= row["p50_s"] <= row["p95_s"]


def test_every_real_algorithm_is_exact_and_a_wrong_one_is_flagged(measured):
    for row in measured[0]["rows"]:
        if row["algorithm"] == "broken":
            assert row["max_abs_error"] == 1.0 and not row["correct"]
        else:
            assert row["max_abs_error"] == 0.0 and row["correct"], row
    text = bench.report(measured[0]["rows"])
    assert f"correctness: {len(SIZES)} WRONG results" in text


def test_ratios_pair_each_call_with_torchs_call_of_the_same_round(measured):
    for row in measured[0]["rows"]:
        low, high = row["vs_torch_ci_low"], row["vs_torch_ci_high"]
        assert low <= row["vs_torch"] <= high
        if row["algorithm"] == "torch":
            assert row["vs_torch"] == low == high == 1.0
    auto = [r for r in measured[0]["rows"] if r["algorithm"] == "auto"]
    assert [r["choice"] for r in auto] == ["shared_memory"] * len(SIZES), "two ranks on one host: shared memory"


def test_one_step_of_each_engine_is_timed_with_its_bytes(measured):
    p2p = measured[0]["p2p"]
    assert [(r["engine"], r["bytes"]) for r in p2p] == [("ours", 4), ("gloo", 4), ("ours", 4000), ("gloo", 4000)]
    for row in p2p:
        moved = row["bytes"] if row["engine"] == "ours" else row["bytes"] / 2  # gloo's ring on 2 ranks: 2 half steps
        assert row["step_gbps"] == pytest.approx(moved / row["step_s"] / 1e9, rel=1e-12)


# --------------------------------------------------------------------------- no processes


def _row(algorithm, seconds, nbytes=10 << 20, world=2, ratio=None, ci=None, oversubscribed=False, correct=True,
         choice=None):
    return {"backend": "gloo", "world_size": world, "algorithm": algorithm, "bytes": nbytes, "avg_s": seconds,
            "p50_s": seconds, "p95_s": seconds, "algbw_gbps": 1.0, "busbw_gbps": 1.0, "vs_torch": ratio,
            "vs_torch_ci_low": ci[0] if ci else None, "vs_torch_ci_high": ci[1] if ci else None,
            "oversubscribed": oversubscribed, "choice": choice,
            "max_abs_error": 0.0 if correct else 2.0, "correct": correct}


def test_sizes_are_powers_of_two_units_like_nccl_tests():
    assert [bench.parse_size(s) for s in ("4096", "64KB", "10MB", "1GB", "1.5MB", "64KiB", "10mib", "1G")] == [
        4096, 65536, 10 << 20, 1 << 30, 3 << 19, 65536, 10 << 20, 1 << 30]
    assert [bench.format_size(n) for n in (65536, 10 << 20, 1 << 30, 1000)] == ["64KiB", "10MiB", "1GiB", "1000B"]
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


def test_targets_give_the_interval_and_a_verdict_and_label_oversubscribed_runs():
    lines = bench.target_lines([
        _row("torch", 0.1, ratio=1.0, ci=[1.0, 1.0]),
        _row("auto", 0.09, nbytes=4000, ratio=0.9, ci=[0.85, 0.97]),
        _row("auto", 0.105, ratio=1.05, ci=[1.02, 1.08]),
        _row("auto", 0.2, nbytes=100 << 20, world=4, ratio=1.3, ci=[1.2, 1.4], oversubscribed=True),
        _row("ring", 0.105, ratio=1.05, ci=[0.9, 1.2]),
    ])
    assert "target auto <= 1.10x torch, 2 processes, 4000B: 0.90x [0.85, 0.97] met" in lines
    assert "target auto <= 1.10x torch, 2 processes, 10MiB: 1.05x [1.02, 1.08] met" in lines
    assert "target auto <= 1.00x torch, 2 processes, 10MiB: 1.05x [1.02, 1.08] missed" in lines
    assert any(line.startswith("target auto <= 1.00x torch, 4 processes, 100MiB: 1.30x [1.20, 1.40] missed [oversubscribed")
               for line in lines)
    assert "target ring <= 1.10x torch, 2 processes, 10MiB: 1.05x [0.90, 1.20] inconclusive" in lines
    assert len(lines) == 6  # auto at 4000 B has no 1.00 target; torch has none


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_model_fit_recovers_known_alpha_and_beta(world):
    """Times made by the model itself (alpha 150 us, 0.5 GB/s) must give back exactly those parameters."""
    alpha, beta = 150e-6, 2e-9
    sizes = [4000, 1 << 16, 1 << 20, 10 << 20, 100 << 20]
    rows = []
    for name in ("torch", "ring", "butterfly", "halving_doubling", "recursive_doubling", "tree"):
        for nbytes in sizes:
            steps, moved = bench.model_terms(name, world, nbytes)
            rows.append(_row(name, steps * alpha + moved * beta, nbytes=nbytes, world=world))
    rows.append(_row("auto", 1.0, world=world))  # not a model of its own: ignored
    fits = bench.fit_model(rows)
    assert len(fits) == 6
    for fit in fits:
        assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6) and fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
        assert fit["max_rel_error"] < 1e-6
        assert bench.predict(fit, 1 << 22) == pytest.approx(sum(np.multiply(bench.model_terms(fit["algorithm"], world, 1 << 22),
                                                                            (alpha, beta))))


def test_the_steps_are_those_of_each_algorithm():
    assert bench.model_terms("recursive_doubling", 8, 4000) == (3, 3 * 4000)
    assert bench.model_terms("recursive_doubling", 6, 4000) == (2 + 2, 4 * 4000)  # p = 4, folded in and out
    assert bench.model_terms("ring", 4, 4000) == (6, 1.5 * 4000)
    assert bench.model_terms("halving_doubling", 4, 4000) == (4, 1.5 * 4000)
    assert bench.model_terms("tree", 2, 4000)[0] == 2 and bench.model_terms("tree", 7, 4000)[0] == 4


def test_the_crossover_table_keeps_the_fastest_ignores_a_one_size_flip_and_bounds_at_the_geometric_mean():
    sizes = [4096 << (2 * i) for i in range(7)]
    times = {size: {"recursive_doubling": 1 if i < 2 else 2, "ring": 2 if i < 2 else 1, "tree": 0.97 if i == 4 else 2}
             for i, size in enumerate(sizes)}  # recursive doubling, then the ring; the tree 3 % ahead at one size only
    rows = [_row(name, t, nbytes=size, world=4) for size, by_name in times.items() for name, t in by_name.items()]
    rows.append(_row("torch", 0.001, nbytes=4096, world=4))  # not ours: never chosen
    table = bench.crossover_table(rows)
    assert table == {4: ((int(math.sqrt(sizes[1] * sizes[2])), "recursive_doubling"), (None, "ring"))}
    namespace = {}
    exec(bench.format_table(table), namespace)  # the printed table is the Python literal to paste
    assert namespace["CROSSOVER"] == table
    assert [allreduce.choose_algorithm(s, 4, table) for s in sizes] == ["recursive_doubling"] * 2 + ["ring"] * 5


def test_the_per_size_chart_marks_the_algorithm_auto_chose():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [_row("ring", 3e-3, nbytes=4000), _row("recursive_doubling", 1e-3, nbytes=4000),
            _row("ring", 5e-3, nbytes=1 << 20), _row("recursive_doubling", 9e-3, nbytes=1 << 20),
            _row("auto", 1.1e-3, nbytes=4000, choice="recursive_doubling"), _row("auto", 5.2e-3, nbytes=1 << 20, choice="ring")]
    figure, ax = plt.subplots()
    bench.draw_per_size(ax, rows, "gloo", 2)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(ax.get_legend_handles_labels()[1]) == {"ring", "recursive doubling", "auto (measured)", "auto's choice"}
    assert list(lines["auto's choice"].get_xdata()) == [4000, 1 << 20]
    assert list(lines["auto's choice"].get_ydata()) == pytest.approx([1.0, 5.0])  # ms: RD's point, then the ring's
    plt.close(figure)


def test_quick_and_tune_fill_defaults_but_explicit_flags_win():
    quick = bench.parse_args(["--quick", "--iters", "7"])
    assert quick.iters == 7 and quick.warmup == bench.QUICK["warmup"] and quick.procs == bench.QUICK["procs"]
    tune = bench.parse_args(["--tune", "--procs", "2"])
    assert tune.procs == [2] and tune.algorithms == list(allreduce.CUSTOM)
    assert tune.sizes == [bench.parse_size(s) for s in bench.TUNE_SIZES]
    plain = bench.parse_args([])
    assert plain.iters == 20 and plain.sizes == [bench.parse_size(s) for s in bench.DEFAULT_SIZES]


def test_the_sharded_collectives_have_their_own_targets_and_sizes_rounded_to_the_world():
    rows = [{**_row("torch", 0.1, ratio=1.0, ci=[1.0, 1.0]), "collective": "reduce_scatter"},
            {**_row("ring", 0.06, nbytes=(10 << 20) - 8, ratio=0.6, ci=[0.55, 0.65]), "collective": "reduce_scatter"},
            {**_row("ring", 0.12, ratio=1.2, ci=[1.15, 1.25]), "collective": "all_gather"}]
    text = bench.report(rows)
    assert "target ring reduce_scatter <= 0.70x torch, 2 processes, 10MiB: 0.60x [0.55, 0.65] met" in text
    assert "target ring all_gather <= 1.10x torch, 2 processes, 10MiB: 1.20x [1.15, 1.25] missed" in text
    assert "target auto" not in text and "target ring <= " not in text  # the all-reduce targets are all-reduce's


def test_a_sharded_collective_takes_its_own_algorithms():
    assert bench.parse_args(["--collective", "all_gather"]).algorithms == ["torch", "ring", "shared_memory"]
    assert bench.parse_args(["--collective", "reduce_scatter"]).algorithms == ["torch", "ring"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--collective", "reduce_scatter", "--algorithms", "butterfly"])
