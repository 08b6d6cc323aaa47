"""ZeRO stage 1: an optimizer whose state is sharded over the data-parallel ranks.

    model = DDP(build_model(...))                     # gradients are averaged as usual
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Every rank still holds the whole model and, after backward, the whole averaged gradient; but
each parameter element is owned by exactly one rank, and only its owner keeps its optimizer
state (for AdamW two float32 tensors per parameter: the biggest share of the model states)
and updates it. ``step()`` runs ``optimizer_cls`` on this rank's share, then every rank's
updated share is sent to every other rank with the ring all-gather of ``allreduce.py``.

The partition (the same on every rank, computed from the shapes alone), per param group:

* ``partition="flat"`` (default): the group's parameters of each dtype, flattened back to
  back, cut into n ranges of near-equal length (``allreduce.bounds``); a parameter crossing
  a boundary is split, and its owners' optimizers update 1-D views of their elements. The
  state is 1/n of the whole to within one element per group and dtype, whatever the
  tensor sizes. Exact for element-wise updates (SGD, Adam, AdamW: the same arithmetic on the
  same elements, bit for bit); an update that looks at a whole tensor (LAMB's per-tensor
  trust ratio, Adafactor's factored moments, a norm) sees a piece of it, or a 1-D view of a
  matrix, and is NOT the unsharded update: use ``partition="tensor"``.
* ``partition="tensor"``: whole parameters, largest first, each to the rank owning the
  fewest elements so far (ties to the lowest rank; frozen parameters weigh nothing). Exact
  for any update that treats each tensor as a unit, at the price of uneven shares when one
  tensor is a large part of the model (a GPT's token embedding).

An update that couples tensors (a global gradient norm computed inside the optimizer, LBFGS's
line search over all parameters) sees this rank's share only, under either partition.

Tested bit for bit against the unsharded optimizer: ``tests/test_zero.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

import allreduce


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


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` over this rank's share of ``params`` (ZeRO stage 1); a ``torch.optim.Optimizer``.

    Args:
        params: tensors, or param-group dicts with their own options (as any optimizer takes).
        optimizer_cls: a ``torch.optim.Optimizer`` subclass, built over this rank's share.
        process_group: the ranks that share the state (default: the whole world).
        partition: ``"flat"`` (default) or ``"tensor"``, see the module docstring.
        **defaults: options for ``optimizer_cls`` (``lr=...``), defaults of every param group.

    ``param_groups`` lists every parameter (so ``zero_grad`` and learning-rate schedulers act
    on all of them; their options are handed to the local optimizer at every step); ``state``
    holds this rank's optimizer state only (per piece). Parameters without a gradient are left
    unchanged, as by any optimizer. Every rank must call ``step``, ``state_dict`` and
    ``load_state_dict`` (collectives), with the same model. ``last_share_s``: seconds the last
    step spent sending and receiving parameters.

    Checkpoints are CONSOLIDATED: ``state_dict()`` gathers every rank's state and returns, on
    every rank, exactly what ``optimizer_cls`` over all the parameters would return, so it can
    be saved once (by rank 0), loaded into a plain optimizer, or into a ``ShardedOptimizer``
    over any number of ranks; ``load_state_dict`` keeps the state of this rank's pieces.
    """

    update = "all_gather"  # or "broadcast": how step() shares the updated parameters (see _share_parameters)

    def __init__(self, params: Iterable, optimizer_cls: type, process_group=None, *, partition: str = "flat",
                 **defaults: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if partition not in PARTITIONS:
            raise ValueError(f"unknown partition {partition!r}: choose one of {', '.join(PARTITIONS)}")
        groups = _param_groups(params)
        self.process_group, self.rank = process_group, dist.get_rank(process_group)
        self.world_size, self.partition = dist.get_world_size(process_group), partition
        self.load = [0] * self.world_size  # elements owned per rank, across groups: the greedy partition's state
        self.pieces: list[Piece] = []  # every rank's, in param-group order
        owned = [self._assign(group["params"]) for group in groups]
        self.local = optimizer_cls([{**group, "params": mine} for group, mine in zip(groups, owned)], **defaults)
        self._ready = False  # the base constructor calls add_param_group: the groups are already partitioned
        super().__init__(groups, self.local.defaults)  # every option of optimizer_cls, so state_dict loads anywhere
        self._ready = True
        self.state = self.local.state  # type: ignore[assignment]  # this rank's share only
        self.last_share_s = 0.0

    # ------------------------------------------------------------------ partition

    def _assign(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Cut one group's parameters into pieces with owners; returns the tensors this rank updates, in order."""
        pieces = []
        if self.partition == "tensor":
            # A frozen parameter never has optimizer state: it weighs nothing in the balance.
            owners = partition([p.numel() if p.requires_grad else 0 for p in params], self.load)
            pieces = [Piece(p, 0, p.numel(), owner, p) for p, owner in zip(params, owners)]
        else:
            for dtype in dict.fromkeys(p.dtype for p in params):  # each dtype's elements in n near-equal ranges
                same = [p for p in params if p.dtype == dtype]
                edges = allreduce.bounds(sum(p.numel() for p in same), self.world_size)
                offset = 0
                for p in same:
                    for owner in range(self.world_size):
                        start, end = max(edges[owner], offset), min(edges[owner + 1], offset + p.numel())
                        if start < end:
                            view = p.detach().view(-1)[start - offset:end - offset]  # shares p's storage
                            pieces.append(Piece(p, start - offset, end - offset, owner, view))
                    offset += p.numel()
        self.pieces += pieces
        return [piece.tensor for piece in pieces if piece.owner == self.rank]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to every rank's partition (every rank must add the same group)."""
        if not self._ready:  # called by the base constructor
            super().add_param_group(param_group)
            return
        (group,) = _param_groups([param_group], known=[p for g in self.param_groups for p in g["params"]])
        super().add_param_group(group)
        self.local.add_param_group({**self.param_groups[-1], "params": self._assign(group["params"])})

    def _mine(self) -> list[Piece]:
        return [piece for piece in self.pieces if piece.owner == self.rank]

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Update this rank's pieces, then bring every rank's copy of every parameter up to date."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self.local.param_groups):
            local.update({key: value for key, value in group.items() if key != "params"})  # schedulers set these
        views = [piece for piece in self._mine() if piece.tensor is not piece.param]
        for piece in views:  # the gradient of a piece is the same view of the parameter's gradient
            grad = piece.param.grad
            piece.tensor.grad = None if grad is None else grad.view(-1)[piece.start:piece.end]
        self.local.step()
        for piece in views:
            piece.tensor.grad = None  # do not keep the gradient alive past zero_grad(set_to_none=True)
        start = time.perf_counter()
        self._share_parameters()
        self.last_share_s = time.perf_counter() - start  # communication nothing overlaps (on the host clock)
        return loss

    @torch.no_grad()
    def _share_parameters(self) -> None:
        """Every owner's pieces to every rank: one all-gather per dtype.

        Rank j packs its pieces of that dtype into row j of a (world, largest share) buffer,
        padded; the ring all-gather fills the other rows; each rank copies them into its
        parameters. All-gather rather than one broadcast per owner: the ring sends each rank's
        (n-1)/n of the buffer in n-1 pipelined steps, n broadcasts serialise n rounds
        (``update = "broadcast"``; ``sharding_benchmark.py`` times both in the same rounds).
        """
        for dtype, by_rank in self._by_dtype().items():
            width = max(sum(piece.end - piece.start for piece in pieces) for pieces in by_rank)
            if width == 0:
                continue
            device = next(piece.param.device for pieces in by_rank for piece in pieces)  # one device: checked
            buffer = torch.empty(self.world_size, width, dtype=dtype, device=device)  # (n, largest share), padded
            _copy_pieces(by_rank[self.rank], buffer[self.rank], into_row=True)
            if self.update == "broadcast":
                for owner in range(self.world_size):
                    dist.broadcast(buffer[owner], group=self.process_group, group_src=owner)
            else:
                allreduce.all_gather(buffer.view(-1), buffer[self.rank], self.process_group)
            for owner, pieces in enumerate(by_rank):
                if owner != self.rank:
                    _copy_pieces(pieces, buffer[owner], into_row=False)

    def _by_dtype(self) -> dict[torch.dtype, list[list[Piece]]]:
        """dtype -> for each rank, its pieces of that dtype in param-group order."""
        out: dict[torch.dtype, list[list[Piece]]] = {}
        for piece in self.pieces:
            out.setdefault(piece.param.dtype, [[] for _ in range(self.world_size)])[piece.owner].append(piece)
        return out

    # ------------------------------------------------------------------ checkpoints

    def _index(self) -> dict[torch.Tensor, int]:
        """Parameter -> its number in a plain optimizer's state dict (param-group order)."""
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _group_options(self) -> list[dict]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]

    def state_dict(self) -> dict:
        """The consolidated state (a collective): what ``optimizer_cls`` over every parameter would return."""
        index, local = self._index(), self.local.state_dict()["state"]
        mine = [(index[piece.param], piece.start, piece.end, local[i])
                for i, piece in enumerate(self._mine()) if i in local]
        shares: list = [None] * self.world_size
        dist.all_gather_object(shares, mine, group=self.process_group)  # a checkpoint, not the hot path: pickled is fine
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


def _copy_pieces(pieces: list[Piece], row: torch.Tensor, into_row: bool) -> None:
    """Pieces back to back in ``row`` (1-D), copied into it or out of it into their parameters."""
    offset = 0
    for piece in pieces:
        length = piece.end - piece.start
        values = piece.param.detach().view(-1)[piece.start:piece.end]
        if into_row:
            row[offset:offset + length].copy_(values)
        else:
            values.copy_(row[offset:offset + length])
        offset += length
