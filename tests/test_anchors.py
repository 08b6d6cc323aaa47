"""The anchors of the backend axis (dpkit.bench.anchors, dpkit.bench.mpirun): how mpirun is called (held to shared
memory, oversubscribed only past the cores), how a world's DeepSpeed segments are named and removed, how a
stopped mpirun takes its ranks with it, and the backend's ratio to each anchor. Marked slow: the memory's bound
(no library needed) beside a real run; where Open MPI, mpi4py and DeepSpeed are installed, the benchmark under
mpirun on 2 ranks, every anchor row exact, nothing left in /dev/shm, and a failing rank failing the run with its
traceback."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import collectives_benchmark as bench
from common import REPO
from dpkit.bench import anchors, backend_axis, collectives, mpirun
from dpkit.comm.process_groups import WorkerError

RUN_TIMEOUT_S = 600.0  # the slow run: a first build of DeepSpeed's op, then two worlds' start-up and a few calls


# --------------------------------------------------------------------------- how mpirun is called


def test_mpirun_is_held_to_shared_memory_and_oversubscribes_and_yields_only_past_the_cores():
    two = mpirun.command("/x/mpirun", 2, "/tmp/spec", cpus=2)
    four = mpirun.command("/x/mpirun", 4, "/tmp/spec", cpus=2)
    for cmd in (two, four):
        flags = " ".join(cmd)
        assert "--mca pml ob1" in flags and "--mca btl self,sm" in flags and "--bind-to none" in flags
        assert cmd[-4:] == [sys.executable, "-m", "dpkit.bench.mpirun", "/tmp/spec"]
    assert two[:3] == ["/x/mpirun", "-n", "2"] and four[:3] == ["/x/mpirun", "-n", "4"]
    assert ":OVERSUBSCRIBE" not in two and "mpi_yield_when_idle" not in two
    assert "--map-by :OVERSUBSCRIBE" in " ".join(four) and "--mca mpi_yield_when_idle 1" in " ".join(four)


def test_mpirun_may_run_as_root_only_for_root_and_its_ranks_find_the_package():
    assert mpirun.environment({"A": "1"}, uid=0)["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    user = mpirun.environment({"A": "1", "PYTHONPATH": "/elsewhere"}, uid=1000)
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in user and user["A"] == "1"
    assert user["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere"]


def _error_file(folder, rank: int, stamp: float, last_line: str) -> None:
    (folder / f"error-{rank}.txt").write_text(f"{stamp!r}\nTraceback (most recent call last):\n{last_line}\n")


def test_the_failure_reported_is_a_ranks_own_before_the_peers_it_took_down(tmp_path):
    assert mpirun.root_cause(str(tmp_path)) is None
    _error_file(tmp_path, 0, 1.0, "dpkit.comm.process_groups.PeerFailedError: a peer failed")
    _error_file(tmp_path, 1, 2.0, "ValueError: the real cause")
    rank, text = mpirun.root_cause(str(tmp_path))
    assert rank == 1 and "the real cause" in text


def test_stopping_mpirun_kills_every_process_of_its_session_even_one_in_a_group_of_its_own():
    # A rank of mpirun's sits in a process group of its own, out of reach of a signal to mpirun's group.
    rank = "import os, time; os.setpgid(0, 0); time.sleep(120)"
    launcher = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}]); time.sleep(120)"
    process = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(mpirun.session_members(process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        members = mpirun.session_members(process.pid)
        assert len(members) == 2, members
    finally:
        mpirun.stop(process)
    deadline = time.monotonic() + 10
    while mpirun.session_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # the orphaned child is reaped by init
    assert mpirun.session_members(process.pid) == []


# --------------------------------------------------------------------------- DeepSpeed's segments


def test_deepspeeds_segments_are_named_as_shm_cpp_names_them():
    # shm.cpp: "%s_%d_%s_%s" % (SHM_BUFFER_NAME, getuid(), MASTER_ADDR, MASTER_PORT), then "_%d" % rank
    assert anchors.segment_paths(2, "127.0.0.1", "29500", uid=0) == [
        "/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_29500_0",
        "/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_29500_1"]


@pytest.mark.parametrize("fails", [False, True], ids=["ends", "fails"])
def test_a_world_removes_its_own_segments_and_no_other_and_restores_the_environment(tmp_path, monkeypatch, fails):
    monkeypatch.setattr(anchors, "SHM_DIR", str(tmp_path))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "outer")
    other = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_0"  # another run's
    other.write_text("")
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with anchors.deepspeed_names(2) as paths:
            assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"] != "outer"
            assert paths == anchors.segment_paths(2, "127.0.0.1", os.environ["MASTER_PORT"])
            for path in paths[:1]:  # rank 1 unlinked its own already
                open(path, "w").close()
            if fails:
                raise RuntimeError("a rank failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]
    assert "MASTER_ADDR" not in os.environ and os.environ["MASTER_PORT"] == "outer"


# --------------------------------------------------------------------------- rows and the report


def _row(label: str, times: list[float], **fields) -> dict:
    return {"label": label, "round_p50_s": times, "rounds": len(times), "world_size": 2, "collective": "allreduce",
            "bytes": 4096, **fields}


def test_each_anchor_row_gets_the_backends_time_over_its_own_paired_round_by_round():
    rows = [_row("gloo", [4.0, 4.0, 4.0]), _row(collectives.BACKEND, [1.0, 2.0, 3.0]),
            _row("Open MPI (mpi4py)", [2.0, 2.0, 2.0], anchor="openmpi", anchor_version="Open MPI v5")]
    done = anchors.with_ratios(rows, collectives.BACKEND)
    assert [("backend_vs_anchor" in r) for r in done] == [False, False, True]
    mpi = done[2]
    # median of .5, 1, 1.5
    assert mpi["backend_vs_anchor"] == 1.0 and mpi["backend_vs_anchor_of"] == collectives.BACKEND
    assert mpi["backend_vs_anchor_ci_low"] >= 0.5 and mpi["backend_vs_anchor_ci_high"] <= 1.5
    text = "\n".join(anchors.ratio_lines(done))
    assert "| 2 | all-reduce | 4KiB | Open MPI (mpi4py) | Open MPI v5 | 1.00x [" in text
    assert anchors.ratio_lines(rows) == []  # no anchor measured: no table


def test_anchors_are_asked_for_on_the_backend_axis_by_name_or_all_at_once():
    assert bench.parse_args(["--axis", "backends"]).anchors == []
    assert bench.parse_args(["--axis", "backends", "--anchors"]).anchors == list(anchors.ANCHORS)
    assert bench.parse_args(["--axis", "all", "--anchors", "deepspeed"]).anchors == ["deepspeed"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--axis", "transports", "--anchors"])


@pytest.mark.slow  # a benchmark's run: seconds of the default suite's three minutes
def test_the_memory_s_bound_needs_no_library_and_stands_beside_the_all_reduce_alone_checked_exact(tmp_path):
    path = tmp_path / "memory.json"
    result = _run(["collectives_benchmark.py", "--axis", "backends", "--procs", "2", "--anchors", "memory",
                   "--backend-collectives", "allreduce", "broadcast", "--backend-sizes", "4KB", "--iters", "1",
                   "--warmup", "0", "--floor-calls", "0", "--json", str(path)], timeout_s=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [r for r in json.loads(path.read_text())["results"] if "axis" in r]
    (memory,) = [r for r in rows if "anchor" in r]
    assert (memory["anchor"], memory["collective"], memory["label"]) == ("memory", "allreduce",
                                                                         anchors.LABELS["memory"])
    assert memory["correct"] and memory["max_abs_error"] == 0.0 and memory["backend_vs_anchor"] > 0
    assert "torch.add(a, b, out=c)" in memory["anchor_settings"]
    assert {r["collective"] for r in rows} == {"allreduce", "broadcast"} and all(r["correct"] for r in rows)


# --------------------------------------------------------------------------- the real thing (slow)


def _missing() -> list[str]:
    names = [name for name in ("mpi4py", "deepspeed") if importlib.util.find_spec(name) is None]
    return names + ([] if mpirun.find() else ["mpirun"])


needs_anchors = pytest.mark.skipif(bool(_missing()), reason=f"not installed: {', '.join(_missing())} "
                                                            "(pip install -r requirements-anchors.txt)")


def _segments() -> set[str]:
    return {name for name in os.listdir(anchors.SHM_DIR) if name.startswith("deepspeed_allreduce_buffer_")}


def _run(argv: list[str], timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    process = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)  # the benchmark stops mpirun, which stops its ranks
        out, err = process.communicate(timeout=60)
        raise AssertionError(f"timed out after {timeout_s:g} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


@pytest.mark.slow
@needs_anchors
def test_under_mpirun_every_anchor_row_is_exact_and_deepspeed_leaves_nothing_in_dev_shm(tmp_path):
    before, path = _segments(), tmp_path / "anchors.json"
    result = _run(["collectives_benchmark.py", "--axis", "backends", "--procs", "2", "--anchors", "--backend-sizes",
                   "8", "4KB", "--iters", "1", "--warmup", "0", "--floor-calls", "0", "--json", str(path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(path.read_text())["results"]
    found = {(r["anchor"], r["collective"], r["bytes"]) for r in rows if "anchor" in r}
    sizes = {c: (0,) if c == "barrier" else (8, 4096) for c in backend_axis.BACKEND_CALLS}
    assert found == {("openmpi", c, n) for c, ns in sizes.items() for n in ns} | {
        (name, "allreduce", n) for name in ("deepspeed", "memory") for n in (8, 4096)}
    assert all(r["correct"] and r["max_abs_error"] == 0.0 for r in rows if "axis" in r)
    mpi = next(r for r in rows if r.get("anchor") == "openmpi")
    assert mpi["anchor_version"].startswith("Open MPI v") and "btl=self,sm" in mpi["anchor_settings"]
    assert all(r["backend_vs_anchor"] > 0 for r in rows if "anchor" in r)
    assert "against the anchors" in result.stdout and "correctness: all exact" in result.stdout
    assert _segments() <= before, _segments() - before


def _fails_on_rank_1(ctx, _args):
    # Every rank has joined before rank 1 fails: else rank 0, done at once, may exit while rank 1 still connects to
    # it, and rank 1 fails on that connection instead (seen in CI, on a loaded machine).
    dist.barrier()
    if ctx.rank == 1:
        raise ValueError("rank 1 was told to fail")
    return ctx.rank


@pytest.mark.slow
@needs_anchors
def test_a_failing_rank_under_mpirun_fails_the_launch_with_its_traceback():
    with pytest.raises(WorkerError, match="rank 1 of 2 failed under mpirun") as failure:
        mpirun.launch(_fails_on_rank_1, 2, None, timeout_s=120.0, pg_timeout_s=20.0)
    assert "rank 1 was told to fail" in str(failure.value)
