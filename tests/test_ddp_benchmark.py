"""ddp_benchmark.py: a tiny run of every variant on every transport writes sane results in the shared layout.

One spawned group does the measuring: the sweep at world size 2 (2 workers through
process_groups.launch; its single-process no-ddp row runs in this process) on the homework CNN,
batch 2 per rank, 2 timed iterations in one round after 1 warm-up, at PyTorch's default bucket
cap (25 MiB), on gloo, shared memory and shared memory with a communication thread, writing
JSON and Chrome traces. Every test of it reads that run, or the diff of its file against a copy
with timings changed by known factors. Its timings themselves are never asserted: only their
relations (percentiles of the slowest rank's samples, waits inside iterations), which checks
compare which rows, and what each variant keeps and sends. The statistics and the verdicts are
checked exactly on a world of one timed by a scripted clock (rounds, drift, every axis).
"""

from __future__ import annotations

import argparse
import copy
import io
import itertools
import json
import math
import os
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch

import toy_engine
from common import PG_TIMEOUT_S, WORKERS_TIMEOUT_S
import ddp_benchmark as bench
from dpkit.bench import ddp_replicas, ddp_run, ddp_step, ddp_targets, ddp_variants, harness, measure
from dpkit.bench import transport_choice
from dpkit.bench.results import read_results, write_results
from dpkit.bench.row_identity import STAGED, ZERO_COPY
from dpkit.bench.row_identity import label as row_label
from dpkit.comm import registry
from dpkit.comm import transport
from dpkit.engines import ddp
from dpkit.engines.ddp import LAST_BUCKET_CAP_MB
from dpkit import models
from dpkit.models import Net
from dpkit.report import ddp_printout, ddp_tables, plots

# One round: rounds are pooled and paired in the scripted run below; here every row is built once.
BATCH, ITERS, ROUNDS, WORLD = 2, 2, 1, 2
BUCKETS = (25.0,)  # PyTorch's default, the targets' size: other sizes only add rows (variants_for is tested alone)
SWEEP_TRANSPORTS = ("torch", "shared_memory", "shared_memory:thread", "torch:dpkit")
# The rows of the sweep, in the order they are printed: PyTorch's DDP at its defaults with its own gloo only,
# at its best settings on both inline transports (shared memory through its comm hook); ours naive and flat sum
# after backward, so a thread would change nothing for them; ours overlap and bucketed on every transport but
# "torch:dpkit", a process group of the backend "dpkit", which only PyTorch's DDP takes.
LABELS = ["no ddp", "ddp pytorch 25M [torch]", "ddp pytorch best 25M [torch]",
          "ddp pytorch best 25M [shared_memory]", "ddp pytorch best 25M [torch:dpkit]", "ddp ours naive [torch]",
          "ddp ours naive [shared_memory]", "ddp ours flat [torch]", "ddp ours flat [shared_memory]",
          "ddp ours overlap [torch]", "ddp ours overlap [shared_memory]", "ddp ours overlap [shared_memory:thread]",
          "ddp ours 25M [torch]", "ddp ours 25M [shared_memory]", "ddp ours 25M [shared_memory:thread]"]
SHM_ALL_REDUCE = transport.SHARED_MEMORY_RANGE.format("all_reduce")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(results document, printed report, trace directory) of the one measured run."""
    tmp = tmp_path_factory.mktemp("ddp_benchmark")
    out = io.StringIO()
    with redirect_stdout(out):
        bench.main(["sweep", "--world-sizes", str(WORLD), "--models", "cnn", "--batch-size", str(BATCH),
                    "--iters", str(ITERS), "--rounds", str(ROUNDS), "--warmup", "1", "--timeout", str(PG_TIMEOUT_S),
                    "--bucket-sizes", *map(str, BUCKETS), "--transports", *SWEEP_TRANSPORTS,
                    "--max-time", str(WORKERS_TIMEOUT_S), "--json", str(tmp / "run.json"),
                    "--profile", str(tmp / "traces")])
    return read_results(str(tmp / "run.json")), out.getvalue(), tmp / "traces"


def rows_at(doc: dict, world: int) -> dict[str, dict]:
    return {r["label"]: r for r in doc["results"] if r["world_size"] == world}


def but_transport(fields: dict) -> dict:
    """A side's identity without its transport and path: the engine, implementation, option and cap."""
    return {k: v for k, v in fields.items() if k not in ("transport", "path")}


def cnn_parameters() -> list[torch.Tensor]:
    return list(Net().parameters())


# --------------------------------------------------------------------------- which rows run


# The default rows on a CPU (transports torch and shared_memory), at the default bucket sizes the issue lists.
DEFAULT_LABELS = (["no ddp"] + [f"ddp pytorch {mb}M [torch]" for mb in (1, 10, 25, 100, 1000)]
                  + ["ddp pytorch best 25M [torch]", "ddp pytorch best 25M [shared_memory]", "ddp ours naive [torch]",
                     "ddp ours naive [shared_memory]", "ddp ours flat [torch]", "ddp ours flat [shared_memory]",
                     "ddp ours overlap [torch]", "ddp ours overlap [shared_memory]"]
                  + [f"ddp ours {mb}M [{t}]" for t in ("torch", "shared_memory") for mb in (1, 10, 25, 100, 1000)])


def test_by_default_every_variant_runs_on_gloo_and_shared_memory_on_a_cpu_and_on_torch_alone_on_gpus():
    args = bench.parse_args([])
    assert ddp_variants.default_transports(args, torch.device("cpu")) == ["torch", "shared_memory"]
    assert ddp_variants.default_transports(args, torch.device("cuda")) == ["torch"]
    assert harness.config(bench.BENCHMARK, args)["variants"] == DEFAULT_LABELS
    assert [v.label for v in ddp_variants.variants_for(ddp_step.DDP_KINDS, args.bucket_sizes)] == DEFAULT_LABELS
    on_gpus = ddp_variants.variants_for(ddp_step.DDP_KINDS, [25.0], ["torch"])
    assert {v.transport for v in on_gpus} == {None, "torch"}


def test_a_thread_runs_only_the_variants_whose_sums_can_overlap_backward():
    variants = ddp_variants.variants_for(ddp_step.DDP_KINDS, [1.0], ["torch", "shared_memory", "shared_memory:thread"])
    assert [v.label for v in variants if v.transport == "shared_memory:thread"] == [
        "ddp ours overlap [shared_memory:thread]", "ddp ours 1M [shared_memory:thread]"]
    # PyTorch's DDP at its defaults keeps its own gloo, and also runs at its default bucket size (25 MiB)
    assert [v.label for v in variants if v.kind == "ddp pytorch"] == ["ddp pytorch 1M [torch]",
                                                                      "ddp pytorch 25M [torch]"]
    assert [v.label for v in variants if v.kind == "ddp pytorch best"] == ["ddp pytorch best 25M [torch]",
                                                                       "ddp pytorch best 25M [shared_memory]"]
    assert [(v.kind, v.engine, v.bucket_mb, v.transport) for v in variants[:1]] == [("no ddp", None, None, None)]
    assert ddp_variants.variant("ddp ours", 25.0, "shared_memory:thread").slug == "ddp-ours-25M-[shared_memory:thread]"
    assert {v.kind: (v.engine, v.impl, v.option) for v in variants if v.engine} == ddp_step.DDP_FIELDS


def test_transports_are_made_in_one_order_whatever_order_they_are_asked_in(monkeypatch):
    """Each transport is made collectively: ranks that made them in different orders (a set's order differs
    between processes) would wait on each other forever. Recorded here without a process group."""
    built = []
    monkeypatch.setattr(registry, "resolve", lambda spec, group=None, device=None, **_: built.append(spec) or spec)
    cpu = torch.device("cpu")
    for order in itertools.permutations(SWEEP_TRANSPORTS):
        for names in (list(order), set(order), dict.fromkeys(order)):
            built.clear()
            made = transport_choice.make(names, cpu)
            assert built == ["torch", "torch:dpkit", "shared_memory", "shared_memory:thread"], names
            assert list(made) == built
    built.clear()
    with pytest.raises(ValueError, match="unknown transport 'gloo': choose one of torch, torch:dpkit, "):
        transport_choice.make(["torch", "gloo"], cpu)
    assert built == []  # refused before any was made


# --------------------------------------------------------------------------- the results file


def test_results_file_is_in_the_shared_layout(sweep):
    doc, _, _ = sweep
    assert doc["benchmark"] == "ddp_benchmark"
    assert doc["env"]["torch"] == torch.__version__ and doc["env"]["backend"] == "gloo"
    assert doc["env"]["world_size"] == [1, WORLD] and doc["env"]["threads"] == 1
    assert doc["config"]["bucket_sizes"] == list(BUCKETS) and doc["config"]["world_sizes"] == [1, WORLD]
    assert doc["config"]["transports"] == list(SWEEP_TRANSPORTS)
    assert doc["config"]["variants"] == LABELS


def test_a_row_per_variant_and_transport_and_the_single_process_no_ddp_row(sweep):
    doc, _, _ = sweep
    assert [r["label"] for r in doc["results"] if r["world_size"] == WORLD] == LABELS
    assert [r["label"] for r in doc["results"] if r["world_size"] == 1] == ["no ddp"]
    rows = rows_at(doc, WORLD)
    buckets = {label: r["bucket_cap_mb"] for label, r in rows.items()}
    assert buckets["ddp ours overlap [shared_memory]"] == 0 and buckets["ddp ours naive [torch]"] is None
    assert buckets["ddp pytorch 25M [torch]"] == 25


def test_each_row_carries_its_identity_and_the_path_it_recorded_and_its_label_is_formatted_from_them(sweep):
    doc, _, _ = sweep
    for r in doc["results"]:
        assert r["label"] == row_label(r), r["label"]
    rows = rows_at(doc, WORLD)
    fields = {k: rows["ddp pytorch best 25M [shared_memory]"][k] for k in ("engine", "impl", "option", "transport")}
    assert fields == {"engine": "ddp", "impl": "pytorch", "option": "best", "transport": "shared_memory"}
    assert (rows["no ddp"]["engine"], rows["no ddp"]["transport"]) == (None, None)
    # On shared memory, the path each row took as the transport saw it: PyTorch's buckets (handed to its comm hook)
    # and naive's gradients are copied into a staging block; ours sums in buffers the transport allocated.
    staged = {"ddp pytorch best 25M [shared_memory]", "ddp ours naive [shared_memory]"}
    for label, r in rows.items():
        on_shared_memory = r["transport"] in ("shared_memory", "shared_memory:thread")
        expected = (STAGED if label in staged else ZERO_COPY) if on_shared_memory else None
        assert r["path"] == expected, label
        assert (r["transport_staging_bytes"] > 0) == (expected == STAGED), label


def test_the_results_file_stores_the_target_checks_of_its_rows(sweep):
    doc, printed, _ = sweep
    assert doc["targets"] and doc["targets"] == ddp_targets.target_checks(doc["results"])
    assert "\n".join(ddp_printout.targets_text(doc["targets"])) in printed


def test_each_check_compares_along_one_axis(sweep):
    """Impl: ours and PyTorch's on one transport. Transport: one engine on two transports. Overhead: ours against
    no DDP.
    Overlap: exposed waits on the asynchronous transports, against naive's sums on the same wire; and, for
    information only, the communication thread against the same sums made inline."""
    doc, _, _ = sweep
    rows = rows_at(doc, WORLD)
    faster_on_torch = min(("ddp pytorch 25M [torch]", "ddp pytorch best 25M [torch]"),
                          key=lambda label: rows[label]["p50_s"])
    expected = {
        ("impl", "p50 / faster pytorch p50, same transport", "ddp ours 25M [torch]", faster_on_torch),
        ("impl", "peak memory / same pytorch row", "ddp ours 25M [torch]", faster_on_torch),
        ("impl", "p50 / faster pytorch p50, same "
                 "transport", "ddp ours 25M [shared_memory]", "ddp pytorch best 25M [shared_memory]"),
        ("impl", "peak memory / same pytorch "
                 "row", "ddp ours 25M [shared_memory]", "ddp pytorch best 25M [shared_memory]"),
        *(("transport", "p50 / the same engine on torch", f"ddp pytorch best 25M [{t}]", "ddp pytorch best 25M [torch]")
          for t in ("shared_memory", "torch:dpkit")),
        ("overhead", "p50 / no DDP", "ddp ours 25M [shared_memory]", "no ddp"),
        *(("overlap", "exposed wait / naive's all-reduce time", f"{v} [{t}]", naive)
          for t, naive in (("torch", "ddp ours naive [torch]"),
                           ("shared_memory:thread", "ddp ours naive [shared_memory]"))
          for v in ("ddp ours overlap", "ddp ours 25M")),
        *(("overlap", "p50 / the same sums in the backward hook", f"{v} [shared_memory:thread]", f"{v} [shared_memory]")
          for v in ("ddp ours overlap", "ddp ours 25M")),
    }
    checks = doc["targets"]
    assert {(c["axis"], c["target"], c["label"], c["reference"]) for c in checks} == expected
    assert len(checks) == len(expected)
    for c in checks:
        assert (c["model"], c["world_size"]) == ("cnn", WORLD)
        ours, theirs = c["row"], c["reference_row"]
        assert ours == {k: rows[c["label"]][k] for k in ours} and theirs == {k: rows[c["reference"]][k] for k in theirs}
        if c["axis"] == "impl":
            assert ours["transport"] == theirs["transport"] and ours["impl"] != theirs["impl"], c
        elif c["axis"] == "transport":
            assert but_transport(ours) == but_transport(theirs) and ours["transport"] != theirs["transport"], c
        elif c["axis"] == "overhead":
            assert theirs["engine"] is None, c
        elif c["limit"] is not None:
            assert ours["transport"] in ddp_variants.ASYNCHRONOUS, c
        if c["limit"] is None:
            assert c["verdict"] == "information" and c["axis"] == "overlap", c
        else:
            assert c["verdict"] == measure.verdict(c["ratio"], c["limit"]), c


def test_rows_are_related_to_pytorch_on_their_own_transport(sweep):
    rows = rows_at(sweep[0], WORLD)
    for label, row in rows.items():
        assert row["vs_no_ddp"] == measure.paired_ratio(row["round_p50_s"], rows["no ddp"]["round_p50_s"])
        for kind, key in (("ddp pytorch", "vs_pytorch"), ("ddp pytorch best", "vs_pytorch_best")):
            reference = rows.get(f"{kind} 25M [{row['transport']}]")
            assert row[key] == (reference and measure.paired_ratio(row["round_p50_s"], reference["round_p50_s"])), label
    # PyTorch at its defaults has no shared-memory row: ours on shared memory is not compared with it on gloo
    assert rows["ddp ours 25M "
                "[shared_memory]"]["vs_pytorch"] is None and rows["ddp ours 25M [shared_memory]"]["vs_pytorch_best"]
    assert (rows["ddp ours 25M [shared_memory:thread]"]["vs_pytorch"] is None
            is rows["ddp ours 25M [shared_memory:thread]"]["vs_pytorch_best"])


# --------------------------------------------------------------------------- the statistics, against a scripted clock


# Seconds per iteration of each variant in a world of one, and the exposed wait ours report.
# The oracle: every figure below follows from these numbers by hand, not from the benchmark's code.
SCRIPT = {"no ddp": (0.100, 0.0), "ddp pytorch 25M [torch]": (0.150, 0.0), "ddp pytorch best 25M [torch]": (0.120, 0.0),
          "ddp pytorch best 25M [shared_memory]": (0.108, 0.0), "ddp pytorch best 25M [torch:dpkit]": (0.111, 0.0),
          "ddp ours naive [torch]": (0.200, 0.080), "ddp ours naive [shared_memory]": (0.180, 0.060),
          "ddp ours 25M [torch]": (0.132, 0.004), "ddp ours 25M [shared_memory]": (0.104, 0.001),
          "ddp ours 25M [shared_memory:thread]": (0.1144, 0.036)}
DRIFT = (1.0, 2.0, 1.5, 3.0)  # the machine slows down and recovers: round r multiplies every time by DRIFT[r]
SCRIPTED_ITERS = 8  # 2 per round
# The engine each kind must be built as (in a world of one every transport is torch's: nothing travels).
ENGINES = {"no ddp": Net, "ddp pytorch": torch.nn.parallel.DistributedDataParallel,
           "ddp pytorch best": torch.nn.parallel.DistributedDataParallel, "ddp ours": ddp.DDP,
           "ddp ours naive": ddp.NaiveDDP}


class ScriptedClock:
    """Stands in for time.perf_counter in measure.py: a step advances it by its variant's scripted time."""

    def __init__(self):
        self.now, self.replicas, self.built = 0.0, 0, []

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def scripted():
    """A world-of-one run of no ddp, both PyTorch rows, ddp ours 25M and ours naive on every transport, timed by the
    scripted clock; also what make_replica built for each variant."""
    clock = ScriptedClock()
    variants = len(SCRIPT)
    real_make, real_time = ddp_replicas.make_replica, measure.time

    def make_replica(variant, module, batch, made):
        replica = real_make(variant, module, batch, made)
        assert set(made) == set(SWEEP_TRANSPORTS)  # one transport object per name, made once for the whole run
        clock.built.append((variant, replica.model))
        replica.label = variant.label
        replica.drift = DRIFT[clock.replicas // variants]  # schedule(): round r builds every variant once
        clock.replicas += 1
        return replica

    def step(replica):
        seconds, wait = SCRIPT[replica.label]
        clock.now += seconds * replica.drift
        replica.waits.append(wait * replica.drift)

    patch = pytest.MonkeyPatch()
    patch.setattr(ddp_run, "make_replica", make_replica)
    patch.setattr(ddp_step.Replica, "step", step)
    patch.setattr(measure, "time", clock)
    try:
        args = bench.parse_args(["--models", "cnn", "--variants", "ddp pytorch", "ddp pytorch best", "ddp ours",
                                 "ddp ours naive",
                                 "--transports", *SWEEP_TRANSPORTS, "--bucket-sizes", "25", "--batch-size", str(BATCH),
                                 "--iters", str(SCRIPTED_ITERS), "--rounds", str(len(DRIFT)), "--warmup", "1",
                                 "--no-breakdown"])
        with redirect_stdout(io.StringIO()):
            rows = harness.run(bench.BENCHMARK, args)  # without torchrun: a world of one in this process
    finally:
        patch.undo()
    assert real_time is measure.time
    return {r["label"]: r for r in rows}, clock.built


def test_each_variant_is_built_as_its_engine(scripted):
    rows, built = scripted
    assert list(rows) == list(SCRIPT)
    assert len(built) == len(SCRIPT) * len(DRIFT)
    for variant, model in built:
        assert type(model) is ENGINES[variant.kind], variant
        if variant.kind.startswith("ddp pytorch"):
            assert model.gradient_as_bucket_view == (variant.kind == "ddp pytorch best")


def test_percentiles_pool_the_scripted_times_of_every_round(scripted):
    rows, _ = scripted
    for label, (seconds, _) in SCRIPT.items():
        expected = [seconds * d for d in DRIFT for _ in range(SCRIPTED_ITERS // len(DRIFT))]
        row = rows[label]
        assert row["samples_s"] == pytest.approx(expected)
        for p in ddp_run.PERCENTILES:
            assert row[f"p{p}_s"] == pytest.approx(float(np.percentile(expected, p)))
            assert row[f"p{p}_ex_per_s"] == pytest.approx(BATCH / row[f"p{p}_s"])  # one rank: global batch = BATCH
        assert row["round_p50_s"] == pytest.approx([seconds * d for d in DRIFT])


def exact(ratio: dict, expected: float) -> bool:
    """A ratio the same in every round: the interval over rounds is a single point."""
    return [ratio["ci_low"], ratio["median"], ratio["ci_high"]] == pytest.approx([expected] * 3)


def test_ratios_pair_rounds_so_drift_cancels_and_compare_pytorch_on_the_same_transport(scripted):
    # Every round, ddp ours [torch] takes 0.132 / 0.150 = 0.88 of ddp pytorch [torch]'s time and 1.10 of
    # ddp pytorch best [torch]'s, whatever the drift; ddp ours [shared_memory] 0.104 / 0.108 of
    # ddp pytorch best [shared_memory]'s.
    rows, _ = scripted
    assert exact(rows["ddp ours 25M [torch]"]["vs_pytorch"], 0.88)
    assert exact(rows["ddp ours 25M [torch]"]["vs_pytorch_best"], 1.10)
    assert rows["ddp ours 25M [torch]"]["vs_pytorch"]["rounds"] == len(DRIFT)
    assert rows["ddp ours 25M "
                "[shared_memory]"]["vs_pytorch"] is None  # PyTorch at its defaults runs on its own gloo only
    assert exact(rows["ddp ours 25M [shared_memory]"]["vs_pytorch_best"], 0.104 / 0.108)
    assert rows["ddp ours 25M [shared_memory:thread]"]["vs_pytorch_best"] is None  # its hook cannot use the thread
    assert exact(rows["ddp ours naive [shared_memory]"]["vs_no_ddp"], 1.8)
    peers = list(rows.values())
    assert ddp_targets.faster_pytorch(peers, "torch")["label"] == "ddp pytorch best 25M [torch]"
    assert ddp_targets.faster_pytorch(peers, "shared_memory")["label"] == "ddp pytorch best 25M [shared_memory]"
    assert ddp_targets.faster_pytorch(peers, "shared_memory:thread") is None


def test_overhead_is_the_p50_above_the_no_ddp_row(scripted):
    rows, _ = scripted
    p50_drift = float(np.median([d for d in DRIFT for _ in range(SCRIPTED_ITERS // len(DRIFT))]))  # 1.75
    assert rows["ddp ours naive [torch]"]["overhead_s"] == pytest.approx((0.200 - 0.100) * p50_drift)
    assert rows["ddp ours naive [torch]"]["overhead_frac"] == pytest.approx(1.0)
    assert rows["ddp ours naive [shared_memory]"]["overhead_frac"] == pytest.approx(0.8)


def test_exposed_wait_and_its_share_of_the_iteration(scripted):
    rows, _ = scripted
    drift_sum = sum(DRIFT) * (SCRIPTED_ITERS // len(DRIFT))
    for label in ("ddp ours 25M [torch]", "ddp ours 25M [shared_memory:thread]", "ddp ours naive [torch]",
                  "ddp ours naive [shared_memory]"):
        seconds, wait = SCRIPT[label]
        row = rows[label]
        assert row["comm_share"] == pytest.approx(wait * drift_sum / (seconds * drift_sum))
        assert row["round_comm_wait_s"] == pytest.approx([wait * d for d in DRIFT])
    for label in ("no ddp", "ddp pytorch 25M [torch]", "ddp pytorch best 25M [torch]",
                  "ddp pytorch best 25M [shared_memory]"):
        assert rows[label]["comm_wait_s"] is None and rows[label]["comm_share"] is None  # nothing a host clock isolates


def scripted_checks(scripted, world=2):
    rows = [{**r, "world_size": world} for r in scripted[0].values()]  # targets need 2 ranks; the rows are the same
    ddp_targets.relate(rows)
    return rows, ddp_targets.target_checks(rows)


def test_impl_checks_compare_ours_with_the_faster_pytorch_row_on_the_same_transport(scripted):
    rows, checks = scripted_checks(scripted)
    engine = [c for c in checks if c["axis"] == "impl"]
    assert all(c["row"]["transport"] == c["reference_row"]["transport"] for c in engine)
    time = {c["label"]: c for c in engine if c["target"] == "p50 / faster pytorch p50, same transport"}
    assert set(time) == {"ddp ours 25M "
                         "[torch]", "ddp ours 25M [shared_memory]"}  # no PyTorch row on the thread: no check
    assert time["ddp ours 25M [torch]"]["reference"] == "ddp pytorch best 25M [torch]"
    assert exact(time["ddp ours 25M [torch]"]["ratio"], 1.10) and time["ddp ours 25M [torch]"]["verdict"] == "missed"
    assert time["ddp ours 25M [shared_memory]"]["reference"] == "ddp pytorch best 25M [shared_memory]"
    assert exact(time["ddp ours 25M "
                      "[shared_memory]"]["ratio"], 0.104 / 0.108) and time["ddp ours 25M "
                                                                           "[shared_memory]"]["verdict"] == "met"
    by_label = {r["label"]: r for r in rows}
    for c in (c for c in engine if c["target"] == "peak memory / same pytorch row"):
        assert c["reference"] == time[c["label"]]["reference"] and c["limit"] == ddp_targets.TARGET_MEMORY
        assert c["ratio"]["median"] == by_label[c["label"]]["peak_bytes"] / by_label[c["reference"]]["peak_bytes"]


def test_a_registered_engine_is_compared_with_the_faster_pytorch_row_for_information(scripted):
    ours = scripted[0]["ddp ours 25M [torch]"]
    toy = {**ours, "engine": toy_engine.NAME, "label": f"{toy_engine.NAME} ours 25M [torch]",
           "round_p50_s": [t * 0.9 for t in ours["round_p50_s"]]}
    with toy_engine.registered():
        rows = [{**r, "world_size": 2} for r in [*scripted[0].values(), toy]]
        ddp_targets.relate(rows)
        checks = ddp_targets.target_checks(rows)
    registered = [c for c in checks if c["row"]["engine"] == toy_engine.NAME]
    assert [(c["axis"], c["reference"], c["limit"], c["verdict"]) for c in registered] == [
        ("impl", "ddp pytorch best 25M [torch]", None, "information")]  # the target is our DDP's, not the toy's
    assert exact(registered[0]["ratio"], 0.9 * 1.10)  # ours takes 1.10x the faster PyTorch row, the toy 0.9 of ours
    assert len(checks) == len(scripted_checks(scripted)[1]) + 1, "every other check as without the toy"


def test_transport_checks_compare_one_engine_on_two_transports_and_ours_with_no_ddp(scripted):
    _, checks = scripted_checks(scripted)
    transport = {c["label"]: c for c in checks if c["axis"] in ("transport", "overhead")}
    assert set(transport) == {"ddp pytorch best 25M "
                              "[shared_memory]", "ddp pytorch best 25M [torch:dpkit]", "ddp ours 25M [shared_memory]"}
    assert transport["ddp ours 25M "
                     "[shared_memory]"]["axis"] == "overhead"  # against no DDP: not one engine on two transports
    hook = transport["ddp pytorch best 25M [shared_memory]"]
    assert hook["reference"] == "ddp pytorch best 25M [torch]" and hook["limit"] == ddp_targets.TARGET_HOOK
    assert exact(hook["ratio"], 0.108 / 0.120) and hook["verdict"] == "met"  # 0.90 <= 0.95
    backed = transport["ddp pytorch best 25M [torch:dpkit]"]  # the same engine, unchanged, on a "dpkit" process group
    assert (backed["axis"], backed["reference"], backed["limit"]) == ("transport", "ddp pytorch best 25M [torch]",
                                                                      ddp_targets.TARGET_BACKEND)
    assert exact(backed["ratio"], 0.111 / 0.120) and backed["verdict"] == "met"  # 0.925 <= 0.93
    alone = transport["ddp ours 25M [shared_memory]"]
    assert alone["reference"] == "no ddp" and alone["limit"] == ddp_targets.TARGET_VS_NO_DDP
    assert exact(alone["ratio"], 1.04) and alone["verdict"] == "met"  # 1.04 <= 1.15


def test_overlap_is_checked_on_asynchronous_transports_only_against_naive_on_the_same_wire(scripted):
    _, checks = scripted_checks(scripted)
    hidden = {c["label"]: c for c in checks if c["axis"] == "overlap" and c["limit"] is not None}
    # ddp ours 25M [shared_memory] waits 0.001 / 0.060 of ours naive [shared_memory]: inline, its sums are inside
    # backward: not checked
    assert set(hidden) == {"ddp ours 25M [torch]", "ddp ours 25M [shared_memory:thread]"}
    assert hidden["ddp ours 25M [torch]"]["reference"] == "ddp ours naive [torch]"
    assert exact(hidden["ddp ours 25M [torch]"]["ratio"], 0.004 / 0.080)
    assert hidden["ddp ours 25M [torch]"]["verdict"] == "met"
    assert hidden["ddp ours 25M [shared_memory:thread]"]["reference"] == "ddp ours naive [shared_memory]"
    assert exact(hidden["ddp ours 25M [shared_memory:thread]"]["ratio"], 0.6)
    assert hidden["ddp ours 25M [shared_memory:thread]"]["verdict"] == "missed"
    assert all(c["limit"] == ddp_targets.TARGET_HIDDEN for c in hidden.values())


def test_a_communication_thread_is_compared_with_the_same_sums_inline_for_information(scripted):
    _, checks = scripted_checks(scripted)
    information = [c for c in checks if c["limit"] is None]
    assert len(information) == 1
    thread = information[0]
    assert (thread["axis"], thread["label"], thread["reference"]) == ("overlap", "ddp ours 25M [shared_memory:thread]",
                                                                      "ddp ours 25M [shared_memory]")
    assert exact(thread["ratio"], 1.10) and thread["verdict"] == "information"
    text = "\n".join(ddp_printout.targets_text(checks))
    assert "1.10x [1.10, 1.10] (information)" in text


def test_targets_text_says_met_missed_or_inconclusive(scripted):
    _, checks = scripted_checks(scripted)
    text = "\n".join(ddp_printout.targets_text(checks))
    assert "1.10x [1.10, 1.10] <= 1.00: MISSED" in text and "0.05x [0.05, 0.05] <= 0.50: MET" in text
    assert "0.90x [0.90, 0.90] <= 0.95: MET" in text and "0.60x [0.60, 0.60] <= 0.50: MISSED" in text
    assert len(text.splitlines()) == 1 + len(checks)
    assert ddp_targets.target_checks([{**r, "world_size": 1} for r in scripted[0].values()]) == []  # one rank: nothing


def test_a_run_with_more_processes_than_cores_is_marked_and_never_official(scripted):
    rows = [{**r, "world_size": os.cpu_count() + 1, "oversubscribed": True} for r in scripted[0].values()]
    ddp_targets.relate(rows)
    assert ddp_targets.target_checks(rows) and all(c["oversubscribed"] for c in ddp_targets.target_checks(rows))
    assert "(oversubscribed: information)" in "\n".join(ddp_printout.targets_text(ddp_targets.target_checks(rows)))
    assert "*ranks" in ddp_tables.row_prefix(rows[0])


# --------------------------------------------------------------------------- what each variant sends and keeps


def test_collectives_and_buffers_follow_each_variant_s_design(sweep):
    rows = rows_at(sweep[0], WORLD)
    params = cnn_parameters()
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    for t in ("torch", "shared_memory"):
        # one per parameter
        naive, overlap = rows[f"ddp ours naive [{t}]"], rows[f"ddp ours overlap [{t}]"]
        assert naive["all_reduces"] == overlap["all_reduces"] == len(params)
        assert rows[f"ddp ours flat [{t}]"]["all_reduces"] == 1  # 3.2 MiB in one piece
    # ours: everything in one bucket but the first layers' gradients, up to LAST_BUCKET_CAP_MB, in a last one
    first_bytes = np.cumsum([p.numel() * p.element_size() for p in params])
    assert 0 < first_bytes[0] <= LAST_BUCKET_CAP_MB * 2**20 < grad_bytes < 25 * 2**20
    for t in SWEEP_TRANSPORTS[:-1]:  # the same buckets whatever carries them; overlap: a bucket per parameter
        assert rows[f"ddp ours 25M [{t}]"]["all_reduces"] == 2
        assert rows[f"ddp ours overlap [{t}]"]["all_reduces"] == len(params)
    for label, row in rows.items():
        assert row["grad_bytes"] == grad_bytes
        # buffers kept between steps
        if row["engine"] and row["option"] != "naive":
            assert row["ddp_buffer_bytes"] >= grad_bytes, label
        else:
            assert row["ddp_buffer_bytes"] == 0, label
        assert row["iteration_peak_bytes"] > 0


def staging_block(nbytes: int) -> int:
    """The staging block transport.SharedMemory takes for a tensor of ``nbytes``: at least 1 MiB, 64-byte aligned."""
    return max(2**20, -(-nbytes // 64) * 64)


def test_peak_memory_adds_the_shared_memory_staging_block_the_profiler_cannot_see(sweep):
    rows = rows_at(sweep[0], WORLD)
    for label, row in rows.items():
        assert row["peak_bytes"] == (row["iteration_peak_bytes"] + row["ddp_buffer_bytes"]
                                     + row["transport_staging_bytes"])
    # Staged: what the transport did not allocate. Naive hands it each gradient (the largest sets the block);
    # PyTorch's DDP, through its hook, its buckets.
    largest = max(p.numel() * p.element_size() for p in cnn_parameters())
    assert rows["ddp ours naive [shared_memory]"]["transport_staging_bytes"] == staging_block(largest)
    best = rows["ddp pytorch best 25M [shared_memory]"]
    if best["all_reduces"] == 1:  # one bucket: it holds every gradient
        assert best["transport_staging_bytes"] == staging_block(best["ddp_buffer_bytes"])
    else:
        assert staging_block(best["ddp_buffer_bytes"] // best["all_reduces"]) <= best["transport_staging_bytes"] \
            <= staging_block(best["ddp_buffer_bytes"])
    # Ours allocate their buffers in the arena: nothing staged, whatever a row before them on the same transport
    # object left (each row's block is released before its own is measured). Gloo stages nothing of ours.
    for label, row in rows.items():
        if label not in ("ddp ours naive [shared_memory]", "ddp pytorch best 25M [shared_memory]"):
            assert row["transport_staging_bytes"] == 0, label


def test_report_prints_every_row_and_the_targets(sweep):
    doc, printed, _ = sweep
    assert f"Benchmark: cnn with batch size {BATCH} per rank, 3x32x32 inputs" in printed
    for row in doc["results"]:
        prefix = ddp_tables.row_prefix(row)
        assert f"{prefix}  p50: {row['p50_s']:8.4f}s" in printed  # the seed-004 table
        assert sum(line.startswith(prefix) for line in printed.splitlines()) >= 2  # and the communication table
    assert "Targets (set for CPU, 2 ranks, resnet18), each on one axis." in printed
    for target in ("p50 / faster pytorch p50, same transport", "peak memory / same pytorch row",
                   "p50 / the same engine on torch", "p50 / no DDP", "exposed wait / naive's all-reduce time",
                   "p50 / the same sums in the backward hook"):
        assert target in printed
    assert "[shared_memory:thread]: the same on a communication thread" in printed  # the legend


def trace_names(traces, label: str, rank: int = 0) -> list[str]:
    return [e.get("name") for e in json.loads((traces / f"cnn-{WORLD}ranks-{label.replace(' ', '-')}-rank{rank}.json")
                                              .read_text())["traceEvents"]]


def test_every_variant_writes_a_loadable_chrome_trace_per_rank_with_its_sums_on_its_transport(sweep):
    doc, _, traces = sweep
    expected = {f"cnn-{WORLD}ranks-{label.replace(' ', '-')}-rank{rank}.json"
                for label in LABELS for rank in range(WORLD)}
    expected.add("cnn-1ranks-no-ddp-rank0.json")
    assert {p.name for p in traces.iterdir()} == expected
    names = trace_names(traces, "ddp ours 25M [shared_memory]")
    for label in ("iteration 0", "iteration 2", "forward", "backward", "sync_gradients", "optimizer_step"):
        assert label in names
    # Each profiled iteration sums every bucket (or gradient) once, over the row's transport and no other:
    # gloo's ranges for [torch] (PyTorch's own or ours), ours for shared memory (PyTorch's through its hook);
    # on a "dpkit" group, the backend's own range (its sums record none of gloo's or the transport's).
    for label, row in rows_at(doc, WORLD).items():
        names = trace_names(traces, label)
        if row["transport"] == "torch:dpkit":
            assert names.count("dpkit:all_reduce") == ddp_run.PROFILE_ITERS * row["all_reduces"] > 0, label
            assert names.count("gloo:all_reduce") == names.count(SHM_ALL_REDUCE) == 0, label
            continue
        wire, other = (("gloo:all_reduce", SHM_ALL_REDUCE) if row["transport"] == "torch"
                       else (SHM_ALL_REDUCE, "gloo:all_reduce"))
        assert names.count(wire) == ddp_run.PROFILE_ITERS * row["all_reduces"] and names.count(other) == 0, label
    assert rows_at(doc, WORLD)["no ddp"]["all_reduces"] == 0


def test_the_timeline_shows_where_each_transport_sums(sweep):
    """gloo sums on its own threads, shared memory in the thread that computes (inline in the backward hook),
    shared memory with a thread on that one thread (plots.timeline_events on rank 0's last profiled iteration)."""
    doc, _, traces = sweep
    rows = rows_at(doc, WORLD)

    def lanes(label):
        trace = json.loads((traces / f"cnn-{WORLD}ranks-{label.replace(' ', '-')}-rank0.json").read_text())
        return plots.timeline_events(trace)["comm"]

    for label in ("ddp ours 25M [torch]", "ddp pytorch best 25M [torch]"):
        on = lanes(label)
        assert on and all(lane.startswith("comm thread") for lane in on), (label, on)
        assert sum(map(len, on.values())) == rows[label]["all_reduces"]
    for label in ("ddp ours 25M [shared_memory]", "ddp pytorch best 25M [shared_memory]",
                  "ddp ours naive [shared_memory]"):
        on = lanes(label)
        assert list(on) == ["sums in the compute thread"]
        assert len(on["sums in the compute thread"]) == rows[label]["all_reduces"]
    on = lanes("ddp ours 25M [shared_memory:thread]")
    assert list(on) == ["comm thread 1"]
    assert len(on["comm thread 1"]) == rows["ddp ours 25M [shared_memory:thread]"]["all_reduces"]


# --------------------------------------------------------------------------- diff


SCALE, FASTER = 1.25, 0.8  # every row of the test file 25% slower, ddp ours 25M [shared_memory] 20% faster
QUICKER = "ddp ours 25M [shared_memory]"


def changed_copy(doc: dict) -> dict:
    test = copy.deepcopy(doc)
    test["env"]["torch"] = "9.9.9"
    for row in test["results"]:
        factor = FASTER if row["label"] == QUICKER else SCALE
        row["samples_s"] = [factor * s for s in row["samples_s"]]
    test["results"] = [r for r in test["results"] if r["label"] != "ddp ours flat [torch]"]
    return test


def test_diff_gives_the_percent_change_of_each_row(sweep, tmp_path):
    doc, _, _ = sweep
    base_path, test_path = tmp_path / "base.json", tmp_path / "test.json"
    write_results(str(base_path), doc["benchmark"], doc["env"], doc["config"], doc["results"])
    test = changed_copy(doc)
    write_results(str(test_path), test["benchmark"], test["env"], test["config"], test["results"])
    diffs, unmatched = ddp_tables.diff_rows(read_results(str(base_path)), read_results(str(test_path)))
    assert len(diffs) == len(doc["results"]) - 1
    assert unmatched == [f"only in baseline: cnn (batch {BATCH}, 3x32x32), {WORLD} ranks, ddp ours flat [torch]"]
    base_rows = {(r["world_size"], r["label"]): r for r in doc["results"]}
    for d in diffs:
        factor = FASTER if d["label"] == QUICKER else SCALE
        base = base_rows[d["world_size"], d["label"]]
        for p in ddp_tables.DIFF_PERCENTILES:
            # PyTorch's diff.py: the change in time, negated (lower is better): 1.25x the time is -25%.
            assert d[f"p{p}_diff_pct"] == pytest.approx(-100 * (factor - 1))
            expected_time = factor * measure.percentile(base["samples_s"], p)
            assert d[f"p{p}_test_s"] == pytest.approx(expected_time)
            assert d[f"p{p}_test_ex_per_s"] == pytest.approx(base["global_batch"] / expected_time)


def test_diff_prints_the_settings_side_by_side_and_a_line_per_row(sweep):
    doc, _, _ = sweep
    test = changed_copy(doc)
    text = ddp_tables.format_diff(doc, test)
    torch_line = next(line for line in text.splitlines() if line.startswith("torch:"))
    assert torch.__version__ in torch_line and "9.9.9" in torch_line and "differs" in torch_line
    backend_line = next(line for line in text.splitlines() if line.startswith("backend:"))
    assert "differs" not in backend_line
    assert "incomplete" not in text
    stopped = ddp_tables.format_diff(doc, {**test, "complete": False})
    assert f"test: incomplete run: ddp_benchmark was stopped; {len(test['results'])} rows" in stopped, \
        "a stopped run's rows are compared, and said to be what it finished"
    row = rows_at(doc, WORLD)[QUICKER]
    p75 = FASTER * measure.percentile(row["samples_s"], 75)
    assert f"{ddp_tables.row_prefix(row)}  p75: {p75:8.4f}s {row['global_batch'] / p75:7.0f}/s    +20.0%" in text
    assert "only in baseline:" in text


# --------------------------------------------------------------------------- pieces, in this process


def test_rounds_rotate_the_order_and_split_the_iterations():
    variants = ddp_variants.variants_for(("ddp ours naive", "ddp ours flat", "ddp ours overlap"), [], ["torch"])
    order = [v.label for _, v in ddp_variants.schedule(variants, 2)]
    assert order == ["no ddp", "ddp ours naive [torch]", "ddp ours flat [torch]", "ddp ours overlap [torch]",
                     "ddp ours flat [torch]", "ddp ours overlap [torch]", "no ddp", "ddp ours naive [torch]"]
    assert [ddp_variants.round_iters(10, 4, r) for r in range(4)] == [3, 3, 2, 2]


def gpt_and_batch(batch: int, width: int, depth: int, heads: int, seq_len: int, vocab: int):
    """A fresh GPT (seed 0) and rank 0's batch, as the benchmark builds them from its flags."""
    args = bench.parse_args(["--models", "gpt", "--batch-size", str(batch), "--gpt-width", str(width), "--gpt-depth",
                             str(depth), "--gpt-heads", str(heads), "--gpt-seq-len", str(seq_len),
                             "--gpt-vocab", str(vocab)])
    torch.manual_seed(0)
    model = models.build_model("gpt", ddp_replicas.gpt_config(args))
    return (model, *ddp_replicas.make_batch("gpt", args, rank=0, device=torch.device("cpu")))


def test_gpt_predicts_the_next_token_with_a_tied_output_layer():
    model, inputs, targets = gpt_and_batch(batch=3, width=16, depth=2, heads=4, seq_len=8, vocab=50)
    assert inputs.shape == targets.shape == (3, 8)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one token
    assert model.head.weight is model.tokens.weight
    logits = model(inputs)
    assert logits.shape == (3, 8, 50)
    ddp_step.loss_of(logits, targets).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    # Causal: the first position's logits do not depend on later tokens.
    changed = inputs.clone()
    changed[:, 1:] = (changed[:, 1:] + 1) % 50
    torch.testing.assert_close(model(changed)[:, 0], logits[:, 0])


def test_a_fresh_gpt_predicts_every_token_about_equally_and_has_no_denormal_probabilities():
    # GPT-2's initialisation: logits near 0, so the loss starts at ~ln(vocab). PyTorch's default
    # N(0, 1) embedding tied to the output layer starts far above it, with probabilities below float32's
    # normal range, whose denormal arithmetic slows this model's benchmarks (models.GPT._init_weights).
    model, inputs, targets = gpt_and_batch(batch=4, width=128, depth=2, heads=4, seq_len=32, vocab=2048)
    logits = model(inputs)
    assert abs(ddp_step.loss_of(logits, targets).item() - math.log(2048)) < 0.1
    assert logits.softmax(-1).min() >= torch.finfo(torch.float32).tiny
    residual_std = model.blocks[0].proj.weight.std().item()
    assert 0.8 < residual_std / (0.02 / math.sqrt(2 * 2)) < 1.2  # scaled by 1/sqrt(2 * depth)


@pytest.mark.parametrize("flags", [["--iters", "2", "--rounds", "3"], ["--batch-size", "1"], ["--bucket-sizes", "0"],
                                   ["--gpt-width", "10", "--gpt-heads", "4"], ["--warmup", "-1"],
                                   ["--transports", "gloo"]])
def test_bad_flags_stop_with_a_usage_error(flags, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(flags)
    assert stop.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_variants_take_the_registry_names():
    assert bench.parse_args(["--variants", "ddp ours", "ddp pytorch best"]).variants == ["ddp ours", "ddp pytorch best"]


# "ours" is make_ddp's name, not a row's; the others are the rows' words of before the names were unified.
@pytest.mark.parametrize("name", ["ours", "bucketed", "pytorch-best", "pytorch", "naive", "flat", "overlap"])
def test_an_unknown_ddp_variant_is_a_usage_error_listing_the_known_ones(name, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--variants", name])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert (f"unknown DDP variant '{name}': choose among 'ddp pytorch', 'ddp pytorch best', 'ddp ours naive', "
            "'ddp ours flat', 'ddp ours overlap', 'ddp ours'") in err
    assert "deprecated" not in err and err.count("error:") == 1


def test_shared_memory_transports_are_refused_with_gpus(monkeypatch, capsys):
    monkeypatch.setattr(bench, "check_placement", lambda parser, args: "cuda")  # as with GPUs, without one
    for transports_ in (["shared_memory"], ["torch", "shared_memory:thread"]):
        with pytest.raises(SystemExit) as stop:
            bench.parse_args(["--transports", *transports_])
        assert stop.value.code == 2 and "take CPU tensors" in capsys.readouterr().err
    assert bench.parse_args(["--transports", "torch"]).transports == ["torch"]


def test_every_flag_shows_its_default_in_help():
    parser = bench.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert "default" in (action.help or ""), f"{name} {action.option_strings}"


def test_quick_fills_only_the_flags_not_given():
    quick = bench.parse_args(["--quick"])
    assert (quick.batch_size, quick.iters, quick.rounds, quick.warmup) == tuple(
        bench.QUICK[k] for k in ("batch_size", "iters", "rounds", "warmup"))
    assert quick.models == list(bench.CPU_MODELS)
    explicit = bench.parse_args(["--quick", "--iters", "12", "--rounds", "6", "--models", "resnet18"])
    assert (explicit.iters, explicit.rounds, explicit.models) == (12, 6, ["resnet18"])
    assert explicit.batch_size == bench.QUICK["batch_size"]
    normal = bench.parse_args([])
    assert (normal.iters, normal.rounds) == (bench.NORMAL["iters"], bench.NORMAL["rounds"])


def test_the_25m_rows_on_every_transport_say_where_an_iteration_spends_its_time(sweep):
    rows = rows_at(sweep[0], WORLD)
    profiled = [label for label, row in rows.items() if "breakdown" in row]
    assert profiled == ["ddp pytorch 25M [torch]", "ddp pytorch best 25M [torch]",
                        "ddp pytorch best 25M [shared_memory]",
                        "ddp pytorch best 25M [torch:dpkit]", "ddp ours 25M [torch]", "ddp ours 25M [shared_memory]",
                        "ddp ours 25M [shared_memory:thread]"]
    for label in profiled:
        breakdown = rows[label]["breakdown"]
        assert set(breakdown["ranges"]) == set(measure.PHASES), label
        assert breakdown["ranges"]["backward"] > 0 and breakdown["ops"], label


def test_diff_of_two_benchmarks_or_of_runs_with_nothing_in_common_says_what_differs(sweep, capsys, tmp_path):
    doc, _, _ = sweep
    other = {**copy.deepcopy(doc), "benchmark": "syncbn_benchmark"}
    with pytest.raises(ValueError, match="cannot compare a 'ddp_benchmark' results file with a 'syncbn_benchmark' one"):
        ddp_tables.format_diff(doc, other)
    bigger = copy.deepcopy(doc)
    bigger["config"]["batch_size"] = 64
    for row in bigger["results"]:
        row["batch_size"] = 64
    with pytest.raises(ValueError, match=r"measured nothing in common(.|\n)*batch_size: 2 vs 64"):
        ddp_tables.format_diff(doc, bigger)
    base, test = tmp_path / "a.json", tmp_path / "b.json"
    write_results(str(base), doc["benchmark"], doc["env"], doc["config"], doc["results"])
    write_results(str(test), other["benchmark"], other["env"], other["config"], other["results"])
    with pytest.raises(SystemExit, match="error: cannot compare"):
        bench.main(["diff", str(base), str(test)])


# --------------------------------------------------------------------------- the time budget (GPU defaults)


def test_the_budget_lowers_the_iterations_to_what_fits_never_below_one_per_round_nor_above_iters():
    # 7 variants at 0.2 s an iteration, 8 rounds of 2 warm-up iterations each: 60 s hold 42 iterations a
    # variant, of which 16 warm up.
    assert ddp_run.iters_within(60.0, 0.2, 7, 8, 2, 48) == 26
    assert ddp_run.iters_within(60.0, 0.5, 7, 8, 2, 48) == 8, "one per round at least"
    assert ddp_run.iters_within(60.0, 0.001, 7, 8, 2, 48) == 48, "never more than --iters"
    assert ddp_run.iters_within(0.0, 10.0, 7, 8, 2, 48) == 48, "0: no budget"


def test_on_a_gpu_the_defaults_take_one_bucket_size_and_a_budget_measured_on_a_no_ddp_iteration(monkeypatch):
    args = bench.parse_args([])
    assert args.bucket_sizes == [1.0, 10.0, 25.0, 100.0, 1000.0] and args.budget is None, "the CPU's defaults"
    monkeypatch.setattr(bench, "check_placement", lambda parser, args: "cuda")
    on_gpu = bench.parse_args([])
    assert on_gpu.bucket_sizes == [ddp_step.PYTORCH_DEFAULT_BUCKET_MB]
    assert [v.label for v in ddp_variants.variants_for(on_gpu.variants, on_gpu.bucket_sizes, ["torch"])] == \
        ["no ddp", "ddp pytorch 25M [torch]", "ddp pytorch best 25M [torch]", "ddp ours naive [torch]",
         "ddp ours flat [torch]", "ddp ours overlap [torch]", "ddp ours 25M [torch]"]
    variants = ddp_variants.variants_for(on_gpu.variants, on_gpu.bucket_sizes, ["torch"])
    measured = []
    monkeypatch.setattr(ddp_run, "step_seconds", lambda ctx, args, name, batch: measured.append(name) or 0.5)
    gpu, cpu = (argparse.Namespace(device=torch.device(kind)) for kind in ("cuda", "cpu"))
    # The GPT at 0.5 s an iteration: 60 s fit 17 a variant, fewer than 8 rounds of 2 warm-up and 1 timed.
    assert ddp_run.model_iters(gpu, on_gpu, "gpt", variants, None) == on_gpu.rounds == 8 and measured == ["gpt"]
    assert ddp_run.model_iters(cpu, on_gpu, "gpt", variants, None) == on_gpu.iters and measured == ["gpt"], \
        "no budget on a CPU: nothing measured first"
    assert ddp_run.model_iters(cpu, bench.parse_args(["--budget", "30"]), "cnn", variants, None) == 8


def test_a_run_within_a_budget_times_the_iterations_it_fits_and_each_row_says_how_many(monkeypatch, tmp_path):
    monkeypatch.setattr(ddp_run, "step_seconds", lambda ctx, args, name, batch: 1.0)  # every model: 1 s an iteration
    path = tmp_path / "budget.json"
    with redirect_stdout(io.StringIO()) as out:
        bench.main(["--models", "cnn", "--variants", "ddp pytorch", "--bucket-sizes", "25", "--transports", "torch",
                    "--iters", "12", "--rounds", "2", "--warmup", "0", "--budget", "1", "--batch-size", "2",
                    "--no-breakdown", "--json", str(path)])
    doc = read_results(str(path))
    assert doc["complete"] and doc["config"]["budget"] == 1.0
    assert [(r["label"], r["iters"]) for r in doc["results"]] == [("no ddp", 2), ("ddp pytorch 25M [torch]", 2)], \
        "1 s hold half an iteration of each of 2 variants: one per round"
    assert "12 timed iterations per variant at most (each row says how many" in out.getvalue()
