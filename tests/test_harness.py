"""The one benchmark driver: a benchmark declares its worker, process counts, report, targets and extras;
``harness.run`` spawns each process count, keeps rank 0's rows, prints, and writes the shared layout. The
optional hooks (threads, a world of one in this process, local rows, completion, header, stored environment
and config) are checked on one run with every hook set."""

import argparse
import json
import os

import torch
import torch.distributed as dist

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
    assert "* label x" in out and out.rstrip().endswith(f"4 rows\n\nwrote {args.json}"), "header, report, file"
    assert CALLS[-1] == (4, 2, "x"), "the extras see the rows, the environment and the arguments"


def test_finish_alone_reprints_and_rewrites_a_results_file_without_measuring(tmp_path, capsys):
    rows = [{"world_size": 2, "rank": 0, "size": 5}]
    args = argparse.Namespace(json=str(tmp_path / "again.json"), label="y")
    harness.finish(TOY, rows, {"world_size": 2}, args)
    assert json.loads((tmp_path / "again.json").read_text())["results"] == rows
    assert capsys.readouterr().out.strip() == f"1 rows\n\nwrote {args.json}" and CALLS[-1] == (1, 2, "y")


def _measured_at(ctx, args):
    """Where and how a rank measured: its world, its intra-op threads, its process."""
    return [{"world_size": ctx.world_size, "threads": torch.get_num_threads(), "pid": os.getpid()}]


def _local(args, device):
    return [{"world_size": None, "threads": torch.get_num_threads(), "pid": os.getpid(),
             "grouped": dist.is_initialized(), "device": device.type}]


def _complete(rows, env, args):
    return rows + [{"derived_from": len(rows), "env": env["stored"], "label": args.label}]


HOOKED = harness.Benchmark(
    "hooked", _measured_at, world_sizes=lambda args: args.procs, report=lambda rows: f"{len(rows)} rows",
    threads=lambda args: args.threads, world_of_one_here=True, local=_local, complete=_complete,
    header=lambda env, args: f"hooked header: {env['stored']}, {env['threads']} threads",
    environment=lambda env, args: {**env, "stored": "as the benchmark says"},
    config_adds=lambda args: {"resolved": 2 * args.threads})


def test_every_hook_threads_a_world_of_one_here_local_rows_completion_header_environment_and_config(tmp_path, capsys):
    args = argparse.Namespace(procs=[1, 2], threads=2, json=str(tmp_path / "hooked.json"), label="z",
                              backend="gloo", timeout=30.0)
    before = torch.get_num_threads()
    rows = harness.run(HOOKED, args)
    assert torch.get_num_threads() == before, "this process gets its own thread count back"
    here, spawned, local, derived = rows
    assert (here["world_size"], here["threads"], here["pid"]) == (1, 2, os.getpid()), "a world of one in this process"
    assert (spawned["world_size"], spawned["threads"]) == (2, 2) and spawned["pid"] != os.getpid()
    assert local == {"world_size": None, "threads": 2, "pid": os.getpid(), "grouped": False, "device": "cpu"}, \
        "local rows: after the workers', in this process, at the benchmark's threads, with no process group"
    assert derived == {"derived_from": 3, "env": "as the benchmark says", "label": "z"}, "complete sees every row"
    doc = read_results(args.json)
    assert doc["results"] == rows and doc["env"]["stored"] == "as the benchmark says" and doc["env"]["threads"] == 2
    assert doc["config"] == {"procs": [1, 2], "threads": 2, "label": "z", "backend": "gloo", "timeout": 30.0,
                             "resolved": 4}
    out = capsys.readouterr().out
    assert out.startswith("hooked header: as the benchmark says, 2 threads\n"), "the header hook replaces the default"
    assert out.rstrip().endswith(f"4 rows\n\nwrote {args.json}")
