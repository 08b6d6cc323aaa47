"""Test conventions every test file shares.

* ``run_workers(fn, n, *args)``: run ``fn(ctx, *args)`` on n spawned gloo workers (no
  port, a timeout on the whole group) and return each rank's result, so the parent can
  compare them with a single-process oracle. Run a whole grid of cases inside one call:
  spawning a worker costs seconds (importing torch), a case costs milliseconds.
* ``run_torchrun(script, n, *args)``: run a script through the real torchrun
  (``--standalone`` picks a free port) with a timeout; the whole process group is killed
  when it expires. ``run_script([script, *args])``: the same for ``python script args``.
* ``CollectiveCounter``: counts calls into ``torch.distributed`` inside a worker.
* ``CountingTransport``: a transport that counts the collectives an engine makes through it, whatever
  carries them (pass it as the engine's ``transport=``).
* ``launch_expecting_peer_failure``: a group in which one rank must fail because a peer
  stopped answering, with the message and the time it took.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dpkit.bench import measure
from dpkit.comm import transport
from dpkit.comm.process_groups import GROUP_OUTLIVED_TEARDOWN, PeerFailedError, WorkerError, launch

REPO = Path(__file__).resolve().parents[1]

# The two paths to the "dpkit" backend, as the environment of a launch picks them: its C++ face, and torch's
# Python-backend route (where no C++ compiler is).
BACKEND_PATHS = {"c++": {}, "python": {"DPKIT_NATIVE": "0"}}

# A device whose memory gloo's send and recv cannot read, on a machine without one: meta tensors stand in for
# CUDA tensors in the CPU twins of the GPU paths (gloo's collectives copy CUDA tensors; its send and recv do not).
OFF_HOST = torch.device("meta")

# Generous for a loaded 2-core machine, yet far below gloo's 30-minute default.
WORKERS_TIMEOUT_S = 180.0
PG_TIMEOUT_S = 30.0


def run_workers(fn, world_size: int, *args, timeout_s: float = WORKERS_TIMEOUT_S, pg_timeout_s: float = PG_TIMEOUT_S):
    """``process_groups.launch`` with the suite's timeouts: one spawned group, every rank's result."""
    return launch(fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)


def launch_expecting_peer_failure(fn, world_size: int, *args, rank: int = 0, pg_timeout_s: float,
                                  timeout_s: float = 120.0) -> tuple[str, float]:
    """Launch ``fn``; it must fail on ``rank`` with ``PeerFailedError`` naming the process-group timeout.

    Returns the launcher's message and the seconds the launch took.
    """
    start = time.monotonic()
    try:
        launch(fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    except WorkerError as failure:
        message = str(failure)
    else:
        raise AssertionError(f"{fn.__name__}: every rank succeeded; rank {rank} should have failed")
    assert f"rank {rank} of {world_size} failed" in message, message
    assert PeerFailedError.__name__ in message and "a peer failed" in message, message
    assert f"{pg_timeout_s:g} s process-group timeout" in message, message
    return message, time.monotonic() - start


def run_torchrun(script: str, nproc: int, *args: str, timeout_s: float = 240.0, check: bool = True,
                 torchrun_args: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node nproc script args`` from the repository root (``run_script``)."""
    return run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args,
                       str(REPO / script), *args], timeout_s=timeout_s, check=check, env=env)


def run_script(arguments: list[str], timeout_s: float = 240.0, check: bool = True,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python arguments`` from the repository root in a session of its own.

    Returns the completed process (stdout and stderr as text). With ``check``, a non-zero
    exit, or a process group that outlived its teardown, fails the test with both streams. On timeout every
    process of the run (spawned ranks included) is killed.
    """
    command = [sys.executable, *arguments]
    # See pytorch/pytorch#135712: restarted workers may fail to reconnect to a shared store.
    full_env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    process = subprocess.Popen(command, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"timed out after {timeout_s} s: {' '.join(command)}\n--- stdout\n{stdout}\n--- "
                             f"stderr\n{stderr[-5000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"exit code {result.returncode}: {' '.join(command)}\n"
                             f"--- stdout\n{stdout[-5000:]}\n--- stderr\n{stderr[-5000:]}")
    # A group that outlives its teardown can abort a worker at exit, now and then (see process_groups.teardown).
    if check and GROUP_OUTLIVED_TEARDOWN in stderr:
        raise AssertionError(f"a process group outlived its teardown: {' '.join(command)}\n"
                             f"--- stderr\n{stderr[-5000:]}")
    return result


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter",
               "all_to_all", "all_to_all_single", "barrier")
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


class CollectiveCounter:
    """Counts calls into ``torch.distributed`` while active, and bytes sent point to point.

    Both ``torch.distributed.X`` and ``distributed_c10d.X`` are wrapped, so code that calls
    ``dist.all_reduce`` is seen, and ``P2POp(dist.isend, ...)`` still passes torch's check
    that its op is ``isend``. Only the outermost call counts: ``send`` is implemented
    with ``isend`` and ``batch_isend_irecv`` calls each op's function, and those inner
    calls are part of the one the caller made. ``calls`` maps a function name to its
    number of calls; ``sent_bytes`` adds up the tensors sent by ``send``, ``isend`` and
    the ``isend`` ops of ``batch_isend_irecv``.
    """

    def __init__(self):
        self.calls = collections.Counter()
        self.sent_bytes = 0
        self._depth = 0
        self._saved = []

    @property
    def collectives(self) -> int:
        return sum(self.calls[name] for name in COLLECTIVES)

    @property
    def point_to_point(self) -> int:
        return sum(self.calls[name] for name in POINT_TO_POINT)

    def reset(self) -> None:
        self.calls.clear()
        self.sent_bytes = 0

    @staticmethod
    def _bytes_sent(name, args, kwargs) -> int:
        if name in ("send", "isend"):
            tensor = args[0] if args else kwargs["tensor"]
            return tensor.numel() * tensor.element_size()
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            return sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op.__name__ == "isend")
        return 0

    def _wrap(self, name, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            self.calls[name] += 1
            self.sent_bytes += self._bytes_sent(name, args, kwargs)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> "CollectiveCounter":
        for name in COLLECTIVES + POINT_TO_POINT:
            original = getattr(c10d, name)
            wrapped = self._wrap(name, original)
            for module in (dist, c10d):
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


def run_in_subgroups(grid_in, world_size: int, rounds, *args) -> dict[int, list]:
    """Run ``grid_in(group, *args)`` on every group of ``rounds`` inside ONE spawned world.

    ``rounds`` is a sequence of rounds, each a list of disjoint member lists (``None``: the whole
    world); the groups of a round run at the same time. Returns group size -> each member's
    result in group-rank order (each size must occur once).
    """
    by_size: dict[int, list] = {}
    for per_rank in run_workers(_subgroup_grid, world_size, grid_in, rounds, *args):
        for n, (group_rank, outcome) in per_rank.items():
            by_size.setdefault(n, [None] * n)[group_rank] = outcome
    assert all(None not in members for members in by_size.values()), "a group size occurs in two groups"
    return by_size


def _subgroup_grid(ctx, grid_in, rounds, *args) -> dict:
    out = {}
    for groups in rounds:
        # Every rank creates every group, in the same order; only members use it.
        handles = [dist.new_group(members) if members is not None else None for members in groups]
        for members, group in zip(groups, handles):
            if members is None or ctx.rank in members:
                size = len(members) if members is not None else ctx.world_size
                out[size] = (dist.get_rank(group), grid_in(group, *args))
    return out


def doubled_count(row: dict) -> bool:
    """Whether a row's calls per batch is a count ``measure.calls_lasting`` makes: doubled from one until the calls
    last the batch, so a power of two or the limit. Which contender makes more calls is a timing, left to the
    benchmarks: on a loaded machine, shared memory's spinning ranks may wait longer than gloo's sleeping ones. That
    each contender gets its own count is tested on a clock only the calls move (``test_measure``)."""
    calls, limit = row["calls_per_round"], measure.MAX_CALLS_PER_BATCH
    return 1 <= calls <= limit and (calls & (calls - 1) == 0 or calls == limit)


def refused(call) -> dict:
    """Call ``call()`` expecting a TypeError or ValueError: ``{"error": "Type: message" or None, "calls": ...}``,
    with the ``torch.distributed`` calls it made (none, if it refused before any message)."""
    with CollectiveCounter() as counter:
        try:
            call()
            error = None
        except (TypeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
    return {"error": error, "calls": dict(counter.calls)}


def assert_refused(refusals: dict[str, dict], expected: dict[str, str]) -> None:
    """Each case of ``refusals`` (``refused(...)`` results) failed with the message ``expected`` starts
    with, and made no ``torch.distributed`` call."""
    for case, start in expected.items():
        outcome = refusals[case]
        assert outcome["error"] is not None and outcome["error"].startswith(start), (case, outcome["error"])
        assert outcome["calls"] == {}, case


class CountingTransport(transport.Wrapped):
    """Wraps a transport (default: ``resolve("auto")`` over ``group``) and counts the collectives made through
    it: ``calls["all_reduce" | "reduce_scatter" | "all_gather"]`` at the call (an asynchronous one when it
    is launched, as torch's counts), and ``bytes[kind]``. Buffers are the inner transport's (``allocate``),
    so a shared-memory inner transport still sums them without a copy. Every rank must wrap alike."""

    name = "counting"

    def __init__(self, inner: transport.Transport | str = "auto", group=None, device="cpu"):
        super().__init__(inner if isinstance(inner, transport.Transport) else transport.resolve(inner, group, device))
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    @property
    def collectives(self) -> int:
        return sum(self.calls.values())

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def _count(self, kind: str, tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        self._count("all_reduce", tensor)
        return super().all_reduce(tensor, op, async_op=async_op)

    def reduce_scatter(self, output, input, op="sum", *, async_op=False):
        self._count("reduce_scatter", input)
        return super().reduce_scatter(output, input, op, async_op=async_op)

    def all_gather(self, output, input, *, async_op=False):
        self._count("all_gather", output)
        return super().all_gather(output, input, async_op=async_op)


def left_in_dev_shm(before: set[str], pids=()) -> list[str]:
    """What appeared in /dev/shm since ``before`` and stays with no live process holding it (a second look still
    finds it; other processes of this machine, another test file's DataLoader for one, make and hold their own
    files meanwhile), and anything named after one of ``pids``."""
    new = set(os.listdir("/dev/shm")) - before
    time.sleep(0.25)
    orphans = {name for name in new & set(os.listdir("/dev/shm")) if not _held(name)}
    return sorted(orphans | {name for name in os.listdir("/dev/shm") for pid in pids if str(pid) in name})


def _held(name: str) -> bool:
    """Whether a live process maps /dev/shm/``name`` or has it open (a dead worker does neither)."""
    path = os.path.join("/dev/shm", name)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                if path in maps.read():
                    return True
            fds = f"/proc/{pid}/fd"
            if any(os.readlink(os.path.join(fds, fd)) == path for fd in os.listdir(fds)):
                return True
        except OSError:  # the process ended, or is not ours to read
            continue
    return False
