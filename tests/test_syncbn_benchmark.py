"""syncbn_benchmark.py and its package modules (``dpkit.bench.syncbn_*``): its flags, the ratios, verdicts and
attributions derived from timed rows, the timing devices (the floor, the stamping transport), and one tiny run of
the workers over both transports.

The rows are synthetic with known per-round times, so every ratio, verdict and sentence is known in advance.
The timing devices take a recording transport (no process group). One tiny run of one process alone goes through
the benchmark harness (nothing spawned); only the last test spawns workers.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch

import syncbn
from common import run_workers
from dpkit.bench.results import format_environment, read_results
from dpkit.comm import transport
from dpkit.native import syncbn_channels
from dpkit.bench.syncbn_report import attribution_lines, report
from dpkit.bench.syncbn_verdicts import (COLD, CPU_TARGET, FLOOR, LOCAL, OURS, PATH_IMPLS, PATHS, PHASES, REFERENCE,
                                         SHM, SINGLE, SYNC_PATH, TARGET_GRID, TARGET_SINGLE, TORCH, WORKERS, bounds,
                                         ratios, targets)
from dpkit.bench import syncbn_operators
from dpkit.bench.syncbn_case import run_case
from dpkit.bench.syncbn_contenders import Sources, make_layer
from dpkit.bench.syncbn_operators import operators
from dpkit.bench.syncbn_phases import Stamped, phase_medians
from dpkit.bench.syncbn_run import run, run_paths
from syncbn_benchmark import NORMAL, QUICK, main, parse_args, sources


def test_quick_fills_only_the_flags_not_given():
    assert {k: getattr(parse_args([]), k) for k in NORMAL} == NORMAL
    assert {k: getattr(parse_args(["--quick"]), k) for k in QUICK} == QUICK
    args = parse_args(["--quick", "--iters", "50", "--warmup", "0"])
    assert (args.iters, args.rounds, args.warmup) == (50, QUICK["rounds"], 0)


def test_bad_flags_are_refused():
    for argv in (["--rounds", "0"], ["--iters", "4", "--rounds", "8"], ["--dtypes", "int8"], ["--settings", "gpu"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def _row(impl: str, setting: str, hidden: int, round_p50: list[float], saved: int = 100, peak: int = 1000,
         transport: str | None = None) -> dict:
    return {"kind": "time", "impl": impl, "transport": transport, "setting": setting, "dtype": "float32",
            "device": "cpu", "batch": 32, "hidden": hidden, "workers": 2 if setting == WORKERS else 1,
            "round_p50_s": round_p50, "saved_bytes": saved, "peak_bytes": peak}


def _engine(hidden: int, load: list[float], t: str, reference: float, ours: float,
            floor: float | None = None) -> list[dict]:
    """The rows of one size on transport ``t``: the reference, ours and the floor (times in units of ``load``)."""
    rows = [_row(REFERENCE, WORKERS, hidden, [reference * x for x in load], transport=t),
            _row(OURS, WORKERS, hidden, [ours * x for x in load], transport=t)]
    return rows + ([_row(FLOOR, WORKERS, hidden, [floor * x for x in load], transport=t)] if floor is not None else [])


def test_ratios_pair_rounds_and_targets_say_met_missed_or_inconclusive():
    """hidden 128: ours 1.1x the reference in every round (met <= 1.3); 256: 1.5x (missed); 512: 1.2x or 1.4x
    in alternate rounds (inconclusive); the load doubles halfway, which pairing cancels."""
    load = [1.0] * 10 + [2.0] * 10
    factors = {128: [1.1] * 20, 256: [1.5] * 20, 512: [1.2, 1.4] * 10}
    rows = []
    for hidden, factor in factors.items():
        rows += [_row(REFERENCE, WORKERS, hidden, load, transport=TORCH),
                 _row(LOCAL, WORKERS, hidden, [0.5 * t for t in load]),
                 _row(OURS, WORKERS, hidden, [f * t for f, t in zip(factor, load)], saved=100 if hidden != 512 else 101,
                      transport=TORCH)]
    rows += [_row(LOCAL, SINGLE, 128, load), _row(OURS, SINGLE, 128, [1.05 * t for t in load], peak=900)]
    ratio_rows = ratios(rows)
    by = {(r["setting"], r["versus"], r["hidden"]): r for r in ratio_rows}
    assert by[WORKERS, REFERENCE, 128]["median"] == pytest.approx(1.1)
    assert [by[WORKERS, REFERENCE, h]["verdict"] for h in factors] == ["met", "missed", "inconclusive"]
    assert (by[WORKERS, REFERENCE, 128]["transport"], by[WORKERS, REFERENCE, 128]["versus_transport"]) == (TORCH, TORCH)
    assert by[WORKERS, LOCAL, 128]["verdict"] is None and by[WORKERS, LOCAL, 128]["median"] == pytest.approx(2.2)
    assert (by[WORKERS, LOCAL, 128]["transport"], by[WORKERS, LOCAL, 128]["versus_transport"]) == (TORCH, None)
    assert by[SINGLE, LOCAL, 128]["target"] == TARGET_SINGLE and by[SINGLE, LOCAL, 128]["verdict"] == "met"
    assert by[SINGLE, LOCAL, 128]["transport"] is None
    found = {t["name"]: t for t in targets(ratio_rows, rows)}
    every = found[f"{WORKERS} [{TORCH}]: every size, ours / ({REFERENCE}) <= {CPU_TARGET}"]
    assert (every["verdict"], every["sizes_met"], every["sizes"], every["transport"]) == ("missed", 1, 3, TORCH)
    assert every["why"].startswith("not met at 32x256 missed, 32x512 inconclusive")
    grid = found[f"{WORKERS} [{TORCH}]: median over the grid, ours / ({REFERENCE}) <= {TARGET_GRID}"]
    assert grid["median"] == pytest.approx(1.3) and grid["verdict"] == "missed"  # median of 1.1, 1.5, 1.2 or 1.4
    assert found[f"{WORKERS} [{TORCH}]: saved_bytes of ours <= BatchNorm1d's at every size"]["verdict"] == "missed"
    assert not any(f"[{SHM}]" in name for name in found), "no shared-memory rows: no target on that transport"
    assert found[f"{SINGLE}: peak_bytes of ours <= BatchNorm1d's at every size"]["verdict"] == "met"


def test_cold_caches_time_the_synchronized_path_after_a_setup_before_every_iteration():
    """The COLD rows: ``setup`` (the eviction) runs before each warm-up and timed iteration, outside the timed region;
    the rows carry the COLD setting and no transport; their ratio is reported without a target and no memory
    target covers them."""
    calls = []
    args = parse_args(["--iters", "6", "--rounds", "3", "--warmup", "2"])
    rows = run_case(0, 1, torch.device("cpu"), [(LOCAL, None), (SYNC_PATH, None)], 8, 4, "float32", args,
                    Sources(syncbn), setting=COLD, setup=lambda: calls.append(time.perf_counter()))
    # Per implementation: round 0 has 2 warm-up + 2 timed iterations, rounds 1 and 2 have 2 warm-up + 2 timed.
    assert len(calls) == 2 * (3 * (2 + 2))
    assert [(r["impl"], r["transport"], r["setting"], r["iters"], r["rounds"]) for r in rows] == \
        [(LOCAL, None, COLD, 6, 3), (SYNC_PATH, None, COLD, 6, 3)]
    ratio_rows = ratios(rows)
    assert [(r["impl"], r["versus"], r["setting"], r["target"]) for r in ratio_rows] == [(SYNC_PATH, LOCAL, COLD, None)]
    assert not [t for t in targets(ratio_rows, rows) if t["setting"] == COLD]


def test_the_report_plot_reads_the_float32_worker_ratios_of_a_file_with_one_transport():
    """plots.syncbn_grid draws from these rows: with one transport (GPUs, or workers on several hosts) it must pick
    the float32 2-worker times (not the one-process, half-precision or ratio rows) and pair their rounds as the
    benchmark does. (A file with both transports has two rows of ours per size: plots must choose by transport.)"""
    from dpkit.report import plots

    load = [1.0, 2.0, 1.5, 1.2]
    rows = []
    for dtype, factor in (("float32", 1.1), ("bfloat16", 3.0)):
        for impl, scale, t in ((REFERENCE, 1.0, TORCH), (LOCAL, 0.5, None), (OURS, factor, TORCH)):
            rows.append({**_row(impl, WORKERS, 128, [scale * x for x in load], transport=t), "dtype": dtype})
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
    assert phase_medians(stamps, iters=3) == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 15e-3])


def test_each_transport_has_its_impl_targets_against_the_reference_on_that_transport():
    """torch: ours 1.1x its reference (met); shm: 1.5x its own (missed), though 0.6x torch's reference, which no
    target may credit it with; torch:dpkit (torch's code on a "dpkit" group): ours 0.3, its reference 0.25. The
    transport axis, each layer on each other transport / the same layer on torch, is a ratio without a target."""
    load = [1.0, 1.2] * 4
    rows = []
    for hidden in (128, 256):
        rows += _engine(hidden, load, TORCH, 1.0, 1.1) + _engine(hidden, load, SHM, 0.4, 0.6)
        rows += _engine(hidden, load, "torch:dpkit", 0.25, 0.3)
        rows.append(_row(LOCAL, WORKERS, hidden, [0.2 * x for x in load]))
    ratio_rows = ratios(rows)
    assert all(r["transport"] == r["versus_transport"] for r in ratio_rows if r["target"] is not None)
    assert all(r["axis"] == "impl" for r in ratio_rows if r["target"] is not None)
    across = {(r["impl"], r["transport"], r["versus"], r["versus_transport"], r["target"], r["hidden"]): r["median"]
              for r in ratio_rows if r["axis"] == "transport"}
    assert across == pytest.approx({(impl, t, impl, TORCH, None, hidden): ratio for hidden in (128, 256)
                                    for impl, t, ratio in ((OURS, SHM, 0.6 / 1.1), (REFERENCE, SHM, 0.4),
                                                           (OURS, "torch:dpkit", 0.3 / 1.1),
                                                           (REFERENCE, "torch:dpkit", 0.25))})
    found = {t["name"]: t for t in targets(ratio_rows, rows)}
    assert {t["axis"] for t in found.values()} == {"impl"}  # ours against another implementation, on one transport
    for t, median, verdict in ((TORCH, 1.1, "met"), (SHM, 1.5, "missed")):
        grid = found[f"{WORKERS} [{t}]: median over the grid, ours / ({REFERENCE}) <= {TARGET_GRID}"]
        assert grid["median"] == pytest.approx(median) and grid["verdict"] == verdict and grid["transport"] == t
        assert found[f"{WORKERS} [{t}]: every size, ours / ({REFERENCE}) <= {CPU_TARGET}"]["verdict"] == verdict
    assert {b["kind"] for b in bounds(ratio_rows)} == {"comparison"}  # no floor: no bound
    comparisons = {(c["impl"], c["transport"], c["versus_transport"]): c for c in bounds(ratio_rows)}
    assert set(comparisons) == {(impl, t, TORCH) for impl in (OURS, REFERENCE) for t in (SHM, "torch:dpkit")}
    assert comparisons[OURS, SHM, TORCH]["median"] == pytest.approx(0.6 / 1.1)
    assert comparisons[REFERENCE, "torch:dpkit", TORCH]["median"] == pytest.approx(0.25)
    assert not any("verdict" in c for c in comparisons.values())


def test_the_floor_is_a_bound_on_each_transport_without_a_target():
    """On each transport ours 1.5x the floor and the floor 1.1x the reference in every round: two bounds per
    transport, medians over the grid, no verdict; the targets' verdicts are those without the floor."""
    load = [1.0, 2.0] * 4
    rows = []
    for hidden in (128, 256):
        rows += _engine(hidden, load, TORCH, 1.0, 1.65, 1.1) + _engine(hidden, load, SHM, 0.4, 0.66, 0.44)
        rows.append(_row(LOCAL, WORKERS, hidden, [0.2 * x for x in load]))
    ratio_rows = ratios(rows)
    found = {(b["impl"], b["versus"], b["transport"]): b for b in bounds(ratio_rows) if b["kind"] == "bound"}
    assert set(found) == {(OURS, FLOOR, t) for t in (TORCH, SHM)} | {(FLOOR, REFERENCE, t) for t in (TORCH, SHM)}
    for t in (TORCH, SHM):
        assert found[OURS, FLOOR, t]["median"] == pytest.approx(1.5)
        assert found[FLOOR, REFERENCE, t]["median"] == pytest.approx(1.1)
    assert all("verdict" not in b and b["sizes"] == 2 for b in found.values())
    without = [r for r in rows if r["impl"] != FLOOR]

    def verdicts(ratio_rows, rows):
        return [(t["name"], t["verdict"]) for t in targets(ratio_rows, rows)]
    assert verdicts(ratio_rows, rows) == verdicts(ratios(without), without)
    assert not [b for b in bounds(ratios(without)) if b["kind"] == "bound"]


def test_a_missed_engine_target_says_per_size_what_is_left_and_why():
    """On shared memory, per round (x the load): hidden 128: reference 100 us, floor 140, ours 150 (1.5x, missed;
    the floor alone is above 1.3x); 256: reference 100, floor 110, ours 150 (missed; ours beyond the floor must
    shrink); 512: reference 100, floor 105, ours 110 (met: nothing to say). Phases at 128 split the excess into
    compute and waiting."""
    load = [0.9, 1.0, 1.1] * 3
    us = 1e-6
    rows = [row for hidden, (ours, floor) in {128: (150, 140), 256: (150, 110), 512: (110, 105)}.items()
            for row in _engine(hidden, load, SHM, 100 * us, ours * us, floor * us)]
    cut = {OURS: (30, 20, 40, 20, 10), REFERENCE: (20, 25, 10, 25, 5)}  # us per phase: compute +45, waiting -10
    rows += [{"kind": "phases", "impl": impl, "transport": SHM, "setting": WORKERS, "dtype": "float32", "batch": 32,
              "hidden": 128, "phases_s": {p: s * us for p, s in zip(PHASES, phases)}} for impl, phases in cut.items()]
    engine = {r["hidden"]: r for r in ratios(rows) if r["versus"] == REFERENCE and r["impl"] == OURS}
    assert [engine[h]["verdict"] for h in (128, 256, 512)] == ["missed", "missed", "met"]
    for hidden, (excess, floor, own, left, left_grid) in {128: (50, 40, 10, 20, 35), 256: (50, 10, 40, 20, 35),
                                                          512: (10, 5, 5, -20, -5)}.items():
        got = [1e6 * engine[hidden][k] for k in ("excess_s", "floor_excess_s", "own_excess_s", "left_s", "left_grid_s")]
        assert got == pytest.approx([excess, floor, own, left, left_grid]), hidden
    assert engine[128]["floor_ratio"] == pytest.approx(1.4)
    assert 1e6 * engine[128]["compute_excess_s"] == pytest.approx(45)
    assert 1e6 * engine[128]["wait_excess_s"] == pytest.approx(-10)
    assert "compute_excess_s" not in engine[256]  # no phases at that size
    assert "why" not in engine[512]
    why = engine[128]["why"]
    assert why.startswith("32x128 [shared_memory]: ours 1.50x [1.50, 1.50] the reference, missed; "
                          "it must lose 20 us of its 50 us")
    assert "+40 us (80 %) is that frame" in why and "+10 us (20 %) ours beyond the floor" in why
    assert "The floor alone is above 1.3x" in why and engine[128]["floor_verdict"] == "missed"
    # a floor whose median is above the target but whose rounds go from 1.2x to 1.5x is not called above it
    noisy = _engine(128, load, SHM, 100 * us, 150 * us)
    noisy.append(_row(FLOOR, WORKERS, 128, [f * 100 * us * x for f, x in zip([1.2, 1.4, 1.5] * 3, load)],
                      transport=SHM))
    straddling = next(r for r in ratios(noisy) if r["versus"] == REFERENCE and r["impl"] == OURS)
    assert straddling["floor_ratio"] > 1.3 and straddling["floor_verdict"] == "inconclusive"
    assert "The floor alone is above" not in straddling["why"]
    assert ("The floor's median is above 1.3x, its interval not: whether the floor alone misses is inconclusive."
            in straddling["why"])
    assert "ours computes 45 us more than the reference per iteration and waits 10 us less in the sums" in why
    assert "The floor is within it: ours beyond the floor (40 us) must shrink by 20 us." in engine[256]["why"]
    lines = "\n".join(attribution_lines(ratios(rows)))
    assert engine[128]["why"] in lines and engine[256]["why"] in lines and "32x512 [shared_memory]: ours" not in lines
    found = {t["name"]: t for t in targets(ratios(rows), rows)}
    grid = found[f"{WORKERS} [{SHM}]: median over the grid, ours / ({REFERENCE}) <= {TARGET_GRID}"]
    assert grid["verdict"] == "missed"
    assert grid["why"] == ("2 of 3 sizes above 1.15x: 32x128 1.50x (35 us to cut), 32x256 1.50x (35 us to cut). "
                           "The floor's median over the grid is 1.10x the reference: ours beyond the floor is what "
                           "must shrink.")


def test_a_grid_median_whose_interval_straddles_its_target_says_so_when_no_size_is_above_it():
    """Two sizes whose rounds alternate 1.0x and 1.3x: each size's median is 1.15x (not above), the grid's interval
    reaches above 1.15x: inconclusive, and the sentence says that no size is above it."""
    load = [1.0] * 8
    rows = [row for hidden in (128, 256) for row in _engine(hidden, load, SHM, 1.0, 1.0, 1.05)]
    for row in rows:
        if row["impl"] == OURS:
            row["round_p50_s"] = [1.0, 1.3] * 4
    found = {t["name"]: t for t in targets(ratios(rows), rows)}
    grid = found[f"{WORKERS} [{SHM}]: median over the grid, ours / ({REFERENCE}) <= {TARGET_GRID}"]
    assert grid["verdict"] == "inconclusive"
    assert grid["why"].startswith("no size's median is above 1.15x, but the interval over the grid reaches above it.")


class _Recording(transport.Transport):
    """A transport of two ranks without a process group: records each all_reduce, and with ``pending`` returns
    work that is done only once waited on (as gloo's asynchronous calls)."""

    name = "recording"

    def __init__(self, pending: bool = False):
        self.group, self.rank, self.world_size, self.ranks = None, 0, 2, [0, 1]
        self._comm, self._closed = None, False
        self.pending, self.calls, self.waits = pending, [], []

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        self.calls.append((tuple(tensor.shape), tensor.dtype, op, async_op, time.perf_counter()))
        if not async_op:
            return None
        if not self.pending:
            return transport.Work()

        recording = self

        class Pending(transport.Work):
            def wait(self):
                recording.waits.append(time.perf_counter())
                return True

            def is_completed(self):
                return False
        return Pending()


# Layers that compute BatchNorm1d on the local batch through a Python Function, and the sums each makes through its
# transport: the floor, one of 2C + 1 float64 values in forward and one of 2C in backward, in that order; the
# synchronized path without collectives (the layer's own Function with no transport), none.
THROUGH_FUNCTION = {FLOOR: [((9,), torch.float64, "sum", False), ((8,), torch.float64, "sum", False)], SYNC_PATH: []}


@pytest.mark.parametrize("impl", list(THROUGH_FUNCTION))
def test_the_floor_and_the_path_without_collectives_compute_batchnorm_and_make_only_their_sums(impl):
    """BatchNorm1d's output, gradients and running statistics (the local batch), with the sums of
    THROUGH_FUNCTION[impl] through the transport given."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    dy = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    recording = _Recording()
    mine = make_layer(impl, 4, torch.device("cpu"), Sources(syncbn), recording).double()
    batch_norm = torch.nn.BatchNorm1d(4).double()
    with torch.no_grad():
        for layer in (mine, batch_norm):
            layer.weight.copy_(torch.arange(1.0, 5.0))
            layer.bias.fill_(0.5)
    outputs, grads = [], []
    for layer in (mine, batch_norm):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        outputs.append(y.detach())
        grads.append((xi.grad, layer.weight.grad, layer.bias.grad))
    assert [c[:4] for c in recording.calls] == THROUGH_FUNCTION[impl]
    torch.testing.assert_close(outputs[0], outputs[1])
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(mine.running_mean, batch_norm.running_mean)
    torch.testing.assert_close(mine.running_var, batch_norm.running_var)


def test_operators_counts_what_one_iteration_dispatches_and_without_its_hook_says_so():
    """Two aten operators per call of a step that makes two; -1 (not a guess) where the counter cannot be made
    or fails, with a warning when it fails."""
    def step():
        torch.ones(3).add_(1.0)
    cpu = torch.device("cpu")
    assert operators(step, cpu, iters=4) == 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(syncbn_operators, "dispatch_counter", lambda: None)
        assert operators(step, cpu) == -1
    with pytest.MonkeyPatch.context() as patch, pytest.warns(UserWarning, match="operators not counted"):
        patch.setattr(syncbn_operators, "dispatch_counter", lambda: 1 / 0)
        assert operators(step, cpu) == -1


# Ours' forward + backward beyond BatchNorm1d's: the per-channel arithmetic of both sums, a few operations each;
# half inputs add the float32 sum of dx's two terms and its rounding, three operations per slice of rows
# (``syncbn.HALF_CHUNKS`` of them: the float32 temporary stays a fraction of dx). More than this is a regression
# (a per-channel operation dispatched one by one where a fused one did it).
OPERATORS_BEYOND_BATCHNORM = {torch.float32: 16, torch.bfloat16: 20 + 3 * syncbn.HALF_CHUNKS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ours_dispatches_few_operators_beyond_batchnorm_and_makes_its_two_sums(dtype):
    """The synchronized Function through a recording transport (both sums made, in float64 then float32) costs at
    most OPERATORS_BEYOND_BATCHNORM[dtype] aten operators per iteration more than BatchNorm1d on the same step."""
    x = torch.randn(16, 64, dtype=dtype, requires_grad=True)
    recording = _Recording()
    ours = syncbn.SyncBatchNorm(64)
    batch_norm = torch.nn.BatchNorm1d(64)

    def mine():
        syncbn.SyncBatchNormFunction.apply(x, ours.weight, ours.bias, ours.running_mean, ours.running_var, ours.eps,
                                           ours.momentum, recording)[:8].float().sum().backward()

    def theirs():
        batch_norm(x)[:8].float().sum().backward()
    for step in (mine, theirs):
        step()  # warm: a first call makes the cached constants and buffers
    counts = {name: operators(step, torch.device("cpu")) for name, step in (("ours", mine), ("BatchNorm1d", theirs))}
    assert [c[:2] for c in recording.calls[-2:]] == [((129,), torch.float64), ((2, 64), torch.float32)]
    beyond = OPERATORS_BEYOND_BATCHNORM[dtype]
    assert 0 < counts["BatchNorm1d"] < counts["ours"] <= counts["BatchNorm1d"] + beyond, counts


def test_the_stamping_transport_times_where_the_caller_waits_and_delegates_the_rest():
    """A blocking all_reduce is stamped around the call, and so is an asynchronous one that returns done (shared
    memory sums in the caller's thread); one still running is stamped around its wait(), so the work done between
    the call and the wait counts as the caller's compute. What is not timed goes to the inner transport."""
    for pending in (False, True):
        inner, stamps = _Recording(pending), []
        stamped = Stamped(inner, stamps, torch.device("cpu"))
        assert (stamped.ranks, stamped.world_size, stamped.describe()) == ([0, 1], 2, "stamped recording")
        assert stamped.supports(torch.device("cpu")) and not stamped.owns(torch.ones(1))
        assert stamped.all_reduce(torch.ones(3)) is None
        work = stamped.all_reduce(torch.ones(3), async_op=True)
        assert len(stamps) == (2 if pending else 4)  # a call still running: nothing stamped until the wait
        assert work.wait() is True
        assert len(stamps) == 4 and stamps == sorted(stamps)
        (_, _, _, _, first), (_, _, _, _, second) = inner.calls
        assert stamps[0] <= first <= stamps[1] <= second
        if pending:
            assert len(inner.waits) == 1 and stamps[2] <= inner.waits[0] <= stamps[3]
        else:
            assert stamps[2] <= second <= stamps[3]


def _tiny_run(ctx, argv):
    args = parse_args(argv)
    rows = run(ctx, args, sources(args), profile_iters=2, phase_iters=4)
    return rows, os.getpid()


def test_the_workers_time_every_engine_on_both_transports_and_leave_nothing_in_dev_shm():
    """Two gloo workers on one host, one tiny size: ours, the reference, the floor and ours at HEAD (its syncbn.py
    loaded from git) on torch's transport and on shared memory, BatchNorm1d without one; every row says its
    transport; the phases are cut on both; no file of the run stays in /dev/shm."""
    argv = ["--iters", "4", "--rounds", "2", "--warmup", "1", "--batch", "8", "--hidden", "4", "--dtypes", "float32",
            "--baseline", "HEAD"]
    (rows, pid), _ = run_workers(_tiny_run, 2, argv)
    times = {(r["impl"], r["transport"]): r for r in rows if r["kind"] == "time"}
    engines = {(impl, t) for t in (TORCH, SHM) for impl in (OURS, REFERENCE, FLOOR, f"{OURS}@HEAD")}
    assert set(times) == engines | {(LOCAL, None)}
    assert {times[OURS, t]["transport_detail"] for t in (TORCH, SHM)} == {"torch (gloo)", "shared_memory"}
    assert all("transport" in r for r in rows)
    cut = {(r["impl"], r["transport"]): r for r in rows if r["kind"] == "phases"}
    assert set(cut) == {(impl, t) for t in (TORCH, SHM) for impl in (OURS, REFERENCE, FLOOR)}
    assert all(r["phases_s"][p] > 0 for r in cut.values() for p in PHASES)
    names = {t["name"] for t in targets(ratios(rows), rows)}
    assert {f"{WORKERS} [{t}]: every size, ours / ({REFERENCE}) <= {CPU_TARGET}" for t in (TORCH, SHM)} <= names
    assert not glob.glob(f"/dev/shm/dp-kit-{pid}-*")


def test_one_process_alone_is_measured_here_then_completed_printed_and_written_as_the_readers_expect(tmp_path, capsys):
    """--settings single spawns nothing: this process times one size, warm and with cold caches; the harness adds
    the ratios, targets and bounds after the measured rows, prints the environment and the timing line before the
    report, and writes every flag (--json too) and where it summed as the config and an environment without
    spawned process counts."""
    path = str(tmp_path / "single.json")
    args = parse_args(["--settings", "single", "--batch", "8", "--hidden", "4", "--iters", "2", "--rounds", "1",
                       "--warmup", "0", "--json", path])
    rows = main(args)
    kinds = [r["kind"] for r in rows]
    measured = kinds.index("ratio")
    assert set(kinds[:measured]) == {"time", "breakdown"} and set(kinds[measured:]) == {"ratio", "target"}
    assert {r["setting"] for r in rows if r["kind"] == "time"} == {SINGLE, COLD}
    names = {r["name"] for r in rows if r["kind"] == "target"}
    assert f"{SINGLE}: every size, ours / ({LOCAL}) <= {TARGET_SINGLE}" in names
    doc = read_results(path)
    assert doc["benchmark"] == "syncbn_benchmark" and doc["targets"] == []
    assert [r["kind"] for r in doc["results"]] == kinds
    assert doc["config"] == {**vars(args), "sums": "zero copy"}
    assert "procs" not in doc["env"] and doc["env"]["threads"] == 1
    out = capsys.readouterr().out
    assert out.startswith(format_environment(doc["env"]) + "\n* 2 iterations per implementation and size")
    assert out.endswith(f"{report(rows)}\n\nwrote {path}\n")


def test_each_path_of_the_layer_is_timed_by_its_own_code_against_the_c_path():
    """--settings paths: the synchronized path without collectives on each of syncbn.PATHS, in one process. Each
    row ran its own code (fewer operators dispatched the more the C functions do: the passes, then the per-channel
    arithmetic), and each slower path is a ratio to the C one on the axis "path", without a target."""
    args = parse_args(["--settings", "paths", "--batch", "8", "--hidden", "4", "--iters", "2", "--rounds", "1",
                       "--warmup", "0"])
    rows = run_paths(torch.device("cpu"), args, Sources(syncbn))
    impls = list(PATH_IMPLS.values())
    assert [(r["impl"], r["setting"]) for r in rows] == [(impl, PATHS) for impl in impls]
    if syncbn_channels.for_dtype(torch.float32) is not None:  # where a C compiler built them
        c, kernels, pytorch = (r["operators"] for r in rows)
        assert c < kernels < pytorch, "each path does more in PyTorch than the one before"
    ratio_rows = ratios(rows)
    assert [(r["impl"], r["versus"], r["axis"], r["target"]) for r in ratio_rows] == \
        [(impl, SYNC_PATH, "path", None) for impl in impls[1:]]
    assert not targets(ratio_rows, rows)


@pytest.mark.parametrize("path", syncbn.PATHS)
def test_a_forced_path_computes_what_the_c_path_computes(path):
    """syncbn.forced_path runs the same formulas by another path: outputs and input gradients agree with the
    default (C) path to float32 round-off; an unknown path is refused naming the three."""
    x, weight, bias = torch.randn(16, 8, requires_grad=True), torch.rand(8), torch.randn(8)

    def layer(x):  # the synchronized computation, no transport: nobody to sum with
        return syncbn.SyncBatchNormFunction.apply(x, weight, bias, torch.zeros(8), torch.ones(8), 1e-5, 0.1, None)
    expected_y = layer(x)
    (expected_dx,) = torch.autograd.grad(expected_y.sum(), x)
    with syncbn.forced_path(path):
        y = layer(x)
        (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(dx, expected_dx)
    with pytest.raises(ValueError, match="unknown path 'fused': choose one of c, kernels, pytorch"):
        with syncbn.forced_path("fused"):
            pass
