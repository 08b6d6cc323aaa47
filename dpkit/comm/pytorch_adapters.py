"""PyTorch's own engines over a transport: DDP through a communication hook, ``fully_shard`` (FSDP2) through
its custom collectives.

    ddp_model.register_comm_hook(SharedMemory(group), ddp_comm_hook)   # DistributedDataParallel
    use_with_fully_shard(model, SharedMemory(group))                   # after fully_shard, before a forward

Over ``Torch`` the backend's own handles go back to PyTorch; over any other transport each call
finishes before PyTorch gets a done future (or None) back. ``fully_shard``'s buffers are allocated
by the transport (in the shared segment for ``SharedMemory``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpkit.comm.interface import Transport, Work
from dpkit.comm.torch_transport import TorchWork


def ddp_comm_hook(state: Transport, bucket):  # (dist.GradBucket) -> torch.futures.Future[torch.Tensor]
    """A communication hook for ``torch.nn.parallel.DistributedDataParallel``: each bucket's gradients averaged
    through the transport ``state``::

        ddp_model.register_comm_hook(transport.SharedMemory(group), transport.ddp_comm_hook)

    (No annotations: under ``from __future__ import annotations`` they are strings, which DDP's check refuses.)
    The mean divides every rank's gradients by the world size before the sum, as PyTorch's own
    all-reduce hook does. Over shared memory the bucket (PyTorch allocates it) is staged: one
    copy in, the sum, one copy out. The first call checks that the transport's ranks are those
    of the DDP that calls it (through the bucket's parameters) and raises on every rank if not.
    """
    buffer = bucket.buffer()
    if not getattr(state, "_checked_for_ddp", False):
        _check_hook_group(state, bucket)
    work = state.all_reduce(buffer, "avg", async_op=True)
    if isinstance(work, TorchWork) and work.then is None:
        return work.work.get_future().then(lambda _: buffer)
    work.wait()
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _check_hook_group(state: Transport, bucket) -> None:
    """The DDP that owns the bucket's parameters must run over the transport's ranks."""
    if not isinstance(state, Transport):
        raise TypeError(f"ddp_comm_hook's state must be a Transport (e.g. transport.SharedMemory(group)), got "
                        f"{type(state).__name__}")
    ddp = _owning_ddp(bucket.parameters()[0]) if bucket.parameters() else None
    if ddp is not None:
        theirs = dist.get_process_group_ranks(ddp.process_group)
        if list(theirs) != list(state.ranks):
            raise ValueError(f"ddp_comm_hook: the transport is over ranks {list(state.ranks)}, the "
                             f"DistributedDataParallel over {list(theirs)}: make the transport over the DDP's "
                             "process group")
    state._checked_for_ddp = True


def _owning_ddp(param: torch.Tensor):
    """The ``DistributedDataParallel`` whose parameter list holds ``param``: parameter <- list <- the DDP's
    ``__dict__`` <- the DDP, three passes over the garbage collector's objects, once per transport."""
    import gc

    lists = [holder for holder in gc.get_referrers(param) if isinstance(holder, list)]
    dicts = [owner for owner in gc.get_referrers(*lists) if isinstance(owner, dict)] if lists else []
    modules = gc.get_referrers(*dicts) if dicts else []
    return next((m for m in modules if isinstance(m, torch.nn.parallel.DistributedDataParallel)), None)


def _reduce_op(op) -> str:
    """torch.distributed's ReduceOp as this kit's op name."""
    if op in (dist.ReduceOp.SUM, "sum"):
        return "sum"
    if op in (dist.ReduceOp.AVG, "avg"):
        return "avg"
    raise NotImplementedError(f"reduce op {op} is not supported by the transport (sum and avg are)")


def _fsdp_api():
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def fully_shard_comms(transport: Transport):
    """``(all_gather, reduce_scatter)`` objects for ``FSDPModule.set_custom_all_gather`` and
    ``set_custom_reduce_scatter``: ``fully_shard``'s buffers allocated by ``transport`` (in the shared
    segment for ``SharedMemory``), its collectives made by it."""
    AllGather, ReduceScatter = _fsdp_api()

    class TransportAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return transport.allocate(tuple(int(s) for s in size), dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return _unwrap(transport.all_gather(output_tensor, input_tensor, async_op=async_op))

    class TransportReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return transport.allocate(tuple(int(s) for s in size), dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return _unwrap(transport.reduce_scatter(output_tensor, input_tensor, _reduce_op(op), async_op=async_op))

    return TransportAllGather(), TransportReduceScatter()


def _unwrap(work: Work | None):
    """What ``fully_shard`` expects back: torch's ``Work`` to wait on, or None once the call is done."""
    if work is None:
        return None
    if isinstance(work, TorchWork) and work.then is None:
        return work.work
    work.wait()
    return None


def use_with_fully_shard(module: torch.nn.Module, transport: Transport) -> int:
    """Give every ``fully_shard``-ed module in ``module`` the transport's all-gather and reduce-scatter;
    returns how many modules took them. Call after ``fully_shard`` and before the first forward."""
    from torch.distributed.fsdp import FSDPModule

    all_gather, reduce_scatter = fully_shard_comms(transport)
    count = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(all_gather)
            m.set_custom_reduce_scatter(reduce_scatter)
            count += 1
    return count
