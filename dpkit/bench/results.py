"""Results: the environment header, the one JSON layout all our benchmarks share, and tables.

Every script prints ``format_environment(environment(...))`` before it measures, and writes
``{schema, benchmark, complete, env, config, results: [row, ...], targets: [check, ...]}`` with
``write_results`` (times in seconds, memory in bytes, rows flat; ``targets`` holds the verdicts
the benchmark computed where it measured, which the README and the report read as they are;
``complete`` is false while a run is under way, or after one was stopped: the rows it finished).
``read_results`` refuses any other layout, naming the schema it expected.
``write_durably`` is how every file we produce is written (results, checkpoints, the executed notebook): whole or
not at all, flushed to the disk.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Sequence

import torch

from dpkit.comm import slots

RESULTS_SCHEMA = "dp-kit-results/2"  # 2: ratios with intervals over rounds, oversubscribed rows


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


# What a run writes (results, and README's block and the notebook rendered from them): changes there do not make
# the code that measured differ from its commit.
_WRITTEN_BY_RUNS = (":(top,exclude)results", ":(top,exclude)README.md", ":(top,exclude)report.ipynb")


def git_commit() -> str | None:
    """HEAD's short hash, with "+dirty" when tracked code differs from it: a file's commit then names code that
    is not the code that measured."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ":/", *_WRITTEN_BY_RUNS)
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+dirty" if commit and dirty else commit or None


def gpu_facts(device: torch.device) -> dict:
    """What a GPU result needs beside it: CUDA and NCCL versions, the GPU's memory (bytes) and compute
    capability. Empty keys' values (None) on the CPU, so CPU and GPU rows have the same header fields."""
    if device.type != "cuda":
        return {"cuda": None, "nccl": None, "gpu_memory_bytes": None, "gpu_capability": None}
    properties = torch.cuda.get_device_properties(device)
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    return {"cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "gpu_memory_bytes": properties.total_memory, "gpu_capability": f"{properties.major}.{properties.minor}"}


def environment(backend: str, device: torch.device | str, world_size: int, **extra) -> dict:
    """The environment header stored with, and printed before, every result."""
    device = torch.device(device)
    return {
        "torch": torch.__version__,
        **gpu_facts(device),
        "backend": backend,
        "device": device.type,
        "device_model": _device_model(device),
        "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cache_bytes": slots.last_level_cache_bytes(),  # the last-level cache (Linux's figure): where copies land
        "world_size": world_size,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "git_commit": git_commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def format_environment(env: dict) -> str:
    """A short header: what ran, on what."""
    lines = [
        f"* torch {env['torch']}" + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
        + (f", NCCL {env['nccl']}" if env.get("nccl") else ""),
        f"* backend {env['backend']}, device {env['device']} ({env['device_model']}"
        + (f", {env['gpu_memory_bytes'] / 2 ** 30:.0f} GiB, {env['gpus']} visible" if env.get("gpu_memory_bytes")
           else "") + ")",
        f"* world size {env['world_size']}, {env['threads']} thread(s) per process, {env['cpus']} CPUs",
    ]
    return "\n".join(lines)


def write_results(path: str, benchmark: str, env: dict, config: dict, rows: list[dict],
                  targets: list[dict] | None = None, complete: bool = True) -> None:
    """Write the shared JSON layout: ``{schema, benchmark, complete, env, config, results: [...], targets: [...]}``.

    Rows are flat dicts; times are in seconds and memory in bytes. ``targets``: the benchmark's
    target checks with their verdicts (each a flat dict with ``target``, ``limit``, ``ratio`` and
    ``verdict``), stored where they were computed. ``complete=False``: the rows of the configurations
    a run has finished so far, as measured (no derived rows, no targets). Written with
    ``write_durably``: a reader never sees half a file, and a failure leaves the old one.
    """
    doc = {"schema": RESULTS_SCHEMA, "benchmark": benchmark, "complete": complete, "env": env, "config": config,
           "results": rows, "targets": targets or []}
    text = json.dumps(doc, indent=1, default=_jsonable) + "\n"  # an unserialisable row fails before any file is touched
    write_durably(path, lambda f: f.write(text.encode()))


def write_durably(path: str, write) -> None:
    """Create or replace the file ``path`` so that no reader, crash or full disk ever sees half of it.

    ``write(f)`` fills a temporary file (binary) in the same directory; it is flushed to the
    disk (``fsync``), renamed over ``path`` (atomic), and the directory is flushed too, so the
    rename survives a power cut. On any failure (disk full, permission denied, an object that
    cannot be pickled) the temporary file is removed, ``path`` keeps its old content, and
    OSError names the path, the cause and what to do.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # from here on a failure can only be the directory's flush (below)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as error:
        if os.path.exists(tmp):
            os.remove(tmp)
        if not isinstance(error, Exception):  # Ctrl-C, a stop signal: no temporary file left, the stop goes on
            raise
        raise OSError(f"could not write {path} ({type(error).__name__}: {error}); it is unchanged and no temporary "
                      f"file is left. Check the free space and the permissions of {directory}, or write "
                      "elsewhere.") from error


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (torch.device, torch.dtype)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_results(path: str) -> dict:
    """Read a file written by ``write_results`` (its ``complete`` says whether its run ended), refusing other
    layouts."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != RESULTS_SCHEMA:
        raise ValueError(f"{path}: not a results file of layout {RESULTS_SCHEMA} "
                         f"(it says schema={doc.get('schema')!r}): re-run the command that wrote it "
                         "(results/manifest.json lists each file's command)")
    return doc


def incomplete_note(doc: dict) -> str:
    """What to say of a stopped run's file (empty for a complete one): its rows are what it finished."""
    if doc["complete"]:
        return ""
    return (f"incomplete run: {doc['benchmark']} was stopped; {len(doc['results'])} rows of the configurations it "
            "finished, no targets")


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table. ``columns`` are (key, header, format spec); a missing value prints as '-'."""
    def cell(row, key, spec):
        value = row.get(key)
        return "-" if value is None else format(value, spec)

    header = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("-" * (len(h) + 2) for _, h, _ in columns) + "|"
    body = ["| " + " | ".join(cell(row, k, s) for k, _, s in columns) + " |" for row in rows]
    return "\n".join([header, rule, *body])


def config_differences(base: dict, test: dict, ignored: Sequence[str] = ()) -> list[str]:
    """``key: baseline vs test`` for every config value that differs between two results documents."""
    keys = sorted((set(base["config"]) | set(test["config"])) - set(ignored))
    return [f"{k}: {base['config'].get(k, '-')!r} vs {test['config'].get(k, '-')!r}"
            for k in keys if base["config"].get(k) != test["config"].get(k)]


def check_comparable(base: dict, test: dict) -> None:
    """Refuse to compare results of two different benchmarks, naming both."""
    if base["benchmark"] != test["benchmark"]:
        raise ValueError(f"cannot compare a {base['benchmark']!r} results file with a {test['benchmark']!r} one: "
                         "diff two runs of the same benchmark")
