"""The torch.distributed backend "dpkit": unchanged PyTorch code gets this host's shared memory.

    import dpkit                                              # registers "dpkit" (as does dpkit.comm.backend)
    dist.init_process_group("dpkit")                          # or "cpu:dpkit,cuda:nccl"
    dist.new_group(ranks, backend="dpkit")                    # DDP, fully_shard, ZeroRedundancyOptimizer run on it

On one host, all-reduce, reduce, broadcast, all-gather, reduce-scatter, all-to-all (even splits) and barrier go
through ``Slots`` (two shared-memory slots per rank, one wait per piece, the reduction straight into the output);
the C++ face runs the small ones itself (``enable_fast_path``). Across hosts (real, or simulated by ``DPKIT_HOSTS``) an
all-reduce is hierarchical: the slots inside each host, gloo between one leader per host, the slots again to hand
the result out. Everything else (point-to-point, gather, scatter, uneven all-to-all, sparse tensors, what the
slots cannot take) goes to a gloo backend the group keeps on the same store; bfloat16, which gloo lacks, is
moved as float16 bits or reduced in float32 there, and the mean, which gloo refuses, is the sum divided (integers
truncated toward zero, as NCCL's). When /dev/shm has no room, every call goes to gloo, warned once; on CPUs that
may reorder stores (not x86) too.

Each call checks its arguments on the caller's thread (a refusal before any message leaves the group as it was),
then queues its communication in the group's ``CallQueue`` (``backend_work``): run by the caller when it waits,
by the queue's thread when it does not (``async_op=True`` goes on meanwhile). Once a call fails on a rank
(timeout, a dead peer, ranks that disagree), the group is broken: every later call raises at once, there and,
through the slots' headers, on every peer.

torch reaches the implementation (``DpkitBackend``) through ``dpkit/native/c10d_backend.cpp``, built at first
use: a C++ ``Backend`` whose works answer every question torch asks of a work. Where it cannot be built (no C++
compiler, ``DPKIT_NATIVE=0``), ``PythonBackend`` takes torch's Python-backend route, which forwards only ``wait``
and ``get_future`` of a work. Latency: ``python -m dpkit.bench.backend_latency``.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from dpkit import native
from dpkit.comm.backend_work import CallQueue, Delegated, Work
from dpkit.comm.hosts import HOSTS_ENV, number_hosts, ranks_by_host, real_host
from dpkit.comm.interface import profiler_range
from dpkit.comm.slots import DTYPES, Slots, native_sums
from dpkit.comm.shared_memory import POLLS

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


def computes(dtype: torch.dtype, op: str | None) -> bool:
    """Whether the slots compute ``op`` on ``dtype`` (an integer mean as the sum, then divided; else gloo decides)."""
    if op is None or dtype not in DTYPES:
        return False
    floating, boolean = dtype.is_floating_point, dtype == torch.bool
    return not ((op in _BITWISE and floating) or (boolean and op in ("sum", "avg", "product")))


def check_op(op: str | None, dtype: torch.dtype) -> None:
    """ValueError for a reduction no rank computes (as gloo refuses it), before anything is sent."""
    if op is None:
        raise ValueError(f"backend {NAME!r} computes SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR and BXOR, not this op")
    if op in _BITWISE and dtype.is_floating_point:
        raise ValueError(f"backend {NAME!r}: ReduceOp.{op.upper()} takes integer tensors, not {dtype}")
    if op == "avg" and dtype == torch.bool:
        raise ValueError(f"backend {NAME!r}: ReduceOp.AVG is not defined on torch.bool")


def check_cpu(tensors) -> None:
    """ValueError naming the device of the first tensor that is not on the CPU."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"backend {NAME!r} moves CPU tensors, and this one is on {t.device}: use "
                             f"init_process_group('cpu:{NAME},cuda:nccl') or a CUDA backend for GPU tensors")


class DpkitBackend:
    """The implementation of a group's backend (see the module docstring): every method checks its arguments on
    the caller's thread (a refusal before any message, as gloo's), then queues the communication in the group's
    ``CallQueue`` and returns its ``Work``. torch reaches it through ``c10d_backend.cpp`` (or ``PythonBackend``)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, global_ranks: list[int]):
        self.rank, self.size, self.timeout_s = rank, size, timeout.total_seconds()
        store = _incarnation(store, size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        self.slots: Slots | None = None  # this host's ranks (all of the group's when it is one host)
        self.leaders = None  # gloo among one rank per host, on those ranks, when the group spans hosts
        self.spans_hosts = False
        tell = weakref.WeakMethod(self._tell_peers)  # the queue's thread must not keep this backend alive
        self.calls = CallQueue(f"backend {NAME!r} (rank {rank} of {size})", on_failure=lambda e: tell() and tell()(e))
        weakref.finalize(self, self.calls.close)  # torch calls no shutdown on destroy: the thread ends with us
        self.fast_on = np.zeros(1, np.int64)  # 1 while the C++ fast path may use the slots (``enable_fast_path``)
        if size > 1:
            self._connect(store, global_ranks, timeout)

    def _connect(self, store, global_ranks, timeout) -> None:
        hosts = ranks_by_host(_host_indices(store, self.rank, self.size, global_ranks, timeout))
        mine = next(h for h, members in enumerate(hosts) if self.rank in members)
        members = hosts[mine]
        self.spans_hosts = len(hosts) > 1
        self._local = members.index(self.rank)
        if len(members) > 1 and POLLS:  # elsewhere a peer may see the counter before the data: gloo carries all
            self.slots = Slots.open(dist.PrefixStore(f"host{mine}", store), self._local, len(members),
                                    self.timeout_s, sums=native_sums())  # built already: create() asked first
        if self.spans_hosts and self._local == 0:
            self.leaders = dist.ProcessGroupGloo(dist.PrefixStore("leaders", store), mine, len(hosts), timeout)
        roomy = _everyone(store, self.rank, self.size, "room", self.slots is not None or len(members) == 1, timeout)
        if not all(roomy):
            if self.slots is not None:
                self.slots.close()
            self.slots = None
            self.spans_hosts = False
            if self.rank == 0:
                warnings.warn(f"backend {NAME!r}: /dev/shm has no room for the shared-memory slots, or a rank could "
                              "not open them: every collective of this group goes through gloo", RuntimeWarning,
                              stacklevel=2)

    def _tell_peers(self, error: BaseException) -> None:
        """A call failed here: mark the slots broken, so that every peer's next wait raises at once."""
        if self.slots is not None:
            self.slots.break_group(f"{type(error).__name__}: {error}")

    def _refuse_if_broken(self) -> None:
        """BrokenGroupError when a call of this group failed, here or on a peer whose header says so."""
        if self.calls.broken is None and self.slots is not None:
            why = self.slots.peer_broken()
            if why is not None:
                self.calls.break_(why)
        self.calls.refuse_if_broken()

    def enable_fast_path(self) -> tuple | None:
        """Turns the C++ face's fast path on (``fast_on``; ``shutdown`` turns it off) and returns the words it reads
        (``c10d_backend.cpp``): the address of the queue's count of calls not yet run, of ``fast_on``, then
        ``Slots.native_layout()``. None, and the fast path stays off: no slots, or across hosts."""
        if self.slots is None or self.spans_hosts:
            return None
        self.fast_on[0] = 1
        return self.calls.outstanding.ctypes.data, self.fast_on.ctypes.data, self.slots.native_layout()

    def finish_posted(self, kind: str, tensors: list, op: str, root: int, start: int = 0) -> Work:
        """The rest of a call ``kind`` (a slots kind) on contiguous ``tensors`` (all-gather and reduce-scatter:
        output, input) that the C++ fast path posted up to the piece that starts at element ``start`` (data,
        descriptor, counter; every piece before it done) but whose peers did not all post that piece within its
        hand-over time: queued as any call, waited for as on the Python path (dead peers named, the timeout, the
        descriptors checked)."""
        flat = [t.view(-1) for t in tensors]
        slots = self.slots
        run = {"all_reduce": lambda: slots.all_reduce(flat[0], op, announced=start),
               "broadcast": lambda: slots.broadcast(flat[0], root, announced=start),
               "all_gather": lambda: slots.all_gather(flat[0], flat[1], announced=start),
               "reduce_scatter": lambda: slots.reduce_scatter(flat[0], flat[1], op, announced=start),
               "barrier": lambda: slots.barrier(announced=start),
               "reduce": lambda: slots.reduce(flat[0], op, root, announced=start),
               "all_to_all": lambda: slots.all_to_all(flat[0], flat[1], announced=start)}[kind]
        return self._submit(run, list(tensors[:1]))

    def shutdown(self) -> None:
        self.fast_on[0] = 0  # before the slots are unmapped
        self.calls.close()
        if self.slots is not None:
            self.slots.close()
            self.slots = None

    def _native(self, tensors, op: str | None = "sum") -> bool:
        """Whether the slots take this call: one host with room, dense CPU tensors of one of their dtypes, an op
        they compute."""
        dtype = tensors[0].dtype
        return (self.slots is not None and not self.spans_hosts and computes(dtype, op)
                and all(t.dtype == dtype and t.layout == torch.strided for t in tensors))

    def _submit(self, run, result=None, opts=None) -> Work:
        """Queue ``run``; a caller that waits at once (``opts.asyncOp`` False: ``async_op=False``) runs it now, when
        no call is queued before it, and no other thread is woken."""
        if self.size == 1:  # nobody to wait for: run on the spot, no queue
            work = Work(run, result, None)
            work.finish(work.execute())
            return work
        return self.calls.submit(run, result, now=not getattr(opts, "asyncOp", True))

    # ---- the reductions

    @profiled("all_reduce")
    def allreduce(self, tensors, opts=None):
        opts = opts or c10d.AllreduceOptions()
        op = op_name(opts.reduceOp)
        check_cpu(tensors)
        self._refuse_if_broken()
        if any(t.layout != torch.strided for t in tensors):  # sparse: gloo sums them, as on gloo
            return self._submit(lambda: self.gloo.allreduce(tensors, opts).wait(), tensors, opts)
        check_op(op, tensors[0].dtype)
        if len(tensors) == 1:
            return self._submit(lambda: self._all_reduce_now(tensors[0], op), tensors, opts)
        return self._submit(lambda: _reduce_through_gloo(tensors, op, self.size, self.gloo.allreduce,
                                                         c10d.AllreduceOptions), tensors, opts)

    allreduce_sparse = allreduce

    def _all_reduce_now(self, tensor: torch.Tensor, op: str) -> None:
        if self.size == 1:
            return
        if self._native([tensor], op):
            _in_place(tensor, lambda flat: self._slots_all_reduce(flat, op))
        elif self.spans_hosts and computes(tensor.dtype, op):
            self._hierarchical_all_reduce(tensor, op)
        else:
            _reduce_through_gloo([tensor], op, self.size, self.gloo.allreduce, c10d.AllreduceOptions)

    def _slots_all_reduce(self, flat: torch.Tensor, op: str) -> None:
        if op == "avg" and not flat.dtype.is_floating_point:  # NCCL's integer mean: the sum, then divided
            self.slots.all_reduce(flat, "sum")
            flat.div_(self.size, rounding_mode="trunc")
        else:
            self.slots.all_reduce(flat, op)

    def _hierarchical_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """Inside the host through the slots, between hosts through gloo among the leaders, then the slots again."""
        inner = "sum" if op == "avg" else op
        flat = tensor.contiguous().view(-1)
        if self.slots is not None:
            self.slots.all_reduce(flat, inner)
        if self.leaders is not None:
            _reduce_through_gloo([flat], inner, self.size, self.leaders.allreduce, c10d.AllreduceOptions)
        if self.slots is not None:
            self.slots.broadcast(flat, 0)
        if op == "avg":
            _divide(flat, self.size)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))

    @profiled("reduce")
    def reduce(self, tensors, opts=None):
        opts = opts or c10d.ReduceOptions()
        op = op_name(opts.reduceOp)
        check_cpu(tensors)
        check_op(op, tensors[0].dtype)
        self._refuse_if_broken()
        root = opts.rootRank
        if len(tensors) == 1 and self._native(tensors, op):
            return self._submit(lambda: self._reduce_now(tensors[0], op, root), tensors, opts)

        def run():
            _reduce_through_gloo(tensors, op, self.size, self.gloo.reduce, c10d.ReduceOptions, root=root,
                                 divide=self.rank == root)
        return self._submit(run, tensors, opts)

    def _reduce_now(self, tensor: torch.Tensor, op: str, root: int) -> None:
        inner = "sum" if op == "avg" and not tensor.dtype.is_floating_point else op
        _in_place(tensor, lambda flat: self.slots.reduce(flat, inner, root))
        if inner != op and self.rank == root:
            _divide(tensor, self.size)

    @profiled("reduce_scatter")
    def reduce_scatter(self, outputs, input_lists, opts=None):
        pieces = input_lists[0]
        check_cpu([*outputs, *pieces])
        if len(outputs) != 1 or len(pieces) != self.size or any(p.numel() != outputs[0].numel() for p in pieces):
            raise ValueError(f"backend {NAME!r}: reduce_scatter takes one output and {self.size} inputs of its size "
                             f"({outputs[0].numel()} elements), not inputs of {[p.numel() for p in pieces]}")
        return self.reduce_scatter_single(outputs[0], torch.cat([p.reshape(-1) for p in pieces]), opts)

    @profiled("reduce_scatter")
    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        op = op_name(opts.reduceOp)
        check_cpu([output, input])
        check_op(op, input.dtype)
        if input.numel() != self.size * output.numel() or input.dtype != output.dtype:
            raise ValueError(f"backend {NAME!r}: reduce_scatter's input must hold {self.size} x the output's "
                             f"{output.numel()} elements of {output.dtype}, not {input.numel()} of {input.dtype}")
        self._refuse_if_broken()
        return self._submit(lambda: self._reduce_scatter_now(output, input, op), [output], opts)

    _reduce_scatter_base = reduce_scatter_single  # the name torch's ProcessGroup calls where it predates the new one

    def _reduce_scatter_now(self, output, input, op) -> None:
        if self._native([output, input], op):
            inner = "sum" if op == "avg" and not output.dtype.is_floating_point else op
            _in_place(output, lambda flat: self.slots.reduce_scatter(flat, input.contiguous().view(-1), inner))
            if inner != op:
                _divide(output, self.size)
            return
        # gloo's own reduce-scatter takes fewer dtypes and names than its all-reduce: sum a copy, keep my slice
        whole = input.contiguous().view(-1).clone()
        self._all_reduce_now(whole, op)
        m = output.numel()
        output.copy_(whole[self.rank * m:(self.rank + 1) * m].view_as(output))

    # ---- the collectives that move data

    @profiled("broadcast")
    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        check_cpu(tensors)
        self._refuse_if_broken()
        if len(tensors) == 1 and self._native(tensors, "sum"):
            return self._submit(lambda: _in_place(tensors[0], lambda flat: self.slots.broadcast(flat, opts.rootRank)),
                                tensors, opts)
        return self._submit(lambda: self.gloo.broadcast([_bits(t) for t in tensors], opts).wait(), tensors, opts)

    @profiled("all_gather")
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        check_cpu([*inputs, *[t for outs in output_lists for t in outs]])
        self._refuse_if_broken()
        if len(inputs) == 1 and len(output_lists[0]) == self.size \
                and all(o.numel() == inputs[0].numel() and o.dtype == inputs[0].dtype for o in output_lists[0]):
            return self._submit(lambda: self._all_gather_now(output_lists[0], inputs[0]), output_lists, opts)
        return self._submit(lambda: _move_through_gloo(self.gloo.allgather, output_lists, inputs, opts).wait(),
                            output_lists, opts)

    def _all_gather_now(self, outputs: list, input: torch.Tensor) -> None:
        """``outputs[r]`` <- rank r's ``input`` (each the size of ``input``)."""
        if not self._native([*outputs, input], "sum"):
            _move_through_gloo(self.gloo.allgather, [outputs], [input], c10d.AllgatherOptions()).wait()
            return
        gathered = torch.empty(self.size * input.numel(), dtype=input.dtype)
        self.slots.all_gather(gathered, input.contiguous().view(-1))
        for r, out in enumerate(outputs):
            out.copy_(gathered.view(self.size, -1)[r].view_as(out))

    @profiled("all_gather")
    def all_gather_single(self, output, input, opts=None):
        check_cpu([output, input])
        if output.numel() != self.size * input.numel() or output.dtype != input.dtype:
            raise ValueError(f"backend {NAME!r}: all_gather's output must hold {self.size} x the input's "
                             f"{input.numel()} elements of {input.dtype}, not {output.numel()} of {output.dtype}")
        if not output.is_contiguous():
            raise ValueError(f"backend {NAME!r}: all_gather's output must be contiguous")
        self._refuse_if_broken()
        if self._native([output, input], "sum"):
            return self._submit(lambda: self.slots.all_gather(output.view(-1), input.contiguous().view(-1)), [output],
                                opts)
        rows = list(output.view(self.size, -1).unbind(0))
        return self._submit(lambda: self._all_gather_now(rows, input.reshape(-1)), [output], opts)

    _allgather_base = all_gather_single  # the name torch's ProcessGroup calls where it predates the new one

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``output_lists[r][j]`` <- rank r's ``inputs[j]`` (torch's layout: one list per rank)."""
        check_cpu([*inputs, *[t for outs in output_lists for t in outs]])
        if len(output_lists) != self.size or any(len(outs) != len(inputs) for outs in output_lists):
            raise ValueError(f"backend {NAME!r}: all_gather_coalesced takes one output list per rank "
                             f"({self.size}), each as long as the inputs ({len(inputs)})")
        self._refuse_if_broken()

        def run():
            for j, input in enumerate(inputs):
                self._all_gather_now([outs[j] for outs in output_lists], input)
        return self._submit(run, output_lists, opts)

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.GatherOptions()
        check_cpu([*inputs, *[t for outs in output_lists for t in outs]])
        self._refuse_if_broken()
        return self._submit(lambda: _move_through_gloo(self.gloo.gather, output_lists, inputs, opts).wait(),
                            output_lists, opts)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ScatterOptions()
        check_cpu([*outputs, *[t for ins in input_lists for t in ins]])
        self._refuse_if_broken()
        return self._submit(lambda: _move_through_gloo(self.gloo.scatter, outputs, input_lists, opts).wait(),
                            outputs, opts)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        check_cpu([output, input])
        self._refuse_if_broken()
        even = output.numel() == input.numel() and output.numel() % self.size == 0 and all(
            split == output.numel() // self.size for split in [*output_splits, *input_splits])
        if even and output.dtype == input.dtype and output.is_contiguous() and self._native([output, input], "sum"):
            return self._submit(lambda: self.slots.all_to_all(output.view(-1), input.contiguous().view(-1)), [output],
                                opts)
        call = getattr(self.gloo, "all_to_all_single", None) or self.gloo.alltoall_base
        options = opts or c10d.AllToAllOptions()
        return self._submit(lambda: call(_bits(output), _bits(input), output_splits, input_splits, options).wait(),
                            [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        """Through gloo's ``all_to_all_single`` on the pieces laid end to end (gloo has no list form)."""
        check_cpu([*outputs, *inputs])
        self._refuse_if_broken()
        call = getattr(self.gloo, "all_to_all_single", None) or self.gloo.alltoall_base

        def run():
            send = torch.cat([t.reshape(-1) for t in inputs])
            receive = torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype)
            call(_bits(receive), _bits(send), [t.numel() for t in outputs], [t.numel() for t in inputs],
                 opts or c10d.AllToAllOptions()).wait()
            for piece, out in zip(receive.split([t.numel() for t in outputs]), outputs):
                out.copy_(piece.view_as(out))
        return self._submit(run, outputs, opts)

    # ---- coalesced calls: one work for several collectives, run in order

    def allreduce_coalesced(self, tensors, opts=None):
        op = op_name((opts or c10d.AllreduceCoalescedOptions()).reduceOp)
        check_cpu(tensors)
        for t in tensors:
            check_op(op, t.dtype)
        self._refuse_if_broken()
        return self._submit(lambda: [self._all_reduce_now(t, op) for t in tensors], tensors, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        check_cpu([*outputs, *inputs])
        self._refuse_if_broken()
        return self._submit(lambda: [self._all_gather_now(list(o.view(self.size, -1).unbind(0)), i.reshape(-1))
                                     for o, i in zip(outputs, inputs)], outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # the older name

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = op_name((opts or c10d.ReduceScatterOptions()).reduceOp)
        check_cpu([*outputs, *inputs])
        self._refuse_if_broken()
        return self._submit(lambda: [self._reduce_scatter_now(o, i, op) for o, i in zip(outputs, inputs)], outputs,
                            opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # the older name

    # ---- barriers

    @profiled("barrier")
    def barrier(self, opts=None):
        self._refuse_if_broken()
        if self.size == 1:
            return self._submit(lambda: None)
        if self.slots is not None and not self.spans_hosts:
            return self._submit(self.slots.barrier, None, opts)
        options = opts or c10d.BarrierOptions()
        return self._submit(lambda: self.gloo.barrier(options).wait(), None, opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier (it names the ranks that did not arrive), after every call queued before it."""
        self._submit(lambda: None).wait()
        self.gloo.monitored_barrier(timeout, wait_all_ranks) if timeout is not None \
            else self.gloo.monitored_barrier(wait_all_ranks=wait_all_ranks)

    # ---- point to point: gloo's own works (not queued: a receive may wait for a peer's later collective)

    def send(self, tensors, dst: int, tag: int):
        check_cpu(tensors)
        self._refuse_if_broken()
        return Delegated(self.gloo.send([_bits(t) for t in tensors], dst, tag))

    def recv(self, tensors, src: int, tag: int):
        check_cpu(tensors)
        self._refuse_if_broken()
        return Delegated(self.gloo.recv([_bits(t) for t in tensors], src, tag))

    def recv_anysource(self, tensors, tag: int):
        check_cpu(tensors)
        self._refuse_if_broken()
        return Delegated(self.gloo.recv_anysource([_bits(t) for t in tensors], tag))


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
    return call(bits(outputs), bits(inputs), opts)


def _reduce_through_gloo(tensors, op: str, size: int, call, options_type, root: int | None = None,
                         divide: bool = True) -> None:
    """A gloo reduction (an all-reduce, or a reduce to ``root``), waited for. bfloat16, which gloo lacks, is
    reduced as float32 copies and rounded back; the mean, which gloo refuses, is the sum divided by ``size``
    (on the ranks where ``divide``: the root of a reduce)."""
    options = options_type()
    options.reduceOp = _OPS["sum" if op == "avg" else op]
    if root is not None:
        options.rootRank = root
    wide = [t.float() if t.dtype == torch.bfloat16 else t for t in tensors]
    call(wide, options).wait()
    for t, w in zip(tensors, wide):
        if op == "avg" and divide:
            _divide(w, size)
        if w is not t:
            t.copy_(w)


def _divide(tensor: torch.Tensor, size: int) -> None:
    """The sum of ``size`` ranks into their mean; integers truncated toward zero, as NCCL's integer mean."""
    if tensor.dtype.is_floating_point:
        tensor.div_(size)
    else:
        tensor.div_(size, rounding_mode="trunc")


def _incarnation(store, size: int):
    """``store`` under a prefix of this group's own: a group made again on the same store (torch gives it the
    prefix of the one destroyed before it) reads none of the keys an earlier one left. Every rank of one group
    counts itself in before any rank of the next can (making a group is a collective)."""
    arrivals = store.add(f"{NAME}/arrivals", 1)
    return dist.PrefixStore(f"{NAME}/{(arrivals - 1) // size}", store)


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


def cpu_backend(group=None):
    """``group``'s backend for CPU tensors (default: the world's): for "dpkit", its C++ face where it is built, else
    the ``PythonBackend`` of torch's Python-backend route (on torch 2.11, the group itself, which names no
    device)."""
    group = group or dist.group.WORLD
    return group if hasattr(group, "impl") else group._get_backend(torch.device("cpu"))


def implementation(group=None) -> DpkitBackend | None:
    """The "dpkit" implementation behind ``group``'s CPU backend (None: another backend)."""
    impl = getattr(cpu_backend(group), "impl", None)
    return impl if isinstance(impl, DpkitBackend) else None


def slots_of(group=None) -> Slots | None:
    """The slots a "dpkit" group's backend exchanges through on this host (None: gloo, or across hosts)."""
    impl = implementation(group)
    return impl.slots if impl is not None and not impl.spans_hosts else None


class TorchWork(dist.Work):
    """A ``Work`` as torch's Python-backend route takes one: it forwards only ``wait`` and ``get_future``."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def wait(self, timeout=None):
        return self.work.wait(int(timeout.total_seconds() * 1000) if timeout else 0)

    def get_future(self):
        return self.work.get_future()


class PythonBackend(BASE):
    """The same implementation through torch's Python-backend route, where ``c10d_backend.cpp`` cannot be built
    (no C++ compiler). There torch forwards only ``wait`` and ``get_future`` of a work: ``is_completed()`` stays
    False, ``result()`` raises, a receive from any source cannot name its sender, and
    TORCH_DISTRIBUTED_DEBUG=DETAIL is refused (README, "PyTorch's test base")."""

    def __init__(self, impl: DpkitBackend):
        super().__init__(impl.rank, impl.size)
        self.impl = impl
        self._names = ("", "")

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
        self.impl.shutdown()

    # torch reads these as properties; left to the base class, its C++ asks Python back, without end
    supports_splitting = property(lambda self: False)
    supports_coalescing = property(lambda self: False)
    options = property(lambda self: c10d.Backend.Options(NAME, datetime.timedelta(seconds=self.impl.timeout_s)))

    def monitored_barrier(self, *args) -> None:
        timeout = getattr(args[0], "timeout", args[0]) if args else None
        self.impl.monitored_barrier(timeout, *args[1:])


def _forwarded(name: str):
    def call(self, *args, **kwargs):  # keywords too: torch 2.11 calls ``group.barrier(opts=opts)`` on this object
        return TorchWork(getattr(self.impl, name)(*args, **kwargs))
    call.__name__ = name
    return call


for _name in ("allreduce", "allreduce_sparse", "reduce", "reduce_scatter", "reduce_scatter_single",
              "_reduce_scatter_base", "broadcast", "allgather", "all_gather_single", "_allgather_base",
              "allgather_coalesced", "gather", "scatter", "all_to_all_single", "alltoall_base", "alltoall",
              "allreduce_coalesced", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
              "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "barrier", "send", "recv",
              "recv_anysource"):
    setattr(PythonBackend, _name, _forwarded(_name))


def compiled():
    """The module of ``c10d_backend.cpp``, built at first use (None: no C++ compiler, or DPKIT_NATIVE=0)."""
    return native.load_extension("c10d_backend")


def create(options, _backend_options=None):
    """What torch calls to make the backend of a group (``register_backend(..., extended_api=True)``). The C++
    face is built (or found in the cache) before any rank waits for a peer, so no peer times out meanwhile."""
    face = compiled()
    impl = DpkitBackend(options.store, options.group_rank, options.group_size, options.timeout,
                        list(options.global_ranks_in_group))
    return face.Backend(impl.rank, impl.size, impl) if face is not None else PythonBackend(impl)


def register() -> None:
    """Register "dpkit" for CPU tensors with torch.distributed, once per process."""
    if not hasattr(dist.Backend, NAME.upper()):
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])


register()
