"""What a program may expect of the "dpkit" backend beyond its sums, as of gloo: works that say they completed, real
asynchrony, point-to-point from any source, monitored barriers, TORCH_DISTRIBUTED_DEBUG=DETAIL, sparse tensors,
double backward through DDP, a group made again on the same store, NCCL's integer mean; and after a fault,
nothing that goes on silently.

One spawned group of two ranks runs every case on "dpkit" (the oracle, where there is one: the same call on a
gloo group over the same ranks), on each path the backend has: the C++ face (``dpkit/native/c10d_backend.cpp``)
and, where no compiler is, torch's Python-backend route (``DPKIT_NATIVE=0``), which can forward only ``wait`` and
``get_future`` of a work. The fault cases are marked slow.
"""

from __future__ import annotations

import datetime
import inspect
import os
import tempfile
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d
from torch.distributed._functional_collectives import allow_inflight_collective_as_graph_input_ctx

from common import BACKEND_PATHS, PG_TIMEOUT_S
from dpkit.comm import backend
from dpkit.comm.process_groups import WorkerError, launch
from dpkit.comm.slots import SLOT_BYTES, piece_numel, reduce_into

BIG = SLOT_BYTES // 4 + 100  # float32 elements a rank gathers: more than one slot, which the Python path runs


def works(rank: int) -> dict:
    """A work after ``wait()``, and one left alone: completed, its result, no exception."""
    x = torch.full((3,), float(rank + 1))
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    left = dist.all_reduce(torch.ones(2), async_op=True)
    deadline = time.monotonic() + 10
    while not left.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)  # nobody waits: the backend's own thread must finish it
    out = {"completed": work.is_completed(), "left alone completed": left.is_completed(), "x": x}
    try:
        out["result"] = work.result()
        out["exception"] = work.exception()
    except RuntimeError as error:
        out["result"] = f"RuntimeError: {error}"
    except TypeError as error:  # torch 2.11's binding cannot return an exception_ptr, gloo's included
        assert "exception_ptr" in str(error), error
        out["exception"] = None
    left.wait()
    return out


def waited_calls(rank: int) -> dict:
    """What the group hands back for each collective the C++ face runs itself, called as ``dist.all_reduce(x)``
    and its kin call it (``asyncOp`` False: the caller waits at once), and each call's result; then the same
    all-reduce while torch captures in-flight collectives for compiled graphs, whose ``wait_tensor`` looks up the
    call's Work."""
    group, x = dist.group.WORLD, torch.arange(4, dtype=torch.float32) * (rank + 1)
    shown, reduced, summed = x.clone(), x.clone(), x.clone()
    gathered, scattered, exchanged = torch.empty(8), torch.empty(2), torch.empty(4)
    calls = {
        "all_reduce": lambda w: group.allreduce([summed], _options(dist.AllreduceOptions, **w)),
        "broadcast": lambda w: group.broadcast([shown], _options(dist.BroadcastOptions, rootRank=1, **w)),
        "reduce": lambda w: group.reduce([reduced], _options(dist.ReduceOptions, rootRank=0, **w)),
        "all_gather": lambda w: group._allgather_base(gathered, x, _options(c10d.AllgatherOptions, **w)),
        "reduce_scatter": lambda w: group._reduce_scatter_base(scattered, x, _options(dist.ReduceScatterOptions, **w)),
        "all_to_all": lambda w: group.alltoall_base(exchanged, x, [], [], _options(dist.AllToAllOptions, **w)),
        "barrier": lambda w: group.barrier(_options(dist.BarrierOptions, **w)),
    }
    out = {"no work": {}}
    for name, call in calls.items():
        work = call({"asyncOp": False})
        out["no work"][name] = work is None
        if work is not None:
            work.wait()
    out["results"] = [summed, shown, reduced if rank == 0 else torch.zeros(0), gathered, scattered, exchanged]
    captured = x.clone()
    with allow_inflight_collective_as_graph_input_ctx():
        work = group.allreduce([captured], _options(dist.AllreduceOptions, asyncOp=False))
        out["captured has a work"] = work is not None
        torch.ops._c10d_functional.wait_tensor(captured)
    out["captured"] = captured
    return out


def overlap(rank: int) -> float:
    """Rank 0 starts an all-reduce, then receives what rank 1 sends before rank 1 reaches the all-reduce: the
    all-reduce must go on while rank 0 waits in the receive (seconds it took)."""
    x, y = torch.ones(4), torch.zeros(3)
    start = time.monotonic()
    if rank == 0:
        work = dist.all_reduce(x, async_op=True)
        dist.recv(y, src=1)
        work.wait()
    else:
        dist.send(torch.full((3,), 7.0), dst=0)
        dist.all_reduce(x)
    assert torch.equal(x, torch.full((4,), 2.0)) and (rank == 1 or torch.equal(y, torch.full((3,), 7.0)))
    return time.monotonic() - start


def point_to_point(rank: int) -> dict:
    out = {}
    if backend.compiled() is not None:  # torch's Python route cannot ask a work for its source
        if rank == 1:
            dist.send(torch.full((2,), 5.0), dst=0)
        else:
            got = torch.zeros(2)
            out["any source"] = (dist.recv(got), got)  # no source: returns the sender's rank
    mine, theirs = torch.full((2,), float(rank)), torch.zeros(2)
    ops = [dist.P2POp(dist.isend, mine, 1 - rank), dist.P2POp(dist.irecv, theirs, 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["batch"] = theirs
    return out


def reductions(rank: int) -> dict:
    out = {}
    for dtype in (torch.int32, torch.int64, torch.uint8):
        x = torch.tensor([rank * 3 + 1, 7, rank], dtype=dtype) if dtype == torch.uint8 else \
            torch.tensor([rank * 3 + 1, -5 - rank, rank], dtype=dtype)
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        out[f"avg {dtype}"] = x
    big = torch.arange(300_000, dtype=torch.int64) * (rank + 1)  # more than one slot
    dist.all_reduce(big, op=dist.ReduceOp.AVG)
    out["avg int64 long"] = big
    outs = [[torch.empty(2, dtype=torch.int32), torch.empty(3, dtype=torch.int32)] for _ in range(2)]
    mine = [torch.full((2,), rank, dtype=torch.int32), torch.full((3,), 10 + rank, dtype=torch.int32)]
    dist.all_gather_coalesced(outs, mine)
    out["all_gather_coalesced"] = outs
    for name, call in (("tensor", lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(5))),
                       ("list", lambda: dist.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(3)]))):
        try:
            call()
            out[f"uneven {name}"] = "no error"
        except ValueError as error:
            out[f"uneven {name}"] = str(error)
    y = torch.ones(2)
    dist.all_reduce(y)
    out["after refusals"] = y  # a refusal before any message leaves the group working
    return out


def sparse(rank: int, gloo) -> dict:
    def dense(group):
        s = torch.sparse_coo_tensor([[0, 2 + rank]], [1.0 + rank, 2.0], (5,))
        dist.all_reduce(s, group=group)
        return s.to_dense()
    out = {"all_reduce": (dense(None), dense(gloo))}
    for name, group in (("dpkit", None), ("gloo", gloo)):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Embedding(10, 3, sparse=True), process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(3):
            model(torch.tensor([rank, step + 2 * rank, 7])).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        out[name] = model.module.weight.detach().clone()
    return out


class Square(nn.Module):
    def __init__(self, start: float):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(start))

    def forward(self):
        return self.p.pow(2)


def double_backward(rank: int, gloo) -> dict:
    """DDP's gradients made by ``backward(create_graph=True)`` (they require grad, so that a gradient penalty can
    follow), six times over, as torch's own test does: on dpkit and on gloo."""
    out = {}
    for name, group in (("dpkit", None), ("gloo", gloo)):
        model = nn.parallel.DistributedDataParallel(Square(1.0 + rank), process_group=group)
        grads = []
        for _ in range(6):
            model().backward(create_graph=True)
            grads.append((model.module.p.grad.detach().clone(), model.module.p.grad.requires_grad))
        out[name] = grads
    return out


def made_again(ctx) -> list[torch.Tensor]:
    """The default group made, destroyed and made again on one store, as torch's own tests do (the keys the
    first left are still there)."""
    path = [tempfile.mktemp(prefix="dpkit-store-")]
    dist.broadcast_object_list(path, group_src=0)
    store, timeout = dist.FileStore(path[0], ctx.world_size), datetime.timedelta(seconds=PG_TIMEOUT_S)
    sums = []
    for _ in range(2):
        dist.destroy_process_group()
        dist.init_process_group("dpkit", store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
        x = torch.full((2,), float(ctx.rank + 1))
        dist.all_reduce(x)
        sums.append(x)
    return sums


def monitored(rank: int) -> dict:
    """A monitored barrier (None where torch itself allows it on gloo alone: torch 2.11), and the names."""
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
        passed = True
    except ValueError as error:
        if "only implemented for GLOO" not in str(error):
            raise
        passed = None
    return {"passed": passed, "name": dist.get_backend()}


def fast_path(rank: int, gloo) -> dict:
    """Each collective the C++ face runs itself (small dense tensors, nothing queued), as gloo computes it, and
    which calls it ran itself or handed to Python: here, one whose peer is far later than the hand-over time."""
    face = backend.cpu_backend()
    counted = lambda: (getattr(face, "fast_calls", 0), getattr(face, "handed_over", 0))  # noqa: E731
    before = counted()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=generator)
    out = {}
    for name, group in (("dpkit", None), ("gloo", gloo)):
        summed, ints, shown = x.clone(), torch.arange(6, dtype=torch.int64) * (rank + 1), x.clone().double()
        gathered, scattered = torch.empty(2 * 1000), torch.empty(3, dtype=torch.float64)
        dist.all_reduce(summed, group=group)
        dist.all_reduce(ints, group=group)
        dist.broadcast(shown, 1, group=group)
        dist.all_gather_into_tensor(gathered, x, group=group)
        dist.reduce_scatter_tensor(scattered, torch.arange(6, dtype=torch.float64) * (rank + 1), group=group)
        reduced, exchanged = x.clone(), torch.empty(1000)
        dist.reduce(reduced, dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
        dist.all_to_all_single(exchanged, x, group=group)
        dist.barrier(group=group)
        out[name] = [summed, ints, shown, gathered, scattered, reduced if rank == 0 else torch.zeros(0), exchanged]
        for numel in (1000, BIG):  # in place (the input is this rank's block of the output): in C++, in Python
            gathered = torch.zeros(2, numel)
            gathered[rank] = torch.arange(numel) * (rank + 1)
            dist.all_gather_into_tensor(gathered.view(-1), gathered[rank], group=group)
            out[name].append(gathered)
    mean = x.clone()
    dist.all_reduce(mean, dist.ReduceOp.AVG)
    out["avg"], out["sum"] = mean, out["gloo"][0]
    out["counted"] = [a - b for a, b in zip(counted(), before)]
    if rank == 1:
        time.sleep(0.3)  # rank 0 posts, waits its hand-over time, and hands the call to Python
    late = torch.full((4,), float(rank + 1))
    dist.all_reduce(late)
    out["late"], out["late counted"] = late, [a - b for a, b in zip(counted(), before)]
    return out


def pieces(rank: int, gloo) -> dict:
    """A broadcast from rank 1, a reduce to rank 0, an all-reduce and an all-to-all of one slot (2 MiB) each, and
    an all-reduce of 2.5 slots (all-reduces go in pieces at every size, the first three calls too: four pieces
    each, ``piece_numel``), against gloo's: with both ranks calling torch; with rank 1 calling the Python
    implementation itself, so that each call pairs the two paths piece by piece; and with rank 1 late for the third
    piece of the broadcast, the reduce and both all-reduces (it runs their exchanges itself, and sleeps after the
    second piece), so that rank 0 hands each over in the middle (its all-reduces then go on in C++ from the next
    piece where it is built, ``Slots.all_reduce``); then all five through torch again."""
    n = 1 << 19
    x = torch.arange(n, dtype=torch.float32) * (rank + 1)
    big = torch.arange(5 * n // 2, dtype=torch.float32) * (rank + 1)
    impl, face = backend.implementation(), backend.cpu_backend()
    counted = lambda: (getattr(face, "fast_calls", 0), getattr(face, "handed_over", 0))  # noqa: E731
    second = piece_numel("broadcast", n, x.element_size(), impl.slots.slot_bytes)  # where the second piece starts
    assert second == piece_numel("all_reduce", big.numel(), x.element_size(), impl.slots.slot_bytes) < n

    def late(lo, hi, parts):  # rank 1 is the broadcast's root and not the reduce's: it reads no slot
        if lo == second:
            time.sleep(0.3)  # far past the hand-over time of a caller that waits at once

    def late_sum(flat):
        def take(lo, hi, parts):
            late(lo, hi, parts)
            reduce_into(flat[lo:hi], parts, "sum", rank)
        return take

    def run(group, how: str) -> list[torch.Tensor]:
        shown, reduced, exchanged = x.clone(), x.clone(), torch.empty(n)
        summed, summed_big = x.clone(), big.clone()
        if how == "torch":
            dist.broadcast(shown, dist.get_global_rank(group or dist.group.WORLD, 1), group=group)
            dist.reduce(reduced, dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
            dist.all_reduce(summed, group=group)
            dist.all_reduce(summed_big, group=group)
        elif how == "python":  # the Python implementation, torch not in between
            impl.broadcast([shown], _options(dist.BroadcastOptions, rootRank=1, rootTensor=0)).wait()
            impl.reduce([reduced], _options(dist.ReduceOptions, rootRank=0, reduceOp=dist.ReduceOp.SUM)).wait()
            impl.allreduce([summed], dist.AllreduceOptions()).wait()
            impl.allreduce([summed_big], dist.AllreduceOptions()).wait()
        else:  # the slots' exchanges themselves, late for the third piece
            impl.slots.exchange("broadcast", shown, "none", 1, True, late)
            impl.slots.exchange("reduce", reduced, "sum", 0, True, late)
            impl.slots.exchange("all_reduce", summed, "sum", 0, True, late_sum(summed))
            impl.slots.exchange("all_reduce", summed_big, "sum", 0, True, late_sum(summed_big))
        if how == "torch":
            dist.all_to_all_single(exchanged, x, group=group)
        else:
            impl.all_to_all_single(exchanged, x, [], [], dist.AllToAllOptions()).wait()
        if group is None and rank != 0:  # a reduce leaves the others' tensors as they are (gloo promises nothing)
            kept.append(torch.equal(reduced, x))
        return [shown, reduced if rank == 0 else torch.zeros(0), summed, summed_big, exchanged]

    kept: list[bool] = []
    out = {"gloo": run(gloo, "torch"), "torch": run(None, "torch")}
    before = counted()
    out["paired"] = run(None, "python" if rank == 1 else "torch")
    out["late"] = run(None, "late" if rank == 1 else "torch")
    out["late counted"] = [a - b for a, b in zip(counted(), before)]
    out["after"] = run(None, "torch")
    out["reduce kept the others' tensors"] = kept
    return out


def _options(kind, **fields):
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


def semantics_worker(ctx) -> dict:
    gloo = dist.new_group(backend="gloo")
    out = {"fast path": fast_path(ctx.rank, gloo), "pieces": pieces(ctx.rank, gloo), "works": works(ctx.rank),
           "waited calls": waited_calls(ctx.rank),
           "overlap": overlap(ctx.rank), "p2p": point_to_point(ctx.rank),
           "reductions": reductions(ctx.rank), "sparse": sparse(ctx.rank, gloo),
           "double backward": double_backward(ctx.rank, gloo), "monitored": monitored(ctx.rank),
           "native": backend.compiled() is not None}
    dist.destroy_process_group(gloo)
    out["made again"] = made_again(ctx)
    return out


def detail_worker(ctx) -> torch.Tensor:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks every collective across ranks first."""
    x = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(x)
    dist.barrier()
    return x


_RUNS: dict = {}


def semantics(path: str) -> list[dict]:
    if path not in _RUNS:
        with mock.patch.dict(os.environ, BACKEND_PATHS[path]):
            _RUNS[path] = launch(semantics_worker, 2, backend="dpkit", timeout_s=240, pg_timeout_s=PG_TIMEOUT_S)
    return _RUNS[path]


@pytest.fixture(params=["c++", pytest.param("python", marks=pytest.mark.slow)])  # the fallback: under -m slow
def path(request):
    return request.param


def test_each_path_is_the_one_asked_for(path):
    assert all(found["native"] == (path == "c++") for found in semantics(path))


def test_small_collectives_give_gloo_s_bits_whoever_runs_them(path):
    for rank, found in enumerate(semantics(path)):
        fast = found["fast path"]
        for ours, theirs in zip(fast["dpkit"], fast["gloo"]):
            assert torch.equal(ours, theirs)
        assert torch.equal(fast["avg"], fast["sum"] / 2)
        assert torch.equal(fast["late"], torch.full((4,), 3.0))
        assert torch.equal(fast["dpkit"][-1], torch.arange(BIG).repeat(2, 1) * torch.tensor([[1.0], [2.0]]))
        if path == "c++":  # the 10 calls of up to a slot, each run by the C++ face or handed over; then the late one
            ran, handed = fast["counted"]
            assert ran + handed == 10 and ran > 0, fast["counted"]
            first = rank == 0  # the rank that waited: it handed the call over; the late one found it posted
            assert fast["late counted"] == [ran + (not first), handed + first], (rank, fast["late counted"])


def test_collectives_of_many_pieces_give_gloo_s_bits_whichever_path_each_rank_takes(path):
    for rank, found in enumerate(semantics(path)):
        calls = found["pieces"]
        assert len(calls["gloo"]) == 5
        assert calls["reduce kept the others' tensors"] == ([True] * 4 if rank else []), rank
        for case in ("torch", "paired", "late", "after"):
            for ours, theirs in zip(calls[case], calls["gloo"], strict=True):
                assert torch.equal(ours, theirs), (rank, case)
        if path == "c++" and rank == 0:  # ten calls; rank 1 was late for the third piece of four of them
            ran, handed = calls["late counted"]
            assert ran + handed == 10 and handed >= 4, calls["late counted"]


def test_a_waited_work_and_one_left_alone_both_complete(path):
    for rank, found in enumerate(semantics(path)):
        works = found["works"]
        assert torch.equal(works["x"], torch.full((3,), 3.0))
        if path == "c++":  # torch's Python route keeps its own completion flag, which no backend can set
            assert works["completed"] and works["left alone completed"]
            assert torch.equal(works["result"][0], works["x"]) and works["exception"] is None


def test_a_call_the_cpp_face_completes_for_a_caller_that_waits_at_once_returns_no_work_unless_captured(path):
    x = torch.arange(4, dtype=torch.float32)
    for rank, found in enumerate(semantics(path)):
        calls = found["waited calls"]
        # None: done, nothing to wait on (torch's Python waits only on a Work); torch's Python route always
        # wraps what a Python backend returns
        assert calls["no work"] == dict.fromkeys(calls["no work"], path == "c++"), (rank, calls["no work"])
        summed, shown, reduced, gathered, scattered, exchanged = calls["results"]
        assert torch.equal(summed, 3 * x) and torch.equal(shown, 2 * x) and torch.equal(gathered, torch.cat([x, 2 * x]))
        assert torch.equal(scattered, 3 * x[2 * rank:2 * rank + 2])
        assert torch.equal(exchanged, torch.cat([x[2 * rank:2 * rank + 2], 2 * x[2 * rank:2 * rank + 2]]))
        assert rank != 0 or torch.equal(reduced, 3 * x)
        assert calls["captured has a work"] and torch.equal(calls["captured"], 3 * x)


def test_an_async_collective_goes_on_while_its_caller_waits_for_a_peer(path):
    for found in semantics(path):
        assert found["overlap"] < 10, f"took {found['overlap']:.1f} s: the all-reduce waited for its caller"


def test_a_receive_from_any_source_names_the_sender_and_batched_point_to_point_works(path):
    found = semantics(path)
    if path == "c++":  # torch's Python route cannot ask a work for its source
        source, got = found[0]["p2p"]["any source"]
        assert source == 1 and torch.equal(got, torch.full((2,), 5.0))
    for rank, f in enumerate(found):
        assert torch.equal(f["p2p"]["batch"], torch.full((2,), float(1 - rank)))


def test_the_integer_mean_is_the_sum_divided_and_truncated_as_nccl_defines_it(path):
    sums = {torch.int32: [1 + 4, -5 - 6, 0 + 1], torch.int64: [1 + 4, -5 - 6, 0 + 1], torch.uint8: [1 + 4, 14, 1]}
    for found in semantics(path):
        got = found["reductions"]
        for dtype, total in sums.items():
            expected = [int(s / 2) for s in total]  # Python's / then int(): toward zero, as C's integer division
            assert got[f"avg {dtype}"].tolist() == expected and got[f"avg {dtype}"].dtype == dtype
        assert torch.equal(got["avg int64 long"], torch.arange(300_000, dtype=torch.int64) * 3 // 2)


def test_all_gather_coalesced_fills_one_list_per_rank(path):
    for found in semantics(path):
        outs = found["reductions"]["all_gather_coalesced"]
        for r in range(2):
            assert torch.equal(outs[r][0], torch.full((2,), r, dtype=torch.int32))
            assert torch.equal(outs[r][1], torch.full((3,), 10 + r, dtype=torch.int32))


def test_an_uneven_reduce_scatter_is_refused_on_every_rank_and_the_group_goes_on(path):
    for found in semantics(path):
        got = found["reductions"]
        assert "2 x the output's 2 elements" in got["uneven tensor"], got["uneven tensor"]
        assert "inputs of [2, 3]" in got["uneven list"], got["uneven list"]
        assert torch.equal(got["after refusals"], torch.full((2,), 2.0))


def test_sparse_tensors_are_summed_and_ddp_over_a_sparse_embedding_trains_as_on_gloo(path):
    for found in semantics(path):
        ours, theirs = found["sparse"]["all_reduce"]
        assert torch.equal(ours, theirs)
        assert torch.equal(found["sparse"]["dpkit"], found["sparse"]["gloo"])


def test_ddp_gradients_made_with_create_graph_are_as_on_gloo(path):
    for found in semantics(path):
        for (ours, graph), (theirs, _) in zip(found["double backward"]["dpkit"], found["double backward"]["gloo"]):
            assert torch.equal(ours, theirs) and graph


def test_a_monitored_barrier_passes_and_the_backend_names_itself(path):
    for found in semantics(path):
        gloo_only = "only implemented for GLOO" in inspect.getsource(dist.monitored_barrier)  # torch's own refusal
        assert found["monitored"]["passed"] is (None if gloo_only else True)
        assert found["monitored"]["name"] == "dpkit"


def test_a_group_made_again_on_the_same_store_works(path):
    for found in semantics(path):
        assert all(torch.equal(x, torch.full((2,), 3.0)) for x in found["made again"])


def test_under_torch_distributed_debug_detail_every_collective_runs():
    with mock.patch.dict(os.environ, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}):
        found = launch(detail_worker, 2, backend="dpkit", timeout_s=240, pg_timeout_s=PG_TIMEOUT_S)
    assert all(torch.equal(x, torch.full((3,), 3.0)) for x in found)


# --------------------------------------------------------------------------- after a fault


def late_peer_worker(ctx) -> dict:
    """Rank 1 reaches the first all-reduce past rank 0's timeout; both ranks catch what they get and go on
    calling: nothing may pair across the failure."""
    out = {}
    if ctx.rank == 1:
        time.sleep(6)
    first = torch.full((2,), float(ctx.rank + 1))
    try:
        dist.all_reduce(first)
        out["first"] = f"no error: {first.tolist()}"
    except RuntimeError as error:
        out["first"] = f"{type(error).__name__}: {error}"
    later = []
    for i, call in enumerate((dist.all_reduce, dist.reduce, dist.all_reduce)):  # reduce: through gloo, not the slots
        x = torch.full((2,), 10.0 * (i + 1) + ctx.rank)
        start = time.monotonic()
        try:
            call(x) if call is dist.all_reduce else call(x, dst=0)
            later.append(f"no error: {x.tolist()}")
        except RuntimeError as error:
            later.append(f"{type(error).__name__} after {time.monotonic() - start:.1f} s: {error}")
    out["later"] = later
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", list(BACKEND_PATHS))
def test_after_a_collective_fails_every_later_call_raises_at_once_on_every_rank(path):
    with mock.patch.dict(os.environ, BACKEND_PATHS[path]):
        found = launch(late_peer_worker, 2, backend="dpkit", timeout_s=120, pg_timeout_s=3)
    assert "timeout" in found[0]["first"], found[0]["first"]
    for rank, f in enumerate(found):
        for later in f["later"]:
            assert not later.startswith("no error"), f"rank {rank} paired across the failure: {f}"
            seconds = float(later.split(" after ")[1].split(" s:")[0])
            assert seconds < 1.0 and "broke" in later, f"rank {rank}: {later}"


def dies_at_once_worker(ctx) -> None:
    if ctx.rank == 1:
        os._exit(0)  # gone before the first collective, without a word
    dist.all_reduce(torch.ones(4))


@pytest.mark.slow
def test_a_peer_dead_before_the_first_call_is_named_within_seconds():
    start = time.monotonic()
    with pytest.raises(WorkerError) as failure:
        launch(dies_at_once_worker, 2, backend="dpkit", timeout_s=120, pg_timeout_s=60)
    assert "rank(s) [1]" in str(failure.value) or "rank 1" in str(failure.value), str(failure.value)
    assert time.monotonic() - start < 30, "the dead peer was found only at the group's 60 s timeout"


def dies_mid_call_worker(ctx) -> None:
    """Rank 1 posts the first three pieces of an all-reduce of 2.5 slots (by the slots' exchange itself) and dies
    after the third; rank 0 calls torch, on the C++ face's loop over the pieces where it is built."""
    big = torch.ones(5 * SLOT_BYTES // 8)
    if ctx.rank == 1:
        impl = backend.implementation()
        third = 2 * piece_numel("all_reduce", big.numel(), big.element_size(), impl.slots.slot_bytes)

        def take(lo, hi, parts):
            if lo == third:
                os._exit(0)  # without a word, its third piece posted
        impl.slots.exchange("all_reduce", big, "sum", 0, True, take)
    dist.all_reduce(big)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(BACKEND_PATHS))
def test_a_peer_dead_in_the_middle_of_a_long_all_reduce_is_named_within_seconds(path):
    start = time.monotonic()
    with mock.patch.dict(os.environ, BACKEND_PATHS[path]), pytest.raises(WorkerError) as failure:
        launch(dies_mid_call_worker, 2, backend="dpkit", timeout_s=120, pg_timeout_s=60)
    assert "PeerFailedError" in str(failure.value) and "rank(s) [1]" in str(failure.value), str(failure.value)
    assert time.monotonic() - start < 30, "the dead peer was found only at the group's 60 s timeout"
