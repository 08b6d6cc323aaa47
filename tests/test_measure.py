"""Measurement: percentiles, peak memory, saved bytes, interleaved timing, confidence intervals, verdicts."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from common import REPO
from dpkit.bench import measure
from dpkit.bench.measure import PeakMemory, bootstrap_ci, paired_ratio, percentile, saved_tensor_bytes, verdict


def test_percentile_interpolates_like_numpy():
    samples = [0.3, 0.1, 0.4, 0.15, 0.9, 0.2]
    for q in (0, 50, 75, 90, 95, 100):
        assert percentile(samples, q) == pytest.approx(np.percentile(samples, q))


def test_peak_memory_on_cpu_sees_torch_allocations_and_their_frees():
    with PeakMemory("cpu") as peak:
        big = torch.empty(1_000_000)  # 4 MB, freed before the 1 MB one is made
        del big
        small = torch.empty(250_000)
    assert 4_000_000 <= peak.bytes < 4_100_000
    with PeakMemory("cpu") as nothing:
        small.add_(1)  # in place: no new memory
    assert nothing.bytes < 1_000


def test_saved_tensor_bytes_counts_each_saved_storage_once():
    x = torch.randn(1000, requires_grad=True)
    w = torch.randn(1000)
    assert saved_tensor_bytes(lambda: (x * w).sum()) == 4000  # d/dx needs w only
    w.requires_grad_()
    assert saved_tensor_bytes(lambda: (x * w).sum()) == 8000  # now both, 4000 bytes each
    assert saved_tensor_bytes(lambda: (x * x).sum()) == 4000  # x saved twice, stored once
    assert saved_tensor_bytes(lambda: (x + w).sum()) == 0
    assert saved_tensor_bytes(lambda: (x * w).sum(), exclude=[w]) == 4000  # e.g. parameters left out: x only


def test_time_interleaved_rotates_the_order_and_runs_setup_before_every_call():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    timings = measure.time_interleaved(fns, iters=3, warmup=1, rounds=2, setup=lambda: calls.append("setup"))
    assert {name: t.per_rank.shape for name, t in timings.items()} == {"a": (1, 3), "b": (1, 3)}
    # Round 1: a (warm-up + 2 timed), then b (same); round 2, rotated: b then a, 1 timed call each.
    assert [c for c in calls if c != "setup"] == ["a"] * 3 + ["b"] * 3 + ["b", "a"]
    assert calls[0::2] == ["setup"] * 8, "setup precedes every call, warm-up included"


def test_a_batch_of_calls_lasts_at_least_the_time_asked_and_less_than_twice_it(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])  # a clock that only the calls move

    def lasting(call_s: float, limit: int = 1 << 16) -> int:
        return measure.calls_lasting(lambda: now.__setitem__(0, now[0] + call_s), 0.02, limit)
    assert lasting(1e-3) == 32  # 16 calls of 1 ms last 16 ms, short of a batch of 20 ms; 32 last 32 ms
    assert lasting(1e-6) == 32_768
    assert lasting(1e-6, limit=5_000) == 5_000  # at most the limit
    assert lasting(0.08) == 1  # a call longer than the batch: alone

    stalls = iter([0.0, 0.005])  # the first timed call (after the untimed one) stalls for 5 ms: the batch stays whole
    assert measure.calls_lasting(lambda: now.__setitem__(0, now[0] + 1e-3 + next(stalls, 0.0)), 0.02, 1 << 16) == 32
    # Calls 1 (untimed) and 2 to 16 (tries of 1 to 8) come first; call 17 opens the first try of 16 calls and
    # stalls for 5 ms: that try lasts 21 ms, the next 16: the stall does not halve the batch.
    stalls = iter([0.0] * 16 + [0.005])
    assert measure.calls_lasting(lambda: now.__setitem__(0, now[0] + 1e-3 + next(stalls, 0.0)), 0.02, 1 << 16) == 32
    stalls = iter([0.0] * 16 + [0.005])
    assert measure.calls_lasting(lambda: now.__setitem__(0, now[0] + 1e-3 + next(stalls, 0.0)), 0.02, 1 << 16,
                                 tries=1) == 16, "one try: the stall makes the count"


def test_batches_of_each_function_are_counted_apart_and_timed_per_call(monkeypatch):
    now, calls = [0.0], []
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])  # a clock that only the calls move

    def taking(name: str, call_s: float):
        return lambda: (calls.append(name), now.__setitem__(0, now[0] + call_s))
    fns = {"fast": taking("fast", 1e-3), "slow": taking("slow", 0.03)}
    timings, counts = measure.time_batches(fns, iters=2, warmup=0, rounds=2, setup=lambda: calls.append("setup"),
                                           seconds=0.02)
    assert counts == {"fast": 32, "slow": 1}  # each its own count: 32 calls of 1 ms, one of 30 ms, last 20 ms
    assert timings["fast"].samples == pytest.approx([1e-3] * 2)  # per call: a batch's time over its count
    assert timings["slow"].samples == pytest.approx([0.03] * 2)
    timed = calls[calls.index("setup", 1):]  # after the counts: setup, then a whole batch, in every round
    assert timed == ["setup", *["fast"] * 32, "setup", "slow", "setup", "slow", "setup", *["fast"] * 32]


def test_bootstrap_interval_covers_the_median_and_narrows_with_more_rounds():
    rng = np.random.default_rng(1)
    few, many = rng.normal(1.0, 0.1, 5), rng.normal(1.0, 0.1, 200)
    low_few, high_few = bootstrap_ci(few)
    low_many, high_many = bootstrap_ci(many)
    assert low_few <= np.median(few) <= high_few
    assert low_many <= np.median(many) <= high_many
    assert high_many - low_many < (high_few - low_few) / 2, "40x the rounds: about 6x narrower"
    assert bootstrap_ci(few) == (low_few, high_few), "a fixed seed: a report renders the same interval every time"
    assert bootstrap_ci([0.7]) == (0.7, 0.7)
    with pytest.raises(ValueError, match="no values"):
        bootstrap_ci([])


def test_bootstrap_interval_of_a_known_distribution_has_its_nominal_coverage():
    # The median of 30 draws from N(0, 1): the 95 % interval must contain 0 in about 95 % of trials.
    rng = np.random.default_rng(2)
    covered = sum(low <= 0 <= high for low, high in (bootstrap_ci(rng.normal(0, 1, 30), resamples=2000)
                                                     for _ in range(200)))
    assert 0.88 * 200 <= covered <= 200


def test_paired_ratio_pairs_rounds_so_common_drift_cancels():
    theirs = [1.0, 2.0, 4.0, 8.0]  # the machine slows down round after round
    ours = [1.1 * t for t in theirs]  # but ours is always 10 % slower in the same round
    ratio = paired_ratio(ours, theirs)
    assert ratio["median"] == pytest.approx(1.1) and ratio["rounds"] == 4
    assert ratio["ci_low"] == pytest.approx(1.1) and ratio["ci_high"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="same non-zero number of rounds"):
        paired_ratio([1.0], [1.0, 2.0])


def test_verdict_is_inconclusive_when_the_interval_straddles_the_target():
    assert verdict({"ci_low": 0.90, "ci_high": 0.99}, 1.0) == "met"
    assert verdict({"ci_low": 0.95, "ci_high": 1.00}, 1.0) == "met"
    assert verdict({"ci_low": 1.01, "ci_high": 1.20}, 1.0) == "missed"
    assert verdict({"ci_low": 0.98, "ci_high": 1.02}, 1.0) == "inconclusive"


def test_oversubscribed_means_more_cpu_processes_than_cores():
    assert measure.oversubscribed(3, "cpu", cpus=2) and not measure.oversubscribed(2, "cpu", cpus=2)
    assert not measure.oversubscribed(8, "cuda", cpus=2), "one process per GPU: the cores are not what is shared"


def test_silencing_the_profiler_drops_only_its_status_lines_from_stderr(capfd):
    """fd 2 is process-wide: an error another thread (gloo's) writes while the profiler starts
    must still reach stderr; kineto's status lines must not."""
    kineto = "USDT:2026-11-23 16:08:23 28571:28571 SyncActivityProfilerHandler.cpp:39] profiler_start\n"
    allocator = ("[W1123 16:08:23.372208583 CPUAllocator.cpp:245] Memory block of unknown size was allocated before "
                 "the profiling started\n")
    gloo = "[E1123 16:08:23.1 ProcessGroupGloo.cpp:143] Gloo connectFullMesh failed: Connection reset by peer\n"
    with measure.quiet_stderr():
        for line in (kineto, gloo, allocator):
            os.write(2, line.encode())
    assert capfd.readouterr().err == gloo
    with PeakMemory("cpu"):
        torch.ones(8)
    assert "profiler_st" not in capfd.readouterr().err, "the profiler's real status lines are dropped"


def test_a_ratio_is_printed_with_its_interval_or_as_a_single_measurement():
    assert measure.format_ratio(paired_ratio([1.1, 1.2, 1.0], [1.0, 1.0, 1.0])) == "1.10x [1.00, 1.20]"
    single = {"median": 1.00031, "ci_low": 1.00031, "ci_high": 1.00031, "rounds": 1}
    assert measure.format_ratio(single) == "1.0003x (one measurement)" and verdict(single, 1.0) == "missed"


def test_a_bound_that_rounds_to_the_limit_it_is_judged_by_shows_its_side():
    above = {"median": 1.036, "ci_low": 1.0042, "ci_high": 1.157, "rounds": 15}  # slower: the whole interval above 1
    assert measure.format_ratio(above) == "1.04x [1.00, 1.16]"
    assert measure.format_ratio(above, against=1.0) == "1.036x [1.004, 1.157]"
    assert measure.format_ratio(above, against=1.2) == "1.04x [1.00, 1.16]"  # no bound rounds to 1.20
    exactly = {"median": 1.1, "ci_low": 1.0, "ci_high": 1.2, "rounds": 15}
    assert measure.format_ratio(exactly, against=1.0) == "1.10x [1.00, 1.20]"  # on the limit: nothing to show


def test_a_benchmark_imports_and_profiles_where_torch_lacks_the_private_all_threads_config():
    """A fresh interpreter whose torch has no ``_ExperimentalConfig`` (a release that moved it)."""
    code = ("import torch, torch._C._profiler as private; del private._ExperimentalConfig; "
            "from dpkit.bench import measure; "
            "print([op['op'] for op in measure.op_breakdown(lambda: torch.ones(8).add_(1), iters=2)['ops']])")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "aten::add_" in result.stdout
