"""syncbn_benchmark.py: its flags, and the ratios and verdicts it derives from timed rows (no processes spawned).

The rows are synthetic with known per-round times, so every ratio and verdict is known in advance.
"""

from __future__ import annotations

import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import allreduce
from syncbn_benchmark import (COLD, FLOOR, LOCAL, NORMAL, OURS, PHASES, QUICK, REFERENCE, SHARED_REFERENCE, SINGLE,
                              SYNC_PATH, TARGET_GRID, TARGET_SINGLE, CPU_TARGET, WORKERS, _Floor, _phase_medians,
                              _stamped_collectives, bounds, parse_args, ratios, run_case, targets)


def test_quick_fills_only_the_flags_not_given():
    assert {k: getattr(parse_args([]), k) for k in NORMAL} == NORMAL
    assert {k: getattr(parse_args(["--quick"]), k) for k in QUICK} == QUICK
    args = parse_args(["--quick", "--iters", "50", "--warmup", "0"])
    assert (args.iters, args.rounds, args.warmup) == (50, QUICK["rounds"], 0)


def test_bad_flags_are_refused():
    for argv in (["--rounds", "0"], ["--iters", "4", "--rounds", "8"], ["--dtypes", "int8"], ["--settings", "gpu"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def _row(impl: str, setting: str, hidden: int, round_p50: list[float], saved: int = 100, peak: int = 1000) -> dict:
    return {"kind": "time", "impl": impl, "setting": setting, "dtype": "float32", "device": "cpu", "batch": 32,
            "hidden": hidden, "round_p50_s": round_p50, "saved_bytes": saved, "peak_bytes": peak}


def test_ratios_pair_rounds_and_targets_say_met_missed_or_inconclusive():
    """hidden 128: ours 1.1x the reference in every round (met <= 1.3); 256: 1.5x (missed); 512: 1.2x or 1.4x
    in alternate rounds (inconclusive); the load doubles halfway, which pairing cancels."""
    load = [1.0] * 10 + [2.0] * 10
    factors = {128: [1.1] * 20, 256: [1.5] * 20, 512: [1.2, 1.4] * 10}
    rows = []
    for hidden, factor in factors.items():
        rows += [_row(REFERENCE, WORKERS, hidden, load), _row(LOCAL, WORKERS, hidden, [0.5 * t for t in load]),
                 _row(OURS, WORKERS, hidden, [f * t for f, t in zip(factor, load)], saved=100 if hidden != 512 else 101)]
    rows += [_row(LOCAL, SINGLE, 128, load), _row(OURS, SINGLE, 128, [1.05 * t for t in load], peak=900)]
    ratio_rows = ratios(rows)
    by = {(r["setting"], r["versus"], r["hidden"]): r for r in ratio_rows}
    assert by[WORKERS, REFERENCE, 128]["median"] == pytest.approx(1.1)
    assert [by[WORKERS, REFERENCE, h]["verdict"] for h in factors] == ["met", "missed", "inconclusive"]
    assert by[WORKERS, LOCAL, 128]["verdict"] is None and by[WORKERS, LOCAL, 128]["median"] == pytest.approx(2.2)
    assert by[SINGLE, LOCAL, 128]["target"] == TARGET_SINGLE and by[SINGLE, LOCAL, 128]["verdict"] == "met"
    found = {t["name"]: t for t in targets(ratio_rows, rows)}
    every = found[f"{WORKERS}: every size, ours / ({REFERENCE}) <= {CPU_TARGET}"]
    assert (every["verdict"], every["sizes_met"], every["sizes"]) == ("missed", 1, 3)
    grid = found[f"{WORKERS}: median over the grid, ours / ({REFERENCE}) <= {TARGET_GRID}"]
    assert grid["median"] == pytest.approx(1.3) and grid["verdict"] == "missed"  # median of 1.1, 1.5, 1.2 or 1.4
    assert found[f"{WORKERS}: saved_bytes of ours <= BatchNorm1d's at every size"]["verdict"] == "missed"
    assert not any(SHARED_REFERENCE in name for name in found), "no shared-memory rows: no target against them"
    assert found[f"{SINGLE}: peak_bytes of ours <= BatchNorm1d's at every size"]["verdict"] == "met"


def test_cold_caches_time_the_synchronized_path_after_a_setup_before_every_iteration():
    """The COLD rows: ``setup`` (the eviction) runs before each warm-up and timed iteration, outside the timed region;
    the rows carry the COLD setting; their ratio is reported without a target and no memory target covers them."""
    calls = []
    args = parse_args(["--iters", "6", "--rounds", "3", "--warmup", "2"])
    rows = run_case(0, 1, torch.device("cpu"), [LOCAL, SYNC_PATH], 8, 4, "float32", args, setting=COLD,
                    setup=lambda: calls.append(time.perf_counter()))
    # Per implementation: round 0 has 2 warm-up + 2 timed iterations, rounds 1 and 2 have 2 warm-up + 2 timed.
    assert len(calls) == 2 * (3 * (2 + 2))
    assert [(r["impl"], r["setting"], r["iters"], r["rounds"]) for r in rows] == [(LOCAL, COLD, 6, 3), (SYNC_PATH, COLD, 6, 3)]
    ratio_rows = ratios(rows)
    assert [(r["impl"], r["versus"], r["setting"], r["target"]) for r in ratio_rows] == [(SYNC_PATH, LOCAL, COLD, None)]
    assert not [t for t in targets(ratio_rows, rows) if t["setting"] == COLD]


def test_the_report_plot_reads_the_float32_worker_ratios_of_this_layout():
    """plots.syncbn_grid draws from these rows: it must pick the float32 2-worker times (not the one-process,
    half-precision or ratio rows) and pair their rounds as the benchmark does."""
    import plots

    load = [1.0, 2.0, 1.5, 1.2]
    rows = []
    for dtype, factor in (("float32", 1.1), ("bfloat16", 3.0)):
        for impl, scale in ((REFERENCE, 1.0), (LOCAL, 0.5), (OURS, factor)):
            rows.append({**_row(impl, WORKERS, 128, [scale * t for t in load]), "dtype": dtype})
    rows += [_row(LOCAL, SINGLE, 128, load), _row(OURS, SINGLE, 128, [5 * t for t in load])]
    ratio_rows = ratios(rows)
    drawn = plots.syncbn_ratios({"results": rows + ratio_rows + targets(ratio_rows, rows)})
    assert len(drawn) == 1 and drawn[0]["median"] == pytest.approx(1.1)
    mine = [r for r in ratio_rows if (r["versus"], r["dtype"]) == (REFERENCE, "float32")]
    assert (drawn[0]["ci_low"], drawn[0]["ci_high"]) == pytest.approx((mine[0]["ci_low"], mine[0]["ci_high"]))


def test_phases_cut_each_iteration_at_its_collectives_and_drop_the_warm_up():
    """Two warm-up iterations of 1 s per phase, then three timed ones whose phases last 1, 2, 3, 4, 5 ms,
    one of them twice as long: the median per phase is 1, 2, 3, 4, 5 ms and the median iteration 15 ms;
    the warm-up and the gaps between iterations (7 s each) count nowhere."""
    stamps, clock = [], 0.0
    for durations in ([1.0] * 5, [1.0] * 5, [1e-3, 2e-3, 3e-3, 4e-3, 5e-3], [2e-3, 4e-3, 6e-3, 8e-3, 10e-3],
                      [1e-3, 2e-3, 3e-3, 4e-3, 5e-3]):
        stamps.append(clock)
        for d in durations:
            clock += d
            stamps.append(clock)
        clock += 7.0  # the barrier between iterations belongs to no phase
    assert len(PHASES) == 5
    # then the median iteration: 15, 30 and 15 ms long
    assert _phase_medians(stamps, iters=3) == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 15e-3])


def test_both_references_carry_the_same_targets():
    """Against torch's all_reduce (the issue's definition) and against the shared memory ours uses on one host."""
    load = [1.0] * 8
    rows = []
    for hidden in (128, 256):
        rows += [_row(REFERENCE, WORKERS, hidden, load), _row(SHARED_REFERENCE, WORKERS, hidden, [0.4 * t for t in load]),
                 _row(LOCAL, WORKERS, hidden, [0.2 * t for t in load]), _row(OURS, WORKERS, hidden, [0.6 * t for t in load])]
    found = {t["name"]: t for t in targets(ratios(rows), rows)}
    for versus, median, verdict in ((REFERENCE, 0.6, "met"), (SHARED_REFERENCE, 1.5, "missed")):
        grid = found[f"{WORKERS}: median over the grid, ours / ({versus}) <= {TARGET_GRID}"]
        assert grid["median"] == pytest.approx(median) and grid["verdict"] == verdict
        assert found[f"{WORKERS}: every size, ours / ({versus}) <= {CPU_TARGET}"]["verdict"] == verdict


def test_the_floor_is_a_bound_without_a_target():
    """ours 1.5x the floor and the floor 1.1x the shared-memory reference in every round: two bounds, medians over
    the grid, no verdict; the targets are the same as without the floor."""
    load = [1.0, 2.0] * 4
    rows = []
    for hidden in (128, 256):
        rows += [_row(REFERENCE, WORKERS, hidden, load), _row(SHARED_REFERENCE, WORKERS, hidden, [0.4 * t for t in load]),
                 _row(FLOOR, WORKERS, hidden, [0.44 * t for t in load]), _row(OURS, WORKERS, hidden, [0.66 * t for t in load]),
                 _row(LOCAL, WORKERS, hidden, [0.2 * t for t in load])]
    ratio_rows = ratios(rows)
    found = {(b["impl"], b["versus"]): b for b in bounds(ratio_rows)}
    assert found[OURS, FLOOR]["median"] == pytest.approx(1.5) and found[FLOOR, SHARED_REFERENCE]["median"] == pytest.approx(1.1)
    assert all(b["kind"] == "bound" and "verdict" not in b and b["sizes"] == 2 for b in found.values())
    without = [r for r in rows if r["impl"] != FLOOR]
    assert targets(ratio_rows, rows) == targets(ratios(without), without)
    assert not bounds(ratios(without))


def test_the_floor_computes_batchnorm_and_makes_the_two_sums_of_a_synchronized_layer():
    """_Floor: BatchNorm1d's output, gradients and running statistics (its own kernels, the local batch), with one
    sum of 2C + 1 float64 values in forward and one of 2C in backward, in that order."""
    import plots

    assert plots.SYNCBN_FLOOR == FLOOR  # the report draws the floor by this name
    sums = []
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    dy = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    floor, batch_norm = _Floor(4).double(), torch.nn.BatchNorm1d(4).double()
    with torch.no_grad():
        for layer in (floor, batch_norm):
            layer.weight.copy_(torch.arange(1.0, 5.0))
            layer.bias.fill_(0.5)
    outputs, grads = [], []
    with mock.patch.object(allreduce, "shared_memory_allreduce", lambda t, op, *a: sums.append((t.shape, t.dtype, op))):
        for layer in (floor, batch_norm):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(dy)
            outputs.append(y.detach())
            grads.append((xi.grad, layer.weight.grad, layer.bias.grad))
    assert sums == [((9,), torch.float64, "sum"), ((8,), torch.float64, "sum")]
    torch.testing.assert_close(outputs[0], outputs[1])
    for mine, theirs in zip(*grads):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(floor.running_mean, batch_norm.running_mean)
    torch.testing.assert_close(floor.running_var, batch_norm.running_var)


def test_stamped_collectives_time_where_the_caller_waits_and_put_the_real_one_back():
    """A blocking all_reduce is stamped around the call; an asynchronous one around its wait(), so the
    work done between the call and the wait counts as the caller's compute."""
    calls, waits = [], []

    class Work:
        def wait(self):
            waits.append(time.perf_counter())
            return True

    def fake(tensor, async_op=False, **kwargs):
        calls.append(time.perf_counter())
        return Work() if async_op else None

    with mock.patch.object(dist, "all_reduce", fake):
        real = dist.all_reduce
        stamps = []
        with _stamped_collectives(stamps, torch.device("cpu")):
            dist.all_reduce(torch.ones(3))
            work = dist.all_reduce(torch.ones(3), async_op=True)
            assert len(stamps) == 2  # nothing stamped until the wait
            assert work.wait() is True
        assert dist.all_reduce is real
    assert len(calls) == 2 and len(waits) == 1 and len(stamps) == 4 and stamps == sorted(stamps)
    assert stamps[0] <= calls[0] <= stamps[1] <= calls[1] <= stamps[2] <= waits[0] <= stamps[3]


def test_stamped_collectives_also_time_the_shared_memory_all_reduce():
    """Ours and the shared reference sum through allreduce.shared_memory_allreduce on one host: stamped around the call."""
    calls = []
    with mock.patch.object(allreduce, "shared_memory_allreduce", lambda *a, **k: calls.append(time.perf_counter())):
        real = allreduce.shared_memory_allreduce
        stamps = []
        with _stamped_collectives(stamps, torch.device("cpu")):
            allreduce.shared_memory_allreduce(torch.ones(3), "sum")
        assert allreduce.shared_memory_allreduce is real
    assert len(calls) == 1 and len(stamps) == 2 and stamps[0] <= calls[0] <= stamps[1]
