"""fsdp.py: a fully sharded model trains like one process on the global batch.

Two spawned groups (2 and 3 workers, started together) run every case; the parent trains
the same model from the same initial weights on the whole global batch in one process
(the oracle) and compares the full parameters. The model mixes sharded layers (an
embedding, linears whose sizes leave padding at 2 and 3 ranks, a head tied to the
embedding) with replicated ones (a LayerNorm, a free parameter). In float32 the only
differences are summation orders (a mean of per-rank means against one mean), so the
tolerance is a few float32 ulp; a summed gradient, a wrong shard, a stale gather or a lost
tied gradient is off by orders of magnitude more. With ``compute_dtype`` the oracle is a
single process that runs the same layers on weights and inputs cast the same way.
Workers train with every warning turned into an error.

The same training runs on every transport ("auto": this host's shared memory; "torch"; "p2p";
shared memory on a communication thread, whose prefetches are really in flight while the
layers compute), each inside a ``CountingTransport`` that checks what FSDP sends through it.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common import CountingTransport, run_workers
from dpkit.bench.measure import saved_tensor_bytes
from dpkit.comm import transport
from dpkit.engines.fsdp import FSDP

VOCAB, DIM, HIDDEN, SEQ = 13, 8, 9, 5
MICRO = 4  # sequences per rank
STEPS = 3
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1))}
FLOAT32_CASES = [(opt, reshard) for opt in OPTIMIZERS for reshard in (True, False)]
# Each dtype once, each with one reshard mode (the float32 cases cover both modes).
LOW_CASES = [("float16", True), ("bfloat16", False)]
EPS32 = torch.finfo(torch.float32).eps
# "background": SharedMemory(group, background=True), whose collectives run beside the caller.
TRANSPORTS = ("auto", "torch", "p2p", "background")
TRANSPORT_CLASS = {"auto": "SharedMemory", "torch": "Torch", "p2p": "MessagePassing", "background": "SharedMemory"}
# (optimizer, compute dtype, reshard_after_forward) on each transport, all with TinyLM's tied weights: "auto"
# every case above; "background" (real asynchrony) float32 and each compute dtype in both reshard modes;
# "torch" and "p2p" float32 and a compute dtype each, their reshard modes swapped.
CASES = {"auto": [(opt, None, reshard) for opt, reshard in FLOAT32_CASES] + [("adamw", *case) for case in LOW_CASES],
         "torch": [("adamw", None, True), ("adamw", "bfloat16", False)],
         "p2p": [("adamw", None, False), ("adamw", "float16", True)],
         "background": [("adamw", None, True), ("adamw", None, False)] + [("adamw", *case) for case in LOW_CASES]}
# The calls of TinyLM's forward into a sharded module (head uses embed's unit: tied), and the units.
CALLS = ("embed", "up", "down", "head")
UNIT_OF_CALL = {"embed": "embed", "up": "up", "down": "down", "head": "embed"}
# The calls whose backward needs their weights: a linear saves its weight for its input's gradient;
# an embedding's backward needs only the indices.
SAVING_CALLS = ("up", "down", "head")
UNIT_NUMELS = {"embed": VOCAB * DIM, "up": DIM * HIDDEN + HIDDEN, "down": HIDDEN * DIM + DIM}


class TinyLM(nn.Module):
    """Sharded: ``embed`` (13 x 8), ``up`` (8 -> 9: 81 elements, padded at 2 ranks), ``down``,
    ``head`` (tied to ``embed``). Replicated: ``norm`` (LayerNorm) and ``scale``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, idx):
        h = self.norm(self.embed(idx))                           # (B, T, DIM)
        h = h + self.down(torch.tanh(self.up(h))) * self.scale   # (B, T, DIM)
        return self.head(h)                                      # (B, T, VOCAB)


def reference_forward(model: TinyLM, idx, dtype=None, cast_once=False):
    """TinyLM's forward written out, each sharded layer run in ``dtype`` (weights and inputs cast, output
    back to float32): what FSDP's compute_dtype promises. The tied weight is cast for each use (two
    gradients, each cast to float32), or with ``cast_once`` once for both (its uses' gradients add up in
    ``dtype``), as FSDP does with reshard_after_forward True and False."""
    def cast(t):
        return t if dtype is None else t.to(dtype)

    def back(t):
        return t.float()

    embed = cast(model.embed.weight)
    h = model.norm(back(F.embedding(idx, embed)))
    up = back(F.linear(cast(h), cast(model.up.weight), cast(model.up.bias)))
    down = back(F.linear(cast(torch.tanh(up)), cast(model.down.weight), cast(model.down.bias)))
    return back(F.linear(cast(h + down * model.scale), embed if cast_once else cast(model.head.weight)))


def tokens(step, world):
    """The global batch of one step: (world * MICRO, SEQ) token ids; rank r's are rows r*MICRO:(r+1)*MICRO."""
    return torch.randint(0, VOCAB, (world * MICRO, SEQ), generator=torch.Generator().manual_seed(step))


def loss_of(logits, idx):
    return F.cross_entropy(logits.flatten(0, 1), idx.flatten())


def build(seed):
    torch.manual_seed(seed)
    return TinyLM()


# --------------------------------------------------------------------------- the oracle (parent)


@functools.lru_cache(maxsize=None)
def oracle(world, optimizer, dtype=None, steps=STEPS, cast_once=False):
    """One process on the global batch. With ``dtype``, the layers FSDP shards run in ``dtype`` and each
    rank's share of the batch is a separate backward (so its gradient is rounded to ``dtype`` on its own,
    as on its rank), the float32 gradients added up and divided by ``world``: the same arithmetic as
    FSDP's, in one process."""
    model = build(0)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    for step in range(steps):
        idx = tokens(step, world)
        if dtype is None:
            loss_of(reference_forward(model, idx), idx).backward()
        else:
            for chunk in idx.split(MICRO):
                loss_of(reference_forward(model, chunk, dtype, cast_once), chunk).backward()
            for p in model.parameters():  # the mean over ranks, taken in float32 (in float16 it would underflow)
                p.grad /= world
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- the workers


class _Watched(transport.Work):
    """A reduce-scatter's handle that notes whether FSDP waited for it."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self) -> bool:
        self.waited = True
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Recording(CountingTransport):
    """A ``CountingTransport`` that also notes, per step (``end_step``), whether the gathered full tensors
    and the flat gradients lie in the inner transport's own buffers (zero copy), how many asynchronous
    calls were still in flight when they returned, how many reduce-scatters were left unwaited when a
    new one began, and, over shared memory, the arena's bytes in use at the calls and after the step."""

    def __init__(self, inner):
        super().__init__(inner)
        self.steps = []
        self.reset()

    def reset(self):
        super().reset()
        self.gathers_owned, self.reduced_owned, self.reductions = [], [], []
        self.in_flight = self.unwaited = 0
        self.peak = 0

    def _arena_in_use(self):
        arena = getattr(self.inner, "_arena", None)
        if arena is None:
            return None
        with arena.lock:  # a communication thread may give a block back meanwhile
            return arena.size - sum(length for _, length in arena.free)

    def _note(self, work):
        self.in_flight += work is not None and not work.is_completed()
        self.peak = max(self.peak, self._arena_in_use() or 0)
        return work

    def all_gather(self, output, input, *, async_op=False):
        self.gathers_owned.append(self.inner.owns(output))
        return self._note(super().all_gather(output, input, async_op=async_op))

    def reduce_scatter(self, output, input, op="sum", *, async_op=False):
        self.reduced_owned.append((input.numel(), self.inner.owns(input)))
        self.unwaited = max(self.unwaited, sum(not work.waited for work in self.reductions))
        work = self._note(super().reduce_scatter(output, input, op, async_op=async_op))
        if work is not None:
            work = _Watched(work)
            self.reductions.append(work)
        return work

    def end_step(self):
        arena = getattr(self.inner, "_arena", None)
        self.steps.append({"calls": dict(self.calls), "bytes": dict(self.bytes),
                           "gathers_owned": list(self.gathers_owned), "reduced_owned": list(self.reduced_owned),
                           "in_flight": self.in_flight, "unwaited": self.unwaited, "peak": self.peak,
                           "after": self._arena_in_use(), "free": None if arena is None else list(arena.free)})


def train(ctx, model, optimizer, steps=STEPS, seen=None, recording=None):
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    for step in range(steps):
        if recording is not None:
            recording.reset()
        idx = tokens(step, ctx.world_size)[ctx.rank * MICRO:(ctx.rank + 1) * MICRO]
        loss_of(model(idx), idx).backward()
        model.finish_gradient_synchronization()
        if seen is not None:
            seen.append({n: (p.grad.dtype, p.grad.shape == p.shape) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        if recording is not None:
            recording.end_step()
    return model.full_parameters()


def _training(ctx):
    """Every case of CASES, each FSDP given a ``Recording`` of its transport: ``out[name, *case]`` is the full
    parameters after training; what the recording saw and what the optimizer and ``up`` saw go beside them."""
    background = transport.SharedMemory(background=True)
    out = {}
    try:
        for name, cases in CASES.items():
            inner = background if name == "background" else transport.resolve(name)
            out[name, "class"] = type(inner).__name__
            for optimizer, dtype, reshard in cases:
                recording, seen, used = Recording(inner), [], []
                # Rank-dependent initial weights: FSDP must take rank 0's.
                model = FSDP(build(ctx.rank), compute_dtype=dtype and getattr(torch, dtype),
                             reshard_after_forward=reshard, transport=recording)
                # prepend: run before FSDP's own post-forward hook, which frees the weights and casts the output back
                model.module.up.register_forward_hook(
                    lambda m, i, o, used=used: used.append((m.weight.dtype, i[0].dtype, o.dtype)), prepend=True)
                key = (name, optimizer, dtype, reshard)
                out[key] = train(ctx, model, optimizer, seen=seen, recording=recording)
                out["steps", *key], out["grads", *key], out["used", *key] = recording.steps, seen, used[0]
                out["master", *key] = sorted({str(p.dtype) for p in model.parameters()})
    finally:
        background.close()
    return out


def _memory(ctx):
    """Which units are gathered while ``down`` runs, and after finish_gradient_synchronization."""
    out = {}
    for reshard in (True, False):
        model = FSDP(build(0), reshard_after_forward=reshard)
        gathered = []
        model.module.down.register_forward_hook(
            lambda m, i, o: gathered.append(sorted(u.name for u in model.units if u.full is not None)), prepend=True)
        idx = tokens(0, ctx.world_size)[:MICRO]
        loss_of(model(idx), idx).backward()
        model.finish_gradient_synchronization()
        out[reshard] = gathered[0], [u.name for u in model.units if u.full is not None]
        out["shard_numels", reshard] = [u.shard.numel() for u in model.units]
    # An enclosing saved-tensor hook (here a measurement) still sees every activation.
    plain, model = build(0), FSDP(build(0))
    out["default transport"] = type(model.transport).__name__
    out["saved", "plain"] = saved_tensor_bytes(lambda: plain(idx), exclude=list(plain.parameters()))
    out["saved", "fsdp"] = saved_tensor_bytes(lambda: model(idx), exclude=list(model.parameters()))
    out["freed"] = _freed_after_a_forward_without_backward(idx)
    return out


def _freed_after_a_forward_without_backward(idx):
    """For each reshard mode, whether a wrapper whose forward ran with gradients, its output dropped with no
    backward, is freed at once with its gathered tensors and transport: no reference cycle (one through
    autograd's graph is one Python's gc cannot even see)."""
    freed = {}
    for reshard in (True, False):
        model = FSDP(build(0), reshard_after_forward=reshard)
        model(idx)
        freed[reshard] = weakref.ref(model)
    del model
    return {reshard: ref() is None for reshard, ref in freed.items()}


def _state_dicts(ctx):
    """full_state_dict after training loads into a fresh FSDP of other weights, and into a plain TinyLM."""
    trained = FSDP(build(0))
    train(ctx, trained, "sgd", steps=1)
    state = trained.full_state_dict()
    fresh = FSDP(build(5))
    fresh.load_full_state_dict(state)
    plain = build(7)
    plain.load_state_dict(state)
    return {"keys": list(state), "plain_keys": list(build(0).state_dict()), "loaded": fresh.full_parameters(),
            "plain": {n: p.detach().clone() for n, p in plain.named_parameters()}, "saved": trained.full_parameters()}


def _no_shard_types(ctx):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FSDP(build(0), shard_types=(nn.Conv2d,))
    return {"warnings": [str(w.message) for w in caught], "units": len(model.units),
            "params": train(ctx, model, "sgd")}


def _errors(ctx):
    """Each bad input must raise on every rank (the worker returns the messages)."""
    def message(fn):
        try:
            fn()
        except (RuntimeError, TypeError, ValueError) as error:
            return str(error)
        return None

    out = {"no parameters": message(lambda: FSDP(nn.ReLU()))}

    def differing():
        model = build(0)
        if ctx.rank == ctx.world_size - 1:
            model.down = nn.Linear(HIDDEN, DIM, bias=False)  # one rank lacks down.bias
        FSDP(model)

    out["differing"] = message(differing)

    def devices():
        model = build(0)
        model.scale = nn.Parameter(torch.ones(DIM, device="meta"))
        FSDP(model)

    out["devices"] = message(devices)

    def no_grad_then_backward():
        model = FSDP(build(0))
        idx = tokens(0, ctx.world_size)[:MICRO]
        with torch.no_grad():
            loss = loss_of(model(idx), idx)
        backward = message(loss.backward)
        return backward, message(model.finish_gradient_synchronization)

    out["no_grad"] = no_grad_then_backward()
    out["compute_dtype"] = message(lambda: FSDP(build(0), compute_dtype=torch.int8))

    def transports_differ():
        model = build(ctx.rank)  # refused before rank 0's weights are broadcast: each keeps its own
        error = message(lambda: FSDP(model, transport="torch" if ctx.rank == 0 else "auto"))
        return error, torch.equal(model.up.weight, build(ctx.rank).up.weight)

    out["transports differ"] = transports_differ()
    out["unknown transport"] = message(lambda: FSDP(build(0), transport="carrier pigeon"))
    idx = tokens(0, ctx.world_size)[:MICRO]
    out["freed before backward"] = message(loss_of(FSDP(build(0), reshard_after_forward=False)(idx), idx).backward)
    return out


def _cases(ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning may be raised while training
        out = {"training": _training(ctx), "memory": _memory(ctx), "state": _state_dicts(ctx), "errors": _errors(ctx)}
    out["no_shard_types"] = _no_shard_types(ctx)
    return out


@pytest.fixture(scope="module")
def groups():
    """Both spawned groups at once: each worker spends seconds importing torch, so overlap them."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {world: pool.submit(run_workers, _cases, world) for world in (2, 3)}
        return {world: future.result() for world, future in futures.items()}


# --------------------------------------------------------------------------- the tests


def ulps(a, b):
    """Largest difference between two tensors in float32 ulps at the tensor's scale (its largest magnitude)."""
    return ((a - b).abs().max() / (b.abs().max() * EPS32)).item()


def assert_few_ulps(got, expected, limit=16):
    """At most ``limit`` ulps apart. Measured: float32 runs <= 2.1 ulps, the casting oracle <= 8.4 ulps
    (``pytest tests/test_fsdp.py`` with a print of ``worst``): AdamW divides by sqrt(v), which magnifies
    round-off in the gradients of elements whose gradient nearly cancels."""
    assert got.keys() == expected.keys()
    worst = max(ulps(got[n], expected[n]) for n in expected)
    assert worst <= limit, f"{worst:.1f} ulps apart"


def test_reference_forward_is_tinylm_forward():
    model, idx = build(0), tokens(0, 1)
    torch.testing.assert_close(reference_forward(model, idx), model(idx), rtol=0, atol=0)


def compute(dtype):
    return dtype and getattr(torch, dtype)


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("optimizer,reshard", FLOAT32_CASES)
def test_float32_trains_like_one_process_on_the_global_batch(groups, world, optimizer, reshard):
    expected = oracle(world, optimizer)
    for result in groups[world]:
        assert_few_ulps(result["training"]["auto", optimizer, None, reshard], expected)


@pytest.mark.parametrize("world", (2, 3))
def test_the_training_moves_parameters_far_beyond_the_tolerance(world):
    """So the ulp comparison above can fail: a step changes parameters by many thousand ulps."""
    start, end = {n: p.detach() for n, p in build(0).named_parameters()}, oracle(world, "sgd")
    assert max(ulps(start[n], end[n]) for n in end) > 1e4


@pytest.mark.parametrize("world", (2, 3))
def test_every_rank_holds_the_same_full_parameters(groups, world):
    first = groups[world][0]["training"]
    for result in groups[world][1:]:
        for name, cases in CASES.items():
            for case in cases:
                for param, value in first[name, *case].items():
                    torch.testing.assert_close(result["training"][name, *case][param], value, rtol=0, atol=0)


@pytest.mark.parametrize("world", (2, 3))
def test_optimizer_sees_float32_gradients_of_its_own_shapes(groups, world):
    for result in groups[world]:
        for name, cases in CASES.items():
            for case in cases:
                for step in result["training"]["grads", name, *case]:
                    assert step and all(dtype == torch.float32 and same for dtype, same in step.values()), step


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("dtype,reshard", LOW_CASES)
def test_low_precision_compute_matches_one_process_that_casts_the_same_way(groups, world, dtype, reshard):
    """A few float32 ulps from the casting oracle, and far from float32 training (which a run that ignored
    compute_dtype would match instead)."""
    cast, exact = oracle(world, "adamw", compute(dtype), cast_once=not reshard), oracle(world, "adamw")
    assert max(ulps(cast[n], exact[n]) for n in cast) > 1000
    for result in groups[world]:
        assert_few_ulps(result["training"]["auto", "adamw", dtype, reshard], cast)
        assert result["training"]["used", "auto", "adamw", dtype, reshard] == (compute(dtype),) * 3
        assert result["training"]["master", "auto", "adamw", dtype, reshard] == ["torch.float32"]


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_trains_like_one_process_on_every_transport(groups, world, name):
    """Float32 and compute dtypes, both reshard modes, the tied weights: on each transport as with one process
    (with "background", the prefetched gathers and the reduce-scatters run while the layers compute)."""
    for result in groups[world]:
        training = result["training"]
        assert training[name, "class"] == TRANSPORT_CLASS[name]
        for optimizer, dtype, reshard in CASES[name]:
            expected = oracle(world, optimizer, compute(dtype), cast_once=dtype is not None and not reshard)
            assert_few_ulps(training[name, optimizer, dtype, reshard], expected)
            assert training["used", name, optimizer, dtype, reshard] == (compute(dtype) or torch.float32,) * 3


@pytest.mark.parametrize("world", (2, 3))
def test_the_default_transport_is_this_hosts_shared_memory(groups, world):
    for result in groups[world]:
        assert result["memory"]["default transport"] == "SharedMemory"


def expected_traffic(world, dtype, reshard):
    """What one step sends through the transport, from TinyLM's structure: (calls, bytes) of all_gather and
    reduce_scatter. Each unit is padded to a multiple of the world size.

    reshard_after_forward=True: forward gathers once per call into a sharded module (CALLS: four, head
    gathering the tied embedding again), backward once per call whose backward needs its weights
    (SAVING_CALLS: three; not the embedding); one reduce-scatter per gather of the forward (the tied
    embedding's two uses each reduce their own gradient). False: each unit gathered once, in forward, and
    reduced once. Gathers move ``compute_dtype`` elements, reduce-scatters float32 (the master dtype)."""
    padded = {unit: math.ceil(n / world) * world for unit, n in UNIT_NUMELS.items()}
    if reshard:
        gathered = [UNIT_OF_CALL[c] for c in CALLS + SAVING_CALLS]
        reduced = [UNIT_OF_CALL[c] for c in CALLS]
    else:
        gathered = reduced = list(padded)
    size = (compute(dtype) or torch.float32).itemsize
    return ({"all_gather": len(gathered), "reduce_scatter": len(reduced)},
            {"all_gather": size * sum(padded[u] for u in gathered),
             "reduce_scatter": 4 * sum(padded[u] for u in reduced)})


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_gathers_and_reduce_scatters_go_through_the_given_transport(groups, world, name):
    """Every step sends exactly what the model implies (``expected_traffic``), through the transport it was
    given; the replicated parameters' all-reduce goes through it too (FSDP's internal DDP)."""
    for result in groups[world]:
        for case in CASES[name]:
            calls, nbytes = expected_traffic(world, *case[1:])
            steps = result["training"]["steps", name, *case]
            assert len(steps) == STEPS
            for step in steps:
                assert {k: step["calls"].get(k) for k in calls} == calls, (case, step["calls"])
                assert {k: step["bytes"].get(k) for k in nbytes} == nbytes, (case, step["bytes"])
                assert step["calls"].get("all_reduce", 0) >= 1


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("name", TRANSPORTS)
def test_at_most_one_reduce_scatter_is_in_flight(groups, world, name):
    """A reduce-scatter is waited for before the next one starts, so its flat gradient (full-size) is gone
    before the next is made: one at a time, not one per unit until the end of backward."""
    for result in groups[world]:
        for case in CASES[name]:
            for step in result["training"]["steps", name, *case]:
                assert step["unwaited"] == 0, case


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("name", ("auto", "background"))
def test_shared_memory_gathers_in_place_and_gives_the_arena_back_every_step(groups, world, name):
    """On shared memory every gathered full tensor lies in the transport's arena (the peers read it there,
    zero copy), and so does every flat gradient the transport allocated (all but a float32 embedding
    gradient that fills its unit, reduced as autograd made it). The arena holds more during a step than
    after it, and every step ends with the same free list: what a step took it gave back."""
    embed = math.ceil(UNIT_NUMELS["embed"] / world) * world
    for result in groups[world]:
        for case in CASES[name]:
            steps = result["training"]["steps", name, *case]
            as_made = case[1] is None and embed == UNIT_NUMELS["embed"]
            for step in steps:
                assert step["gathers_owned"] and all(step["gathers_owned"]), case
                assert all(owned for numel, owned in step["reduced_owned"] if not (as_made and numel == embed)), case
                assert step["peak"] > step["after"], (case, step["peak"], step["after"])
            assert all(step["free"] == steps[0]["free"] for step in steps), case


@pytest.mark.parametrize("world", (2, 3))
def test_background_transport_really_overlaps_and_inline_does_not(groups, world):
    """With ``background=True`` asynchronous calls return while the collective is still running (the
    training above stayed exact with them in flight); the default shared memory finishes each at its call."""
    for result in groups[world]:
        for name, in_flight in (("background", True), ("auto", False)):
            for case in CASES[name]:
                count = sum(step["in_flight"] for step in result["training"]["steps", name, *case])
                assert (count > 0) == in_flight, (name, case, count)


@pytest.mark.parametrize("world", (2, 3))
def test_shards_are_one_nth_padded_and_freed_after_forward_unless_kept(groups, world):
    memory = groups[world][0]["memory"]
    # embed 13*8 = 104; up 8*9 + 9 = 81; down 9*8 + 8 = 80 elements, each split evenly with padding.
    assert memory["shard_numels", True] == [math.ceil(n / world) for n in (104, 81, 80)]
    during, after = memory[True]
    assert during == ["down"], "reshard_after_forward: only the running layer is gathered (embed and up freed)"
    during, after = memory[False]
    assert during == ["down", "embed", "up"], "reshard_after_forward=False keeps earlier layers until backward"
    assert after == [] and memory[True][1] == [], "nothing stays gathered after the step"
    assert memory["saved", "fsdp"] == memory["saved", "plain"] > 0, "activations seen through FSDP's own hooks"
    assert memory["freed"] == {True: True, False: True}, "a forward without backward kept the wrapper alive"


@pytest.mark.parametrize("world", (2, 3))
def test_full_state_dict_has_the_plain_keys_and_round_trips(groups, world):
    for result in groups[world]:
        state = result["state"]
        assert state["keys"] == state["plain_keys"]  # head.weight (tied) included, like the plain module
        for name, value in state["saved"].items():
            torch.testing.assert_close(state["loaded"][name], value, rtol=0, atol=0)
            torch.testing.assert_close(state["plain"][name], value, rtol=0, atol=0)


@pytest.mark.parametrize("world", (2, 3))
def test_shard_types_matching_nothing_is_data_parallel_and_says_so_once(groups, world):
    expected = oracle(world, "sgd")
    for rank, result in enumerate(groups[world]):
        case = result["no_shard_types"]
        assert case["units"] == 0
        assert len(case["warnings"]) == (1 if rank == 0 else 0)
        if rank == 0:
            assert "nothing is sharded" in case["warnings"][0]
        assert_few_ulps(case["params"], expected)


@pytest.mark.parametrize("world", (2, 3))
def test_bad_input_raises_a_clear_error_on_every_rank(groups, world):
    for rank, result in enumerate(groups[world]):
        errors = result["errors"]
        assert "has no parameters" in errors["no parameters"]
        assert "FSDP: the ranks wrap different models" in errors["differing"] and "down.bias" in errors["differing"]
        assert "different devices" in errors["devices"]
        backward, finish = errors["no_grad"]
        assert "does not require grad" in backward
        assert "torch.no_grad()" in finish
        assert "compute_dtype" in errors["compute_dtype"]
        error, own_weights = errors["transports differ"]
        assert "FSDP: the ranks chose different transports" in error and own_weights
        assert "unknown transport 'carrier pigeon'" in errors["unknown transport"]
        assert "the wrapper was freed before backward" in errors["freed before backward"]
