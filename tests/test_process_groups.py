"""Process groups: the local launcher's success and failure paths, a world of one without torchrun,
and timing gathered across ranks."""

import faulthandler
import os
import signal
import sys
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from common import CollectiveCounter, left_in_dev_shm, run_workers
from dpkit.bench import measure
from dpkit.comm import process_groups
from dpkit.comm.process_groups import GROUP_OUTLIVED_TEARDOWN, PeerFailedError, WorkerError, launch


def _probe(ctx, payload):
    """Several successful-path checks in one spawned group (spawning costs seconds, a check milliseconds)."""
    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total)
    # Rank 1 is slower; every iteration counts as long as its slowest rank.
    timing = measure.time_iterations(lambda: time.sleep(0.02 * ctx.rank), iters=5, warmup=1)
    with CollectiveCounter() as counter:
        dist.all_reduce(torch.ones(2))
        peer = (ctx.rank + 1) % ctx.world_size
        ops = [dist.P2POp(dist.isend, torch.ones(3), peer),
               dist.P2POp(dist.irecv, torch.empty(3), (ctx.rank - 1) % ctx.world_size)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if ctx.rank == 0:
            dist.send(torch.ones(5), dst=1)
        elif ctx.rank == 1:
            dist.recv(torch.empty(5), src=0)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": total.item(), "payload": payload,
            "threads": torch.get_num_threads(), "timing": timing,
            "counted": (dict(counter.calls), counter.sent_bytes, counter.collectives, counter.point_to_point)}


@pytest.fixture(scope="module")
def three_workers():
    return run_workers(_probe, 3, "x")


def test_launch_returns_every_rank_result_in_rank_order(three_workers):
    assert [r["rank"] for r in three_workers] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 3.0 and r["payload"] == "x" for r in three_workers)
    assert all(r["threads"] == 1 for r in three_workers), "workers run one intra-op thread by default"


def test_time_iterations_gathers_every_rank_and_reports_the_slowest(three_workers):
    timing = three_workers[0]["timing"]
    assert timing.per_rank.shape == (3, 5)
    assert timing.samples == timing.per_rank.max(dim=0).values.tolist()
    assert min(timing.samples) >= 0.04, "rank 2 sleeps 40 ms per iteration"
    assert timing.median == pytest.approx(np.median(timing.samples))
    assert all(torch.equal(r["timing"].per_rank, timing.per_rank) for r in three_workers), "every rank has every sample"


def test_collective_counter_sees_collectives_and_bytes_sent(three_workers):
    calls, sent, collectives, p2p = three_workers[0]["counted"]
    assert calls == {"all_reduce": 1, "batch_isend_irecv": 1, "send": 1}, \
        "the isend/irecv inside batch and send are theirs"
    assert (sent, collectives, p2p) == (12 + 20, 1, 2)
    calls, sent, _, _ = three_workers[1]["counted"]
    assert calls == {"all_reduce": 1, "batch_isend_irecv": 1, "recv": 1} and sent == 12


def _raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits for a peer that is gone: the launcher must not wait with it


def _hang_on_rank_0(ctx):
    if ctx.rank == 0:
        time.sleep(600)


def _exit_abruptly(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()


def _abort_in_a_named_frame(ctx):
    if ctx.rank == 1:
        os.abort()  # SIGABRT, as a C++ exception nobody catches ends a process
    dist.barrier()


def _silent_peer(ctx):
    """Rank 1 stays alive but never answers, so only the process-group timeout can end rank 0's wait."""
    if ctx.rank == 1:
        time.sleep(600)
    dist.recv(torch.zeros(1), src=1)


def _assert_all_dead(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_raises_fails_the_launch_with_its_traceback_and_leaves_no_process():
    start = time.monotonic()
    with pytest.raises(WorkerError) as failure:
        launch(_raise_on_rank_1, 2, timeout_s=120, pg_timeout_s=60)
    assert "rank 1 of 2 failed" in str(failure.value)
    assert "ValueError: boom from rank 1" in str(failure.value)
    assert time.monotonic() - start < 50, "the launcher must not wait for the peers' timeout"
    _assert_all_dead(failure.value.pids)


def test_a_hung_worker_fails_the_launch_at_the_timeout_and_is_killed():
    start = time.monotonic()
    with pytest.raises(WorkerError) as failure:
        launch(_hang_on_rank_0, 2, timeout_s=4, pg_timeout_s=60)
    assert "ranks [0" in str(failure.value) and "of 2 still running after 4 s" in str(failure.value)
    assert time.monotonic() - start < 40
    _assert_all_dead(failure.value.pids)


def test_a_worker_that_dies_without_a_traceback_is_reported_with_its_exit_code():
    with pytest.raises(WorkerError) as failure:
        launch(_exit_abruptly, 2, timeout_s=120, pg_timeout_s=60)
    assert "rank 1 of 2 failed" in str(failure.value) and "exit code 3" in str(failure.value)
    _assert_all_dead(failure.value.pids)


def test_a_worker_that_crashes_outside_python_is_reported_with_its_signal_and_python_stack():
    with pytest.raises(WorkerError) as failure:
        launch(_abort_in_a_named_frame, 2, timeout_s=120, pg_timeout_s=60)
    message = str(failure.value)
    assert "rank 1 of 2 failed" in message and f"exit code {-signal.SIGABRT}" in message
    assert "the Python stacks when it crashed" in message and "_abort_in_a_named_frame" in message
    _assert_all_dead(failure.value.pids)


# What gloo's connect raised on CI in a rank still joining when its peer, already joined, aborted.
_CONNECT_CLOSED = ("Gloo connectFullMesh failed with [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] "
                   "Connection closed by peer [127.0.0.1]:34518")


def test_a_rank_that_fails_to_join_because_its_peer_crashed_is_not_reported_as_the_cause(tmp_path, monkeypatch):
    """The crash is the root cause: the rank still joining fails with PeerFailedError, which ranks below a rank
    that died without a traceback, so the launcher names the crashed rank whichever of the two it sees first."""
    def join_that_loses_its_peer(*_):
        raise RuntimeError(_CONNECT_CLOSED)

    monkeypatch.setattr(process_groups, "_init", join_that_loses_its_peer)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # worker_main sets them; restored after the test
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit):
            process_groups.worker_main(_abort_in_a_named_frame, 0, 2, str(tmp_path / "store"), "gloo", 3, 1, (),
                                       str(tmp_path))
    finally:
        torch.set_num_threads(threads)
        faulthandler.enable()  # worker_main pointed it at crash-0.txt
    last_line = (tmp_path / "error-0.txt").read_text().strip().splitlines()[-1]
    assert last_line.startswith(f"{PeerFailedError.__module__}.{PeerFailedError.__name__}: rank 0/2: a peer failed")
    assert "Connection closed by peer" in last_line
    exited = [types.SimpleNamespace(exitcode=1), types.SimpleNamespace(exitcode=-signal.SIGABRT)]
    rank, text = process_groups.root_cause(str(tmp_path), exited)
    assert rank == 1 and text.startswith(f"exit code {-signal.SIGABRT}, no traceback"), text


def test_under_torchrun_a_join_that_loses_its_peer_is_a_peer_failure(monkeypatch):
    def join_that_loses_its_peer(*_):
        raise RuntimeError(_CONNECT_CLOSED)

    monkeypatch.setattr(process_groups, "_init", join_that_loses_its_peer)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PeerFailedError, match="rank 1/2: a peer failed"):
        with process_groups.distributed("gloo", timeout_s=10):
            pass


def _killed_after_a_progress_bar(ctx) -> None:
    for _ in process_groups.progress(range(2)):  # rank 0 draws it
        pass
    if ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
    time.sleep(60)


def test_a_worker_killed_after_drawing_a_progress_bar_leaves_nothing_in_dev_shm():
    """A bar's lock is a thread lock: tqdm's default would leave a named semaphore until the launcher exits."""
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(WorkerError, match=f"exit code {-signal.SIGKILL}"):
        launch(_killed_after_a_progress_bar, 2, timeout_s=120, pg_timeout_s=60)
    assert left_in_dev_shm(before) == []


def test_a_silent_peer_fails_the_waiting_rank_within_the_process_group_timeout():
    start = time.monotonic()
    with pytest.raises(WorkerError) as failure:
        launch(_silent_peer, 2, timeout_s=120, pg_timeout_s=3)
    message = str(failure.value)
    assert "rank 0 of 2 failed" in message
    assert PeerFailedError.__name__ in message and "a peer failed" in message and "3 s process-group timeout" in message
    assert time.monotonic() - start < 40
    _assert_all_dead(failure.value.pids)


def test_distributed_without_torchrun_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with process_groups.distributed("gloo", timeout_s=10) as ctx:
        assert (ctx.rank, ctx.world_size, ctx.device.type) == (0, 1, "cpu")
        assert dist.is_initialized() and dist.get_world_size() == 1
    assert not dist.is_initialized(), "torn down on exit"


def test_a_group_still_referenced_after_teardown_is_reported(monkeypatch, capsys):
    """A group that outlives destroy_process_group keeps gloo's threads running into interpreter shutdown,
    where a process whose work succeeded can abort: the teardown says so on stderr."""
    monkeypatch.delenv("RANK", raising=False)
    held = []
    with process_groups.distributed("gloo", timeout_s=10):
        held.append(dist.group.WORLD)  # as a default argument evaluated after the group was made would
    assert GROUP_OUTLIVED_TEARDOWN in capsys.readouterr().err
    held.clear()
    with process_groups.distributed("gloo", timeout_s=10):
        pass
    assert GROUP_OUTLIVED_TEARDOWN not in capsys.readouterr().err


def test_the_report_names_each_function_that_holds_the_group_as_a_default_argument(monkeypatch):
    group = object()

    def broadcast(tensor, group=group):  # as torch.distributed.nn.functional's, imported after init
        return tensor

    class Scaler:
        __module__ = "late"

        def __init__(self, *, process_group=group):
            self.process_group = process_group

    module = types.ModuleType("late")
    module.broadcast, module.Scaler, module.other = broadcast, Scaler, lambda group=None: group
    monkeypatch.setitem(sys.modules, "late", module)
    assert process_groups.default_argument_holders(group, ["late"]) == ["late.broadcast", "late.Scaler.__init__"]


def test_a_set_up_that_fails_leaves_no_store_directory(monkeypatch, tmp_path):
    """Without torchrun, ``distributed`` makes a FileStore in a temporary directory: removed even
    when joining the process group raises (on today's main it was left behind)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(process_groups.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError, match="--backend bogus: unknown backend"):
        with process_groups.distributed("bogus"):
            pass
    assert os.listdir(tmp_path) == [] and not dist.is_initialized()


# --------------------------------------------------------------------------- --backend and --device


@pytest.mark.parametrize("gpu, backend, device, want", [
    (False, "auto", "auto", ("gloo", "cpu")),
    (False, "gloo", "cpu", ("gloo", "cpu")),
    (True, "auto", "auto", ("nccl", "cuda")),
    (True, "auto", "cpu", ("gloo", "cpu")),  # CPU tensors on a GPU machine: gloo
    (True, "gloo", "auto", ("gloo", "cpu")),
    (True, "gloo", "cuda", ("gloo", "cuda")),  # ranks share the GPUs over gloo
    (True, "nccl", "auto", ("nccl", "cuda")),
])
def test_the_backend_and_device_follow_the_flags_and_the_machine(monkeypatch, gpu, backend, device, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert process_groups.placement(backend, device) == want


@pytest.mark.parametrize("gpu, flags, message", [
    (False, ("--device", "cuda"), "--device cuda: no CUDA device is visible"),
    (False, ("--backend", "nccl"), "--backend nccl needs CUDA"),
    (True, ("--backend", "nccl", "--device", "cpu"), "--device cpu with --backend nccl"),
])
@pytest.mark.parametrize("script", ("sequential_print", "ddp_cifar100"))
def test_a_device_the_machine_cannot_serve_is_a_usage_error_naming_the_flag(monkeypatch, capsys, gpu, flags, message,
                                                                            script):
    module = __import__(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(list(flags))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err, err


@pytest.mark.parametrize("script", ("sequential_print", "ddp_cifar100"))
def test_cuda_asked_of_a_torch_built_without_it_says_so_rather_than_no_gpu(monkeypatch, capsys, script):
    module = __import__(script)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--device", "cuda"])
    assert exit_.value.code == 2
    assert f"--device cuda: this torch ({torch.__version__}) is built without CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("processes, gpus, refused", [(2, 1, True), (3, 2, True), (2, 2, False), (1, 1, False)])
def test_nccl_with_more_processes_than_gpus_on_a_host_is_one_sentence_naming_both_ways_out(monkeypatch, processes,
                                                                                           gpus, refused):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    process_groups.check_gpu_per_rank("gloo", processes)  # gloo: processes may share a GPU
    if not refused:
        process_groups.check_gpu_per_rank("nccl", processes)
        return
    with pytest.raises(RuntimeError, match=rf"--backend nccl: {processes} processes on this host and {gpus} GPU\(s\), "
                                           r"and NCCL needs a GPU per process: use --backend gloo \(processes share a "
                                           r"GPU\) or more GPUs"):
        process_groups.check_gpu_per_rank("nccl", processes)
