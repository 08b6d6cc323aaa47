"""The one benchmark driver: a benchmark declares its worker, process counts, report, targets and extras;
``harness.run`` spawns each process count, keeps rank 0's rows, prints, and writes the shared layout. The
optional hooks (threads, a world of one in this process, local rows, completion, header, stored environment
and config) are checked on one run with every hook set. A run stopped after its first configuration (SIGTERM,
its time limit) leaves that configuration's rows, marked incomplete: collectives_benchmark.py on two sizes,
whose second never ends."""

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import collectives_benchmark
from common import REPO
from dpkit.bench import harness
from dpkit.bench.results import read_results
from dpkit.comm.process_groups import WorkerError

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
    config = {"procs": [1, 2], "sizes": [10, 20], "backend": "gloo", "timeout": 30.0}
    assert doc["config"] == config, "json, label left out"
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
    kept = read_results(args.json)  # as the run left it once the workers were done
    return [{"world_size": None, "threads": torch.get_num_threads(), "pid": os.getpid(),
             "grouped": dist.is_initialized(), "device": device.type, "kept": [kept["complete"], len(kept["results"])]}]


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
    assert local == {"world_size": None, "threads": 2, "pid": os.getpid(), "grouped": False, "device": "cpu",
                     "kept": [False, 2]}, \
        "local rows: after the workers' (kept in the file, incomplete), in this process, at the benchmark's threads, " \
        "with no process group"
    assert derived == {"derived_from": 3, "env": "as the benchmark says", "label": "z"}, "complete sees every row"
    doc = read_results(args.json)
    assert doc["complete"] is True, "a run that ends says so"
    assert doc["results"] == rows and doc["env"]["stored"] == "as the benchmark says" and doc["env"]["threads"] == 2
    assert doc["config"] == {"procs": [1, 2], "threads": 2, "label": "z", "backend": "gloo", "timeout": 30.0,
                             "resolved": 4}
    out = capsys.readouterr().out
    assert out.startswith("hooked header: as the benchmark says, 2 threads\n"), "the header hook replaces the default"
    assert out.rstrip().endswith(f"4 rows\n\nwrote {args.json}")


# --------------------------------------------------------------------------- a run stopped after its first size

SIZES = (4000, 8000)
TIME_LIMIT_S = 15.0  # the first size takes a few seconds, workers started included
PIDS_ENV = "DPKIT_TEST_PIDS"  # where the stalling workers leave their process ids


def _stalls_on_the_second_size(ctx, args):
    """collectives_benchmark.py's worker, whose second size never ends: every rank sleeps in it."""
    measure = collectives_benchmark.benchmark_transports_size

    def stalling(ctx, collective, nbytes, *rest):
        if nbytes == SIZES[1]:
            with open(os.path.join(os.environ[PIDS_ENV], f"pid-{ctx.rank}"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        return measure(ctx, collective, nbytes, *rest)

    collectives_benchmark.benchmark_transports_size = stalling  # in this worker process only
    return collectives_benchmark.worker(ctx, args)


def stalled_run(path: str, procs: int, timeout_s: float = 300.0) -> None:
    args = collectives_benchmark.parse_args(["--procs", str(procs), "--sizes", *map(str, SIZES), "--axis", "transports",
                                             "--transports", "torch", "--iters", "1", "--warmup", "0", "--json", path])
    stalling = dataclasses.replace(collectives_benchmark.BENCHMARK, worker=_stalls_on_the_second_size,
                                   timeout_s=lambda args, world_size: timeout_s)
    harness.run(stalling, args)


def _first_size_kept(path, ranks: int, pids, deadline_s: float = 120.0) -> None:
    """Wait until the file holds the first size's rows and every rank sleeps in the second."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if len(list(pids.glob("pid-*"))) == ranks and read_results(str(path))["results"]:
            return
        time.sleep(0.2)
    raise AssertionError(f"the first size was not kept within {deadline_s:g} s")


def _assert_kept_first_size_only(path) -> None:
    doc = read_results(str(path))
    assert doc["complete"] is False and doc["targets"] == []
    assert {row["bytes"] for row in doc["results"]} == {SIZES[0]} and {row["label"] for row in doc["results"]} == \
        {"torch"}, "the finished size's rows, as measured"
    assert doc["config"]["sizes"] == list(SIZES) and doc["env"]["procs"], "the environment and config of the run"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"  # a zombie has stopped; its parent reaps it
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("stop", [pytest.param("SIGTERM to the launcher", marks=pytest.mark.slow),  # a minute
                                  pytest.param("SIGINT to its process group",  # alone: in the full slow run
                                               marks=(pytest.mark.slow, pytest.mark.solo))])  # it timed out twice
def test_a_run_stopped_by_a_signal_after_its_first_size_leaves_those_rows_marked_incomplete(tmp_path, stop):
    """SIGTERM: ``kill``, a batch system; SIGINT to the group: Ctrl-C in a terminal, which reaches the workers too."""
    path, pids = tmp_path / "stopped.json", tmp_path / "pids"
    pids.mkdir()
    # Ctrl-C's handler even where this job was started with SIGINT ignored (a shell's background job without job
    # control), which a child inherits; and its stacks on SIGUSR1, should it outlive the stop.
    script = ("import faulthandler, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "faulthandler.register(signal.SIGUSR1, all_threads=True); sys.path[:0] = ['.', 'tests']; "
              "import test_harness; test_harness.stalled_run(sys.argv[1], 2)")
    run = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=REPO, env={**os.environ, PIDS_ENV: str(pids)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _first_size_kept(path, 2, pids)
        if stop.startswith("SIGTERM"):
            run.send_signal(signal.SIGTERM)
        else:
            os.killpg(run.pid, signal.SIGINT)
        _, err = run.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGUSR1)  # the launcher's Python stacks, to stderr, before it is killed
        time.sleep(2)
        os.killpg(run.pid, signal.SIGKILL)
        raise AssertionError(f"the launcher did not end within 60 s of the {stop}; its stacks:\n"
                             f"{run.communicate()[1][-6000:]}") from None
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 128 + (signal.SIGTERM if stop.startswith("SIGTERM") else signal.SIGINT), err
    _assert_kept_first_size_only(path)
    assert f"{path} keeps the 1 row measured before the stop, marked incomplete" in err, err
    workers = [int(p.read_text()) for p in pids.iterdir()]
    assert all(_gone(pid) for pid in workers), "the launcher stopped its workers"
    assert not list(tmp_path.glob("stopped.json.tmp*")), "no half-written file left"


@pytest.mark.slow  # waits out its whole time limit: the default run has the SIGTERM case of the same mechanism
def test_a_run_past_its_time_limit_after_its_first_size_leaves_those_rows_marked_incomplete(tmp_path, monkeypatch,
                                                                                            capsys):
    monkeypatch.setenv(PIDS_ENV, str(tmp_path))
    path = tmp_path / "timed_out.json"
    with pytest.raises(WorkerError, match="still running after"):
        stalled_run(str(path), 1, timeout_s=TIME_LIMIT_S)
    _assert_kept_first_size_only(path)
    assert harness.KEEP_ENV not in os.environ, "the next run in this process keeps nothing of this one"
