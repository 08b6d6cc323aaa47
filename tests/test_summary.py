"""README.md's headline block is rendered from the committed results: a claim cannot drift from its data.

The DDP and training sentences are also checked on small synthetic documents, written by hand: each
line must say what its check says (ratio, interval, verdict), on the axis it belongs to.
"""

import json
import shutil

import pytest

from common import REPO
from dpkit.bench import ddp_step
from dpkit.bench.row_identity import label as row_label
from dpkit.report import findings, summary
import run_experiments


def test_the_readme_block_is_exactly_what_the_committed_results_render():
    rendered = summary.render(REPO / "results", run_experiments.producers())
    assert summary.readme_block((REPO / "README.md").read_text()) == rendered, (
        "README.md's headline block differs from the committed results: run `python run_experiments.py --summary`")


def test_a_missing_results_file_is_named_with_the_command_that_writes_it(tmp_path):
    for path in (REPO / "results").glob("*.json"):
        if path.name != "ddp_benchmark.json":
            shutil.copy(path, tmp_path / path.name)
    with pytest.raises(summary.MissingResults, match=r"ddp_benchmark.json is missing(.|\n)*"
                                                     r"python run_experiments.py --quick --only ddp_benchmark"):
        summary.render(tmp_path, run_experiments.producers())


def test_a_stopped_runs_file_is_refused_naming_the_command_that_writes_a_whole_one(tmp_path):
    for path in (REPO / "results").glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    doc = json.loads((tmp_path / "ddp_benchmark.json").read_text())
    (tmp_path / "ddp_benchmark.json").write_text(json.dumps({**doc, "complete": False}))
    with pytest.raises(summary.MissingResults, match=r"ddp_benchmark.json: incomplete run: ddp_benchmark was stopped"
                                                     r"(.|\n)*python run_experiments.py --quick --only ddp_benchmark"):
        summary.render(tmp_path, run_experiments.producers())
    (tmp_path / "ddp_benchmark.json").write_text(json.dumps({**doc, "complete": True}))
    summary.render(tmp_path, run_experiments.producers())  # the same file, whole: accepted


def test_ddp_results_without_stored_target_checks_name_the_command_that_writes_them(tmp_path):
    for path in (REPO / "results").glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    for targets in (None, []):  # written before the checks were stored, or a run that evaluated none
        doc = json.loads((tmp_path / "ddp_headline.json").read_text())
        doc.pop("targets", None)
        if targets is not None:
            doc["targets"] = targets
        (tmp_path / "ddp_headline.json").write_text(json.dumps(doc))
        with pytest.raises(summary.MissingResults, match="no target checks(.|\n)*python run_experiments.py --quick "
                                                         "--only ddp_benchmark ddp_headline"):
            summary.render(tmp_path, run_experiments.producers())


def test_update_rewrites_only_the_block_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{summary.BEGIN}\nold claim: 9.99x\n{summary.END}\noutro\n")
    block = f"{summary.BEGIN}\nnew claim\n{summary.END}"
    assert summary.update_readme(readme, block)
    assert readme.read_text() == f"intro\n{block}\noutro\n"
    assert not summary.update_readme(readme, block), "nothing to change the second time"
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="no such generated block"):
        summary.update_readme(readme, block)


# --------------------------------------------------------------------------- the DDP section, synthetic


def ratio(median, low, high, rounds=15):
    return {"median": median, "ci_low": low, "ci_high": high, "rounds": rounds}


def side(kind, cap, transport, path=None) -> dict:
    """A row's identity: the fields of ``kind`` (a --variants name; "no ddp": the model alone)."""
    engine, impl, option = ddp_step.DDP_FIELDS.get(kind, (None, None, None))
    return {"engine": engine, "impl": impl, "option": option, "bucket_cap_mb": cap, "transport": transport,
            "path": path}


def check(axis, target, row, reference, value, limit, verdict, model="resnet18", world=2, oversubscribed=False):
    return {"model": model, "batch_size": 16, "input": "3x32x32", "world_size": world, "target": target, "axis": axis,
            "label": row_label(row), "reference": row_label(reference), "row": row, "reference_row": reference,
            "ratio": value, "limit": limit, "verdict": verdict, "oversubscribed": oversubscribed, "note": ""}


# The rows' identities, with the paths a run recorded: on shared memory ours zero copy, PyTorch's through its hook
# and naive's per-parameter gradients staged.
NO_DDP = side("no ddp", None, None)
OURS, BEST, PYTORCH = side("ddp ours", 25.0, "torch"), side("ddp pytorch best", 25.0, "torch"), \
    side("ddp pytorch", 25.0, "torch")
OURS_SHM, BEST_SHM = side("ddp ours", 25.0, "shared_memory", "zero copy"), \
    side("ddp pytorch best", 25.0, "shared_memory", "staged")
OURS_THREAD = side("ddp ours", 25.0, "shared_memory:thread", "zero copy")
NAIVE, NAIVE_SHM = side("ddp ours naive", None, "torch"), side("ddp ours naive", None, "shared_memory", "staged")
TIME, MEMORY = "p50 / faster pytorch p50, same transport", "peak memory / same pytorch row"
HIDDEN, THREAD = "exposed wait / naive's all-reduce time", "p50 / the same sums in the backward hook"
CHECKS = [
    check("impl", TIME, OURS, BEST, ratio(1.10, 1.05, 1.15), 1.0, "missed"),
    check("impl", MEMORY, OURS, BEST, ratio(0.9, 0.9, 0.9, rounds=1), 1.0, "met"),
    check("impl", TIME, OURS_SHM, BEST_SHM, ratio(0.96, 0.90, 1.02), 1.0, "inconclusive"),
    check("impl", MEMORY, OURS_SHM, BEST_SHM, ratio(1.2, 1.2, 1.2, rounds=1), 1.0, "missed"),
    check("transport", "p50 / the same engine on torch", BEST_SHM, BEST, ratio(0.80, 0.75, 0.85), 0.95, "met"),
    check("overhead", "p50 / no DDP", OURS_SHM, NO_DDP, ratio(1.30, 1.20, 1.40), 1.15, "missed"),
    check("overlap", HIDDEN, OURS, NAIVE, ratio(0.10, 0.05, 0.15), 0.5, "met"),
    check("overlap", HIDDEN, OURS_THREAD, NAIVE_SHM, ratio(0.40, 0.30, 0.60), 0.5, "inconclusive"),
    # information: a thread against the same sums inline, slower, faster, and an interval that holds 1 (its low end)
    check("overlap", THREAD, OURS_THREAD, OURS_SHM, ratio(1.20, 1.10, 1.30), None, "information"),
    check("overlap", THREAD, side("ddp ours overlap", 0.0, "shared_memory:thread", "zero copy"),
          side("ddp ours overlap", 0.0, "shared_memory", "zero copy"), ratio(0.80, 0.70, 0.90), None, "information"),
    check("overlap", THREAD, side("ddp ours", 1.0, "shared_memory:thread", "zero copy"),
          side("ddp ours", 1.0, "shared_memory", "zero copy"), ratio(1.05, 1.00, 1.10), None, "information"),
    # not the headline's setting: another model, and an oversubscribed run
    check("impl", TIME, side("ddp ours", 25.0, "cnn-only"), PYTORCH, ratio(0.5, 0.4, 0.6), 1.0, "met", model="cnn"),
    check("impl", TIME, side("ddp ours", 25.0, "oversubscribed"), PYTORCH, ratio(0.5, 0.4, 0.6), 1.0, "met",
          oversubscribed=True),
]


# (identity, peak bytes, staging bytes): the staged rows hold a staging block, the zero-copy ones none.
ROWS = [(NO_DDP, 5000, 0), (BEST, 6000, 0), (BEST_SHM, 6000, 1000), (OURS, 5000, 0), (OURS_SHM, 5000, 0),
        (OURS_THREAD, 5000, 0), (NAIVE, 5000, 0), (NAIVE_SHM, 5500, 500)]


def headline_doc(checks=CHECKS):
    rows = [{"model": "resnet18", "world_size": 2, **fields, "label": row_label(fields), "batch_size": 16,
             "peak_bytes": peak, "transport_staging_bytes": staging} for fields, peak, staging in ROWS]
    return {"config": {"rounds": 15}, "results": rows, "targets": checks}


def lines_of(lines, start):
    return [line for line in lines if line.startswith(start)]


def test_ddp_lines_state_each_stored_check_on_its_axis_and_each_shared_memory_row_its_path():
    lines = summary.ddp_lines(headline_doc(), {})
    assert lines[0].startswith("- **DDP** (`ddp_benchmark.py`, resnet18, batch 16 per rank, 2 processes, 15 rounds;")
    assert lines_of(lines, "  - impl (ours / PyTorch's), one engine and path: ") == [
        "  - impl (ours / PyTorch's), one engine and path: ddp ours 25M [torch] / ddp pytorch best 25M [torch]: "
        "1.10x [1.05, 1.15] "
        "(target <= 1.00x): **missed**; peak memory 0.9000x (one measurement) (target <= 1.00x: **met**)"]
    # our DDP's buckets are the transport's (zero copy), PyTorch's DDP is copied in through the hook (staged):
    # a comparison of the two paths, on the transport axis, its memory ratio holding the staging block
    assert lines_of(lines, "  - transport and implementation (zero copy / staged): ") == [
        "  - transport and implementation (zero copy / staged): ddp ours 25M [shared_memory, zero copy] / "
        "ddp pytorch best 25M [shared_memory, staged]: 0.96x [0.90, 1.02] (target <= 1.00x): **inconclusive**; "
        "peak memory 1.2000x (one measurement) (target <= 1.00x: **missed**), the reference's peak holding "
        "the staged path's copy (1,000 B: the whole difference)"]
    assert lines_of(lines, "  - transport, one engine: ") == [
        "  - transport, one engine: ddp pytorch best 25M [shared_memory, staged] / ddp pytorch best 25M [torch]: "
        "0.80x [0.75, 0.85] "
        "(target <= 0.95x): **met**"]
    assert lines_of(lines, "  - overhead, ") == [
        "  - overhead, against no DDP at all: ddp ours 25M [shared_memory, zero copy] / no ddp: 1.30x [1.20, 1.40] "
        "(target <= 1.15x): **missed**"]
    # the thread transport's sides took different paths: the verdict counts it on the transport axis, and says so
    assert lines_of(lines, "  - overlap, asynchronous transports: ") == [
        "  - overlap, asynchronous transports: exposed wait / naive's all-reduce time: ddp ours 25M [torch] / "
        "ddp ours naive [torch] 0.10x [0.05, 0.15] (target <= 0.50x: **met**); "
        "ddp ours 25M [shared_memory:thread, zero copy] / "
        "ddp ours naive [shared_memory, staged] 0.40x [0.30, 0.60] (target <= 0.50x: **inconclusive**; "
        "zero copy against staged: counted on the transport axis)"]
    text = "\n".join(lines)
    assert "cnn-only" not in text and "[oversubscribed]" not in text  # only resnet18, 2 ranks, not oversubscribed
    assert "[shared_memory]" not in text and "[shared_memory:thread]" not in text, \
        "every shared-memory row names its path"
    assert len(lines) == 1 + 1 + 1 + 1 + 1 + 3 + 1  # header, one per comparison, 3 thread lines, the exposed waits


def test_a_registered_engines_comparison_with_pytorch_is_stated_as_information_beside_ours():
    toy = {**side("ddp ours", 25.0, "torch"), "engine": "toy"}  # a registered engine's row: "toy ours"
    doc = headline_doc([*CHECKS, check("impl", TIME, toy, BEST, ratio(0.95, 0.90, 1.00), None, "information")])
    doc["results"].append({**doc["results"][0], **toy, "label": row_label(toy)})
    assert lines_of(summary.ddp_lines(doc, {}), "  - impl (ours / PyTorch's), one engine and path: toy") == [
        "  - impl (ours / PyTorch's), one engine and path: toy ours 25M [torch] / ddp pytorch best 25M [torch]: "
        "0.95x [0.90, 1.00] (information: no target)"]


def test_a_headline_file_without_the_headline_model_says_so_in_one_line():
    doc = headline_doc()
    doc["results"] = [{**r, "model": "cnn"} for r in doc["results"]]
    assert summary.ddp_lines(doc, {}) == [
        "- **DDP** (`ddp_benchmark.py`): *not in this results file: resnet18 at 2 processes, the headline*"]


def test_ddp_lines_say_slower_faster_or_neither_as_the_information_interval_says():
    lines = lines_of(summary.ddp_lines(headline_doc(), {}), "  - overlap: ")
    assert len(lines) == 3
    slower, faster, neither = lines
    assert slower.startswith("  - overlap: ddp ours 25M [shared_memory:thread, zero copy] / ddp ours 25M "
                             "[shared_memory, zero copy]: "
                             "1.20x [1.10, 1.30], slower:")
    assert faster.startswith("  - overlap: ddp ours overlap [shared_memory:thread, zero copy] / "
                             "ddp ours overlap [shared_memory, zero copy]: "
                             "0.80x [0.70, 0.90], faster:")
    # [1.00, 1.10] holds 1: neither, however the median leans
    assert neither.startswith("  - overlap: ddp ours 1M [shared_memory:thread, zero copy] / ddp ours 1M "
                              "[shared_memory, zero copy]: "
                              "1.05x [1.00, 1.10], neither faster nor slower")
    # the same checks, the data reversed: the sentences follow
    flipped = [{**c, "ratio": ratio(1 / c["ratio"]["median"], 1 / c["ratio"]["ci_high"], 1 / c["ratio"]["ci_low"])}
               if c["limit"] is None and c["axis"] == "overlap" else c for c in CHECKS]
    slower, faster, neither = lines_of(summary.ddp_lines(headline_doc(flipped), {}), "  - overlap: ")
    assert ", faster:" in slower and ", slower:" in faster and ", neither faster nor slower" in neither


def test_ddp_lines_without_stored_checks_name_the_command():
    for doc in ({**headline_doc(), "targets": []}, {k: v for k, v in headline_doc().items() if k != "targets"}):
        with pytest.raises(summary.MissingResults,
                           match="run_experiments.py --quick --only ddp_benchmark ddp_headline"):
            summary.ddp_lines(doc, {})


# --------------------------------------------------------------------------- the training sentence, synthetic


def training_doc(transport, val_acc, step_s):
    config = {"model_used": "cnn", "dataset_used": "synthetic", "train_size_used": 8192, "transport_used": transport}
    final = {"kind": "final", "epochs": 3, "val_acc": val_acc, "step_time_median_s": step_s}
    return {"config": config, "env": {"world_size": 2}, "results": [{"kind": "epoch"}, final]}


def test_training_line_says_whether_both_runs_used_the_same_transport():
    same = summary.training_lines(training_doc("shared_memory", 0.253, 0.30),
                                  training_doc("shared_memory", 0.251, 0.25))
    assert len(same) == 1
    assert "both on shared memory, ours zero copy" in same[0] and "PyTorch's DDP staged" in same[0]
    assert "compare engine and path together" in same[0] and "different" not in same[0]
    gloo = summary.training_lines(training_doc("torch", 0.25, 0.2), training_doc("torch", 0.25, 0.2))[0]
    assert "both on the same transport (torch)" in gloo
    assert "validation accuracy 25.3 % with our DDP" in same[0] and "25.1 % with PyTorch's DDP" in same[0]
    assert "median time per optimizer step 1.20x PyTorch's" in same[0]
    different = summary.training_lines(training_doc("shared_memory", 0.25, 0.2), training_doc("torch", 0.25, 0.4))[0]
    assert "on different transports (ours shared_memory, PyTorch's torch)" in different and "same" not in different
    assert "0.50x PyTorch's" in different


def test_two_training_runs_of_different_settings_are_named_not_compared():
    ours, theirs = training_doc("torch", 0.25, 0.2), training_doc("torch", 0.30, 0.4)
    theirs["config"] |= {"train_size_used": 64, "num_epochs": 1}
    assert summary.training_lines(ours, theirs) == [
        "- **Training** (`ddp_cifar100.py`): the two runs are not the same experiment (train_size 8192 / 64; "
        "num_epochs None / 1, ours / PyTorch's): not compared."]


def test_a_training_run_too_short_to_time_a_step_says_so_and_names_its_engine():
    ours = training_doc("torch", 0.25, None)
    ours["config"]["engine_used"] = "toy"
    line = summary.training_lines(ours, training_doc("torch", 0.25, 0.2))[0]
    assert "with our engine toy and SyncBatchNorm" in line
    assert line.endswith("; no median time per optimizer step (a run too short to time one).")


# --------------------------------------------------------------------------- the collectives lines, synthetic


def collective_check(collective, axis, label, world, verdict, oversubscribed=False):
    text = f"target {label} <= 1.10x torch, {world} processes, 10MiB: 0.90x [0.80, 1.00] {verdict}"
    return {"collective": collective, "axis": axis, "label": label, "world_size": world, "verdict": verdict,
            "oversubscribed": oversubscribed, "text": text}


def test_collectives_lines_state_each_stored_check_by_collective_and_axis_and_leave_out_oversubscribed_runs():
    allreduce = {"targets": [collective_check("allreduce", "algorithm", "ring", 2, "met"),
                             collective_check("allreduce", "algorithm", "auto", 2, "missed"),
                             collective_check("allreduce", "algorithm", "auto", 4, "met", oversubscribed=True),
                             collective_check("allreduce", "transport", "shared_memory", 2, "met")]}
    scatter = {"targets": [collective_check("reduce_scatter", "transport", "p2p", 2, "met")]}
    gather = {"targets": [collective_check("all_gather", "transport", "p2p", 2, "inconclusive")]}
    lines = summary.collectives_lines(allreduce, scatter, gather)
    algorithms = lines.index(next(line for line in lines if line.startswith("- **All-reduce, algorithms")))
    assert "2 processes; 1 met, 1 missed" in lines[algorithms]
    assert lines[algorithms + 1:algorithms + 3] == [
        "  - ring <= 1.10x torch, 2 processes, 10MiB: 0.90x [0.80, 1.00] met",
        "  - auto <= 1.10x torch, 2 processes, 10MiB: 0.90x [0.80, 1.00] missed"]
    assert not any("4 processes" in line for line in lines), "an oversubscribed run carries no headline"
    assert any(line.startswith("- **All-reduce, transports") and "1 met" in line for line in lines)
    assert any(line.startswith("- **Reduce-scatter, transports") and "1 met" in line for line in lines)
    assert any(line.startswith("- **All-gather, transports") and "1 inconclusive" in line for line in lines)


def test_collectives_results_without_stored_checks_name_the_command():
    with pytest.raises(summary.MissingResults, match="run_experiments.py --quick --only reduce_scatter"):
        summary.collectives_lines({"targets": [collective_check("allreduce", "algorithm", "ring", 2, "met")]},
                                  {"results": []}, {"targets": []})


# --------------------------------------------------------------------------- SyncBatchNorm, oversubscription, footer


def syncbn_ratio(dtype, peak, saved, target, batch=32, hidden=128):
    return {"kind": "ratio", "impl": "ours", "versus": "BatchNorm1d "
                                                       "(local)", "setting": "workers", "transport": "shared_memory",
            "dtype": dtype, "batch": batch, "hidden": hidden, "peak_ratio": peak, "saved_ratio": saved,
            "target": target}


def test_syncbn_lines_name_the_targets_dtype_and_give_the_other_dtypes_memory_without_a_target():
    time = {"kind": "time", "impl": "ours", "workers": 2, "batch": 32, "hidden": 128}
    doc = {"benchmark": "syncbn_benchmark", "config": {"rounds": 12, "sums": "staged"}, "results": [
        time, {**time, "hidden": 256},
        syncbn_ratio("float32", 0.72, 0.90, 1.3), syncbn_ratio("float32", 0.72, 0.90, 1.3, hidden=256),
        syncbn_ratio("bfloat16", 2.10, 0.85, None), syncbn_ratio("float16", 2.06, 0.90, None, hidden=256),
        {"kind": "target", "name": "workers [shared_memory]: peak_bytes of ours <= BatchNorm1d's at every "
                                   "size", "verdict": "met", "setting": "workers", "transport": "shared_memory",
         "dtype": "float32", "sizes": 2, "sizes_met": 2}]}  # a memory target: no "versus" (a time target's reference)
    header, target, memory = summary.syncbn_lines(doc)
    assert header.endswith("2 sizes, 12 rounds; times of forward + backward; time targets checked in no dtype, "
                           "memory targets in float32; [shared_memory, staged]: this host's shared memory, each sum's "
                           "small tensor copied in and out):")
    assert target == ("  - workers [shared_memory, staged]: peak_bytes of ours <= BatchNorm1d's at every size: "
                      "2 of 2 sizes met, **met**")
    assert memory == ("  - workers [shared_memory, staged], float16/bfloat16: peak_bytes of ours / BatchNorm1d "
                      "(local) 2.06x to "
                      "2.10x, saved_bytes 0.85x to 0.90x, over 2 sizes (no target)")
    zero_copy = {**doc, "config": {"rounds": 12, "sums": "zero copy"}}  # a file that says it summed in place
    header, target, _ = summary.syncbn_lines(zero_copy)
    assert header.endswith("[shared_memory, zero copy]: this host's shared memory, each sum in the transport's own "
                           "buffer, summed where it lies):")
    assert target.startswith("  - workers [shared_memory, zero copy]: peak_bytes")


def test_a_dtype_a_memory_target_judges_gets_no_information_line_of_its_memory():
    time = {"kind": "time", "impl": "ours", "workers": 2, "batch": 32, "hidden": 128}
    judged = {"kind": "target", "name": "workers [shared_memory], float16: peak_bytes of ours <= BatchNorm1d's at "
                                        "every size", "verdict": "met", "setting": "workers",
              "transport": "shared_memory", "dtype": "float16", "sizes": 1, "sizes_met": 1}
    doc = {"benchmark": "syncbn_benchmark", "config": {"rounds": 12, "sums": "staged"},
           "results": [time, syncbn_ratio("float16", 0.6, 0.9, None), syncbn_ratio("bfloat16", 0.7, 0.8, None),
                       judged]}
    header, _, memory = summary.syncbn_lines(doc)
    assert "memory targets in float16;" in header
    assert memory.startswith("  - workers [shared_memory, staged], bfloat16: ") and memory.endswith("(no target)")


def test_the_overlap_line_states_what_was_measured_not_a_cause():
    slower = lines_of(summary.ddp_lines(headline_doc(), {}), "  - overlap: ")[0]
    assert "costs more than it hides (one traced iteration is in the report's overlap timeline)" in slower
    assert "cores that compute" not in slower


def test_a_check_of_more_processes_than_cores_is_left_out_whatever_its_flag_says():
    env = {"cpus": 2, "device": "cpu"}
    stale = collective_check("allreduce", "algorithm", "ring", 4, "met")  # flag False, 4 processes on 2 cores
    lines = summary.collectives_lines({"env": env,
                                       "targets": [collective_check("allreduce", "algorithm", "ring", 2, "met"),
                                                               stale]},
                                      {"env": env,
                                       "targets": [collective_check("reduce_scatter", "transport", "p2p", 2, "met")]},
                                      {"env": env,
                                       "targets": [collective_check("all_gather", "transport", "p2p", 2, "met")]})
    assert not any("4 processes" in line for line in lines)
    docs = [{"env": env, "results": [{"world_size": 2}, {"world_size": 8, "oversubscribed": False}],
             "targets": [{"world_size": 4}]}]
    assert summary.oversubscribed_lines(*docs) == [
        "- Runs with 4 and 8 processes on this machine's 2 cores are oversubscribed: the report shows them, labelled, "
        "and no headline rests on them."]
    assert summary.oversubscribed_lines({"env": env, "results": [{"world_size": 2}]}) == []


def test_the_footer_calls_the_brackets_a_range_when_a_file_has_fewer_than_five_rounds(tmp_path):
    many = {"config": {"rounds": 12}, "targets": [{"ratio": {"rounds": 40}}]}
    assert (summary.interval_note({"syncbn": many})
            == "median over rounds [95 % bootstrap interval] (at least 12 rounds)")
    note = summary.interval_note({"syncbn": many, "sharding": {"config": {"rounds": 2}},
                                  "ddp_sweep": {"config": {"rounds": 1}}})
    # ddp_sweep states no ratio
    assert note.startswith("median over rounds [95 % bootstrap interval] (at least 2 rounds)")
    assert note.endswith("with fewer than 5 rounds the brackets are the range of the rounds")
    manifest = {"results": [{"experiment": "syncbn"}]}
    for name in ("syncbn", "manifest", "syncbn_large"):
        (tmp_path / f"{name}.json").write_text("{}")
    assert summary.report_scope(tmp_path, manifest) == (
        "report.ipynb shows every experiment of `results/manifest.json` "
        "(not `syncbn_large.json`, which no experiment of it writes).")
    (tmp_path / "syncbn_large.json").unlink()
    assert summary.report_scope(tmp_path, manifest).endswith("`results/manifest.json`.")


def test_the_run_time_is_a_sum_over_the_experiments_and_names_their_commits_and_not_the_notebook():
    manifest = {"config": {"quick": True}, "env": {"device_model": "cpu", "cpus": 2},
                "results": [{"seconds": 600.0, "git_commit": "abc1234"}, {"seconds": 600.0, "git_commit": "def5678"}]}
    line, = summary.run_time_lines(manifest)
    assert line.startswith("The experiments of `python run_experiments.py --quick` behind these results took 20 min "
                           "in sum on cpu (2 experiments, run in parts at abc1234 and def5678), 2 cores")
    assert "executing report.ipynb is not counted" in line


def test_a_manifest_merged_from_runs_on_two_machines_sums_the_time_of_each_machine_apart():
    manifest = {"config": {"quick": True}, "env": {"device_model": "AMD EPYC", "cpus": 2},
                "results": [{"seconds": 600.0, "device_model": "Intel Xeon", "git_commit": "a"},
                            {"seconds": 120.0, "git_commit": "b"},
                            {"seconds": 60.0, "device_model": "AMD EPYC", "git_commit": "b"}]}
    line, = summary.run_time_lines(manifest)
    assert line.startswith("The experiments of `python run_experiments.py --quick` behind these results took 10 min "
                           "in sum on Intel Xeon (1 experiment, run in parts at a); 3 min in sum on AMD EPYC "
                           "(2 experiments, run in parts at b), 2 cores")


CPU_ENV = {"device": "cpu", "device_model": "AMD EPYC", "cpus": 2, "backend": "gloo"}
GPU_ENV = {"device": "cuda", "device_model": "NVIDIA A100", "cpus": 16, "backend": "nccl", "gpus": 8,
           "gpu_memory_bytes": 80 * 2 ** 30, "cuda": "13.0", "nccl": "2.27.3"}


def test_the_hardware_line_names_the_cpu_or_the_gpu_with_its_memory_cuda_and_nccl():
    assert summary.hardware(CPU_ENV) == "AMD EPYC (2 cores, no GPU), gloo"
    assert summary.hardware(GPU_ENV) == "NVIDIA A100 (GPU, 80 GiB, 8 visible, CUDA 13.0, NCCL 2.27.3), nccl"
    assert summary.hardware({**CPU_ENV, "backend": "-"}) == "AMD EPYC (2 cores, no GPU)"  # the suite's: none


def test_the_block_refuses_results_measured_on_different_device_types():
    summary.check_one_device({"syncbn": {"env": CPU_ENV}, "ddp_headline": {"env": CPU_ENV}, "manifest": {}})
    with pytest.raises(ValueError, match=r"results/ mixes devices \(ddp_headline: cuda, syncbn: cpu\)"):
        summary.check_one_device({"syncbn": {"env": CPU_ENV}, "ddp_headline": {"env": GPU_ENV}})


def test_the_machine_is_named_from_each_files_environment_and_two_cpus_are_not_named_as_one():
    epyc = {"device_model": "AMD EPYC", "cpus": 2, "backend": "gloo"}
    xeon = {**epyc, "device_model": "Intel Xeon"}
    docs = {"a": {"env": epyc}, "b": {"env": epyc}, "manifest": {}}
    assert summary.machines(docs) == "AMD EPYC (2 cores, no GPU), gloo"
    assert summary.machines({"a": {"env": epyc}, "b": {"env": xeon}}) == \
        "AMD EPYC (2 cores, no GPU), gloo (`a.json`); Intel Xeon (2 cores, no GPU), gloo (`b.json`)"


def test_the_other_runs_verdicts_are_stated_and_each_missed_check_named():
    """allreduce.py's run, the bucket-size sweep and the world-size sweep check the same comparisons again: their
    verdicts are not in the counts, so the block states them, counted the same way, and names every missed check."""
    env = {"cpus": 2, "device": "cpu"}
    ratio = {"median": 1.2, "ci_low": 1.1, "ci_high": 1.3, "rounds": 6}
    check = {"world_size": 2, "label": "ddp ours 25M [torch]", "reference": "ddp pytorch 25M [torch]", "limit": 1.0,
             "ratio": ratio, "target": "p50 / faster pytorch p50, same transport"}
    docs = [{"env": env, "targets": [{**check, "verdict": "met", "model": None}]},
            {"env": env, "targets": [{**check, "verdict": "missed", "model": "cnn"},
                                     {**check, "verdict": "missed", "world_size": 4, "model": "cnn"}]},  # 4 on 2 cores
            {"env": env, "targets": [{**check, "verdict": "met", "ratio": {**ratio, "ci_high": 0.9, "rounds": 2}}]}]
    (line,) = summary.other_runs_lines(*docs)
    assert "`allreduce.json` 1 met, 0 missed, 0 inconclusive; `ddp_benchmark.json` 0 met, 1 missed, 0 inconclusive; " \
           "`ddp_sweep.json` 1 met, 0 missed, 0 inconclusive (timed checks on the range of 2 rounds, not a 95 % " \
           "interval)" in line
    assert line.endswith("missed: cnn ddp ours 25M [torch] / ddp pytorch 25M [torch] 1.20x [1.10, 1.30] "
                         "(`ddp_benchmark.json`).")


def test_files_measured_at_two_commits_are_named_with_their_commit():
    docs = {"a": {"env": {"git_commit": "f45658c"}}, "b": {"env": {"git_commit": "f45658c"}},
            "c": {"env": {"git_commit": "b2c3b4f"}}, "manifest": {}}
    assert summary.commits(docs) == "f45658c (`a.json`, `b.json`); b2c3b4f (`c.json`)"
    assert summary.commits({"a": docs["a"], "b": docs["b"]}) == "f45658c"


def test_every_other_committed_files_verdicts_are_stated():
    """No committed verdict goes unstated: each file the block's counts leave out is listed with its own counts,
    a verdict without a numeric limit (PyTorch's test base) included."""
    line, = summary.other_files_lines(REPO / "results")
    stated = {*summary.RATIO_FILES, *summary.OTHER_RUN_FILES, "manifest", "suite"}
    for path in sorted((REPO / "results").rglob("*.json")):
        name = path.relative_to(REPO / "results").with_suffix("").as_posix()
        doc = json.loads(path.read_text())
        if name in stated or "traces" in name or not doc.get("results"):
            continue
        verdicts = findings.judged(summary.stored_verdicts(doc), doc.get("env"))
        assert (f"`{name}.json` {findings.counts_text(verdicts)}" in line) == bool(verdicts), name
    assert "`pytorch_suite.json` 0 met, 1 missed, 0 inconclusive" in line
