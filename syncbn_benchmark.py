"""Time and memory of synchronized BatchNorm, forward + backward, ours against PyTorch.

    python syncbn_benchmark.py                    # spawns 2 workers itself (gloo on CPU; nccl when GPUs are visible)
    python syncbn_benchmark.py --quick            # a fast run of the same grid (seconds)
    torchrun --standalone --nproc_per_node 2 syncbn_benchmark.py --json results/syncbn.json

The homework's setup: a global batch of B samples (split evenly over the workers) with
H channels, standard normal float32 inputs, loss = sum of the outputs over the first
B/2 samples of the global batch (so with 2 workers, rank 1 gets a zero upstream
gradient and still joins both collectives). One iteration = forward + backward; the
inputs are made before the timed region; every iteration starts with a barrier; an
iteration counts as long as its slowest rank; we report the median (and p10/p90) over
many iterations, taken in interleaved rounds so that load from other processes hits
every implementation alike. Peak memory is measured in a separate untimed pass
(``measure.PeakMemory``), and "saved" is what autograd keeps for backward after the
forward pass (``measure.saved_tensor_bytes``).

Implementations:

* ``ours``: ``syncbn.SyncBatchNorm`` (one all_reduce in forward, one in backward).
* ``BatchNorm1d (local)``: ``torch.nn.BatchNorm1d`` on each rank's local batch, with no
  communication: the lower bound, and the only PyTorch reference on the CPU, because
  ``torch.nn.SyncBatchNorm`` refuses CPU tensors.
* ``BatchNorm1d + 2 all_reduce``: the same plus two ``all_reduce`` calls of 2C + 1
  float32 values, one after forward and one after backward: the cost of a perfect
  synchronized BatchNorm with the communication it cannot avoid.
* ``torch.nn.SyncBatchNorm``: on CUDA only.

Targets, printed with every run: on CPU, ours <= 1.3 x (BatchNorm1d + 2 all_reduce) and
ours saves no more bytes for backward than BatchNorm1d; on CUDA, ours faster than
``torch.nn.SyncBatchNorm`` with no more peak memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist

from dist_utils import add_common_args, distributed, launch, progress, resolve_backend
from measure import PeakMemory, Timing, gather_rows, saved_tensor_bytes, time_iterations
from results import environment, format_environment, markdown_table, write_results
from syncbn import SyncBatchNorm

OURS, LOCAL, REFERENCE, TORCH_SYNC = "ours", "BatchNorm1d (local)", "BatchNorm1d + 2 all_reduce", "torch.nn.SyncBatchNorm"
CPU_TARGET = 1.3  # ours / (BatchNorm1d + 2 all_reduce) on CPU


# --------------------------------------------------------------------------- one case


def _make_layer(impl: str, hidden: int, device: torch.device) -> torch.nn.Module:
    if impl == OURS:
        layer = SyncBatchNorm(hidden)
    elif impl == TORCH_SYNC:
        layer = torch.nn.SyncBatchNorm(hidden)
    else:
        layer = torch.nn.BatchNorm1d(hidden)
    return layer.to(device).train()


def _make_step(impl: str, layer: torch.nn.Module, x: torch.Tensor, loss_rows: int) -> Callable[[], None]:
    """One iteration: forward, the homework's loss over this rank's share of the first B/2 samples, backward."""
    if impl != REFERENCE:
        def step():
            x.grad = None
            layer(x)[:loss_rows].sum().backward()
        return step

    # BatchNorm's own work plus the two collectives a synchronized BatchNorm cannot avoid.
    channels = x.size(1)
    forward_stats, backward_stats = x.new_zeros(2 * channels + 1), x.new_zeros(2 * channels + 1)

    def reference_step():
        x.grad = None
        y = layer(x)
        dist.all_reduce(forward_stats)
        y[:loss_rows].sum().backward()
        dist.all_reduce(backward_stats)
    return reference_step


def _local_input(ctx, batch: int, hidden: int) -> tuple[torch.Tensor, int]:
    """This rank's rows of the global (batch, hidden) input, and how many of them are in the first batch/2."""
    local = batch // ctx.world_size
    generator = torch.Generator().manual_seed(1000 * ctx.rank + hidden + batch)
    x = torch.randn(local, hidden, generator=generator).to(ctx.device).requires_grad_()
    start = ctx.rank * local
    loss_rows = max(0, min(local, batch // 2 - start))
    return x, loss_rows


def _measure_memory(ctx, impl: str, hidden: int, x: torch.Tensor, loss_rows: int) -> tuple[int, int]:
    """(peak bytes of one iteration, bytes saved for backward by one forward), on a fresh layer; maxima over ranks."""
    layer = _make_layer(impl, hidden, ctx.device)
    step = _make_step(impl, layer, x, loss_rows)
    step()  # warm: first-call allocations (e.g. cached constants) are not the steady state
    with PeakMemory(ctx.device) as peak:
        step()
    saved = saved_tensor_bytes(lambda: layer(x))
    # Ranks differ (rank 0 holds the loss rows): report the largest.
    most = gather_rows([peak.bytes, saved]).max(dim=0).values
    return int(most[0]), int(most[1])


def run_case(ctx, impls: list[str], batch: int, hidden: int, iters: int, rounds: int, warmup: int) -> list[dict]:
    """Every implementation on one (batch, hidden), timed in ``rounds`` interleaved rounds."""
    x, loss_rows = _local_input(ctx, batch, hidden)
    steps = {impl: _make_step(impl, _make_layer(impl, hidden, ctx.device), x, loss_rows) for impl in impls}
    parts: dict[str, list[torch.Tensor]] = {impl: [] for impl in impls}
    per_round = max(1, iters // rounds)
    for round_ in range(rounds):
        order = impls if round_ % 2 == 0 else impls[::-1]
        for impl in order:
            timing = time_iterations(steps[impl], per_round, warmup=warmup if round_ == 0 else 2, device=ctx.device)
            parts[impl].append(timing.per_rank)
    rows = []
    for impl in impls:
        timing = Timing(torch.cat(parts[impl], dim=1))
        peak, saved = _measure_memory(ctx, impl, hidden, x, loss_rows)
        rows.append({"impl": impl, "device": ctx.device.type, "batch": batch, "hidden": hidden,
                     "workers": ctx.world_size, "local_batch": x.size(0), "iters": timing.per_rank.size(1),
                     "time_s": timing.median, "p10_s": timing.percentile(10), "p90_s": timing.percentile(90),
                     "peak_bytes": peak, "saved_bytes": saved})
    return rows


def implementations(device: torch.device) -> list[str]:
    impls = [OURS, LOCAL, REFERENCE]
    return impls + [TORCH_SYNC] if device.type == "cuda" else impls


def run(ctx, args) -> list[dict]:
    """Every rank runs the whole grid; returns the rows (the same on every rank: times are maxima over ranks)."""
    torch.set_num_threads(args.threads)
    impls = implementations(ctx.device)
    cases = [(batch, hidden) for batch in args.batch for hidden in args.hidden]
    rows = []
    for batch, hidden in progress(cases, desc="syncbn benchmark"):
        rows += run_case(ctx, impls, batch, hidden, args.iters, args.rounds, args.warmup)
    return rows


# --------------------------------------------------------------------------- report


def _by(rows: list[dict], impl: str, device: str) -> dict[tuple[int, int], dict]:
    return {(r["batch"], r["hidden"]): r for r in rows if r["impl"] == impl and r["device"] == device}


def _with_ms(rows: list[dict]) -> list[dict]:
    return [{**r, "time_ms": 1e3 * r["time_s"], "p90_ms": 1e3 * r["p90_s"]} for r in rows]


PER_IMPL_COLUMNS = [("batch", "batch_size", "d"), ("hidden", "hidden_dim", "d"), ("workers", "num_workers", "d"),
                    ("time_ms", "median time (ms)", ".3f"), ("p90_ms", "p90 (ms)", ".3f"),
                    ("peak_bytes", "peak memory (bytes)", "d"), ("saved_bytes", "saved for backward (bytes)", "d")]


def comparison(rows: list[dict], device: str) -> tuple[str, list[dict]]:
    """The table of ratios against this device's reference, one entry per size, each saying whether the target is met."""
    ours, local, reference, torch_sync = (_by(rows, impl, device) for impl in (OURS, LOCAL, REFERENCE, TORCH_SYNC))
    table = []
    for key, row in ours.items():
        entry = {"batch": key[0], "hidden": key[1], "ours_ms": 1e3 * row["time_s"],
                 "local_ms": 1e3 * local[key]["time_s"], "reference_ms": 1e3 * reference[key]["time_s"],
                 "vs_reference": row["time_s"] / reference[key]["time_s"], "vs_local": row["time_s"] / local[key]["time_s"],
                 "saved_ratio": row["saved_bytes"] / local[key]["saved_bytes"]}
        if device == "cuda":
            entry.update(torch_ms=1e3 * torch_sync[key]["time_s"], vs_torch=row["time_s"] / torch_sync[key]["time_s"],
                         peak_ratio=row["peak_bytes"] / torch_sync[key]["peak_bytes"])
            ok = entry["vs_torch"] < 1 and entry["peak_ratio"] <= 1
        else:
            ok = entry["vs_reference"] <= CPU_TARGET and entry["saved_ratio"] <= 1
        entry["target"] = "met" if ok else "NOT met"
        table.append(entry)
    columns = [("batch", "batch", "d"), ("hidden", "hidden", "d"), ("ours_ms", "ours (ms)", ".3f"),
               ("local_ms", "BN local (ms)", ".3f"), ("reference_ms", "BN + 2 AR (ms)", ".3f")]
    if device == "cuda":
        columns += [("torch_ms", "torch SyncBN (ms)", ".3f"), ("vs_torch", "ours / torch", ".2f"),
                    ("peak_ratio", "peak ours / torch", ".2f")]
    columns += [("vs_reference", "ours / (BN + 2 AR)", ".2f"), ("vs_local", "ours / BN local", ".2f"),
                ("saved_ratio", "saved ours / BN", ".2f"), ("target", "target", "s")]
    return markdown_table(table, columns), table


def report(rows: list[dict], env: dict, args) -> None:
    print(format_environment(env))
    print(f"* global batch split evenly over {env['world_size']} workers; {rows[0]['iters']} iterations per "
          f"implementation in {args.rounds} interleaved rounds; times are medians of the per-iteration maximum over ranks")
    for device in sorted({r["device"] for r in rows}):
        if device == "cpu":
            print("\nOn CPU, torch.nn.SyncBatchNorm cannot run (it raises on CPU tensors): the local BatchNorm1d with "
                  "no communication is the lower bound and the only PyTorch reference.")
        for impl in (OURS, LOCAL, REFERENCE, TORCH_SYNC):
            impl_rows = [r for r in rows if r["impl"] == impl and r["device"] == device]
            if impl_rows:
                print(f"\n{impl} ({device})\n{markdown_table(_with_ms(impl_rows), PER_IMPL_COLUMNS)}")
        table, entries = comparison(rows, device)
        if device == "cuda":
            target = "ours faster than torch.nn.SyncBatchNorm, with no more peak memory"
        else:
            target = f"ours <= {CPU_TARGET} x (BatchNorm1d + 2 all_reduce of 2C+1 floats), and saved bytes <= BatchNorm1d's"
        print(f"\nComparison ({device}); target: {target}\n{table}")
        met = sum(e["target"] == "met" for e in entries)
        print(f"Target met on {met} of {len(entries)} sizes ({device}).")


# --------------------------------------------------------------------------- entry points


def _worker(ctx, args):
    rows = run(ctx, args)
    return rows if ctx.is_master else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2,
                        help="processes to spawn when not under torchrun (default: %(default)s)")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64], help="global batch sizes (default: %(default)s)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="numbers of channels (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=2000,
                        help="timed iterations per implementation and size (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=40,
                        help="interleaved rounds the iterations are split into (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed iterations before the first round (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a fast run: 100 iterations in 4 rounds, 5 warm-up (default: off)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.iters, args.rounds, args.warmup = 100, 4, 5
    if args.workers < 1 or args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--workers, --iters, --rounds and --threads must be at least 1, --warmup at least 0")
    if args.rounds > args.iters:
        parser.error("--rounds must not exceed --iters")
    return args


def main(args) -> None:
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        with distributed(args.backend, args.timeout) as ctx:
            for batch in args.batch:
                if batch % ctx.world_size:
                    raise ValueError(f"--batch {batch} is not divisible by the {ctx.world_size} workers")
            rows = run(ctx, args)
            env = environment(ctx.backend, ctx.device, ctx.world_size, threads=args.threads)
        if ctx.is_master:
            finish(rows, env, args)
        return
    backend = resolve_backend(args.backend)
    for batch in args.batch:
        if batch % args.workers:
            sys.exit(f"error: --batch {batch} is not divisible by --workers {args.workers}")
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    # Generous bound on the whole run: the process-group timeout catches a stuck peer much sooner.
    budget = 600 + 0.05 * args.iters * len(args.batch) * len(args.hidden)
    rows = launch(_worker, args.workers, args, backend=backend, timeout_s=budget, pg_timeout_s=args.timeout,
                  threads=args.threads)[0]
    finish(rows, environment(backend, device, args.workers, threads=args.threads), args)


def finish(rows: list[dict], env: dict, args) -> None:
    report(rows, env, args)
    if args.json:
        write_results(args.json, "syncbn_benchmark", env, vars(args), rows)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main(parse_args())
