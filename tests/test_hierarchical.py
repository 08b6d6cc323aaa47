"""hosts.py and hierarchical.py on a simulated multi-host job: exact collectives, what "auto" picks, the
refusals, the intra-host fallback and the bytes each rank sends between hosts.

The default run spawns ONE world of 4 ranks as 2 hosts of 2 (``launch(..., hosts=(2, 2))``). Every rank
makes every group first, in one order; then the groups run one round after another: the world (2+2),
ranks 0-2 (2+1), ranks 1-3 (1+2: group ranks differ from global ones, and its members made different
numbers of groups before it), two groups of one rank per host, two groups of one host. The inputs are
reproducible (``test_transport.rank_input``): ranks return what they computed and the parent compares it
with the float64 sum of every rank's input, within the rounding of the dtype (``test_transport.oracle``).
6 ranks as 3 hosts of 2, 3 ranks as 2+1 and a torchrun job run with ``-m slow``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common import CollectiveCounter, CountingTransport, run_torchrun
from dpkit.comm import hosts, process_groups, shared_memory, transport
from dpkit.comm.hierarchical import Hierarchical, Plan
from test_transport import FLOATS, mismatch, oracle, rank_input

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
SIZES = (1, 7, 1001)  # elements per rank: fewer than the ranks, and counts no host or shard count divides
BYTES_NUMEL = 1200  # the byte-count case: divisible by every shard and host count used here
WORLD_4 = {"layout": (2, 2), "rounds": [[("2+2", None)], [("2+1", [0, 1, 2])], [("1+2", [1, 2, 3])],
                                        [("1+1 a", [0, 2]), ("1+1 b", [1, 3])],
                                        [("one host a", [0, 1]), ("one host b", [2, 3])]]}
WORLD_6 = {"layout": (2, 2, 2), "rounds": [[("2+2+2", None)], [("1+2+2", [1, 2, 3, 4, 5])]]}
WORLD_3 = {"layout": (2, 1), "rounds": [[("2+1 world", None)]]}
SPANNING = {"2+2", "2+1", "1+2", "2+2+2", "1+2+2", "2+1 world"}  # groups over hosts with two ranks on one
LIGHT = {"1+2", "1+2+2"}  # groups whose point is who is where, not the arithmetic: a few cases (``light``)


def cases() -> list[tuple]:
    """(kind, dtype, op, numel per rank, layout, async_op)."""
    out = []
    for kind in KINDS:
        ops = ("sum",) if kind == "all_gather" else ("sum", "avg")
        for dtype in FLOATS:
            for op in ops:
                for numel in SIZES:
                    out.append((kind, dtype, op, numel, "contiguous", False))
        out += [(kind, "int64", "sum", numel, "contiguous", False) for numel in SIZES]
        in_place = () if kind == "all_reduce" else ("in_place",)
        for layout in ("strided", *in_place):
            out.append((kind, "float32", ops[-1], 1001, layout, True))
    out.append(("all_reduce", "float16", "avg", 7, "near the top", False))  # the sum overflows, the mean not
    return out


def light() -> list[tuple]:
    """Every collective in float32 and int64, of a size smaller and one larger than the ranks, and in place."""
    return [case for case in cases() if case[1] in ("float32", "int64") and case[3] in (1, 1001)
            and case[4] in ("contiguous", "in_place")]


def grid_for(name: str) -> list[tuple]:
    return light() if name in LIGHT else cases()


def contribution(case: tuple, rank: int, n: int) -> torch.Tensor:
    """What group rank ``rank`` brings: a whole all-reduce tensor, a reduce-scatter input or an all-gather shard."""
    kind, dtype, _, numel, layout, _ = case
    if layout == "near the top":  # every rank 40000: n of them overflow float16 (65504), their mean does not
        return torch.full((numel,), 40000.0, dtype=torch.float16)
    return rank_input(numel * (n if kind == "reduce_scatter" else 1), rank, dtype)


# --------------------------------------------------------------------------- in the workers


def run_case(t: transport.Transport, group, case: tuple) -> dict:
    """One collective on this rank: its result, and whether it left the input and the neighbours alone."""
    kind, dtype, op, numel, layout, async_op = case
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    mine = contribution(case, rank, n)
    try:
        if kind == "all_reduce":
            result, intact = _all_reduce(t, mine, op, layout, async_op)
        elif kind == "reduce_scatter":
            result, intact = _reduce_scatter(t, mine, op, layout, async_op, rank, n)
        else:
            result, intact = _all_gather(t, mine, layout, async_op, rank, n)
    except Exception as error:  # noqa: BLE001 - asserted in the parent
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None, "result": result, "intact": intact}


def _finish(work, async_op: bool) -> bool:
    """Wait on an asynchronous call's handle; True when the handle then says it completed (or there was none)."""
    if not async_op:
        return work is None
    return work.wait() and work.is_completed()


def _all_reduce(t, mine, op, layout, async_op):
    if layout == "strided":  # every other element of a buffer: the others must not move
        buffer = torch.full((2 * mine.numel(),), -7, dtype=mine.dtype)
        x = buffer[::2]
        x.copy_(mine)
        done = _finish(t.all_reduce(x, op, async_op=async_op), async_op)
        return x.clone(), done and bool((buffer[1::2] == -7).all())
    x = mine.clone()
    done = _finish(t.all_reduce(x, op, async_op=async_op), async_op)
    return x, done


def _reduce_scatter(t, mine, op, layout, async_op, rank, n):
    m = mine.numel() // n
    if layout == "in_place":  # the output is the input's own chunk
        full = mine.clone()
        out = full[rank * m:(rank + 1) * m]
        done = _finish(t.reduce_scatter(out, full, op, async_op=async_op), async_op)
        return out.clone(), done
    source = mine.clone()
    if layout == "strided":
        buffer = torch.full((2 * m,), -7, dtype=mine.dtype)
        out = buffer[::2]
        done = _finish(t.reduce_scatter(out, source, op, async_op=async_op), async_op)
        return out.clone(), done and bool((buffer[1::2] == -7).all()) and torch.equal(source, mine)
    out = torch.empty(m, dtype=mine.dtype)
    done = _finish(t.reduce_scatter(out, source, op, async_op=async_op), async_op)
    return out, done and torch.equal(source, mine)


def _all_gather(t, mine, layout, async_op, rank, n):
    m = mine.numel()
    if layout == "in_place":  # the input is the output's own chunk
        out = torch.empty(n * m, dtype=mine.dtype)
        out[rank * m:(rank + 1) * m] = mine
        done = _finish(t.all_gather(out, out[rank * m:(rank + 1) * m], async_op=async_op), async_op)
        return out, done
    source = mine.clone()
    if layout == "strided":
        buffer = torch.full((2 * n * m,), -7, dtype=mine.dtype)
        out = buffer[::2]
        done = _finish(t.all_gather(out, source, async_op=async_op), async_op)
        return out.clone(), done and bool((buffer[1::2] == -7).all()) and torch.equal(source, mine)
    out = torch.empty(n * m, dtype=mine.dtype)
    done = _finish(t.all_gather(out, source, async_op=async_op), async_op)
    return out, done and torch.equal(source, mine)


def picks(group) -> dict:
    """What resolve makes for "auto" (and by name) on this group, and SharedMemory's verdict."""
    out = {"auto": transport.resolve("auto", group).describe(),
           "auto type": type(transport.resolve("auto", group)).__name__,
           "hosts": hosts.host_indices(group)}
    try:
        transport.SharedMemory(group).close()
        out["shared_memory"] = None
    except ValueError as error:
        out["shared_memory"] = (type(error).__name__, str(error))
    try:
        transport.resolve("hierarchical", group, "cuda")
        out["hierarchical for cuda"] = None
    except ValueError as error:
        out["hierarchical for cuda"] = str(error)
    return out


def grid(group, name: str) -> dict:
    """The group's cases through "hierarchical" (by name) on a group that spans hosts."""
    t = transport.resolve("hierarchical", group)
    return {"describe": t.describe(), "cases": {case: run_case(t, group, case) for case in grid_for(name)}}


def bad_layouts(fresh: list) -> dict:
    """host_indices on fresh groups of the world, each rank seeing ``DPKIT_HOSTS`` as the case says."""
    rank = dist.get_rank()
    layouts = {"too many ranks": "2,3", "not numbers": "2,x", "an empty host": "2,0,2",
               "rank 3 sees another": "1,3" if rank == 3 else "2,2"}
    out = {}
    saved = os.environ[hosts.HOSTS_ENV]
    for (case, text), group in zip(layouts.items(), fresh):
        os.environ[hosts.HOSTS_ENV] = text
        try:
            out[case] = ("no error", hosts.host_indices(group))
        except ValueError as error:
            out[case] = (type(error).__name__, str(error))
        finally:
            os.environ[hosts.HOSTS_ENV] = saved
    return out


def blind_rank_1() -> contextlib.AbstractContextManager:
    """On global rank 1, the shared-memory files the others made cannot be opened (as on another machine: they are
    reached through the maker's /proc/<pid>/fd)."""
    real_open = os.open

    def blind(path, flags, *args, **kwargs):
        if str(path).startswith("/proc/") and "/fd/" in str(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return real_open(path, flags, *args, **kwargs)
    return mock.patch.object(shared_memory.os, "open", blind) if dist.get_rank() == 1 else contextlib.nullcontext()


def fallback() -> dict:
    """Host 0's ranks cannot map one shared file: that host computes through torch; exact all the same."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with blind_rank_1():
            t = Hierarchical()
    out = {"warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
           "describe": t.describe(), "inner": type(t.inner).__name__,
           "cases": {case: run_case(t, dist.group.WORLD, case) for case in light()}}
    t.close()
    return out


def sent_between_hosts() -> dict:
    """Bytes each rank sends between hosts, counted two ways: the real messages of the ring ("p2p:ring" as the
    outer transport; the shared memory inside a host sends none), and what a counting outer transport is asked
    to move."""
    rank, n, out = dist.get_rank(), dist.get_world_size(), {}
    ring = Hierarchical(outer=transport.factory("p2p:ring"))
    m = BYTES_NUMEL // n
    for kind, call in (("all_reduce", lambda: ring.all_reduce(rank_input(BYTES_NUMEL, rank, "float32"))),
                       ("reduce_scatter", lambda: ring.reduce_scatter(torch.empty(m), rank_input(BYTES_NUMEL, rank,
                                                                                                   "float32"))),
                       ("all_gather", lambda: ring.all_gather(torch.empty(BYTES_NUMEL), rank_input(m, rank,
                                                                                                 "float32")))):
        with CollectiveCounter() as counter:
            call()
        out[kind] = {"sent": counter.sent_bytes, "calls": dict(counter.calls)}
    out["slots"] = [j for j, _ in ring.outer]
    ring.close()
    counting: list[CountingTransport] = []

    def counted(group) -> CountingTransport:
        counting.append(CountingTransport("torch", group))
        return counting[-1]
    asked = Hierarchical(outer=counted)
    asked.all_reduce(rank_input(BYTES_NUMEL, rank, "float32"))
    out["asked"] = [dict(c.bytes) for c in counting]
    asked.close()
    return out


def closing() -> dict:
    """What close lets go of, and what a closed transport says when called."""
    t = Hierarchical()
    inner, outer = t.inner, [o for _, o in t.outer]
    groups = list(t.subgroups)
    t.close()
    try:
        t.all_reduce(torch.ones(3))
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"subgroups": len(groups), "left": len(t.subgroups), "inner closed": inner._closed,
            "outer closed": all(o._closed for o in outer), "error": error}


def _job(ctx, spec: dict) -> dict:
    """Every group of ``spec``'s rounds made first (every rank, one order), then each round run by its members."""
    made = {name: dist.new_group(ranks) if ranks is not None else dist.group.WORLD
            for round_ in spec["rounds"] for name, ranks in round_}
    fresh = [dist.new_group(list(range(ctx.world_size))) for _ in range(4)]
    out = {"env": os.environ.get(hosts.HOSTS_ENV), "groups": {}, "counts": {}}
    for round_ in spec["rounds"]:
        for name, ranks in round_:
            if ranks is None or ctx.rank in ranks:
                out["counts"][name] = c10d._world.group_count  # before the group's own subgroups are made
                got = picks(made[name])
                if name in SPANNING:
                    got.update(grid(made[name], name))
                out["groups"][name] = got
    out.update(bad_layouts=bad_layouts(fresh), fallback=fallback(), sent=sent_between_hosts(), closing=closing())
    return out


def launch_job(spec: dict) -> list[dict]:
    return process_groups.launch(_job, sum(spec["layout"]), spec, hosts=spec["layout"], timeout_s=300.0,
                                 pg_timeout_s=30.0)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return launch_job(WORLD_4)


# --------------------------------------------------------------------------- in the parent: the checks


def group_results(world: list[dict], name: str) -> list[dict]:
    """Each member's results for group ``name``, in group-rank order (members are in global-rank order)."""
    return [out["groups"][name] for out in world if name in out["groups"]]


def wrong(per_rank: list[dict], grid_cases: list[tuple]) -> list[str]:
    """Every case of ``grid_cases`` whose result on some rank is not the exact one (within the dtype's rounding)."""
    n, found = len(per_rank), []
    for case in grid_cases:
        kind, dtype, op, numel = case[:4]
        inputs = [contribution(case, r, n) for r in range(n)]
        for rank, got in enumerate(outcome["cases"][case] for outcome in per_rank):
            if got["error"] or not got["intact"]:
                found.append(f"rank {rank} {case}: {got['error'] or 'input, neighbours or handle wrong'}")
                continue
            if kind == "all_gather":
                problem = None if torch.equal(got["result"], torch.cat(inputs)) else "not every rank's input"
            else:
                want, bound = oracle(inputs, op, dtype)
                if kind == "reduce_scatter":
                    want, bound = want[rank * numel:(rank + 1) * numel], bound[rank * numel:(rank + 1) * numel]
                problem = mismatch(got["result"], want, bound)
            if problem:
                found.append(f"rank {rank} {case}: {problem}")
    return found


def shown(found: list[str]) -> str:
    return f"{len(found)} failing, e.g.:\n" + "\n".join(found[:8])


def test_the_launcher_sets_the_layout_for_every_worker(four):
    assert [out["env"] for out in four] == ["2,2"] * 4


@pytest.mark.parametrize("name", ["2+2", "2+1", "1+2"])
def test_every_collective_is_exact_for_every_dtype_op_size_and_layout(four, name):
    """The world, and subgroups of 2+1 and 1+2 ranks (a rank of the smaller host serves both shards)."""
    per_rank = group_results(four, name)
    assert set(per_rank[0]["cases"]) == set(grid_for(name))
    found = wrong(per_rank, grid_for(name))
    assert not found, shown(found)


@pytest.mark.parametrize("name", ["2+2", "2+1", "1+2"])
def test_every_rank_of_an_all_reduce_holds_the_same_bits(four, name):
    per_rank = group_results(four, name)
    for case in grid_for(name):
        if case[0] == "all_reduce":
            results = [out["cases"][case]["result"] for out in per_rank]
            assert all(torch.equal(results[0], r) for r in results), case


def test_the_members_of_a_subgroup_made_different_numbers_of_groups_before_it(four):
    """Precondition of the 1+2 group's exactness: torch would name its subgroups differently on its members
    (their counts of groups made differ), unless ``new_subgroups`` aligns them."""
    counts = [out["counts"]["1+2"] for out in four[1:]]
    assert len(set(counts)) > 1, counts


AUTO = {"2+2": ("Hierarchical", (0, 0, 1, 1)), "2+1": ("Hierarchical", (0, 0, 1)),
        "1+2": ("Hierarchical", (0, 1, 1)), "1+1 a": ("Torch", (0, 1)), "1+1 b": ("Torch", (0, 1)),
        "one host a": ("SharedMemory", (0, 0)), "one host b": ("SharedMemory", (0, 0))}


@pytest.mark.parametrize("name", list(AUTO))
def test_auto_picks_hierarchical_across_hosts_torch_for_one_rank_per_host_and_shared_memory_on_one(four, name):
    kind, layout = AUTO[name]
    for out in group_results(four, name):
        assert (out["auto type"], out["hosts"]) == (kind, layout)
    if kind == "Hierarchical":
        sizes = "+".join(str(layout.count(h)) for h in sorted(set(layout)))
        assert group_results(four, name)[0]["auto"] == (f"hierarchical ({sizes} ranks on 2 hosts; inside: "
                                                        "shared_memory; between: torch (gloo))")


@pytest.mark.parametrize("name", list(AUTO))
def test_hierarchical_refuses_gpu_tensors_on_every_rank(four, name):
    for out in group_results(four, name):
        assert out["hierarchical for cuda"] == ("this engine: transport 'hierarchical' takes CPU tensors, not cuda "
                                                "ones: use 'torch' (NCCL) or 'auto'")


def test_an_outer_transport_that_is_not_a_factory_or_a_known_name_is_refused_before_any_message():
    for outer in (3, "p2p:ring", object.__new__(transport.Torch)):
        with pytest.raises(TypeError, match="Hierarchical's outer must be a factory"):
            Hierarchical(outer=outer)
    with pytest.raises(ValueError, match="Hierarchical: unknown outer transport 'fastest': choose one of auto, "):
        transport.factory("fastest")


@pytest.mark.parametrize("name", list(AUTO))
def test_shared_memory_over_simulated_hosts_raises_not_one_host_on_every_rank(four, name):
    """As over real hosts, so that "auto" would fall back the same way; on one host it serves."""
    verdicts = [out["shared_memory"] for out in group_results(four, name)]
    if AUTO[name][0] == "SharedMemory":
        assert verdicts == [None, None]
        return
    for verdict in verdicts:
        assert verdict is not None and verdict[0] == "NotOneHost", verdict
        assert verdict[1].startswith("transport 'shared_memory' needs every rank of the group on this host: ranks ")
        assert "are on 2 hosts (simulated: DPKIT_HOSTS=2,2)" in verdict[1], verdict[1]
    assert len(set(verdicts)) == 1, verdicts


BAD = {"too many ranks": "DPKIT_HOSTS=2,3 places 5 ranks on 2 hosts, but the world has 4 ranks: the ranks per "
                         "host must add up to the world size",
       "not numbers": "DPKIT_HOSTS='2,x' is not a host layout: give the number of ranks on each host",
       "an empty host": "DPKIT_HOSTS='2,0,2' is not a host layout",
       "rank 3 sees another": "the ranks were given different DPKIT_HOSTS (rank 0: '2,2', rank 1: '2,2', "
                              "rank 2: '2,2', rank 3: '1,3'): every rank of a job must see the same layout"}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_layout_raises_the_same_value_error_on_every_rank(four, case):
    verdicts = [out["bad_layouts"][case] for out in four]
    assert verdicts[0][0] == "ValueError" and verdicts[0][1].startswith(BAD[case]), verdicts[0]
    assert verdicts == [verdicts[0]] * 4


def test_the_launcher_refuses_a_layout_that_does_not_fit_before_starting_a_worker():
    with pytest.raises(ValueError, match="DPKIT_HOSTS=2,3 places 5 ranks on 2 hosts, but the world has 4 ranks"):
        process_groups.launch(_job, 4, WORLD_4, hosts=(2, 3))
    with pytest.raises(TypeError, match="hosts must be a sequence of ranks per host"):
        process_groups.launch(_job, 4, WORLD_4, hosts="2,2")


def test_a_host_whose_ranks_cannot_share_a_file_goes_through_torch_inside_warned_once(four):
    """Rank 1 cannot open the files rank 0 made: host 0 computes through torch, host 1 through shared
    memory; group rank 0 warns once, every rank says the same in describe, the results are exact."""
    got = [out["fallback"] for out in four]
    assert [g["inner"] for g in got] == ["Torch", "Torch", "SharedMemory", "SharedMemory"]
    assert [len(g["warnings"]) for g in got] == [1, 0, 0, 0]
    assert "inside hosts [0]: their ranks cannot map one shared file" in got[0]["warnings"][0]
    assert {g["describe"] for g in got} == {"hierarchical (2+2 ranks on 2 hosts; inside: shared_memory, hosts [0] "
                                            "through torch; between: torch (gloo))"}
    for rank, g in enumerate(got):
        for case, outcome in g["cases"].items():
            assert outcome["error"] is None and outcome["intact"], (rank, case, outcome)
    found = wrong(got, list(got[0]["cases"]))
    assert not found, shown(found)


def ring_sends(numel: int, members: int) -> list[int]:
    """Elements each member of a ring all-reduce of ``numel`` sends: chunks r, r-1, ... in the reduce-scatter,
    r+1, r, ... in the all-gather (``allreduce._ring_ticks``); 2 (H - 1) / H of ``numel`` when H divides it."""
    chunks = [numel // members + (i < numel % members) for i in range(members)]
    return [sum(chunks[(r - s) % members] + chunks[(r + 1 - s) % members] for s in range(members - 1))
            for r in range(members)]


def check_bytes(world: list[dict], hosts_count: int, ranks_per_host: int) -> None:
    shard = BYTES_NUMEL // ranks_per_host  # elements of one shard: every rank serves exactly one
    m = BYTES_NUMEL // len(world)
    for rank, out in enumerate(world):
        sent = out["sent"]
        assert sent["slots"] == [rank % ranks_per_host]  # hosts of equal size: one shard per rank
        assert sent["all_reduce"]["sent"] == 4 * ring_sends(shard, hosts_count)[rank // ranks_per_host]
        assert sent["all_reduce"]["sent"] * hosts_count == 4 * 2 * (hosts_count - 1) * shard
        assert sent["reduce_scatter"]["sent"] == sent["all_gather"]["sent"] == 4 * (hosts_count - 1) * m
        assert not {k for k in sent["all_reduce"]["calls"] if k not in ("isend", "irecv", "batch_isend_irecv")}
        assert out["sent"]["asked"] == [{"all_reduce": 4 * shard}]


def test_each_rank_sends_hosts_minus_one_over_hosts_of_its_shard_twice_between_hosts(four):
    """2 hosts of 2, 1200 float32 elements: each rank serves one shard of 600 and sends 2 (2-1)/2 of it through
    the ring between hosts, nothing else; a reduce-scatter or all-gather sends (H-1) of the 300-element chunks."""
    check_bytes(four, hosts_count=2, ranks_per_host=2)


def test_close_destroys_the_subgroups_and_closes_the_inner_and_outer_transports(four):
    for out in four:
        got = out["closing"]
        assert got["subgroups"] == 2 and got["left"] == 0  # its host's group and its shard's
        assert got["inner closed"] and got["outer closed"]
        assert got["error"].endswith("is closed")


# --------------------------------------------------------------------------- the plan, without processes


@pytest.mark.parametrize("layout", [(2, 2), (2, 1), (1, 2), (3, 2), (2, 3, 1), (4, 3), (1, 1, 1), (3,)])
def test_the_plan_serves_every_slot_on_every_host_and_puts_every_chunk_in_one_row(layout):
    members = [list(range(sum(layout[:h]), sum(layout[:h + 1]))) for h in range(len(layout))]
    plan = Plan(members, list(range(sum(layout))))
    assert plan.slots == max(layout)
    for h, ranks in enumerate(members):
        served = [list(plan.served(h, i)) for i in range(len(ranks))]
        assert sum(served, []) == list(range(plan.slots)), served  # each slot once, in order
        assert all(1 <= len(s) <= plan.width(h) for s in served)
        rows = plan.rows(h)
        assert len(set(rows)) == len(rows) and max(rows) < len(ranks) * plan.width(h) * len(layout)
    for j in range(plan.slots):
        assert sorted(plan.host_of[r] for r in plan.outer(j)) == list(range(len(layout)))


def test_a_host_layout_is_parsed_and_checked():
    assert hosts.parse_layout("2,1") == (2, 1)
    assert hosts.layout_value((3, 2, 1), 6) == "3,2,1"
    assert hosts.number_hosts([("2,1", "a")] * 3, [0, 1, 2], 3) == (0, 0, 1)
    assert hosts.number_hosts([(None, "a"), (None, "b"), (None, "a")], [0, 1, 2], 3) == (0, 1, 0)
    # Simulated hosts subdivide real ones: ranks 0 and 1 share no host when their machines differ.
    assert hosts.number_hosts([("2,1", "a"), ("2,1", "b"), ("2,1", "b")], [0, 1, 2], 3) == (0, 1, 2)
    for bad in ("", "2,", "-1,3", "two"):
        with pytest.raises(ValueError, match="is not a host layout"):
            hosts.parse_layout(bad)


# --------------------------------------------------------------------------- bigger layouts (-m slow)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [WORLD_6, WORLD_3], ids=["3 hosts of 2", "2+1"])
def test_bigger_and_uneven_worlds_are_exact(spec):
    world = launch_job(spec)
    for round_ in spec["rounds"]:
        for name, _ in round_:
            found = wrong(group_results(world, name), grid_for(name))
            assert not found, f"{name}: " + shown(found)
    if spec is WORLD_6:
        check_bytes(world, hosts_count=3, ranks_per_host=2)


@pytest.mark.slow
def test_torchrun_honours_the_layout_in_the_environment():
    """``DPKIT_HOSTS=2,2 torchrun ...``: the probe prints each rank's host and what "auto" made."""
    result = run_torchrun("tests/hosts_probe.py", 4, env={hosts.HOSTS_ENV: "2,2"})
    lines = sorted(re.findall(r"rank \d: .*?, all-reduce (?:exact|WRONG)", result.stdout))
    assert lines == [f"rank {r}: host {r // 2} of (0, 0, 1, 1), auto = hierarchical (2+2 ranks on 2 hosts; "
                     "inside: shared_memory; between: torch (gloo)), all-reduce exact" for r in range(4)], result.stdout
