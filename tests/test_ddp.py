"""ddp.py: every variant trains exactly like one process on the global batch.

Two spawned groups (2 and 3 workers, started together) run every case; the parent
trains the same models from the same initial weights on the whole global batch in one
process (the oracle) and compares. Models are float64, so "exactly" means agreement to
1e-9 relative: the only differences are summation orders (mean of per-rank means vs
one mean). A summed instead of averaged gradient, a lost micro-batch, a gradient of
the wrong parameter or a skipped step is off by far more. The comparison with PyTorch's
DDP runs in float32, as real training does.

Every variant also runs on each transport (``transport.resolve``: "auto", which is this host's
shared memory here, "torch", "p2p", and Transport objects); a ``CountingTransport`` passed as
``transport=`` counts the sums an engine makes through it.
"""

from __future__ import annotations

import errno
import functools
import itertools
import warnings
from unittest import mock
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import POINT_TO_POINT, CollectiveCounter, CountingTransport, refused, run_workers
from dpkit.comm import shared_memory
from dpkit.comm import transport
from dpkit.engines.ddp import (DDP, LAST_BUCKET_CAP_MB, TAIL_SHARE, FlatDDP, NaiveDDP, assign_buckets,
                               guard_optimizer_step, make_ddp, sync_gradients)

D_IN, D_OUT = 5, 3
MICRO = 4  # samples per rank in a micro-batch
STEPS = 3  # optimizer steps per run
LR, MOMENTUM = 0.1, 0.9
KIB = 1 / 1024  # in MiB, the unit of bucket_cap_mb
CAPS = {"0": 0.0, "1KiB": 1 * KIB, "4KiB": 4 * KIB, "1000MiB": 1000.0}
ZERO_MODES = ("set_to_none", "zeros", "replaced")  # how gradients are cleared between steps
ACCUMS = (1, 3)  # micro-batches per optimizer step


# --------------------------------------------------------------------------- models


class Frozen(nn.Module):
    """The first layer is frozen: it is broadcast but never synchronised or stepped."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, 8).requires_grad_(False)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, D_OUT)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.embed(x)))))


class Tied(nn.Module):
    """``a`` and ``b`` share one weight: one parameter, two uses, synchronised once."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.out = nn.Linear(8, D_OUT)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(torch.tanh(self.inp(x)))))))


def big():
    """``2.weight`` (48 x 48 float64 = 18 KiB) is bigger than the 4 KiB bucket.

    Gradient bytes in registration order: 0.weight 1920, 0.bias 384, 2.weight 18432,
    2.bias 384, 4.weight 1152, 4.bias 24.
    """
    return nn.Sequential(nn.Linear(D_IN, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, D_OUT))


class Partial(nn.Module):
    """``extra`` is used only where ``use_extra`` (one rank); ``never`` is never used."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(D_IN, D_OUT)
        self.extra = nn.Linear(D_IN, D_OUT)
        self.never = nn.Linear(D_IN, D_OUT)

    def forward(self, x, use_extra=False):
        y = self.body(x)
        return y + self.extra(x) if use_extra else y


class TwoBranches(nn.Module):
    """Equal-shaped branches; the forward order decides which branch's gradients come first."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, D_OUT)
        self.b = nn.Linear(D_IN, D_OUT)

    def forward(self, x, a_first=True):
        if a_first:
            ya = self.a(x)
            yb = self.b(x)
        else:
            yb = self.b(x)
            ya = self.a(x)
        return ya * yb


class Mixed(nn.Module):
    """float64, float32, float64 layers: buckets never mix dtypes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2).double()
        self.b = nn.Linear(2, 2).float()
        self.c = nn.Linear(2, 2).double()


class WithState(nn.Module):
    """Trainable and frozen parameters and buffers of two dtypes, for the construction broadcast."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(D_IN, 4).requires_grad_(False)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, D_OUT)

    def forward(self, x):
        return self.out(self.bn(self.frozen(x)))


def conv_net():
    """A float32 CNN with BatchNorm for the comparison with PyTorch's DDP (inputs 3 x 6 x 6)."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, D_OUT))


MODELS = {"frozen": Frozen, "tied": Tied, "big": big}


def build(factory, seed, dtype=torch.float64):
    torch.default_generator.manual_seed(seed)  # torch.manual_seed would also format a traceback for CUDA, each call
    return factory().to(dtype)


# --------------------------------------------------------------------------- data and training loop


def global_batch(step, micro, world, shape=(D_IN,), dtype=torch.float64):
    """The whole micro-batch of all ranks: x (world * MICRO, *shape), y (world * MICRO, D_OUT)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return (torch.randn(world * MICRO, *shape, generator=g, dtype=dtype),
            torch.randn(world * MICRO, D_OUT, generator=g, dtype=dtype))


def shard(batch, rank):
    return tuple(t[rank * MICRO:(rank + 1) * MICRO] for t in batch)


class MomentumSGD:
    """``torch.optim.SGD(params, lr, momentum)``, the same arithmetic, without torch.optim.

    Constructing any torch optimizer imports torch._dynamo: 2.4 s of CPU per process. The
    parent's oracles and the 3-rank group use this one; the 2-rank group, which imports
    it anyway for PyTorch's DDP, drives the DDP under test with torch.optim.SGD.
    """

    def __init__(self, params, lr, momentum):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers = [None] * len(self.params)

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.buffers[i] is None:
                self.buffers[i] = p.grad.clone()
            else:
                self.buffers[i].mul_(self.momentum).add_(p.grad)
            p.add_(self.buffers[i], alpha=-self.lr)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def clear_grads(model, optimizer, zero_mode):
    if zero_mode == "zeros":
        optimizer.zero_grad(set_to_none=False)
        return
    optimizer.zero_grad(set_to_none=True)
    if zero_mode == "replaced":  # the user puts their own tensors in .grad
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)


def train(model, loss_of, accum=1, zero_mode="set_to_none", steps=STEPS, counter=None, on_sync=None,
          optimizer=MomentumSGD):
    """SGD with momentum for ``steps`` steps of ``accum`` micro-batches, the loss divided by ``accum``.

    ``loss_of(step, micro)`` computes one micro-batch's loss. Data-parallel wrappers get
    ``no_sync()`` on all micro-batches but the last and ``sync_gradients`` before the step.
    Returns the final parameters and buffers, the last step's gradients (None where None)
    and, with a ``counter`` (the ``CountingTransport`` the model sums through, or an entered
    ``CollectiveCounter``), per step: collectives counted inside no_sync, all_reduces made by
    the end of the synchronised backward, and all_reduces in total. ``on_sync(model)`` runs
    after every synchronisation; its answers are returned too.
    """
    optimizer = optimizer(model.parameters(), lr=LR, momentum=MOMENTUM)
    clear_grads(model, optimizer, zero_mode)
    counts, grads, seen = [], {}, []
    for step in range(steps):
        in_no_sync = 0
        if counter is not None:
            counter.reset()
        for micro in range(accum):
            last = micro == accum - 1
            with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
                (loss_of(step, micro) / accum).backward()
            if not last and counter is not None:
                in_no_sync += counter.collectives
                counter.reset()
        after_backward = counter.calls["all_reduce"] if counter is not None else None
        sync_gradients(model)
        if counter is not None:
            counts.append((in_no_sync, after_backward, counter.calls["all_reduce"]))
        seen.append(on_sync(model) if on_sync else None)
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        clear_grads(model, optimizer, zero_mode)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"state": state, "grads": grads, "counts": counts, "on_sync": seen}


def mse_loss(model, world, rank=None, **forward_kwargs):
    """The loss on the global batch (rank None) or on ``rank``'s shard of it."""
    def loss_of(step, micro):
        batch = global_batch(step, micro, world)
        x, y = batch if rank is None else shard(batch, rank)
        return F.mse_loss(model(x, **forward_kwargs), y)

    return loss_of


def strip_module(state):
    return {k.removeprefix("module."): v for k, v in state.items()}


# --------------------------------------------------------------------------- the workers


def _grads_are_bucket_views(model):
    return all(p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
               for b in model.buckets for p in b.params)


def _owned(model) -> list[bool]:
    """Whether each buffer the variant sums in lies in memory its transport allocated (zero copy): DDP's
    bucket flats, FlatDDP's flat buffers (none for NaiveDDP, which sums the gradients themselves)."""
    if isinstance(model, DDP):
        return [model.transport.owns(b.flat) for b in model.buckets]
    return [model.transport.owns(flat) for flat in getattr(model, "_flats", [])]


def _ddp_runs(ctx):
    """Every (model, cap, zero mode, accumulation) run of the hand-written DDP, counted by the transport
    it sums through (around "auto": this host's shared memory)."""
    out = {}
    counter = CountingTransport("auto")
    for name, factory in MODELS.items():
        for cap_name, cap in CAPS.items():
            for zero_mode in ZERO_MODES:
                for accum in ACCUMS:
                    model = DDP(build(factory, seed=0), bucket_cap_mb=cap, transport=counter)
                    result = train(model, mse_loss(model, ctx.world_size, ctx.rank), accum, zero_mode,
                                   counter=counter, on_sync=_grads_are_bucket_views, optimizer=torch.optim.SGD)
                    result.update(buckets=len(model.buckets), transport=model.transport.describe(), owned=_owned(model))
                    out[name, cap_name, zero_mode, accum] = result
    return out


def _baseline_runs(ctx):
    """NaiveDDP and FlatDDP on every model, with and without accumulation."""
    out = {}
    counter = CountingTransport("auto")
    for wrapper in (NaiveDDP, FlatDDP):
        for name, factory in MODELS.items():
            for accum in ACCUMS:
                model = wrapper(build(factory, seed=0), transport=counter)
                out[wrapper.__name__, name, accum] = train(model, mse_loss(model, ctx.world_size, ctx.rank), accum,
                                                           counter=counter, optimizer=torch.optim.SGD)
    return out


def _layouts(ctx):
    """Bucket layouts read off DDP objects: names, gradient bytes, dtypes."""
    def layout(model, cap):
        ddp = DDP(model, bucket_cap_mb=cap)
        return [(b.names, b.nbytes, b.dtype) for b in ddp.buckets]

    out = {("big", cap_name): layout(build(big, 0), cap) for cap_name, cap in CAPS.items()}
    out["frozen", "1000MiB"] = layout(build(Frozen, 0), 1000.0)
    out["tied", "0"] = layout(build(Tied, 0), 0.0)
    torch.manual_seed(0)
    out["mixed", "1000MiB"] = layout(Mixed(), 1000.0)
    return out


def _construction(ctx):
    """Different initial weights and buffers on each rank; DDP's constructor makes them rank 0's."""
    net = build(WithState, seed=10 + ctx.rank)
    with torch.no_grad():
        net.bn.running_mean.fill_(ctx.rank + 1.0)
        net.bn.num_batches_tracked.fill_(ctx.rank + 5)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    chosen = transport.resolve("auto")  # made beforehand: a first shared-memory transport maps its files
    with CollectiveCounter() as counter:
        ddp = DDP(net, transport=chosen)
    return {
        "before": before,
        "after": {k: v.clone() for k, v in net.state_dict().items()},
        "calls": dict(counter.calls),
        "state_dict_keys": list(ddp.state_dict()),
        "module_keys": list(net.state_dict()),
        "same_parameters": [id(p) for p in ddp.parameters()] == [id(p) for p in net.parameters()],
        "same_named_parameters": [(n, id(p)) for n, p in ddp.named_parameters()]
        == [("module." + n, id(p)) for n, p in net.named_parameters()],
        "same_buffers": [id(b) for b in ddp.buffers()] == [id(b) for b in net.buffers()],
    }


def _unused(ctx):
    """``extra`` is used by rank 1 only and ``never`` by nobody; one bucket per parameter and one for all."""
    out = {}
    for cap_name in ("0", "1000MiB"):
        model = DDP(build(Partial, seed=0), bucket_cap_mb=CAPS[cap_name])
        out[cap_name] = train(model, mse_loss(model, ctx.world_size, ctx.rank, use_extra=ctx.rank == 1))
    return out


def _unused_without_flags(ctx):
    """As ``_unused``, but without used-flags in the buckets (``find_unused_parameters=False``)."""
    model = DDP(build(Partial, seed=0), bucket_cap_mb=CAPS["1000MiB"], find_unused_parameters=False)
    result = train(model, mse_loss(model, ctx.world_size, ctx.rank, use_extra=ctx.rank == 1))
    result["bucket_numel"] = [b.flat.numel() for b in model.buckets]
    return result


def _arrival_order(ctx):
    """Rank 0 runs branch a first, the others b first, so their gradients arrive in opposite orders."""
    model = DDP(build(TwoBranches, seed=0), bucket_cap_mb=0.0)
    arrived = []
    for name, p in model.module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: arrived.append(name))
    result = train(model, mse_loss(model, ctx.world_size, ctx.rank, a_first=ctx.rank == 0), steps=1)
    result["arrived"] = arrived
    return result


def _error(fn) -> str | None:
    """The message of the RuntimeError or ValueError ``fn()`` raises, or None if it returns."""
    try:
        fn()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return None


def _misuse(ctx):
    """With ``finish_in_backward=False`` (the caller finishes), after a synchronised backward and before
    finish_gradient_synchronization: a forward, no_sync() and optimizer.step() (guarded) must raise and
    leave the step's gradients intact. Then a second backward through the same graph, a double backward,
    an exception inside no_sync()."""
    model = DDP(build(big, seed=0), bucket_cap_mb=4 * KIB, finish_in_backward=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    guard_optimizer_step(model, optimizer)
    x, y = shard(global_batch(0, 0, ctx.world_size), ctx.rank)
    F.mse_loss(model(x), y).backward()
    out = {"forward": _error(lambda: model(x)), "step": _error(optimizer.step)}

    def accumulate_in_no_sync():
        with model.no_sync():
            F.mse_loss(model.module(x), y).backward()  # no_sync() refuses first

    out["no_sync"] = _error(accumulate_in_no_sync)
    model.finish_gradient_synchronization()
    out["grads"] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    out["step_after_finish"] = _error(optimizer.step)
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    out["second"] = _error(loss.backward)
    model.finish_gradient_synchronization()  # every bucket was launched once: this completes the step
    out["double"] = _error(lambda: F.mse_loss(model(x), y).backward(create_graph=True))
    try:
        with model.no_sync():
            raise KeyError("user code fails inside no_sync")
    except KeyError:
        pass
    out["sync_restored"] = model.require_backward_grad_sync
    out["finished by backward"] = _finished_by_backward(ctx)
    return out


def _finished_by_backward(ctx):
    """By default the end of each synchronised backward finishes: right after one, a forward, no_sync() and a
    guarded step go through; finish_gradient_synchronization() then sends nothing. Two synchronised backward
    passes through one graph (retain_graph) leave the sum of their averages; a double backward is refused."""
    counter = CountingTransport("auto")
    model = DDP(build(big, seed=0), bucket_cap_mb=4 * KIB, transport=counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    guard_optimizer_step(model, optimizer)
    x, y = shard(global_batch(0, 0, ctx.world_size), ctx.rank)
    F.mse_loss(model(x), y).backward()
    out = {"grads": {n: p.grad.clone() for n, p in model.module.named_parameters()}}
    counter.reset()
    model.finish_gradient_synchronization()
    out["sums by finish"] = counter.collectives

    def enter_no_sync():
        with model.no_sync():
            pass

    out.update(forward=_error(lambda: model(x)), no_sync=_error(enter_no_sync), step=_error(optimizer.step))
    model = DDP(build(big, seed=0), bucket_cap_mb=4 * KIB)
    loss = F.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    out["twice"] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    out["double"] = _error(lambda: F.mse_loss(model(x), y).backward(create_graph=True))
    return out


# Rank 0 wraps the first model, rank 1 the second; the first difference as rank 0's and rank 1's entry.
MISMATCHES = {
    "shape": (lambda: nn.Linear(D_IN, D_OUT), lambda: nn.Linear(D_IN, D_OUT + 1),
              "parameter 'weight' of shape [3, 5], torch.float32", "parameter 'weight' of shape [4, 5], torch.float32"),
    "dtype": (lambda: nn.Linear(D_IN, D_OUT), lambda: nn.Linear(D_IN, D_OUT).double(),
              "parameter 'weight' of shape [3, 5], torch.float32", "parameter 'weight' of shape [3, 5], torch.float64"),
    "frozen": (lambda: nn.Linear(D_IN, D_OUT), lambda: nn.Linear(D_IN, D_OUT).requires_grad_(False),
               "parameter 'weight' of shape [3, 5], torch.float32 on",
               "parameter 'weight' of shape [3, 5], torch.float32, frozen"),
    "nesting": (lambda: nn.Linear(D_IN, D_OUT), lambda: nn.Sequential(nn.Linear(D_IN, D_OUT)),
                "parameter 'weight' of shape [3, 5], torch.float32",
                "parameter '0.weight' of shape [3, 5], torch.float32"),
    "buffers": (lambda: nn.BatchNorm1d(D_OUT), lambda: nn.BatchNorm1d(D_OUT, track_running_stats=False),
                "buffer 'running_mean' of shape [3], torch.float32", "nothing (fewer parameters and buffers)"),
}


def _mismatched_models(ctx):
    """DDP and NaiveDDP (their shared base checks) on models that differ between the ranks: each rank's error."""
    out = {}
    for case, (ours, theirs, _, _) in MISMATCHES.items():
        for wrapper in (DDP, NaiveDDP):
            model = ours() if ctx.rank == 0 else theirs()
            out[case, wrapper.__name__] = _error(lambda: wrapper(model))
    dist.barrier()  # the group still works after the refusals
    return out


def _against_pytorch(ctx):
    """The same float32 CNN and data through PyTorch's DDP and ours, with accumulation (no_sync in both)."""
    def loss_fn(model, dtype):
        def loss_of(step, micro):
            x, y = shard(global_batch(step, micro, ctx.world_size, shape=(3, 6, 6), dtype=dtype), ctx.rank)
            return F.mse_loss(model(x), y)
        return loss_of

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for variant, cap in (("pytorch", 25.0), ("ours", 25.0), ("ours", 4 * KIB), ("ours overlap", 0.0)):
            # Rank-dependent initial weights: both wrappers must broadcast rank 0's.
            model = make_ddp(variant, build(conv_net, seed=20 + ctx.rank, dtype=dtype), bucket_cap_mb=cap)
            key = (variant, cap) if dtype == torch.float32 else (variant, cap, "bf16")
            out[key] = train(model, loss_fn(model, dtype), accum=3, steps=4, optimizer=torch.optim.SGD)
    return out


# make_ddp's names for DDP (4 KiB buckets), DDP
TRANSPORT_VARIANTS = ("ours", "ours overlap", "ours naive", "ours flat")
# (one bucket per parameter), NaiveDDP and FlatDDP
NAMED = ("auto", "torch", "p2p")
# The cases of _over_transports: each name as given, and a Transport object that counts the sums, around a
# shared-memory transport that sums on a communication thread. (Sums through "torch" are counted as
# torch.distributed calls; _ddp_runs and _baseline_runs count those of "auto" through a CountingTransport.)
COUNTED = ("counting threaded shared_memory",)
TRANSPORT_ACCUM = TRANSPORT_STEPS = 2  # per run of _over_transports: enough for no_sync and a second step


def _summed_by_end_of_backward(model, ctx) -> list[tuple[bool, bool]] | None:
    """One more synchronised backward: (launched, done) for each of DDP's buckets after its last gradient hook,
    before the end of backward waits for them (hooks added after DDP's run after them)."""
    if not isinstance(model, DDP):
        return None
    seen = []
    note = lambda _: seen.append([(b.work is not None, b.work is not None and b.work.is_completed())
                                  for b in model.buckets])
    handles = [p.register_post_accumulate_grad_hook(note) for p in model.parameters() if p.requires_grad]
    x, y = shard(global_batch(TRANSPORT_STEPS, 0, ctx.world_size), ctx.rank)
    F.mse_loss(model(x), y).backward()
    for handle in handles:
        handle.remove()
    return seen[-1]


def _over_transports(ctx):
    """Every variant on ``big`` over each transport. By name, counting the torch.distributed calls (``counts``
    per step; ``torch_calls``: those of the last step's synchronised backward and synchronisation); as a
    CountingTransport, counting the sums made through it. Then PyTorch's DDP summing through our shared
    memory (its comm hook)."""
    out = {}

    def run(spec, variant, counter=None):
        model = make_ddp(variant, build(big, seed=0), bucket_cap_mb=4 * KIB, transport=spec)
        with CollectiveCounter() as calls:
            result = train(model, mse_loss(model, ctx.world_size, ctx.rank), TRANSPORT_ACCUM, steps=TRANSPORT_STEPS,
                           counter=counter or calls)
        result.update(transport=getattr(model, "transport", None) and model.transport.describe(), owned=_owned(model),
                      torch_calls=dict(calls.calls), summed=_summed_by_end_of_backward(model, ctx))
        return result

    for spec in NAMED:
        for variant in TRANSPORT_VARIANTS:
            out[spec, variant] = run(spec, variant)
    threaded = transport.SharedMemory(background=True)
    counter = CountingTransport(threaded)
    for variant in TRANSPORT_VARIANTS:
        out["counting threaded shared_memory", variant] = run(counter, variant, counter)
    threaded.close()
    counter = CountingTransport("shared_memory")
    out["shared_memory", "pytorch"] = run("shared_memory", "pytorch")
    out["counting shared_memory", "pytorch"] = run(counter, "pytorch", counter)
    return out


def _full(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


def _no_room_in_dev_shm(ctx):
    """DDP built while /dev/shm is full (``posix_fallocate`` fails with ENOSPC), on a shared-memory transport
    made then (no room for its control file: it goes through torch), and on one made before (no room for
    the buckets: they are plain tensors, staged through its arena at each sum). Each trains, counting the
    torch.distributed calls and the transport's warnings."""
    out = {}
    for case in ("no room at all", "no room for buckets"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            made_before = transport.SharedMemory() if case == "no room for buckets" else None
            with mock.patch.object(shared_memory.os, "posix_fallocate", _full):
                model = DDP(build(big, seed=0), bucket_cap_mb=4 * KIB,
                            transport=made_before or transport.SharedMemory())
            with CollectiveCounter() as calls:
                result = train(model, mse_loss(model, ctx.world_size, ctx.rank), TRANSPORT_ACCUM, steps=TRANSPORT_STEPS,
                               optimizer=torch.optim.SGD)
        out[case] = {**result, "transport": model.transport.describe(), "owned": _owned(model),
                     "torch_calls": dict(calls.calls),
                     "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}
    return out


def _transport_refusals(ctx):
    """Ranks that pass different transports to a wrapper (two names, a name no transport has, PyTorch's DDP
    through make_ddp, each rank a transport over a group of its own): each rank's error, and whether its
    module kept its own weights (a refused wrapper broadcasts nothing)."""
    out = {}
    for wrapper in (DDP, NaiveDDP):
        net = build(big, seed=40 + ctx.rank)
        before = net[0].weight.clone()
        out["different", wrapper.__name__] = refused(
            lambda: wrapper(net, transport=("torch", "p2p")[ctx.rank]))["error"]
        out["weights kept", wrapper.__name__] = torch.equal(net[0].weight, before)
    out["unknown"] = refused(lambda: DDP(build(big, seed=0), transport=("auto", "carrier pigeon")[ctx.rank]))["error"]
    out["pytorch"] = refused(lambda: make_ddp("pytorch", build(big, seed=0),
                                              transport=("torch", "shared_memory")[ctx.rank]))["error"]
    alone = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank must call new_group
    out["own group"] = refused(lambda: DDP(build(big, seed=0), transport=transport.Torch(alone[ctx.rank])))["error"]
    dist.barrier()  # the group still works after the refusals
    return out


def _two_rank_cases(ctx):
    return {"ddp": _ddp_runs(ctx), "baselines": _baseline_runs(ctx), "transports": _over_transports(ctx),
            "no room": _no_room_in_dev_shm(ctx), "refusals": _transport_refusals(ctx),
            "layouts": _layouts(ctx),
            "construction": _construction(ctx), "unused": _unused(ctx), "arrival": _arrival_order(ctx),
            "unused_without_flags": _unused_without_flags(ctx),
            "misuse": _misuse(ctx), "mismatch": _mismatched_models(ctx), "pytorch": _against_pytorch(ctx)}


def _three_rank_cases(ctx):
    """An odd world size (division by 3), and a DDP on the subgroup of ranks 1 and 2 (then one given a
    transport over all three ranks: refused)."""
    out = {"unused": _unused(ctx)}
    model = DDP(build(big, seed=0), bucket_cap_mb=4 * KIB)
    out["big"] = train(model, mse_loss(model, 3, ctx.rank), accum=3)
    for wrapper in (NaiveDDP, FlatDDP):
        model = wrapper(build(big, seed=0))
        out[wrapper.__name__] = train(model, mse_loss(model, 3, ctx.rank), accum=3)
    subgroup = dist.new_group([1, 2])  # every rank must call new_group
    if ctx.rank in (1, 2):
        model = DDP(build(big, seed=30 + ctx.rank), bucket_cap_mb=4 * KIB, process_group=subgroup)
        out["subgroup"] = train(model, mse_loss(model, 2, ctx.rank - 1), accum=2)
        over_all = transport.Torch()
        out["other group"] = refused(
            lambda: DDP(build(big, seed=0), process_group=subgroup, transport=over_all))["error"]
    return out


@pytest.fixture(scope="module")
def groups():
    """Both spawned groups at once: each worker spends seconds importing torch, so overlap them."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        two, three = pool.submit(run_workers, _two_rank_cases, 2), pool.submit(run_workers, _three_rank_cases, 3)
        return {2: two.result(), 3: three.result()}


@pytest.fixture(scope="module")
def two(groups):
    return groups[2]


@pytest.fixture(scope="module")
def three(groups):
    return groups[3]


# --------------------------------------------------------------------------- oracles


@functools.lru_cache(maxsize=None)
def oracle(name, accum, world, seed=0, steps=STEPS):
    """One process, the whole global batch: the result every rank of a data-parallel run must reach."""
    model = build(MODELS[name], seed)
    return train(model, mse_loss(model, world), accum, steps=steps)


def transport_oracle():
    """The oracle of the runs of ``_over_transports``."""
    return oracle("big", TRANSPORT_ACCUM, world=2, steps=TRANSPORT_STEPS)


def oracle_partial(world):
    """Single-process training on the loss every rank computes, averaged: rank r uses ``extra`` iff r == 1."""
    model = build(Partial, seed=0)
    losses = [mse_loss(model, world, rank, use_extra=rank == 1) for rank in range(world)]
    return train(model, lambda step, micro: sum(loss(step, micro) for loss in losses) / world)


def oracle_branches(world):
    model = build(TwoBranches, seed=0)
    return train(model, mse_loss(model, world), steps=1)


def assert_trains_like(result, expected, rtol=1e-9, atol=1e-12):
    """Same final parameters and buffers, and the same last-step gradients (None where None)."""
    state, expected_state = strip_module(result["state"]), strip_module(expected["state"])
    assert state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol, msg=key)
    grads, expected_grads = strip_module(result["grads"]), strip_module(expected["grads"])
    assert {k: g is None for k, g in grads.items()} == {k: g is None for k, g in expected_grads.items()}
    for key, grad in expected_grads.items():
        if grad is not None:
            torch.testing.assert_close(grads[key], grad, rtol=rtol, atol=atol, msg=key)


# --------------------------------------------------------------------------- tests: training equals one process


DDP_CASES = [(name, cap, zero_mode, accum) for name in MODELS for cap in CAPS for zero_mode in ZERO_MODES
             for accum in ACCUMS]


@pytest.mark.parametrize("name, cap, zero_mode, accum", DDP_CASES)
def test_ddp_trains_like_one_process_on_the_global_batch(two, name, cap, zero_mode, accum):
    """Frozen, tied and bigger-than-bucket parameters; buckets of 0, 4 KiB, 20 KiB, 1000 MiB;
    grads cleared to None, zeroed in place or replaced by the user; no_sync accumulation over 1 or 3
    micro-batches equals one large batch."""
    for rank in range(2):
        assert_trains_like(two[rank]["ddp"][name, cap, zero_mode, accum], oracle(name, accum, world=2))


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_are_averaged_not_summed(two, name):
    """The last step's gradient equals the single-process one, which is the average: a sum is twice it."""
    expected = oracle(name, 1, world=2)["grads"]
    got = strip_module(two[0]["ddp"][name, "4KiB", "set_to_none", 1]["grads"])
    for key, grad in expected.items():
        if grad is not None:
            assert grad.norm() > 1e-3, "a zero gradient could not tell a sum from an average"
            torch.testing.assert_close(got[key], grad, rtol=1e-9, atol=0)


def test_frozen_parameters_get_no_gradient_and_do_not_move(two):
    result = two[1]["ddp"]["frozen", "4KiB", "set_to_none", 3]
    assert result["grads"]["module.embed.weight"] is None and result["grads"]["module.embed.bias"] is None
    initial = build(Frozen, seed=0).state_dict()
    torch.testing.assert_close(result["state"]["module.embed.weight"], initial["embed.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("wrapper", ["NaiveDDP", "FlatDDP"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("accum", ACCUMS)
def test_naive_and_flat_train_like_one_process(two, wrapper, name, accum):
    for rank in range(2):
        assert_trains_like(two[rank]["baselines"][wrapper, name, accum], oracle(name, accum, world=2))


def test_odd_world_size_of_three(three):
    for rank in range(3):
        assert_trains_like(three[rank]["big"], oracle("big", 3, world=3))
        for wrapper in ("NaiveDDP", "FlatDDP"):
            assert_trains_like(three[rank][wrapper], oracle("big", 3, world=3))


def test_ddp_on_a_subgroup_broadcasts_from_its_first_rank_and_divides_by_its_size(three):
    assert "subgroup" not in three[0]
    for rank in (1, 2):  # initial weights: the subgroup's rank 0 is global rank 1 (seed 31)
        assert_trains_like(three[rank]["subgroup"], oracle("big", 2, world=2, seed=31))


def test_ours_equals_pytorch_ddp_with_accumulation(two):
    """float32 CNN, 4 steps of 3 micro-batches, no_sync in both: equal up to float32 round-off.

    (With 2 ranks they are in fact bitwise equal: PyTorch halves before the sum, we after it,
    and halving is exact in binary floating point.)"""
    for rank in range(2):
        runs = two[rank]["pytorch"]
        reference = runs["pytorch", 25.0]
        for key in [("ours", 25.0), ("ours", 4 * KIB), ("ours overlap", 0.0)]:
            assert_trains_like(runs[key], reference, rtol=1e-6, atol=1e-7)
    assert not torch.equal(two[0]["pytorch"]["pytorch", 25.0]["state"]["module.0.weight"],
                           build(conv_net, seed=20, dtype=torch.float32).state_dict()["0.weight"]), "training moved"


def test_a_bfloat16_model_trains_like_under_pytorch_ddp(two):
    """The same CNN in bfloat16 (parameters, gradients, buckets and all-reduces): every variant
    ends where PyTorch's DDP does, up to bfloat16 round-off (8 bits)."""
    for rank in range(2):
        runs = two[rank]["pytorch"]
        reference = runs["pytorch", 25.0, "bf16"]
        assert all(v.dtype == torch.bfloat16 for v in reference["state"].values() if v.is_floating_point())
        for key in [("ours", 25.0), ("ours", 4 * KIB), ("ours overlap", 0.0)]:
            assert_trains_like(runs[(*key, "bf16")], reference, rtol=2**-8, atol=2**-8)
    assert not torch.equal(two[0]["pytorch"]["pytorch", 25.0, "bf16"]["state"]["module.0.weight"],
                           build(conv_net, seed=20, dtype=torch.bfloat16).state_dict()["0.weight"]), "training moved"


# --------------------------------------------------------------------------- tests: communication


@pytest.mark.parametrize("name, cap, zero_mode, accum", DDP_CASES)
def test_one_all_reduce_per_bucket_all_launched_during_backward_none_inside_no_sync(two, name, cap, zero_mode, accum):
    result = two[0]["ddp"][name, cap, zero_mode, accum]
    buckets = expected_bucket_count(MODELS[name], CAPS[cap])
    if name == "big":
        assert buckets == len(BIG_LAYOUTS[cap]), "the rule below agrees with the layouts derived by hand"
    assert result["buckets"] == buckets
    assert result["counts"] == [(0, buckets, buckets)] * STEPS


def expected_bucket_count(factory, cap_mib: float) -> int:
    """The number of buckets the documented rule gives, from the gradient sizes and the cap alone.

    Split off the tail: the first registered parameters whose bytes add up to at most
    LAST_BUCKET_CAP_MB MiB and a quarter of the model's (none when the cap is 0). Walk the rest, then
    the tail, from the last registered to the first, adding each gradient's bytes to the open
    bucket; a bucket closes once it holds the cap or more (so with a cap of 0, after every
    parameter). (All these models are float64.)
    """
    sizes = [p.numel() * p.element_size() for p in build(factory, 0).parameters() if p.requires_grad]
    tail_bytes = min(LAST_BUCKET_CAP_MB * 2**20, sum(sizes) // 4) if cap_mib > 0 else 0
    tail = sum(1 for total in itertools.accumulate(sizes) if total <= tail_bytes)
    return sum(_buckets_of(part, cap_mib * 2**20) for part in (sizes[tail:], sizes[:tail]))


def _buckets_of(sizes: list[int], cap_bytes: float) -> int:
    count, filled = 0, None
    for nbytes in reversed(sizes):
        if filled is None:
            count, filled = count + 1, 0
        filled += nbytes
        if filled >= cap_bytes:
            filled = None
    return count


def test_baselines_all_reduce_once_per_parameter_or_once_in_all_when_backward_ends(two):
    for name, factory in MODELS.items():
        trainable = sum(p.requires_grad for p in build(factory, 0).parameters())
        assert two[0]["baselines"]["NaiveDDP", name, 3]["counts"] == [(0, trainable, trainable)] * STEPS
        assert two[0]["baselines"]["FlatDDP", name, 3]["counts"] == [(0, 1, 1)] * STEPS


def test_buckets_are_launched_in_the_same_order_on_ranks_that_finish_gradients_in_different_orders(two):
    orders = [two[rank]["arrival"]["arrived"] for rank in range(2)]
    assert orders[0] != orders[1], "precondition: the ranks' gradients must arrive in different orders"
    for rank in range(2):
        assert_trains_like(two[rank]["arrival"], oracle_branches(world=2))


def test_constructor_checks_the_models_then_broadcasts_rank0_weights_and_buffers_in_one_collective_per_dtype(two):
    rank0, rank1 = two[0]["construction"], two[1]["construction"]
    assert any(not torch.equal(rank0["before"][k], rank1["before"][k]) for k in rank0["before"]), "precondition"
    for k, value in rank0["before"].items():
        assert torch.equal(rank0["after"][k], value), k
        assert torch.equal(rank1["after"][k], value), k
    dtypes = {v.dtype for v in rank0["before"].values()}
    # One all_gather_object compares the ranks' models first (see the mismatch tests), one more checks that
    # they chose the same transport (transport.resolve; the one given here was made beforehand).
    for calls in (rank0["calls"], rank1["calls"]):
        assert calls == {"all_gather_object": 2, "broadcast": len(dtypes)}


def test_wrapper_adds_no_parameters_and_prefixes_state_dict_keys_with_module(two):
    result = two[0]["construction"]
    assert result["same_parameters"] and result["same_named_parameters"] and result["same_buffers"]
    assert result["state_dict_keys"] == ["module." + k for k in result["module_keys"]]


def test_grads_are_views_of_the_buckets_after_synchronisation(two):
    """No copy back: after each step, every gradient is its bucket's memory, whatever zero_grad did; and no copy
    in or out of the sum: on this host every bucket lies in the shared memory of the transport summing it."""
    for rank in range(2):
        for key, result in two[rank]["ddp"].items():
            assert result["on_sync"] == [True] * STEPS, key
            assert result["transport"] == "counting shared_memory" and all(result["owned"]), key


# --------------------------------------------------------------------------- tests: transports


def sums_per_step(variant: str) -> tuple[int, int]:
    """(sums made by the end of the synchronised backward, sums in all) in one step of ``variant`` on ``big``
    (the bucketed one with 4 KiB buckets): every variant finishes when backward ends."""
    trainable = sum(p.requires_grad for p in build(big, 0).parameters())
    return {"ours": (len(BIG_LAYOUTS["4KiB"]),) * 2, "ours overlap": (trainable, trainable),
            "ours naive": (trainable, trainable), "ours flat": (1, 1)}[variant]


@pytest.mark.parametrize("variant", TRANSPORT_VARIANTS)
@pytest.mark.parametrize("spec", NAMED + COUNTED)
def test_every_variant_trains_like_one_process_on_every_transport(two, spec, variant):
    for rank in range(2):
        assert_trains_like(two[rank]["transports"][spec, variant], transport_oracle())


DESCRIPTIONS = {"auto": "shared_memory", "torch": "torch (gloo)", "p2p": "p2p (auto)"}


@pytest.mark.parametrize("spec", NAMED)
def test_the_transport_named_carries_every_sum(two, spec):
    """The torch.distributed calls of a synchronised step: "torch", one all_reduce a sum; "p2p", point-to-point
    messages only; "auto" (shared memory: every rank is on this host) none, where its ranks meet by polling
    (x86)."""
    for rank in range(2):
        for variant in TRANSPORT_VARIANTS:
            result = two[rank]["transports"][spec, variant]
            assert result["transport"] == DESCRIPTIONS[spec], variant
            calls = result["torch_calls"]
            if spec == "torch":
                assert calls == {"all_reduce": sums_per_step(variant)[1]}, variant
            elif spec == "p2p":
                assert calls and set(calls) <= set(POINT_TO_POINT), (variant, calls)
            elif transport.POLLS:
                assert calls == {}, (variant, calls)


@pytest.mark.parametrize("spec", ("torch", *COUNTED))
def test_the_sums_go_through_the_transport_given_one_per_bucket_none_inside_no_sync(two, spec):
    """Counted by the CountingTransport given; for "torch", as torch.distributed's all_reduce calls."""
    for rank in range(2):
        for variant in TRANSPORT_VARIANTS:
            during, total = sums_per_step(variant)
            assert two[rank]["transports"][spec, variant]["counts"] == [(0, during, total)] * TRANSPORT_STEPS, variant


def test_on_shared_memory_the_transport_owns_the_buffers_it_sums_and_elsewhere_none(two):
    """Zero copy: DDP's bucket flats and FlatDDP's flat buffers lie in the transport's shared memory (and
    DDP's param.grad are views of its buckets: ``test_grads_are_views_of_the_buckets_after_synchronisation``)."""
    for rank in range(2):
        runs = two[rank]["transports"]
        for variant in ("ours", "ours overlap", "ours flat"):
            for spec in ("auto", "counting threaded shared_memory"):
                assert runs[spec, variant]["owned"] and all(runs[spec, variant]["owned"]), (spec, variant)
            for spec in ("torch", "p2p"):
                assert runs[spec, variant]["owned"] and not any(runs[spec, variant]["owned"]), (spec, variant)


def test_an_inline_transport_sums_each_bucket_in_backward_an_asynchronous_one_has_launched_it(two):
    """Seen after the last gradient hook, before the end of backward waits. Shared memory and p2p run in the
    caller's thread by default: the hook that completes a bucket sums it, so by then every sum is done (and,
    since buckets go in index order, the launch order holds: ``test_buckets_are_launched_in_the_same_order_...``).
    torch's all_reduce and the threaded shared memory have launched every bucket by then, and may still be
    summing."""
    for rank in range(2):
        runs = two[rank]["transports"]
        for variant in ("ours", "ours overlap"):
            buckets = sums_per_step(variant)[1]
            for spec in ("auto", "p2p"):
                assert runs[spec, variant]["summed"] == [(True, True)] * buckets, (spec, variant)
            for spec in ("torch", "counting threaded shared_memory"):
                summed = runs[spec, variant]["summed"]
                assert len(summed) == buckets and all(launched for launched, _ in summed), (spec, variant)


def test_pytorch_ddp_summing_through_our_shared_memory_trains_like_one_process(two):
    """``make_ddp("pytorch", ..., transport="shared_memory")``: PyTorch's DDP with ``transport.ddp_comm_hook``.
    Its buckets are its own: the count is checked for its form (sums in backward, none in no_sync)."""
    for rank in range(2):
        runs = two[rank]["transports"]
        for spec in ("shared_memory", "counting shared_memory"):
            assert_trains_like(runs[spec, "pytorch"], transport_oracle())
        counts = runs["counting shared_memory", "pytorch"]["counts"]
        assert len(counts) == TRANSPORT_STEPS
        assert all(no_sync == 0 and 0 < during == total for no_sync, during, total in counts)


def test_ddp_built_while_dev_shm_is_full_warns_once_and_still_trains_like_one_process(two):
    """A shared-memory transport made while /dev/shm is full goes through torch's all_reduce; one made before,
    with room for its files but none for the buckets, stages them (plain tensors) through its arena, which
    still carries every sum. Group rank 0 warns, once."""
    buckets = len(BIG_LAYOUTS["4KiB"])
    for rank in range(2):
        for case in ("no room at all", "no room for buckets"):
            result = two[rank]["no room"][case]
            assert_trains_like(result, transport_oracle())
            assert result["owned"] == [False] * buckets, case
            shm_warnings = [w for w in result["warnings"] if "/dev/shm" in w]
            assert len(shm_warnings) == (1 if rank == 0 else 0), result["warnings"]
        full, staged = two[rank]["no room"]["no room at all"], two[rank]["no room"]["no room for buckets"]
        assert full["transport"] == "shared_memory (through torch: no room)"
        assert full["torch_calls"] == {"all_reduce": TRANSPORT_STEPS * buckets}
        assert staged["transport"] == "shared_memory"
        assert staged["torch_calls"] == {} or not transport.POLLS


# The names make_ddp took before the engine registry's vocabulary, and the DDP benchmark's old "pytorch-best".
@pytest.mark.parametrize("old", ["bucketed", "overlap", "flat", "naive", "pytorch-best"])
def test_an_unknown_ddp_variant_is_refused_listing_the_known_ones_before_anything_is_built(old):
    with pytest.raises(ValueError, match=f"unknown DDP variant '{old}': choose one of ours, ours overlap, "
                                         "ours flat, ours naive, pytorch"):
        make_ddp(old, nn.Linear(3, 2))  # no process group: nothing is built


@pytest.mark.parametrize("wrapper", ["DDP", "NaiveDDP"])
def test_ranks_choosing_different_transports_are_refused_on_every_rank_before_the_broadcast(two, wrapper):
    assert not torch.equal(build(big, 40)[0].weight, build(big, 41)[0].weight), "precondition: the weights differ"
    for rank in range(2):
        refusals = two[rank]["refusals"]
        message = refusals["different", wrapper]
        assert message.startswith(f"ValueError: {wrapper}: the ranks chose different transports"), message
        assert "rank 0: torch" in message and "rank 1: p2p" in message, message
        assert refusals["weights kept", wrapper] is True, "a refused wrapper broadcast rank 0's weights"


def test_an_unknown_transport_or_one_over_other_ranks_is_refused_on_every_rank(two, three):
    for rank in range(2):
        refusals = two[rank]["refusals"]
        assert refusals["unknown"].startswith("ValueError: DDP: unknown transport 'carrier pigeon' (on group rank 1)")
        assert refusals["pytorch"].startswith("ValueError: DistributedDataParallel: the ranks chose different "
                                              "transports (rank 0: torch, rank 1: shared_memory)"), refusals["pytorch"]
        # Each rank's transport over a group of its own: they differ in their ranks, which the message names.
        assert refusals["own group"].startswith("ValueError: DDP: the transport is over ranks [0] (on group rank 0), "
                                                "the engine's group over [0, 1]"), refusals["own group"]
    for rank in (1, 2):
        assert three[rank]["other group"].startswith(
            "ValueError: DDP: the transport is over ranks [0, 1, 2] (on group rank 0), the engine's group over [1, 2]"
        ), three[rank]["other group"]


# --------------------------------------------------------------------------- tests: unused parameters, errors


@pytest.mark.parametrize("cap", ["0", "1000MiB"])
@pytest.mark.parametrize("world", [2, 3])
def test_parameter_used_on_one_rank_is_averaged_everywhere_and_unused_one_keeps_none(two, three, world, cap):
    results = two if world == 2 else three
    expected = oracle_partial(world)
    assert expected["grads"]["never.weight"] is None and expected["grads"]["extra.weight"] is not None
    for rank in range(world):
        assert_trains_like(results[rank]["unused"][cap], expected)


def test_without_used_flags_buckets_hold_only_gradients_and_an_unused_parameter_gets_zeros(two):
    expected = oracle_partial(2)
    numel = sum(p.numel() for p in build(Partial, 0).parameters())
    for rank in range(2):
        result = two[rank]["unused_without_flags"]
        assert result["bucket_numel"] == [numel], "one bucket, no flag elements"
        grads = strip_module(result["grads"])
        for key, grad in strip_module(expected["grads"]).items():
            if grad is None:  # nobody used it: with no flags to tell, every rank averages zeros
                assert torch.equal(grads[key], torch.zeros_like(grads[key])), key
            else:
                torch.testing.assert_close(grads[key], grad, rtol=1e-9, atol=1e-12, msg=key)
        state, expected_state = strip_module(result["state"]), strip_module(expected["state"])
        for key, value in expected_state.items():  # momentum SGD without decay leaves a zero-gradient weight alone
            torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-12, msg=key)


def test_forward_no_sync_and_step_before_finish_raise_and_corrupt_nothing(two):
    """With finish_in_backward=False, buckets of a synchronised backward are in flight until the caller
    finishes: each misuse raises, naming the fix, and the step then completes with the single-process
    gradient (nothing was added into the buckets)."""
    expected = oracle("big", 1, world=2, steps=1)["grads"]
    for rank in range(2):
        result = two[rank]["misuse"]
        for what in ("forward", "no_sync", "step"):
            assert result[what] is not None, f"rank {rank}: {what} before finish_gradient_synchronization() must raise"
            assert "still being all-reduced" in result[what]
            assert "Call finish_gradient_synchronization()" in result[what]
        assert result["step_after_finish"] is None
        for key, grad in expected.items():
            torch.testing.assert_close(result["grads"][key], grad, rtol=1e-9, atol=1e-12, msg=key)


def test_second_backward_before_finish_and_double_backward_are_errors(two):
    for rank in range(2):
        result = two[rank]["misuse"]
        assert result["second"] is not None
        assert "second gradient before finish_gradient_synchronization()" in result["second"]
        assert result["double"] is not None and "create_graph=True" in result["double"]


def test_by_default_backward_ends_synchronised_so_the_next_forward_no_sync_and_step_go_through(two):
    """What used to raise (a forward, no_sync() or a guarded step right after a synchronised backward) is what
    PyTorch's DDP allows: the end of backward finished, with the single-process gradient, and a finish called
    afterwards sends nothing."""
    expected = oracle("big", 1, world=2, steps=1)["grads"]
    for rank in range(2):
        result = two[rank]["misuse"]["finished by backward"]
        assert (result["forward"], result["no_sync"], result["step"]) == (None, None, None)
        assert result["sums by finish"] == 0
        for key, grad in expected.items():
            torch.testing.assert_close(result["grads"][key], grad, rtol=1e-9, atol=1e-12, msg=key)


def test_two_synchronised_backward_passes_through_one_graph_add_their_averages_and_double_backward_is_refused(two):
    """retain_graph: each backward ends averaged, so the gradients are twice the single-process one, as one
    process accumulates them (PyTorch's DDP would reduce only the first after the forward)."""
    expected = oracle("big", 1, world=2, steps=1)["grads"]
    for rank in range(2):
        result = two[rank]["misuse"]["finished by backward"]
        for key, grad in expected.items():
            torch.testing.assert_close(result["twice"][key], 2 * grad, rtol=1e-9, atol=1e-12, msg=key)
        assert result["double"] is not None and "create_graph=True" in result["double"]


def test_no_sync_restores_synchronisation_when_its_body_raises(two):
    assert all(two[rank]["misuse"]["sync_restored"] is True for rank in range(2))


@pytest.mark.parametrize("case", list(MISMATCHES))
@pytest.mark.parametrize("wrapper", ["DDP", "NaiveDDP"])
def test_different_models_on_different_ranks_are_refused_on_every_rank_naming_the_first_difference(two, case, wrapper):
    _, _, on_rank0, on_rank1 = MISMATCHES[case]
    for rank in range(2):
        message = two[rank]["mismatch"][case, wrapper]
        assert message is not None, f"rank {rank}: {case} mismatch accepted"
        assert "the ranks wrap different models" in message
        assert f"{on_rank0}" in message and f"{on_rank1} on rank 1" in message


def test_negative_bucket_cap_and_unknown_variant_are_rejected():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(nn.Linear(1, 1), bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="unknown DDP variant 'fast'"):
        make_ddp("fast", nn.Linear(1, 1))


# --------------------------------------------------------------------------- tests: bucket layout


BIG_REVERSED = ["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]
BIG_LAYOUTS = {  # derived by hand from the byte sizes in big()'s docstring
    "0": [[name] for name in BIG_REVERSED],
    "1KiB": [["4.bias", "4.weight"], ["2.bias", "2.weight"], ["0.bias", "0.weight"]],
    "4KiB": [["4.bias", "4.weight", "2.bias", "2.weight"], ["0.bias", "0.weight"]],
    "1000MiB": [["4.bias", "4.weight", "2.bias", "2.weight"], ["0.bias", "0.weight"]],  # the tail: 2304 <= 22296 / 4
}


@pytest.mark.parametrize("cap", list(CAPS))
def test_bucket_layout_reverse_order_each_bucket_closed_once_it_reaches_the_cap(two, cap):
    layout = two[0]["layouts"]["big", cap]
    assert [names for names, _, _ in layout] == BIG_LAYOUTS[cap]
    for names, nbytes, _ in layout:
        size = dict((n, p.numel() * p.element_size()) for n, p in build(big, 0).named_parameters())
        assert sum(size[n] for n in names[:-1]) < CAPS[cap] * 2**20 or cap == "0", \
            "over the cap by its last parameter only"
    buckets = assign_buckets(list(build(big, 0).parameters()), int(CAPS[cap] * 2**20), int(LAST_BUCKET_CAP_MB * 2**20))
    assert buckets == [[BIG_REVERSED[::-1].index(n) for n in names] for names in BIG_LAYOUTS[cap]]


def test_the_first_layers_up_to_the_last_bucket_cap_get_the_last_bucket_of_their_own():
    """big()'s first layer holds 1920 + 384 bytes of gradients (its docstring): a last-bucket cap of that
    size or more takes both, one byte less only the weight (the first registered); 0 turns it off. It
    never takes more than a quarter of the model's bytes (TAIL_SHARE): a model whose first layer is most of
    it (an embedding) keeps one bucket."""
    params = list(build(big, 0).parameters())
    index = {n: BIG_REVERSED[::-1].index(n) for n in BIG_REVERSED}
    layout = lambda cap, last: [[BIG_REVERSED[::-1][i] for i in b] for b in assign_buckets(params, cap, last)]
    whole = 1000 * 2**20
    assert layout(whole, 2304) == [["4.bias", "4.weight", "2.bias", "2.weight"], ["0.bias", "0.weight"]]
    assert layout(whole, 2303) == [["4.bias", "4.weight", "2.bias", "2.weight", "0.bias"], ["0.weight"]]
    assert layout(whole, 0) == [BIG_REVERSED]
    assert layout(whole, whole) == layout(whole, 2304), "a quarter of 22296 bytes: still just the first layer"
    embedding_first = list(nn.Sequential(nn.Linear(100, 10), nn.Linear(10, 10)).parameters())  # 4000 of 4480 bytes
    assert TAIL_SHARE == 4 and assign_buckets(embedding_first, whole, 4000) == [[3, 2, 1, 0]]
    assert layout(0, 2304) == [[name] for name in BIG_REVERSED]  # one bucket per parameter, as without it
    assert sorted(i for b in assign_buckets(params, 4096, 2304) for i in b) == sorted(index.values())


def test_bucket_layout_skips_frozen_counts_tied_once_and_never_mixes_dtypes(two):
    layouts = two[0]["layouts"]
    assert [n for n, _, _ in layouts["frozen", "1000MiB"]] == [
        ["out.bias", "out.weight", "hidden.bias", "hidden.weight"]]
    assert [n for n, _, _ in layouts["tied", "0"]] == [["out.bias"], ["out.weight"], ["b.bias"], ["a.bias"],
                                                       ["a.weight"], ["inp.bias"], ["inp.weight"]]
    assert [(n, d) for n, _, d in layouts["mixed", "1000MiB"]] == [
        (["c.bias", "c.weight", "a.bias", "a.weight"], torch.float64), (["b.bias", "b.weight"], torch.float32)]
