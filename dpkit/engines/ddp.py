"""Hand-written data parallelism: every rank ends a step with the same, averaged gradients.

A drop-in for ``torch.nn.parallel.DistributedDataParallel``, inside an initialised process group::

    model = DDP(net, bucket_cap_mb=25.0)           # broadcasts rank 0's weights and buffers
    with model.no_sync():                           # accumulation micro-batches: no communication
        loss_fn(model(x0), y0).backward()
    loss_fn(model(x1), y1).backward()               # buckets summed as they fill; at its end (autograd
    optimizer.step(); optimizer.zero_grad()         # calls back, as PyTorch's) every .grad is averaged

The variants the benchmark compares ("ddp" and these names: the engine registry's vocabulary), all with that
interface (``make_ddp`` selects by name):

============  ===========================================================================
ours          ``DDP(module, bucket_cap_mb)``: gradients packed into buckets, each summed as soon
              as it is complete, while the rest of backward goes on.
ours overlap  ``DDP(module, bucket_cap_mb=0)``: the same, one bucket per parameter.
ours flat     ``FlatDDP``: when backward ends, all gradients copied into one flat tensor, one all-reduce.
ours naive    ``NaiveDDP``: when backward ends, one blocking all-reduce per parameter.
pytorch       ``torch.nn.parallel.DistributedDataParallel``, the reference.
============  ===========================================================================

Each sums through the transport its ``transport=`` names (``transport.resolve``; "auto", the
default: this host's shared memory when every rank is on it and the gradients are on the CPU,
else torch.distributed's collectives), in buffers the transport allocates.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dpkit import compat
from dpkit.comm.process_groups import synchronize
from dpkit.comm import transport as comm_transport

MIB = 2**20
# Largest single broadcast of module state at construction, PyTorch DDP's value (250 MiB):
# few collectives, yet a bounded temporary copy for very large models.
BROADCAST_CHUNK_BYTES = 250 * MIB
# The most gradient bytes of the last bucket(s), the first layers' (see ``assign_buckets``): their
# all-reduce cannot overlap backward. PyTorch's DDP caps its first bucket at 1 MiB so communication
# starts early; this cap is for the other end. Measured on resnet18 by ``ddp_benchmark.py`` (the
# "ddp ours" rows against PyTorch's and against ``last_bucket_cap_mb=0``).
LAST_BUCKET_CAP_MB = 2.0
# ... and at most this share of the model's gradient bytes: a small model whose first parameters need
# almost no backward compute (the GPT's token embedding) has nothing to hide a separate tail behind, while
# a CNN's full-resolution convolutions do. Compare with ``sharding_benchmark.py`` rows rebuilt with other
# ``last_bucket_cap_mb`` values.
TAIL_SHARE = 4
VARIANTS = ("ours", "ours overlap", "ours flat", "ours naive", "pytorch")


# --------------------------------------------------------------------------- shared pieces


def broadcast_module_state(module: nn.Module, process_group=None) -> int:
    """Copy the group's rank 0 parameters (trainable or frozen) and buffers into every rank's ``module``.

    Tensors are coalesced: one flat buffer per (dtype, device), split into chunks of at
    most ``BROADCAST_CHUNK_BYTES``, one broadcast per chunk. A collective costs a round
    trip whatever its size, so resnet18's 122 tensors cost one broadcast per dtype
    (float32 weights, int64 ``num_batches_tracked``) instead of 122. Returns the number
    of broadcasts made (the same on every rank).
    """
    tensors = [p.detach() for p in module.parameters()] + [b for b in module.buffers() if b.numel()]
    is_source = dist.get_rank(process_group) == 0
    count = 0
    with torch.no_grad():
        for chunk in coalesce(tensors, BROADCAST_CHUNK_BYTES):
            flat = _flatten_dense_tensors(chunk)  # (sum of numels,) copy; every rank sends or receives it whole
            dist.broadcast(flat, group_src=0, group=process_group)
            count += 1
            if not is_source:
                for tensor, value in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
                    tensor.copy_(value)
    return count


def coalesce(tensors: Sequence[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Runs of same-(dtype, device) tensors of at most ``cap_bytes`` each (a bigger tensor alone)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        chunk, size = [], 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if chunk and size + nbytes > cap_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        yield chunk


# Every variant divides by the world size BEFORE the sum, as PyTorch's DDP does, because:
# * it is free where a gradient is copied into a bucket anyway (torch.div(grad, w, out=slot) is
#   one pass, like the copy alone), whereas dividing after the sum is one more pass over all
#   gradients, exposed after the last wait;
# * the sum cannot overflow: in float16 (max 65504) w gradients of 65504 / w would sum to inf.
# Precision: for a power-of-two world size both orders are exact (halving is exact in binary
# floating point, barring subnormals), so results are bitwise PyTorch's; otherwise each
# rank's g / w rounds once more than a single division of the sum, a round-off-level difference.


_UNFINISHED = (
    "DDP: {what} while the gradients of a synchronised backward are still being all-reduced: that backward did "
    "not reach its end (it raised), or this wrapper was built with finish_in_backward=False. Call "
    "finish_gradient_synchronization() (or ddp.sync_gradients(model)) on every rank first: otherwise gradients "
    "are added into buckets being sent or the optimizer reads half-reduced ones.")


def _model_signature(module: nn.Module) -> list[tuple]:
    """(kind, name, shape, dtype, requires_grad) of every parameter and buffer, in registration order."""
    return ([("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
            + [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()])


def check_same_model(module: nn.Module, process_group=None, local_problem: str | None = None,
                     wrapper: str = "DDP") -> None:
    """Raise ValueError on every rank of the group unless every rank's ``module`` has the same
    parameters and buffers (names, shapes, dtypes, requires_grad) in the same order.

    ``local_problem``: what a rank found wrong on its own (e.g. parameters on several devices),
    sent along in the same collective so that every rank raises it; ``wrapper`` names the
    caller in the messages.

    One ``all_gather_object`` of the signatures (inside: an all_gather of their sizes, then
    one of their pickled bytes, a few dozen bytes per tensor), as PyTorch's DDP checks shapes
    across processes at construction: otherwise a mismatch surfaces as a gloo size-mismatch
    abort, a NCCL hang or buckets that silently mix different parameters. Every rank sees
    every signature, so every rank raises the same message, naming the first difference.
    """
    gathered: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (local_problem, _model_signature(module)), group=process_group)
    for rank, (problem, _) in enumerate(gathered):
        if problem is not None:
            raise ValueError(f"{wrapper}: {problem} (on rank {rank})")
    signatures = [signature for _, signature in gathered]
    reference = signatures[0]

    def describe(entry):
        if entry is None:
            return "nothing (fewer parameters and buffers)"
        kind, name, shape, dtype, requires_grad = entry
        frozen = ", frozen" if kind == "parameter" and not requires_grad else ""
        return f"{kind} {name!r} of shape {list(shape)}, {dtype}{frozen}"

    first = None  # (index, rank) of the earliest difference from rank 0
    for rank, signature in enumerate(signatures[1:], start=1):
        for index in range(max(len(signature), len(reference))):
            theirs = signature[index] if index < len(signature) else None
            ours = reference[index] if index < len(reference) else None
            if theirs != ours:
                if first is None or index < first[0]:
                    first = (index, rank, ours, theirs)
                break
    if first is not None:
        index, rank, ours, theirs = first
        raise ValueError(f"{wrapper}: the ranks wrap different models. Tensor {index} (parameters, then buffers, in "
                         f"registration order) is the {describe(ours)} on rank 0 but the {describe(theirs)} on "
                         f"rank {rank}. Build the same model (architecture, dtype, frozen parameters) on every rank "
                         "before wrapping it.")


class _DataParallel(nn.Module):
    """What every hand-written variant shares: the wrapped module, the broadcast, forward, ``no_sync``, timing,
    and the end of each synchronised backward.

    ``state_dict()`` keys carry the ``module.`` prefix (as PyTorch's DDP's do): load a
    plain model's state into ``wrapper.module``, or strip the prefix. No parameter or
    buffer is added: ``parameters()`` and ``named_parameters()`` are the wrapped module's.

    The end of backward: the first gradient hook of a synchronised backward queues a callback
    on autograd's engine (as PyTorch's DDP reducer does), which runs once that backward is done
    and calls ``finish_gradient_synchronization``. ``finish_in_backward=False`` leaves that call
    to the caller (FSDP ends its replicated parameters' DDP in its own callback).
    """

    def __init__(self, module: nn.Module, process_group=None, transport="auto", *, finish_in_backward: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised process group (process_groups.distributed)")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # The trainable parameters in registration order; a tied weight appears once.
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in module.named_parameters()}
        # False inside no_sync(); read by the gradient hooks when backward runs.
        self.require_backward_grad_sync = True
        self.finish_in_backward = finish_in_backward
        self._armed = False     # an end-of-backward callback is queued (cleared when it runs)
        self._finished = False  # synchronised; cleared by a forward with gradients or a gradient's arrival
        # Host seconds the last finish took (at the end of backward, or called): the communication
        # left exposed after backward. On CUDA set sync_device_for_timing to include the
        # device-side wait (it synchronises the device before and after: measurement only).
        self.last_wait_s = 0.0
        self.sync_device_for_timing = False
        check_same_model(module, process_group)  # before the broadcast, which a mismatch would abort or corrupt
        # How the ranks sum gradients (``transport.resolve``: "auto" is this host's shared memory when every
        # rank is on it and the gradients are on the CPU, else torch.distributed's all_reduce). Chosen before
        # the broadcast, so that ranks refused for choosing different transports keep their own weights.
        device = self._trainable[0].device if self._trainable else torch.device("cpu")
        self.transport = comm_transport.resolve(transport, process_group, device, engine=type(self).__name__)
        self.broadcasts = broadcast_module_state(module, process_group)
        self_ref = weakref.ref(self)
        # On the module itself, so that a forward that bypasses the wrapper (FSDP's) counts too.
        self._hook_handles = [module.register_forward_pre_hook(_forward_pre_hook(self_ref))]
        self._hook_handles += [p.register_post_accumulate_grad_hook(_hook(self_ref, position))
                               for position, p in enumerate(self._trainable)]

    def remove_hooks(self) -> None:
        """Detach from the module and its parameters: later backward passes are plain local ones."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _before_forward(self) -> None:
        """The module's forward pre-hook, with gradients enabled."""
        if self._in_flight():
            raise RuntimeError(_UNFINISHED.format(what="a forward with gradients enabled"))
        self._finished = False  # a rank whose backward reaches no parameter can still finish by hand

    @contextmanager
    def no_sync(self):
        """Skip gradient communication for the backward passes run inside (gradient accumulation).

        Gradients keep adding up in ``param.grad``; the first synchronised backward after
        the context (or ``finish_gradient_synchronization``) averages the accumulated sum.

        Note: the flag is read when backward runs, so the ``backward()`` call must be
        inside the context (in PyTorch's DDP the forward decides; run both inside, as its
        documentation shows, and the two agree).

        Raises RuntimeError if a synchronised backward's buckets are still in flight (see
        ``_UNFINISHED``): a backward in here would add into gradients that are being sent.
        """
        if self._in_flight():
            raise RuntimeError(_UNFINISHED.format(what="no_sync()"))
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Finish communication: afterwards each trainable ``param.grad`` is its average over ranks.

        Each synchronised backward calls it at its end (unless ``finish_in_backward=False``), so a
        call afterwards does nothing, as it does inside ``no_sync()`` with nothing in flight. Called
        after backward passes that only accumulated (``no_sync``), or on a rank whose backward reached
        no parameter while its peers' did, it averages the gradients as they are (a collective: every
        rank finishes, by hand or at its backward's end). Records ``last_wait_s``.
        """
        if not self._in_flight() and (self._finished or not self.require_backward_grad_sync):
            return
        timing = self.sync_device_for_timing
        device = (self._trainable[0].device if self._trainable else torch.device("cpu")) if timing else None
        if timing:
            synchronize(device)  # so the clock below measures communication, not queued backward
        start = time.perf_counter()
        self._armed = False
        with torch.no_grad():
            self._finish()
        if timing:
            synchronize(device)
        self._finished = True
        self.last_wait_s = time.perf_counter() - start

    def _on_grad_ready(self, position: int, param: nn.Parameter) -> None:
        """Backward finished accumulating ``param.grad`` (hook): a synchronised backward ends with a finish."""
        self._finished = False
        if self.require_backward_grad_sync and not self._armed and self.finish_in_backward:
            self._arm()

    def _arm(self) -> None:
        """Have autograd call ``finish_gradient_synchronization`` once the running backward is done (only
        from inside a backward: a hook's). If that backward raises, the engine drops the callback: the
        wrapper stays in flight and the next forward says so."""
        self._armed = True
        Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)

    def _in_flight(self) -> bool:
        """True between a synchronised backward's first gradient and the finish that ends it."""
        return self._armed

    def _finish(self) -> None:
        raise NotImplementedError

    def _name(self, param: torch.Tensor) -> str:
        return self._names.get(id(param), "<unnamed>")


def _forward_pre_hook(ref: weakref.ref):
    def before_forward(module, args) -> None:
        wrapper = ref()
        if wrapper is not None and torch.is_grad_enabled():
            wrapper._before_forward()

    return before_forward


def _grads_or_zeros(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient; a missing one becomes zeros, set as its .grad (rank-consistent)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


# --------------------------------------------------------------------------- after-backward baselines


class NaiveDDP(_DataParallel):
    """One blocking all-reduce per trainable parameter, at the end of backward.

    ``NaiveDDP(module, process_group=None, transport="auto")``. The baseline: no overlap with
    backward and one collective (one round trip) per parameter. ``transport``: how the ranks
    sum (``transport.resolve``), as for ``DDP``.

    Note: a parameter whose ``.grad`` is None on a rank contributes zeros and, like every
    other, ends with the average as its gradient (zeros if no rank had one). ``DDP``
    instead leaves None where no rank had a gradient.
    """

    def _finish(self) -> None:
        for grad in _grads_or_zeros(self._trainable):
            self.transport.all_reduce(grad, "avg")  # divides before the sum: see the note above _DataParallel


class FlatDDP(_DataParallel):
    """All gradients flattened into one tensor (per dtype and device), one all-reduce, at the end of backward.

    ``FlatDDP(module, process_group=None, transport="auto")``. One round trip per step, but
    no overlap with backward, and two extra copies of the gradients (into the flat tensor and
    back); the flat tensor, as big as all gradients, is allocated once by the transport.

    Note: missing gradients are handled as in ``NaiveDDP`` (zeros in, average out).
    """

    def __init__(self, module: nn.Module, process_group=None, transport="auto"):
        super().__init__(module, process_group, transport)
        # One flat buffer per (dtype, device), allocated by the transport once (zero copy on shared memory).
        self._flats = [self.transport.allocate((sum(p.numel() for p in params),), dtype=params[0].dtype,
                                               device=params[0].device)
                       for params in coalesce(self._trainable, cap_bytes=2**62)]

    @property
    def flat_buffers(self) -> tuple[torch.Tensor, ...]:
        """The flat gradient buffers (one per dtype and device), kept from step to step (read-only view)."""
        return tuple(self._flats)

    def _finish(self) -> None:
        for flat, grads in zip(self._flats, coalesce(_grads_or_zeros(self._trainable), cap_bytes=2**62)):
            views = _unflatten_dense_tensors(flat, grads)  # (total numel,) in registration order
            for grad, view in zip(grads, views):
                torch.div(grad, self.world_size, out=view)  # before the sum: see the note above _DataParallel
            self.transport.all_reduce(flat, "sum")
            for grad, average in zip(grads, views):
                grad.copy_(average)


# --------------------------------------------------------------------------- bucketed, overlapped


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: int, last_cap_bytes: int = 0) -> list[list[int]]:
    """Indices into ``params`` for each bucket, in launch order.

    Parameters are taken in reverse order (backward produces the last layers' gradients
    first, as PyTorch's DDP assumes) and added to the open bucket, which closes as soon as
    its gradient bytes reach ``cap_bytes``: PyTorch's DDP's rule, so a bucket exceeds the
    cap by at most its last parameter. ``cap_bytes == 0`` gives one bucket per parameter.
    Parameters of different dtype or device never share a bucket: each (dtype, device) has
    its own open bucket.

    The tail: the last bucket's all-reduce can only start when backward ends, so nothing
    hides it. The first parameters (in registration order) whose bytes add up to at most
    ``last_cap_bytes`` therefore get buckets of their own, launched last, and the bucket
    before them closes early, while backward still has those first layers to go through.
    (For resnet18 at 25 MiB, ``[b.nbytes for b in DDP(model).buckets]`` shows the split;
    ``last_bucket_cap_mb=0`` restores PyTorch's layout.) Why not close a bucket before it
    would overflow instead? That moves the tail's size around with the cap; this rule sets it.
    The tail takes at most 1/``TAIL_SHARE`` of the model's gradient bytes: it pays when the first
    layers are cheap to send and costly to differentiate (convolutions at full resolution), not
    when they are most of the model (see ``TAIL_SHARE``).
    """
    total: dict[tuple, int] = {}  # (dtype, device) -> gradient bytes
    for p in params:
        total[p.dtype, p.device] = total.get((p.dtype, p.device), 0) + p.numel() * p.element_size()
    in_tail, seen = [], {}  # in_tail[i]: params[i] is among the first bytes of its (dtype, device) the tail takes
    for p in params:
        key = (p.dtype, p.device)
        seen[key] = seen.get(key, 0) + p.numel() * p.element_size()
        in_tail.append(cap_bytes > 0 and seen[key] <= min(last_cap_bytes, total[key] // TAIL_SHARE))
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[list[int], int]] = {}  # key -> (indices, gradient bytes); absent: none open
    for index in reversed(range(len(params))):
        p = params[index]
        # The tail is a kind of its own: reached last in reverse order, its buckets come after the others.
        key, nbytes = (p.dtype, p.device, in_tail[index]), p.numel() * p.element_size()
        indices, size = open_bucket.pop(key, (None, 0))
        if indices is None:
            indices = []
            buckets.append(indices)
        indices.append(index)
        if size + nbytes < cap_bytes:  # still room: the next parameter of this kind joins it
            open_bucket[key] = (indices, size + nbytes)
    return buckets


def _dense_strides(p: torch.Tensor) -> tuple[int, ...]:
    """The strides autograd gives p's gradient: p's own if p is dense and non-overlapping
    (e.g. channels_last), else contiguous. empty_like follows exactly that rule; on the meta
    device it allocates nothing."""
    return torch.empty_like(p, device="meta").stride()


@dataclass(eq=False)
class Bucket:
    """One all-reduce's worth of gradients (read-only for users; tests inspect the layout).

    ``flat`` is (n + k,) for k parameters holding n gradient elements:
    ``flat[:n]`` (``grads``) holds the gradients back to back in ``params`` order, and
    after the first synchronised step each ``param.grad`` IS its slice ``views[i]``
    (PyTorch's ``gradient_as_bucket_view``), so autograd accumulates straight into the
    bucket and nothing is copied back. ``flat[n:]`` (``flags``) says per parameter
    whether the rank had a gradient: their sum over ranks tells whether anyone did.
    """

    index: int
    params: list[nn.Parameter]
    names: list[str]
    positions: list[int]  # each param's index in DDP's trainable list (registration order)
    flat: torch.Tensor
    views: list[torch.Tensor]
    nbytes: int  # gradient bytes, flags excluded
    pending: int = 0  # parameters whose gradient has not arrived in this step
    missing: list[int] = field(default_factory=list)  # slots whose param had no gradient at launch
    work: comm_transport.Work | None = None

    @property
    def grads(self) -> torch.Tensor:
        return self.flat[: self.nbytes // self.flat.element_size()]

    @property
    def flags(self) -> torch.Tensor:
        """(k,) used-flags, or (0,) for a DDP built with ``find_unused_parameters=False``."""
        return self.flat[self.nbytes // self.flat.element_size():]

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def device(self) -> torch.device:
        return self.flat.device


def _make_bucket(index: int, params: list[nn.Parameter], names: list[str], positions: list[int],
                 flags: bool = True, allocate=torch.empty) -> Bucket:
    """The bucket's flat tensor comes from ``allocate`` (the transport's: on shared memory it lies in the
    segment the peers read, so its sum needs no copy)."""
    numel = sum(p.numel() for p in params)
    first = params[0]
    flat = allocate((numel + (len(params) if flags else 0),), dtype=first.dtype, device=first.device).zero_()
    views, offset = [], 0
    for p in params:
        views.append(flat.as_strided(p.shape, _dense_strides(p), offset))
        offset += p.numel()
    return Bucket(index, params, names, positions, flat, views, numel * first.element_size(), pending=len(params))


_SUMMED = comm_transport.Work()  # a finished handle: what a world of one's "sum" returns


def _divisor(world_size: int, dtype: torch.dtype) -> torch.Tensor | None:
    """What ``_adopt_grad`` divides a gradient of ``dtype`` by: None for a world of one (nothing to divide), else
    the world size as a 0-dim CPU tensor of the gradient's own dtype. A Python number would be wrapped in a new
    tensor at every call, and a tensor of another dtype cast anew (4 more dispatched operators and an allocation
    per gradient); the quotient is the same, since a world size is exact in every floating dtype."""
    return None if world_size == 1 else torch.tensor(float(world_size), dtype=dtype)


def _adopt_grad(param: nn.Parameter, view: torch.Tensor, divisor: torch.Tensor | None) -> None:
    """Put param's gradient divided by ``divisor`` (``_divisor``; None: as it is) into ``view`` (its slice of its
    bucket), and make ``view`` its ``.grad``.

    At most one pass over the gradient: an in-place division when autograd already
    accumulated into the view (``zero_grad(set_to_none=False)``, or no zero_grad), a
    dividing copy when the gradient lives elsewhere (the first step, after
    ``zero_grad(set_to_none=True)`` autograd makes a fresh gradient, or after a user
    replaced ``param.grad``). In a world of one: nothing, or a plain copy.
    """
    grad = param.grad
    if grad is view:
        if divisor is not None:
            view.div_(divisor)
        return
    if grad.is_sparse:
        raise RuntimeError("DDP does not support sparse gradients (e.g. nn.Embedding(sparse=True))")
    if divisor is None:
        view.copy_(grad)
    else:
        torch.div(grad, divisor, out=view)
    param.grad = view


def _hook(ddp_ref: weakref.ref, position: int):
    """A post-accumulate-grad hook; a weak reference so a discarded DDP does not live on in its hooks."""

    def on_grad_ready(param: nn.Parameter) -> None:
        ddp = ddp_ref()
        if ddp is not None:
            ddp._on_grad_ready(position, param)

    return on_grad_ready


class DDP(_DataParallel):
    """Data parallelism with bucketed gradient all-reduces overlapped with backward.

    ``DDP(module, bucket_cap_mb=25.0, process_group=None, find_unused_parameters=True, transport="auto")``

    ``DDP(..., finish_in_backward=True)``: a drop-in for PyTorch's DDP in a loop written for it
    (``zero_grad``, forward, ``loss.backward()``, ``step``; ``no_sync()`` for accumulation): each
    synchronised backward ends with every gradient averaged, as PyTorch's does. With
    ``finish_in_backward=False`` the caller must call ``finish_gradient_synchronization()`` (or
    ``sync_gradients(model)``) after each synchronised backward and before ``optimizer.step()``: until
    then the gradients are half-reduced, and a forward with gradients, ``no_sync()`` or (with
    ``guard_optimizer_step``) ``optimizer.step()`` in between raises RuntimeError.

    * Construction broadcasts the group's rank 0 parameters (trainable and frozen) and
      buffers to every rank, coalesced (see ``broadcast_module_state``). Buffers are not
      broadcast again (PyTorch's DDP re-broadcasts rank 0's before every forward by
      default: ``forward_sync_buffers``/``broadcast_buffers``); use synchronised
      BatchNorm to keep running statistics equal.
    * Trainable parameters (``requires_grad=True``; a tied weight counts once) are packed
      into buckets in reverse registration order, each closed once it holds ``bucket_cap_mb``
      MiB (``bucket_cap_mb * 2**20`` bytes) of gradients or more, as PyTorch's DDP does (see
      ``assign_buckets``); ``bucket_cap_mb=0`` means one bucket per parameter; parameters of different
      dtype or device never share one. Unlike PyTorch's DDP the first layers' gradients (at
      most ``last_bucket_cap_mb`` MiB and a quarter of the model's) get buckets of their own,
      launched last: nothing can hide the last bucket's all-reduce, so it is kept small (0
      turns this off). There is no smaller first bucket and no re-bucketing by observed
      gradient order. ``buckets`` shows the layout.
    * During a synchronised backward, a post-accumulate-grad hook marks each gradient
      ready. A complete bucket is all-reduced (sum) asynchronously at once, but buckets
      are launched strictly in index order on every rank: gloo and NCCL match collectives
      by call order, and ranks may finish gradients in different orders. The sums go through
      ``transport`` (``transport.resolve``: by default this host's shared memory when every
      rank is on it, where a bucket is summed in the hook that completes it, in the shared
      segment the transport allocated it in; else torch's asynchronous all_reduce).
    * Each gradient is divided by the world size as it enters its bucket (before the
      sum, like PyTorch's DDP; see the note above ``_DataParallel`` for why). In a world of
      one it is copied in undivided and no collective is called (the transport's would
      return at once); PyTorch's DDP still multiplies by 1 and calls its allreduce.
      ``finish_gradient_synchronization()``, run by autograd once the synchronised backward is
      done (a callback the first hook queues, as PyTorch's reducer does), launches what is left
      (in order) and waits for every bucket, on an asynchronous transport too. Each trainable
      ``param.grad`` is then the average over ranks and a view of its bucket. Calling it again
      does nothing.
    * Gradient accumulation: inside ``no_sync()`` backward communicates nothing; the first
      backward outside it averages what accumulated.
    * Several synchronised backward passes per forward (``retain_graph=True``): each ends
      averaged, so the gradients are the sum of the passes' averages, as one process would
      accumulate them (PyTorch's DDP reduces only the first after each forward).
      ``torch.autograd.grad`` fills no ``.grad`` and communicates nothing.
    * ``forward`` delegates to ``module``; ``parameters()`` and ``named_parameters()`` are
      the module's (nothing is registered besides it), and ``state_dict()`` keys carry the
      ``module.`` prefix, as with PyTorch's DDP: save ``ddp.module.state_dict()`` for a
      checkpoint that loads into the plain model.
    * ``last_wait_s``: seconds the last finish (at the end of backward, or called) took, i.e.
      communication not hidden behind backward (see ``sync_device_for_timing`` on CUDA). On
      an inline transport (shared memory by default) the sums run inside backward, which
      they lengthen, so it is near zero there: compare step times instead.

    Which gradient is averaged: each rank contributes the ``param.grad`` it holds at the
    end of the step (the sum of everything accumulated since the last ``zero_grad``,
    including ``no_sync`` passes); a rank whose ``param.grad`` is None contributes zeros.
    If every rank had None, ``param.grad`` stays None everywhere (so, as in single-process
    training, the optimizer skips the parameter); if any rank had a gradient, every rank
    gets the average. A one-element flag per parameter rides in its bucket's all-reduce
    to decide this, so no extra collective is needed; it matches PyTorch's DDP with
    ``find_unused_parameters=True``. A parameter without a gradient delays its bucket
    (and all later ones) to the end of backward. With
    ``find_unused_parameters=False`` the buckets carry no flags (one element per parameter
    less; PyTorch's DDP by default has none either, and raises on an unused parameter):
    every trainable parameter then gets the average as its gradient, zeros where no rank had
    one (as ``NaiveDDP`` does), so an optimizer with weight decay or momentum state would
    also update a parameter nobody used.

    Works with any optimizer and with ``zero_grad(set_to_none=True)`` (the default: one
    dividing copy into the bucket per step) or ``set_to_none=False`` (no copy: autograd
    accumulates into the bucket, divided in place). Memory: one bucket copy of the
    trainable parameters, which also serves as the gradients; PyTorch's DDP (default
    ``gradient_as_bucket_view=False``) keeps the gradients besides its buckets and copies
    the averages back into them.

    Warnings:
        * Every rank's synchronised backward must reach some trainable parameter (as with
          PyTorch's DDP): a rank whose backward reaches none has no end of backward to finish
          at, so it must call ``finish_gradient_synchronization()`` by hand, or its peers wait
          until the group's timeout. Reentrant activation checkpointing may finish inside the
          checkpoint's own backward, then again at the end: correct, but sent twice.
        * Wrap a module once, after moving it to its device; every rank must wrap an
          identical model (checked at construction: ``check_same_model``). Sparse
          gradients and double backward are not supported.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, process_group=None,
                 find_unused_parameters: bool = True, last_bucket_cap_mb: float = LAST_BUCKET_CAP_MB,
                 transport="auto", *, finish_in_backward: bool = True):
        if bucket_cap_mb < 0 or last_bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb and last_bucket_cap_mb must be >= 0, got {bucket_cap_mb} and "
                             f"{last_bucket_cap_mb}")
        super().__init__(module, process_group, transport, finish_in_backward=finish_in_backward)
        self.find_unused_parameters = find_unused_parameters
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_cap_bytes = int(bucket_cap_mb * MIB)
        self.buckets: list[Bucket] = []
        # position -> (bucket, its view, divisor): what the hook needs, looked up once per gradient.
        self._route: list[tuple[Bucket, torch.Tensor, torch.Tensor | None]] = [None] * len(self._trainable)
        for index, positions in enumerate(assign_buckets(self._trainable, self.bucket_cap_bytes,
                                                         int(last_bucket_cap_mb * MIB))):
            params = [self._trainable[i] for i in positions]
            bucket = _make_bucket(index, params, [self._name(p) for p in params], positions, find_unused_parameters,
                                  self.transport.allocate)
            self.buckets.append(bucket)
            divisor = _divisor(self.world_size, bucket.dtype)
            for slot, position in enumerate(positions):
                self._route[position] = (bucket, bucket.views[slot], divisor)
        self._reset_step()

    # ---- per step state: which gradients arrived, which buckets are launched

    def _reset_step(self) -> None:
        self._ready = [False] * len(self._trainable)
        self._ready_count = 0
        self._next_launch = 0  # buckets [0, _next_launch) are launched, on every rank in this order
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.params), None
            if bucket.missing:
                bucket.missing.clear()

    def _in_flight(self) -> bool:
        return self._armed or self._ready_count > 0 or self._next_launch > 0

    def _on_grad_ready(self, position: int, param: nn.Parameter) -> None:
        """Backward finished accumulating ``param.grad`` (hook); may launch buckets.

        Runs once per parameter per backward, so it stays lean: no ``torch.no_grad()``
        (a context manager's cost at every call), since backward runs hooks with gradients off unless create_graph.
        """
        self._finished = False
        if not self.require_backward_grad_sync:
            return  # accumulation micro-batch: the gradient stays in param.grad
        if self._ready[position]:
            raise RuntimeError(
                f"DDP: parameter {self._name(param)!r} received a second gradient before "
                "finish_gradient_synchronization(): built with finish_in_backward=False, call it after every "
                "synchronised backward; with reentrant activation checkpointing, use use_reentrant=False.")
        if not self._armed:  # the first gradient of this backward (or every one, without finishing in backward)
            if torch.is_grad_enabled():  # create_graph holds for the whole backward: checked at its first hook
                raise RuntimeError("DDP does not support backward(create_graph=True) (double backward)")
            if self.finish_in_backward:
                self._arm()
        self._ready[position] = True
        self._ready_count += 1
        bucket, view, divisor = self._route[position]
        _adopt_grad(param, view, divisor)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_complete_buckets()

    def _launch_complete_buckets(self) -> None:
        # Bucket k goes only after buckets 0..k-1: the call order must be the same on all ranks.
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's asynchronous sum; gradients that never arrived are filled in first."""
        if bucket.pending:  # only from finish: take param.grad as it is, or zeros
            for slot, (param, position) in enumerate(zip(bucket.params, bucket.positions)):
                if self._ready[position]:
                    continue
                if param.grad is None:
                    bucket.views[slot].zero_()
                    if self.find_unused_parameters:
                        bucket.missing.append(slot)
                    else:  # no flags to tell: the gradient is the average, with zeros from this rank
                        param.grad = bucket.views[slot]
                else:
                    _adopt_grad(param, bucket.views[slot], self._route[position][2])
        if self.find_unused_parameters:  # else the bucket carries no flags: nothing to fill
            flags = bucket.flags
            flags.fill_(1)
            if bucket.missing:
                flags[bucket.missing] = 0
        # A world of one has nothing to sum: the transport's all_reduce would return at once (every
        # transport's contract), so it is not called. PyTorch's DDP calls its allreduce even then.
        bucket.work = self.transport.all_reduce(bucket.flat, "sum", async_op=True) if self.world_size > 1 else _SUMMED

    def _finish(self) -> None:
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        self._next_launch = len(self.buckets)
        for bucket in self.buckets:
            self._complete(bucket)
        self._reset_step()

    def _complete(self, bucket: Bucket) -> None:
        bucket.work.wait()
        if bucket.missing:
            # Reading the flags waits for the device; only ranks with a missing gradient pay it.
            had_grad = bucket.flags.tolist()  # (k,) number of ranks that had each gradient
            for slot in bucket.missing:
                if had_grad[slot] > 0:
                    bucket.params[slot].grad = bucket.views[slot]


# --------------------------------------------------------------------------- selection by name


def make_ddp(variant: str, module: nn.Module, bucket_cap_mb: float = 25.0, process_group=None,
             find_unused_parameters: bool = True, transport=None, **pytorch_kwargs) -> nn.Module:
    """Wrap ``module`` in the data-parallel variant named ``variant`` (one of ``VARIANTS``).

    ``bucket_cap_mb`` (MiB, default 25) applies to ``ours`` and ``pytorch``;
    ``find_unused_parameters`` to ``ours`` and ``ours overlap`` (see ``DDP``); another name is a ValueError that
    lists ``VARIANTS``.
    ``pytorch`` is ``torch.nn.parallel.DistributedDataParallel`` with
    ``forward_sync_buffers=False`` (``broadcast_buffers=False`` before it; ``compat.NO_BUFFER_SYNC``),
    so it behaves like ours (buffers broadcast once, at construction) and pays no extra
    collective per forward; its other arguments keep their defaults (e.g.
    ``gradient_as_bucket_view=False``) unless ``pytorch_kwargs`` override them.

    ``transport``: how the gradients are summed (``transport.resolve``). None is each
    engine's own default: "auto" for ours, PyTorch's built-in all-reduce for ``pytorch``.
    Given for ``pytorch``, any transport but "torch" is registered as its communication
    hook (``transport.ddp_comm_hook``), so the two engines can be compared on one transport.

    Drive every variant the same way, as PyTorch's DDP: ``no_sync()`` around the backward passes
    that only accumulate; each synchronised backward ends averaged (``sync_gradients(model)``
    before the step is harmless, and needed only with ``finish_in_backward=False``).
    """
    ours = "auto" if transport is None else transport
    if variant == "ours":
        return DDP(module, bucket_cap_mb, process_group, find_unused_parameters, transport=ours)
    if variant == "ours overlap":
        return DDP(module, 0.0, process_group, find_unused_parameters, transport=ours)
    if variant == "ours flat":
        return FlatDDP(module, process_group, transport=ours)
    if variant == "ours naive":
        return NaiveDDP(module, process_group, transport=ours)
    if variant == "pytorch":
        device = next(module.parameters()).device
        kwargs = dict(device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb,
                      process_group=process_group, **compat.NO_BUFFER_SYNC)
        model = torch.nn.parallel.DistributedDataParallel(module, **{**kwargs, **pytorch_kwargs})
        # Always resolved (None as "torch", its own communication): resolve is a collective, so ranks that
        # chose differently all raise instead of some waiting in it for the others.
        chosen = comm_transport.resolve("torch" if transport is None else transport, process_group, device,
                                    engine="DistributedDataParallel")
        if not isinstance(chosen, comm_transport.Torch):
            model.register_comm_hook(chosen, comm_transport.ddp_comm_hook)
        return model
    raise ValueError(f"unknown DDP variant {variant!r}: choose one of {', '.join(VARIANTS)}")


def guard_optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer):
    """Make ``optimizer.step()`` raise RuntimeError while ``model`` (ours) still has gradients in
    flight: built with ``finish_in_backward=False`` and ``sync_gradients(model)`` forgotten, or after
    a synchronised backward that raised.

    A step pre-hook on the optimizer (a flag read, no communication). Returns its handle, or
    None for models that leave nothing in flight (PyTorch's DDP waits inside backward;
    ``NaiveDDP`` and ``FlatDDP`` start communicating only when backward ends).
    """
    if not isinstance(model, DDP):
        return None

    def check(*_):
        if model._in_flight():
            raise RuntimeError(_UNFINISHED.format(what="optimizer.step()"))

    return optimizer.register_step_pre_hook(check)


def sync_gradients(model: nn.Module) -> None:
    """End a synchronised step: ``finish_gradient_synchronization()`` for ours (nothing left to do
    unless built with ``finish_in_backward=False``); nothing for PyTorch's DDP, whose backward
    already waited for its all-reduces."""
    finish = getattr(model, "finish_gradient_synchronization", None)
    if finish is not None:
        finish()
