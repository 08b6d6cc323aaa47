"""ZeRO stages 1 and 2: an optimizer whose state (stage 2: and gradients) is sharded over the ranks.

    model = DDP(build_model(...))        # stage 1: DDP averages every gradient on every rank
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model = build_model(...)             # stage 2: no DDP; each rank receives its own share's gradients
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    optimizer.overlap_with_forward(model)             # optional: the next forward waits per layer
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Each parameter element is owned by one rank, which alone keeps its optimizer state (AdamW: two tensors per
parameter) and updates it; every rank's updated share then goes to every other rank in one all-gather per
*bucket* (at most ``bucket_cap_mb`` of one param group and dtype) through the ``transport``. A bucket's
parameters are views of one buffer the transport allocated (row r: rank r's share), so the gather lands in
them in place. Stage 2: hooks reduce-scatter each bucket's gradients once backward made them all, in chunks
through two small slots (1/32 of the parameters' bytes each); each rank keeps its elements' average.

``step()`` updates bucket 0, starts its all-gather, updates bucket 1, ...; it returns once every parameter is
up to date, or, after ``overlap_with_forward(module)``, at once, each layer of the next forward waiting for its
bucket (whether the transfers overlap is the transport's matter).

The partition, from the shapes alone, the same on every rank: ``"flat"`` (default) cuts each bucket's N
elements, back to back, into ranges of ceil(N / n): exact for element-wise updates (SGD, Adam, AdamW: bit
for bit the unsharded optimizer), not for one that looks at a whole tensor (LAMB, a norm); ``"tensor"``
gives whole parameters, largest first, to the least loaded rank: exact for any per-tensor update, uneven
when one tensor dominates (a bucket's rows are as long as its largest share). ``tests/test_zero.py`` checks
both partitions at both stages, ``tests/test_zero_memory.py`` what each stage holds.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dpkit.comm import transport as comm_transport
from dpkit.engines.ddp import coalesce


@dataclass
class Piece:
    """Elements ``[start, end)`` of ``param`` (flattened), owned by rank ``owner``.

    ``tensor`` is what the owner's optimizer updates: ``param`` itself when the piece is the
    whole tensor under ``partition="tensor"``, otherwise a 1-D view of those elements (so the
    update lands in ``param`` without a copy)."""

    param: torch.Tensor
    start: int
    end: int
    owner: int
    tensor: torch.Tensor


@dataclass(eq=False)
class Bucket:
    """Consecutive parameters of one param group and dtype, all-gathered together after their update.

    ``by_rank[r]``: rank r's pieces of them, in order (what row r of the all-gather buffer
    holds, back to back). ``work``: the all-gather on its way into ``buffer``, from ``step()`` until
    someone waits for it (the parameters are views of the buffer, so it lands in them)."""

    index: int
    group: int                     # the param group (of this optimizer and of the local one)
    params: list[torch.Tensor]
    by_rank: list[list[Piece]]
    buffer: torch.Tensor | None = field(default=None, repr=False)  # (n, width), allocated by the transport
    work: comm_transport.Work | None = field(default=None, repr=False)  # the all-gather into ``buffer``
    # Stage 2 only. The reduce-scatter's input is n virtual rows of ``reduce_width``: row r = rank r's pieces'
    # gradients divided by n, back to back, then one used-flag per piece (1 if this rank had its parameter's
    # gradient), then zeros; they are built chunk by chunk in the optimizer's reduce-scatter pool (see
    # ``ShardedOptimizer._reduce``). ``grad`` (reduce_width,): this rank's row of the sum, i.e. its pieces'
    # averaged gradients and how many ranks had each.
    grad: torch.Tensor | None = field(default=None, repr=False)
    # Parameter id -> its gradient (flat), from its hook until the bucket is reduced (autograd's tensor, kept).
    arrived: dict = field(default_factory=dict, repr=False)
    holds: bool = False  # ``grad`` holds gradients (some backward since the last zero_grad reduced this bucket)

    def mine(self, rank: int) -> list[torch.Tensor]:
        return [piece.tensor for piece in self.by_rank[rank]]

    @property
    def width(self) -> int:
        """Elements of the largest share: the row length of the all-gather buffer."""
        return max(sum(piece.end - piece.start for piece in pieces) for pieces in self.by_rank)

    @property
    def reduce_width(self) -> int:
        """Elements of the largest share plus its used-flags: the row length of the reduce-scatter."""
        return max(sum(piece.end - piece.start for piece in pieces) + len(pieces) for pieces in self.by_rank)


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` over this rank's share of ``params`` (ZeRO stage 1 or 2); a ``torch.optim.Optimizer``.

    Args:
        params: tensors, or param-group dicts with their own options (as any optimizer takes).
        optimizer_cls: a ``torch.optim.Optimizer`` subclass, built over this rank's share.
        process_group: the ranks that share the state (default: the whole world).
        partition: ``"flat"`` (default) or ``"tensor"``, see the module docstring.
        bucket_cap_mb: MiB of parameters per bucket (default 25, as DDP's); ``float("inf")``:
            one bucket per param group and dtype (nothing to overlap), 0: one per parameter.
        transport: how the updated shares travel (``transport.resolve``; default "auto": this
            host's shared memory when every rank is on it, else PyTorch's all-gather). An
            asynchronous transport overlaps each bucket's all-gather with the next bucket's update
            (and the next forward, see ``overlap_with_forward``); an inline one completes it at its call.
        stage: 1 (default): the gradients arrive averaged on every rank (wrap the model in a DDP);
            2: over an unwrapped model, the optimizer averages them itself, see below.
        reduce_cap_mb: stage 2: MiB of each of the reduce-scatter pool's two slots (default None: 1/32 of the
            bytes of the parameters that require a gradient, at least 64 KiB; never more than the largest
            bucket needs). A bucket larger than a slot is reduce-scattered in several calls (one bucket of
            every parameter: about 32, more with gradient accumulation): larger slots, fewer calls.
        **defaults: options for ``optimizer_cls`` (``lr=...``), defaults of every param group.

    Stage 2 (``stage=2``, the model NOT wrapped in a DDP): construction checks that every rank holds
    the same parameters (a digest of each all-gathered: ValueError on every rank naming the first that
    differs; build the model from one seed, or load one checkpoint). Buckets hold the parameters that
    require a gradient when their group is added; a post-accumulate-grad hook on each keeps its
    gradient (autograd's tensor) until its bucket is reduced and sets ``.grad`` to None; a bucket whose
    gradients are all in is reduce-scattered at once (the buckets go in reverse order, the same on every
    rank whatever order the gradients arrive in), the rest when backward ends, which waits for every one.
    A bucket goes in chunks of columns of its rows (see ``Bucket``), each copied, divided by n, into one of
    two slots the transport allocated once; a chunk waits for the reduce-scatter that last used its slot, so
    stage 2 keeps no buffer the size of the parameters and takes no transport memory during backward (while
    a bucket waits, its gradients are alive, as autograd made them). After backward each rank holds, in
    ``gradient_shares()`` (buffers the transport allocated), the averaged gradients of its own pieces only,
    and no parameter has a ``.grad``. ``step()`` hands them to the local optimizer, then all-gathers as at
    stage 1. The contract:

    * a parameter no rank gave a gradient since the last ``zero_grad`` is left unchanged (a used-flag
      per piece rides in the reduce-scatter); one that some ranks gave a gradient gets the average,
      zeros from the others (as DDP with ``find_unused_parameters=True``);
    * each backward reduces what it produced, added to what earlier ones left (gradient accumulation:
      the sum of the averages, rounded per backward); ``zero_grad(set_to_none=...)`` empties the shares
      either way: there is no ``.grad`` to keep at zero, so a step after it with no backward changes
      nothing (the plain optimizer after ``zero_grad(set_to_none=True)``, PyTorch's default);
    * every rank runs the same backward passes, each reaching at least one of these parameters (a rank
      whose backward reaches none leaves its peers in the reduce-scatter until the group's timeout);
      a ``.grad`` set by hand is refused by ``step()`` (RuntimeError): gradients come through the hooks.

    ``param_groups`` lists every parameter (so ``zero_grad`` and learning-rate schedulers act
    on all of them; their options are handed to the local optimizer at every step); ``state``
    holds this rank's optimizer state only (per piece). Parameters without a gradient are left
    unchanged, as by any optimizer. Over several ranks, construction (and ``add_param_group``) moves each
    parameter of a bucket into its bucket's buffer: ``p.data`` becomes a view of it, the Parameter object
    stays (module, tied weights, a DDP see the same one); a parameter whose storage is replaced later
    (``p.data = ...``, ``load_state_dict(assign=True)``) is no longer updated. Every rank must construct
    it, call ``step``, ``state_dict``, ``load_state_dict``, ``add_param_group`` and ``overlap_with_forward``
    the same way, with the same model (collectives, or they reshape the collectives).

    ``last_share_s``: seconds the calling thread spent on sharing the last step's updated
    parameters, i.e. the share communication nothing overlapped: the all-gather calls (all of an
    all-gather that the transport runs inline) and the waits for the asynchronous ones. By default all of
    it is inside ``step()``; with ``overlap_with_forward`` the waits of the following forward (or of any
    other wait) count too, and it is set once every bucket of that step has arrived.

    ``last_reduce_wait_s`` (stage 2): seconds the end of the last backward spent launching the buckets still
    waiting and waiting for every reduce-scatter (what backward did not overlap; an inline transport sums
    inside the hooks, lengthening backward instead).

    ``close()`` waits for the parameters and removes the hooks (stage 2: the gradient hooks too, after
    which backward leaves ``.grad`` as usual); the transport stays open (it may serve other engines:
    close one you made yourself when done with it).

    Checkpoints are CONSOLIDATED: ``state_dict()`` gathers every rank's state and returns, on
    every rank, exactly what ``optimizer_cls`` over all the parameters would return, so it can
    be saved once (by rank 0), loaded into a plain optimizer, or into a ``ShardedOptimizer``
    over any number of ranks; ``load_state_dict`` keeps the state of this rank's pieces.
    """

    # How step() shares the updated parameters: an all-gather through the transport, or "broadcast": one
    # torch.distributed.broadcast per owner (n rounds where a ring all-gather pipelines them; for A/B timing).
    update = "all_gather"

    def __init__(self, params: Iterable, optimizer_cls: type, process_group=None, *, partition: str = "flat",
                 bucket_cap_mb: float = 25.0, transport="auto", stage: int = 1, reduce_cap_mb: float | None = None,
                 **defaults: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if partition not in PARTITIONS:
            raise ValueError(f"unknown partition {partition!r}: choose one of {', '.join(PARTITIONS)}")
        if not bucket_cap_mb >= 0:  # also refuses NaN
            raise ValueError(f"bucket_cap_mb must be at least 0, got {bucket_cap_mb}")
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(map(str, STAGES))}, got {stage!r}")
        if reduce_cap_mb is not None and not reduce_cap_mb > 0:
            raise ValueError(f"reduce_cap_mb must be more than 0 (or None), got {reduce_cap_mb}")
        groups = _param_groups(params)
        self.process_group, self.rank = process_group, dist.get_rank(process_group)
        self.world_size, self.partition, self.stage = dist.get_world_size(process_group), partition, stage
        if stage == 2:
            check_same_parameters(groups, process_group)
        self.bucket_cap_bytes = bucket_cap_mb * 2 ** 20
        self.load = [0] * self.world_size  # elements owned per rank, across groups: the greedy partition's state
        self.pieces: list[Piece] = []  # every rank's, in bucket order
        self.buckets: list[Bucket] = []  # in param-group order, then the parameters' order
        device = next(p.device for g in groups for p in g["params"])  # one device: checked
        self.transport = comm_transport.resolve(transport, process_group, device, engine="ShardedOptimizer")
        self._module: nn.Module | None = None  # set by overlap_with_forward
        self._hooks: list = []
        self._waited_s = 0.0  # the calling thread's time on this step's share so far (see last_share_s)
        self.last_share_s = 0.0
        # Stage 2: parameter id -> its bucket; the gradient hooks; the world size as a divisor per gradient dtype
        # (a 0-dim tensor of the gradient's own dtype: no cast at each call, exact since a world size is).
        self._bucket_of: dict[int, Bucket] = {}
        self._gradient_hooks: list = []
        self._divisors: dict[torch.dtype, torch.Tensor] = {}
        # Stage 2's reduce-scatter pool (``_size_pool``): POOL_SLOTS slots (a chunk's n rows of input, then a row for
        # its output when it is to be added to an earlier backward's), used in turn; ``_pending[s]``: (work, output,
        # share) of the reduce-scatter that last used slot s, until someone waits for it.
        self._reduce_cap_bytes = None if reduce_cap_mb is None else reduce_cap_mb * 2 ** 20
        self._pool: torch.Tensor | None = None  # (POOL_SLOTS, _slot_bytes) uint8, allocated by the transport
        self._pending: list[tuple | None] = [None] * POOL_SLOTS
        self._turn = 0
        self._in_backward = False
        self._reduced = 0  # buckets whose reduce-scatter this backward launched, in ``_reduce_order``
        self.last_reduce_wait_s = 0.0
        owned = [self._assign(group["params"], index) for index, group in enumerate(groups)]  # allocates too
        self.local = optimizer_cls([{**group, "params": mine} for group, mine in zip(groups, owned)], **defaults)
        self._ready = False  # the base constructor calls add_param_group: the groups are already partitioned
        super().__init__(groups, self.local.defaults)  # every option of optimizer_cls, so state_dict loads anywhere
        self._ready = True
        self.state = self.local.state  # type: ignore[assignment]  # this rank's share only

    # ------------------------------------------------------------------ partition

    def _assign(self, params: list[torch.Tensor], group: int) -> list[torch.Tensor]:
        """Cut one group's parameters into buckets of pieces with owners; returns the tensors this rank
        updates, in order (the local optimizer's group: ``_mine()`` follows the same order)."""
        owner_of = {}
        if self.stage == 2:  # a parameter that cannot get a gradient has nothing to reduce, update or gather
            params = [p for p in params if p.requires_grad]
        if self.partition == "tensor":
            # A frozen parameter never has optimizer state: it weighs nothing in the balance.
            owners = partition([p.numel() if p.requires_grad else 0 for p in params], self.load)
            owner_of = {id(p): owner for p, owner in zip(params, owners)}
        mine = []
        for run in coalesce(params, self.bucket_cap_bytes):  # one dtype, consecutive, at most the cap
            pieces = ([Piece(p, 0, p.numel(), owner_of[id(p)], p) for p in run] if owner_of
                      else _flat_pieces(run, self.world_size))
            by_rank = [[piece for piece in pieces if piece.owner == r] for r in range(self.world_size)]
            bucket = Bucket(len(self.buckets), group, run, by_rank)
            self.buckets.append(bucket)
            self.pieces += [piece for share in by_rank for piece in share]
            if self.stage == 2:
                self._prepare_reduction(bucket)
            if bucket.width and self.world_size > 1:
                self._place(bucket)
            mine += bucket.mine(self.rank)
        if self.stage == 2:
            self._size_pool()
        return mine

    @torch.no_grad()
    def _place(self, bucket: Bucket) -> None:
        """The bucket's parameters move into one (n, width) buffer the transport allocates, rank r's
        pieces back to back in row r, and become views of it, so the all-gather lands in the parameters
        themselves (in place: nothing kept beside them but the rows' padding; on shared memory the peers read
        each share where its owner updated it). A flat partition's rows are consecutive ranges of the bucket,
        so each parameter is one contiguous run of the buffer; a whole tensor is one piece."""
        first = bucket.params[0]
        buffer = self.transport.allocate((self.world_size, bucket.width), dtype=first.dtype, device=first.device)
        buffer.zero_()  # the padding: deterministic bytes to gather
        flat, begins = buffer.view(-1), {}
        for row, pieces in enumerate(bucket.by_rank):
            column = row * bucket.width
            for piece in pieces:  # where the parameter's element 0 lies: the same for each of its pieces
                begin = begins.setdefault(id(piece.param), column - piece.start)
                assert begin == column - piece.start, "a flat partition's rows are consecutive ranges"
                column += piece.end - piece.start
        for p in bucket.params:
            view = flat[begins[id(p)]:begins[id(p)] + p.numel()].view(p.shape)
            view.copy_(p.detach())
            p.data = view  # the same Parameter object (the module, tied weights, a DDP keep it), new storage
        for piece in (piece for pieces in bucket.by_rank for piece in pieces):
            if piece.tensor is not piece.param:  # a flat piece: its view of the parameter's new storage
                piece.tensor = piece.param.detach().view(-1)[piece.start:piece.end]
        bucket.buffer = buffer

    def _prepare_reduction(self, bucket: Bucket) -> None:
        """Stage 2: the bucket's share of the sum (allocated by the transport) and a gradient hook on each
        parameter."""
        first = bucket.params[0]
        bucket.grad = self.transport.allocate((bucket.reduce_width,), dtype=first.dtype, device=first.device)
        self._bucket_of.update((id(p), bucket) for p in bucket.params)
        ref = weakref.ref(self)
        self._gradient_hooks += [p.register_post_accumulate_grad_hook(_gradient_hook(ref)) for p in bucket.params]

    def _size_pool(self) -> None:
        """Stage 2: (re)allocate the reduce-scatter pool when a bucket added needs larger slots (construction and
        ``add_param_group``, never during backward). A slot holds one chunk: n rows of input and one of output."""
        n = self.world_size
        need = max((n + 1) * b.reduce_width * b.grad.element_size() for b in self.buckets if b.grad is not None)
        cap = self._reduce_cap_bytes
        if cap is None:
            trainable = sum(p.numel() * p.element_size() for b in self.buckets for p in b.params)
            cap = max(POOL_MIN_BYTES, trainable / POOL_FRACTION)
        widest = max(b.grad.element_size() for b in self.buckets if b.grad is not None)
        slot = max(min(need, int(cap)), (n + 1) * widest)  # at least one column of the widest dtype
        slot = -(-slot // POOL_ALIGN) * POOL_ALIGN  # every slot starts aligned for any dtype's view
        if self._pool is None or self._pool.size(1) < slot:
            first = self.buckets[0].params[0]
            self._pool = self.transport.allocate((POOL_SLOTS, slot), dtype=torch.uint8, device=first.device)

    def reduce_pool(self) -> list[torch.Tensor]:
        """Stage 2: the reduce-scatter pool (kept between steps; during backward, chunks of gradients in flight);
        empty at stage 1."""
        return [] if self._pool is None else [self._pool]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to every rank's partition (every rank must add the same group)."""
        if not self._ready:  # called by the base constructor
            super().add_param_group(param_group)
            return
        (group,) = _param_groups([param_group], known=[p for g in self.param_groups for p in g["params"]])
        if self.stage == 2:
            check_same_parameters([group], self.process_group, first_group=len(self.param_groups))
        self.wait_for_parameters()
        super().add_param_group(group)
        self.local.add_param_group({**self.param_groups[-1],
                                    "params": self._assign(group["params"], len(self.param_groups) - 1)})
        if self._module is not None:  # the new parameters' layers wait for their buckets too
            self._install_hooks(self._module)

    def _mine(self) -> list[Piece]:
        return [piece for piece in self.pieces if piece.owner == self.rank]

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Update this rank's pieces bucket by bucket, each bucket's all-gather overlapping the next
        bucket's update; return when every parameter is up to date (or at once, see
        ``overlap_with_forward``)."""
        self.wait_for_parameters()  # the previous step's gathers still write the parameters being updated
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self.local.param_groups):
            local.update({key: value for key, value in group.items() if key != "params"})  # schedulers set these
        attached = self._attach_gradients()
        self._waited_s = 0.0
        try:
            for bucket in self.buckets:
                self._update(bucket)
                self._launch(bucket)
        finally:
            for piece in attached:
                piece.tensor.grad = None  # do not keep the gradient alive past zero_grad(set_to_none=True)
        if self._module is None:
            self.wait_for_parameters()
        else:
            self._note_share_time()  # an inline transport left nothing for the forward to wait for
        return loss

    def _attach_gradients(self) -> list[Piece]:
        """Give this rank's pieces their gradients (the tensors the local optimizer steps): at stage 1 the
        same view of the parameter's averaged ``.grad`` (a whole parameter already has it), at stage 2 their
        part of the bucket's reduced share, where some rank had one. Returns the pieces given one here."""
        if self.stage == 1:
            views = [piece for piece in self._mine() if piece.tensor is not piece.param]
            for piece in views:
                grad = piece.param.grad
                piece.tensor.grad = None if grad is None else grad.view(-1)[piece.start:piece.end]
            return views
        self._refuse_stray_gradients()
        attached = []
        for bucket in self.buckets:
            pieces = bucket.by_rank[self.rank]
            if not (bucket.holds and pieces):
                continue
            column, elements = 0, sum(piece.end - piece.start for piece in pieces)
            for piece, had in zip(pieces, bucket.grad[elements:elements + len(pieces)].tolist()):
                length = piece.end - piece.start
                if had > 0:  # some rank's backward gave its parameter a gradient
                    piece.tensor.grad = bucket.grad[column:column + length].view(piece.tensor.shape)
                    attached.append(piece)
                column += length
        return attached

    def _refuse_stray_gradients(self) -> None:
        """Stage 2: a ``.grad`` on a parameter here did not come through the hooks: it would be ignored."""
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    raise RuntimeError(
                        f"ShardedOptimizer(stage=2): parameter {i} of param group {g} (shape {tuple(p.shape)}) has a "
                        ".grad: at stage 2 gradients reach the optimizer only through backward, whose hooks "
                        "reduce-scatter them (a .grad set by hand, or produced while the hooks were removed or the "
                        "parameter did not require a gradient when its group was added, is not reduced)")

    def _update(self, bucket: Bucket) -> None:
        """The local optimizer's step over this rank's pieces of ``bucket`` only.

        Its param groups are swapped for one holding just these tensors (with the group's
        options): the state is keyed by tensor, so each piece keeps its own, and element-wise
        updates are the same arithmetic as one step over everything."""
        mine = bucket.mine(self.rank)
        if not mine:
            return
        groups = self.local.param_groups
        self.local.param_groups = [{**groups[bucket.group], "params": mine}]
        try:
            self.local.step()
        finally:
            self.local.param_groups = groups

    def _launch(self, bucket: Bucket) -> None:
        """Start sharing the bucket's updated pieces: the all-gather of this rank's row of the bucket's buffer
        (asynchronous where the transport is), which is this rank's pieces, updated where they lie."""
        if bucket.buffer is None:  # nothing to share: one rank owns every piece
            return
        start = time.perf_counter()
        if self.update == "broadcast":
            _broadcast_rows(bucket.buffer.view(-1), bucket.buffer[self.rank], self.process_group)
        else:
            bucket.work = self.transport.all_gather(bucket.buffer.view(-1), bucket.buffer[self.rank], async_op=True)
        self._waited_s += time.perf_counter() - start  # an inline transport's whole all-gather is in here
        if bucket.work is None or bucket.work.is_completed():  # done already (inline transports): no wait
            self._unpack(bucket)

    def _unpack(self, bucket: Bucket) -> None:
        """Wait for the bucket's all-gather: it wrote the other ranks' pieces into the parameters (views of the
        buffer)."""
        start = time.perf_counter()
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        self._waited_s += time.perf_counter() - start

    def wait_for_parameters(self, through: int | None = None) -> None:
        """Wait until the updated parameters of buckets ``0..through`` (default: all) have arrived.

        Only needed with ``overlap_with_forward``, before reading a parameter in a way the
        hooks do not see (see there); a no-op when nothing is in flight. Raises the
        all-gather's error, or the transport's after the process group's timeout."""
        last = len(self.buckets) - 1 if through is None else through
        for bucket in self.buckets[:last + 1]:  # launched in this order: an earlier one is never later
            if bucket.work is not None:
                self._unpack(bucket)
        self._note_share_time()

    def _note_share_time(self) -> None:
        if all(bucket.work is None for bucket in self.buckets):
            self.last_share_s = self._waited_s  # every bucket of the last step is in

    # ------------------------------------------------------------------ stage 2: gradients to their owners

    def gradient_shares(self) -> list[torch.Tensor]:
        """Stage 2: the buffers holding this rank's reduced gradients, one per bucket (its pieces' averaged
        gradients, their used-flags, padding); empty at stage 1, where the gradients are the parameters'."""
        return [bucket.grad for bucket in self.buckets if bucket.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As any optimizer's; at stage 2 it also empties the reduced shares (either way: see the class)."""
        super().zero_grad(set_to_none)
        for bucket in self.buckets:
            bucket.holds = False

    def _on_gradient(self, param: torch.Tensor) -> None:
        """Backward finished ``param``'s gradient (its hook): kept by its bucket until the bucket is reduced, then
        freed. The first hook of a backward arranges for its end (``_end_of_backward``)."""
        if not self._in_backward:
            self._in_backward = True
            self.wait_for_parameters()  # a late all-gather would change the parameters backward reads
            Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self._bucket_of[id(param)]
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError("ShardedOptimizer(stage=2) does not take sparse gradients (nn.Embedding(sparse=True))")
        bucket.arrived[id(param)] = grad.reshape(-1)
        param.grad = None  # the bucket holds it now; after the reduce-scatter only this rank's share is kept
        if len(bucket.arrived) == len(bucket.params):
            self._launch_reductions(complete_only=True)

    def _reduce_order(self) -> list[Bucket]:
        """Last bucket first (backward produces the last parameters' gradients first); the same on every rank:
        the transports pair collectives up by call order."""
        return self.buckets[::-1]

    def _launch_reductions(self, complete_only: bool) -> None:
        """Launch the next buckets in ``_reduce_order``: those whose gradients are all in, or (at the end of
        backward) every one left."""
        order = self._reduce_order()
        while self._reduced < len(order):
            bucket = order[self._reduced]
            if complete_only and len(bucket.arrived) < len(bucket.params):
                return
            self._reduce(bucket)
            self._reduced += 1

    def _reduce(self, bucket: Bucket) -> None:
        """Start the bucket's reduce-scatter, chunk by chunk: columns [lo, hi) of its n rows (see ``Bucket``) into
        a slot of the pool, once the reduce-scatter that last used that slot is done; each chunk's sum goes into
        this rank's share, or beside it when the share already holds an earlier backward's gradients (added when
        waited for). Then the bucket's gradients are freed."""
        n, width, share = self.world_size, bucket.reduce_width, bucket.grad
        area = self._pool.view(POOL_SLOTS, -1).view(share.dtype)  # (slots, slot elements)
        accumulate = bucket.holds
        columns = area.size(1) // (n + accumulate)  # an output row beside the input only to add to the share
        for lo in range(0, width, columns):
            hi = min(lo + columns, width)
            slot = self._turn % POOL_SLOTS
            self._turn += 1
            self._finish_slot(slot)
            rows = area[slot, :n * (hi - lo)].view(n, hi - lo)
            for row in range(n):
                self._fill(bucket, row, lo, rows[row])
            out = area[slot, n * columns:n * columns + hi - lo] if accumulate else share[lo:hi]
            work = self.transport.reduce_scatter(out, rows.view(-1), "sum", async_op=True)
            self._pending[slot] = (work, out, share[lo:hi])
            if work.is_completed():  # an inline transport: done already
                self._finish_slot(slot)
        bucket.holds = True
        bucket.arrived = {}

    def _fill(self, bucket: Bucket, row: int, lo: int, out: torch.Tensor) -> None:
        """Columns [lo, lo + len(out)) of the bucket's row ``row``: its pieces' gradients divided by n (zeros for a
        parameter that had none), their used-flags, zero padding."""
        hi, arrived, column = lo + out.numel(), bucket.arrived, 0
        pieces = bucket.by_rank[row]
        for piece in pieces:
            a, b = max(lo, column), min(hi, column + piece.end - piece.start)
            if a < b:
                grad = arrived.get(id(piece.param))
                if grad is None:
                    out[a - lo:b - lo].zero_()
                else:  # divided before the sum, as DDP divides (see the note above ddp's engines)
                    first = piece.start + a - column
                    torch.div(grad[first:first + b - a], self._divisor(grad.dtype), out=out[a - lo:b - lo])
            column += piece.end - piece.start
        a, b = max(lo, column), min(hi, column + len(pieces))
        if a < b:
            out[a - lo:b - lo] = torch.tensor([float(id(piece.param) in arrived)
                                               for piece in pieces[a - column:b - column]], dtype=out.dtype)
        out[max(lo, column + len(pieces)) - lo:].zero_()

    def _divisor(self, dtype: torch.dtype) -> torch.Tensor:
        divisor = self._divisors.get(dtype)
        if divisor is None:
            divisor = self._divisors[dtype] = torch.tensor(float(self.world_size), dtype=dtype)
        return divisor

    def _finish_slot(self, slot: int) -> None:
        """Wait for the reduce-scatter that last used pool slot ``slot``; add its sum to the share if it went beside
        it (gradient accumulation: this backward's average added to the earlier ones')."""
        pending, self._pending[slot] = self._pending[slot], None
        if pending is None:
            return
        work, out, share = pending
        work.wait()
        if out.data_ptr() != share.data_ptr():
            share.add_(out)

    def _end_of_backward(self) -> None:
        """Launch the buckets still waiting (in order), wait for every reduce-scatter, reset for the next backward."""
        start = time.perf_counter()
        try:
            self._launch_reductions(complete_only=False)
            for slot in range(POOL_SLOTS):
                self._finish_slot(slot)
        finally:
            self._in_backward, self._reduced = False, 0
            for bucket in self.buckets:
                bucket.arrived = {}
        self.last_reduce_wait_s = time.perf_counter() - start

    # ------------------------------------------------------------------ overlap with the next forward

    def overlap_with_forward(self, module: nn.Module) -> None:
        """From now on ``step()`` returns before the parameters arrive; ``module``'s next forward waits for them.

        Hooks on ``module`` wait, so that nothing reads a parameter before its bucket's all-gather
        is done and the other ranks' pieces are copied into it:

        * a forward pre-hook on every submodule that owns one of this optimizer's parameters
          (in its own ``_parameters``) waits for the buckets up to the one holding them;
        * a forward hook on ``module`` waits for the rest (parameters no layer owns, unused
          layers), so nothing is in flight after the forward: backward, ``module.state_dict()``
          and every other read after a forward see the updated values;
        * ``state_dict`` and ``load_state_dict`` pre-hooks on every such submodule wait too
          (a load must not be overwritten by a late all-gather);
        * the optimizer's own ``step``, ``state_dict``, ``load_state_dict``,
          ``add_param_group`` and ``close`` wait first. ``zero_grad`` does not need to: it
          touches only ``.grad``, which the all-gathers never write.

        What a caller must do: call ``wait_for_parameters()`` before reading a parameter in
        any other way between ``step()`` and the next forward (``p.data``, ``torch.save(model)``,
        an evaluation on another module object sharing the parameters, a forward that reads
        a layer's weight without calling the layer first). Every rank must call this (it
        changes when collectives are waited for, not their order)."""
        self.wait_for_parameters()
        self._module = module
        self._install_hooks(module)

    def _install_hooks(self, module: nn.Module) -> None:
        self._remove_hooks()
        bucket_of = {id(p): bucket.index for bucket in self.buckets for p in bucket.params}
        ref = weakref.ref(self)
        for m in module.modules():
            owned = [bucket_of[id(p)] for p in m._parameters.values() if p is not None and id(p) in bucket_of]
            if owned:
                wait = _waiter(ref, max(owned))
                self._hooks += [m.register_forward_pre_hook(lambda *_, wait=wait: wait()),
                                m.register_state_dict_pre_hook(lambda *_, wait=wait: wait()),
                                m.register_load_state_dict_pre_hook(lambda *_, wait=wait: wait())]
        everything = _waiter(ref, None)
        self._hooks += [module.register_forward_hook(lambda *_: everything()),
                        module.register_state_dict_pre_hook(lambda *_: everything()),
                        module.register_load_state_dict_pre_hook(lambda *_: everything())]

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def close(self) -> None:
        """Wait for the parameters and remove the hooks (idempotent); the transport stays open."""
        self.wait_for_parameters()
        self._remove_hooks()
        self._module = None
        for handle in self._gradient_hooks:
            handle.remove()
        self._gradient_hooks = []

    # ------------------------------------------------------------------ checkpoints

    def _index(self) -> dict[torch.Tensor, int]:
        """Parameter -> its number in a plain optimizer's state dict (param-group order)."""
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _group_options(self) -> list[dict]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]

    def state_dict(self) -> dict:
        """The consolidated state (a collective): what ``optimizer_cls`` over every parameter would return."""
        self.wait_for_parameters()
        index, local = self._index(), self.local.state_dict()["state"]
        mine = [(index[piece.param], piece.start, piece.end, local[i])
                for i, piece in enumerate(self._mine()) if i in local]
        shares: list = [None] * self.world_size
        # a checkpoint, not the hot path: pickled is fine
        dist.all_gather_object(shares, mine, group=self.process_group)
        by_param: dict[int, list] = {}
        for i, start, end, state in sorted((entry for share in shares for entry in share), key=lambda e: e[:2]):
            by_param.setdefault(i, []).append((start, end, state))
        params = list(index)
        state = {i: _join(params[i], pieces) for i, pieces in sorted(by_param.items())}
        groups, start = [], 0
        for options, group in zip(self._group_options(), self.param_groups):
            groups.append({**options, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state dict (from ``state_dict()`` or a plain optimizer over the same parameters)."""
        self.wait_for_parameters()  # the load must not be overwritten by a late all-gather
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"the state dict's param groups have {[len(g['params']) for g in saved]} parameters, "
                             f"this optimizer's {[len(g['params']) for g in self.param_groups]}")
        for group, saved_group in zip(self.param_groups, saved):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        index, mine = self._index(), self._mine()
        states = {i: _cut(state_dict["state"][index[piece.param]], piece) for i, piece in enumerate(mine)
                  if index[piece.param] in state_dict["state"]}
        local_groups, start = [], 0
        for options, local in zip(self._group_options(), self.local.param_groups):
            local_groups.append({**options, "params": list(range(start, start + len(local["params"])))})
            start += len(local["params"])
        self.local.load_state_dict({"state": states, "param_groups": local_groups})
        self.state = self.local.state


PARTITIONS = ("flat", "tensor")
STAGES = (1, 2)
# Stage 2's reduce-scatter pool: two slots, so that one chunk is filled while the one before is summed; each
# 1/POOL_FRACTION of the trainable parameters' bytes by default (the pool: 1/16 of them beside the parameters),
# at least POOL_MIN_BYTES (fewer calls for a small model), each starting on a cache line.
POOL_SLOTS, POOL_FRACTION, POOL_MIN_BYTES, POOL_ALIGN = 2, 32, 64 * 2 ** 10, 64


def check_same_parameters(groups: list[dict], process_group=None, first_group: int = 0) -> None:
    """Raise ValueError on every rank of the group unless every rank's ``groups`` hold the same parameters:
    the same number, shapes, dtypes and values (a digest of each one's bytes, all-gathered once: a
    collective). The message names the first parameter that differs, in param-group order (group
    numbers from ``first_group``), and the ranks whose copy differs from group rank 0's."""
    mine = [(g, i, tuple(p.shape), str(p.dtype), _digest(p))
            for g, group in enumerate(groups, first_group) for i, p in enumerate(group["params"])]
    everyone: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, mine, group=process_group)  # construction, not the hot path: pickled is fine
    for index in range(max(len(entries) for entries in everyone)):
        column = [entries[index] if index < len(entries) else None for entries in everyone]
        if any(entry != column[0] for entry in column):
            g, i, shape, dtype, _ = next(entry for entry in column if entry is not None)
            ranks = [r for r, entry in enumerate(column) if entry != column[0]]
            raise ValueError(f"ShardedOptimizer(stage=2): the ranks' parameters differ, first parameter {i} of param "
                             f"group {g} (shape {shape}, {dtype}): group rank(s) {ranks} hold another one than rank 0 "
                             "(its values, shape or dtype, or no such parameter): every rank must build the same model "
                             "(one seed, or one checkpoint loaded) before the optimizer")


def _digest(p: torch.Tensor) -> str:
    """A digest of a tensor's bytes: equal on two ranks exactly when their values are bitwise equal (to a
    collision of a 128-bit hash)."""
    data = p.detach().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _gradient_hook(ref: weakref.ref) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook for stage 2; a weak reference: a parameter must not keep the optimizer alive."""
    def on_gradient(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._on_gradient(param)
    return on_gradient


def _elementwise(value: Any, numel: int) -> bool:
    """A state entry with one element per element of its piece (a moment), as opposed to a step count."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def _join(param: torch.Tensor, pieces: list[tuple[int, int, dict]]) -> dict:
    """One parameter's state from its pieces' (in order): element-wise entries concatenated in the
    parameter's shape, the rest (step counts, equal in every piece) taken from the first piece."""
    joined = {}
    for key, value in pieces[0][2].items():
        if all(_elementwise(state[key], end - start) for start, end, state in pieces):
            joined[key] = torch.cat([state[key].reshape(-1) for _, _, state in pieces]).view(param.shape)
        else:
            joined[key] = value
    return joined


def _cut(state: dict, piece: Piece) -> dict:
    """A parameter's state cut to one piece: element-wise entries sliced (and shaped like the piece)."""
    return {key: value.reshape(-1)[piece.start:piece.end].reshape(piece.tensor.shape).clone()
            if _elementwise(value, piece.param.numel()) else value for key, value in state.items()}


def partition(sizes: list[int], load: list[int]) -> list[int]:
    """The owner of each tensor: largest first, each to the rank owning the fewest elements (ties: lowest rank).

    ``load`` (elements per rank so far, one entry per rank) is updated, so groups added later
    balance against the earlier ones. Deterministic: every rank computes the same owners.
    """
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: equal sizes keep their order
        owners[i] = min(range(len(load)), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


def _param_groups(params: Iterable, known: Iterable[torch.Tensor] = ()) -> list[dict]:
    """Normalise ``params`` to a list of group dicts with ``params`` lists; refuse what would break later.

    Checked on every rank before any message, so a bad argument fails every rank at once
    instead of leaving its peers waiting: no parameters, a parameter twice (in one group or
    two), a non-tensor, parameters on different devices.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or dicts, got a single tensor: wrap it in a list")
    groups = list(params)
    if not groups:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen = {id(p) for p in known}
    devices = {p.device for p in known}
    out = []
    for group in groups:
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for p in tensors:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizers take tensors, got a {type(p).__name__}")
            if not p.is_contiguous():
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not contiguous: the optimizer updates "
                                 "flat views of its elements")
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} appears twice in the param groups: "
                                 "give each parameter (a tied one too) once")
            seen.add(id(p))
            devices.add(p.device)
        out.append({**group, "params": tensors})
    if not seen:
        raise ValueError("ShardedOptimizer got no parameters (every param group is empty)")
    if len(devices) > 1:
        raise ValueError(f"parameters on different devices {sorted(map(str, devices))}: "
                         "the shared update needs them on one device")
    return out


def _flat_pieces(params: list[torch.Tensor], world_size: int) -> list[Piece]:
    """``params`` (one dtype) flattened back to back and cut into ``world_size`` ranges of ceil(N / n)
    elements, the last ones shorter (so rows of that width, back to back, are the parameters back to back,
    padded at the end only): each parameter's piece in each range it crosses, in order."""
    total = sum(p.numel() for p in params)
    width = -(-total // world_size)
    edges = [min(r * width, total) for r in range(world_size + 1)]
    pieces, offset = [], 0
    for p in params:
        for owner in range(world_size):
            start, end = max(edges[owner], offset), min(edges[owner + 1], offset + p.numel())
            if start < end:
                view = p.detach().view(-1)[start - offset:end - offset]  # shares p's storage
                pieces.append(Piece(p, start - offset, end - offset, owner, view))
        offset += p.numel()
    return pieces


def _broadcast_rows(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """The all-gather's contract (``input`` is row r of ``output`` viewed (n, -1)) as one broadcast per owner."""
    rows = output.view(dist.get_world_size(group), -1)
    for owner in range(rows.size(0)):
        dist.broadcast(rows[owner], group=group, group_src=owner)


def _waiter(ref: weakref.ref, through: int | None) -> Callable[[], None]:
    """A hook body: wait for the buckets up to ``through`` (None: all) of the optimizer ``ref`` points to.
    A weak reference: the module's hooks must not keep the optimizer (and its buffers) alive."""
    def wait() -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer.wait_for_parameters(through)
    return wait
