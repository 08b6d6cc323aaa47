"""The rules that decide the report's words: where an interval lies against a target, which way a series goes,
how verdicts are counted (per axis and kind, no one-process or oversubscribed runs), which path a shared-memory
row took, which two committed runs made the same comparison; and the suite's times, written by a command."""

import pytest

from dpkit.bench.results import read_results
from dpkit.bench.row_identity import label as row_label
from dpkit.report import findings, paths, sentences, summary
import run_experiments


def ratio(median, low, high, rounds=10):
    return {"median": median, "ci_low": low, "ci_high": high, "rounds": rounds}


# --------------------------------------------------------------------------- intervals


def test_above_or_below_a_target_only_when_the_whole_interval_says_so():
    assert findings.position(ratio(1.34, 1.05, 1.64), 1.3) == "inconclusive"  # the median above, the interval not
    assert findings.position(ratio(1.64, 1.48, 1.80), 1.3) == "above"
    assert findings.position(ratio(1.0, 0.9, 1.3), 1.3) == "below"  # at the target counts as within it
    assert findings.position(ratio(0.5, 0.5, 0.5, rounds=1), 1.0) == "inconclusive"  # one measurement: no interval
    assert findings.position(None, 1.0) == "inconclusive"


def test_a_comparison_with_pytorch_is_the_stored_paired_ratio_with_its_interval():
    assert findings.against_pytorch(ratio(1.80, 1.49, 3.30), "ring / torch") == \
        "ring / torch 1.80x [1.49, 3.30], slower than PyTorch's"
    assert findings.against_pytorch(ratio(0.7, 0.6, 0.8), "auto / torch").endswith("faster than PyTorch's")
    assert "no difference from PyTorch's resolved" in findings.against_pytorch(ratio(1.09, 0.76, 1.98), "auto / torch")
    assert findings.against_pytorch(None, "ring / torch") == "ring / torch: no paired ratio stored"


def test_a_trend_word_only_where_the_intervals_resolve_it():
    # medians 2.61, 2.05, 2.61 with overlapping intervals: no word for a direction
    assert findings.trend([(1_000, 1.49, 3.30), (10_000, 1.41, 2.35), (100_000, 1.19, 4.34)]) == "unresolved"
    assert findings.trend([(1, 1.0, 1.1), (2, 1.2, 1.3), (3, 1.5, 1.6)]) == "rises"
    assert findings.trend([(3, 1.0, 1.1), (1, 1.5, 1.6), (2, 1.2, 1.3)]) == "falls"  # sorted by x first
    assert findings.trend([(1, 1.0, 1.1), (2, 2.0, 2.1), (3, 1.0, 1.1)]) == "varies"  # up, then down
    # the last overlaps the middle: no fall
    assert findings.trend([(1, 1.0, 1.1), (2, 1.5, 1.6), (3, 1.45, 1.7)]) == "rises"
    assert findings.trend([(1, 1.0, 1.1), (2, 1.5, 1.6), (3, 1.05, 1.6)]) == "unresolved"  # the ends overlap
    assert findings.trend([(1, 1.0, 1.1)]) == "unresolved"
    assert set(findings.TREND_WORDS) == {"rises", "falls", "varies", "unresolved"}


# --------------------------------------------------------------------------- paths


def ddp_row(engine, impl, option, cap, transport, path) -> dict:
    fields = {"engine": engine, "impl": impl, "option": option, "bucket_cap_mb": cap, "transport": transport,
              "path": path}
    return {**fields, "label": row_label(fields)}


# The paths as the rows recorded them; the last one says the opposite of what its engine's code would make one
# guess (ours allocates its buckets through the transport), so only a reader of the field finds it.
DDP_DOC = {"benchmark": "ddp_benchmark", "results": [
    ddp_row("ddp", "ours", None, 25.0, "shared_memory", "zero copy"),
    ddp_row("ddp", "pytorch", "best", 25.0, "shared_memory", "staged"),
    ddp_row("ddp", "ours", "naive", None, "shared_memory", "staged"),
    ddp_row("ddp", "ours", "overlap", 0.0, "shared_memory", "staged")]}


def sharding_row(engine, impl, transport, path):
    fields = {"engine": engine, "impl": impl, "option": None, "transport": transport, "path": path}
    return {**fields, "variant": row_label(fields)}


# A sharding file as sharding_benchmark.py writes it: each row names itself by "variant" and records its path.
SHARDING_DOC = {"benchmark": "sharding_benchmark", "results": [
    sharding_row("ddp", "pytorch", "shared_memory", "staged"),  # through transport.ddp_comm_hook
    sharding_row("fsdp", "pytorch", "shared_memory", "zero copy"),  # fully_shard's buffers from the transport
    sharding_row("zero1", "ours", "shared_memory:thread", "staged")]}  # recorded: the opposite of a guess


def test_a_row_s_path_is_read_from_its_field_never_guessed_from_its_label():
    assert paths.path("ddp ours 25M [shared_memory]", DDP_DOC) == "zero copy"
    assert paths.path("ddp pytorch best 25M [shared_memory]", DDP_DOC) == "staged"
    assert paths.path("ddp ours naive [shared_memory]", DDP_DOC) == "staged"
    assert paths.path("ddp ours overlap [shared_memory]", DDP_DOC) == "staged"  # as recorded, not as guessed
    assert paths.path("ddp ours 25M [torch]", DDP_DOC) is None
    assert paths.path("ddp ours 1M [shared_memory]", DDP_DOC) is None  # no such row: nothing recorded, no guess
    assert paths.path("ddp pytorch [shared_memory]", SHARDING_DOC) == "staged"
    assert paths.path("fsdp pytorch [shared_memory]", SHARDING_DOC) == "zero copy"
    assert paths.path("zero1 ours [shared_memory:thread]", SHARDING_DOC) == "staged"
    assert paths.path("zero2 ours [shared_memory]", SHARDING_DOC) is None  # not in the file
    assert paths.path("zero1 ours [shared_memory]") is None  # no file: no guess
    staged_sums = {"benchmark": "syncbn_benchmark", "config": {"sums": "staged"}}  # the file says where it summed
    assert paths.path("workers [shared_memory]: every size", staged_sums) == "staged"
    zero_copy_sums = {"benchmark": "syncbn_benchmark", "config": {"sums": "zero copy"}}
    assert paths.path("workers [shared_memory]: every size", zero_copy_sums) == "zero copy"
    assert paths.path("shared_memory:staged") == "staged" and paths.path("shared_memory") == "zero copy"


def test_labels_name_the_path_and_a_zero_copy_row_against_a_staged_one_is_on_the_transport_axis():
    assert paths.label("ddp ours 25M [shared_memory] / ddp pytorch best 25M [shared_memory]", DDP_DOC) == \
        "ddp ours 25M [shared_memory, zero copy] / ddp pytorch best 25M [shared_memory, staged]"
    assert paths.label("ddp ours [torch] / ddp pytorch [torch]") == "ddp ours [torch] / ddp pytorch [torch]"
    ours, best = DDP_DOC["results"][:2]
    impl = {"axis": "impl", "label": ours["label"], "reference": best["label"], "row": ours, "reference_row": best}
    assert paths.axis(impl, DDP_DOC) == "transport"  # the stored paths differ
    both_staged = {**impl, "row": {**ours, "path": "staged"}}  # the fields decide, not the labels
    assert paths.axis(both_staged, DDP_DOC) == "impl"
    on_torch = {**impl, "row": {**ours, "transport": "torch", "path": None},
                "reference_row": {**best, "transport": "torch", "path": None}}
    assert paths.axis(on_torch, DDP_DOC) == "impl"
    ddp, fsdp, _ = SHARDING_DOC["results"]
    engine = {"axis": "engine", "numerator": fsdp["variant"], "denominator": ddp["variant"], "row": fsdp,
              "reference_row": ddp}
    assert paths.axis(engine, SHARDING_DOC) == "transport"  # fully_shard zero copy, DDP's hook staged
    held = {"axis": "memory", "numerator": ddp["variant"], "row": ddp}  # a count against the ideal: one side
    assert paths.axis(held, SHARDING_DOC) == "memory"


# --------------------------------------------------------------------------- counts


def check(axis, verdict, target="ours [torch] / pytorch [torch]", world=2, ratio_=None, **fields):
    return {"axis": axis, "numerator": "ours [torch]", "denominator": "pytorch [torch]", "target": target,
            "world_size": world, "limit": 1.0, "verdict": verdict,
            "ratio": ratio(0.9, 0.8, 1.1) if ratio_ is None else ratio_, **fields}


def test_counts_are_per_axis_and_kind_without_one_process_or_oversubscribed_runs():
    env = {"cpus": 2, "device": "cpu"}
    checks = [check("engine", "met"), check("engine", "inconclusive"), check("engine", "met", world=1),
              check("engine", "met", world=4),  # 4 processes on 2 cores
              check("memory", "met", target="zero1 ours [torch] state / ideal", ratio_=False, value=1.0),
              check("engine", "met", target="peak memory / same pytorch row", ratio_=ratio(0.9, 0.9, 0.9, rounds=1)),
              check("engine", "met", limit=None)]  # for information: no target, no count
    doc = {"benchmark": "sharding_benchmark", "env": env}
    rows = findings.tally([(doc, checks)])
    counts = [(r["axis"], r["kind"], r["met"], r["missed"], r["inconclusive"], r["total"], r["single"]) for r in rows]
    assert counts == [
        ("engine", "time", 1, 0, 1, 2, 0), ("engine", "memory", 1, 0, 0, 1, 1),
        ("ideal", "bytes bookkeeping", 1, 0, 0, 1, 1)]
    assert findings.tally_text(rows[0]) == "engine, time: 1 met, 0 missed, 1 inconclusive of 2"
    assert findings.tally_text(rows[1]).endswith("of 1, each on a single measurement")
    mixed = {**rows[0], "single": 1}
    assert findings.tally_text(mixed).endswith("of 2, 1 of them on a single measurement")


def test_syncbn_target_rows_count_without_their_one_process_setting():
    rows = [{"kind": "target", "name": "workers [torch]: every size, ours / x <= 1.3", "axis": "impl",
             "setting": "workers", "limit": 1.3, "verdict": "missed"},
            {"kind": "target", "name": "workers [torch]: peak_bytes of ours <= x's", "axis": "impl",
             "setting": "workers", "limit": 1.0, "verdict": "met"},
            {"kind": "target", "name": "1 process: every size", "axis": "impl", "setting": "1 process", "limit": 1.2,
             "verdict": "met"}]
    tallied = findings.tally([({"benchmark": "syncbn_benchmark", "env": {"cpus": 2}}, rows)])
    counts = [(r["axis"], r["kind"], r["missed"], r["met"], r["single"]) for r in tallied]
    assert counts == [("impl", "time", 1, 0, 0), ("impl", "memory", 0, 1, 1)]


def test_the_same_auto_torch_comparison_in_two_committed_runs_is_paired():
    collectives = {"targets": [
        {"label": "auto", "axis": "algorithm", "world_size": 2, "bytes": 4000, "limit": 1.1, "verdict": "met"},
        {"label": "auto", "axis": "algorithm", "world_size": 2, "bytes": 65536, "limit": 1.1, "verdict": "met"},
        {"label": "ring", "axis": "algorithm", "world_size": 2, "bytes": 4000, "limit": 1.1, "verdict": "met"}]}
    homework = {"config": {"dtype": "float32"}, "targets": [
        {"target": "auto / torch", "world_size": 2, "numel": 1000, "limit": 1.1, "verdict": "inconclusive"},
        {"target": "auto / torch", "world_size": 2, "numel": 10000, "limit": 1.1, "verdict": "met"}]}
    pairs = findings.repeated_allreduce(collectives, homework)
    assert [(c["bytes"], o["numel"]) for c, o in pairs] == [(4000, 1000)]  # 40,000 B is not 64 KiB
    assert findings.repeated_allreduce(collectives, {}) == []


def test_the_committed_readme_shows_both_runs_of_one_comparison_and_no_bare_shm():
    block = summary.readme_block((run_experiments.REPO / "README.md").read_text())
    results = run_experiments.REPO / "results"
    pairs = findings.repeated_allreduce(read_results(str(results / "collectives.json")),
                                        read_results(str(results / "allreduce.json")))
    assert pairs, "the committed collectives.json and allreduce.json share the 4000 B comparison"
    for ours, other in [(o, a) for o, a in pairs if not o["oversubscribed"]]:
        both = (f"{ours['bytes']}B: {ours['ratio']['median']:.2f}x", "another run of this comparison",
                f"{other['ratio']['median']:.2f}x [{other['ratio']['ci_low']:.2f}, {other['ratio']['ci_high']:.2f}]")
        assert any(all(part in line for part in both) for line in block.splitlines()), both
    assert "[shared_memory]" not in block and "[shared_memory:thread]" not in block


# --------------------------------------------------------------------------- the suite's times


def test_the_suite_times_come_from_a_file_a_command_wrote(tmp_path, monkeypatch):
    script = "print('===== 3 passed, 1 skipped in 0.10s =====')"
    monkeypatch.setattr(run_experiments, "SUITE", (("-c", script),))
    assert run_experiments.time_suite(tmp_path, 60) == 0
    suite = read_results(str(tmp_path / "suite.json"))
    (row,) = suite["results"]
    assert row["outcome"] == "3 passed, 1 skipped" and row["exit_code"] == 0 and row["seconds"] > 0
    line, = summary.suite_lines(suite)
    assert "3 passed, 1 skipped" in line and suite["env"]["device_model"] in line and "results/suite.json" in line
    assert summary.suite_lines(None) == []  # no file: no time is stated
    monkeypatch.setattr(run_experiments, "SUITE", (("-c", "import sys; sys.exit(1)"),))
    assert run_experiments.time_suite(tmp_path, 60) == 1
    assert read_results(str(tmp_path / "suite.json"))["results"][0]["outcome"] == "no pytest summary line"


@pytest.mark.parametrize("flag", ["--suite", "--summary"])
def test_run_experiments_takes_its_flags(flag):
    assert getattr(run_experiments.parse_args([flag]), flag[2:]) is True


def test_an_experiment_is_killed_after_its_guard_which_a_quick_run_keeps_at_half_an_hour():
    assert run_experiments.parse_args(["--quick"]).timeout == run_experiments.QUICK_TIMEOUT_S == 1800
    assert run_experiments.parse_args([]).timeout == run_experiments.FULL_TIMEOUT_S
    assert run_experiments.parse_args(["--quick", "--timeout", "60"]).timeout == 60


# --------------------------------------------------------------------------- the sentences made of them


def test_free_text_names_each_shared_memory_path_its_file_records():
    table = ("| ddp ours 25M [shared_memory] | 0.1 |\n| ddp pytorch best 25M [shared_memory] | 0.2 |\n"
             "| ddp ours 1M [shared_memory] | 0.3 |")
    assert paths.label(table, DDP_DOC) == ("| ddp ours 25M [shared_memory, zero copy] | 0.1 |\n"
                                           "| ddp pytorch best 25M [shared_memory, staged] | 0.2 |\n"
                                           "| ddp ours 1M [shared_memory] | 0.3 |")  # no such row: left as it is
    assert paths.label("ours [shared_memory] / (BatchNorm1d + 2 all_reduce) [shared_memory]",
                       {"benchmark": "syncbn_benchmark", "config": {"sums": "staged"}}) == \
        "ours [shared_memory, staged] / (BatchNorm1d + 2 all_reduce) [shared_memory, staged]"
    assert (paths.label("zero1 ours [shared_memory:thread] waits; fsdp pytorch [shared_memory] too", SHARDING_DOC)
            == "zero1 ours [shared_memory:thread, staged] waits; fsdp pytorch [shared_memory, zero copy] too")
    assert paths.label("ddp ours [shared_memory] alone") == "ddp ours [shared_memory] alone"  # no file
    assert paths.label("[torch] only") == "[torch] only"


def allreduce_doc(world=2, cpus=2):
    rows = [{"algorithm": "ring", "world_size": world, "numel": n, "vs_torch": m, "vs_torch_ci_low": lo,
             "vs_torch_ci_high": hi, "max_abs_error": 1e-7} for n, m, lo, hi in
            ((1000, 2.61, 1.49, 3.30), (10000, 2.05, 1.41, 2.35), (100000, 2.61, 1.19, 4.34))]
    return {"env": {"device_model": "AMD EPYC", "cpus": cpus, "device": "cpu"}, "results": rows}


def test_the_allreduce_commentary_gives_paired_ratios_and_no_trend_its_intervals_do_not_resolve():
    text = sentences.allreduce_commentary(allreduce_doc())
    assert "at 2 processes ring / torch (paired by round, 95 % interval) shows no trend from end to end" in text
    assert "2.61 [1.49, 3.30] at 1,000, 2.05 [1.41, 2.35] at 10,000 and 2.61 [1.19, 4.34] at 100,000" in text
    assert "rises" not in text
    assert "At 2 processes every algorithm stays within 1.0e-07 of the exact mean" in text
    assert "at 2 processes" not in sentences.allreduce_commentary(allreduce_doc(world=4))  # oversubscribed on 2 cores
    both = allreduce_doc()
    both["results"] += [{**r, "world_size": 4, "max_abs_error": 5e-7} for r in allreduce_doc(world=4)["results"]]
    assert "within 1.0e-07" in sentences.allreduce_commentary(both)  # the oversubscribed rows' errors: not used


def test_sharding_counts_say_per_axis_and_kind_what_was_left_out():
    env = {"cpus": 2, "device": "cpu"}
    checks = [{"target": "ddp ours [shared_memory] / ddp pytorch "
                         "[shared_memory]", "axis": "impl", "numerator": "ddp ours [shared_memory]",
               "denominator": "ddp pytorch [shared_memory]", "world_size": world, "limit": 1.0, "verdict": "met",
               "row": sharding_row("ddp", "ours", "shared_memory", "zero copy"),
               "reference_row": sharding_row("ddp", "pytorch", "shared_memory", "staged"),
               "ratio": ratio(0.9, 0.8, 0.95)} for world in (1, 2, 4)]
    text = sentences.sharding_counts({"benchmark": "sharding_benchmark", "env": env, "results": checks}, "sharding")
    assert text.startswith("Targets of `sharding.json`, per axis and kind (2 targets of runs at 1 and 4 processes left "
                           "out")
    # zero copy / staged: counted on the transport axis, saying it was stored as an engine check
    assert text.endswith("* transport, time: 1 met, 0 missed, 0 inconclusive of 1 (1 of them stored as impl checks, "
                         "counted here: each compares a zero-copy row with a staged one)")


def test_collective_targets_show_the_other_runs_verdict_of_the_same_comparison():
    doc = {"env": {"cpus": 2, "device": "cpu"}, "targets": [
        {"label": "auto", "axis": "algorithm", "world_size": 2, "bytes": 4000, "limit": 1.1, "verdict": "met",
         "ratio": ratio(0.69, 0.55, 0.80), "text": "target auto <= 1.10x torch, 2 processes, 4000B: 0.69x met"},
        {"label": "auto", "axis": "algorithm", "world_size": 4, "bytes": 4000, "limit": 1.1, "verdict": "met",
         "ratio": ratio(0.3, 0.2, 0.4), "text": "target auto at 4", "oversubscribed": True}]}
    homework = {"config": {"dtype": "float32"}, "targets": [
        {"target": "auto / torch", "world_size": 2, "numel": 1000, "limit": 1.1, "verdict": "inconclusive",
         "ratio": ratio(1.09, 0.76, 1.98, rounds=20)}]}
    lines = sentences.collective_targets(doc, homework)
    assert "per axis and kind: algorithm, time: 1 met, 0 missed, 0 inconclusive of 1:" in lines[1]
    assert ("* target auto <= 1.10x torch, 2 processes, 4000B: 0.69x met (`allreduce.py`, another run of this "
            "comparison, 20 rounds: 1.09x [0.76, 1.98] inconclusive)") in lines
    assert lines[-1] == "* target auto at 4"  # oversubscribed: shown apart, not counted
