"""Our engines drop into a loop written for PyTorch's: ``zero_grad``, forward, ``loss.backward()``, ``step``.

One spawned group of two gloo workers runs ``pytorch_loop`` (below, never edited per engine) with
PyTorch's engine and with ours swapped in, from rank-dependent initial weights, and compares what
they trained: ``DistributedDataParallel`` against our ``DDP`` (several bucket sizes), ``FlatDDP``
and ``NaiveDDP`` on three transports (shared memory inline, gloo, shared memory on a communication
thread: asynchronous, so the end of backward must wait), with and without ``no_sync``
accumulation, on a model whose parameters some rank or no rank uses; ZeRO stage 1 (our DDP and
``ShardedOptimizer``) against ``ZeroRedundancyOptimizer`` over PyTorch's DDP; ZeRO stage 2 against
PyTorch's DDP with the plain optimizer; our ``FSDP`` against ``fully_shard``. Models are float32
and the engines sum in different orders, so "the same model" means equal to float32 round-off
(a few ulp); a step on unsynchronised gradients, a lost micro-batch or a summed gradient is off
by orders of magnitude more.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from common import CountingTransport, run_workers
from dpkit.comm import transport
from dpkit.engines.ddp import make_ddp
from dpkit.engines.fsdp import FSDP
from dpkit.engines.zero import ShardedOptimizer

D_IN, HIDDEN, D_OUT, MICRO = 6, 16, 3, 4
STEPS = 3
ACCUMS = (1, 3)
KIB = 1 / 1024  # in MiB, the unit of bucket_cap_mb
# Our variants (make_ddp's names, bucket_cap_mb): 25 MiB (one bucket and a tail), 256 bytes (several).
OURS = (("ours", 25.0), ("ours", KIB / 4), ("ours overlap", 0.0), ("ours flat", 25.0), ("ours naive", 25.0))
TRANSPORTS = ("auto", "torch", "threaded")  # "threaded": SharedMemory(background=True)
RTOL, ATOL = 1e-5, 1e-6  # float32 round-off of a few steps, on values of order 1


class Net(nn.Module):
    """``extra`` is used on rank 1 only when ``partial``; ``never`` by no rank (its gradient stays None)."""

    def __init__(self, partial: bool):
        super().__init__()
        self.partial = partial
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                  nn.Linear(HIDDEN, D_OUT))
        if partial:
            self.extra = nn.Linear(D_IN, D_OUT)
            self.never = nn.Linear(D_IN, D_OUT)

    def forward(self, x, use_extra=False):
        y = self.body(x)
        return y + self.extra(x) if self.partial and use_extra else y


class Norm(nn.Module):
    """Linears (sharded by FSDP) around a LayerNorm (replicated)."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(D_IN, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        return self.down(torch.tanh(self.norm(self.up(x))))


def build(seed, cls=Net, **kwargs):
    torch.manual_seed(seed)
    return cls(**kwargs)


def batch(step, micro, rank):
    """This rank's shard of the global micro-batch (``MICRO`` samples per rank)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, D_IN, generator=g), torch.randn(MICRO, D_OUT, generator=g)


def pytorch_loop(model, optimizer, rank, accum, steps=STEPS, **forward_kwargs):
    """A training loop written for PyTorch's engines, the same for every engine compared here."""
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accum):
            x, y = batch(step, micro, rank)
            no_sync = getattr(model, "no_sync", None)  # fully_shard and a bare module have none
            with no_sync() if no_sync is not None and micro < accum - 1 else nullcontext():
                (F.mse_loss(model(x, **forward_kwargs), y) / accum).backward()
        optimizer.step()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def trained(model, module, optimizer, rank, accum, **forward_kwargs):
    pytorch_loop(model, optimizer, rank, accum, **forward_kwargs)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}}


def _ddp_cases(ctx):
    """PyTorch's DDP and each of ours, every transport, with and without accumulation."""
    out = {}
    threaded = transport.SharedMemory(background=True)
    try:
        for partial in (False, True):
            extra = {"use_extra": ctx.rank == 1} if partial else {}
            for accum in ACCUMS:
                net = build(ctx.rank, partial=partial)  # rank-dependent: each engine broadcasts rank 0's
                model = DistributedDataParallel(net, find_unused_parameters=partial)
                out["pytorch", partial, accum] = trained(model, net, sgd(model.parameters()), ctx.rank, accum, **extra)
                for variant, cap in OURS:
                    for name in TRANSPORTS:
                        net = build(ctx.rank, partial=partial)
                        model = make_ddp(variant, net, bucket_cap_mb=cap,
                                         transport=threaded if name == "threaded" else name)
                        out[variant, cap, name, partial, accum] = trained(model, net, sgd(model.parameters()), ctx.rank,
                                                                          accum, **extra)
    finally:
        threaded.close()
    return out


def _explicit_finish(ctx):
    """Sums made by backward, then by finish_gradient_synchronization() and sync-free calls after it, per variant."""
    out = {}
    for variant, cap in OURS:
        counter = CountingTransport("auto")
        model = make_ddp(variant, build(0, partial=False), bucket_cap_mb=cap, transport=counter)
        x, y = batch(0, 0, ctx.rank)
        F.mse_loss(model(x), y).backward()
        in_backward = counter.collectives
        model.finish_gradient_synchronization()
        model.finish_gradient_synchronization()
        out[variant, cap] = (in_backward, counter.collectives - in_backward)
    counter = CountingTransport("auto")
    model = FSDP(build(0, Norm), transport=counter)
    F.mse_loss(model(x), y).backward()
    in_backward, wait = counter.collectives, model.last_wait_s
    model.finish_gradient_synchronization()
    out["fsdp"] = (in_backward, counter.collectives - in_backward, model.last_wait_s == wait)
    out["reaches none"] = _backward_reaching_no_parameter(ctx)
    return out


def _backward_reaching_no_parameter(ctx):
    """Rank 1's backward reaches no parameter, so only rank 0's ends with a finish; rank 1 finishes by hand
    (a no-op on rank 0), which pairs with rank 0's end of backward: the gradients it returns, on each rank."""
    model = make_ddp("ours", build(0, partial=False))
    x, y = batch(0, 0, ctx.rank)
    loss = F.mse_loss(model(x), y)
    (loss if ctx.rank == 0 else torch.ones((), requires_grad=True)).backward()
    model.finish_gradient_synchronization()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()}


def _zero_cases(ctx):
    """Stage 1: our DDP and ShardedOptimizer against ZeroRedundancyOptimizer over PyTorch's DDP; stage 2 (a bare
    module, the same weights on every rank) against PyTorch's DDP with the plain AdamW."""
    out = {}
    for accum in ACCUMS:
        net = build(ctx.rank, partial=False)
        model = DistributedDataParallel(net)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        out["zero pytorch", accum] = trained(model, net, zero, ctx.rank, accum)
        net = build(ctx.rank, partial=False)
        model = make_ddp("ours", net)
        out["stage 1", accum] = trained(model, net, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01,
                                                                     weight_decay=0.1), ctx.rank, accum)
        net = build(0, partial=False)
        model = DistributedDataParallel(net)
        out["ddp adamw", accum] = trained(model, net, adamw(model.parameters()), ctx.rank, accum)
        net = build(0, partial=False)
        optimizer = ShardedOptimizer(net.parameters(), torch.optim.AdamW, stage=2, lr=0.01, weight_decay=0.1)
        out["stage 2", accum] = trained(net, net, optimizer, ctx.rank, accum)
    return out


def _fsdp_cases(ctx):
    """Our FSDP against fully_shard (each Linear, then the root: its LayerNorm), compared by full parameters."""
    out = {}
    for accum in ACCUMS:
        ours = FSDP(build(ctx.rank, Norm))
        pytorch_loop(ours, sgd(ours.parameters()), ctx.rank, accum)
        out["ours", accum] = ours.full_parameters()
        theirs = build(0, Norm)  # fully_shard does not broadcast: rank 0's weights on every rank
        for layer in (theirs.up, theirs.down):
            fully_shard(layer)
        fully_shard(theirs)
        pytorch_loop(theirs, sgd(theirs.parameters()), ctx.rank, accum)
        out["fully_shard", accum] = {n: p.full_tensor().detach().clone() for n, p in theirs.named_parameters()}
    return out


def _cases(ctx):
    return {"ddp": _ddp_cases(ctx), "finish": _explicit_finish(ctx), "zero": _zero_cases(ctx),
            "fsdp": _fsdp_cases(ctx)}


@pytest.fixture(scope="module")
def ranks():
    return run_workers(_cases, 2)


def assert_same(result, expected, what, zeros_for_none=False):
    """Same parameters and last gradients; ``zeros_for_none``: zeros where ``expected`` has no gradient
    (FlatDDP and NaiveDDP average zeros for a parameter no rank used, as documented)."""
    assert result["state"].keys() == expected["state"].keys(), what
    for key, value in expected["state"].items():
        torch.testing.assert_close(result["state"][key], value, rtol=RTOL, atol=ATOL, msg=f"{what}: {key}")
    for key, grad in expected["grads"].items():
        got = result["grads"][key]
        if grad is not None:
            torch.testing.assert_close(got, grad, rtol=RTOL, atol=ATOL, msg=f"{what}: grad {key}")
        elif zeros_for_none:
            assert got is not None and not got.any(), (what, key)
        else:
            assert got is None, (what, key)


def assert_moved(state, initial):
    assert any(not torch.allclose(state[k], v) for k, v in initial.items()), "training moved nothing"


@pytest.mark.parametrize("accum", ACCUMS)
@pytest.mark.parametrize("partial", [False, True], ids=["all used", "unused on a rank and on all"])
@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize("variant, cap", OURS)
def test_our_ddp_trains_what_pytorch_ddp_trains_in_the_same_loop(ranks, variant, cap, name, partial, accum):
    """Accumulation (accum 3) runs the first micro-batches inside no_sync; with ``partial``, a parameter used on
    rank 1 only gets the average, one no rank uses keeps no gradient (find_unused_parameters=True in both)."""
    for rank in range(2):
        runs = ranks[rank]["ddp"]
        reference = runs["pytorch", partial, accum]
        assert_same(runs[variant, cap, name, partial, accum], reference, (rank, variant, cap, name),
                    zeros_for_none=variant in ("ours flat", "ours naive"))
    assert_moved(ranks[0]["ddp"]["pytorch", partial, accum]["state"], build(0, partial=partial).state_dict())
    if partial:
        grads = ranks[0]["ddp"]["pytorch", partial, accum]["grads"]
        assert grads["never.weight"] is None and grads["extra.weight"] is not None


def test_finish_after_the_end_of_backward_sends_nothing(ranks):
    """Every variant's sums are made by the end of backward (DDP's one per bucket, FlatDDP's one, NaiveDDP's one
    per parameter); finish_gradient_synchronization() then, twice, sends nothing. FSDP's likewise, and it keeps
    the wait its end of backward measured (``last_wait_s``, read by the benchmarks)."""
    for rank in range(2):
        finish = ranks[rank]["finish"]
        for variant, cap in OURS:
            in_backward, after = finish[variant, cap]
            assert in_backward > 0 and after == 0, (variant, in_backward, after)
        assert finish["fsdp"][0] > 0 and finish["fsdp"][1:] == (0, True), finish["fsdp"]


def test_a_rank_whose_backward_reaches_no_parameter_finishes_by_hand_and_gets_the_average(ranks):
    """Rank 0's gradient averaged with rank 1's none: rank 0's local gradient halved (used-flags: rank 0 had
    one), the same on both ranks."""
    first, second = (ranks[rank]["finish"]["reaches none"] for rank in range(2))
    net = build(0, partial=False)
    x, y = batch(0, 0, 0)
    F.mse_loss(net(x), y).backward()
    for name, p in net.named_parameters():
        torch.testing.assert_close(first[name], p.grad / 2, rtol=RTOL, atol=ATOL, msg=name)
        torch.testing.assert_close(second[name], first[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("accum", ACCUMS)
def test_zero_stage_1_over_our_ddp_trains_what_zero_redundancy_optimizer_does(ranks, accum):
    for rank in range(2):
        assert_same(ranks[rank]["zero"]["stage 1", accum], ranks[rank]["zero"]["zero pytorch", accum], rank)
    assert_moved(ranks[0]["zero"]["zero pytorch", accum]["state"], build(0, partial=False).state_dict())


@pytest.mark.parametrize("accum", ACCUMS)
def test_zero_stage_2_trains_what_pytorch_ddp_with_the_plain_optimizer_does(ranks, accum):
    """No call beyond the loop: each backward's hooks reduce-scatter and its end waits (stage 2 has no .grad, so
    only the parameters are compared)."""
    for rank in range(2):
        got, expected = ranks[rank]["zero"]["stage 2", accum]["state"], ranks[rank]["zero"]["ddp adamw", accum]["state"]
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=f"{rank}: {key}")
    assert_moved(ranks[0]["zero"]["ddp adamw", accum]["state"], build(0, partial=False).state_dict())


@pytest.mark.parametrize("accum", ACCUMS)
def test_our_fsdp_trains_what_fully_shard_trains_in_the_same_loop(ranks, accum):
    for rank in range(2):
        ours, theirs = ranks[rank]["fsdp"]["ours", accum], ranks[rank]["fsdp"]["fully_shard", accum]
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            torch.testing.assert_close(ours[key], value, rtol=RTOL, atol=ATOL, msg=f"{rank}: {key}")
    assert_moved(ranks[0]["fsdp"]["fully_shard", accum], build(0, Norm).state_dict())
