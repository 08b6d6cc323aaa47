"""Fully sharded data parallelism (ZeRO stage 3): each rank keeps 1/n of the parameters of the big layers.

Not a script; import it inside an initialised process group (``process_groups.distributed``)::

    from dpkit.engines.fsdp import FSDP
    model = FSDP(net, compute_dtype=torch.bfloat16)   # rank 0's weights, sharded 1/n per rank
    model = FSDP(net, shard="host")                    # or: sharded over each host's ranks, replicated across hosts
    optimizer = torch.optim.AdamW(model.parameters())  # local shards and replicated parameters
    for x, y in loader:
        loss_fn(model(x), y).backward()                # gathers before each layer, reduce-scatters after;
        optimizer.step()                               # at its end every .grad is the average over ranks
        optimizer.zero_grad()

The idea: a layer's parameters exist in full only while the layer runs. Every submodule
whose class is in ``shard_types`` (a *unit*) keeps its trainable parameters as one flat,
padded float32 shard of 1/n of their elements per rank. Just before the unit's forward
the shards are all-gathered into the full flat tensor (in ``compute_dtype``), the layer
runs on views of it, and the full tensor is freed. Backward gathers it again where
autograd needs the weights, and once the unit's gradient is complete it is reduce-scattered
(averaged) into this rank's shard of the gradient. Every other parameter is replicated and
its gradient all-reduced, exactly as in ``ddp.DDP``. Both collectives go through the
``transport``, which also allocates their buffers: on one host the gathered tensor and the
flat gradient lie in shared memory, where the peers read them.
"""

from __future__ import annotations

import bisect
import time
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dpkit.comm import transport as comm_transport
from dpkit.comm.comm_thread import group_timeout
from dpkit.comm.hierarchical import Plan, host_subgroups
from dpkit.comm.hosts import host_indices, ranks_by_host
from dpkit.comm.process_groups import DEFAULT_TIMEOUT_S
from dpkit.engines.ddp import DDP, broadcast_module_state, check_same_model

DEFAULT_SHARD_TYPES = (nn.Linear, nn.Embedding)
COMPUTE_DTYPES = (None, torch.float16, torch.bfloat16)
# Over which ranks a unit is sharded: every rank of the process group, or the group's ranks on this rank's
# host (hybrid sharding, HSDP: each host holds the whole model, its gradients averaged across the hosts).
SHARD_SCOPES = ("group", "host")


# --------------------------------------------------------------------------- the flat units


@dataclass(eq=False)
class Unit:
    """The trainable parameters of one ``shard_types`` submodule (one dtype), flattened and sharded.

    The full flat tensor is (padded,) = the parameters back to back in registration order
    (``numel`` elements), then ``padded - numel`` zeros so that every rank holds an equal
    ``padded // world`` elements: rank r's shard is ``full[r * s:(r + 1) * s]``.
    ``slots`` are the (module, attribute) places a parameter was registered in; a tied
    parameter has several, possibly in other units' modules, and belongs to the first unit
    that registers it. Read-only for users; tests and the benchmark inspect it.
    """

    index: int
    name: str                 # the owning module's qualified name ("" for the root)
    names: list[str]          # each parameter's qualified name in the wrapped module
    shapes: list[torch.Size]
    offsets: list[int]        # each parameter's first element in the full flat tensor
    slots: list[list[tuple[nn.Module, str]]]
    numel: int
    padded: int
    shard: nn.Parameter       # (padded // world,) master dtype: what the optimizer updates on this rank
    full: torch.Tensor | None = None        # (padded,) compute dtype, while gathered
    work: comm_transport.Work | None = None     # a gather on its way into ``full``
    views: list[torch.Tensor] = field(default_factory=list)
    gathers: int = 0          # gathers made in this forward that autograd recorded, not yet through backward

    @property
    def master_dtype(self) -> torch.dtype:
        return self.shard.dtype


@dataclass(frozen=True)
class _Saved:
    """What autograd keeps instead of a tensor that lives in a gathered unit: where to find it again."""

    unit: Unit
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    calls: list               # the forward's unit-module calls, for the backward prefetch
    saving: list              # indices of the calls that saved a gathered tensor (filled during the forward)
    call: int                 # which call saved it


@dataclass(eq=False)
class _Reduction:
    """A unit's reduce-scatter: ``out`` becomes this rank's averaged shard of its gradient. ``source``, the flat
    gradient, is kept until ``work`` is done: a transport may read it after ``reduce_scatter`` returned.
    With ``shard="host"`` the reduce-scatter averages over the host; ``across`` then averages ``out`` over
    the ranks that hold the same shard on the other hosts (an all-reduce, started once ``work`` is done)."""

    unit: Unit
    out: torch.Tensor                        # (padded // shard world,) master dtype
    source: torch.Tensor | None              # (padded,) master dtype, until done
    work: comm_transport.Work | None
    across: comm_transport.Transport | None = None
    crossing: comm_transport.Work | None = None  # the all-reduce across hosts on its way

    def wait(self) -> None:
        """The reduce-scatter is done (and the all-reduce across hosts, if any, started)."""
        if self.work is not None:
            self.work.wait()
            self.work = self.source = None  # the flat gradient can go
            if self.across is not None:
                self.crossing = self.across.all_reduce(self.out, "avg", async_op=True)

    def result(self) -> torch.Tensor:
        """``out`` once everything is done: the shard's gradient averaged over every rank of the group."""
        self.wait()
        if self.crossing is not None:
            self.crossing.wait()
            self.crossing = None
        return self.out


@dataclass(frozen=True)
class _Outer:
    """A tensor packed by the saved-tensor hooks that enclosed FSDP's forward, and their unpack."""

    unpack: object
    packed: object


class _Gathered(torch.autograd.Function):
    """shard (s,) -> the unit's parameters, views of the gathered full flat tensor (padded,): its
    backward reduce-scatters their gradients.

    The gather itself happened before (possibly prefetched, in flight on an asynchronous transport);
    this function only ties the parameter views into the autograd graph so that, once every
    use of the unit's parameters has added its gradient, one backward call receives each
    parameter's gradient (None for one nothing used). It hands them to ``FSDP._reduce``
    (asynchronous) and returns no gradient for the shard: the averaged shard gradient is
    added to ``shard.grad`` in ``finish_gradient_synchronization``, when backward ends.

    One output per parameter, not one flat output sliced afterwards: autograd's gradient of
    a slice is a zero-filled tensor of the whole flat size, so a unit of k parameters cost k
    full-size temporaries and their sum (then a float32 copy of it, for a compute dtype);
    ``_reduce`` writes the k gradients into one full-size master-dtype tensor instead.
    """

    @staticmethod
    def forward(ctx, shard, full, fsdp, index):
        # Weak, and the unit by index: the unit keeps the views (and so this node) until backward, and a
        # reference back from the node would be a cycle through C++ that Python's gc cannot free.
        ctx.fsdp, ctx.index = weakref.ref(fsdp), index
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, not a tensor of zeros
        return _views(full, fsdp.units[index])

    @staticmethod
    def backward(ctx, *grads):
        fsdp = ctx.fsdp()
        if fsdp is None:
            raise RuntimeError("FSDP: the wrapper was freed before backward reached its sharded layers: keep it "
                               "alive until backward")
        fsdp._reduce(fsdp.units[ctx.index], grads)
        return None, None, None, None


# --------------------------------------------------------------------------- FSDP


class FSDP(nn.Module):
    """Fully sharded data parallelism: all-gathers and reduce-scatters through a ``transport``.

    ``FSDP(module, compute_dtype=None, shard_types=(nn.Linear, nn.Embedding),
    reshard_after_forward=True, process_group=None, transport="auto", shard="group")``

    * Construction: every rank must wrap an identical model (same parameter names, shapes,
      dtypes; checked with one all_gather_object, raising on every rank with the first
      parameter that differs), on one device. Rank 0's parameters and buffers are
      broadcast, then each outermost submodule whose class is in ``shard_types`` becomes a
      ``Unit``: its trainable parameters are flattened, padded to a multiple of the world
      size, and this rank keeps its 1/n slice as a float32 (master dtype) ``nn.Parameter``.
      The originals are removed from the module, so ``.module.named_parameters()`` lists
      only the replicated ones; outside forward a sharded layer has no ``weight``
      attribute (use ``full_parameters()``). Frozen parameters stay replicated.
    * ``parameters()`` / ``named_parameters()``: this rank's shards (named ``flat.<i>_<module>``)
      and the replicated parameters (``module.<name>``): give them to any ``torch.optim``
      optimizer; its state is then 1/n for the sharded part.
    * Forward: before a unit's forward its full flat tensor is all-gathered in
      ``compute_dtype`` (None: the master dtype) and its parameters become views of it;
      floating inputs are cast to ``compute_dtype`` and floating outputs back to the
      master dtype. After the unit's forward the full tensor is freed
      (``reshard_after_forward=True``) or kept until its backward (False: more memory, one
      gather per step less, like ZeRO stage 2). The next unit's gather is prefetched, in
      the order of the previous forward.
    * Backward: tensors autograd saved from a freed unit are recorded as (unit, offset,
      shape) and gathered again when backward unpacks them, prefetching the previous call
      that saved weights too. When the unit's whole gradient is known, its parameters'
      gradients are copied into one flat master-dtype (float32) tensor, the only full-size
      one, and reduce-scattered (mean over ranks) through the transport while backward goes
      on (at most one in flight). Replicated parameters are handled by an internal
      ``ddp.DDP`` (bucketed all-reduces, averaged).
    * ``finish_gradient_synchronization()``, run by autograd when each backward ends (a
      callback the first reduce-scatter or replicated gradient of that backward queues, as
      ``fully_shard`` does; calling it afterwards does nothing): waits for everything; then each
      shard's ``.grad`` is the master-dtype average over ranks of its slice of the gradient (added
      to what was there: gradients accumulate as usual) and each replicated parameter's
      ``.grad`` is its average. A unit that no forward used this step keeps ``grad=None``
      on every rank (the optimizer skips it, as in one process). So a loop written for
      ``fully_shard`` (forward, ``backward()``, ``step``) runs unchanged.
    * ``no_sync()``: skips the replicated all-reduces (``ddp.DDP.no_sync``); sharded
      gradients are still reduce-scattered every backward (keeping them unsharded is what
      FSDP avoids); summing averaged shards gives the average of the sums.
    * ``full_parameters()``: ``{name: full master-dtype tensor}`` on every rank, names as in the
      wrapped module's ``named_parameters()`` before wrapping; ``full_state_dict()`` /
      ``load_full_state_dict()``: the plain module's ``state_dict`` keys and values.

    Tied parameters work: a parameter registered in two units' modules (GPT's head and
    embedding) belongs to the first; the second gathers that unit too, and each gather
    that autograd recorded reduce-scatters its own gradient into the same shard. With
    ``reshard_after_forward=False`` a unit used several times in one forward is gathered
    once: autograd adds its uses' gradients (in ``compute_dtype``) and one reduce-scatter
    follows; with True each use has its own gather and reduce-scatter (in float32).

    Communication goes through ``transport`` (``transport.resolve``; "auto": this host's shared
    memory when every rank is on it, else PyTorch's collectives), issued in the same order on
    every rank; asynchronous where the transport is (NCCL; ``SharedMemory(background=True)``),
    so that the next unit's gather is prefetched while this one computes.

    Hybrid sharding (HSDP), ``shard="host"``: the units are sharded over the group's ranks on
    this rank's host only (``hosts.host_indices``; ``DPKIT_HOSTS`` simulates hosts), so that
    parameters are gathered inside the host and never cross hosts. Each unit's gradient is
    reduce-scattered (averaged) inside the host, then this rank's shard is all-reduced
    (averaged) among the ranks that hold the same shard on the other hosts: the mean over the
    whole group, and the shards of every host stay equal. Replicated parameters are all-reduced
    over the whole group as above; ``full_parameters()`` gathers inside the host. FSDP makes
    the subgroups (``hierarchical.host_subgroups``: the group may be any subset of the world)
    and one transport per subgroup and one over the group, each from ``transport``, which is
    here a name or a factory ``f(group) -> Transport`` (not a Transport: it would be over one
    group only). Every host must hold the same number of the group's ranks (else ValueError
    on every rank, naming the layout). With one rank per host nothing is sharded: every rank
    keeps the whole model and all-reduces its gradients, which is DDP across hosts; group rank
    0 warns so (``ddp.DDP`` does it in fewer, bucketed messages). With one host it is plain FSDP.

    Warnings:
        * Every rank must call forward (also in eval and under ``torch.no_grad()``) and
          backward the same way: gathers are collectives.
        * Wrap after moving the module to its device; don't move the wrapper afterwards.
        * No nested FSDP, no double backward, no sparse gradients, no activation
          checkpointing inside a sharded layer.
        * A forward hook registered on a sharded layer after wrapping sees its weights only
          with ``prepend=True`` (FSDP's own post-forward hook frees them).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 shard_types: tuple[type, ...] = DEFAULT_SHARD_TYPES, reshard_after_forward: bool = True,
                 process_group=None, *, transport="auto", shard: str = "group"):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised process group (process_groups.distributed)")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of None, torch.float16, torch.bfloat16; got {compute_dtype}")
        shard_types = tuple(shard_types)
        if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in shard_types):
            raise TypeError(f"shard_types must be nn.Module subclasses, got {shard_types}")
        if shard not in SHARD_SCOPES:
            raise ValueError(f"shard must be 'group' (over every rank of the process group) or 'host' (over the "
                             f"ranks of each host, replicated across hosts); got {shard!r}")
        self.compute_dtype = compute_dtype
        self.shard_types = shard_types
        self.reshard_after_forward = reshard_after_forward
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # One collective: every rank raises the same error for a local problem or differing models.
        check_same_model(module, process_group, local_problem=_local_problem(module), wrapper="FSDP")
        # Also a collective that raises on every rank (ranks asking for different transports): before any data moves.
        device = next(module.parameters()).device
        self.transport = comm_transport.resolve(_made(transport, process_group) if shard == "host" else transport,
                                            process_group, device, engine="FSDP")
        # The units are sharded over ``shard_group``'s ranks through ``shard_transport``; ``across`` (None unless
        # hybrid over several hosts) averages each gradient shard among the hosts.
        self.shard = shard
        self.shard_group, self.shard_transport, self.across, self._subgroups = process_group, self.transport, None, []
        if shard == "host":
            self._split_by_host(transport, device)
        self.shard_rank, self.shard_world = dist.get_rank(self.shard_group), dist.get_world_size(self.shard_group)
        broadcast_module_state(module, process_group)

        self.module = module
        # Every parameter and state_dict key of the plain module, before sharding changes it.
        self._param_names = [n for n, _ in module.named_parameters()]
        self._state_keys = list(module.state_dict(keep_vars=True).keys())
        self._key_to_name = _key_to_param_name(module)
        self.units = self._make_units(module)
        self.flat = nn.ParameterDict({f"{u.index}_{u.name.replace('.', '_') or 'root'}": u.shard for u in self.units})
        self._unit_of_name = {n: (u, i) for u in self.units for i, n in enumerate(u.names)}
        self._units_of_module = self._module_units(module)
        if not self.units and self.rank == 0:
            warnings.warn(f"FSDP: no submodule of {type(module).__name__} is one of shard_types "
                          f"({', '.join(t.__name__ for t in shard_types)}): nothing is sharded, this is plain "
                          "data parallelism (ddp.DDP)", stacklevel=2)
        # The replicated parameters (those still registered) get DDP's bucketed, averaged all-reduce.
        # Stored outside the module tree so parameters() does not list them twice.
        # Its finish is ours, in one end-of-backward callback: the ranks then wait for their reduce-scatters
        # and launch its last buckets in the same order, whichever gradient a backward produced first.
        self.__dict__["_replicated"] = DDP(module, process_group=process_group, transport=self.transport,
                                           finish_in_backward=False)
        self._storage_to_unit: dict[int, Unit] = {}
        self._reductions: list[_Reduction] = []
        self._calls: list[nn.Module] = []        # unit modules in the order the current forward called them
        self._saving_calls: list[int] = []       # which of them saved a gathered tensor for backward
        self._previous_calls: list[nn.Module] = []
        self._in_forward = False
        self._outer_hooks = None
        self._no_grad_forward = False
        self._armed = False     # an end-of-backward callback is queued (cleared when it runs)
        self._finished = False  # synchronised; cleared by a forward with gradients or a gradient
        self.last_wait_s = 0.0
        self_ref = weakref.ref(self)
        self._hook_handles = [p.register_post_accumulate_grad_hook(_replicated_hook(self_ref))
                              for p in module.parameters() if p.requires_grad]  # the replicated ones, now
        for m in self._units_of_module:
            self._hook_handles.append(m.register_forward_pre_hook(_pre_hook(self_ref), with_kwargs=True))
            self._hook_handles.append(m.register_forward_hook(_post_hook(self_ref)))

    # ---- construction

    def _split_by_host(self, spec, device: torch.device) -> None:
        """``shard="host"``: this rank's host becomes the shard group and, over several hosts, the ranks that
        hold the same shard on each host the ``across`` group, each with its transport from ``spec``.
        Collectives over the group; a layout that cannot be split raises the same error on every rank."""
        if isinstance(spec, comm_transport.Transport):  # on every rank alike: resolve compared the ranks' choices
            raise TypeError(f"FSDP(shard='host'): give transport as a name or a factory(group) -> Transport, not "
                            f"{spec!r}: FSDP makes one over each host and one among the hosts")
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        plan = Plan(ranks_by_host(host_indices(group)), dist.get_process_group_ranks(group))
        hosts = [[plan.global_ranks[r] for r in members] for members in plan.hosts]
        _check_even_hosts(hosts)
        if len(hosts) == 1:
            return  # one host: sharded over the whole group, plain FSDP
        if len(hosts[0]) == 1 and self.rank == 0:
            warnings.warn(f"FSDP(shard='host'): each of the {len(hosts)} hosts holds one rank of the group, so "
                          "nothing is sharded: every rank keeps the whole model and all-reduces its gradients "
                          "across the hosts, which is DDP across hosts (ddp.DDP does it in fewer, bucketed "
                          "messages; shard='group' shards over the hosts)", stacklevel=3)
        me = dist.get_rank(group)
        # Even hosts: slot i is served by local rank i of every host, the holders of shard i.
        made = host_subgroups(plan, group, group_timeout(group, device) or DEFAULT_TIMEOUT_S)
        self._subgroups = [g for g in made if g is not None]
        self.shard_group, across = made[plan.host_of[me]], made[len(hosts) + plan.local_of[me]]
        self.shard_transport = comm_transport.resolve(_made(spec, self.shard_group), self.shard_group, device,
                                                  engine="FSDP")
        self.across = comm_transport.resolve(_made(spec, across), across, device, engine="FSDP")

    def _make_units(self, module: nn.Module) -> list[Unit]:
        """One unit per (outermost ``shard_types`` submodule, dtype), in registration order."""
        slots_of: dict[int, list[tuple[nn.Module, str]]] = {}
        for m in module.modules():
            for attr, p in m._parameters.items():
                if p is not None:
                    slots_of.setdefault(id(p), []).append((m, attr))
        inside_units = {id(sub) for _, m in _outermost(module, self.shard_types) for sub in m.modules()}
        # A parameter also registered outside every unit module (tied to a replicated layer) stays replicated.
        owned = {pid for pid, slots in slots_of.items() if any(id(m) not in inside_units for m, _ in slots)}
        units = []
        for prefix, m in _outermost(module, self.shard_types):
            by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
            for name, p in m.named_parameters(prefix=prefix):
                if p.requires_grad and id(p) not in owned:
                    owned.add(id(p))
                    by_dtype.setdefault(p.dtype, []).append((name, p))
            for params in by_dtype.values():
                units.append(self._make_unit(len(units), prefix, params, [slots_of[id(p)] for _, p in params]))
        for unit in units:  # only now: removing earlier would hide tied parameters from later units
            for slots in unit.slots:
                for m, attr in slots:
                    del m._parameters[attr]
        return units

    def _make_unit(self, index: int, prefix: str, params: list[tuple[str, nn.Parameter]], slots) -> Unit:
        offsets, numel = [], 0
        for _, p in params:
            offsets.append(numel)
            numel += p.numel()
        per_rank = -(-numel // self.shard_world)  # ceil: every rank the same shard size
        padded = per_rank * self.shard_world
        first = params[0][1]
        full = torch.zeros(padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for (_, p), offset in zip(params, offsets):
                full[offset:offset + p.numel()].copy_(p.reshape(-1))
        shard = nn.Parameter(full[self.shard_rank * per_rank:(self.shard_rank + 1) * per_rank].clone())
        return Unit(index, prefix, [n for n, _ in params], [p.shape for _, p in params], offsets, slots, numel,
                    padded, shard)

    def _module_units(self, module: nn.Module) -> dict[nn.Module, list[Unit]]:
        """For each unit module, every unit whose parameters it uses (its own and tied ones)."""
        needs: dict[nn.Module, list[Unit]] = {}
        for prefix, m in _outermost(module, self.shard_types):
            inside = {id(sub) for sub in m.modules()}
            needs[m] = [u for u in self.units if any(id(s) in inside for slots in u.slots for s, _ in slots)]
        return {m: units for m, units in needs.items() if units}

    # ---- forward

    def forward(self, *args, **kwargs):
        grad = torch.is_grad_enabled()
        if grad and self._armed:
            raise RuntimeError("FSDP: a forward with gradients enabled while the last backward's gradients are still "
                               "being reduced: that backward did not reach its end (it raised). Call "
                               "finish_gradient_synchronization() on every rank first.")
        self._finished = self._finished and not grad
        self._release_all()  # gathers kept from an earlier forward may be stale (the optimizer stepped)
        self._no_grad_forward = not grad
        self._calls, self._saving_calls = [], []
        # An enclosing saved-tensor hook pair (activation offloading, a measurement) would be shadowed
        # by ours: ours hands it every tensor that is not a view of a gathered unit.
        self._outer_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        hooks = (torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                 if grad and self.reshard_after_forward else nullcontext())
        self._in_forward = True
        try:
            with hooks:
                out = self.module(*args, **kwargs)
        finally:
            self._in_forward = False
            self._previous_calls = self._calls
        if not grad:
            self._release_all()  # no backward will come: nothing to keep
        return out

    def _before_unit(self, m: nn.Module, args, kwargs):
        """Gather (or wait for the prefetch of) every unit ``m`` uses, set the views, prefetch the next."""
        call = len(self._calls)
        self._calls.append(m)
        units = self._units_of_module[m]
        for unit in units:
            self._gather(unit)
        if call + 1 < len(self._previous_calls) and self._previous_calls[call] is m:
            for unit in self._units_of_module[self._previous_calls[call + 1]]:
                self._gather(unit)
        for unit in units:
            self._materialize(unit)
        if self.compute_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.compute_dtype)
        return args, kwargs

    def _after_unit(self, m: nn.Module, output):
        if self.reshard_after_forward:
            for unit in self._units_of_module[m]:
                self._release(unit)
        if self.compute_dtype is not None:
            output = _cast_floating(output, self._units_of_module[m][0].master_dtype)
        return output

    def _materialize(self, unit: Unit) -> None:
        """Wait for the unit's gather; put views of the full tensor (autograd-tracked) into its slots."""
        if unit.views:
            return
        full = self._wait(unit)
        if torch.is_grad_enabled():
            unit.views = list(_Gathered.apply(unit.shard, full, self, unit.index))
            unit.gathers += 1
        else:
            unit.views = list(_views(full, unit))
        for slots, view in zip(unit.slots, unit.views):
            for m, attr in slots:
                m.__dict__[attr] = view

    # ---- gathering and freeing

    def _gather(self, unit: Unit) -> None:
        """Start gathering the unit's full tensor unless it is gathered or on its way.

        The shard is cast (``compute_dtype`` halves the bytes sent) straight into its own chunk of the
        transport's buffer, and the all-gather runs in place: the peers read that chunk where it lies."""
        if unit.full is not None or unit.work is not None:
            return
        shard = unit.shard.detach()
        full = self.shard_transport.allocate((unit.padded,), dtype=self.compute_dtype or shard.dtype,
                                             device=shard.device)
        own = full[self.shard_rank * shard.numel():(self.shard_rank + 1) * shard.numel()]
        own.copy_(shard)
        unit.work = self.shard_transport.all_gather(full, own, async_op=True)
        unit.full = full
        self._storage_to_unit[full.untyped_storage().data_ptr()] = unit

    def _wait(self, unit: Unit) -> torch.Tensor:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        return unit.full

    def _release(self, unit: Unit) -> None:
        """Drop every reference to the unit's full tensor; autograd keeps none (see ``_pack``)."""
        if unit.full is None:
            return
        self._wait(unit)
        self._storage_to_unit.pop(unit.full.untyped_storage().data_ptr(), None)
        unit.full, unit.views = None, []
        for slots in unit.slots:
            for m, attr in slots:
                m.__dict__.pop(attr, None)

    def _release_all(self) -> None:
        for unit in self.units:
            self._release(unit)

    # ---- backward

    def _pack(self, tensor: torch.Tensor):
        """Saved-tensor hook: a view of a gathered unit is saved as where to find it, not as memory.

        Any other tensor is kept detached (autograd reattaches it when unpacking): an output that its own
        node saves would otherwise hold that node, a cycle through C++ that keeps the graph (and this
        wrapper, whose ``_unpack`` it holds) alive for good when no backward comes (pytorch/pytorch#115255)."""
        tensor = tensor.detach()
        unit = self._storage_to_unit.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
        if unit is None or tensor.dtype != unit.full.dtype:
            return tensor if self._outer_hooks is None else _Outer(self._outer_hooks[1], self._outer_hooks[0](tensor))
        call = len(self._calls) - 1
        if not self._saving_calls or self._saving_calls[-1] != call:
            self._saving_calls.append(call)
        return _Saved(unit, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), self._calls,
                      self._saving_calls, call)

    def _unpack(self, saved):
        if isinstance(saved, _Outer):
            return saved.unpack(saved.packed)
        if not isinstance(saved, _Saved):
            return saved
        self._gather(saved.unit)
        # Prefetch for the next call backward reaches that saved weights: not simply the call before, which
        # may need none (an embedding's backward needs only the indices) and would be gathered for nothing.
        earlier = bisect.bisect_left(saved.saving, saved.call)
        if earlier:
            for unit in self._units_of_module[saved.calls[saved.saving[earlier - 1]]]:
                self._gather(unit)
        full = self._wait(saved.unit)
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def _reduce(self, unit: Unit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """A unit's gradient is complete (``_Gathered.backward``: one per parameter, in compute dtype, None
        where unused): flattened into one master-dtype tensor and reduce-scattered, asynchronously.

        At most one reduce-scatter is in flight: the previous one is waited for (it had this unit's backward
        to run in) before this unit's flat gradient is made, so one full-size gradient exists at a time."""
        if torch.is_grad_enabled():
            raise RuntimeError("FSDP does not support backward(create_graph=True) (double backward)")
        self._arm()
        if self._reductions:
            self._reductions[-1].wait()
        source = _flat_gradient(unit, grads, self.shard_transport)
        out = torch.empty(unit.padded // self.shard_world, dtype=unit.master_dtype, device=source.device)
        work = self.shard_transport.reduce_scatter(out, source, "avg", async_op=True)
        self._reductions.append(_Reduction(unit, out, source, work, self.across))
        unit.gathers -= 1
        if self.reshard_after_forward or unit.gathers == 0:
            self._release(unit)

    @contextmanager
    def no_sync(self):
        """Skip the replicated parameters' all-reduce for the backward passes inside (see the class docstring)."""
        with self._replicated.no_sync():
            yield

    def _arm(self) -> None:
        """In a backward (a hook's or a node's): have autograd call the finish once it is done."""
        self._finished = False
        if not self._armed:
            self._armed = True
            Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter and all-reduce; add the averaged shard gradients to ``.grad``.

        Autograd calls it when each backward ends; afterwards it does nothing until the next forward
        with gradients. Records ``last_wait_s``, the seconds it took (communication left exposed
        after backward).
        """
        if self._finished:
            return
        self._armed = False
        if self._no_grad_forward and not self._reductions and self.units:
            raise RuntimeError("FSDP: the last forward ran under torch.no_grad() (or with gradients disabled), so "
                               "no sharded parameter can receive a gradient: run the training forward with "
                               "gradients enabled")
        start = time.perf_counter()
        with torch.no_grad():
            for reduction in self._reductions:
                reduction.wait()  # every all-reduce across hosts on its way before the first is waited for
            for reduction in self._reductions:
                unit = reduction.unit
                if unit.shard.grad is None:
                    unit.shard.grad = reduction.result()
                else:
                    unit.shard.grad += reduction.result()
            self._reductions = []
            self._replicated.finish_gradient_synchronization()
        self._release_all()
        for unit in self.units:
            unit.gathers = 0
        self._finished = True
        self.last_wait_s = time.perf_counter() - start

    # ---- full views for checkpoints and tests

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """``{name: full master-dtype tensor}`` on every rank (a collective), in ``named_parameters()`` order of
        the module before wrapping; a tied parameter appears once, under its first name."""
        fulls = {}
        for unit in self.units:
            full = torch.empty(unit.padded, dtype=unit.master_dtype, device=unit.shard.device)
            self.shard_transport.all_gather(full, unit.shard.detach())  # inside the host with shard="host"
            fulls[unit.index] = full
        replicated = dict(self.module.named_parameters())
        out = {}
        for name in self._param_names:
            if name in self._unit_of_name:
                unit, i = self._unit_of_name[name]
                out[name] = fulls[unit.index][unit.offsets[i]:unit.offsets[i] + unit.shapes[i].numel()].view(
                    unit.shapes[i]).clone()
            else:
                out[name] = replicated[name].detach().clone()
        return out

    @property
    def replicated_buckets(self) -> tuple:
        """The gradient buckets (``ddp.Bucket``, read-only view) of the replicated parameters, which a
        ``ddp.DDP`` inside this FSDP averages: what it keeps between steps beside the shards."""
        return tuple(self._replicated.buckets)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unwrapped module's ``state_dict()`` (same keys, full tensors) on every rank (a collective)."""
        params = self.full_parameters()
        buffers = self.module.state_dict()
        return {k: params[self._key_to_name[k]] if k in self._key_to_name else buffers[k].clone()
                for k in self._state_keys}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a plain module's ``state_dict`` (e.g. ``full_state_dict()``'s) on every rank: each takes its shards."""
        missing, unexpected = set(self._state_keys) - state.keys(), state.keys() - set(self._state_keys)
        if missing or unexpected:
            raise KeyError(f"load_full_state_dict: missing keys {sorted(missing)}, "
                           f"unexpected keys {sorted(unexpected)}")
        self._release_all()
        replicated = dict(self.module.named_parameters())
        for key in self._state_keys:
            name = self._key_to_name.get(key)
            if name in self._unit_of_name:
                unit, i = self._unit_of_name[name]
                per_rank = unit.padded // self.shard_world
                lo, hi = self.shard_rank * per_rank, (self.shard_rank + 1) * per_rank
                start, stop = unit.offsets[i], unit.offsets[i] + unit.shapes[i].numel()
                a, b = max(lo, start), min(hi, stop)  # the part of this parameter in this rank's shard
                if a < b:
                    unit.shard[a - lo:b - lo].copy_(state[key].reshape(-1)[a - start:b - start])
            elif name is not None:
                replicated[name].copy_(state[key])
        buffers = dict(self.module.named_buffers())
        for key in self._state_keys:
            if key not in self._key_to_name and key in buffers:
                buffers[key].copy_(state[key])

    def close(self) -> None:
        """Remove the hooks; with ``shard="host"`` also close the subgroups' transports and destroy the subgroups
        (the wrapper is unusable afterwards)."""
        for handle in self._hook_handles:
            handle.remove()
        self._replicated.remove_hooks()
        if self._subgroups:
            self.shard_transport.close()
            self.across.close()
            if dist.is_initialized():
                for group in self._subgroups:
                    dist.destroy_process_group(group)
            self._subgroups = []


# --------------------------------------------------------------------------- helpers


def _made(spec, group):
    """``spec(group)`` for a transport factory (a class such as ``transport.Torch`` included); else ``spec``."""
    return spec(group) if callable(spec) and not isinstance(spec, (str, comm_transport.Transport)) else spec


def _check_even_hosts(hosts: list[list[int]]) -> None:
    """ValueError unless every host holds as many of the group's ranks (``hosts``: global ranks per host)."""
    if len({len(members) for members in hosts}) > 1:
        layout = "; ".join(f"host {h}: ranks {members}" for h, members in enumerate(hosts))
        raise ValueError(f"FSDP(shard='host'): the group's hosts hold different numbers of its ranks "
                         f"({'+'.join(str(len(m)) for m in hosts)}: {layout}); each gradient shard is all-reduced "
                         "among the ranks that hold it on every host, so every host needs as many ranks: use "
                         "shard='group', or a process group with as many ranks on each host")


def _replicated_hook(ref: weakref.ref):
    """A replicated parameter's post-accumulate-grad hook: a backward that reaches only those ends with a finish too."""
    def hook(param):
        fsdp = ref()
        if fsdp is not None:
            fsdp._arm()
    return hook


def _pre_hook(ref: weakref.ref):
    def hook(module, args, kwargs):
        fsdp = ref()
        if fsdp is None or not fsdp._in_forward:
            raise RuntimeError(f"FSDP: a sharded {type(module).__name__} was called outside the FSDP wrapper's "
                               "forward; call the wrapper (its parameters exist only inside its forward)")
        return fsdp._before_unit(module, args, kwargs)

    return hook


def _post_hook(ref: weakref.ref):
    def hook(module, args, output):
        return ref()._after_unit(module, output)

    return hook


def _outermost(module: nn.Module, types: tuple[type, ...]):
    """(qualified name, submodule) for each submodule of one of ``types`` not inside another one."""
    if isinstance(module, types):
        yield "", module
        return
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop(0)
        for name, child in m.named_children():
            qualified = f"{prefix}.{name}" if prefix else name
            if isinstance(child, types):
                yield qualified, child
            else:
                stack.append((qualified, child))


def _key_to_param_name(module: nn.Module) -> dict[str, str]:
    """Each parameter's ``state_dict`` key -> its ``named_parameters()`` name (tied keys map to the first name)."""
    first = {id(p): n for n, p in module.named_parameters()}
    return {f"{prefix}.{attr}" if prefix else attr: first[id(p)]
            for prefix, m in module.named_modules(remove_duplicate=False)
            for attr, p in m._parameters.items() if p is not None and id(p) in first}


def _flat_gradient(unit: Unit, grads: tuple[torch.Tensor | None, ...], transport) -> torch.Tensor:
    """The unit's (padded,) master-dtype gradient: reduced in the master dtype (no float16 overflow).

    A unit of one master-dtype parameter that fills it (the GPT's embedding) reduces its gradient as
    it is on a transport that takes any tensor where it lies (torch.distributed's); otherwise one
    tensor from the transport's ``allocate`` (on shared memory: in its arena, where the copy below is
    the one copy the transport would otherwise make into its staging block), each gradient cast as it
    is copied in.
    """
    (grad, *rest) = grads
    if not rest and grad is not None and grad.dtype == unit.master_dtype and grad.numel() == unit.padded \
            and grad.is_contiguous() and not transport.zero_copy:
        return grad.view(-1)
    flat = transport.allocate((unit.padded,), dtype=unit.master_dtype, device=unit.shard.device)
    for grad, view in zip(grads, _views(flat, unit)):
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
    flat[unit.numel:].zero_()  # the padding
    return flat


def _views(full: torch.Tensor, unit: Unit) -> tuple[torch.Tensor, ...]:
    """The unit's parameters, in their shapes, as views of a (padded,) flat tensor laid out like ``full``."""
    return tuple(full[o:o + s.numel()].view(s) for o, s in zip(unit.offsets, unit.shapes))


def _cast_floating(value, dtype: torch.dtype):
    """``value`` with every floating tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def _local_problem(module: nn.Module) -> str | None:
    """What this rank alone can see is wrong with ``module`` (raised on every rank by ``check_same_model``)."""
    devices = sorted({str(p.device) for p in module.parameters()})
    if not devices:
        return f"{type(module).__name__} has no parameters: there is nothing to shard or synchronise"
    if len(devices) > 1:
        return f"the parameters are on different devices ({', '.join(devices)}): move the module to one device"
    return None
