"""Process groups: set-up under torchrun, a local launcher for tests and sweeps, peer-failure errors.

* ``distributed()`` joins the process group torchrun describes (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``; several nodes through torchrun's rendezvous), or a world of one without
  torchrun, and tears it down on exit.
* ``launch(fn, n)`` runs ``fn(ctx)`` on n fresh workers (forked from a server that imported torch
  once) that meet through a file (no port), with a timeout on the whole group and the root cause's
  traceback when a worker fails.
* Both use a short process-group timeout (``DEFAULT_TIMEOUT_S``), so a dead or stuck peer
  ends the job with ``PeerFailedError`` instead of hanging for gloo's default half hour.
* Rank-0 output: ``print0`` and ``progress`` (a tqdm bar on rank 0 only).

* ``teardown()`` destroys the group after closing what holds it (``before_teardown``) and says
  when something still does. ``synchronize(device)`` waits for queued GPU work.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
from multiprocessing import reduction
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
# Imported while no process group exists, on purpose. Its functions take ``group=group.WORLD`` as a default
# argument, evaluated on first import: PyTorch's DDP imports it on first construction, after
# init_process_group, and the defaults would then hold the default group for the life of the process.
# destroy_process_group could not free it, and gloo's threads would run on into interpreter shutdown,
# where a worker can abort ("terminate called without an active exception"). Imported now, they hold None.
import torch.distributed.nn  # noqa: F401

from dpkit import compat
from dpkit.comm.hosts import HOSTS_ENV, layout_value

# Short enough that a dead or stuck peer fails every rank within about a minute;
# long enough for a slow collective on a loaded 2-core machine.
DEFAULT_TIMEOUT_S = 60.0
# What teardown prints (and the tests look for) when a destroyed group is still referenced.
GROUP_OUTLIVED_TEARDOWN = "still referenced after destroy_process_group"
# The modules imported when this process joined its group: teardown looks for holders only among the others
# (one imported before holds None in its defaults), and reads no attribute of the rest.
_MODULES_AT_INIT: set[str] = set()


# --------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class DistContext:
    """Who this process is. ``device`` is where its tensors live (``resolve_device``; on CUDA
    cuda:LOCAL_RANK modulo the GPUs visible)."""

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


DEVICES = ("auto", "cpu", "cuda")


def resolve_backend(backend: str = "auto", device: str = "auto") -> str:
    """``auto`` is nccl when the ranks compute on CUDA (``--device cuda``, or ``auto`` with a GPU visible),
    else gloo; nccl without CUDA is an error naming the flag."""
    if backend not in ("auto", "gloo", "nccl", "dpkit"):
        raise ValueError(f"--backend {backend}: unknown backend; choose auto, gloo, nccl or dpkit")
    if device not in DEVICES:
        raise ValueError(f"--device {device}: unknown device; choose one of {', '.join(DEVICES)}")
    if backend == "auto":
        return "nccl" if device != "cpu" and torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("--backend nccl needs CUDA, and no GPU is visible (torch.cuda.is_available() is "
                           "False): use --backend gloo")
    return backend


def resolve_device(device: str, backend: str) -> str:
    """The device type the ranks compute on, for a resolved ``backend``: ``auto`` is cuda with nccl, else cpu.

    ``cuda`` with gloo puts the tensors on the GPU and lets gloo move them (its collectives take CUDA
    tensors through host memory): how two processes share one GPU. Asking for CUDA where none is
    visible, or for CPU tensors with nccl (which moves CUDA tensors only), is an error naming the flags.
    """
    if device not in DEVICES:
        raise ValueError(f"--device {device}: unknown device; choose one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if backend == "nccl" else "cpu"
    if device == "cuda" and not torch.backends.cuda.is_built():
        raise RuntimeError(f"--device cuda: this torch ({torch.__version__}) is built without CUDA; install a "
                           "CUDA build of torch, or use --device cpu (or auto)")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False); "
                           "use --device cpu (or auto)")
    if device == "cpu" and backend == "nccl":
        raise ValueError("--device cpu with --backend nccl: NCCL moves CUDA tensors only; use --backend gloo "
                         "(or auto) for CPU tensors")
    return device


def placement(backend: str = "auto", device: str = "auto") -> tuple[str, str]:
    """(backend, device type) the flags ``--backend`` and ``--device`` name, checked against this machine."""
    backend = resolve_backend(backend, device)
    return backend, resolve_device(device, backend)


def check_gpu_per_rank(backend: str, local_world_size: int) -> None:
    """NCCL gives each process a GPU of its own: more processes on a host than GPUs is refused here, on
    every rank, before PyTorch's "Duplicate GPU detected" from inside the first collective."""
    gpus = torch.cuda.device_count()
    if backend == "nccl" and local_world_size > gpus:
        raise RuntimeError(f"--backend nccl: {local_world_size} processes on this host and {gpus} GPU(s), and NCCL "
                           "needs a GPU per process: use --backend gloo (processes share a GPU) or more GPUs")


def _device_for(device_type: str, local_rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())  # ranks of one host share the GPUs
    torch.cuda.set_device(device)
    return device


def _init(backend: str, rank: int, local_rank: int, world_size: int, timeout_s: float, store=None,
          device: str = "auto") -> DistContext:
    backend, device_type = placement(backend, device)
    check_gpu_per_rank(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    device = _device_for(device_type, local_rank)
    kwargs = dict(backend=backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(**kwargs)
    _MODULES_AT_INIT.update(sys.modules)
    return DistContext(rank, local_rank, world_size, backend, device, timeout_s)


# What must let go of the process groups before they are destroyed (``before_teardown``).
_BEFORE_TEARDOWN: list[Callable[[], None]] = []


def before_teardown(callback: Callable[[], None]) -> None:
    """Have ``teardown`` call ``callback()`` before it destroys the group: for objects of a layer above this
    one that hold a group (the transports close, letting theirs go), so nothing keeps it past its end."""
    _BEFORE_TEARDOWN.append(callback)


def teardown() -> str | None:
    """Destroy the process group. Returns (and prints) a warning when something still references it.

    A group that outlives destroy_process_group keeps gloo's threads running into interpreter shutdown,
    where tearing them down can abort a process whose work succeeded. What is still referenced is
    usually pinned by a module imported after init_process_group that evaluates ``group.WORLD`` in a
    default argument (``torch.distributed.nn``, ``torch.distributed.optim``; import such modules first)
    or by a cache of PyTorch's (DTensor's, emptied here).
    """
    if not dist.is_initialized():
        return None
    for callback in _BEFORE_TEARDOWN:
        callback()
    _clear_dtensor_caches()
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    # A wrapped model in a reference cycle (PyTorch's DDP: its reducer holds the group) is freed now,
    # while Python is whole, not during shutdown.
    gc.collect()
    # With a failure in flight there is nothing to add: it is reported already, and the frames of its
    # traceback may be what holds the group.
    if world() is None or sys.exc_info()[0] is not None:
        return None
    holders = (", ".join(default_argument_holders(world(), set(sys.modules) - _MODULES_AT_INIT))
               or "none; a cache or a global holds it")
    warning = (f"warning: the default process group is {GROUP_OUTLIVED_TEARDOWN}, so its threads live on into "
               "interpreter shutdown, where the process can abort. Functions imported after the group was made "
               f"that hold it as a default argument (import them before): {holders}")
    print(warning, file=sys.stderr, flush=True)
    return warning


def _clear_dtensor_caches() -> None:
    """Empty DTensor's process-wide caches (PyTorch's fully_shard runs on DTensor), so the group can be freed.

    In torch 2.14 five of them keep device meshes, and a mesh keeps its process groups: redistribution
    planners and transforms, sharding decisions (Python and C++), mesh topologies. Best effort: where a
    version names them otherwise, ``teardown`` reports the group still referenced.
    """
    if "torch.distributed.tensor._redistribute" not in sys.modules:
        return  # DTensor never ran
    try:
        from torch.distributed.tensor import _redistribute, debug
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        clears = (_redistribute.clear_redistribute_planner_cache, _redistribute._gen_transform_infos.cache_clear,
                  MeshTopoInfo.build_from_mesh.cache_clear, debug._clear_sharding_prop_cache)
    except (ImportError, AttributeError):
        return
    for clear in clears:
        clear()


def default_argument_holders(group, module_names) -> list[str]:
    """The functions and methods of these modules with ``group`` among their default arguments."""
    def holds(fn) -> bool:
        if not isinstance(fn, types.FunctionType):
            return False
        return any(value is group for value in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()))

    found = []
    for name in sorted(module_names):
        module = sys.modules.get(name)
        for attr, value in list(vars(module).items()) if isinstance(module, types.ModuleType) else ():
            members = vars(value).items() if isinstance(value, type) and value.__module__ == name else ()
            found += [f"{name}.{attr}"] if holds(value) else []
            found += [f"{name}.{attr}.{member}" for member, fn in members if holds(fn)]
    return found


# What gloo and NCCL say when the other side of a message is gone or silent.
_PEER_SIGNS = ("Timed out", "timed out", "Connection reset", "Connection closed", "closed by peer",
               "Broken pipe", "communicator was aborted")


def _explain(error: BaseException, rank: int, world_size: int, timeout_s: float) -> BaseException:
    """Turn a transport error caused by a peer into one message that names the likely cause."""
    text = str(error)
    from_peer = isinstance(error, dist.DistBackendError) or any(sign in text for sign in _PEER_SIGNS)
    if isinstance(error, PeerFailedError) or not from_peer:
        return error
    return PeerFailedError(
        f"rank {rank}/{world_size}: a peer failed, diverged or stopped answering: a message or "
        f"collective did not complete within the {timeout_s:g} s process-group timeout, or a peer's "
        f"connection closed. Look at the other ranks' errors for the root cause. ({text.strip()[:300]})")


@contextmanager
def peer_failures_explained(rank: int, world_size: int, timeout_s: float):
    """Re-raise a transport error a peer caused as ``PeerFailedError``, from joining the group on: a peer that
    dies while this rank still connects (gloo's ``connectFullMesh``) is as much the cause as one that dies later."""
    try:
        yield
    except Exception as error:
        explained = _explain(error, rank, world_size, timeout_s)
        if explained is error:
            raise
        raise explained from error


@contextmanager
def distributed(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "auto"):
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
    try:  # from here on, the store's directory is removed whatever fails, set-up included
        with peer_failures_explained(rank, world_size, timeout_s):
            ctx = _init(backend, rank, local_rank, world_size, timeout_s, store, device)
            try:
                yield ctx
            finally:
                teardown()
    finally:
        if store is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def add_common_args(parser: argparse.ArgumentParser,
                    json_help: str = "write the results here in the shared JSON layout") -> None:
    """The flags every script shares: --backend, --device, --timeout, --json (check them with ``parse_checked``)."""
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="process-group backend; auto = nccl when the ranks compute on CUDA, else gloo "
                             "(default: %(default)s)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the ranks compute; auto = cuda with nccl (a GPU per rank, cycling), else cpu; "
                             "cuda with --backend gloo: ranks may share one GPU (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="process-group timeout in seconds: a stuck peer fails the job after this long "
                             "(default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", default=None, help=f"{json_help} (default: none)")


def parse_checked(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, then ``check_placement``."""
    args = parser.parse_args(argv)
    check_placement(parser, args)
    return args


def check_placement(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The device type of --backend and --device (``placement``), checked against this machine: a request it
    cannot serve (CUDA without a GPU, nccl with CPU tensors) exits with the parser's usage and the reason."""
    try:
        return placement(args.backend, args.device)[1]
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))


# --------------------------------------------------------------------------- local launcher


class WorkerError(RuntimeError):
    """A worker started by ``launch`` raised, crashed or hung; ``pids`` are the (now dead) workers."""

    def __init__(self, message: str, pids: Sequence[int]):
        super().__init__(message)
        self.pids = list(pids)


def worker_main(fn, rank, world_size, store_path, backend, pg_timeout_s, threads, args, out_dir, environ=None,
                streams=None, device="auto"):
    """One rank started by ``launch``: takes the launcher's environment and, from a forkserver, its stdout and
    stderr (``streams``), joins the group through the file store, runs ``fn(ctx, *args)`` and leaves
    ``result-<rank>.pt``, or ``error-<rank>.txt`` (time stamp and traceback) and exit status 1, in ``out_dir``."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    for target, inherited in zip((1, 2), streams or ()):
        fd = inherited.detach()
        os.dup2(fd, target)
        os.close(fd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    # A crash outside Python (a signal: SIGABRT from C++, SIGSEGV) leaves no traceback: the Python stack of every
    # thread at that moment, in crash-<rank>.txt, is what the launcher reports instead (``root_cause``).
    faulthandler.enable(open(os.path.join(out_dir, f"crash-{rank}.txt"), "w"), all_threads=True)
    torch.set_num_threads(threads)
    try:
        with peer_failures_explained(rank, world_size, pg_timeout_s):
            ctx = _init(backend, rank, rank, world_size, pg_timeout_s, dist.FileStore(store_path, world_size),
                        device)
            result = fn(ctx, *args)
        torch.save(result, os.path.join(out_dir, f"result-{rank}.pt"))
    except BaseException:
        # The time stamp lets the parent report the first failure (the root cause), not the
        # cascade of peers that failed because of it.
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        sys.exit(1)
    finally:
        teardown()


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


def root_cause(out_dir: str, processes) -> tuple[int, str]:
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
    crash = os.path.join(out_dir, f"crash-{rank}.txt")
    stacks = open(crash).read().strip() if os.path.exists(crash) else ""
    return rank, (f"exit code {code}, no traceback (killed, os._exit, or a crash outside Python)\n"
                  + (f"the Python stacks when it crashed:\n{stacks}\n" if stacks else ""))


class _Streams:
    """The launcher's stdout and stderr, handed to a worker as it starts: a forkserver child begins with the
    server's descriptors, not the launcher's, and a worker's output (a test capturing it, a log) belongs to the
    launcher. Pickled only while ``Process.start`` pickles its arguments, which is when descriptors can be sent."""

    def __reduce__(self):
        return tuple, ((reduction.DupFd(1), reduction.DupFd(2)),)


# What a forkserver imports once, so that every worker it forks starts with them loaded. torch._dynamo: the first
# torch.optim optimizer a process builds imports it, seconds of CPU that every worker would pay again (it starts
# no thread, so forking after it is safe).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy", "dpkit.comm.transport")


def _start_context():
    """How ``launch`` starts its workers: from a forkserver that imported torch once (``PRELOAD``), where the
    platform has one; else spawned, each importing torch itself (seconds of CPU per worker). Both run ``fn``
    in a process that shares no threads or state with the launcher."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def launch(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0,
           pg_timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1, device: str = "auto",
           hosts: Sequence[int] | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` fresh processes and return each rank's result.

    Workers start from a forkserver with torch imported once (``_start_context``; ``spawn`` where there is
    none) and meet through a FileStore in a new temporary directory (no port, so concurrent runs never
    collide). Each uses
    ``threads`` intra-op threads and computes on ``device`` (``resolve_device``: "cuda" with gloo shares
    the GPUs). ``fn`` must be importable (defined at module level)
    and its result picklable by ``torch.save``. ``hosts`` (ranks per host, e.g. ``(2, 2)``) simulates
    that many hosts: the workers' ``DPKIT_HOSTS`` (``dpkit.comm.hosts``); None keeps the environment's.

    The whole group must finish within ``timeout_s``. A worker that raises or exits
    without a result fails the launch with the root cause's traceback (see
    ``root_cause``); a hang past the timeout fails it naming the ranks still running.
    Either way every worker is terminated and reaped before ``WorkerError`` is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    environ = dict(os.environ)
    if hosts is not None:
        environ[HOSTS_ENV] = layout_value(hosts, world_size)
    mp = _start_context()
    tmp = tempfile.mkdtemp(prefix="dpkit-launch-")
    processes = []
    try:
        for rank in range(world_size):
            p = mp.Process(target=worker_main, name=f"rank{rank}",
                           args=(fn, rank, world_size, os.path.join(tmp, "store"), backend, pg_timeout_s, threads,
                                 args, tmp, environ, _Streams() if mp.get_start_method() == "forkserver" else None,
                                 device))
            p.start()
            processes.append(p)
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [p for p in processes if p.is_alive()]  # is_alive() also reaps, setting exitcode
            if any(p.exitcode not in (None, 0) for p in processes):
                time.sleep(0.5)  # let the peers it took down record their errors: the root cause may be among them
                for p in processes:
                    p.is_alive()
                rank, text = root_cause(tmp, processes)
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

    if not _BARS_LOCKED.is_set():
        # tqdm's default lock (made by its first bar) includes a multiprocessing lock: a named semaphore in
        # /dev/shm, which a worker stopped by a signal leaves behind until its launcher exits. One process draws
        # the bars, so a thread lock is enough, set before the first bar.
        tqdm.set_lock(threading.RLock())
        _BARS_LOCKED.set()
    return tqdm(iterable, dynamic_ncols=True, leave=False, **tqdm_kwargs)


_BARS_LOCKED = threading.Event()  # this process's bars take a thread lock (``progress``)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a host clock measures it; nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def message_device(device: torch.device | str, group=None) -> torch.device:
    """Where ``send``/``recv`` of ``group``'s backend take tensors meant for ``device``: host memory on gloo,
    whose collectives copy CUDA tensors themselves but whose send and recv do not; the device itself on NCCL."""
    device = torch.device(device)
    return device if device.type == "cpu" or dist.get_backend(group) == "nccl" else torch.device("cpu")


def new_subgroups(parent, members: Sequence[Sequence[int]], timeout_s: float | None, device=None) -> list:
    """This rank's process group for each list of global ranks it is in, None for the others: a collective
    over ``parent`` (every rank of it calls, with the same lists); no rank outside ``parent`` takes part.

    Only the members of a list make its group (``use_local_synchronization``), so groups of disjoint
    parents are made at the same time. torch names such a group after its ranks and a count of groups
    (``compat.subgroup_names_by_count``), a count a process advances only for the groups it makes: members
    with different histories would name one group differently and never meet. So every rank of ``parent``
    first sets its count to the largest of theirs, then to that plus the group's index before making each
    group, and ends at one shared count. ``device``: where ``parent`` sums (CUDA for NCCL; default the CPU);
    ``timeout_s``: the groups' timeout (None: torch's default).
    """
    count = torch.tensor([c10d._world.group_count], dtype=torch.int64, device=device)
    dist.all_reduce(count, dist.ReduceOp.MAX, group=parent)
    base, me = int(count.item()), dist.get_rank()
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)  # None: torch's default
    made = []
    with compat.subgroup_names_by_count():
        for index, ranks in enumerate(members):
            c10d._world.group_count = base + index
            made.append(dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True)
                        if me in ranks else None)
    c10d._world.group_count = base + len(members)
    return made


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat), or None if there is no such
    process here. A pid and its start time name one process: a reused pid has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (name)": state, ppid, ...
    except OSError:
        return None
    if fields[0] in (b"Z", b"X"):  # a zombie (dead, not yet reaped by its parent) will never count either
        return None
    return int(fields[19])
