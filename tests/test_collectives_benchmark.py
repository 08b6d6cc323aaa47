"""collectives_benchmark.py: what it measures on each axis (run on 2 spawned workers and checked against numbers
the test computes itself), its exact correctness pattern, the labels that keep algorithms and transports apart,
the model fit, the crossover table, the targets and the charts."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import allreduce
import collectives_benchmark as bench
from common import OFF_HOST, doubled_count, run_workers
from dpkit.bench import (algorithm_axis, backend_axis, collective_run, collective_tables, collective_targets,
                         collectives, exact_pattern, latency_model, transport_axis)
from dpkit.bench.crossover_table import crossover_table, format_table
from dpkit.bench.point_to_point import point_to_point, point_to_point_rows
from dpkit.comm.message_passing import CUSTOM
from dpkit.report import collective_plots

SIZES = (4000, 64 << 10)  # the homework's 1,000 float32 elements, and one size of several chunks
TRANSPORT_SIZE = 64 << 10
LABELS = list(collectives.TRANSPORTS)  # torch, shared_memory, shared_memory:staged, p2p: the registry's names
BACKEND_SIZES = (4, 4 << 10, 64 << 10)  # one element, and the sizes of the backend's all-reduce targets
BATCH_S = 2e-3  # every axis's timed batches: shorter than a run's, for the suite's time
FLOOR_CASES = {"dist.all_reduce [dpkit]", "slots.all_reduce", "dispatch (one-rank group)",
               "ProcessGroup.allreduce (one-rank group)", "Backend.allreduce (one-rank group)",
               "wait (exchange of no data)", "reduction (copy in, sum out)", "dist.all_reduce [gloo]",
               "SharedMemory.all_reduce [own buffer]", "SharedMemory.all_reduce [any tensor]"}


def _broken(tensor, op="avg", group=None):
    """A wrong all-reduce: the ring's result with rank 0's first element off by one."""
    allreduce.ring_allreduce(tensor, op, group)
    if torch.distributed.get_rank(group) == 0 and tensor.numel():
        tensor[0] += 1
    return tensor


def _transports(ctx, collective: str) -> tuple[list[dict], dict]:
    """The transport axis of one collective at one size, and which contenders' inputs the shared memory owns."""
    made = transport_axis.make_transports(ctx, list(collectives.TRANSPORTS))
    shared = made["shared_memory"]
    contenders, _, _ = transport_axis.transport_contenders(ctx, collective, TRANSPORT_SIZE, made)
    owned = {c.label: [shared.owns(t) for t in c.inputs] for c in contenders}
    del contenders
    rows = transport_axis.benchmark_transports_size(ctx, collective, TRANSPORT_SIZE, made, iters=1, warmup=0,
                                                    batch_s=BATCH_S)
    for t in {id(t): t for t in made.values()}.values():
        t.close()
    return rows, owned


def _wrong_backend(ctx) -> dict[str, float]:
    """Each collective of the backend axis on the "dpkit" group with rank 0's output off by one: the error its
    check finds on this rank (a barrier has no output)."""
    group, errors = backend_axis.backend_groups()[collectives.BACKEND], {}
    for collective in (c for c in backend_axis.BACKEND_CALLS if c != "barrier"):
        contenders, _, _ = backend_axis.backend_contenders(ctx, collective, 4 << 10, {collectives.BACKEND: group})
        full, part = contenders[0].inputs
        call = backend_axis.backend_call(collective, group, full, part)

        def broken(call=call, out=part if collective in ("reduce_scatter", "all_to_all") else full):
            call()
            if ctx.rank == 0:
                out[0] += 1
        errors[collective] = backend_axis.backend_error(ctx, collective, broken, full, part)
    return errors


SENT = {"allreduce": "full", "broadcast": "full", "reduce": "full", "all_gather": "part", "reduce_scatter": "full",
        "all_to_all": "full"}  # the tensor each call of the backend axis sends (``backend_call``'s arguments)


def _sent_after_a_timed_call(ctx) -> dict[str, tuple]:
    """Each collective's timed call on the "dpkit" group, the tensor it sends filled with sevens first: (what the
    tensor holds after it on this rank, its row's ``input_written_first``)."""
    group, out = backend_axis.backend_groups()[collectives.BACKEND], {}
    for collective, name in SENT.items():
        contender = backend_axis.backend_contenders(ctx, collective, 4 << 10, {collectives.BACKEND: group})[0][0]
        sent = dict(zip(("full", "part"), contender.inputs))[name]
        sent.fill_(7.0)
        contender.call()
        out[collective] = (sorted(set(sent.tolist())), contender.fields["input_written_first"])
    return out


def _measure(ctx) -> dict:
    allreduce.ALGORITHMS["broken"] = _broken  # this worker only: the benchmark looks algorithms up by name
    pipeline = {"segment_bytes": allreduce.SEGMENT_BYTES, "in_flight": allreduce.IN_FLIGHT}
    rows = [row for nbytes in SIZES
            for row in algorithm_axis.benchmark_size(ctx, nbytes, [*allreduce.ALGORITHMS], iters=2, warmup=1,
                                                     pipeline=pipeline, batch_s=BATCH_S)]
    transports = {collective: _transports(ctx, collective) for collective in bench.COLLECTIVES}
    return {"rows": rows, "transports": {c: rows for c, (rows, _) in transports.items()},
            "owned": {c: owned for c, (_, owned) in transports.items()},
            "p2p": point_to_point(ctx, iters=3, warmup=1, sizes=(4, 4000), batch_s=BATCH_S),
            "p2p_off_host": point_to_point(dataclasses.replace(ctx, device=OFF_HOST), iters=1, warmup=0,
                                                 sizes=(4,), batch_s=BATCH_S),
            "groups_before_backend": len(c10d._world.pg_map),
            "backend": backend_axis.backend_worker(ctx, list(backend_axis.BACKEND_CALLS), list(BACKEND_SIZES), iters=1,
                                                   warmup=0, floor_calls=2, batch_s=BATCH_S),
            "groups_after_backend": len(c10d._world.pg_map),
            "backend_wrong": _wrong_backend(ctx), "backend_sent": _sent_after_a_timed_call(ctx)}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    """Every rank's rows from one spawned group of 2."""
    return run_workers(_measure, 2)


def _all_rows(result: dict) -> list[dict]:
    return result["rows"] + [row for rows in result["transports"].values() for row in rows]


def test_every_rank_reports_the_same_rows(measured):
    first, second = measured
    assert [r["p50_s"] for r in _all_rows(first)] == [r["p50_s"] for r in _all_rows(second)]  # maxima over ranks


def test_each_size_has_one_row_per_algorithm_over_one_wire(measured):
    rows = measured[0]["rows"]
    names = [*allreduce.ALGORITHMS, "broken"]  # the workers added the wrong one
    assert [(r["bytes"], r["algorithm"]) for r in rows] == [(s, a) for s in SIZES for a in names]
    assert "shared_memory" not in allreduce.ALGORITHMS, "shared memory is a transport, not an algorithm"
    assert all(r["world_size"] == 2 and not r["oversubscribed"] for r in rows)
    assert all((r["axis"], r["transport"], r["label"], r["collective"])
               == ("algorithm", "gloo", r["algorithm"], "allreduce")
               for r in rows)


def test_each_collective_has_one_row_per_transport_labelled_with_what_runs_inside(measured):
    inside = {"allreduce": "auto", "reduce_scatter": "ring", "all_gather": "ring"}
    for collective, rows in measured[0]["transports"].items():
        assert [r["label"] for r in rows] == LABELS
        assert all(r["axis"] == "transport" and r["collective"] == collective for r in rows)
        # "p2p" is auto's transport: the ring for reduce-scatter and all-gather (the algorithm column)
        assert [r["transport"] for r in rows] == ["torch (gloo)", "shared_memory", "staged shared_memory", "p2p (auto)"]
        assert [r["algorithm"] for r in rows] == ["torch", "direct", "direct", inside[collective]]
        size = TRANSPORT_SIZE if collective == "allreduce" else TRANSPORT_SIZE // 4 // 2 * 2 * 4
        assert {r["bytes"] for r in rows} == {size}


def test_zero_copy_works_on_buffers_the_transport_allocated_and_staged_on_plain_tensors(measured):
    for collective, owned in measured[0]["owned"].items():
        assert owned["shared_memory"] and all(owned["shared_memory"]), collective
        for label in ("torch", "shared_memory:staged", "p2p"):
            assert not any(owned[label]), (collective, label)


def test_small_messages_get_more_timed_batches(measured):
    """Up to 1 MiB a size gets 4 times --iters rounds (one batch each); above it, --iters."""
    assert collective_run.calls(4000, 3) == collective_run.calls(1 << 20, 3) == 12
    assert collective_run.calls((1 << 20) + 1, 3) == collective_run.calls(100 << 20, 3) == 3
    transports = [row for rows in measured[0]["transports"].values() for row in rows]
    assert {r["rounds"] for r in measured[0]["rows"]} == {8} and {r["rounds"] for r in transports} == {4}  # all small
    assert all(len(r["round_p50_s"]) == r["rounds"] for r in _all_rows(measured[0]))


def test_the_algorithm_and_transport_axes_time_each_contender_in_batches(measured):
    for row in _all_rows(measured[0]):
        assert doubled_count(row), row


def test_bandwidths_follow_from_bytes_and_time(measured):
    """algbw = bytes / mean time; busbw = algbw x 2(n-1)/n for an all-reduce, x (n-1)/n for the others
    (nccl-tests), computed here from the row's own numbers."""
    for row in _all_rows(measured[0]):
        algbw = row["bytes"] / row["avg_s"] / 1e9
        share = 2 * (2 - 1) / 2 if row["collective"] == "allreduce" else (2 - 1) / 2
        assert row["algbw_gbps"] == pytest.approx(algbw, rel=1e-12)
        assert row["busbw_gbps"] == pytest.approx(algbw * share, rel=1e-12)
        assert 0 < row["min_s"] <= row["p50_s"] <= row["p95_s"]


def test_every_real_contender_is_exact_and_a_wrong_one_is_flagged(measured):
    for row in _all_rows(measured[0]):
        if row["algorithm"] == "broken":
            assert row["max_abs_error"] == 1.0 and not row["correct"]
        else:
            assert row["max_abs_error"] == 0.0 and row["correct"], row
    text = collective_tables.report(measured[0]["rows"])
    assert f"correctness: {len(SIZES)} WRONG results" in text


def test_ratios_pair_each_call_with_torchs_call_of_the_same_round_and_axis(measured):
    for row in _all_rows(measured[0]):
        low, high = row["vs_torch_ci_low"], row["vs_torch_ci_high"]
        assert low <= row["vs_torch"] <= high
        if row["label"] == "torch":
            assert row["vs_torch"] == low == high == 1.0
    auto = [r for r in measured[0]["rows"] if r["algorithm"] == "auto"]
    assert [r["choice"] for r in auto] == [allreduce.choose_algorithm(s, 2, warn=False) for s in SIZES]
    p2p = [r for rows in measured[0]["transports"].values() for r in rows if r["label"] == "p2p"]
    assert [r["choice"] for r in p2p] == [allreduce.choose_algorithm(TRANSPORT_SIZE, 2, warn=False), None, None]


def test_a_step_on_a_device_gloos_send_cannot_read_goes_through_host_memory(measured):
    """The CPU twin of CUDA over gloo: gloo's send and recv take host memory only (handed device memory, they
    fail with 'writev ... Bad address'), so the one-step rows exchange host tensors."""
    assert [(r["impl"], r["bytes"]) for r in measured[0]["p2p_off_host"]] == [("ours", 4), ("gloo", 4)]


def test_one_step_of_ours_and_of_gloos_is_timed_with_its_bytes(measured):
    p2p = measured[0]["p2p"]
    assert point_to_point_rows(p2p) == p2p
    assert [(r["impl"], r["bytes"]) for r in p2p] == [("ours", 4), ("gloo", 4), ("ours", 4000), ("gloo", 4000)]
    for row in p2p:
        moved = row["bytes"] if row["impl"] == "ours" else row["bytes"] / 2  # gloo's ring on 2 ranks: 2 half steps
        assert row["step_gbps"] == pytest.approx(moved / row["step_s"] / 1e9, rel=1e-12)
        assert doubled_count(row), row  # steps timed in batches, as the axes


def test_the_report_has_one_table_per_axis(measured):
    text = collective_tables.report(measured[0]["rows"] + measured[0]["transports"]["allreduce"])
    algorithms, transports = text.index("## all-reduce: algorithms over gloo"), text.index("## all-reduce: transports")
    assert (algorithms < text.index("| 2 | 4000B | ring |") < transports
            < text.index("| 2 | 64KiB | shared_memory |"))


def test_the_backend_axis_has_a_gloo_and_a_dpkit_row_per_collective_and_size(measured):
    rows = [r for r in measured[0]["backend"] if "axis" in r]
    assert all(r["axis"] == "backend" and r["world_size"] == 2 for r in rows)
    for collective, call in backend_axis.BACKEND_CALLS.items():
        mine = [r for r in rows if r["collective"] == collective]
        sizes = BACKEND_SIZES[:1] if collective == "barrier" else BACKEND_SIZES
        assert [r["label"] for r in mine] == ["gloo", collectives.BACKEND] * len(sizes), collective
        assert [r["transport"] for r in mine] == ["gloo", "dpkit"] * len(sizes)
        assert {r["algorithm"] for r in mine} == {f"dist.{call}"}
        if collective in ("all_gather", "reduce_scatter") and hasattr(dist, "all_gather_single"):
            assert call == f"{collective}_single"  # the name of what compat calls on this torch
        # nccl-tests: the full tensor's bytes; the sharded calls and all-to-all hold at least one element per rank
        sharded = collective in ("all_gather", "reduce_scatter", "all_to_all")
        expected = [0] if collective == "barrier" else [max(s, 8) if sharded else s for s in sizes]
        assert [r["bytes"] for r in mine[::2]] == [r["bytes"] for r in mine[1::2]] == expected
    assert measured[0]["backend"] == measured[1]["backend"]  # timings and floor: each the slowest rank's


def test_the_backend_rows_are_exact_and_a_wrong_result_is_flagged_on_every_collective(measured):
    rows = [r for r in measured[0]["backend"] if "axis" in r]
    assert all(r["max_abs_error"] == 0.0 and r["correct"] for r in rows)
    for collective in (c for c in backend_axis.BACKEND_CALLS if c != "barrier"):
        assert max(rank["backend_wrong"][collective] for rank in measured) == 1.0, collective


def test_the_backend_ratio_is_dpkit_over_gloo_of_the_same_rounds_timed_in_batches(measured):
    rows = [r for r in measured[0]["backend"] if "axis" in r]
    for gloo, dpkit in zip(rows[::2], rows[1::2]):
        assert gloo["vs_torch"] == gloo["vs_torch_ci_low"] == gloo["vs_torch_ci_high"] == 1.0
        assert dpkit["vs_torch"] == pytest.approx(float(np.median(np.divide(dpkit["round_p50_s"],
                                                                            gloo["round_p50_s"]))))
        assert doubled_count(gloo) and doubled_count(dpkit)
        assert 0 < dpkit["min_s"] <= dpkit["p50_s"] <= dpkit["p95_s"]
        factor = {"allreduce": 1.0, "broadcast": 1.0, "reduce": 1.0, "barrier": 0.0}.get(dpkit["collective"], 0.5)
        assert dpkit["busbw_gbps"] == pytest.approx(dpkit["algbw_gbps"] * factor, rel=1e-12)


def test_a_timed_call_first_writes_the_tensor_it_sends_unless_the_call_writes_it_itself(measured):
    """As a training step writes what it then sends: a tensor left as it was would still sit, clean, in a
    single-copy reader's cache. The all-reduce writes its sum (of sevens) over it; the others sent zeros."""
    for rank in measured:
        assert rank["backend_sent"] == {"allreduce": ([14.0], False), "broadcast": ([0.0], True),
                                        "reduce": ([0.0], True), "all_gather": ([0.0], True),
                                        "reduce_scatter": ([0.0], True), "all_to_all": ([0.0], True)}


def test_measuring_the_backend_at_several_sizes_leaves_no_group_behind(measured):
    for rank in measured:  # the floor's one-rank and gloo groups are made per size and destroyed after it
        assert rank["groups_after_backend"] == rank["groups_before_backend"]


def test_the_backend_targets_and_latency_floor_are_stored_with_the_rows(measured):
    checks = collective_targets.stored_targets(measured[0]["backend"])
    moving = [c for c in backend_axis.BACKEND_CALLS if c != "barrier"]  # every collective that moves data
    assert [(c["collective"], c["axis"], c["label"], c["reference"], c["bytes"], c["limit"], c["world_size"])
            for c in checks] == [(collective, "backend", collectives.BACKEND, "gloo", nbytes, 0.25, 2)
                                 for collective in moving for nbytes in (4 << 10, 64 << 10)]
    assert all(c["text"].startswith(f"target {collectives.NAMES[c['collective']]} through dpkit backend <= 0.25x "
                                    "gloo, 2 processes") for c in checks)
    floor = [r for r in measured[0]["backend"] if r.get("kind") == "latency floor"]
    for nbytes in backend_axis.FLOOR_SIZES:
        mine = [r for r in floor if r["bytes"] == nbytes]
        assert {r["case"] for r in mine} == FLOOR_CASES and all(r["seconds_per_call"] > 0 for r in mine)
    text = collective_tables.report(measured[0]["backend"])
    assert text.index('torch.distributed on a "dpkit" group against a gloo group') < text.index(
        "| 2 | dist.all_reduce | 4KiB | dpkit backend |") < text.index("latency floor") < text.index(
        "| 2 | 4KiB | wait (exchange of no data) |")


# --------------------------------------------------------------------------- no processes


def _row(algorithm, seconds, nbytes=10 << 20, world=2, ratio=None, ci=None, oversubscribed=False, correct=True,
         choice=None, axis="algorithm", label=None, collective="allreduce"):
    return {"backend": "gloo", "world_size": world, "collective": collective, "axis": axis,
            "transport": "gloo" if axis == "algorithm" else label, "algorithm": algorithm, "label": label or algorithm,
            "bytes": nbytes, "avg_s": seconds, "p50_s": seconds, "p95_s": seconds, "algbw_gbps": 1.0, "busbw_gbps": 1.0,
            "vs_torch": ratio, "vs_torch_ci_low": ci[0] if ci else None, "vs_torch_ci_high": ci[1] if ci else None,
            "rounds": 6, "oversubscribed": oversubscribed, "choice": choice,
            "max_abs_error": 0.0 if correct else 2.0, "correct": correct}


def _transport_row(label, seconds, **kw):
    algorithm = {"torch": "torch", "p2p": "auto"}.get(label, "direct")
    return _row(algorithm, seconds, axis="transport", label=label, **kw)


def test_sizes_are_powers_of_two_units_like_nccl_tests():
    assert [collectives.parse_size(s) for s in ("4096", "64KB", "10MB", "1GB", "1.5MB", "64KiB", "10mib", "1G")] == [
        4096, 65536, 10 << 20, 1 << 30, 3 << 19, 65536, 10 << 20, 1 << 30]
    assert [collectives.format_size(n) for n in (65536, 10 << 20, 1 << 30, 1000)] == ["64KiB", "10MiB", "1GiB", "1000B"]
    with pytest.raises(Exception, match="not a size"):
        collectives.parse_size("ten megabytes")


@pytest.mark.parametrize("numel", [1, 1000, 1024, 5000, 4096 * 1024 + 3])
def test_the_pattern_sums_exactly_and_any_wrong_element_shows(numel):
    world = 6
    total = torch.zeros(numel, dtype=torch.float32)
    for rank in range(world):
        x = torch.empty(numel, dtype=torch.float32)
        exact_pattern.fill_pattern(x, rank)
        assert x[0].item() == rank and x[-1].item() == (numel - 1) % exact_pattern.PERIOD + rank
        total += x  # in float32, in rank order: the pattern's sums are exact whatever the order
    assert exact_pattern.pattern_error(total, world) == 0.0
    total[numel // 2] += 1
    assert exact_pattern.pattern_error(total, world) == 1.0


def test_targets_give_the_interval_and_a_verdict_and_label_oversubscribed_runs():
    lines = collective_targets.target_lines([
        _row("torch", 0.1, ratio=1.0, ci=[1.0, 1.0]),
        _row("auto", 0.09, nbytes=4000, ratio=0.9, ci=[0.85, 0.97]),
        _row("auto", 0.105, ratio=1.05, ci=[1.02, 1.08]),
        _row("auto", 0.2, nbytes=100 << 20, world=4, ratio=1.3, ci=[1.2, 1.4], oversubscribed=True),
        _row("ring", 0.105, ratio=1.05, ci=[0.9, 1.2]),
    ])
    assert "target auto <= 1.10x torch, 2 processes, 4000B: 0.90x [0.85, 0.97] met" in lines
    assert "target auto <= 1.10x torch, 2 processes, 10MiB: 1.05x [1.02, 1.08] met" in lines
    assert "target auto <= 1.00x torch, 2 processes, 10MiB: 1.05x [1.02, 1.08] missed" in lines
    assert any(line.startswith("target auto <= 1.00x torch, 4 processes, 100MiB: 1.30x [1.20, 1.40] missed "
                               "[oversubscribed")
               for line in lines)
    assert "target ring <= 1.10x torch, 2 processes, 10MiB: 1.05x [0.90, 1.20] inconclusive" in lines
    assert len(lines) == 6  # auto at 4000 B has no 1.00 target; torch has none


def test_the_zero_copy_all_reduce_has_its_own_targets_at_10_and_100_mib_with_2_processes():
    zero, staged = "shared_memory", "shared_memory:staged"
    rows = [_transport_row("torch", 0.1, ratio=1.0, ci=[1.0, 1.0]),
            _transport_row(zero, 0.04, ratio=0.40, ci=[0.38, 0.43]),
            _transport_row(zero, 0.33, nbytes=100 << 20, ratio=0.33, ci=[0.31, 0.35]),
            _transport_row(zero, 0.3, nbytes=1 << 20, ratio=0.3, ci=[0.2, 0.4]),  # no target at 1 MiB
            _transport_row(zero, 0.5, world=4, ratio=0.5, ci=[0.45, 0.55], oversubscribed=True),  # nor with 4
            _transport_row(staged, 0.06, ratio=0.6, ci=[0.55, 0.65]),  # no target for staged
            _transport_row("p2p", 0.1, ratio=1.0, ci=[0.9, 1.1], choice="halving_doubling"),  # nor for p2p's all-reduce
            _row("auto", 0.04, ratio=0.4, ci=[0.38, 0.42], axis="transport", label="auto (ran shared_memory, staged)")]
    lines = collective_targets.target_lines(rows)
    assert lines == [
        "target all-reduce through shared_memory <= 0.45x torch, 2 processes, 10MiB: "
        "0.40x [0.38, 0.43] met",
        "target all-reduce through shared_memory <= 0.30x torch, 2 processes, 100MiB: "
        "0.33x [0.31, 0.35] missed"]
    inconclusive = collective_targets.target_checks([_transport_row(zero, 0.03, nbytes=100 << 20, ratio=0.29,
                                                                    ci=[0.27, 0.32])])
    assert [(c["axis"], c["label"], c["limit"], c["verdict"]) for c in inconclusive] == [
        ("transport", zero, 0.30, "inconclusive")]


def test_an_algorithm_target_never_judges_a_transport_row():
    """A transport row whose algorithm has a target on the other axis (p2p runs auto) is not that target's row."""
    rows = [_transport_row("p2p", 0.1, ratio=1.3, ci=[1.2, 1.4]),
            _transport_row("torch", 0.1, ratio=1.0, ci=[1.0, 1.0])]
    assert collective_targets.target_checks(rows) == []


def test_the_sharded_collectives_have_their_own_targets_and_sizes_rounded_to_the_world():
    rows = [_transport_row("torch", 0.1, ratio=1.0, ci=[1.0, 1.0], collective="reduce_scatter"),
            _transport_row("p2p", 0.06, nbytes=(10 << 20) - 8, ratio=0.6, ci=[0.55, 0.65], collective="reduce_scatter"),
            _transport_row("p2p", 0.12, ratio=1.2, ci=[1.15, 1.25], collective="all_gather"),
            _transport_row("shared_memory", 0.02, ratio=0.2, ci=[0.15, 0.25], collective="all_gather")]
    text = collective_tables.report(rows)
    assert "target reduce-scatter through p2p <= 0.70x torch, 2 processes, 10MiB: 0.60x [0.55, 0.65] met" in text
    assert "target all-gather through p2p <= 1.10x torch, 2 processes, 10MiB: 1.20x [1.15, 1.25] missed" in text
    assert "target auto" not in text and "target ring" not in text and "zero copy) <=" not in text
    assert "## reduce-scatter, all-gather: transports" in text and "algorithms over" not in text


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_model_fit_recovers_known_alpha_and_beta(world):
    """Times made by the model itself (alpha 150 us, 0.5 GB/s) must give back exactly those parameters."""
    alpha, beta = 150e-6, 2e-9
    sizes = [4000, 1 << 16, 1 << 20, 10 << 20, 100 << 20]
    rows = []
    for name in ("torch", "ring", "butterfly", "halving_doubling", "recursive_doubling", "tree"):
        for nbytes in sizes:
            steps, moved = latency_model.model_terms(name, world, nbytes)
            rows.append(_row(name, steps * alpha + moved * beta, nbytes=nbytes, world=world))
    rows.append(_row("auto", 1.0, world=world))  # not a model of its own: ignored
    rows += [_transport_row("torch", 1.0, nbytes=s, world=world) for s in sizes]  # another axis: ignored
    fits = latency_model.fit_model(rows)
    assert len(fits) == 6
    for fit in fits:
        assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
        assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
        assert fit["max_rel_error"] < 1e-6
        terms = latency_model.model_terms(fit["algorithm"], world, 1 << 22)
        assert latency_model.predict(fit, 1 << 22) == pytest.approx(sum(np.multiply(terms, (alpha, beta))))


def test_the_steps_are_those_of_each_algorithm():
    assert latency_model.model_terms("recursive_doubling", 8, 4000) == (3, 3 * 4000)
    assert latency_model.model_terms("recursive_doubling", 6, 4000) == (2 + 2, 4 * 4000)  # p = 4, folded in and out
    assert latency_model.model_terms("ring", 4, 4000) == (6, 1.5 * 4000)
    assert latency_model.model_terms("halving_doubling", 4, 4000) == (4, 1.5 * 4000)
    assert latency_model.model_terms("tree", 2, 4000)[0] == 2 and latency_model.model_terms("tree", 7, 4000)[0] == 4


def test_the_crossover_table_keeps_the_fastest_ignores_a_one_size_flip_and_bounds_at_the_geometric_mean():
    sizes = [4096 << (2 * i) for i in range(7)]
    times = {size: {"recursive_doubling": 1 if i < 2 else 2, "ring": 2 if i < 2 else 1, "tree": 0.97 if i == 4 else 2}
             for i, size in enumerate(sizes)}  # recursive doubling, then the ring; the tree 3 % ahead at one size only
    rows = [_row(name, t, nbytes=size, world=4) for size, by_name in times.items() for name, t in by_name.items()]
    rows.append(_row("torch", 0.001, nbytes=4096, world=4))  # not ours: never chosen
    rows.append(_row("ring", 0.001, nbytes=4096, world=4, axis="transport", label="p2p"))  # another axis: never chosen
    table = crossover_table(rows, CUSTOM)
    assert table == {4: ((int(math.sqrt(sizes[1] * sizes[2])), "recursive_doubling"), (None, "ring"))}
    assert format_table(table) == "4 processes: recursive_doubling up to 32KiB, ring above"
    assert [allreduce.choose_algorithm(s, 4, table) for s in sizes] == ["recursive_doubling"] * 2 + ["ring"] * 5


def _chart_rows():
    return [_row("ring", 3e-3, nbytes=4000), _row("recursive_doubling", 1e-3, nbytes=4000),
            _row("ring", 5e-3, nbytes=1 << 20), _row("recursive_doubling", 9e-3, nbytes=1 << 20),
            _row("auto", 1.1e-3, nbytes=4000, choice="recursive_doubling"),
            _row("auto", 5.2e-3, nbytes=1 << 20, choice="ring"),
            *[_transport_row(label, 1e-3 * (i + 1), nbytes=s)
              for i, label in enumerate(LABELS) for s in (4000, 1 << 20)]]


def test_the_per_size_chart_draws_one_axis_and_marks_the_algorithm_auto_chose():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (algorithms, transports) = plt.subplots(1, 2)
    collective_plots.draw_per_size(algorithms, _chart_rows(), "gloo", 2)
    lines = {line.get_label(): line for line in algorithms.get_lines()}
    assert set(algorithms.get_legend_handles_labels()[1]) == {"ring", "recursive doubling", "auto (measured)",
                                                              "auto's choice"}
    assert list(lines["auto's choice"].get_xdata()) == [4000, 1 << 20]
    assert list(lines["auto's choice"].get_ydata()) == pytest.approx([1.0, 5.0])  # ms: RD's point, then the ring's
    assert algorithms.get_title() == "algorithms over gloo, 2 processes"
    collective_plots.draw_per_size(transports, _chart_rows(), "gloo", 2, axis="transport")
    assert transports.get_legend_handles_labels()[1] == LABELS  # the registry's names
    assert transports.get_title() == "transports, 2 processes"
    plt.close(figure)


def test_quick_and_tune_fill_defaults_but_explicit_flags_win():
    quick = bench.parse_args(["--quick", "--iters", "7"])
    assert quick.iters == 7 and quick.warmup == bench.QUICK["warmup"] and quick.procs == bench.QUICK["procs"]
    tune = bench.parse_args(["--tune", "--procs", "2"])
    assert tune.procs == [2] and tune.algorithms == list(CUSTOM) and tune.transports == []
    assert tune.sizes == [collectives.parse_size(s) for s in bench.TUNE_SIZES]
    plain = bench.parse_args([])
    assert plain.iters == 20 and plain.sizes == [collectives.parse_size(s) for s in bench.DEFAULT_SIZES]
    with pytest.raises(SystemExit):
        bench.parse_args(["--tune", "--axis", "transports"])


def test_the_axis_selects_what_is_measured():
    both = bench.parse_args([])
    assert both.axis == "both"
    assert both.algorithms == list(allreduce.ALGORITHMS) and both.transports == list(collectives.TRANSPORTS)
    assert both.backend_collectives == []
    backends = bench.parse_args(["--axis", "backends"])
    assert backends.algorithms == backends.transports == []
    assert backends.backend_collectives == list(backend_axis.BACKEND_CALLS)
    assert backends.backend_sizes == [collectives.parse_size(s) for s in bench.BACKEND_SIZES]
    every = bench.parse_args(["--axis", "all", "--backend-collectives", "allreduce"])
    assert every.algorithms and every.transports and every.backend_collectives == ["allreduce"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--collective", "all_gather", "--axis", "all"])
    algorithms = bench.parse_args(["--axis", "algorithms"])
    assert algorithms.algorithms == list(allreduce.ALGORITHMS) and algorithms.transports == []
    transports = bench.parse_args(["--axis", "transports", "--transports", "torch", "shared_memory"])
    assert transports.algorithms == [] and transports.transports == ["torch", "shared_memory"]


def test_a_sharded_collective_compares_transports_only():
    for collective in ("all_gather", "reduce_scatter"):
        args = bench.parse_args(["--collective", collective])
        assert args.axis == "transports" and args.algorithms == [] and args.transports == list(collectives.TRANSPORTS)
    for wrong in (["--algorithms", "butterfly"], ["--axis", "algorithms"], ["--axis", "both"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--collective", "reduce_scatter", *wrong])
