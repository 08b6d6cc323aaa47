"""Shared helpers for every script and test in this repository.

Nothing here is a script; everything is imported. The pieces:

* Process-group set-up: ``distributed()`` under torchrun (reads ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``; multi-node through torchrun's rendezvous) and
  ``launch()`` for code that starts its own N workers (tests, the all-reduce
  comparison). Both give the worker a ``DistContext`` and both use a short
  process-group timeout, so a dead or stuck peer ends the job with a clear error
  instead of hanging for gloo's default 30 minutes.
* Rank-0 output: ``print0``, ``progress`` (a tqdm bar on rank 0 only).
* Measurement: ``time_iterations`` (warm-up, barrier, ``perf_counter``, CUDA
  synchronisation, maximum over ranks), ``PeakMemory``, ``chrome_trace`` and
  ``saved_tensor_bytes``.
* Results: ``environment`` and ``format_environment`` (the header every script
  prints), ``write_results``/``read_results`` (the one JSON layout all our
  benchmarks share) and ``markdown_table``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

# Short enough that a dead or stuck peer fails every rank within about a minute;
# long enough for a slow collective on a loaded 2-core machine.
DEFAULT_TIMEOUT_S = 60.0
RESULTS_SCHEMA = "dp-kit-results/1"


# --------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class DistContext:
    """Who this process is. ``device`` is where its tensors live (cuda:LOCAL_RANK with nccl)."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float

    @property
    def is_master(self) -> bool:
        return self.rank == 0


class PeerFailedError(RuntimeError):
    """A collective or message failed because another rank died, diverged or stopped answering."""


def resolve_backend(backend: str = "auto") -> str:
    """``auto`` is nccl when CUDA is available, else gloo; nccl without CUDA is an error."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: choose auto, gloo or nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs CUDA, and no GPU is visible; use --backend gloo")
    return backend


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _init(backend: str, rank: int, local_rank: int, world_size: int, timeout_s: float, store=None) -> DistContext:
    backend = resolve_backend(backend)
    device = _device_for(backend, local_rank)
    kwargs = dict(backend=backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(**kwargs)
    return DistContext(rank, local_rank, world_size, backend, device, timeout_s)


def _teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# What gloo and NCCL say when the other side of a message is gone or silent.
_PEER_SIGNS = ("Timed out", "timed out", "Connection reset", "Connection closed", "closed by peer",
               "Broken pipe", "communicator was aborted")


def _explain(error: BaseException, ctx: DistContext) -> BaseException:
    """Turn a transport error caused by a peer into one message that names the likely cause."""
    text = str(error)
    from_peer = isinstance(error, dist.DistBackendError) or any(sign in text for sign in _PEER_SIGNS)
    if isinstance(error, PeerFailedError) or not from_peer:
        return error
    return PeerFailedError(
        f"rank {ctx.rank}/{ctx.world_size}: a peer failed, diverged or stopped answering: a message or "
        f"collective did not complete within the {ctx.timeout_s:g} s process-group timeout, or a peer's "
        f"connection closed. Look at the other ranks' errors for the root cause. ({text.strip()[:300]})")


@contextmanager
def distributed(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S):
    """Join the process group described by torchrun's environment; tear it down on exit.

    Without torchrun (no ``RANK`` in the environment) this is a world of one process, so
    every script also runs as plain ``python script.py``. Transport errors caused by a
    peer are re-raised as ``PeerFailedError`` with a message that says so.
    """
    if "RANK" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        store = None  # env:// rendezvous from MASTER_ADDR/MASTER_PORT that torchrun sets
    else:
        rank, world_size, local_rank = 0, 1, 0
        tmp = tempfile.mkdtemp(prefix="dpkit-store-")
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
    ctx = _init(backend, rank, local_rank, world_size, timeout_s, store)
    try:
        yield ctx
    except Exception as error:
        explained = _explain(error, ctx)
        if explained is error:
            raise
        raise explained from error
    finally:
        _teardown()
        if store is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def add_common_args(parser: argparse.ArgumentParser, json_help: str = "write the results here in the shared JSON layout") -> None:
    """The flags every script shares: --backend, --timeout, --json."""
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="process-group backend; auto = nccl when CUDA is available, else gloo (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="process-group timeout in seconds: a stuck peer fails the job after this long (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", default=None, help=f"{json_help} (default: none)")


# --------------------------------------------------------------------------- local launcher


class WorkerError(RuntimeError):
    """A worker started by ``launch`` raised, crashed or hung; ``pids`` are the (now dead) workers."""

    def __init__(self, message: str, pids: Sequence[int]):
        super().__init__(message)
        self.pids = list(pids)


def _worker_main(fn, rank, world_size, store_path, backend, pg_timeout_s, threads, args, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    ctx = None
    try:
        ctx = _init(backend, rank, rank, world_size, pg_timeout_s, dist.FileStore(store_path, world_size))
        try:
            result = fn(ctx, *args)
        except Exception as error:
            explained = _explain(error, ctx)
            if explained is not error:
                raise explained from error
            raise
        torch.save(result, os.path.join(out_dir, f"result-{rank}.pt"))
    except BaseException:
        # The time stamp lets the parent report the first failure (the root cause), not the
        # cascade of peers that failed because of it.
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        sys.exit(1)
    finally:
        _teardown()


def _stop(processes) -> None:
    """Terminate, then kill, then reap every worker still alive: none may outlive the launcher."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _root_cause(out_dir: str, processes) -> tuple[int, str]:
    """The failure to report among the dead workers, with its rank.

    A failing rank takes its peers down with it, and they fail too, with
    ``PeerFailedError``. So the root cause is, in this order: the earliest error a rank
    raised for its own reason; else a rank that died without a traceback (killed,
    ``os._exit``, a crash outside Python); else the earliest ``PeerFailedError``.
    """
    raised = []
    for name in os.listdir(out_dir):
        if name.startswith("error-"):
            with open(os.path.join(out_dir, name)) as f:
                stamp, text = f.read().split("\n", 1)
            consequence = f"{PeerFailedError.__name__}:" in text.strip().splitlines()[-1]
            raised.append((consequence, float(stamp), int(name[6:-4]), text))
    ranks_raised = {rank for _, _, rank, _ in raised}
    silent = [(rank, p.exitcode) for rank, p in enumerate(processes)
              if p.exitcode not in (None, 0) and rank not in ranks_raised]
    own = [r for r in raised if not r[0]]
    if own or not silent:
        _, _, rank, text = min(own or raised)
        return rank, text
    rank, code = silent[0]
    return rank, f"exit code {code}, no traceback (killed, os._exit, or a crash outside Python)\n"


def launch(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0,
           pg_timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` fresh processes and return each rank's result.

    Workers start with the ``spawn`` method and meet through a FileStore in a new
    temporary directory (no port, so concurrent runs never collide). Each uses
    ``threads`` intra-op threads. ``fn`` must be importable (defined at module level)
    and its result picklable by ``torch.save``.

    The whole group must finish within ``timeout_s``. A worker that raises or exits
    without a result fails the launch with the root cause's traceback (see
    ``_root_cause``); a hang past the timeout fails it naming the ranks still running.
    Either way every worker is terminated and reaped before ``WorkerError`` is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    mp = multiprocessing.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="dpkit-launch-")
    processes = []
    try:
        for rank in range(world_size):
            p = mp.Process(target=_worker_main, name=f"rank{rank}",
                           args=(fn, rank, world_size, os.path.join(tmp, "store"), backend, pg_timeout_s, threads, args, tmp))
            p.start()
            processes.append(p)
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [p for p in processes if p.is_alive()]  # is_alive() also reaps, setting exitcode
            if any(p.exitcode not in (None, 0) for p in processes):
                time.sleep(0.5)  # let the peers it took down record their errors: the root cause may be among them
                for p in processes:
                    p.is_alive()
                rank, text = _root_cause(tmp, processes)
                raise WorkerError(f"{fn.__name__}: rank {rank} of {world_size} failed:\n{text}",
                                  [p.pid for p in processes])
            if not alive:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = [processes.index(p) for p in alive]
                raise WorkerError(f"{fn.__name__}: ranks {ranks} of {world_size} still running after {timeout_s:g} s; "
                                  "all workers were terminated", [p.pid for p in processes])
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=left)
        return [torch.load(os.path.join(tmp, f"result-{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        _stop(processes)
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- rank-0 output


def is_master() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only, flushed so lines keep their order in torchrun's merged output."""
    if is_master():
        print(*args, **kwargs, flush=True)


def progress(iterable: Iterable, **tqdm_kwargs) -> Iterable:
    """A tqdm progress bar on rank 0 (to stderr); the bare iterable elsewhere."""
    if not is_master():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, dynamic_ncols=True, leave=False, **tqdm_kwargs)


# --------------------------------------------------------------------------- measurement


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a host clock measures it; nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_rows(values: Sequence[float], group=None) -> torch.Tensor:
    """Every rank's ``values`` (same length on all ranks) as a float64 (world, n) tensor on every rank."""
    local = torch.tensor(list(values), dtype=torch.float64)
    if not dist.is_initialized():
        return local.unsqueeze(0)
    world = dist.get_world_size(group)
    # nccl moves only GPU tensors; gloo only needs CPU ones.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else local.device
    local = local.to(device)
    rows = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows).cpu()


@dataclass
class Timing:
    """Per-iteration wall times. ``per_rank`` is (world, iters); ``samples`` its maximum over ranks.

    An iteration is as slow as its slowest rank, so statistics are taken over ``samples``.
    """

    per_rank: torch.Tensor

    @property
    def samples(self) -> list[float]:
        return self.per_rank.max(dim=0).values.tolist()

    def percentile(self, q: float) -> float:
        return percentile(self.samples, q)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, like numpy's default."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("percentile of no samples")
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def time_iterations(fn: Callable[[], Any], iters: int, warmup: int = 5, device: torch.device | str = "cpu",
                    group=None, barrier_each: bool = True, setup: Callable[[], Any] | None = None) -> Timing:
    """Time ``iters`` calls of ``fn`` after ``warmup`` untimed ones; every rank must call this.

    A barrier precedes the timed region (and, with ``barrier_each``, every iteration, so
    all ranks start each iteration together and a rank's time includes waiting for its
    slowest peer only inside ``fn``). GPU work is synchronised before the clock is read.
    Inputs must be made by the caller, outside ``fn``; ``setup``, if given, runs before
    every call (warm-up included) outside the timed region, e.g. to restore an input that
    an in-place ``fn`` changed.
    """
    device = torch.device(device)
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    synchronize(device)
    initialized = dist.is_initialized()
    if initialized:
        dist.barrier(group=group)
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
        if barrier_each and initialized:
            dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return Timing(gather_rows(times, group))


def time_interleaved(fns: dict[str, Callable[[], Any]], iters: int, warmup: int = 5, rounds: int = 2,
                     device: torch.device | str = "cpu", group=None, setup: Callable[[], Any] | None = None) -> dict[str, Timing]:
    """``time_iterations`` for several functions, their iterations split into ``rounds`` interleaved rounds.

    Round r times each function in turn (the order rotated every round), so a change in the
    machine's load during the run hits every function alike and their ratios stay meaningful.
    Each function gets ``iters`` timed calls in all (at least one per round) and ``warmup``
    untimed calls in its first round; every rank must call this with the same functions.
    """
    names = list(fns)
    rounds = max(1, min(rounds, iters))
    per_round = [iters // rounds + (r < iters % rounds) for r in range(rounds)]
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            timing = time_iterations(fns[name], per_round[r], warmup if r == 0 else 0, device, group, setup=setup)
            parts[name].append(timing.per_rank)
    return {name: Timing(torch.cat(parts[name], dim=1)) for name in names}


@contextmanager
def _quiet_stderr():
    """Silence fd 2 while the profiler starts and stops: kineto writes status lines there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class PeakMemory:
    """Peak bytes of tensor memory that torch allocated inside the block, above the level at entry.

    On CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
    what was allocated at entry.
    On CPU: torch has no allocator statistics, and tracemalloc does not see its buffers.
    We record the block with the autograd profiler (``profile_memory=True``), which logs every
    allocation and free of torch's CPU allocator, and take the maximum of the running total
    in time order. It counts tensors, autograd's saved tensors and operator workspaces
    allocated on the thread that entered the block; it does not count Python objects or
    gloo's own transport buffers.
    Limitation: a tensor whose last reference is dropped on another thread (e.g. a gloo
    worker finishing a collective after the caller let go of its buffer) is freed without
    an event, so a block that ends such collectives can overstate the peak by that buffer.
    Measure steady-state steps (after construction broadcasts) where that matters.
    Profiling slows the block down: measure memory and time in separate runs.

    Usage::

        with PeakMemory(device) as peak:
            step()
        peak.bytes
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            # The autograd profiler torch.profiler.profile wraps: the wrapper's start imports
            # torch._inductor, about 2 s of CPU in a process that has not imported torch._dynamo
            # yet (building a torch.optim optimizer imports that too).
            self._profiler = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True)
            with _quiet_stderr():
                # The first free of a block allocated before profiling makes torch warn, once per
                # process ("Memory block of unknown size..."): a free we do not count anyway
                # (it is below the level at entry). Trigger that warning here, silenced.
                before = torch.empty(1)
                self._profiler.__enter__()
                del before
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        with _quiet_stderr():
            self._profiler.__exit__(*exc)
        if exc[0] is not None:
            return
        events = [e for e in self._profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        self.bytes = peak


@contextmanager
def chrome_trace(path: str, device: torch.device | str = "cpu"):
    """Profile the block and write a Chrome trace to ``path`` (chrome://tracing or ui.perfetto.dev).

    The trace holds the host operators of every thread (so gloo's collectives, which run
    on gloo's own threads, appear beside backward) and, on CUDA, the kernels of every
    stream. It uses the autograd profiler that ``torch.profiler.profile`` wraps: the
    wrapper's start imports torch._inductor (about 2 s of CPU per process). Queued GPU
    work is waited for before the trace ends; kineto's status lines on stderr are
    silenced. Nothing is written if the block raises.
    """
    device = torch.device(device)
    profiler = torch.autograd.profiler.profile(use_kineto=True, use_device="cuda" if device.type == "cuda" else None)
    with _quiet_stderr():
        profiler.__enter__()
    try:
        yield
        synchronize(device)
    finally:
        with _quiet_stderr():
            profiler.__exit__(None, None, None)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _quiet_stderr():
        profiler.export_chrome_trace(path)


def saved_tensor_bytes(fn: Callable[[], Any]) -> int:
    """Bytes of distinct tensor storage that autograd keeps for backward while ``fn`` runs.

    Counts each storage once (a tensor saved twice, or a view of a saved tensor, is free),
    including inputs and outputs that are saved because backward needs them.
    """
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


# --------------------------------------------------------------------------- results


def _device_model(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(backend: str, device: torch.device | str, world_size: int, **extra) -> dict:
    """The environment header stored with, and printed before, every result."""
    device = torch.device(device)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "backend": backend,
        "device": device.type,
        "device_model": _device_model(device),
        "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "world_size": world_size,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "git_commit": _git_commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def format_environment(env: dict) -> str:
    """A short header: what ran, on what."""
    lines = [
        f"* torch {env['torch']}" + (f", CUDA {env['cuda']}" if env.get("cuda") else ""),
        f"* backend {env['backend']}, device {env['device']} ({env['device_model']})",
        f"* world size {env['world_size']}, {env['threads']} thread(s) per process, {env['cpus']} CPUs",
    ]
    return "\n".join(lines)


def write_results(path: str, benchmark: str, env: dict, config: dict, rows: list[dict]) -> None:
    """Write the shared JSON layout: ``{schema, benchmark, env, config, results: [row, ...]}``.

    Rows are flat dicts; times are in seconds and memory in bytes. The file is written
    to a temporary name and renamed, so a reader never sees half a file.
    """
    doc = {"schema": RESULTS_SCHEMA, "benchmark": benchmark, "env": env, "config": config, "results": rows}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (torch.device, torch.dtype)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_results(path: str) -> dict:
    """Read a file written by ``write_results``, refusing other layouts."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != RESULTS_SCHEMA:
        raise ValueError(f"{path}: not a results file of layout {RESULTS_SCHEMA} (schema={doc.get('schema')!r})")
    return doc


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table. ``columns`` are (key, header, format spec); a missing value prints as '-'."""
    def cell(row, key, spec):
        value = row.get(key)
        return "-" if value is None else format(value, spec)

    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("-" * (len(h) + 2) for _, h, _ in columns) + "|"
    body = ["| " + " | ".join(cell(row, k, s) for k, _, s in columns) + " |" for row in rows]
    return "\n".join([header, rule, *body])
