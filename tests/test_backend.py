"""The torch.distributed backend "dpkit" (dpkit/comm/backend.py) against gloo's results, PyTorch's engines on it,
and what it refuses or survives.

One spawned group per world size runs the whole grid: every collective torch.distributed offers, every dtype
gloo takes (and bfloat16, which it does not: there the oracle is gloo on float32 copies, rounded), every op,
a small message and one longer than a slot; each rank returns the pair (dpkit's result, gloo's on the same
input, through a gloo group over the same ranks), and the parent compares them: bit for bit at 2 ranks
(a sum of two is the same in any order) and for every op but sum, mean and product of floats, within the
dtype's rounding at 3 ranks, where gloo's ring sums in another order. DPKIT_HOSTS=2,2 runs the hierarchical
path the same way.
PyTorch's DDP, fully_shard and ZeroRedundancyOptimizer train one model on a "dpkit" and a gloo group: bit for
bit at 2 ranks (same sums). The kill test is marked slow.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
import zlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from common import BACKEND_PATHS, PG_TIMEOUT_S, left_in_dev_shm
from dpkit.comm import backend, slots
from dpkit.comm.process_groups import WorkerError, launch

DTYPES = ("float32", "float64", "float16", "bfloat16", "uint8", "int8", "int32", "int64")
OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
BIG = slots.SLOT_BYTES // 4 + 1001  # float32 elements: more than one slot, not a multiple of it
SIZES = (7, BIG)
LAYOUTS = {1: None, 2: None, 3: None, 4: (2, 2)}


def valid(op: str, dtype: str) -> bool:
    floating = dtype.startswith(("float", "bfloat"))
    return not ((op in ("band", "bor", "bxor") and floating) or (op == "avg" and not floating))


def cases() -> list[tuple]:
    """(collective, dtype, op, numel per rank)."""
    out = [("all_reduce", d, op, 7) for d in DTYPES for op in OPS if valid(op, d)]
    out += [(kind, d, "sum", 7) for kind in ("broadcast", "all_gather", "all_gather_single", "all_to_all",
                                              "all_to_all_single", "gather", "scatter", "send_recv") for d in DTYPES]
    out += [(kind, d, op, 7) for kind in ("reduce", "reduce_to_last", "reduce_scatter", "reduce_scatter_single")
            for d in DTYPES for op in ("sum", "max") if valid(op, d)]
    out += [(kind, "float32", "sum", BIG) for kind in ("all_reduce", "reduce", "reduce_to_last", "broadcast",
                                                       "all_gather_single", "reduce_scatter_single",
                                                       "all_to_all_single")]
    out += [("all_reduce_strided", "float32", "sum", 7), ("all_reduce_async", "float32", "sum", 7),
            ("objects", "float32", "sum", 7), ("barrier", "float32", "sum", 7)]
    return out


def rank_input(case: tuple, rank: int, n: int) -> torch.Tensor:
    kind, dtype, op, numel = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()) + rank)
    count = numel * (n if kind in ("reduce_scatter", "reduce_scatter_single", "all_to_all", "all_to_all_single",
                                   "scatter") else 1)
    if dtype.startswith(("float", "bfloat")):
        scale = 1.5 if op == "product" else 4.0
        return (torch.rand(count, generator=g) * scale + (0.5 if op == "product" else -2.0)).to(getattr(torch, dtype))
    low = 0 if dtype == "uint8" else -3
    return torch.randint(low, 4, (count,), generator=g).to(getattr(torch, dtype))


def run(case: tuple, x: torch.Tensor, group, n: int):
    """The collective of ``case`` on ``x`` over ``group``; returns what this rank holds afterwards."""
    kind, _, op, numel = case
    rank, reduce_op = dist.get_rank(group), getattr(dist.ReduceOp, op.upper())
    if kind == "all_reduce":
        dist.all_reduce(x, reduce_op, group=group)
        return x
    if kind == "all_reduce_strided":
        y = torch.stack([x, x], 1)[:, 0]
        if group is not dist.group.WORLD:  # the oracle: gloo, which would sum the strided view's storage
            y = y.contiguous()
        dist.all_reduce(y, group=group)
        return y
    if kind == "all_reduce_async":
        work = dist.all_reduce(x, group=group, async_op=True)
        return x if work.wait() and work.get_future().wait() is not None and work.get_future().done() else None
    if kind == "broadcast":
        dist.broadcast(x, group_src=n - 1, group=group)
        return x
    if kind in ("reduce", "reduce_to_last"):  # to the first rank, to the last
        root = 0 if kind == "reduce" else n - 1
        dist.reduce(x, group_dst=root, op=reduce_op, group=group)
        return x if rank == root else None
    if kind == "all_gather":
        out = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(out, x, group=group)
        return torch.cat(out)
    if kind == "all_gather_single":
        out = torch.empty(n * x.numel(), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    if kind == "reduce_scatter":
        out = torch.empty(numel, dtype=x.dtype)
        dist.reduce_scatter(out, list(x.chunk(n)), reduce_op, group=group)
        return out
    if kind == "reduce_scatter_single":
        out = torch.empty(numel, dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x, reduce_op, group=group)
        return out
    return run_more(case, x, group, n, rank)


def run_more(case, x, group, n, rank):
    kind, _, _, numel = case
    if kind == "all_to_all" and group is not dist.group.WORLD:  # the oracle: some torch's gloo lacks the list form
        kind = "all_to_all_single"
    if kind == "all_to_all":
        out = [torch.empty(numel, dtype=x.dtype) for _ in range(n)]
        dist.all_to_all(out, list(x.chunk(n)), group=group)
        return torch.cat(out)
    if kind == "all_to_all_single":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out
    if kind == "gather":
        out = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
        dist.gather(x, out, group_dst=0, group=group)
        return torch.cat(out) if rank == 0 else None
    if kind == "scatter":
        out = torch.empty(numel, dtype=x.dtype)
        dist.scatter(out, list(x.chunk(n)) if rank == 0 else None, group_src=0, group=group)
        return out
    if kind == "send_recv":  # a ring: even ranks send first, odd ones receive first
        got = torch.empty_like(x)
        peer_to, peer_from = dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)
        for step in ((lambda: dist.send(x, peer_to, group=group)), (lambda: dist.recv(got, peer_from, group=group))
                     )[::(1 if rank % 2 == 0 else -1)]:
            step()
        return got
    if kind == "objects":
        out = [None] * n
        dist.all_gather_object(out, {"rank": rank, "x": x.tolist()}, group=group)
        listed = [out if rank == 0 else None]
        dist.broadcast_object_list(listed, group_src=0, group=group)
        return listed
    if kind == "barrier":
        dist.barrier(group=group)
        return torch.ones(1)
    raise ValueError(kind)


def grid_worker(ctx) -> dict:
    """{case: (dpkit's result, gloo's result or the error gloo raised)} on this rank."""
    n, gloo = ctx.world_size, dist.new_group(backend="gloo")
    found = {}
    for case in cases():
        if n == 1 and case[0] == "send_recv":  # one rank sends to no one
            continue
        x = rank_input(case, ctx.rank, n)
        ours = run(case, x.clone(), dist.group.WORLD, n)
        try:
            wide = x.float() if case[1] == "bfloat16" else x.clone()
            theirs = run(case, wide, gloo, n)
            theirs = theirs.to(torch.bfloat16) if case[1] == "bfloat16" and isinstance(theirs, torch.Tensor) else theirs
        except (RuntimeError, ValueError) as error:
            theirs = f"gloo: {error}"
        found[case] = (ours, theirs)
    face = backend.cpu_backend()  # the C++ face, where it was built
    return found | {"spans_hosts": backend.slots_of() is None, "pid": os.getpid(),
                    "calls": (getattr(face, "fast_calls", None), getattr(face, "handed_over", None))}


def shm_names() -> set[str]:
    """The names in /dev/shm (the slots' file has none: a test compares the listing before and after)."""
    return set(os.listdir("/dev/shm"))


_GRIDS: dict = {}


def grid(world: int, path: str = "c++") -> list[dict]:
    """Every rank's grid at ``world`` ranks on ``path`` (BACKEND_PATHS), launched once (a failed launch fails every
    test that needs it), and the names it left in /dev/shm."""
    key = (world, path)
    if key not in _GRIDS:
        before = shm_names()
        try:
            with mock.patch.dict(os.environ, BACKEND_PATHS[path]):
                _GRIDS[key] = launch(grid_worker, world, backend="dpkit", timeout_s=240, pg_timeout_s=PG_TIMEOUT_S,
                                     hosts=LAYOUTS[world])
            _GRIDS[key][0]["left in /dev/shm"] = left_in_dev_shm(before)
        except WorkerError as error:
            _GRIDS[key] = error
    if isinstance(_GRIDS[key], WorkerError):
        raise _GRIDS[key]
    return _GRIDS[key]


def compare(ours, theirs, case, world) -> None:
    if isinstance(theirs, str):
        pytest.fail(f"gloo refused {case}, which the grid should not ask for: {theirs}")
    if not isinstance(ours, torch.Tensor):
        assert ours == theirs
        return
    exact = world == 2 or case[2] not in ("sum", "avg", "product") or not case[1].startswith(("float", "bfloat"))
    if exact and case[1] != "bfloat16":
        assert torch.equal(ours, theirs), f"{case}: {ours[:8]} != {theirs[:8]}"
    else:  # a sum of ``world`` terms, each at most 2 in magnitude, rounded at every addition in either order
        atol = world * 2 * torch.finfo(ours.dtype).eps
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=torch.finfo(ours.dtype).eps * world,
                                   msg=lambda m: f"{case}: {m}")


# The long messages run at 1, 2 and 3 ranks; 2 hosts of 2 checks the hierarchical arithmetic on the short ones;
# torch's Python-backend route (where no compiler is) runs the whole grid at 2 ranks.
WORLDS = {(1, "c++"): "1rank", (2, "c++"): "2ranks", (3, "c++"): "3ranks", (4, "c++"): "2hosts_of_2",
          (2, "python"): "2ranks_python"}
GRID = [pytest.param(world, path, case, id=f"{name}-{'-'.join(map(str, case))}")
        for case in cases() for (world, path), name in WORLDS.items()
        if not (world == 4 and case[3] == BIG) and not (world == 1 and case[0] == "send_recv")]


@pytest.mark.parametrize("world, path, case", GRID)
def test_every_collective_matches_gloo(world, path, case):
    for rank, found in enumerate(grid(world, path)):
        ours, theirs = found[case]
        compare(ours, theirs, case, world)


def test_a_group_of_one_rank_completes_its_collectives_in_the_cpp_face_at_once():
    ran, handed = grid(1)[0]["calls"]
    assert backend.compiled() is not None and ran > 0 and handed == 0, (ran, handed)


def test_the_python_grid_runs_on_torchs_python_backend_route_without_the_cpp_face():
    assert all(found["calls"] == (None, None) for found in grid(2, "python"))


@pytest.mark.parametrize("world", (2, 3, 4))
def test_one_host_uses_the_slots_two_hosts_go_hierarchical_and_no_file_stays(world):
    results = grid(world)
    assert all(r["spans_hosts"] == (world == 4) for r in results)
    assert not results[0]["left in /dev/shm"], "a file outlived its group"


def reduce_roots_slots(ctx) -> dict:
    """{(root, numel): (whether the root's two slots still hold what it wrote there before its reduce, whether the
    sum is right)} on the root of a reduce of each of SIZES to each rank in turn (the short one in the C++ face,
    where it is built; the long one on the Python path)."""
    mine, n, found = backend.slots_of(), ctx.world_size, {}
    for root in range(n):
        for numel in SIZES:
            x = torch.full((numel,), float(ctx.rank + 1))
            dist.barrier()  # every read of the slots by an earlier call is done
            before = [mine.slot(ctx.rank, parity, torch.uint8, mine.slot_bytes).fill_(0xAB) for parity in (0, 1)]
            dist.reduce(x, root)
            if ctx.rank == root:
                found[root, numel] = (all(bool((slot == 0xAB).all()) for slot in before),
                                      torch.equal(x, torch.full((numel,), n * (n + 1) / 2)))
    return found


def test_a_reduce_root_that_sums_its_own_part_in_place_posts_nothing_and_a_later_one_posts_its_part():
    """Ranks 0 and 1 sum their own part where it is (no rank reads a root's slot then); rank 2 adds its part after
    its tensor is overwritten, from its slot."""
    for rank, found in enumerate(launch(reduce_roots_slots, 3, backend="dpkit", timeout_s=120,
                                        pg_timeout_s=PG_TIMEOUT_S)):
        for (root, numel), (untouched, right) in found.items():
            assert right, (root, numel)
            assert untouched == (root < 2), (root, numel)


# --------------------------------------------------------------------------- PyTorch's engines


def train_worker(ctx) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # older torch: the composable API's first home
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import DeviceMesh

    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("dpkit", dist.group.WORLD), ("gloo", gloo)):
        out[("ddp", name)] = steps(lambda m: torch.nn.parallel.DistributedDataParallel(m, process_group=group))
        out[("fsdp", name)] = steps(lambda m: (fully_shard(m, mesh=DeviceMesh.from_group(group, "cpu")), m)[1],
                                    gather=True)
        out[("zero", name)] = steps(lambda m: m, zero=lambda p: ZeroRedundancyOptimizer(
            p, torch.optim.AdamW, lr=1e-2, process_group=group))
    return out


def steps(wrap, zero=None, gather=False) -> list[torch.Tensor]:
    """Three steps of a small MLP on this rank's batch; the full parameters after each."""
    torch.manual_seed(0)
    model = wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)))
    optimizer = zero(model.parameters()) if zero else torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    seen = []
    for _ in range(3):
        loss = model(torch.randn(5, 8, generator=g)).square().mean()
        if zero:  # ZeRO shards the optimizer, not the gradients: sum them the way DDP would
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=optimizer.process_group)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        params = [p.full_tensor() if gather else p for p in model.parameters()]
        seen.append(torch.cat([p.detach().reshape(-1).clone() for p in params]))
    return seen


def two_rank_worker(ctx) -> tuple[dict, dict]:
    """The engines' training and the bad inputs, in one launch (a launch costs seconds)."""
    return train_worker(ctx), bad_input_worker(ctx)


@pytest.fixture(scope="module")
def two_ranks():
    before = shm_names()
    found = launch(two_rank_worker, 2, backend="dpkit", timeout_s=240, pg_timeout_s=PG_TIMEOUT_S)
    found[0][1]["left in /dev/shm"] = left_in_dev_shm(before)
    return found


@pytest.fixture(scope="module")
def trained(two_ranks):
    return [found[0] for found in two_ranks]


@pytest.mark.parametrize("engine", ("ddp", "fsdp", "zero"))
def test_pytorch_engines_train_bit_for_bit_as_on_gloo_at_two_ranks(trained, engine):
    for found in trained:
        for ours, theirs in zip(found[(engine, "dpkit")], found[(engine, "gloo")]):
            assert torch.equal(ours, theirs)  # two ranks: every sum is a + b, whoever adds
        assert not torch.equal(found[(engine, "dpkit")][0], found[(engine, "dpkit")][-1]), "the model did not train"


# --------------------------------------------------------------------------- bad inputs


def bad_input_worker(ctx) -> dict:
    out = {}
    rank = ctx.rank
    for name, x in (("size", torch.ones(4 + rank)), ("dtype", torch.ones(4, dtype=(torch.float32, torch.int32)[rank]))):
        group = dist.new_group(backend="dpkit")
        try:
            dist.all_reduce(x, group=group)
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
        out[f"{name} after"] = refusal(lambda: dist.all_reduce(torch.ones(3), group=group))
        dist.destroy_process_group(group)
    y = torch.ones(3)
    dist.all_reduce(y)
    out["after"] = y  # the other groups still work
    try:
        backend.check_cpu([torch.empty(2, device="meta")])
    except ValueError as error:
        out["device"] = str(error)
    out["cycles"] = create_and_destroy(100)
    out["overlap"] = overlapping_groups(rank)
    out["no room"] = without_room(rank)
    out["per device"] = per_device(rank)
    out["pid"] = os.getpid()
    return out


def refusal(call) -> str:
    """What ``call`` raised (type: message), or "no error"."""
    try:
        call()
    except Exception as error:  # noqa: BLE001  (the test names the type it expects)
        return f"{type(error).__name__}: {error}"
    return "no error"


def per_device(rank: int) -> tuple:
    """A group of "dpkit" for CPU tensors beside another backend for CUDA ones (gloo here: no GPU needed)."""
    group = dist.new_group(backend="cpu:dpkit,cuda:gloo")
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x, group=group)
    through_slots = backend.slots_of(group) is not None
    dist.destroy_process_group(group)
    return x, through_slots


def create_and_destroy(times: int) -> tuple:
    """(mappings, threads) before and after ``times`` groups made, used and destroyed."""
    def state():
        with open("/proc/self/maps") as f:
            maps = sum("/dev/shm/" in line or "memfd:" in line for line in f)  # the slots' file, unnamed
        return maps, len(os.listdir("/proc/self/task")), threading.active_count()
    def cycle():
        group = dist.new_group(backend="dpkit")
        x = torch.ones(2)
        dist.all_reduce(x, group=group)
        dist.destroy_process_group(group)
    cycle()  # the first group may start threads torch keeps for the process (a pool), not for the group
    before = state()
    for _ in range(times):
        cycle()
    return before, state()


def overlapping_groups(rank: int) -> list:
    a, b = dist.new_group(backend="dpkit"), dist.new_group(backend="dpkit")
    got = []
    for i in range(5):
        x, y = torch.full((3,), float(rank + i)), torch.full((3,), 10.0 * (rank + i))
        dist.all_reduce(x, group=a)
        dist.all_reduce(y, group=b)
        got.append((x[0].item(), y[0].item()))
    for g in (a, b):
        dist.destroy_process_group(g)
    return got


def without_room(rank: int) -> tuple:
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    with warnings.catch_warnings(record=True) as caught, mock.patch.object(slots.os, "posix_fallocate", full):
        warnings.simplefilter("always")
        group = dist.new_group(backend="dpkit")
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x, group=group)
    on_gloo = backend.slots_of(group) is None
    dist.destroy_process_group(group)
    return [str(w.message) for w in caught if "no room" in str(w.message)], x, on_gloo


@pytest.fixture(scope="module")
def bad(two_ranks):
    return [found[1] for found in two_ranks]


@pytest.mark.parametrize("what", ("size", "dtype"))
def test_ranks_that_disagree_all_raise_naming_both_and_the_group_refuses_every_later_call(bad, what):
    for found in bad:
        message = found[what]
        assert "rank 0:" in message and "rank 1:" in message, message
        sizes = ("16 bytes of torch.float32", "20 bytes of torch.float32")
        assert all(s in message for s in (sizes if what == "size" else ("torch.int32", "torch.float32"))), message
        later = found[f"{what} after"]
        assert later.startswith("BrokenGroupError") and "broken" in later and message in later, later
        assert torch.equal(found["after"], torch.full((3,), 2.0))


def test_a_tensor_not_on_the_cpu_is_refused_naming_its_device(bad):
    assert all("meta" in found["device"] and "CPU tensors" in found["device"] for found in bad)


def test_a_hundred_groups_made_and_destroyed_leave_no_mapping_or_thread(bad):
    for found in bad:
        before, after = found["cycles"]
        assert after == before, f"(mappings of slots files, OS threads, Python threads): {found['cycles']}"
    assert not bad[0]["left in /dev/shm"], "a file outlived its group"


def test_two_groups_on_the_same_ranks_do_not_talk_across(bad):
    for found in bad:
        assert found["overlap"] == [(2.0 * i + 1, 20.0 * i + 10) for i in range(5)]


def test_without_room_in_dev_shm_the_group_goes_through_gloo_warned_once(bad):
    warned, x, on_gloo = bad[0]["no room"]
    assert len(warned) == 1 and "gloo" in warned[0] and on_gloo
    assert bad[1]["no room"][0] == [] and torch.equal(x, torch.full((5,), 3.0))


def test_a_group_of_dpkit_for_the_cpu_beside_another_backend_for_cuda_sums_cpu_tensors_in_the_slots(bad):
    for found in bad:
        x, through_slots = found["per device"]
        assert torch.equal(x, torch.full((4,), 3.0)) and through_slots


def killed_worker(ctx) -> None:
    x = torch.ones(1 << 10)
    dist.all_reduce(x)  # the group works; then rank 1 dies before the next call
    if ctx.rank == 1:
        os._exit(0)  # gone without a word (status 0: the launcher waits for rank 0's error, the one checked)
    dist.all_reduce(x)


@pytest.mark.slow
def test_a_killed_rank_fails_the_others_naming_it_and_leaves_nothing_in_dev_shm():
    start, before = time.monotonic(), shm_names()
    with pytest.raises(WorkerError) as failure:
        launch(killed_worker, 2, backend="dpkit", timeout_s=120, pg_timeout_s=20)
    text = str(failure.value)
    assert "rank 0 of 2 failed" in text and "PeerFailedError" in text and "rank(s) [1]" in text, text
    assert time.monotonic() - start < 20 + 15, "rank 0 did not fail within the group's timeout"
    assert left_in_dev_shm(before, failure.value.pids) == []
