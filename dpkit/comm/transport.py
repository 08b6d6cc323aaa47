"""Transports: how the ranks of a process group move and sum tensors, as one object every engine takes.
This module is their public face: it names what the modules below define, and defines nothing itself.

    from dpkit.comm import transport
    t = transport.resolve("auto", group, device)   # shared memory on one CPU host, hierarchical across hosts
    flat = t.allocate((n,), dtype=torch.float32)   # a buffer the transport serves without a copy
    t.all_reduce(flat, op="sum")                   # or async_op=True for a handle to wait on
    ddp_model.register_comm_hook(transport.SharedMemory(group), transport.ddp_comm_hook)   # PyTorch's DDP
    transport.use_with_fully_shard(model, transport.SharedMemory(group))                   # fully_shard

* ``interface``: ``Transport`` (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``allocate``), ``Work``,
  ``Wrapped``, ``Staged``.
* ``torch_transport``: ``Torch``, ``torch.distributed``'s collectives on the group's backend (gloo, NCCL).
* ``shared_memory``: ``SharedMemory``, ranks of one host meeting in /dev/shm (CPU tensors).
* ``message_passing``: ``MessagePassing`` ("p2p"), the homework's point-to-point algorithms.
* ``hierarchical``: ``Hierarchical``, shared memory inside each host, another transport between hosts.
* ``registry``: ``resolve``, the one place a transport is chosen; ``register``, ``unregister``, ``names``,
  ``checked``.
* ``pytorch_adapters``: ``ddp_comm_hook``, ``use_with_fully_shard``, ``fully_shard_comms``.
"""

from dpkit.comm.hierarchical import Hierarchical
from dpkit.comm.interface import Staged, Transport, Work, Wrapped
from dpkit.comm.message_passing import MessagePassing
from dpkit.comm.pytorch_adapters import ddp_comm_hook, fully_shard_comms, use_with_fully_shard
from dpkit.comm.registry import checked, factory, names, register, resolve, unregister
from dpkit.comm.shared_memory import ALIGN, POLLS, SHARED_MEMORY_RANGE, SHM_DIRECTORY, NotOneHost, SharedMemory
from dpkit.comm.torch_transport import Torch, TorchWork

__all__ = ["ALIGN", "POLLS", "SHARED_MEMORY_RANGE", "SHM_DIRECTORY", "Hierarchical", "MessagePassing",
           "NotOneHost", "SharedMemory", "Staged", "Torch", "TorchWork", "Transport", "Work", "Wrapped", "checked",
           "ddp_comm_hook", "factory",
           "fully_shard_comms", "names", "register", "resolve", "unregister", "use_with_fully_shard"]
