"""What ``sharding_benchmark.py`` prints: a table of every measured row (times and the bytes a rank holds), the
targets by axis with their verdicts, and the notes that define the memory columns.

    print(report(rows))   # rows: measured rows and target rows (dpkit.bench.sharding_run.benchmark_model)
"""

from __future__ import annotations

from dpkit.bench.measure import format_ratio
from dpkit.bench.results import markdown_table
from dpkit.bench.sharding_targets import AXES

MIB = 2 ** 20
COLUMNS = [("world_size", "procs", "s"), ("model", "model", "s"), ("variant", "variant", "s"),
           ("p50_ms", "p50 ms", ".1f"), ("p95_ms", "p95 ms", ".1f"), ("exposed_ms", "exposed comm ms", ".1f"),
           ("params_mib", "params MiB", ".1f"), ("grads_mib", "grads MiB", ".1f"),
           ("grads_per_rank_mib", "grads MiB per rank", "s"), ("state_mib", "opt state MiB", ".1f"),
           ("activation_mib", "activations MiB", ".1f"), ("peak_mib", "peak MiB", ".1f"),
           ("shared_peak_mib", "/dev/shm MiB", ".1f"), ("model_state_mib", "held MiB", ".1f"),
           ("ideal_mib", "ideal MiB", ".1f"), ("state_vs_ideal", "held / ideal", ".2f")]
BYTE_COUNTS = ("params", "grads", "state", "activation", "peak", "shared_peak", "model_state", "ideal")
MEMORY_NOTES = """\
memory, per rank (the largest rank), counted from the tensors it holds after one untimed iteration (distinct
storages: a tied weight or a bucket holding every gradient counts once): parameters (ZeRO's, at stages 1 and 2,
are views of its all-gather buffers: those, padding included); gradients (after synchronisation; "per rank": each
rank's, in rank order; ZeRO stage 2 keeps only its share's, with a used-flag per piece); optimizer state;
activations (what autograd saves in forward, parameters excluded: the gathered weights count for fully_shard,
whose saved tensors they are, and for ours with keep, not for ours resharding, which gathers them again in
backward). Held = everything the variant holds with its gradients in: parameters, gradients, optimizer state,
its own buffers (DDP's buckets, ours and PyTorch's; ZeRO's all-gather buffers, stage 2's reduce-scatter pool)
and what its transport holds for it (every variant has a transport of its own: for shared memory, the pages of
its arena in /dev/shm, which hold the buffers it allocated, its staging block and the blocks it took during
iterations, kept for reuse; a memory profiler does not see them; on [torch:dpkit] the backend's slots, two of
``slots.SLOT_BYTES`` per rank and group in /dev/shm, are the group's and not counted). Peak = the same between
iterations (gradients freed) + the most bytes torch's allocator held above it during an iteration + the pages the
arena grew by during it. "/dev/shm MiB": the transport's pages in /dev/shm (``Transport.held_bytes``).
Ideal = the model states (parameters + gradients + AdamW's two moments) a rank must hold: all of them for
DDP, 1/n of the optimizer state for ZeRO (stage 2: and of the gradients), 1/n of everything plus the largest
gathered unit for FSDP; "held / ideal" (the memory target) counts every byte an engine or its transport
keeps beside them against it."""


def shown(row: dict) -> dict:
    """A measured row in the table's units: milliseconds, MiB, and the world size marked when oversubscribed."""
    line = {**row, "p50_ms": row["p50_s"] * 1e3, "p95_ms": row["p95_s"] * 1e3,
            "exposed_ms": None if row["exposed_comm_s"] is None else row["exposed_comm_s"] * 1e3,
            "world_size": f"{row['world_size']}{' (oversubscribed)' if row['oversubscribed'] else ''}",
            "grads_per_rank_mib": " / ".join(f"{b / MIB:.2f}" for b in row["grads_bytes_per_rank"])}
    line.update({f"{key}_mib": row[f"{key}_bytes"] / MIB for key in BYTE_COUNTS})
    return line


def fallback_lines(rows: list[dict]) -> list[str]:
    """A note for the shared-memory variants that went through torch.distributed (no room in /dev/shm)."""
    fallbacks = sorted({f"{r['variant']}: {r['transport_detail']}" for r in rows
                        if "transport_detail" in r and "through torch" in r["transport_detail"]})
    if not fallbacks:
        return []
    return ["NOTE: /dev/shm had no room, these shared-memory variants went through torch.distributed: "
            + "; ".join(fallbacks), ""]


def limit_text(row: dict) -> str:
    if row["limit"] is not None:
        return f"target <= {row['limit']:.2f}"
    if row.get("scope"):
        return f"target <= {row['scoped_limit']:.2f} on {row['scope']} only: for information here"
    return "for information"


def target_lines(targets: list[dict]) -> list[str]:
    """The targets grouped by axis, in ``AXES`` order, each with its ratio, limit and verdict."""
    lines = ["targets by axis (ratios: median of per-round p50 ratios, 95 % bootstrap CI):"]
    for axis, meaning in AXES.items():
        mine = [r for r in targets if r["axis"] == axis]
        if mine:
            lines.append(f"  {axis} ({meaning}):")
        for row in mine:
            value = format_ratio(row["ratio"]) if row["ratio"] else f"{row['value']:.2f}x"
            lines.append(f"    {row['world_size']} procs, {row['model']}: {row['target']} = {value} "
                         f"({limit_text(row)}): {row['verdict']}")
    return lines


def report(rows: list[dict]) -> str:
    measured = [shown(r) for r in rows if "variant" in r]
    lines = [markdown_table(measured, COLUMNS), "", *fallback_lines(rows)]
    lines += target_lines([r for r in rows if "target" in r])
    return "\n".join(lines + ["", MEMORY_NOTES])
