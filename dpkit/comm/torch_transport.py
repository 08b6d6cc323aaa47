"""``Torch``: the transport of ``torch.distributed``'s own collectives, on the group's backend.

    t = Torch(group)                  # gloo (CPU; loopback TCP between the processes of one host) or NCCL
    t.all_reduce(flat, op="avg")     # or async_op=True: the backend's own handle, in a ``TorchWork``

``all_reduce``, ``reduce_scatter`` and ``all_gather`` are the same collectives as functions over any
group: where shared memory has no room it goes through them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dpkit import compat
from dpkit.comm.checks import check_input, check_sharded
from dpkit.comm.interface import DONE, Transport, Work, untracked


class TorchWork(Work):
    """``torch.distributed``'s work handle ``work``, with what must follow it (``then``: a copy back from a
    contiguous copy); without one, PyTorch's DDP and FSDP can take ``work`` itself."""

    def __init__(self, work, then: Callable[[], None] | None = None):
        self.work, self.then, self.done = work, then, False

    def wait(self) -> bool:
        self.work.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        self.done = True  # (gloo's reduce_scatter handle never says it completed, even after its wait)
        return True

    def is_completed(self) -> bool:
        return self.done or (self.then is None and self.work.is_completed())


class Torch(Transport):
    """``torch.distributed``'s collectives on the group's backend: gloo (CPU; loopback TCP between the
    processes of one host) or NCCL (GPUs). Asynchronous calls are the backend's own."""

    name = "torch"

    def __init__(self, group=None):
        super().__init__(group)

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        check_input(tensor, op)
        self._check_tensor(tensor)
        self._usable()
        if self.world_size == 1 or tensor.numel() == 0:
            return DONE if async_op else None
        return all_reduce(tensor, op, self.group, async_op)

    def reduce_scatter(self, output, input, op="sum", *, async_op=False):
        check_sharded(output, input, op, self.group, gathering=False)
        self._check_tensor(input)
        self._check_tensor(output)
        self._usable()
        if output.numel() == 0:
            return DONE if async_op else None
        return reduce_scatter(output, input, op, self.group, async_op)

    def all_gather(self, output, input, *, async_op=False):
        check_sharded(output, input, "sum", self.group, gathering=True)
        self._check_tensor(input)
        self._check_tensor(output)
        self._usable()
        if output.numel() == 0:
            return DONE if async_op else None
        return all_gather(output, input, self.group, async_op)

    def describe(self) -> str:
        group = self.group if self.group is not None else dist.group.WORLD
        return f"torch ({dist.get_backend(group)})"


# torch.distributed's collectives with the transport's contracts, over any group (shared memory falls back on
# them). gloo has no mean (AVG): every contribution is divided first, so a float16 mean overflows only where
# the mean itself would. A non-contiguous tensor goes through a contiguous copy, copied back once it is done.
# Nothing is recorded by autograd: where it tracks a tensor of the call, the call is made under no_grad (gloo's
# sharded collectives would otherwise leave a graph on the output, or refuse at the wait).

def all_reduce(tensor: torch.Tensor, op: str, group, async_op: bool = False) -> Work | None:
    with untracked(tensor.requires_grad):
        work_on = tensor if tensor.is_contiguous() else tensor.contiguous()
        if op == "avg":
            work_on.div_(dist.get_world_size(group))
        work = dist.all_reduce(work_on, dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _finish(work, async_op, None if work_on is tensor else _copy_back(tensor, work_on))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, group, async_op: bool = False):
    with untracked(output.requires_grad or input.requires_grad):
        out = output if output.is_contiguous() else output.contiguous()
        source = input.contiguous()
        if op == "avg":  # a divided copy of the input (the input is not modified)
            source = torch.div(source, dist.get_world_size(group))
        work = compat.reduce_scatter_single(out, source, dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _finish(work, async_op, None if out is output else _copy_back(output, out))


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    with untracked(output.requires_grad or input.requires_grad):
        out = output if output.is_contiguous() else output.contiguous()
        work = compat.all_gather_single(out, input.contiguous(), group=group, async_op=async_op)
    return _finish(work, async_op, None if out is output else _copy_back(output, out))


def _copy_back(target: torch.Tensor, result: torch.Tensor) -> Callable[[], None]:
    """What follows a call made on ``result``, a contiguous stand-in for ``target``: its copy back, outside
    autograd as the call was (at once, or at an asynchronous call's wait)."""
    def copy() -> None:
        with untracked(target.requires_grad):
            target.copy_(result)
    return copy


def _finish(work, async_op: bool, then: Callable[[], None] | None) -> Work | None:
    if async_op:
        return TorchWork(work, then)
    if then is not None:
        then()
    return None
