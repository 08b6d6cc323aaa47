"""What each DDP engine adds to a training step (in a world of one: its own work, nothing sent), counted.

    python ddp_step_profile.py --baseline REV --json results/profiles/ddp_step_profile.json   # ours now and at git REV
    torchrun --standalone --nproc_per_node 2 ddp_step_profile.py --baseline REV \
        --json results/profiles/ddp_step_profile_world2.json
    python ddp_step_profile.py --models cnn --steps 2 --timed-steps 8                    # a quick look

One process (or each rank under torchrun; rank 0's rows are kept) runs ``ddp_benchmark.py``'s step
(``dpkit.bench.ddp_step``: forward, cross-entropy, backward, SGD with momentum, ``zero_grad(set_to_none=True)``)
for no DDP, PyTorch's DDP at its defaults and at its best settings, and ours (rows named as the benchmark's:
"no ddp", "ddp pytorch", "ddp pytorch best", "ddp ours", bucketed at 25 MiB on the "torch" transport), also as
of ``--baseline``.
Per step, counted by ``torch.profiler`` over ``--steps`` steps (deterministic: the evidence):
* ``ops``: dispatched aten operators, nested ones included (on the CPU the stand-in for kernel launches);
  ``copies``: ``aten::copy_``; ``allocations``: ``aten::empty*``; ``scalar_reads``:
  ``aten::_local_scalar_dense`` (``.item()``, ``bool(t)``: a device synchronisation for a GPU tensor);
  ``collectives``: c10d's; on CUDA ``launches`` (kernel launches) and ``syncs`` (stream/device waits);
* ``hooks_s``: time in the engine's outermost frames inside backward (ours: Python hooks and the end
  callback; PyTorch's C++ reducer: only its ranges), under the profiler's Python tracer, which inflates
  it: compare rows with each other only.
``step_s``: the median unprofiled host time of ``--timed-steps`` steps, rounds rotated; on a shared
machine it is noisy, the counts are the evidence. The target: ours adds no more ``ops`` than PyTorch's
best. The GPU measurement that confirms it (``tools/gpu_check.sh``'s step ddp-world1):
``torchrun --nproc_per_node 1 ddp_benchmark.py --models resnet18 cnn --variants "ddp pytorch" "ddp pytorch best"
"ddp ours" --bucket-sizes 25 --iters 120 --rounds 8 --device cuda --backend nccl``: ours' overhead over
no DDP against PyTorch's best's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Callable

import torch
from torch import nn

from dpkit.bench import harness
from dpkit.bench.ddp_step import OURS, PYTORCH, PYTORCH_BEST, PYTORCH_BEST_KIND, Replica, sgd
from dpkit.comm import transport
from dpkit.comm.process_groups import add_common_args, parse_checked, synchronize
from dpkit.engines import ddp
from dpkit.models import NUM_CLASSES, build_model

NO_DDP = "no ddp"
BUCKET_MB = 25.0  # the benchmark's rows: PyTorch's default cap, ours at the same
# Frames and ranges that are an engine's own (Python files, PyTorch's reducer ranges); the baseline's
# copy of ours is imported from a temporary file named ddp_baseline.py.
ENGINE_FRAMES = ("engines/ddp.py(", "ddp_baseline.py(", "nn/parallel/distributed.py(", "reducer")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COUNTS = ("ops", "copies", "allocations", "scalar_reads", "collectives", "launches", "syncs")


def load_baseline(revision: str):
    """``dpkit/engines/ddp.py`` as of a git revision, imported as a module of its own (it imports the rest of
    dpkit as it is now)."""
    source = subprocess.run(["git", "show", f"{revision}:dpkit/engines/ddp.py"], capture_output=True, text=True,
                            check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="ddp_baseline_"), "ddp_baseline.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("ddp_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddp_baseline"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def engines(baseline_revision: str | None,
            wire: transport.Transport) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """Row name -> how to wrap a fresh module, in the order of the rows."""
    def ours(engine_module):
        # A revision from before the engine registry's names knows our DDP as "bucketed".
        name = "ours" if "ours" in getattr(engine_module, "VARIANTS", ()) else "bucketed"
        return lambda m: engine_module.make_ddp(name, m, BUCKET_MB, find_unused_parameters=False, transport=wire)

    made = {NO_DDP: lambda m: m,
            PYTORCH: lambda m: ddp.make_ddp("pytorch", m, BUCKET_MB),
            PYTORCH_BEST_KIND: lambda m: ddp.make_ddp("pytorch", m, BUCKET_MB, **PYTORCH_BEST)}
    if baseline_revision:
        made[f"{OURS}@{baseline_revision}"] = ours(load_baseline(baseline_revision))
    made[OURS] = ours(ddp)
    return made


def replica(name: str, wrap, args, device: torch.device) -> Replica:
    torch.manual_seed(args.seed)  # the same weights and batch for every row
    model = wrap(build_model(name).to(device).train())
    size = 32 if name == "cnn" else args.image_size
    inputs = torch.randn(args.batch_size, 3, size, size).to(device)
    targets = torch.randint(NUM_CLASSES, (args.batch_size,)).to(device)
    return Replica(model, sgd(model), inputs, targets, waits=[])


def count_events(events) -> dict:
    """Per-profile counts of ``COUNTS`` from the profiler's events."""
    names = Counter(e.name for e in events)
    return {"ops": sum(n for k, n in names.items() if k.startswith("aten::")),
            "copies": names["aten::copy_"],
            "allocations": sum(n for k, n in names.items() if k.startswith("aten::empty")),
            "scalar_reads": names["aten::_local_scalar_dense"],
            "collectives": sum(n for k, n in names.items() if k.startswith("c10d::")),
            "launches": sum(names[k] for k in LAUNCHES), "syncs": sum(names[k] for k in SYNCS)}


def hooks_seconds(events) -> float | None:
    """Seconds in the outermost engine frames that run inside a ``backward`` range; None where the profiler
    recorded no Python frame at all (a torch whose stack tracer does not record them: nothing to time)."""
    if not any(".py(" in event.name for event in events):
        return None
    total = 0.0
    for event in events:
        if not any(mark in event.name for mark in ENGINE_FRAMES):
            continue
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if "backward" in ancestors and not any(mark in a for a in ancestors for mark in ENGINE_FRAMES):
            total += event.time_range.elapsed_us() * 1e-6
    return total


def profile(rep: Replica, steps: int, device: torch.device) -> dict:
    """Per-step counts and hook seconds over ``steps`` profiled steps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(steps):
            rep.step()
        synchronize(device)
    events = prof.events()
    counts = count_events(events)
    hooks = hooks_seconds(events)
    return {**{k: v / steps for k, v in counts.items()}, "hooks_s": None if hooks is None else hooks / steps}


def timed(replicas: dict[str, Replica], args, device: torch.device) -> dict[str, float]:
    """Median host seconds per step of each replica: ``--rounds`` rounds, the order rotated each round."""
    samples = {name: [] for name in replicas}
    names = list(replicas)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            replicas[name].step()  # warm-up after another replica ran
            for _ in range(max(1, args.timed_steps // args.rounds)):
                synchronize(device)
                start = time.perf_counter()
                replicas[name].step()
                synchronize(device)
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure_model(name: str, wraps: dict, args, device: torch.device) -> list[dict]:
    replicas = {row: replica(name, wrap, args, device) for row, wrap in wraps.items()}
    for rep in replicas.values():
        for _ in range(args.warmup):
            rep.step()
    rows = [{"model": name, "variant": row, **profile(rep, args.steps, device)} for row, rep in replicas.items()]
    times = timed(replicas, args, device)
    base = rows[0]
    for row in rows:
        row["step_s"] = times[row["variant"]]
        row["step_over_no_ddp"] = row["step_s"] / times[NO_DDP] - 1
        for key in COUNTS:
            row[f"{key}_over_no_ddp"] = row[key] - base[key]
    return rows


def worker(ctx, args) -> list[dict]:
    wire = transport.resolve("torch", device=ctx.device)  # the benchmark's GPU row: torch.distributed's
    wraps = engines(args.baseline, wire)
    return [row for name in args.models for row in measure_model(name, wraps, args, ctx.device)]


def targets(rows: list[dict]) -> list[dict]:
    """Per model: the aten operators ours adds to no DDP against those PyTorch's best adds (at most: met)."""
    checks = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["variant"]: r for r in rows if r["model"] == model}
        ours, best = by[OURS]["ops_over_no_ddp"], by[PYTORCH_BEST_KIND]["ops_over_no_ddp"]
        checks.append({"target": f"{model}: ops ddp ours adds <= ops ddp pytorch best adds", "limit": 1.0,
                       "ours": ours, "reference": best, "ratio": ours / best if best else None,
                       "verdict": "met" if ours <= best else "missed"})
    return checks


def _milliseconds(seconds: float | None) -> str:
    return f"{'n/a':>9}" if seconds is None else f"{seconds * 1e3:9.2f}"


def report(rows: list[dict]) -> str:
    head = (f"{'model':9} {'variant':20} {'ops':>7} {'+ops':>6} {'copies':>7} {'allocs':>7} {'scalar':>7} "
            f"{'coll':>5} {'launch':>7} {'hooks ms':>9} {'step ms':>8} {'+step':>7}")
    lines = [head] + [
        f"{r['model']:9} {r['variant']:20} {r['ops']:7.0f} {r['ops_over_no_ddp']:+6.0f} {r['copies']:7.0f} "
        f"{r['allocations']:7.0f} {r['scalar_reads']:7.0f} {r['collectives']:5.0f} {r['launches']:7.0f} "
        f"{_milliseconds(r['hooks_s'])} {r['step_s'] * 1e3:8.2f} {r['step_over_no_ddp']:+7.1%}" for r in rows]
    checks = [f"* {c['target']}: {c['ours']:+.0f} vs {c['reference']:+.0f}: {c['verdict']}" for c in targets(rows)]
    legend = ("counts per step (+: over no DDP); hooks ms under the profiler's Python tracer; step ms: median "
              "host time, unprofiled (a shared machine: noisy)")
    return "\n".join(["", legend, *lines, "", *checks])


BENCHMARK = harness.Benchmark("ddp_step_profile", worker, world_sizes=lambda args: [1], report=report,
                              targets=targets, world_of_one_here=True,
                              describe=lambda args: f"models {', '.join(args.models)}, batch {args.batch_size}, "
                                                    f"baseline {args.baseline or 'none'}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=("cnn", "resnet18", "resnet50"), default=["resnet18", "cnn"],
                        help="models to profile (default: %(default)s)")
    parser.add_argument("--baseline", metavar="REV", default=None,
                        help="also profile ours (dpkit/engines/ddp.py) as of this git revision (default: none)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per row (default: %(default)s)")
    parser.add_argument("--timed-steps", type=int, default=24, help="timed steps per row (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help="timing rounds, order rotated (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before profiling (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per step (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=32, help="resnet input size (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="weights and batch seed (default: %(default)s)")
    add_common_args(parser)
    return parser


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = parse_checked(parser, argv)
    if min(args.steps, args.timed_steps, args.rounds) < 1 or args.warmup < 0 or args.batch_size < 2:
        parser.error("--steps, --timed-steps and --rounds must be >= 1, --warmup >= 0, --batch-size >= 2 (BatchNorm)")
    return harness.run(BENCHMARK, args)


if __name__ == "__main__":
    main()
