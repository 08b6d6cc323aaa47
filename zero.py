"""ZeRO stage 1: an optimizer whose state is sharded over the data-parallel ranks.

    model = DDP(build_model(...))                     # gradients are averaged as usual
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Every rank still holds the whole model and, after backward, the whole averaged gradient; but
each parameter is owned by exactly one rank, and only its owner keeps its optimizer state
(for AdamW two float32 tensors per parameter: the biggest share of the model states) and
updates it. ``step()`` runs ``optimizer_cls`` on this rank's parameters, then every rank's
updated parameters are sent to every other rank with the ring all-gather of ``allreduce.py``.

The partition: whole parameters, largest first, each to the rank owning the fewest elements
so far (ties to the lowest rank; frozen parameters count as empty): the same on every rank,
computed from the shapes alone.
Whole tensors keep optimizers whose update treats each tensor as a unit exact (LAMB's
per-tensor trust ratio, Adafactor's factored moments, Shampoo's per-tensor preconditioners),
at the price of uneven shares when one tensor is a large part of the model. An update that
couples tensors (a global gradient norm computed inside the optimizer, LBFGS's line search
over all parameters) sees this rank's tensors only and is NOT the unsharded update.

Tested bit for bit against the unsharded optimizer: ``tests/test_zero.py``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

import allreduce


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` over this rank's share of ``params`` (ZeRO stage 1); a ``torch.optim.Optimizer``.

    Args:
        params: tensors, or param-group dicts with their own options (as any optimizer takes).
        optimizer_cls: a ``torch.optim.Optimizer`` subclass, built over this rank's parameters.
        process_group: the ranks that share the state (default: the whole world).
        **defaults: options for ``optimizer_cls`` (``lr=...``), defaults of every param group.

    ``param_groups`` lists every parameter (so ``zero_grad`` and learning-rate schedulers act
    on all of them; their options are handed to the local optimizer at every step); ``state``
    holds this rank's optimizer state only. Parameters without a gradient are left unchanged,
    as by any optimizer. Every rank must call ``step``, ``state_dict`` and
    ``load_state_dict`` (collectives), with the same model. ``last_share_s``: seconds the last
    step spent sending and receiving parameters.

    Checkpoints are CONSOLIDATED: ``state_dict()`` gathers every rank's state and returns, on
    every rank, exactly what ``optimizer_cls`` over all the parameters would return, so it can
    be saved once (by rank 0), loaded into a plain optimizer, or into a ``ShardedOptimizer``
    over any number of ranks; ``load_state_dict`` keeps the state of this rank's parameters.
    """

    update = "all_gather"  # or "broadcast": how step() shares the updated parameters (see _share_parameters)

    def __init__(self, params: Iterable, optimizer_cls: type, process_group=None, **defaults: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        groups = _param_groups(params)
        self.process_group, self.rank = process_group, dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.load = [0] * self.world_size  # elements owned per rank, across groups: the greedy partition's state
        self.owner: dict[torch.Tensor, int] = {}
        owned = [self._assign(group["params"]) for group in groups]
        self.local = optimizer_cls([{**group, "params": mine} for group, mine in zip(groups, owned)], **defaults)
        self._ready = False  # the base constructor calls add_param_group: the groups are already partitioned
        super().__init__(groups, self.local.defaults)  # every option of optimizer_cls, so state_dict loads anywhere
        self._ready = True
        self.state = self.local.state  # type: ignore[assignment]  # this rank's share only
        self.last_share_s = 0.0

    # ------------------------------------------------------------------ partition

    def _assign(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Give each parameter an owner; returns this rank's, in order."""
        # A frozen parameter never has optimizer state: it weighs nothing in the balance.
        for p, rank in zip(params, partition([p.numel() if p.requires_grad else 0 for p in params], self.load)):
            self.owner[p] = rank
        return [p for p in params if self.owner[p] == self.rank]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to every rank's partition (every rank must add the same group)."""
        if not self._ready:  # called by the base constructor
            super().add_param_group(param_group)
            return
        (group,) = _param_groups([param_group], known=[p for g in self.param_groups for p in g["params"]])
        super().add_param_group(group)
        self.local.add_param_group({**self.param_groups[-1], "params": self._assign(group["params"])})

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Update this rank's parameters, then bring every rank's copy of every parameter up to date."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self.local.param_groups):
            local.update({key: value for key, value in group.items() if key != "params"})  # schedulers set these
        self.local.step()
        start = time.perf_counter()
        self._share_parameters()
        self.last_share_s = time.perf_counter() - start  # communication nothing overlaps (on the host clock)
        return loss

    @torch.no_grad()
    def _share_parameters(self) -> None:
        """Every owner's parameters to every rank: one all-gather per dtype.

        Rank j packs its parameters of that dtype into chunk j of a (world, largest share)
        buffer, padded; the ring all-gather fills the other chunks; each rank copies them into
        its parameters. All-gather rather than one broadcast per owner: the ring sends each
        rank's (n-1)/n of the buffer in n-1 pipelined steps, n broadcasts serialise n rounds
        (``update = "broadcast"``; ``sharding_benchmark.py`` times both in the same rounds).
        """
        for dtype, by_rank in self._by_dtype().items():
            width = max(sum(p.numel() for p in params) for params in by_rank)
            if width == 0:
                continue
            device = next(p.device for params in by_rank for p in params)  # one device: checked at construction
            buffer = torch.empty(self.world_size, width, dtype=dtype, device=device)  # (n, largest share), padded
            _pack(by_rank[self.rank], buffer[self.rank])
            if self.update == "broadcast":
                for owner in range(self.world_size):
                    dist.broadcast(buffer[owner], group=self.process_group, group_src=owner)
            else:
                allreduce.all_gather(buffer.view(-1), buffer[self.rank], self.process_group)
            for owner, params in enumerate(by_rank):
                if owner != self.rank:
                    _unpack(buffer[owner], params)

    def _by_dtype(self) -> dict[torch.dtype, list[list[torch.Tensor]]]:
        """dtype -> for each rank, its parameters of that dtype in param-group order."""
        out: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                out.setdefault(p.dtype, [[] for _ in range(self.world_size)])[self.owner[p]].append(p)
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The consolidated state (a collective): what ``optimizer_cls`` over every parameter would return."""
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        local = self.local.state_dict()
        local_params = [p for g in self.local.param_groups for p in g["params"]]
        mine = {index[local_params[i]]: state for i, state in local["state"].items()}
        shares: list = [None] * self.world_size
        dist.all_gather_object(shares, mine, group=self.process_group)  # a checkpoint, not the hot path: pickled is fine
        state = {i: s for share in shares for i, s in share.items()}
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state dict (from ``state_dict()`` or a plain optimizer over the same parameters)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"the state dict's param groups have {[len(g['params']) for g in saved]} parameters, "
                             f"this optimizer's {[len(g['params']) for g in self.param_groups]}")
        for group, saved_group in zip(self.param_groups, saved):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        flat = [p for g in self.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(flat)}
        local_params = [p for g in self.local.param_groups for p in g["params"]]
        local_groups, start = [], 0
        for group, local in zip(self.param_groups, self.local.param_groups):
            local_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": list(range(start, start + len(local["params"])))})
            start += len(local["params"])
        states = {i: state_dict["state"][index[p]] for i, p in enumerate(local_params) if index[p] in state_dict["state"]}
        self.local.load_state_dict({"state": states, "param_groups": local_groups})
        self.state = self.local.state


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


def _pack(params: list[torch.Tensor], row: torch.Tensor) -> None:
    offset = 0
    for p in params:
        row[offset:offset + p.numel()].view_as(p).copy_(p)
        offset += p.numel()


def _unpack(row: torch.Tensor, params: list[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        p.copy_(row[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
