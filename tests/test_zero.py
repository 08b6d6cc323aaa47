"""zero.ShardedOptimizer against the unsharded optimizer, bit for bit, on every transport.

ONE spawned group of 3 workers (spawning costs seconds of importing torch per process): the
whole world runs every case with 3 ranks, then ranks 1 and 2 run them again as a 2-rank
subgroup while rank 0 runs them alone (a 1-rank subgroup). Gradients are a fixed function of
the step and the parameter's name, the same on every rank (what data-parallel averaging hands
the optimizer), so the oracle is the plain optimizer run in the parent on the same model for
the same steps. The bucketed grid runs every optimizer, partition and overlap on each transport
(split between the world sizes, see ``grid_cases``): "auto" (shared memory), "torch", "p2p",
and shared memory on a communication thread, whose all-gathers really run beside the caller.

Stage 2 (``stage=2``: the optimizer reduce-scatters the gradients during backward) cannot take
gradients set by hand: each rank runs a backward whose gradients are exact multiples of a power of
two that differ per rank, so the average is the same bits in any order of summation, and the oracle
is the plain optimizer stepped on that average (see ``stage2_gradient``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import time
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from common import CollectiveCounter, CountingTransport, assert_refused, refused, run_workers
from dpkit.comm import transport
from dpkit.engines import zero

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
STEPS = 4  # the late param group joins after step LATE
LATE = 2
GRID_STEPS = LATE + 1  # the bucketed grid's steps: before and after the late group joins
LAYERS = ("embed", "hidden", "out", "frozen")
GROUPS = ((3, None), (2, [1, 2]), (1, [0]))  # (world size, members of the subgroup or None for the world)
# "background": SharedMemory(group, background=True), whose all-gathers really run beside the caller.
TRANSPORTS = ("auto", "torch", "p2p", "background")
KIND_CLASS = {"auto": "SharedMemory", "torch": "Torch", "p2p": "MessagePassing", "background": "SharedMemory"}
SLOW_S = 0.1  # when the all-gathers of the Slow transport arrive, after their call


def grid_cases(n: int) -> list[tuple[str, str, str, bool]]:
    """(transport, optimizer, partition, overlap) of the bucketed grid at world size n: every transport,
    partition and overlap, with AdamW in the whole world of 3 ranks and alone, SGD and Adam in the 2-rank
    subgroup (which runs beside the lone rank): each combination once among the groups that share, so the
    spawned group's time stays what it was."""
    names = ["sgd", "adam"] if n == 2 else ["adamw"]
    return [(kind, name, partition, overlap) for kind in TRANSPORTS for name in names
            for partition in zero.PARTITIONS for overlap in (False, True)]


def grid_params(*fields: str, overlap: bool | None = None) -> list[tuple]:
    """("n", then ``fields`` of grid_cases) for pytest's parametrize: the combinations the grid ran."""
    index = {"kind": 0, "name": 1, "partition": 2, "overlap": 3}
    return sorted({(n, *(case[index[f]] for f in fields)) for n in (1, 2, 3) for case in grid_cases(n)
                   if overlap in (None, case[3])})


class Toy(nn.Module):
    """Uneven tensor sizes (so the partition is uneven), a tied weight, a frozen layer, a parameter
    that never gets a gradient, a float64 parameter, and one added to the optimizer later."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 7)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight  # tied: one parameter
        self.frozen = nn.Linear(7, 6).requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(5))
        self.scale = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.late = nn.Parameter(torch.randn(4, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B,) token ids -> (B, 11) logits
        return self.out(self.frozen(self.hidden(self.embed(tokens))))


def make_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def param_groups(model: Toy) -> list[dict]:
    """Two groups with their own options; ``late`` is left out (added with add_param_group)."""
    return [{"params": [model.embed.weight, model.hidden.weight], "lr": 0.05},
            {"params": [model.hidden.bias, model.frozen.weight, model.frozen.bias, model.unused, model.scale],
             "weight_decay": 0.0}]


def set_gradients(model: Toy, step: int) -> None:
    for index, (name, p) in enumerate(model.named_parameters()):
        if p.requires_grad and name != "unused":
            generator = torch.Generator().manual_seed(1000 * step + index)
            p.grad = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)


def train(model: Toy, optimizer, first: int, last: int) -> None:
    """Steps ``first`` to ``last - 1``: zero_grad (both ways), gradients, step; the late group joins after LATE."""
    for step in range(first, last):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        set_gradients(model, step)
        optimizer.step()
        if step + 1 == LATE:
            optimizer.add_param_group({"params": [model.late], "lr": 0.02})


def checkpoint(state) -> dict:
    """Through torch.save / torch.load, as a file would take it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def state_of(model: Toy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --------------------------------------------------------------------------- workers


def _sharded(model: Toy, name: str, group, partition: str, transport="auto") -> zero.ShardedOptimizer:
    cls, options = OPTIMIZERS[name]
    return zero.ShardedOptimizer(param_groups(model), cls, process_group=group, partition=partition,
                                 transport=transport, **options)


def _case(name: str, partition: str, group, transport="auto") -> dict:
    """STEPS steps; a consolidated checkpoint and a resume from it; a resume from the plain optimizer's checkpoint."""
    model = make_model()
    optimizer = _sharded(model, name, group, partition, transport)
    with CollectiveCounter() as counter:
        train(model, optimizer, 0, STEPS)
    local_state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    owned = sum(piece.end - piece.start for piece in optimizer.pieces if piece.owner == optimizer.rank)
    saved = checkpoint(optimizer.state_dict())
    params_at_checkpoint = checkpoint(model.state_dict())

    resumed = make_model()
    resumed.load_state_dict(params_at_checkpoint)
    resumed_optimizer = _sharded(resumed, name, group, partition, transport)
    resumed_optimizer.add_param_group({"params": [resumed.late], "lr": 0.02})
    resumed_optimizer.load_state_dict(checkpoint(saved))  # a copy: loaded state is trained on in place
    train(resumed, resumed_optimizer, STEPS, STEPS + 2)

    # The plain optimizer's checkpoint, loaded into a sharded one.
    plain_model = make_model()
    cls, options = OPTIMIZERS[name]
    plain = cls(param_groups(plain_model), **options)
    train(plain_model, plain, 0, STEPS)
    from_plain = make_model()
    from_plain.load_state_dict(plain_model.state_dict())
    from_plain_optimizer = _sharded(from_plain, name, group, partition, transport)
    from_plain_optimizer.add_param_group({"params": [from_plain.late], "lr": 0.02})
    from_plain_optimizer.load_state_dict(checkpoint(plain.state_dict()))
    train(from_plain, from_plain_optimizer, STEPS, STEPS + 2)
    return {"params": state_of(model), "state_dict": saved, "resumed": state_of(resumed),
            "from_plain": state_of(from_plain), "local_state_elements": local_state, "owned_elements": owned,
            "calls": dict(counter.calls), "collectives": counter.collectives,
            "transport": type(optimizer.transport).__name__}


def _apart(group) -> dict:
    """AdamW as if the ranks were on different hosts: the updates travel by our ring all-gather ("p2p")."""
    return _case("adamw", "flat", group, transport="p2p")


def _transports(group) -> dict[str, transport.Transport]:
    """The transports of the bucketed grid, made once per group (a shared-memory one maps files: a collective)."""
    return {"auto": transport.resolve("auto", group), "torch": transport.resolve("torch", group),
            "p2p": transport.resolve("p2p", group), "background": transport.SharedMemory(group, background=True)}


class _Logged(transport.Work):
    """``work``, calling ``done()`` once waited for."""

    def __init__(self, work: transport.Work, done: Callable[[], None]):
        self.work, self.done = work, done

    def wait(self) -> bool:
        self.work.wait()
        self.done()
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Recording(CountingTransport):
    """Counts, and logs ("launch" | "wait", output buffer's address) as each all-gather starts and is waited for."""

    def __init__(self, inner: transport.Transport):
        super().__init__(inner)
        self.events: list[tuple[str, int]] = []

    def all_gather(self, output, input, *, async_op=False):
        self.events.append(("launch", output.data_ptr()))
        work = super().all_gather(output, input, async_op=async_op)
        if not async_op:
            self.events.append(("wait", output.data_ptr()))
            return work
        return _Logged(work, lambda: self.events.append(("wait", output.data_ptr())))


def _bucketed_case(name: str, partition: str, overlap: bool, group, inner: transport.Transport) -> dict:
    """GRID_STEPS steps through ``inner`` (counted), in the default buckets: one per param group and dtype (the
    first group's; the second's float32 and its float64 parameters; the late group's), each cut among the
    ranks. Per step: the parameters read right after step() (without overlap), what each layer saw when its
    forward ran (with overlap: the forward after the step waits per layer; none after the first step, so the
    second step() must wait for the first's all-gathers itself), the all-gathers made and the buckets. Then
    the parameters read through ``model.state_dict()``, where each bucket's buffer lies, and what close()
    leaves behind."""
    model = make_model()
    cls, options = OPTIMIZERS[name]
    counting = Recording(inner)
    optimizer = zero.ShardedOptimizer(param_groups(model), cls, process_group=group, partition=partition,
                                      transport=counting, **options)
    seen: list[dict] = []
    in_flight_at_embed = []  # buckets still in flight when the first layer had what it needs
    if overlap:
        optimizer.overlap_with_forward(model)
        for layer in LAYERS:  # registered after the optimizer's hooks: they run after its wait
            getattr(model, layer).register_forward_pre_hook(
                lambda m, args, layer=layer: seen[-1].update({f"{layer}.{n}": p.detach().clone()
                                                              for n, p in m.named_parameters(recurse=False)}))
        model.embed.register_forward_pre_hook(
            lambda *_: in_flight_at_embed.append(sum(b.work is not None for b in optimizer.buckets)))
    after_step, in_flight, gathers, gathered_bytes, buckets = [], 0, [], [], []
    for step in range(GRID_STEPS):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        set_gradients(model, step)
        counting.reset()
        optimizer.step()
        in_flight += sum(bucket.work is not None for bucket in optimizer.buckets)
        gathers.append(dict(counting.calls))
        gathered_bytes.append(counting.bytes["all_gather"])
        buckets.append(len(optimizer.buckets))
        if not overlap:
            after_step.append(state_of(model))
        else:  # no forward after step 0: step 1 must wait for step 0's all-gathers itself
            seen.append({})
            with torch.no_grad():
                if step == 1:  # layer by layer, as the root's forward calls them, without the root's own wait
                    model.out(model.frozen(model.hidden(model.embed(torch.arange(5)))))  # (the root holds
                elif step > 1:  # parameters of the later buckets: its pre-hook waits for all of them)
                    model(torch.arange(5))
        if step + 1 == LATE:
            optimizer.add_param_group({"params": [model.late], "lr": 0.02})
    final = {name: t.clone() for name, t in model.state_dict().items()}
    share_s = optimizer.last_share_s
    buffers = [(bucket.buffer is not None, bucket.buffer is not None and optimizer.transport.owns(bucket.buffer))
               for bucket in optimizer.buckets]  # (allocated, by the transport in its shared memory)
    optimizer.close()
    return {"after_step": after_step, "seen": seen, "final": final, "buckets": buckets, "share_s": share_s,
            "in_flight": in_flight, "gathers": gathers, "gathered_bytes": gathered_bytes, "buffers": buffers,
            "events": counting.events, "in_flight_at_embed": in_flight_at_embed,
            "in_flight_after_close": sum(bucket.work is not None for bucket in optimizer.buckets),
            "hooks_left": sum(
                len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_pre_hooks)
                + len(m._load_state_dict_pre_hooks) for m in model.modules()) - (len(LAYERS) + 1 if overlap else 0)}


def _bucketed_grid(group, made: dict[str, transport.Transport]) -> dict:
    """Every optimizer, partition and overlap on every transport; whether shared memory ever staged a copy."""
    out = {(kind, name, partition, overlap): _bucketed_case(name, partition, overlap, group, made[kind])
           for kind, name, partition, overlap in grid_cases(dist.get_world_size(group))}
    kinds = {kind: type(t).__name__ for kind, t in made.items()}
    staged = {kind: getattr(t, "_staging", None) is not None for kind, t in made.items()}
    made["background"].close()
    return {"cases": out, "kinds": kinds, "staged": staged}


def lone_bucket_params(model: Toy) -> list[nn.Parameter]:
    """One param group of one dtype, well under the default bucket cap: a single bucket."""
    return [p for p in model.parameters() if p.dtype == torch.float32]


def _lone_bucket_case(group) -> dict:
    """AdamW over one bucket with overlap_with_forward, on the default (inline) transport: step() shares it."""
    model = make_model()
    optimizer = zero.ShardedOptimizer(lone_bucket_params(model), torch.optim.AdamW, process_group=group, lr=0.01)
    optimizer.overlap_with_forward(model)
    in_flight = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        set_gradients(model, step)
        optimizer.step()
        in_flight += sum(bucket.work is not None for bucket in optimizer.buckets)
    buckets, share_s = len(optimizer.buckets), optimizer.last_share_s
    optimizer.close()
    return {"params": state_of(model), "buckets": buckets, "in_flight": in_flight, "share_s": share_s}


class _Arrives(transport.Work):
    """Done at time ``at`` (``time.perf_counter``); ``wait()`` sleeps until then, adding the time to ``waited[0]``."""

    def __init__(self, at: float, waited: list[float]):
        self.at, self.waited = at, waited

    def wait(self) -> bool:
        start = time.perf_counter()
        if start < self.at:
            time.sleep(self.at - start)
            self.waited[0] += time.perf_counter() - start
        return True

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.at


class Slow(transport.Transport):
    """A stand-in for timing ``last_share_s``: every all-gather moves nothing and takes SLOW_S, in the call
    (``inline``) or arriving SLOW_S after it (asynchronous). The parameters it leaves are stale: not compared."""

    name = "late"

    def __init__(self, group, inline: bool):
        super().__init__(group)
        self.inline, self.waited = inline, [0.0]  # seconds the callers spent in wait()

    def all_gather(self, output, input, *, async_op=False):
        if self.inline:
            time.sleep(SLOW_S)
            return transport.Work() if async_op else None
        work = _Arrives(time.perf_counter() + SLOW_S, self.waited)
        if async_op:
            return work
        work.wait()
        return None


def _share_time(group) -> dict:
    """``last_share_s`` with overlap_with_forward, on one bucket: an inline all-gather, all of it inside step();
    an asynchronous one that the next forward waits for at once, then one it reaches after 1.5 SLOW_S of
    other work (standing for computation the all-gather overlaps)."""
    model = make_model()
    inline = zero.ShardedOptimizer(lone_bucket_params(model), torch.optim.SGD, group, lr=0.1,
                                   transport=Slow(group, inline=True))
    inline.overlap_with_forward(model)
    set_gradients(model, 0)
    inline.step()
    out = {"inline in flight": sum(b.work is not None for b in inline.buckets), "inline": inline.last_share_s}
    inline.close()

    slow = Slow(group, inline=False)
    later = zero.ShardedOptimizer(lone_bucket_params(model), torch.optim.SGD, group, lr=0.1, transport=slow)
    later.overlap_with_forward(model)
    for case, busy_s in (("waited at once", 0.0), ("overlapped", 1.5 * SLOW_S)):
        set_gradients(model, 1)
        later.step()
        out[f"{case} in flight"] = sum(b.work is not None for b in later.buckets)
        time.sleep(busy_s)
        slow.waited[0] = 0.0
        with torch.no_grad():
            model(torch.arange(5))
        out[case], out[f"{case} wait"] = later.last_share_s, slow.waited[0]
    later.close()
    return out


def _bad_inputs(group) -> dict:
    model = make_model()
    w, b = model.hidden.weight, model.hidden.bias
    elsewhere = nn.Parameter(torch.empty(3, device="meta"))
    optimizer = zero.ShardedOptimizer([w], torch.optim.SGD, process_group=group, lr=0.1)
    return {
        "no parameters": refused(lambda: zero.ShardedOptimizer([], torch.optim.SGD, process_group=group, lr=0.1)),
        "empty groups": refused(lambda: zero.ShardedOptimizer([{"params": []}], torch.optim.SGD, process_group=group)),
        "not a class": refused(lambda: zero.ShardedOptimizer([w], torch.optim.SGD([b], lr=0.1), process_group=group)),
        "not an optimizer": refused(lambda: zero.ShardedOptimizer([w], nn.Linear, process_group=group)),
        "twice in a group": refused(lambda: zero.ShardedOptimizer([w, b, w], torch.optim.SGD,
                                                                  process_group=group, lr=1)),
        "twice across groups": refused(lambda: zero.ShardedOptimizer([{"params": [w]}, {"params": [b, w]}],
                                                                      torch.optim.SGD, process_group=group, lr=1)),
        "twice when added": refused(lambda: optimizer.add_param_group({"params": [w]})),
        "partition": refused(lambda: zero.ShardedOptimizer([w], torch.optim.SGD, group, partition="rows", lr=1)),
        "not contiguous": refused(lambda: zero.ShardedOptimizer([nn.Parameter(torch.ones(4, 3).t())], torch.optim.SGD,
                                                                 process_group=group, lr=1)),
        "devices": refused(lambda: zero.ShardedOptimizer([w, elsewhere], torch.optim.SGD, process_group=group, lr=1)),
        "bucket cap": refused(lambda: zero.ShardedOptimizer([w], torch.optim.SGD, group, bucket_cap_mb=-1, lr=1)),
    }


def _transport_refusals(group) -> dict:
    """Transports the ranks disagree on (group rank 0 against the others), and an unknown name: every rank
    raises at construction (after one exchange of the choices, which is how every rank learns of them)."""
    w = make_model().hidden.weight
    first = dist.get_rank(group) == 0
    torch_transport = transport.resolve("torch", group)
    choices = {"unknown": "pigeon"}
    if dist.get_world_size(group) > 1:
        choices.update({"different names": "torch" if first else "p2p",
                        "an object and a name": torch_transport if first else "torch"})
    return {case: refused(lambda: zero.ShardedOptimizer([w], torch.optim.SGD, group, transport=choice, lr=1))
            for case, choice in choices.items()}


# --------------------------------------------------------------------------- stage 2: workers

STAGE2_STEPS = LATE + 1  # the late group joins for the last step
BACKWARDS = {LATE: 2}  # backward passes before the step (default 1): at LATE, gradient accumulation
# Stage 2 through a reduce-scatter pool of 64-byte slots: every bucket of the Toy in chunks of a few columns (a
# piece, the used-flags cut between chunks), two chunks in flight on the asynchronous transport.
CHUNK_CAP_MB = 64 / 2 ** 20
CHUNKED_CASES = [("auto", "adamw", "flat"), ("auto", "adam", "tensor"), ("background", "adamw", "flat")]


def stage2_cases(n: int) -> list[tuple[str, str, str]]:
    """(transport, optimizer, partition) of the stage-2 cases at world size n: both partitions on "auto" (shared
    memory) with SGD and Adam in the 2-rank subgroup, AdamW in the others (as ``grid_cases`` splits them), and
    AdamW flat on the other transports, with one bucket per parameter (``stage2_cap``); on "background" (its
    all-gathers run beside the caller) with overlap_with_forward."""
    names = ["sgd", "adam"] if n == 2 else ["adamw"]
    return ([("auto", name, partition) for name in names for partition in zero.PARTITIONS]
            + [(kind, "adamw", "flat") for kind in ("torch", "p2p", "background")])


def stage2_cap(kind: str) -> float:
    """The bucket cap of a stage-2 case: the default on "auto" (a bucket per param group and dtype, some with
    a parameter that gets no gradient), 0 elsewhere: a bucket per parameter, whose flat cut is uneven at 2
    and 3 ranks for the parameters of 7, 5 and 3 elements."""
    return 25.0 if kind == "auto" else 0.0


def stage2_givers(name: str, step: int, n: int) -> list[int]:
    """The group ranks whose backward gives parameter ``name`` a gradient at ``step``: every rank, but ``scale``
    (rank 0 only: the others' zeros are in the average), ``hidden.bias`` at step 1 (no rank: left unchanged,
    although its optimizer state would move it with a zero gradient), ``late`` before its group joins, and the
    parameters no backward reaches (``unused``, the frozen layer)."""
    if name in ("unused", "frozen.weight", "frozen.bias") or (name == "late" and step < LATE):
        return []
    if name == "scale":
        return [0]
    return [] if name == "hidden.bias" and step == 1 else list(range(n))


def stage2_gradient(index: int, step: int, micro: int, rank: int, n: int, p: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s gradient of parameter ``index`` in backward ``micro`` of ``step``: n * k * 2**-8, k an
    integer in [-256, 256]. Divided by n (what the engine does first) it is k * 2**-8 exactly, and any sum of
    a few such values is exact (small integers times one power of two): the average has the same bits in
    whatever order a transport adds the ranks' contributions, so the oracle can sum them in float64."""
    generator = torch.Generator().manual_seed(10_000 * step + 1000 * micro + 10 * index + rank)
    k = torch.randint(-256, 257, p.shape, generator=generator, dtype=torch.float64)
    return (k * n / 256).to(p.dtype)


def stage2_backward(model: Toy, step: int, micro: int, rank: int, n: int) -> None:
    """One backward whose gradients are exactly ``stage2_gradient`` (d/dp of sum(p * c) is c), the terms built
    in the opposite order on odd ranks (autograd runs the later-built first): the hooks fire in other orders."""
    named = list(enumerate(model.named_parameters()))
    terms = [(p * stage2_gradient(index, step, micro, rank, n, p)).sum()
             for index, (name, p) in (named if rank % 2 == 0 else named[::-1]) if rank in stage2_givers(name, step, n)]
    sum(terms).backward()


class Ordered(CountingTransport):
    """Counts, and lists the input size of every reduce-scatter in call order."""

    def __init__(self, inner: transport.Transport):
        super().__init__(inner)
        self.reduced: list[int] = []

    def reset(self) -> None:
        super().reset()
        self.reduced.clear()

    def reduce_scatter(self, output, input, op="sum", *, async_op=False):
        self.reduced.append(input.numel())
        return super().reduce_scatter(output, input, op, async_op=async_op)


def _arena_held():
    """A callback for ``SharedMemory.observe_blocks``, and a list whose entry is the bytes it saw taken, net."""
    held = [0]

    def observe(offset: int, nbytes: int, taken: bool) -> None:
        held[0] += nbytes if taken else -nbytes
    return observe, held


def _stage2_step(model: Toy, optimizer: zero.ShardedOptimizer, counting: Ordered, step: int) -> dict:
    """zero_grad (both ways), the step's backward passes, step(); what was held after backward and sent, the
    parameters after backward (the previous step's: with overlap_with_forward, the first gradient hook waited
    for their all-gathers, which no forward of the model waited for) and the all-gathers in flight after step."""
    n, rank = dist.get_world_size(optimizer.process_group), dist.get_rank(optimizer.process_group)
    optimizer.zero_grad(set_to_none=step % 2 == 0)
    counting.reset()
    arena = counting.inner if isinstance(counting.inner, transport.SharedMemory) else None
    observe, taken = _arena_held()
    with arena.observe_blocks(observe) if arena is not None else contextlib.nullcontext():
        arrived: list[str] = []
        handles = [p.register_post_accumulate_grad_hook(lambda p, name=name: arrived.append(name))
                   for name, p in model.named_parameters() if p.requires_grad]
        for micro in range(BACKWARDS.get(step, 1)):
            stage2_backward(model, step, micro, rank, n)
        for handle in handles:
            handle.remove()
        grads_left = [name for name, p in model.named_parameters() if p.grad is not None]
        shares = sum(t.numel() * t.element_size() for t in optimizer.gradient_shares())
    before = state_of(model)
    optimizer.step()
    return {"before": before, "grads_left": grads_left, "share_bytes": shares, "arena_taken": taken[0],
            "arrived": arrived, "calls": dict(counting.calls), "bytes": dict(counting.bytes),
            "reduced": list(counting.reduced), "order": [n * b.reduce_width for b in optimizer.buckets[::-1]],
            "in_flight": sum(b.work is not None for b in optimizer.buckets)}


def _stage2_case(name: str, partition: str, group, inner: transport.Transport, cap: float, overlap: bool,
                 reduce_cap_mb: float | None = None) -> dict:
    """STAGE2_STEPS steps of ZeRO stage 2 over the unwrapped Toy, the late group joining after LATE; then the
    consolidated state dict and the parameters close() leaves."""
    model = make_model()
    cls, options = OPTIMIZERS[name]
    counting = Ordered(inner)
    optimizer = zero.ShardedOptimizer(param_groups(model), cls, process_group=group, partition=partition,
                                      transport=counting, stage=2, bucket_cap_mb=cap, reduce_cap_mb=reduce_cap_mb,
                                      **options)
    if overlap:
        optimizer.overlap_with_forward(model)
    steps = []
    for step in range(STAGE2_STEPS):
        steps.append(_stage2_step(model, optimizer, counting, step))
        if step + 1 == LATE:
            optimizer.add_param_group({"params": [model.late], "lr": 0.02})
    saved = optimizer.state_dict()
    optimizer.close()
    return {"steps": steps, "state_dict": saved, "final": state_of(model)}


def _stage2_refusals(group) -> dict:
    """A bad stage (before any message); parameters that differ across ranks at construction and in an added
    group (every rank raises, naming the first); a .grad set by hand (step() refuses it)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    model = make_model()
    with torch.no_grad():
        if rank == n - 1 and n > 1:  # hidden.bias (param group 1, parameter 0) and scale differ on the last rank,
            model.hidden.bias[0] += 1.0  # frozen.weight (after hidden.bias) on rank 1 of 3: the first is hidden.bias
            model.scale[1] += 1.0
            model.late[0, 0] += 1.0
        if rank == 1 and n > 2:
            model.frozen.weight[0, 0] += 1.0
    w = model.hidden.weight
    out = {"stage": refused(lambda: zero.ShardedOptimizer([w], torch.optim.SGD, group, stage=3, lr=1)),
           "differ": refused(lambda: zero.ShardedOptimizer(param_groups(model), torch.optim.SGD, group, stage=2, lr=1))}
    same = zero.ShardedOptimizer([w], torch.optim.SGD, group, stage=2, lr=1)
    out["added group differs"] = refused(lambda: same.add_param_group({"params": [model.late]}))
    w.grad = torch.ones_like(w)
    try:
        same.step()
        out["set by hand"] = None
    except RuntimeError as error:
        out["set by hand"] = str(error)
    same.close()
    return out


def _stage2_grid(group, made: dict[str, transport.Transport]) -> dict:
    cases = stage2_cases(dist.get_world_size(group))
    return {"cases": {(kind, name, partition): _stage2_case(name, partition, group, made[kind], stage2_cap(kind),
                                                            overlap=kind == "background")
                      for kind, name, partition in cases},
            "chunked": {(kind, name, partition): _stage2_case(name, partition, group, made[kind], stage2_cap(kind),
                                                              overlap=kind == "background", reduce_cap_mb=CHUNK_CAP_MB)
                        for kind, name, partition in CHUNKED_CASES},
            "refused": _stage2_refusals(group)}


def _grid(ctx) -> dict:
    out = {}
    for n, members in GROUPS:
        group = dist.new_group(members) if members is not None else None  # every rank creates every group
        if members is None or ctx.rank in members:
            made = _transports(group)  # held: every case below on "auto" uses the same shared memory
            out[n] = {"rank": dist.get_rank(group),
                      "cases": {(name, partition): _case(name, partition, group)
                                for name in OPTIMIZERS for partition in zero.PARTITIONS},
                      "apart": _apart(group), "lone bucket": _lone_bucket_case(group),
                      "share time": _share_time(group) if n == 2 else None,  # meanwhile rank 0 is alone
                      "stage 2": _stage2_grid(group, made),  # before the grid below, which closes "background"
                      "bucketed": _bucketed_grid(group, made),
                      "refused": _bad_inputs(group), "transport refused": _transport_refusals(group)}
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, list[dict]]:
    """World size -> each member's results, in group-rank order."""
    by_size: dict[int, list] = {}
    for per_rank in run_workers(_grid, 3):
        for n, outcome in per_rank.items():
            by_size.setdefault(n, [None] * n)[outcome["rank"]] = outcome
    assert sorted(by_size) == [1, 2, 3] and all(None not in members for members in by_size.values())
    return by_size


def oracle(name: str, steps: int) -> tuple[Toy, torch.optim.Optimizer]:
    model = make_model()
    cls, options = OPTIMIZERS[name]
    optimizer = cls(param_groups(model), **options)
    train(model, optimizer, 0, steps)
    return model, optimizer


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def assert_same_state(got: dict, want: dict) -> None:
    """Two optimizer state dicts: the same groups and the same state, bit for bit."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        assert got["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


# --------------------------------------------------------------------------- the specification


@pytest.mark.parametrize("partition", zero.PARTITIONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_rank_holds_the_unsharded_optimizers_parameters_bit_for_bit(ranks, n, name, partition):
    model, _ = oracle(name, STEPS)
    want = state_of(model)
    assert not torch.equal(want["embed.weight"], make_model().embed.weight), "the steps changed the parameters"
    assert torch.equal(want["unused"], make_model().unused) and torch.equal(want["frozen.weight"],
                                                                            make_model().frozen.weight)
    for outcome in ranks[n]:
        assert_same_bits(outcome["cases"][name, partition]["params"], want)


@pytest.mark.parametrize("partition", zero.PARTITIONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_consolidated_state_dict_is_the_unsharded_optimizers(ranks, n, name, partition):
    _, optimizer = oracle(name, STEPS)
    for outcome in ranks[n]:
        assert_same_state(outcome["cases"][name, partition]["state_dict"], optimizer.state_dict())


@pytest.mark.parametrize("partition", zero.PARTITIONS)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_training_resumed_from_a_checkpoint_continues_the_unsharded_trajectory(ranks, n, name, partition):
    """From the sharded optimizer's own checkpoint and from the plain optimizer's."""
    model, optimizer = oracle(name, STEPS)
    train(model, optimizer, STEPS, STEPS + 2)
    want = state_of(model)
    for outcome in ranks[n]:
        assert_same_bits(outcome["cases"][name, partition]["resumed"], want)
        assert_same_bits(outcome["cases"][name, partition]["from_plain"], want)


@pytest.mark.parametrize("partition", zero.PARTITIONS)
@pytest.mark.parametrize("name", ["adam", "adamw"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_rank_keeps_the_state_of_its_own_parameters_only(ranks, n, name, partition):
    """Adam's two moments per owned element; the shares add up to the whole, none is empty."""
    trained = sum(p.numel() for nm, p in make_model().named_parameters()
                  if p.requires_grad and nm not in ("unused", "out.weight"))
    local = [outcome["cases"][name, partition]["local_state_elements"] for outcome in ranks[n]]
    owned = [outcome["cases"][name, partition]["owned_elements"] for outcome in ranks[n]]
    assert sum(local) == 2 * trained
    assert all(0 < share <= o * 2 for share, o in zip(local, owned))
    assert sum(owned) == sum(p.numel() for p in make_model().parameters())


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_flat_partition_gives_every_rank_the_same_number_of_elements_to_one_per_group_and_dtype(ranks, n):
    """Three param groups, one with a float64 parameter: four flat ranges cut in n, each to within one element."""
    owned = [outcome["cases"]["adamw", "flat"]["owned_elements"] for outcome in ranks[n]]
    assert max(owned) - min(owned) <= 4, owned


@pytest.mark.parametrize("n", [2, 3])
def test_on_one_host_the_update_is_shared_through_its_memory_without_messages_where_stores_stay_in_order(ranks, n):
    """Where a core's stores stay in order the ranks meet by polling shared counters: not one call into
    torch.distributed; elsewhere each meeting is a one-element all-reduce."""
    for outcome in ranks[n]:
        for name, case in outcome["cases"].items():
            assert case["transport"] == "SharedMemory", name
            if transport.POLLS:
                assert case["calls"] == {}, (name, case["calls"])
            else:
                assert case["calls"].keys() == {"all_reduce"}, (name, case["calls"])


@pytest.mark.parametrize("n", [2, 3])
def test_on_different_hosts_the_update_is_shared_by_the_ring_with_point_to_point_messages_only(ranks, n):
    """transport="p2p", the ring all-gather of allreduce.py; checkpoint and resume as the unsharded optimizer's."""
    model, optimizer = oracle("adamw", STEPS)
    params, saved = state_of(model), checkpoint(optimizer.state_dict())
    train(model, optimizer, STEPS, STEPS + 2)
    want = state_of(model)
    for outcome in ranks[n]:
        case = outcome["apart"]
        assert case["transport"] == "MessagePassing"
        assert case["collectives"] == 0, case["calls"]
        assert case["calls"].keys() <= {"isend", "irecv", "batch_isend_irecv"} and case["calls"]
        assert_same_bits(case["params"], params)
        assert_same_state(case["state_dict"], saved)
        assert_same_bits(case["resumed"], want)
        assert_same_bits(case["from_plain"], want)


def test_a_single_rank_owns_every_piece_and_shares_nothing(ranks):
    """Not even through the transport: step() launches no all-gather and leaves nothing in flight, with overlap too."""
    (outcome,) = ranks[1]
    for name, case in outcome["cases"].items():
        assert case["collectives"] == 0 and not case["calls"], (name, case["calls"])
    for key, case in outcome["bucketed"]["cases"].items():
        assert case["in_flight"] == 0 and all(calls == {} for calls in case["gathers"]), key
        assert case["share_s"] == 0.0 and not any(allocated for allocated, _ in case["buffers"]), key


@pytest.mark.parametrize("n", [1, 2, 3])
def test_bad_input_is_refused_on_every_rank_before_any_message(ranks, n):
    expected = {"no parameters": "ValueError: ShardedOptimizer got an empty parameter list",
                "empty groups": "ValueError: ShardedOptimizer got no parameters",
                "not a class": "TypeError: optimizer_cls must be a torch.optim.Optimizer subclass",
                "not an optimizer": "TypeError: optimizer_cls must be a torch.optim.Optimizer subclass",
                "twice in a group": "ValueError: a parameter of shape (7, 6) appears twice",
                "twice across groups": "ValueError: a parameter of shape (7, 6) appears twice",
                "twice when added": "ValueError: a parameter of shape (7, 6) appears twice",
                "devices": "ValueError: parameters on different devices",
                "partition": "ValueError: unknown partition 'rows'",
                "not contiguous": "ValueError: a parameter of shape (3, 4) is not contiguous",
                "bucket cap": "ValueError: bucket_cap_mb must be at least 0, got -1"}
    for outcome in ranks[n]:
        assert_refused(outcome["refused"], expected)


def test_the_partition_gives_the_largest_tensors_first_to_the_least_loaded_rank():
    load = [0, 0, 0]
    assert zero.partition([3, 10, 7, 7], load) == [1, 0, 1, 2] and load == [10, 10, 7]
    assert zero.partition([4, 4], load) == [2, 0] and load == [14, 10, 11], "later groups balance against earlier ones"
    assert zero.partition([5, 0], [0, 0]) == [0, 1], "ties go to the lowest rank"


# --------------------------------------------------------------------------- buckets, transports and overlap


@functools.lru_cache(maxsize=None)
def oracle_trajectory(name: str) -> list[dict[str, torch.Tensor]]:
    """The plain optimizer's parameters after each of GRID_STEPS steps (computed once per optimizer: read only)."""
    model = make_model()
    cls, options = OPTIMIZERS[name]
    optimizer = cls(param_groups(model), **options)
    states = []
    for step in range(GRID_STEPS):
        train(model, optimizer, step, step + 1)
        states.append(state_of(model))
    return states


def bucketed(ranks, n: int, kind: str, name: str, overlap: bool) -> list[dict]:
    """The bucketed grid's cases on ``kind`` with this optimizer and overlap (each partition it ran), every rank."""
    for outcome in ranks[n]:
        assert set(outcome["bucketed"]["cases"]) == set(grid_cases(n)), "the grid ran every case it names"
    cases = [outcome["bucketed"]["cases"][kind, name, partition, overlap] for outcome in ranks[n]
             for partition in zero.PARTITIONS if (kind, name, partition, overlap) in outcome["bucketed"]["cases"]]
    assert cases, (n, kind, name, overlap)
    return cases


def on(ranks, n: int, kind: str):
    """(name, partition, overlap, case) of every case of the bucketed grid on transport ``kind``, every rank."""
    for outcome in ranks[n]:
        for (case_kind, name, partition, overlap), case in outcome["bucketed"]["cases"].items():
            if case_kind == kind:
                yield name, partition, overlap, case


@pytest.mark.parametrize("n, kind, name", grid_params("kind", "name", overlap=False))
def test_with_buckets_a_read_right_after_step_sees_the_updated_parameters(ranks, n, kind, name):
    """By default step() returns once every bucket's all-gather is in: nothing is left in flight, whatever the
    transport; the late group, added after LATE steps, trains bit for bit too."""
    want = oracle_trajectory(name)
    assert not torch.equal(want[-1]["late"], want[LATE - 1]["late"]), "the late group trains"
    for case in bucketed(ranks, n, kind, name, False):
        assert case["buckets"] == [3] * LATE + [4] * (GRID_STEPS - LATE), "one per param group and dtype"
        assert case["in_flight"] == 0
        for step in range(GRID_STEPS):
            assert_same_bits(case["after_step"][step], want[step])


@pytest.mark.parametrize("n, kind, name", grid_params("kind", "name", overlap=True))
def test_with_overlap_each_layer_sees_its_updated_parameters_when_the_next_forward_reaches_it(ranks, n, kind, name):
    """overlap_with_forward: step() may return before the all-gathers end, each layer's forward waits for
    the buckets holding its parameters (the first forward calls the layers one by one: the root module owns
    parameters of the last buckets, so its own hook waits for all of them); what every layer saw, at every
    step, is the unsharded optimizer's, bit for bit."""
    want = oracle_trajectory(name)
    tied = {"out.weight": "embed.weight"}  # named_parameters() lists a tied parameter once
    for case in bucketed(ranks, n, kind, name, True):
        assert case["seen"][0] == {}, "no forward after the first step"
        for step in range(1, GRID_STEPS):
            seen = case["seen"][step]
            assert {key.split(".")[0] for key in seen} == set(LAYERS)
            assert_same_bits(seen, {key: want[step][tied.get(key, key)] for key in seen})


@pytest.mark.parametrize("n", [2, 3])
def test_an_asynchronous_transport_leaves_the_all_gathers_in_flight_after_step_and_an_inline_one_does_not(ranks, n):
    """With overlap_with_forward, shared memory on a communication thread returns from step() with all-gathers
    still running, some still when the forward's first layer runs (what the overlap test above then checks is
    real); the inline ones have finished them."""
    for outcome in ranks[n]:
        assert outcome["bucketed"]["kinds"] == KIND_CLASS
        cases = outcome["bucketed"]["cases"]
        assert any(case["in_flight_at_embed"][0] > 0 for (kind, _, _, overlap), case in cases.items()
                   if kind == "background" and overlap), "the forward's first layer ran beside later buckets"
        for (kind, name, partition, overlap), case in cases.items():
            if kind == "background" and overlap:
                assert case["in_flight"] > 0, (name, partition)
            elif kind in ("auto", "p2p") or not overlap:
                assert case["in_flight"] == 0, (kind, name, partition, overlap)
            assert case["in_flight_after_close"] == 0


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 3])
def test_every_all_gather_is_waited_for_before_the_next_into_its_buffer_starts(ranks, n, kind):
    """Per bucket buffer: launch, wait, launch, wait... and nothing left unwaited. With overlap, the second
    step follows the first without a forward: step() itself waits for the previous step's all-gathers."""
    for name, partition, overlap, case in on(ranks, n, kind):
        by_buffer: dict[int, list[str]] = {}
        for event, buffer in case["events"]:
            by_buffer.setdefault(buffer, []).append(event)
        assert len(by_buffer) == case["buckets"][-1], (name, partition, overlap)
        for events in by_buffer.values():
            assert events == ["launch", "wait"] * (len(events) // 2), (name, partition, overlap, events)


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 3])
def test_each_step_makes_one_all_gather_per_bucket_through_the_transport_and_nothing_else(ranks, n, kind):
    """Counted where the engine hands them to its transport: one all-gather per bucket per step (one more
    bucket once the late group joins), gathering at least every parameter's bytes."""
    model = make_model()
    early = sum(p.numel() * p.element_size() for group in param_groups(model) for p in group["params"])
    late = model.late.numel() * model.late.element_size()
    for name, partition, overlap, case in on(ranks, n, kind):
        buckets = case["buckets"]
        assert buckets[LATE] == buckets[0] + 1 and len(set(buckets[:LATE])) == len(set(buckets[LATE:])) == 1
        for step in range(GRID_STEPS):
            assert case["gathers"][step] == {"all_gather": buckets[step]}, (name, partition, overlap, step)
            assert case["gathered_bytes"][step] >= early + (late if step >= LATE else 0)


@pytest.mark.parametrize("n", [2, 3])
def test_on_shared_memory_every_buckets_buffer_is_the_transports_and_nothing_is_staged(ranks, n):
    """Zero copy: each bucket's all-gather buffer (those add_param_group made too) lies in the transport's
    shared memory, where the peers read it; no call ever copied a tensor into the staging block. On the
    other transports the buffers are plain tensors."""
    for outcome in ranks[n]:
        grid = outcome["bucketed"]
        assert grid["staged"] == {"auto": False, "torch": False, "p2p": False, "background": False}
        for (kind, name, partition, overlap), case in grid["cases"].items():
            assert all(allocated for allocated, _ in case["buffers"]), (kind, name, partition, overlap)
            owned = [owned for _, owned in case["buffers"]]
            assert all(owned) if KIND_CLASS[kind] == "SharedMemory" else not any(owned), (kind, name, partition)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_lone_bucket_on_an_inline_transport_is_shared_inside_step_even_with_overlap_and_bit_for_bit(ranks, n):
    """Nothing is left in flight after step(), and the time it took counts as exposed; the parameters are
    the unsharded AdamW's."""
    model = make_model()
    plain = torch.optim.AdamW(lone_bucket_params(model), lr=0.01)
    for step in range(STEPS):
        plain.zero_grad()
        set_gradients(model, step)
        plain.step()
    for outcome in ranks[n]:
        case = outcome["lone bucket"]
        assert case["buckets"] == 1 and case["in_flight"] == 0
        assert case["share_s"] > 0.0 if n > 1 else case["share_s"] == 0.0
        assert_same_bits(case["params"], state_of(model))


@pytest.mark.parametrize("n", [2])
def test_last_share_s_is_the_share_nothing_overlapped(ranks, n):
    """All of an inline all-gather, inside step(); of an asynchronous one, what the next forward waited for it
    (all of that wait when the forward came at once; none when other work filled the all-gather's time, and
    the previous step's wait is not carried over)."""
    for outcome in ranks[n]:
        case = outcome["share time"]
        assert case["inline in flight"] == 0 and case["inline"] >= SLOW_S, case
        assert case["waited at once in flight"] == 1 and case["waited at once wait"] > 0.0, case
        assert case["waited at once"] >= case["waited at once wait"], case
        assert case["overlapped in flight"] == 1 and case["overlapped wait"] == 0.0, case
        assert case["overlapped"] < SLOW_S / 2, case


@pytest.mark.parametrize("n, kind, name, overlap", grid_params("kind", "name", "overlap"))
def test_bucketed_training_ends_with_the_unsharded_parameters_and_close_leaves_nothing_behind(ranks, n, kind, name,
                                                                                              overlap):
    """module.state_dict() waits too; close() leaves nothing in flight and removes every hook."""
    model = make_model()
    cls, options = OPTIMIZERS[name]
    optimizer = cls(param_groups(model), **options)
    train(model, optimizer, 0, GRID_STEPS)
    want = {key: t.clone() for key, t in model.state_dict().items()}
    for case in bucketed(ranks, n, kind, name, overlap):
        assert_same_bits(case["final"], want)
        assert case["hooks_left"] == 0 and case["in_flight_after_close"] == 0
        assert case["share_s"] >= 0.0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ranks_that_choose_different_transports_are_refused_on_every_rank(ranks, n):
    """At construction, by the one exchange of the choices (no all-gather of parameters starts)."""
    expected = {"unknown": "ValueError: ShardedOptimizer: unknown transport 'pigeon'"}
    if n > 1:
        expected.update({"different names": "ValueError: ShardedOptimizer: the ranks chose different transports",
                         "an object and a name": "ValueError: ShardedOptimizer: the ranks chose different transports"})
    for outcome in ranks[n]:
        refusals = outcome["transport refused"]
        assert refusals.keys() == expected.keys()
        for case, start in expected.items():
            error = refusals[case]["error"]
            assert error is not None and error.startswith(start), (case, error)
            assert set(refusals[case]["calls"]) <= {"all_gather_object"}, (case, refusals[case]["calls"])


# --------------------------------------------------------------------------- stage 2: gradients to their owners


@functools.lru_cache(maxsize=None)
def stage2_oracle(name: str, n: int) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """The plain optimizer's parameters after each step, each step on the average of what the n ranks' backward
    passes gave, and its state dict at the end (computed once per optimizer and world size: read only). A
    parameter no rank gave a gradient has none (zero_grad(set_to_none=True)); the sum over backward passes of
    the averages, each exact."""
    model = make_model()
    cls, options = OPTIMIZERS[name]
    optimizer = cls(param_groups(model), **options)
    states = []
    for step in range(STAGE2_STEPS):
        optimizer.zero_grad(set_to_none=True)
        for index, (param_name, p) in enumerate(model.named_parameters()):
            givers = stage2_givers(param_name, step, n)
            if givers:  # float64 sums of k * 2**-8 values: exact, see stage2_gradient
                p.grad = sum(stage2_gradient(index, step, micro, r, n, p).double() / n
                             for micro in range(BACKWARDS.get(step, 1)) for r in givers).to(p.dtype)
        optimizer.step()
        if step + 1 == LATE:
            optimizer.add_param_group({"params": [model.late], "lr": 0.02})
        states.append(state_of(model))
    return states, optimizer.state_dict()


def stage2_buckets(step: int, kind: str) -> list[tuple[int, int, int]]:
    """(elements, parameters, element bytes) of each bucket stage 2 makes at ``step`` on transport ``kind``, from
    the shapes: of the parameters that require a gradient, one per param group and dtype (the default cap
    holds the Toy whole) or one per parameter (``stage2_cap``)."""
    model = make_model()
    groups = [g["params"] for g in param_groups(model)] + ([[model.late]] if step >= LATE else [])
    trainable = [[p for p in params if p.requires_grad] for params in groups]
    if stage2_cap(kind) == 0:
        return [(p.numel(), 1, p.element_size()) for params in trainable for p in params]
    buckets = []
    for params in trainable:
        for dtype in dict.fromkeys(p.dtype for p in params):
            mine = [p for p in params if p.dtype == dtype]
            buckets.append((sum(p.numel() for p in mine), len(mine), mine[0].element_size()))
    return buckets


def stage2(ranks, n: int, case: tuple[str, str, str]) -> list[list[dict]]:
    """Each group rank's steps of a stage-2 case."""
    return [outcome["stage 2"]["cases"][case]["steps"] for outcome in ranks[n]]


@pytest.mark.parametrize("n, case", [(n, case) for n in (1, 2, 3) for case in stage2_cases(n)],
                         ids=lambda value: "-".join(value) if isinstance(value, tuple) else str(value))
def test_stage2_is_the_unsharded_optimizer_on_the_averaged_gradient_bit_for_bit(ranks, n, case):
    """After every step, every rank's parameters are the plain optimizer's stepped on the average of the ranks'
    gradients: some parameters got one from some ranks only (their average has the others' zeros), one from no
    rank in a step (left unchanged), one from none ever; two backward passes accumulate before one step; the
    late group trains; the flat partition cuts tensors between ranks unevenly. The consolidated state dict is
    the plain optimizer's too (the frozen parameters, which stage 2 leaves out of its buckets, have none)."""
    want, state = stage2_oracle(case[1], n)
    assert torch.equal(want[1]["hidden.bias"], want[0]["hidden.bias"]), "no gradient: left unchanged"
    assert not torch.equal(want[2]["hidden.bias"], want[1]["hidden.bias"])
    assert not torch.equal(want[-1]["late"], want[LATE - 1]["late"]) and torch.equal(want[-1]["unused"],
                                                                                      make_model().unused)
    for outcome in ranks[n]:
        run = outcome["stage 2"]["cases"][case]
        for step, record in enumerate(run["steps"]):  # each step's parameters, read after the next backward
            assert_same_bits(record["before"], want[step - 1] if step else state_of(make_model()))
        assert_same_bits(run["final"], want[-1])
        assert_same_state(run["state_dict"], state)
        if case[0] == "background" and n > 1:
            assert any(record["in_flight"] for record in run["steps"]), "step() left all-gathers in flight"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stage2_through_a_pool_of_slots_smaller_than_a_bucket_is_still_bit_for_bit(ranks, n):
    """With ``reduce_cap_mb`` so small that each bucket is reduce-scattered in chunks of a few columns (the
    pool's two slots used in turn, each chunk waiting for the one before it in its slot), every step's
    parameters and the state dict are still the plain optimizer's; the chunks of each bucket cover its rows
    once, last bucket first; no .grad is left and no transport memory is taken during backward."""
    for outcome in ranks[n]:
        for (kind, name, partition), run in outcome["stage 2"]["chunked"].items():
            want, state = stage2_oracle(name, n)
            for step, record in enumerate(run["steps"]):
                assert_same_bits(record["before"], want[step - 1] if step else state_of(make_model()))
                assert record["grads_left"] == [] and record["arena_taken"] == 0, (kind, step)
                sizes = [size for _, _, size in stage2_buckets(step, kind)[::-1]]  # in the reduce order
                chunks = []
                for micro in range(BACKWARDS.get(step, 1)):  # a later backward's sums go beside the share: a row
                    for rows, size in zip(record["order"], sizes):
                        columns, width = (64 // size) // (n + (micro > 0)), rows // n
                        chunks += [n * (min(lo + columns, width) - lo) for lo in range(0, width, columns)]
                assert len(chunks) > len(sizes), (kind, step, "a bucket in several chunks")
                assert record["reduced"] == chunks, (kind, partition, step)
            assert_same_bits(run["final"], want[-1])
            assert_same_state(run["state_dict"], state)


@pytest.mark.parametrize("n", [2, 3])
def test_stage2_reduces_the_buckets_in_one_order_on_every_rank_whatever_order_the_gradients_arrive_in(ranks, n):
    """The hooks fire in opposite orders on even and odd ranks; the reduce-scatters go last bucket first on
    every rank (the transports pair collectives up by call order), one per bucket per backward."""
    for case in stage2_cases(n):
        runs = stage2(ranks, n, case)
        for step in range(STAGE2_STEPS):
            first, second = (steps[step]["arrived"] for steps in runs[:2])
            assert [a for a in first if a in second] != [a for a in second if a in first], (case, step)
            for steps in runs:
                assert steps[step]["reduced"] == steps[step]["order"] * BACKWARDS.get(step, 1), (case, step)
            assert len({tuple(steps[step]["reduced"]) for steps in runs}) == 1, (case, step)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stage2_sends_the_bytes_of_one_all_reduce_per_step(ranks, n):
    """Counted where the engine hands them to its transport: per backward one reduce-scatter per bucket, per
    step one all-gather per bucket (none alone). A ring moves (n-1)/n of a reduce-scatter's input and of an
    all-gather's output; an all-reduce of the gradients moves (n-1)/n of their bytes twice. So the input plus
    the output must be twice the gradient bytes G, plus padding (each bucket's rows cut to equal lengths:
    fewer than n elements for the all-gather) and one used-flag per piece of a parameter in the reduce-scatter
    (at most one more piece than parameters per row). Stage 1 sends G in DDP's all-reduce and G in the
    all-gather: 1.5 all-reduces."""
    for case in stage2_cases(n):
        for steps in stage2(ranks, n, case):
            for step, record in enumerate(steps):
                buckets, backwards = stage2_buckets(step, case[0]), BACKWARDS.get(step, 1)
                gathers = {"all_gather": len(buckets)} if n > 1 else {}
                assert record["calls"] == {"reduce_scatter": backwards * len(buckets), **gathers}, (case, step)
                if n == 1 or case[2] == "tensor":  # whole tensors: rows as long as the largest share (not bounded)
                    continue
                grads = sum(elements * size for elements, _, size in buckets)
                slack = sum(n * (params + 1) * size + 2 * (n - 1) * size for _, params, size in buckets)
                sent = record["bytes"]["reduce_scatter"] / backwards + record["bytes"]["all_gather"]
                assert 2 * grads <= sent <= 2 * grads + slack, (case, step, sent, grads, slack)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stage2_keeps_about_one_nth_of_the_gradients_per_rank(ranks, n):
    """After backward no parameter holds a .grad, no shared memory was taken (the reduce-scatter pool and the
    shares are allocated once, at construction) and the shares hold G / n bytes, plus padding and the used-flags."""
    for case in stage2_cases(n):
        for steps in stage2(ranks, n, case):
            for step, record in enumerate(steps):
                assert record["grads_left"] == [] and record["arena_taken"] == 0, (case, step)
                if case[2] == "tensor":  # whole tensors: a rank's share is uneven (not bounded here)
                    continue
                buckets = stage2_buckets(step, case[0])
                grads = sum(elements * size for elements, _, size in buckets)
                slack = sum((params + 1) * size for _, params, size in buckets)
                assert grads / n <= record["share_bytes"] <= grads / n + slack, (case, step, record["share_bytes"])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stage2_refuses_parameters_that_differ_across_ranks_on_every_rank_naming_the_first(ranks, n):
    """At construction and in add_param_group, after one exchange of digests: the same message on every rank,
    naming the first parameter that differs and the ranks that hold another one; a stage that does not exist
    before any message; a .grad set by hand, at step()."""
    for outcome in ranks[n]:
        refusals = outcome["stage 2"]["refused"]
        assert_refused({"stage": refusals["stage"]}, {"stage": "ValueError: stage must be one of 1, 2, got 3"})
        if n == 1:
            assert refusals["differ"]["error"] is None and refusals["added group differs"]["error"] is None
        else:
            assert refusals["differ"]["error"] == (
                "ValueError: ShardedOptimizer(stage=2): the ranks' parameters differ, first parameter 0 of param "
                f"group 1 (shape (7,), torch.float32): group rank(s) [{n - 1}] hold another one than rank 0 (its "
                "values, shape or dtype, or no such parameter): every rank must build the same model (one seed, "
                "or one checkpoint loaded) before the optimizer")
            assert refusals["differ"]["calls"] == {"all_gather_object": 1}, "one exchange, before any other"
            assert refusals["added group differs"]["error"].startswith(
                "ValueError: ShardedOptimizer(stage=2): the ranks' parameters differ, first parameter 0 of param "
                f"group 1 (shape (4, 3), torch.float32): group rank(s) [{n - 1}]")
        assert refusals["set by hand"].startswith("ShardedOptimizer(stage=2): parameter 0 of param group 0")
