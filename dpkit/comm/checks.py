"""The checks every collective makes before its first message, so no peer is left waiting for half a protocol,
and the one way a tensor is cut into near-equal pieces.

    from dpkit.comm.checks import bounds, check_input, check_sharded
    check_input(tensor, "avg")                          # TypeError / ValueError on bad input
    rank, n = check_sharded(shard, full, "sum", group, gathering=True)
    b = bounds(10, 3)                                    # [0, 4, 7, 10]: pieces [b[i], b[i+1])

Every transport (``dpkit.comm.transport``) and the homework's algorithms (``allreduce.py``) refuse the
same input with the same message, because they call these.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OPS = ("avg", "sum")


def check_input(tensor: torch.Tensor, op: str) -> None:
    """Refuse bad input before any message is sent, so no peer is left waiting for half a protocol."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: choose one of {', '.join(OPS)}")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"cannot all-reduce a {tensor.dtype} tensor: use a floating (or, with op='sum', integer) dtype")
    if op == "avg" and not tensor.is_floating_point():
        raise TypeError(f"op='avg' needs a floating dtype, got {tensor.dtype}: the mean of integers is not an integer")


def group_rank(group) -> tuple[int, int]:
    """(rank, world size) of this process in ``group``; ValueError when it is not one of its members."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group it was asked to all-reduce over")
    return rank, dist.get_world_size(group)


def bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` near-equal contiguous pieces of ``numel`` elements (sizes differ by at most one).

    Piece i is ``[b[i], b[i+1])``; the first ``numel % parts`` pieces are the longer ones.
    """
    quotient, remainder = divmod(numel, parts)
    return [i * quotient + min(i, remainder) for i in range(parts + 1)]


def check_sharded(output, input, op: str, group, gathering: bool) -> tuple[int, int]:
    """Refuse what would fail halfway (or hang a peer) before the first message; returns (rank, world size)."""
    check_input(input, op)
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor output, got {type(output).__name__}")
    if output.dtype != input.dtype or output.device != input.device:
        raise TypeError(f"output ({output.dtype}, {output.device}) and input ({input.dtype}, {input.device}) "
                        "must have the same dtype and device")
    rank, n = group_rank(group)
    shard, full = (input, output) if gathering else (output, input)
    if full.numel() != n * shard.numel():
        name = "output" if gathering else "input"
        raise ValueError(f"{name} has {full.numel()} elements, expected world size x shard = {n} x {shard.numel()}: "
                         "pad the full tensor to a multiple of the world size")
    if overlaps(output, input) and not is_own_chunk(shard, full, rank):
        raise ValueError("output and input overlap: only the in-place form is allowed, the shard being chunk "
                         "`rank` of the full tensor (both contiguous)")
    return rank, n


def span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) a tensor may touch in its storage."""
    start = t.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return start, start + extent * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def is_own_chunk(shard: torch.Tensor, full: torch.Tensor, rank: int) -> bool:
    return (shard.is_contiguous() and full.is_contiguous()
            and shard.data_ptr() == full.data_ptr() + rank * shard.numel() * shard.element_size())
