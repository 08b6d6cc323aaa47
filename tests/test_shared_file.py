"""shared_file: one rank makes an anonymous file in /dev/shm, its peers map it only after checking it; and
what ``Slots`` (the "dpkit" backend's) and the ``SharedMemory`` transport build on it.

* A peer maps the maker's file, and only that: a named file, another mode or size, something that is not a
  file, a recycled pid, another PID namespace, or a path as the store used to hold is refused, saying why,
  and nothing is deleted. Checked in this process, then through a store that holds a forged descriptor.
* A rank killed (SIGKILL, or SIGTERM as torchrun sends) at set-up, before it maps while its peer waits,
  leaves nothing in /dev/shm.
* A peer dead before the first call is named within seconds, by Slots and by the transport, not at the
  timeout.
* Broken means broken: after a caught failure every later Slots call raises at once on every rank, naming
  the first failure, and no call pairs with another rank's call of another step, whether Python or C++ sums.
* An output is copied into past the caches (C++'s ``stream_copy``) once the ranks' outputs together fill half the
  last-level cache, and from ``STREAMED_BYTES`` whatever the cache; a shorter one with ``Tensor.copy_``; both exact.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import subprocess
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dpkit.comm import shared_file, slots
from dpkit.comm.process_groups import PeerFailedError, WorkerError, launch, start_time
from common import left_in_dev_shm
from dpkit.comm.shared_file import SHM_DIRECTORY, Refused
from dpkit.comm.shared_memory import SharedMemory
from dpkit.comm.slots import Slots

NBYTES = 1 << 16
SHORT_S = 1.0  # the Slots timeout of the cases where a peer comes late
AT_ONCE_S = 0.5  # a call that must not wait: it raises in milliseconds, this allows for a loaded machine


# --------------------------------------------------------------------------- in this process


def mapped(fd: int, nbytes: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def test_a_peer_maps_the_makers_file_which_has_no_name_anywhere():
    before = set(os.listdir(SHM_DIRECTORY))
    fd = shared_file.make(NBYTES, allocate=True)
    words = shared_file.from_text(shared_file.to_text(shared_file.describe(fd)))
    theirs = mapped(shared_file.attach(words, NBYTES), NBYTES)
    mine = mapped(fd, NBYTES)
    mine[:5] = b"hello"
    assert theirs[:5] == b"hello"
    assert left_in_dev_shm(before) == []
    mine.close()
    theirs.close()


def named_file(path: str, nbytes: int) -> int:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, nbytes)
    return fd


def forged(case: str, directory: str, nbytes: int = NBYTES) -> tuple[str, list[int]]:
    """(the text a forged store would hold, descriptors to close afterwards) for a file that is not a maker's
    anonymous file of ``nbytes`` (in this process), or is but says it is another process's."""
    pid, started, namespace = os.getpid(), start_time(os.getpid()), shared_file.pid_namespace()
    if case == "a path, as the store held before":
        os.close(named_file(os.path.join(directory, "victim"), nbytes))
        return os.path.join(directory, "victim"), []
    if case == "a named file":
        fd = named_file(os.path.join(directory, "victim"), nbytes)
    elif case == "a pipe":
        fd, other = os.pipe()
        return shared_file.to_text((pid, started, namespace, fd)), [fd, other]
    else:
        fd = shared_file.make(nbytes * 2 if case == "another size" else nbytes)
        if case == "another mode":
            os.fchmod(fd, 0o644)
    if case == "a recycled pid":
        started += 1
    if case == "another PID namespace":
        namespace += 1
    return shared_file.to_text((pid, started, namespace, fd)), [fd]


FORGERIES = {"a named file": "name(s) point at it", "another mode": "mode 644 lets others in",
             "another size": f"{2 * NBYTES} bytes where {NBYTES} were expected", "a pipe": "not a regular file",
             "a recycled pid": "its pid was reused", "another PID namespace": "different PID namespaces",
             "a path, as the store held before": "does not describe a shared file"}


@pytest.mark.parametrize("case", FORGERIES)
def test_a_forged_descriptor_is_refused_saying_why_and_nothing_is_deleted(case, tmp_path):
    text, fds = forged(case, str(tmp_path))
    try:
        with pytest.raises(Refused, match=FORGERIES[case].replace("(", r"\(").replace(")", r"\)")):
            shared_file.attach(shared_file.from_text(text), NBYTES)
    finally:
        for fd in fds:
            os.close(fd)
    assert os.listdir(tmp_path) == (["victim"] if "path" in case or "named" in case else [])


def test_the_file_of_a_process_that_is_gone_is_refused():
    child = subprocess.Popen(["sleep", "0"])
    words = (child.pid, start_time(child.pid) or 1, shared_file.pid_namespace(), 3)
    child.wait()
    with pytest.raises(Refused, match="is gone"):
        shared_file.attach(words, NBYTES)


# --------------------------------------------------------------------------- a rank killed at set-up


def default_store():
    return c10d._get_default_store()


def killed_at_set_up(ctx, user: str, stage: str, victim: int, signum: int) -> None:
    """Rank ``victim`` kills itself with ``signum`` at ``stage`` of the set-up: "made" (it has just sized a file of
    its own making), "mapping" (it is about to map one); its peer is then waiting for it, until the launcher
    stops it too (SIGTERM)."""
    def die(*args, **kwargs):
        os.kill(os.getpid(), signum)
        time.sleep(60)

    def made(real):
        return lambda *args, **kwargs: (real(*args, **kwargs), die())
    hooks = {"made": [(os, "ftruncate", made(os.ftruncate)), (os, "posix_fallocate", made(os.posix_fallocate))],
             "mapping": [(mmap, "mmap", die)]}[stage] if ctx.rank == victim else []
    with contextlib.ExitStack() as stack:
        for module, name, hook in hooks:
            stack.enter_context(mock.patch.object(module, name, hook))
        if user == "slots":
            Slots.open(dist.PrefixStore("killed", default_store()), ctx.rank, 2, 30.0)
        else:
            SharedMemory()
    time.sleep(60)  # the survivor: set-up went through here; wait to be stopped with the victim


# (user, stage, victim): rank 0 makes the slots file, rank 1 maps it; each rank makes its transport arena.
STAGES = (("slots", "made", 0), ("slots", "mapping", 1), ("transport", "made", 0), ("transport", "made", 1))
SIGNALS = (signal.SIGKILL, signal.SIGTERM)
# Each stage by default with one signal, each signal twice (a launch takes seconds); the other half with -m slow.
KILLS = [pytest.param(*stage, signum, id=f"{stage[0]}-{stage[1]}-rank{stage[2]}-{signal.Signals(signum).name}",
                      marks=[] if (i + j) % 2 == 0 else [pytest.mark.slow])
         for i, stage in enumerate(STAGES) for j, signum in enumerate(SIGNALS)]


@pytest.mark.parametrize("user, stage, victim, signum", KILLS)
def test_a_rank_killed_at_set_up_leaves_nothing_in_dev_shm(user, stage, victim, signum):
    before = set(os.listdir(SHM_DIRECTORY))
    with pytest.raises(WorkerError) as failure:
        launch(killed_at_set_up, 2, user, stage, victim, signum, timeout_s=60, pg_timeout_s=30)
    assert f"rank {victim} of 2 failed" in str(failure.value) and f"exit code {-signum}" in str(failure.value)
    assert left_in_dev_shm(before, failure.value.pids) == []


# --------------------------------------------------------------------------- a forged store


class ForgingStore:
    """A store in which someone replaced what rank 0 published with ``text`` (for whoever reads it)."""

    def __init__(self, store, text: str):
        self.store, self.text = store, text

    def set(self, key, value):
        self.store.set(key, value)

    def wait(self, keys, timeout):
        self.store.wait(keys, timeout)

    def get(self, key):
        return self.text.encode() if key == slots.FILE_KEY else self.store.get(key)


def slots_from_a_forged_store(ctx, directory: str) -> dict:
    """For each forgery (made by rank 1), both ranks open slots through a store in which the words rank 0 published
    were replaced; then through an honest store, which works."""
    nbytes = slots.file_bytes(2)
    out = {}
    for case in FORGERIES:
        folder = os.path.join(directory, str(len(out)))
        os.makedirs(folder, exist_ok=True)
        text, fds = forged(case, folder, nbytes) if ctx.rank == 1 else ("", [])
        shared = [text]
        dist.broadcast_object_list(shared, src=1)
        store = ForgingStore(dist.PrefixStore(f"forged/{len(out)}", default_store()), shared[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opened = Slots.open(store, ctx.rank, 2, 30.0)
        for fd in fds:
            os.close(fd)
        out[case] = {"opened": opened is not None, "warnings": [str(w.message) for w in caught]}
        dist.barrier()
    honest = Slots.open(dist.PrefixStore("honest", default_store()), ctx.rank, 2, 30.0)
    x = torch.full((3,), ctx.rank + 1.0)
    honest.all_reduce(x)
    out["honest"] = x
    return out


def test_a_store_holding_a_forged_descriptor_gives_no_slots_on_every_rank_saying_why(tmp_path):
    found = launch(slots_from_a_forged_store, 2, str(tmp_path), timeout_s=120, pg_timeout_s=30)
    for case, why in FORGERIES.items():
        why = why.replace(str(NBYTES), str(slots.file_bytes(2))).replace(str(2 * NBYTES), str(2 * slots.file_bytes(2)))
        for rank in (0, 1):
            assert not found[rank][case]["opened"], (rank, case)
        warned = found[0][case]["warnings"]
        assert len(warned) == 1 and "rank 1:" in warned[0] and why in warned[0], (case, warned)
        assert found[1][case]["warnings"] == []
    victims = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("victim"))
    index = {case: str(i) for i, case in enumerate(FORGERIES)}
    assert victims == sorted(f"{index[c]}/victim" for c in ("a named file", "a path, as the store held before"))
    assert all(torch.equal(found[r]["honest"], torch.full((3,), 3.0)) for r in (0, 1))


# --------------------------------------------------------------------------- a peer dead before the first call


def dead_before_the_first_call(ctx, found_at: str) -> None:
    """Rank 1 sets up slots and the transport, then exits; rank 0 calls each, with a long timeout."""
    pair = Slots.open(dist.PrefixStore("dead", default_store()), ctx.rank, 2, 30.0)
    transport = SharedMemory()
    if ctx.rank == 1:
        os._exit(0)
    time.sleep(1.0)  # rank 1 is gone before rank 0's first look
    found = {}
    for name, call in (("slots", lambda: pair.all_reduce(torch.ones(4))),
                       ("transport", lambda: transport.all_reduce(torch.ones(4)))):
        start = time.monotonic()
        try:
            call()
            found[name] = None
        except PeerFailedError as error:
            found[name] = (str(error), time.monotonic() - start)
    torch.save(found, found_at)
    raise PeerFailedError("rank 1 is gone, as it should be")


def test_a_peer_dead_before_the_first_call_is_named_within_seconds_not_at_the_timeout(tmp_path):
    with pytest.raises(WorkerError):
        launch(dead_before_the_first_call, 2, str(tmp_path / "found"), timeout_s=120, pg_timeout_s=30)
    found = torch.load(tmp_path / "found")
    for name in ("slots", "transport"):
        assert found[name] is not None, name
        message, seconds = found[name]
        assert "rank(s) [1] did not reach the shared-memory collective: their process is gone" in message, message
        assert seconds < 3.0, (name, seconds)


# --------------------------------------------------------------------------- broken means broken


def attempt(call) -> tuple[str | None, float]:
    """(the error ``call()`` raised, as "Type: message", or None; the seconds it took)."""
    start = time.monotonic()
    try:
        call()
        return None, time.monotonic() - start
    except (PeerFailedError, ValueError) as error:
        return f"{type(error).__name__}: {error}", time.monotonic() - start


def broken_after_a_caught_failure(ctx, path: str) -> dict:
    """Three pairs of slots, each broken once, and called again after the failure was caught, their all-reduces
    summed in Python or, ``path`` "c++", in C++ (``slots.native_sums``, which leaves what it cannot finish to
    Python):
    * "late": rank 1 comes after rank 0's short timeout;
    * "break_group": rank 0 says a call failed elsewhere;
    * "mismatch": the ranks pass tensors of different sizes;
    and one pair not broken: rank 1 comes late, within the timeout ("late within the timeout")."""
    rank, sums = ctx.rank, slots.native_sums() if path == "c++" else None
    out = {"summed in C++": sums is not None}
    late = Slots.open(dist.PrefixStore("late", default_store()), rank, 2, SHORT_S, sums=sums)
    if rank == 1:
        time.sleep(SHORT_S * 2.5)
    x = torch.full((4,), rank + 1.0)
    first = attempt(lambda: late.all_reduce(x))
    y = torch.full((4,), 10.0 * (rank + 1))
    out["late"] = {"first": first, "second": attempt(lambda: late.all_reduce(y)), "x": x, "y": y,
                   "third": attempt(late.barrier)}
    dist.barrier()

    told = Slots.open(dist.PrefixStore("told", default_store()), rank, 2, 30.0, sums=sums)
    told.all_reduce(torch.ones(2))
    if rank == 0:
        told.break_group("RuntimeError: gloo's all_gather failed")
    dist.barrier()
    out["break_group"] = {"first": attempt(lambda: told.all_reduce(torch.ones(2))),
                          "second": attempt(lambda: told.broadcast(torch.ones(2), 0))}
    dist.barrier()

    differ = Slots.open(dist.PrefixStore("differ", default_store()), rank, 2, 30.0, sums=sums)
    out["mismatch"] = {"first": attempt(lambda: differ.all_reduce(torch.ones(4 + rank))),
                       "second": attempt(lambda: differ.all_reduce(torch.ones(4)))}
    dist.barrier()

    handed = Slots.open(dist.PrefixStore("handed", default_store()), rank, 2, 30.0, sums=sums)
    if rank == 1:
        time.sleep(0.3)  # past C++'s wait, within the timeout: rank 0's posted call is finished in Python
    x, y = torch.full((4,), rank + 1.0), torch.full((4,), 10.0 * (rank + 1))
    handed.all_reduce(x)
    handed.all_reduce(y)
    out["late within the timeout"] = [x, y]
    return out


@pytest.fixture(scope="module", params=["python", "c++"])
def broken(request):
    found = launch(broken_after_a_caught_failure, 2, request.param, timeout_s=120, pg_timeout_s=30)
    assert all(rank["summed in C++"] == (request.param == "c++") for rank in found)
    return found


def test_after_a_peer_came_late_every_later_call_raises_at_once_on_both_ranks_and_none_pairs_across(broken):
    first, took = broken[0]["late"]["first"]
    assert first.startswith("PeerFailedError") and "rank(s) [1] did not reach" in first, first
    assert SHORT_S <= took < SHORT_S + 2, took
    first, took = broken[1]["late"]["first"]
    assert first.startswith("PeerFailedError") and "rank 0 broke off (timeout)" in first, first
    assert took < AT_ONCE_S, took
    for rank in (0, 1):
        got = broken[rank]["late"]
        for later in ("second", "third"):
            error, took = got[later]
            assert error is not None and "refused" in error and got["first"][0].split(": ", 1)[1] in error, error
            assert took < AT_ONCE_S, (rank, later, took)
        assert torch.equal(got["x"], torch.full((4,), rank + 1.0)), "a call paired with another rank's call"
        assert torch.equal(got["y"], torch.full((4,), 10.0 * (rank + 1))), "a call paired with another rank's call"


def test_break_group_makes_the_peers_next_call_raise_at_once_naming_the_rank_and_every_later_call_refuse(broken):
    error, took = broken[1]["break_group"]["first"]
    assert error is not None and "rank 0 broke off (other)" in error and took < AT_ONCE_S, (error, took)
    error, took = broken[0]["break_group"]["first"]
    assert error is not None and "refused" in error and "gloo's all_gather failed" in error and took < AT_ONCE_S
    for rank in (0, 1):
        error, took = broken[rank]["break_group"]["second"]
        assert error is not None and "refused" in error and took < AT_ONCE_S, (rank, error)


def test_after_a_mismatch_every_later_call_refuses_naming_it(broken):
    for rank in (0, 1):
        first, second = broken[rank]["mismatch"]["first"][0], broken[rank]["mismatch"]["second"]
        assert first.startswith("ValueError") and "rank 0: all_reduce of 16 bytes" in first, first
        assert "refused" in second[0] and "rank 0: all_reduce of 16 bytes" in second[0] and second[1] < AT_ONCE_S, \
            second


def test_a_peer_late_within_the_timeout_gets_each_call_paired_with_its_own(broken):
    for rank in (0, 1):
        x, y = broken[rank]["late within the timeout"]
        assert torch.equal(x, torch.full((4,), 3.0)) and torch.equal(y, torch.full((4,), 30.0)), (rank, x, y)


# --------------------------------------------------------------------------- long outputs, copied past the caches

# The last-level cache the long-output tests pin (the AMD EPYC's): at 2 ranks, outputs of 8 MiB on are streamed.
PINNED_CACHE = 32 << 20
# Int64 elements of an output just under and just over that; halves odd, so that blocks start off 16-byte lines.
# (Int64: every value exact, where float32 stops telling x from x + 1 at 2 ** 24.)
AROUND_STREAMED = {"under": slots.streamed_bytes(2, PINNED_CACHE) // 8 - 2,
                   "over": slots.streamed_bytes(2, PINNED_CACHE) // 8 + 1002}


def copies_into_long_outputs(ctx) -> dict:
    """{(kind, "under" or "over"): (whether the output is exact, the copies that went through ``stream_copy``)} of
    a broadcast (from rank 1), an all-gather and an all-to-all on Slots over C++, each rank's data its own."""
    streamed = []
    stream = slots.stream_copy()

    def counted(dst, src):
        streamed.append(dst.numel())
        stream(dst, src)
    with mock.patch.object(slots, "stream_copy", lambda: counted), \
            mock.patch.object(slots, "last_level_cache_bytes", lambda: PINNED_CACHE):
        pair = Slots.open(dist.PrefixStore("streamed", default_store()), ctx.rank, 2, 30.0, sums=slots.native_sums())
    mine = {n: torch.arange(n) * 2 + ctx.rank for n in AROUND_STREAMED.values()}
    theirs = {n: torch.arange(n) * 2 + 1 - ctx.rank for n in AROUND_STREAMED.values()}
    found = {}
    for size, n in AROUND_STREAMED.items():
        half, int64 = n // 2, {"dtype": torch.int64}
        calls = {
            "broadcast": (lambda: mine[n].clone(), lambda x: pair.broadcast(x, 1),
                          mine[n] if ctx.rank == 1 else theirs[n]),
            "all_gather": (lambda: torch.empty(2 * half, **int64), lambda x: pair.all_gather(x, mine[n][:half]),
                           torch.cat([(mine if r == ctx.rank else theirs)[n][:half] for r in (0, 1)])),
            "all_to_all": (lambda: torch.empty(2 * half, **int64), lambda x: pair.all_to_all(x, mine[n][:2 * half]),
                           torch.cat([(mine if r == ctx.rank else theirs)[n][ctx.rank * half:(ctx.rank + 1) * half]
                                      for r in (0, 1)])),
        }
        for kind, (output, call, expected) in calls.items():
            streamed.clear()
            x = output()
            call(x)
            found[kind, size] = (torch.equal(x, expected), len(streamed))
    pair.close()
    return found


def test_an_output_the_ranks_fill_half_the_cache_with_is_copied_past_the_caches_and_a_shorter_one_is_not_both_exact():
    assert slots.native_sums() is not None, "this test needs the C++ of dpkit.native (a C++ compiler)"
    for rank, found in enumerate(launch(copies_into_long_outputs, 2, timeout_s=120, pg_timeout_s=30)):
        for (kind, size), (exact, streamed) in found.items():
            assert exact, (rank, kind, size)
            if size == "under" or (kind == "broadcast" and rank == 1):  # the root copies nothing out
                assert streamed == 0, (rank, kind, size, streamed)
            else:
                assert streamed > 0, (rank, kind, size)


def test_outputs_go_past_the_caches_from_half_the_last_level_cache_over_the_ranks_and_from_32_slots_whatever_it_is():
    mib = 1 << 20
    assert slots.streamed_bytes(2, 32 * mib) == 8 * mib
    assert slots.streamed_bytes(4, 32 * mib) == 4 * mib
    assert slots.streamed_bytes(2, 480 * mib) == slots.STREAMED_BYTES == 32 * slots.SLOT_BYTES
    assert slots.streamed_bytes(2, None) == slots.STREAMED_BYTES


def test_the_last_level_cache_is_the_deepest_data_or_unified_cache_linux_describes(tmp_path):
    for index, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                                 (3, "Unified", "32768K"), (4, "Instruction", "64K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(f"{value}\n")
    assert slots.last_level_cache_bytes(str(tmp_path)) == 32 << 20
    assert slots.last_level_cache_bytes(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 63, 64, 65, 1000, (1 << 20) + 7])
def test_stream_copy_writes_exactly_its_bytes_from_any_alignment(length):
    stream = slots.stream_copy()
    assert stream is not None, "this test needs the C++ of dpkit.native (a C++ compiler)"
    source = torch.randint(0, 256, (length + 32,), dtype=torch.uint8)
    for into, out_of in ((0, 0), (1, 0), (15, 3), (8, 9)):  # byte offsets: every head a 16-byte line can need
        target = torch.zeros(length + 32, dtype=torch.uint8)
        stream(target[into:into + length], source[out_of:out_of + length])
        assert torch.equal(target[into:into + length], source[out_of:out_of + length]), (into, out_of)
        assert not target[:into].any() and not target[into + length:].any(), "a byte outside the copy was written"


def test_stream_copy_refuses_tensors_it_cannot_copy_whole():
    stream = slots.stream_copy()
    with pytest.raises(RuntimeError, match="two contiguous CPU tensors of the same bytes"):
        stream(torch.empty(8), torch.empty(9))
    with pytest.raises(RuntimeError, match="two contiguous CPU tensors of the same bytes"):
        stream(torch.empty(4, 4).t(), torch.empty(4, 4))


# --------------------------------------------------------------------------- pieces that hold a column of every block

def columns_of_every_block(ctx) -> dict:
    """What each piece of ``exchange_columns`` holds (every rank's slot, as ``use`` sees it), and which exchange a
    reduce-scatter and an all-to-all past one piece take, on 3 ranks whose blocks are 1.5 slots long."""
    pair = Slots.open(dist.PrefixStore("columns", default_store()), ctx.rank, ctx.world_size, 30.0)
    n, m = ctx.world_size, slots.SLOT_BYTES // 8 * 3 // 2 + 7  # int64 elements
    flat = torch.arange(n * m) * 4 + ctx.rank  # block j, element i: 4 (j m + i) + rank
    pieces = []
    pair.exchange_columns("all_to_all", flat, "none", lambda c0, c1, parts: pieces.append(
        (c0, c1, [part.clone() for part in parts])))
    taken = []
    with mock.patch.object(Slots, "exchange_columns", autospec=True,
                           side_effect=lambda self, kind, *args: taken.append(kind)), \
            mock.patch.object(Slots, "exchange", autospec=True,
                              side_effect=lambda self, kind, *args, **kwargs: taken.append(f"{kind} in pieces")):
        pair.reduce_scatter(torch.empty(m, dtype=torch.int64), flat)
        pair.all_to_all(torch.empty(n * m, dtype=torch.int64), flat)
        # one piece: as the C++ face cuts it
        pair.reduce_scatter(torch.empty(4, dtype=torch.int64), torch.ones(4 * n, dtype=torch.int64))
    pair.close()
    return {"m": m, "pieces": pieces, "taken": taken}


def test_a_piece_of_a_column_exchange_holds_that_column_of_every_block_but_the_ranks_own():
    found = launch(columns_of_every_block, 3, timeout_s=120, pg_timeout_s=30)
    m = found[0]["m"]
    width = slots.SLOT_BYTES // 8 // 3  # int64 elements: a third of a slot
    for rank, mine in enumerate(found):
        assert [(c0, c1) for c0, c1, _ in mine["pieces"]] == [(c0, min(m, c0 + width)) for c0 in range(0, m, width)]
        for c0, c1, parts in mine["pieces"]:
            w = c1 - c0
            for r, part in enumerate(parts):
                for j in range(3):
                    if j != r:  # block j of rank r: 4 (j m + i) + r, for i in [c0, c1)
                        expected = torch.arange(j * m + c0, j * m + c1) * 4 + r
                        assert torch.equal(part[j * w:(j + 1) * w], expected), (rank, c0, r, j)
        assert mine["taken"] == ["reduce_scatter", "all_to_all", "reduce_scatter in pieces"], mine["taken"]
