"""Results: the environment header, the one JSON layout all our benchmarks share, and tables.

Every script prints ``format_environment(environment(...))`` before it measures, and writes
``{schema, benchmark, env, config, results: [row, ...]}`` with ``write_results`` (times in
seconds, memory in bytes, rows flat). ``read_results`` refuses any other layout, naming the
schema it expected.
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

RESULTS_SCHEMA = "dp-kit-results/1"



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
