"""Anchors: other libraries' collectives, timed beside the backend axis's in the same ranks and rounds.

    python collectives_benchmark.py --axis backends --procs 2 --anchors      # results/backend_anchors.json: README

* ``openmpi``: Open MPI through mpi4py's buffer methods, on numpy views of the axis's own tensors, for every
  collective of the axis. Its ranks must be MPI ranks: each world is started by mpirun (``dpkit.bench.mpirun``,
  which holds Open MPI to its shared-memory BTL).
* ``deepspeed``: DeepSpeed's shared-memory all-reduce (its ``shm.cpp``), compiled by the launcher before any
  rank starts; left out where ranks outnumber cores (its ranks spin while they wait).
* ``memory``: no library, the memory's own bound on an all-reduce: each rank's ``torch.add(a, b, out=c)`` over the
  message's bytes on one thread, every rank at once (as an all-reduce's ranks share the memory).

``available`` says which can run (one line for each that cannot), ``launcher`` starts the worlds they need,
``make`` builds them in a rank; their rows carry ``anchor``, ``anchor_version`` and ``anchor_settings``, and
``with_ratios`` adds the "dpkit" backend's time over each anchor's, paired by round as ``measure`` pairs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.distributed as dist

from dpkit.bench import mpirun
from dpkit.bench.collectives import NAMES, format_size
from dpkit.bench.measure import format_ratio, oversubscribed, paired_ratio
from dpkit.bench.results import markdown_table
from dpkit.comm.process_groups import launch, print0

ANCHORS = ("openmpi", "deepspeed", "memory")
LABELS = {"openmpi": "Open MPI (mpi4py)", "deepspeed": "DeepSpeed shm", "memory": "a + b -> c (one core)"}
MPI_CALLS = {"allreduce": "Allreduce", "broadcast": "Bcast", "reduce": "Reduce", "all_gather": "Allgather",
             "reduce_scatter": "Reduce_scatter_block", "all_to_all": "Alltoall", "barrier": "Barrier"}
COMPILE_TIMEOUT_S = 900.0  # the first build of DeepSpeed's op runs g++ on two files
# The op DeepSpeed's ``inference_all_reduce`` dispatches to when its shm kernel serves the dtype (else it calls
# torch.distributed.all_reduce): timed directly, so no fallback can stand in for it.
DEEPSPEED_OP = "inference_all_reduce_"
# How shm.cpp names the segment of each rank in /dev/shm: the user id, MASTER_ADDR, MASTER_PORT, the rank.
DEEPSPEED_SEGMENT = "deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"
SHM_DIR = "/dev/shm"
# Loads the op as DeepSpeed's builder does (compiling it at first use); prints the ISA level of its kernels and
# the library's path.
_BUILD = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
          "from deepspeed.accelerator import get_accelerator\n"
          "op = get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)\n"
          "print(op.vector_kernel_level(), op.__file__)")
# Where the launcher tells the ranks which library it built: a rank loads that file alone, without importing
# deepspeed, whose import after the process group exists would hold the group in default arguments
# (``process_groups.teardown`` warns of those).
DEEPSPEED_OP_ENV = "DPKIT_DEEPSPEED_OP"


# --------------------------------------------------------------------------- the launcher: which anchors, which world


def available(names: list[str], under_torchrun: bool) -> tuple[list[str], list[str]]:
    """(the anchors of ``names`` that can run, one line for each that cannot and why). DeepSpeed's op is compiled
    here, once, before any rank starts (a rank then loads it from torch's extension cache)."""
    usable, skipped = [], []
    for name in names:
        reason = (_openmpi_missing(under_torchrun) if name == "openmpi" else _deepspeed_missing()
                  if name == "deepspeed" else None)
        if reason:
            skipped.append(f"anchor {LABELS[name]} skipped: {reason}")
        else:
            usable.append(name)
    return usable, skipped


def _openmpi_missing(under_torchrun: bool) -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -r requirements-anchors.txt)"
    if mpirun.find() is None:
        return "no mpirun (pip install -r requirements-anchors.txt)"
    if under_torchrun:
        return "its ranks must be MPI ranks: run the script without torchrun, and --anchors starts them with mpirun"
    return None


def _deepspeed_missing(timeout_s: float = COMPILE_TIMEOUT_S) -> str | None:
    """Why DeepSpeed's shm all-reduce cannot run here, or None once its op is built, its float32 kernel can run and
    ``DEEPSPEED_OP_ENV`` names the library (for the ranks this process starts, which inherit it)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install -r requirements-anchors.txt)"
    process = subprocess.Popen([sys.executable, "-c", _BUILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)  # its own group: g++ dies with it on a timeout
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return f"its op did not compile within {timeout_s:g} s"
    if process.returncode != 0:
        return "its op did not build or load: " + ((err.strip().splitlines() or ["no message"])[-1])
    level, path = out.strip().splitlines()[-1].split(" ", 1)
    if int(level) < 1:  # shm.cpp's float32 kernel uses AVX2; deepspeed.comm would fall back to torch.distributed
        return "this CPU lacks AVX2, which its float32 kernel needs"
    os.environ[DEEPSPEED_OP_ENV] = path
    return None


def launcher(names: list[str]) -> Callable[..., list]:
    """What starts each world (``harness.Benchmark.launcher``): mpirun where Open MPI is measured, else
    ``process_groups.launch``; with DeepSpeed, inside ``deepspeed_names``."""
    return functools.partial(_launch, list(names))


def _launch(names: list[str], fn, world_size: int, *args, **kwargs) -> list:
    start = mpirun.launch if "openmpi" in names else launch
    with deepspeed_names(world_size) if "deepspeed" in names else nullcontext():
        return start(fn, world_size, *args, **kwargs)


def segment_paths(world_size: int, addr: str, port: str, uid: int | None = None) -> list[str]:
    """The /dev/shm files DeepSpeed's ranks make in a world that has ``addr`` and ``port`` as its master's."""
    uid = os.getuid() if uid is None else uid
    return [os.path.join(SHM_DIR, DEEPSPEED_SEGMENT.format(uid=uid, addr=addr, port=port, rank=rank))
            for rank in range(world_size)]


@contextmanager
def deepspeed_names(world_size: int):
    """The world's ``MASTER_ADDR`` and ``MASTER_PORT``, which name DeepSpeed's segments (nothing else reads them:
    the ranks meet through a file): a port free now, whose names no file has. Afterwards the environment is as
    it was and this world's segments are gone, whatever ended it (a rank unlinks its own once every rank has
    mapped them all; this removes those a failure left)."""
    saved = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT")}
    addr = "127.0.0.1"
    while True:
        with socket.socket() as probe:
            probe.bind((addr, 0))
            port = str(probe.getsockname()[1])
        paths = segment_paths(world_size, addr, port)
        if not any(os.path.exists(path) for path in paths):
            break
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=port)
    try:
        yield paths
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --------------------------------------------------------------------------- in a rank: the anchors themselves


class OpenMPI:
    """Open MPI's collectives on a duplicate of MPI_COMM_WORLD, whose ranks are torch.distributed's."""

    name, label = "openmpi", LABELS["openmpi"]

    def __init__(self, ctx):
        if "OMPI_COMM_WORLD_RANK" not in os.environ:
            raise RuntimeError("this rank was not started by mpirun")
        if os.environ.get("OMPI_MCA_btl") != "self,sm":  # else ob1 could carry the bytes over TCP
            raise RuntimeError("Open MPI is not held to its shared-memory BTL (--mca btl self,sm)")
        import mpi4py
        from mpi4py import MPI

        self.mpi, self.comm = MPI, MPI.COMM_WORLD.Dup()
        if self.comm.Get_rank() != ctx.rank or self.comm.Get_size() != ctx.world_size:
            raise RuntimeError(f"MPI rank {self.comm.Get_rank()} of {self.comm.Get_size()} is torch's {ctx.rank} of "
                               f"{ctx.world_size}")
        library = MPI.Get_library_version().split(",")[0].strip()  # "Open MPI v5.0.11"
        # What Open MPI read (the MCA parameters reach a rank as OMPI_MCA_* variables), and how mpirun was called.
        mca = [f"{key}={os.environ[f'OMPI_MCA_{key}']}" for key, _ in mpirun.SHARED_MEMORY + mpirun.OVERSUBSCRIBED
               if f"OMPI_MCA_{key}" in os.environ]
        self.fields = {"anchor": self.name, "anchor_version": f"{library}, mpi4py {mpi4py.__version__}",
                       "anchor_settings": f"mca {' '.join(mca)}; mpirun {os.environ.get(mpirun.FLAGS_ENV, '?')}"}

    def algorithm(self, collective: str) -> str:
        return f"MPI.{MPI_CALLS[collective]}"

    def call(self, collective: str, full: torch.Tensor, part: torch.Tensor) -> Callable[[], object] | None:
        """The collective on the tensors of ``backend_call``: ``full`` the whole tensor, ``part`` a shard or
        all-to-all's output; rank 0 the root."""
        mpi, comm, f, p = self.mpi, self.comm, full.numpy(), part.numpy()  # views: MPI reads and writes the tensors
        root = comm.Get_rank() == 0
        return {"allreduce": lambda: comm.Allreduce(mpi.IN_PLACE, f, op=mpi.SUM),
                "broadcast": lambda: comm.Bcast(f, root=0),
                "reduce": lambda: comm.Reduce(mpi.IN_PLACE if root else f, f if root else None, op=mpi.SUM, root=0),
                "all_gather": lambda: comm.Allgather(p, f),
                "reduce_scatter": lambda: comm.Reduce_scatter_block(f, p, op=mpi.SUM),
                "all_to_all": lambda: comm.Alltoall(f, p),
                "barrier": comm.Barrier}[collective]

    def close(self) -> None:
        self.comm.Free()


class DeepSpeedShm:
    """DeepSpeed's shared-memory all-reduce, without ``deepspeed.comm.init_distributed``: the library the launcher
    built is loaded (``DEEPSPEED_OP_ENV``) and initialised here as ``TorchBackend`` initialises it, and the
    process group stays the harness's."""

    name, label = "deepspeed", LABELS["deepspeed"]
    _initialised = False  # shm.cpp initialises once per process, for one world

    def __init__(self, ctx):
        if DeepSpeedShm._initialised:
            raise RuntimeError("shm.cpp initialises once per process, and this process has joined another world")
        if oversubscribed(ctx.world_size, ctx.device):
            raise RuntimeError(f"more processes than the {os.cpu_count()} cores, and its ranks spin while they wait")
        if int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)) != ctx.world_size:
            raise RuntimeError("its shared memory needs every rank on this host")
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError("no MASTER_ADDR and MASTER_PORT, which name its segments")
        self.op = load_library(os.environ.get(DEEPSPEED_OP_ENV, ""))
        level = self.op.vector_kernel_level()
        if level < 1:
            raise RuntimeError("this CPU lacks AVX2, which its float32 kernel needs")
        self.fields = {"anchor": self.name, "anchor_version": f"DeepSpeed {importlib.metadata.version('deepspeed')}",
                       "anchor_settings": f"LOCAL_SIZE={ctx.world_size}, vector kernel level {level}"}
        self._ctx = ctx

    def start(self) -> None:
        """Every rank's segment made and mapped (``initialize`` returns only then: every rank calls it at once),
        then the names unlinked: the mappings stay, and a run that dies later leaves nothing in /dev/shm."""
        ctx = self._ctx
        os.environ["LOCAL_SIZE"] = str(ctx.world_size)  # equal to the world: shm.cpp takes its shared-memory path
        self.op.initialize(ctx.world_size, ctx.rank)
        DeepSpeedShm._initialised = True
        mine = segment_paths(ctx.world_size, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])[ctx.rank]
        made = os.path.exists(mine)
        dist.barrier()
        if not made:
            raise RuntimeError(f"DeepSpeed made no {mine}: it did not take its shared-memory path")
        os.unlink(mine)

    def algorithm(self, collective: str) -> str:
        return f"torch.ops.deepspeed.{DEEPSPEED_OP}"

    def call(self, collective: str, full: torch.Tensor, part: torch.Tensor) -> Callable[[], object] | None:
        """The all-reduce (a float32 sum, in place); None for every other collective."""
        op = getattr(torch.ops.deepspeed, DEEPSPEED_OP)
        return functools.partial(op, full) if collective == "allreduce" else None

    def close(self) -> None:
        pass


class OneCoreSum:
    """The all-reduce's bound in memory traffic, no library: each rank's own ``a + b -> c`` over the message's bytes,
    one thread, every rank at once in the same rounds (the sum's inputs: the all-reduce's tensor and its
    neighbour's; ``check``: exact against float64)."""

    name, label = "memory", LABELS["memory"]

    def __init__(self, ctx):
        self.fields = {"anchor": self.name, "anchor_version": f"torch {torch.__version__}",
                       "anchor_settings": f"torch.add(a, b, out=c), {torch.get_num_threads()} thread(s) a rank"}

    def algorithm(self, collective: str) -> str:
        return "torch.add"

    def call(self, collective: str, full: torch.Tensor, part: torch.Tensor) -> Callable[[], object] | None:
        """``full + part -> c`` where the all-reduce's ``part`` is as long as ``full``; None for other collectives."""
        if collective != "allreduce" or part.numel() != full.numel():
            return None
        return functools.partial(torch.add, full, part, out=torch.empty_like(full))

    def check(self, call: Callable[[], object], full: torch.Tensor, part: torch.Tensor) -> Callable[[], float]:
        """One call of ``call`` on small integers (exact in float32): its largest error against float64."""
        def error() -> float:
            full.copy_(torch.arange(full.numel()) % 1024)
            part.copy_(torch.arange(part.numel()) % 512)
            out = call()
            return (out.double() - (full.double() + part.double())).abs().max().item()
        return error

    def close(self) -> None:
        pass


def load_library(path: str):
    """The Python module of DeepSpeed's shm op at ``path`` (loading it registers ``torch.ops.deepspeed``), checked
    first as a file this user owns and no one else may write."""
    if not path or not os.path.isfile(path):
        raise RuntimeError("the launcher built no op for it (anchors.available)")
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise RuntimeError(f"{path} is not this user's alone")
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)  # as torch.utils.cpp_extension imports what it built
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KINDS = {"openmpi": OpenMPI, "deepspeed": DeepSpeedShm, "memory": OneCoreSum}


def make(ctx, names: list[str]) -> dict[str, object]:
    """Label -> anchor, for each of ``names`` that every rank could build; one line (rank 0) for each left out.
    A collective: every rank calls it with the same names."""
    made = {}
    for name in names:
        try:
            anchor, reason = KINDS[name](ctx), None
        except (ImportError, RuntimeError, OSError) as error:
            anchor, reason = None, str(error)
        if not _everywhere(anchor is not None):
            print0(f"anchor {LABELS[name]} skipped at {ctx.world_size} processes: {reason or 'a peer could not'}")
            continue
        if hasattr(anchor, "start"):
            anchor.start()
        made[anchor.label] = anchor
    return made


def _everywhere(ok: bool) -> bool:
    """True on every rank when ``ok`` is true on every rank."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, dist.ReduceOp.MIN)
    return bool(flag.item())


# --------------------------------------------------------------------------- rows and the report


def with_ratios(rows: list[dict], label: str) -> list[dict]:
    """The rows of one ``measure`` call, each anchor's with ``label``'s time over its own, paired round by round
    (``paired_ratio`` of their per-round times, as ``vs_torch``): ``backend_vs_anchor`` and its interval."""
    ours = next((row for row in rows if row["label"] == label), None)
    if ours is None:
        return rows
    out = []
    for row in rows:
        if "anchor" in row:
            ratio = paired_ratio(ours["round_p50_s"], row["round_p50_s"])
            row = {**row, "backend_vs_anchor": ratio["median"], "backend_vs_anchor_ci_low": ratio["ci_low"],
                   "backend_vs_anchor_ci_high": ratio["ci_high"], "backend_vs_anchor_of": label}
        out.append(row)
    return out


RATIO_COLUMNS = [("world_size", "procs", "d"), ("collective", "collective", "s"), ("size", "size", "s"),
                 ("label", "anchor", "s"), ("anchor_version", "version", "s"),
                 ("ratio", "backend / anchor [95% CI]", "s")]


def ratio_lines(rows: list[dict]) -> list[str]:
    """The anchors' rows as a table: the backend's time over each anchor's, with its 95 % interval (no rows: none)."""
    mine = [row for row in rows if row.get("backend_vs_anchor") is not None]
    if not mine:
        return []
    shown = [{**row, "collective": NAMES[row["collective"]], "size": format_size(row["bytes"]),
              "ratio": format_ratio({"median": row["backend_vs_anchor"], "ci_low": row["backend_vs_anchor_ci_low"],
                                     "ci_high": row["backend_vs_anchor_ci_high"], "rounds": row["rounds"]})}
             for row in mine]
    crowded = sorted({row["world_size"] for row in mine if row.get("oversubscribed")})
    note = f" (oversubscribed: {', '.join(map(str, crowded))} processes on {os.cpu_count()} cores)" if crowded else ""
    return ["", f"## {mine[0]['backend_vs_anchor_of']} against the anchors: its p50 / theirs, paired by round{note}",
            "", markdown_table(shown, RATIO_COLUMNS)]
