"""What ``ddp_benchmark.py`` prints: the header (the environment, the models and variants, and the legend that
defines every column), then per model its tables, then the target checks with their verdicts.

    print(header(env, config))
    print(report(rows, target_checks(rows)))   # checks computed where the rows are measured: dpkit.bench.ddp_targets
"""

from __future__ import annotations

from dpkit.bench.ddp_memory import MEMORY_ITERS
from dpkit.bench.ddp_run import block_key
from dpkit.bench.ddp_step import PYTORCH_BEST
from dpkit.bench.ddp_targets import (TARGET_BACKEND, TARGET_HIDDEN, TARGET_HOOK, TARGET_MEMORY, TARGET_VS_NO_DDP,
                                     TARGET_VS_PYTORCH)
from dpkit.bench.measure import format_ratio
from dpkit.bench.results import format_environment
from dpkit.bench.row_identity import label
from dpkit.report.ddp_tables import MIB, breakdown_table, comm_table, percentile_table


def targets_text(checks: list[dict]) -> list[str]:
    lines = ["Targets (set for CPU, 2 ranks, resnet18), each on one axis. Impl, on one transport: ddp ours 25M p50 "
             f"<= {TARGET_VS_PYTORCH:.2f} x the faster PyTorch 25M row, peak memory <= {TARGET_MEMORY:.2f} x that "
             f"row's. Transport, under one engine: PyTorch's DDP (best settings) through our shared memory <= "
             f"{TARGET_HOOK:.2f} x through its own gloo, on a \"dpkit\" process group <= {TARGET_BACKEND:.2f} x on "
             f"gloo. Overhead: ddp ours 25M on shared memory <= {TARGET_VS_NO_DDP:.2f} x "
             f"no DDP. Overlap, on asynchronous transports: exposed wait <= {TARGET_HIDDEN:.2f} x ours naive's "
             "all-reduce time. Ratios paired by round within one run, [95 % bootstrap interval over rounds]: met "
             "(interval at or below), missed (above), inconclusive (straddles)."]
    if not checks:
        return lines + ["  not evaluated: needs at least 2 ranks and the rows each target compares"]
    for c in checks:
        official = c["model"] == "resnet18" and c["world_size"] == 2 and not c["oversubscribed"]
        where = f"{c['model']}, {c['world_size']} ranks" + ("" if official else (
            " (oversubscribed: information)" if c["oversubscribed"] else " (information)"))
        note = f"  [{c['note']}]" if c["note"] else ""
        limit = "(information)" if c["limit"] is None else f"<= {c['limit']:.2f}: {c['verdict'].upper()}"
        ours, theirs = label(c["row"], path=True), label(c["reference_row"], path=True)
        lines.append(f"  {c['axis']:<9s} {where:<36s} {ours:>36s} {c['target']:<42s} vs {theirs:<36s} "
                     f"{format_ratio(c['ratio']):>20s} {limit}{note}")
    return lines


def legend(config: dict) -> list[str]:
    return [
        f"* {config['iters']} timed iterations per variant" + (" at most (each row says how many: see --budget)"
                                                                if config.get("budget", 0) else "")
        + f" in {config['rounds']} rotated rounds, each after "
        f"{config['warmup']} warm-up iterations of a freshly built variant; batch {config['batch_size']} per rank",
        "* sec/iter: percentiles over iterations of the slowest rank's time (forward, loss, backward, gradient "
        "sync, SGD step); ex/sec = global batch / sec/iter",
        "* comm wait: median per-iteration exposed communication wait (time in finish_gradient_synchronization, "
        "mean over ranks); of iter: total wait / total iteration time. PyTorch's DDP waits inside backward: "
        "compare all variants by DDP overhead = p50 - the no-ddp p50 of the same run",
        f"* ddp pytorch best: PyTorch's DDP with {', '.join(f'{k}={v}' for k, v in PYTORCH_BEST.items())}; "
        "ours and both PyTorch rows run with find_unused_parameters=False (no used-flags); "
        "vs columns: median of the per-round p50 ratios [95 % bootstrap interval over rounds]",
        f"* peak memory: the least over {MEMORY_ITERS} untimed iterations of the most tensor bytes above the level "
        "before each, max over ranks, plus what the DDP and its transport keep between iterations: its buckets "
        "(on [shared_memory] they lie in the transport's shared memory) and the shared-memory transport's staging "
        "block (in /dev/shm, which the profiler does not see)",
        "* [torch]: torch.distributed's collectives on the backend (gloo: loopback TCP between the processes of "
        "one host; PyTorch's DDP with its own built-in communication); [shared_memory]: this host's shared "
        "memory (transport.SharedMemory; PyTorch's DDP through transport.ddp_comm_hook), summed in the thread that "
        "completes a bucket; [shared_memory:thread]: the same on a communication thread; [torch:dpkit]: PyTorch's "
        "DDP unchanged on a process group of the backend \"dpkit\" (dpkit/comm/backend.py: this host's shared "
        "memory)",
        "* a * after the world size: more processes than CPU cores (oversubscribed): for information only",
    ]


def header(env: dict, config: dict) -> str:
    title = "Data-parallel benchmark: ddp.py's variants against PyTorch's DDP"
    variants = ", ".join(config["variants"])
    return "\n".join(["-" * len(title), title, "-" * len(title), "", format_environment(env),
                      f"* models: {' '.join(config['models'])}; variants: {variants}", *legend(config)])


def report(rows: list[dict], checks: list[dict]) -> str:
    """Per model block: seed 004's percentile table, then communication, overhead and memory; then the targets
    (``checks``, as ``ddp_targets.target_checks`` judged them)."""
    lines = []
    blocks: dict[tuple, list[dict]] = {}
    for row in rows:
        blocks.setdefault(block_key(row), []).append(row)
    for (model, batch, shape), block in blocks.items():
        block = sorted(block, key=lambda r: r["world_size"])  # stable: variant order kept within a world size
        first = block[0]
        lines += ["", f"Benchmark: {model} with batch size {batch} per rank, {shape} inputs; "
                      f"{first['params'] / 1e6:.2f}M parameters, {first['grad_bytes'] / MIB:.1f} MiB of gradients", ""]
        lines += percentile_table(block) + [""] + comm_table(block) + breakdown_table(block)
    return "\n".join(lines + [""] + targets_text(checks))
