"""The one benchmark driver: a benchmark declares its worker, process counts, report, targets and extras;
``harness.run`` spawns each process count, keeps rank 0's rows, prints, and writes the shared layout."""

import argparse
import json

from dpkit.bench import harness
from dpkit.bench.results import read_results

CALLS = []


def _rows(ctx, args):
    """Each rank's rows: rank 0's are the ones kept (the benchmarks gather what they need themselves)."""
    return [{"world_size": ctx.world_size, "rank": ctx.rank, "size": size} for size in args.sizes]


def _targets(rows):
    return [{"target": "every size measured", "verdict": "met" if len(rows) else "missed"}]


def _extra(rows, env, args):
    CALLS.append((len(rows), env["world_size"], args.label))


TOY = harness.Benchmark("toy", _rows, world_sizes=lambda args: args.procs, report=lambda rows: f"{len(rows)} rows",
                        targets=_targets, extra=_extra, describe=lambda args: f"label {args.label}",
                        config_leaves_out=("json", "label"))


def test_run_spawns_each_process_count_keeps_rank_0s_rows_and_writes_rows_targets_and_config(tmp_path, capsys):
    args = argparse.Namespace(procs=[1, 2], sizes=[10, 20], json=str(tmp_path / "toy.json"), label="x",
                              backend="gloo", timeout=30.0)
    rows = harness.run(TOY, args)
    assert rows == [{"world_size": 1, "rank": 0, "size": 10}, {"world_size": 1, "rank": 0, "size": 20},
                    {"world_size": 2, "rank": 0, "size": 10}, {"world_size": 2, "rank": 0, "size": 20}]
    doc = read_results(args.json)
    assert doc["benchmark"] == "toy" and doc["results"] == rows and doc["targets"] == _targets(rows)
    assert doc["config"] == {"procs": [1, 2], "sizes": [10, 20], "backend": "gloo", "timeout": 30.0}, "json, label left out"
    assert doc["env"]["world_size"] == 2 and doc["env"]["procs"] == [1, 2]
    out = capsys.readouterr().out
    assert "* label x" in out and out.rstrip().endswith("4 rows"), "the header's line, then the report"
    assert CALLS[-1] == (4, 2, "x"), "the extras see the rows, the environment and the arguments"


def test_finish_alone_reprints_and_rewrites_a_results_file_without_measuring(tmp_path, capsys):
    rows = [{"world_size": 2, "rank": 0, "size": 5}]
    args = argparse.Namespace(json=str(tmp_path / "again.json"), label="y")
    harness.finish(TOY, rows, {"world_size": 2}, args)
    assert json.loads((tmp_path / "again.json").read_text())["results"] == rows
    assert capsys.readouterr().out.strip() == "1 rows" and CALLS[-1] == (1, 2, "y")
