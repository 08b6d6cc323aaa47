"""ddp_benchmark.py: a tiny run of every variant writes sane results in the shared layout; the diff compares two.

One spawned group does the measuring: the sweep at world size 2 (2 workers through
dist_utils.launch; its single-process no-ddp row runs in this process) on the homework CNN,
batch 2 per rank, 2 timed iterations in 2 rounds after 1 warm-up, writing JSON and Chrome
traces. Every test below reads that run, or the diff of its file against a copy with
timings changed by known factors. Timings themselves are never asserted: only their
relations (percentiles of the slowest rank's samples, examples/sec = global batch / time,
waits inside iterations, overhead against the no-ddp row).
"""

from __future__ import annotations

import copy
import io
import json
import statistics
from contextlib import redirect_stdout

import pytest
import torch

import ddp_benchmark as bench
from common import PG_TIMEOUT_S, WORKERS_TIMEOUT_S
from models import Net
from results import read_results, write_results

BATCH, ITERS, ROUNDS, WORLD = 2, 2, 2, 2
BUCKETS = (1.0, 10.0, 25.0, 100.0, 1000.0)  # the default bucket sizes the issue lists
SELFMADE = ("naive", "flat", "overlap", "bucketed")
# The rows the issue asks for, in the order they are printed.
LABELS = (["no ddp"] + [f"pytorch {mb:g}M" for mb in BUCKETS] + ["naive", "flat", "overlap"]
          + [f"bucketed {mb:g}M" for mb in BUCKETS])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(results document, printed report, trace directory) of the one measured run."""
    tmp = tmp_path_factory.mktemp("ddp_benchmark")
    out = io.StringIO()
    with redirect_stdout(out):
        bench.main(["sweep", "--world-sizes", str(WORLD), "--models", "cnn", "--batch-size", str(BATCH),
                    "--iters", str(ITERS), "--rounds", str(ROUNDS), "--warmup", "1", "--timeout", str(PG_TIMEOUT_S),
                    "--max-time", str(WORKERS_TIMEOUT_S), "--json", str(tmp / "run.json"), "--profile", str(tmp / "traces")])
    return read_results(str(tmp / "run.json")), out.getvalue(), tmp / "traces"


def rows_at(doc: dict, world: int) -> dict[str, dict]:
    return {r["label"]: r for r in doc["results"] if r["world_size"] == world}


def cnn_parameters() -> list[torch.Tensor]:
    return list(Net().parameters())


# --------------------------------------------------------------------------- the results file


def test_results_file_is_in_the_shared_layout(sweep):
    doc, _, _ = sweep
    assert doc["benchmark"] == "ddp_benchmark"
    assert doc["env"]["torch"] == torch.__version__ and doc["env"]["backend"] == "gloo"
    assert doc["env"]["world_size"] == [1, WORLD] and doc["env"]["threads"] == 1
    assert doc["config"]["bucket_sizes"] == list(BUCKETS) and doc["config"]["world_sizes"] == [1, WORLD]
    assert doc["config"]["variants"] == LABELS


def test_a_row_per_variant_and_the_single_process_no_ddp_row(sweep):
    doc, _, _ = sweep
    assert [r["label"] for r in doc["results"] if r["world_size"] == WORLD] == LABELS
    assert [r["label"] for r in doc["results"] if r["world_size"] == 1] == ["no ddp"]
    buckets = {label: r["bucket_cap_mb"] for label, r in rows_at(doc, WORLD).items()}
    assert buckets["overlap"] == 0 and buckets["naive"] is None and buckets["pytorch 25M"] == 25


@pytest.mark.parametrize("label", LABELS)
def test_percentiles_are_over_the_slowest_rank_of_each_iteration(sweep, label):
    row = rows_at(sweep[0], WORLD)[label]
    per_rank = torch.tensor(row["per_rank_s"], dtype=torch.float64)
    assert per_rank.shape == (WORLD, ITERS) and row["iters"] == ITERS
    assert row["samples_s"] == per_rank.max(dim=0).values.tolist()
    assert row["p50_s"] == pytest.approx(statistics.median(row["samples_s"]))
    assert row["p50_s"] <= row["p75_s"] <= row["p90_s"] <= row["p95_s"] <= max(row["samples_s"])
    assert row["round_p50_s"] == row["samples_s"]  # 2 iterations in 2 rounds: one per round
    assert row["global_batch"] == BATCH * WORLD
    for p in bench.PERCENTILES:
        assert row[f"p{p}_ex_per_s"] == pytest.approx(BATCH * WORLD / row[f"p{p}_s"])


@pytest.mark.parametrize("label", LABELS)
def test_communication_wait_is_a_share_of_the_iteration(sweep, label):
    row = rows_at(sweep[0], WORLD)[label]
    if row["variant"] not in SELFMADE:  # PyTorch's DDP waits inside backward; no ddp has nothing to wait for
        assert row["comm_wait_s"] is None and row["comm_share"] is None
        return
    waits = torch.tensor(row["comm_wait_per_rank_s"], dtype=torch.float64)
    times = torch.tensor(row["per_rank_s"], dtype=torch.float64)
    assert waits.shape == times.shape
    assert (waits > 0).all() and (waits <= times).all()  # every step all-reduces, inside the iteration
    assert 0 < row["comm_share"] <= 1
    assert row["comm_share"] == pytest.approx((waits.sum() / times.sum()).item())
    assert row["comm_wait_s"] == pytest.approx(statistics.median(waits.mean(dim=0).tolist()))


@pytest.mark.parametrize("label", LABELS)
def test_overhead_is_against_the_no_ddp_row_of_the_same_run(sweep, label):
    rows = rows_at(sweep[0], WORLD)
    row, base, reference = rows[label], rows["no ddp"], rows["pytorch 25M"]
    assert row["overhead_s"] == pytest.approx(row["p50_s"] - base["p50_s"])
    assert row["overhead_frac"] == pytest.approx(row["overhead_s"] / base["p50_s"])
    assert row["vs_pytorch"] == pytest.approx(row["p50_s"] / reference["p50_s"])


def test_collectives_and_buffers_follow_each_variant_s_design(sweep):
    rows = rows_at(sweep[0], WORLD)
    params = cnn_parameters()
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    assert rows["naive"]["all_reduces"] == rows["overlap"]["all_reduces"] == len(params)  # one per parameter
    assert rows["flat"]["all_reduces"] == rows["bucketed 1000M"]["all_reduces"] == 1  # 3.2 MiB in one piece
    assert rows["bucketed 1M"]["all_reduces"] > 1
    for label, row in rows.items():
        assert row["grad_bytes"] == grad_bytes
        if row["variant"] in ("bucketed", "overlap", "pytorch"):  # buckets hold every gradient between steps
            assert row["ddp_buffer_bytes"] >= grad_bytes, label
        else:
            assert row["ddp_buffer_bytes"] == 0, label
        assert row["iteration_peak_bytes"] > 0
        assert row["peak_bytes"] == row["iteration_peak_bytes"] + row["ddp_buffer_bytes"]


def test_report_prints_every_row_and_the_targets(sweep):
    doc, printed, _ = sweep
    assert f"Benchmark: cnn with batch size {BATCH} per rank, 3x32x32 inputs" in printed
    for row in doc["results"]:
        prefix = bench.row_prefix(row)
        assert f"{prefix}  p50: {row['p50_s']:8.4f}s" in printed  # the seed-004 table
        assert sum(line.startswith(prefix) for line in printed.splitlines()) == 2  # and the communication table
    assert "Targets (issue 6" in printed
    assert "bucketed 25M p50 / pytorch 25M p50" in printed
    assert f"median of the {ROUNDS} per-round ratios" in printed


def test_every_variant_writes_a_loadable_chrome_trace_per_rank(sweep):
    _, _, traces = sweep
    expected = {f"cnn-{WORLD}ranks-{label.replace(' ', '-')}-rank{rank}.json" for label in LABELS for rank in range(WORLD)}
    expected.add("cnn-1ranks-no-ddp-rank0.json")
    assert {p.name for p in traces.iterdir()} == expected
    events = json.loads((traces / f"cnn-{WORLD}ranks-bucketed-1M-rank0.json").read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    for label in ("iteration 0", "iteration 2", "forward", "backward", "sync_gradients", "optimizer_step"):
        assert label in names
    assert names.count("gloo:all_reduce") >= bench.PROFILE_ITERS * rows_at(sweep[0], WORLD)["bucketed 1M"]["all_reduces"]


# --------------------------------------------------------------------------- diff


SCALE, FASTER = 1.25, 0.8  # every row of the test file 25% slower, bucketed 25M 20% faster


def changed_copy(doc: dict) -> dict:
    test = copy.deepcopy(doc)
    test["env"]["torch"] = "9.9.9"
    for row in test["results"]:
        factor = FASTER if row["label"] == "bucketed 25M" else SCALE
        row["samples_s"] = [factor * s for s in row["samples_s"]]
    test["results"] = [r for r in test["results"] if r["label"] != "flat"]
    return test


def test_diff_gives_the_percent_change_of_each_row(sweep, tmp_path):
    doc, _, _ = sweep
    base_path, test_path = tmp_path / "base.json", tmp_path / "test.json"
    write_results(str(base_path), doc["benchmark"], doc["env"], doc["config"], doc["results"])
    test = changed_copy(doc)
    write_results(str(test_path), test["benchmark"], test["env"], test["config"], test["results"])
    diffs, unmatched = bench.diff_rows(read_results(str(base_path)), read_results(str(test_path)))
    assert len(diffs) == len(doc["results"]) - 1
    assert unmatched == [f"only in baseline: cnn (batch {BATCH}, 3x32x32), {WORLD} ranks, flat"]
    base_rows = {(r["world_size"], r["label"]): r for r in doc["results"]}
    for d in diffs:
        factor = FASTER if d["label"] == "bucketed 25M" else SCALE
        base = base_rows[d["world_size"], d["label"]]
        for p in bench.DIFF_PERCENTILES:
            # PyTorch's diff.py: the change in time, negated (lower is better): 1.25x the time is -25%.
            assert d[f"p{p}_diff_pct"] == pytest.approx(-100 * (factor - 1))
            expected_time = factor * bench.percentile(base["samples_s"], p)
            assert d[f"p{p}_test_s"] == pytest.approx(expected_time)
            assert d[f"p{p}_test_ex_per_s"] == pytest.approx(base["global_batch"] / expected_time)


def test_diff_prints_the_settings_side_by_side_and_a_line_per_row(sweep):
    doc, _, _ = sweep
    test = changed_copy(doc)
    text = bench.format_diff(doc, test)
    torch_line = next(line for line in text.splitlines() if line.startswith("torch:"))
    assert torch.__version__ in torch_line and "9.9.9" in torch_line and "differs" in torch_line
    backend_line = next(line for line in text.splitlines() if line.startswith("backend:"))
    assert "differs" not in backend_line
    row = rows_at(doc, WORLD)["bucketed 25M"]
    p75 = FASTER * bench.percentile(row["samples_s"], 75)
    assert f"{bench.row_prefix(row)}  p75: {p75:8.4f}s {row['global_batch'] / p75:7.0f}/s    +20.0%" in text
    assert "only in baseline:" in text


# --------------------------------------------------------------------------- pieces, in this process


def test_rounds_rotate_the_order_and_split_the_iterations():
    variants = bench.variants_for(("naive", "flat", "overlap"), [])  # no ddp, naive, flat, overlap
    order = [v.label for _, v in bench.schedule(variants, 2)]
    assert order == ["no ddp", "naive", "flat", "overlap", "flat", "overlap", "no ddp", "naive"]
    assert [bench.round_iters(10, 4, r) for r in range(4)] == [3, 3, 2, 2]


def test_gpt_predicts_the_next_token_with_a_tied_output_layer():
    args = bench.parse_args(["--models", "gpt", "--batch-size", "3", "--gpt-width", "16", "--gpt-depth", "2",
                             "--gpt-heads", "4", "--gpt-seq-len", "8", "--gpt-vocab", "50"])
    torch.manual_seed(0)
    model = bench.build_model("gpt", bench.gpt_config(args))
    inputs, targets = bench.make_batch("gpt", args, rank=0, device=torch.device("cpu"))
    assert inputs.shape == targets.shape == (3, 8)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one token
    assert model.head.weight is model.tokens.weight
    logits = model(inputs)
    assert logits.shape == (3, 8, 50)
    bench.loss_of(logits, targets).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    # Causal: the first position's logits do not depend on later tokens.
    changed = inputs.clone()
    changed[:, 1:] = (changed[:, 1:] + 1) % 50
    torch.testing.assert_close(model(changed)[:, 0], logits[:, 0])


@pytest.mark.parametrize("flags", [["--iters", "2", "--rounds", "3"], ["--batch-size", "1"], ["--bucket-sizes", "0"],
                                   ["--gpt-width", "10", "--gpt-heads", "4"], ["--warmup", "-1"]])
def test_bad_flags_stop_with_a_usage_error(flags, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(flags)
    assert stop.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_every_flag_shows_its_default_in_help():
    parser = bench.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert "default" in (action.help or ""), f"{name} {action.option_strings}"
