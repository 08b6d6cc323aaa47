"""The memory of a DDP variant's replica as ``ddp_benchmark.py`` reports it: the peak of a steady-state
iteration, the buffers the DDP keeps between iterations, and the shared-memory transport's staging block, whose
use records the row's path (copied in: "staged"; summed where the tensors lie: "zero copy").

    memory = measure_memory(ctx, replica)   # after the replica's timed rounds: {"peak_bytes": ..., ...}
"""

from __future__ import annotations

from torch import nn

from dpkit.bench.ddp_step import Replica
from dpkit.bench.measure import PeakMemory, gather_rows
from dpkit.bench.row_identity import recorded_path
from dpkit.engines.ddp import DDP, FlatDDP, NaiveDDP

MEMORY_ITERS = 3


def _pytorch_bucket_bytes(model: nn.parallel.DistributedDataParallel) -> list[int] | None:
    """The byte size of each of PyTorch's buckets, from its logging data (a private API: None if that
    changes). It rebuilds its buckets after the first step, and the logging data shows the rebuilt
    layout from the third step on."""
    try:
        data = model._get_ddp_logging_data()
        sizes = data["rebuilt_bucket_sizes" if data.get("has_rebuilt_buckets") else "bucket_sizes"]
        return [int(size) for size in sizes.split(",") if size.strip()]  # "29057424, 15853824"
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def communication_layout(model: nn.Module) -> tuple[int | None, int | None]:
    """(gradient all-reduces per synchronised step, bytes of communication buffers kept between steps)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if isinstance(model, DDP):  # the buckets, which also hold the gradients
        return len(model.buckets), sum(b.flat.numel() * b.flat.element_size() for b in model.buckets)
    if isinstance(model, NaiveDDP):
        return len(trainable), 0
    if isinstance(model, FlatDDP):  # its flat buffers, kept from step to step
        return len(model.flat_buffers), sum(f.numel() * f.element_size() for f in model.flat_buffers)
    if isinstance(model, nn.parallel.DistributedDataParallel):  # buckets besides the gradients
        sizes = _pytorch_bucket_bytes(model)
        return (None, None) if sizes is None else (len(sizes), sum(sizes))
    return 0, 0


def measure_memory(ctx, replica: Replica) -> dict:
    """Memory of a warmed-up replica: MEMORY_ITERS more, untimed iterations under PeakMemory.

    ``iteration_peak_bytes``: the most tensor bytes above the level before the iteration
    (activations, gradients, communication temporaries). ``ddp_buffer_bytes``: what the
    DDP keeps between iterations (its buckets). ``peak_bytes``, their sum, compares the
    variants: ours keeps the gradients in its buckets, PyTorch's besides them.

    Why not from wrapping on (the level before the DDP exists)? On CPU, PeakMemory misses a
    free made on one of gloo's threads, and gloo's worker sometimes drops the last reference
    to a buffer after the caller has (the coalesced broadcast at construction): a whole
    model's worth, at random. In a steady-state iteration the caller holds its buffers
    longer than gloo does.
    """
    for wire in {id(t): t for t in (getattr(replica.model, "transport", None), _hook_state(replica.model))
                 if hasattr(t, "release_staging")}.values():
        wire.release_staging()  # a staging block left by another row's calls is not this row's
    peaks = []
    for _ in range(MEMORY_ITERS):
        with PeakMemory(ctx.device) as peak:
            replica.step()
        peaks.append(peak.bytes)
    all_reduces, buffers = communication_layout(replica.model)
    # PeakMemory can only overstate (a buffer freed on a gloo thread is missed), so the least of a few
    # identical iterations is the truest; then the most over ranks.
    iteration_peak = int(gather_rows([min(peaks)]).max())
    # The shared-memory transport's staging block (a copy of the largest tensor it was handed that it did not
    # allocate: PyTorch's buckets under the hook) lives in /dev/shm, which PeakMemory does not see.
    wire = getattr(replica.model, "transport", None) or _hook_state(replica.model)
    staging = getattr(wire, "staging_bytes", 0)
    return {"all_reduces": all_reduces, "iteration_peak_bytes": iteration_peak, "ddp_buffer_bytes": buffers,
            "transport_staging_bytes": staging, "path": recorded_path(wire),
            "peak_bytes": None if buffers is None else iteration_peak + buffers + staging}


def _hook_state(model: nn.Module):
    """The transport PyTorch's DDP was given as its communication hook's state, if any (a private attribute)."""
    hooks = getattr(model, "_comm_hooks", None) if isinstance(model, nn.parallel.DistributedDataParallel) else None
    return hooks[-1][1] if hooks else None
