"""The torch.distributed backend "dpkit": unchanged PyTorch code gets this host's shared memory.

    import dpkit                                              # registers "dpkit" (as does dpkit.comm.backend)
    dist.init_process_group("dpkit")                          # or "cpu:dpkit,cuda:nccl" (torch with Python backends)
    dist.new_group(ranks, backend="dpkit")                    # DDP, fully_shard, ZeroRedundancyOptimizer run on it

On one host, all-reduce, broadcast, all-gather, reduce-scatter and barrier go through ``Slots``
(two shared-memory slots per rank, one wait per piece, the reduction straight into the output).
Across hosts (real, or simulated by ``DPKIT_HOSTS``) an all-reduce is hierarchical: through the
slots inside each host, gloo between one leader per host, the slots again to hand the result out.
Everything else, and whatever the slots cannot take (CUDA-free but odd dtypes, uneven lists), goes
to a gloo backend the group keeps on the same store; bfloat16, which gloo lacks, is moved as float16
bits or reduced in float32 there. When /dev/shm has no room, every call goes to gloo, warned once;
on CPUs that may reorder stores (not x86) too, without the slots.

Where torch builds Python backends (``Backend`` has a Python constructor) the class is a ``Backend``,
so one process group may hold "dpkit" for CPU beside "nccl" for CUDA; elsewhere it is a whole
``ProcessGroup`` (and then "cpu:dpkit,cuda:nccl" serves CPU tensors only). Latency:
``python -m dpkit.bench.backend_latency``.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import warnings

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from dpkit.comm.hosts import HOSTS_ENV, number_hosts, ranks_by_host, real_host
from dpkit.comm.interface import profiler_range
from dpkit.comm.slots import DTYPES, Slots
from dpkit.comm.transport import POLLS

NAME = "dpkit"
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
_BITWISE = ("band", "bor", "bxor")


def _python_backends() -> bool:
    """Whether this torch lets Python subclass ``Backend`` (a constructor is bound)."""
    class Probe(c10d.Backend):
        pass
    try:
        Probe(0, 1)
    except TypeError:
        return False
    return True


BASE = c10d.Backend if _python_backends() else dist.ProcessGroup


def op_name(reduce_op) -> str | None:
    """"sum", "avg", ... for a ``ReduceOp``; None for one the slots do not compute (PREMUL_SUM)."""
    return next((name for name, value in _OPS.items() if reduce_op == value), None)


def profiled(kind: str):
    """A method wrapped in the profiler range "dpkit:<kind>" while a profiler records (gloo's are "gloo:<kind>"),
    so a trace shows this backend's collectives on every torch (a Python process group's calls enter none of
    torch's own ``c10d::`` operators on some releases); outside a profile, one check of a flag."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with profiler_range(f"dpkit:{kind}"):
                return method(self, *args, **kwargs)
        return call
    return wrap


def done(result=None) -> dist.Work:
    """A Work that has completed (the slots finish before the call returns); its future holds ``result``, the
    tensors, as gloo's does (DDP's reducer reads them there)."""
    future = torch.futures.Future()
    future.set_result(result)
    return c10d._create_work_from_future(future)


def computes(dtype: torch.dtype, op: str | None) -> bool:
    """Whether the slots compute ``op`` on ``dtype`` as gloo would (else gloo decides, or refuses)."""
    if op is None or dtype not in DTYPES:
        return False
    floating, boolean = dtype.is_floating_point, dtype == torch.bool
    return not ((op in _BITWISE and floating) or (op == "avg" and not floating)
                or (boolean and op in ("sum", "avg", "product")))


def check_cpu(tensors) -> None:
    """ValueError naming the device of the first tensor that is not on the CPU."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"backend {NAME!r} moves CPU tensors, and this one is on {t.device}: use "
                             f"init_process_group('cpu:{NAME},cuda:nccl') or a CUDA backend for GPU tensors")


class DpkitBackend(BASE):
    """A process group's backend (see the module docstring); made by torch through ``register_backend``."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, global_ranks: list[int]):
        super().__init__(rank, size)
        self._rank, self._size, self.timeout_s = rank, size, timeout.total_seconds()
        self._names = ("", "")
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{NAME}/gloo", store), rank, size, timeout)
        self.slots: Slots | None = None  # this host's ranks (all of the group's when it is one host)
        self.leaders = None  # gloo among one rank per host, on those ranks, when the group spans hosts
        self.spans_hosts = False
        if size > 1:
            self._connect(store, global_ranks, timeout)

    def _connect(self, store, global_ranks, timeout) -> None:
        hosts = ranks_by_host(_host_indices(store, self._rank, self._size, global_ranks, timeout))
        mine = next(h for h, members in enumerate(hosts) if self._rank in members)
        members = hosts[mine]
        self.spans_hosts = len(hosts) > 1
        self._local = members.index(self._rank)
        if len(members) > 1 and POLLS:  # elsewhere a peer may see the counter before the data: gloo carries all
            self.slots = Slots.open(dist.PrefixStore(f"{NAME}/host{mine}", store), self._local, len(members),
                                    self.timeout_s)
        if self.spans_hosts and self._local == 0:
            self.leaders = dist.ProcessGroupGloo(dist.PrefixStore(f"{NAME}/leaders", store), mine, len(hosts),
                                                 timeout)
        roomy = _everyone(store, self._rank, self._size, "room", self.slots is not None or len(members) == 1, timeout)
        if not all(roomy):
            if self.slots is not None:
                self.slots.close()
            self.slots = None
            self.spans_hosts = False
            if self._rank == 0:
                warnings.warn(f"backend {NAME!r}: /dev/shm has no room for the shared-memory slots: every "
                              "collective of this group goes through gloo", RuntimeWarning, stacklevel=2)

    # ---- names torch asks a backend or a Python process group for

    def getBackendName(self) -> str:
        return NAME

    def name(self) -> str:
        return NAME

    def setGroupName(self, name: str) -> None:
        self._names = (name, self._names[1])

    def getGroupName(self) -> str:
        return self._names[0]

    def setGroupDesc(self, desc: str) -> None:
        self._names = (self._names[0], desc)

    def getGroupDesc(self) -> str:
        return self._names[1]

    def shutdown(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None

    # ---- what the slots serve

    def _native(self, tensors, op: str | None = "sum") -> bool:
        """Whether the slots take this call: one host with room, CPU tensors of their dtypes, an op they compute."""
        check_cpu(tensors)
        dtype = tensors[0].dtype
        return (self.slots is not None and not self.spans_hosts and all(t.dtype == dtype for t in tensors)
                and computes(dtype, op))

    @profiled("all_reduce")
    def allreduce(self, tensors, opts=None):
        opts = opts or c10d.AllreduceOptions()
        op = op_name(opts.reduceOp)
        if self._size == 1 and op is not None:
            check_cpu(tensors)
            return done(tensors)
        if len(tensors) == 1 and self._native(tensors, op):
            _in_place(tensors[0], lambda flat: self.slots.all_reduce(flat, op))
            return done(tensors)
        if len(tensors) == 1 and self.spans_hosts and computes(tensors[0].dtype, op):
            self._hierarchical_all_reduce(tensors[0], op)
            return done(tensors)
        return _reduce_through_gloo(tensors, lambda ts: self.gloo.allreduce(ts, opts))

    def _hierarchical_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """Inside the host through the slots, between hosts through gloo among the leaders, then the slots again."""
        inner = "sum" if op == "avg" else op
        flat = tensor.contiguous().view(-1)
        if self.slots is not None:
            self.slots.all_reduce(flat, inner)
        if self.leaders is not None:
            options = c10d.AllreduceOptions()
            options.reduceOp = _OPS[inner]
            _reduce_through_gloo([flat], lambda ts: self.leaders.allreduce(ts, options)).wait()
        if self.slots is not None:
            self.slots.broadcast(flat, 0)
        if op == "avg":
            flat.div_(self._size)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))

    @profiled("broadcast")
    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        if len(tensors) == 1 and self._native(tensors, "sum"):
            _in_place(tensors[0], lambda flat: self.slots.broadcast(flat, opts.rootRank))
            return done(tensors)
        check_cpu(tensors)
        return self.gloo.broadcast([_bits(t) for t in tensors], opts)

    @profiled("all_gather")
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        if len(inputs) == 1 and self._native([*output_lists[0], inputs[0]], "sum") \
                and all(o.numel() == inputs[0].numel() for o in output_lists[0]):
            gathered = torch.empty(self._size * inputs[0].numel(), dtype=inputs[0].dtype)
            self.slots.all_gather(gathered, inputs[0].contiguous().view(-1))
            for r, out in enumerate(output_lists[0]):
                out.copy_(gathered.view(self._size, -1)[r].view_as(out))
            return done(output_lists)
        return _move_through_gloo(self.gloo.allgather, output_lists, inputs, opts)

    @profiled("all_gather")
    def all_gather_single(self, output, input, opts=None):
        if self._native([output, input], "sum") and output.numel() == self._size * input.numel():
            _in_place(output, lambda flat: self.slots.all_gather(flat, input.contiguous().view(-1)))
            return done([output])
        outputs = list(output.view(self._size, -1).unbind(0)) if output.is_contiguous() else None
        if outputs is None:
            raise ValueError(f"backend {NAME!r}: all_gather's output must be contiguous")
        return self.allgather([outputs], [input.view(-1)], opts)

    _allgather_base = all_gather_single  # the name torch's ProcessGroup calls where it predates the new one

    @profiled("reduce_scatter")
    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        flat = torch.cat([t.reshape(-1) for t in input_lists[0]])
        if outputs[0].numel() * self._size != flat.numel():
            raise ValueError(f"backend {NAME!r}: reduce_scatter of uneven pieces "
                             f"({[t.numel() for t in input_lists[0]]})")
        return self.reduce_scatter_single(outputs[0], flat, opts)

    @profiled("reduce_scatter")
    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        op = op_name(opts.reduceOp)
        if self._native([output, input], op) and input.numel() == self._size * output.numel():
            _in_place(output, lambda flat: self.slots.reduce_scatter(flat, input.contiguous().view(-1), op))
            return done([output])
        # gloo's own reduce-scatter takes fewer dtypes and names than its all-reduce: sum a copy, keep my slice
        whole = input.contiguous().view(-1).clone()
        options = c10d.AllreduceOptions()
        options.reduceOp = opts.reduceOp
        self.allreduce([whole], options).wait()
        m = output.numel()
        output.copy_(whole[self._rank * m:(self._rank + 1) * m].view_as(output))
        return done([output])

    _reduce_scatter_base = reduce_scatter_single

    @profiled("barrier")
    def barrier(self, opts=None):
        if self._size == 1:
            return done()
        if self.slots is not None and not self.spans_hosts:
            self.slots.barrier()
            return done()
        return self.gloo.barrier(opts or c10d.BarrierOptions())

    # ---- handed to gloo (bfloat16 moved as int16 bits; reduced in float32)

    def reduce(self, tensors, opts=None):
        return _reduce_through_gloo(tensors, lambda ts: self.gloo.reduce(ts, opts or c10d.ReduceOptions()))

    def gather(self, output_lists, inputs, opts=None):
        return _move_through_gloo(self.gloo.gather, output_lists, inputs, opts or c10d.GatherOptions())

    def scatter(self, outputs, input_lists, opts=None):
        return _move_through_gloo(self.gloo.scatter, outputs, input_lists, opts or c10d.ScatterOptions())

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        check_cpu([output, input])
        call = getattr(self.gloo, "all_to_all_single", None) or self.gloo.alltoall_base
        return call(_bits(output), _bits(input), output_splits, input_splits, opts or c10d.AllToAllOptions())

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        """Through ``all_to_all_single`` on the pieces laid end to end (gloo has no list form)."""
        send = torch.cat([t.reshape(-1) for t in inputs])
        receive = torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype)
        self.all_to_all_single(receive, send, [t.numel() for t in outputs], [t.numel() for t in inputs], opts).wait()
        for piece, out in zip(receive.split([t.numel() for t in outputs]), outputs):
            out.copy_(piece.view_as(out))
        return done()

    def send(self, tensors, dst: int, tag: int):
        check_cpu(tensors)
        return self.gloo.send([_bits(t) for t in tensors], dst, tag)

    def recv(self, tensors, src: int, tag: int):
        check_cpu(tensors)
        return self.gloo.recv([_bits(t) for t in tensors], src, tag)

    def recv_anysource(self, tensors, tag: int):
        check_cpu(tensors)
        return self.gloo.recv_anysource([_bits(t) for t in tensors], tag)

    def allreduce_coalesced(self, tensors, opts=None):
        for t in tensors:
            options = c10d.AllreduceOptions()
            options.reduceOp = (opts or c10d.AllreduceCoalescedOptions()).reduceOp
            self.allreduce([t], options).wait()
        return done()

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input, opts).wait()
        return done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # the older name

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts).wait()
        return done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # the older name

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        for outputs, input in zip(output_lists, inputs):
            self.allgather([outputs], [input], opts).wait()
        return done(output_lists)

    def monitored_barrier(self, *args):
        return self.gloo.monitored_barrier(*args)


def _in_place(tensor: torch.Tensor, run) -> None:
    """``run(flat)`` on a contiguous 1-D view of ``tensor`` (a copy, written back, when it is strided)."""
    if tensor.is_contiguous():
        run(tensor.view(-1))
        return
    flat = tensor.contiguous().view(-1)
    run(flat)
    tensor.copy_(flat.view_as(tensor))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """bfloat16 as float16 bits (gloo moves bytes, but refuses the dtype, and int16 too); any other as it is."""
    return tensor.view(torch.float16) if tensor.dtype == torch.bfloat16 else tensor


def _move_through_gloo(call, outputs, inputs, opts):
    """A gloo collective that only moves data, on tensors or lists of tensors, bfloat16 as its bits."""
    def bits(x):
        return [bits(t) for t in x] if isinstance(x, list) else _bits(x)
    check_cpu([t for x in (*outputs, *inputs) for t in (x if isinstance(x, list) else [x])])
    return call(bits(outputs), bits(inputs), opts) if opts is not None else call(bits(outputs), bits(inputs))


def _reduce_through_gloo(tensors, call):
    """A gloo reduction; bfloat16 tensors are reduced as float32 copies and rounded back."""
    check_cpu(tensors)
    if not any(t.dtype == torch.bfloat16 for t in tensors):
        return call(tensors)
    wide = [t.float() if t.dtype == torch.bfloat16 else t for t in tensors]
    call(wide).wait()
    for t, w in zip(tensors, wide):
        if w is not t:
            t.copy_(w)
    return done(tensors)


def _everyone(store, rank: int, size: int, key: str, value, timeout) -> list:
    """Every rank's ``value`` (JSON), in rank order, through ``store`` (a collective)."""
    store.set(f"{NAME}/{key}/{rank}", json.dumps(value))
    keys = [f"{NAME}/{key}/{r}" for r in range(size)]
    store.wait(keys, timeout)
    return [json.loads(store.get(k)) for k in keys]


def _host_indices(store, rank: int, size: int, global_ranks: list[int], timeout) -> tuple[int, ...]:
    """Each group rank's host (``hosts.number_hosts``), from every rank's view gathered through the store."""
    views = _everyone(store, rank, size, "host", [os.environ.get(HOSTS_ENV), real_host()], timeout)
    world = dist.get_world_size() if dist.is_initialized() else size
    return number_hosts([tuple(v) for v in views], list(global_ranks) or list(range(size)), world)


def slots_of(group=None) -> Slots | None:
    """The slots a "dpkit" group's backend exchanges through on this host (None: gloo, or across hosts)."""
    group = group or dist.group.WORLD
    backend = group if isinstance(group, DpkitBackend) else group._get_backend(torch.device("cpu"))
    return backend.slots if isinstance(backend, DpkitBackend) and not backend.spans_hosts else None


def create(options, _backend_options=None) -> DpkitBackend:
    """What torch calls to make the backend of a group (``register_backend(..., extended_api=True)``)."""
    return DpkitBackend(options.store, options.group_rank, options.group_size, options.timeout,
                        list(options.global_ranks_in_group))


def register() -> None:
    """Register "dpkit" for CPU tensors with torch.distributed, once per process."""
    if not hasattr(dist.Backend, NAME.upper()):
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])


register()
