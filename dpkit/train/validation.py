"""Distributed validation that counts every sample exactly once: rank 0 holds the validation set and
scatters it in rounds, every rank evaluates its pieces, and one float64 all_reduce adds up
[loss sum, correct, count], exact for any world size and set size.

    evaluated = rank0_model(model, module, sharded=False)          # every rank: rank 0's buffers
    loss, correct, count = validation_sums(evaluated, val_set if ctx.is_master else None, 256, ctx).tolist()
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from dpkit.engines.ddp import broadcast_module_state


def rank0_model(model: nn.Module, module: nn.Module, sharded: bool) -> nn.Module:
    """The model every rank evaluates, with rank 0's state: ``module`` unwrapped, or the wrapped ``model`` when
    ``sharded`` (our FSDP's layers have parameters only inside its forward). A collective.

    Parameters are equal on every rank already, but per-rank BatchNorm (no SyncBatchNorm) leaves
    each rank its own running statistics: rank 0's are broadcast.
    """
    if not sharded:
        broadcast_module_state(module)
        return module
    for tensor in module.buffers():
        dist.broadcast(tensor, src=0)  # the sharded parameters are equal by construction
    return model


def _scatter_rounds(val_set: Dataset, per_rank: int, world: int, device: torch.device, num_workers: int):
    """Rank 0: the validation set as rounds of ``world`` pieces, each (per_rank, pixels + 1) float32.

    A row is an image's pixels followed by its label, so one scatter moves both. scatter needs
    pieces of equal size: the last round is padded with zero images labelled -1. Labels are
    small integers, exact in float32.
    """
    loader = DataLoader(val_set, batch_size=world * per_rank, shuffle=False, num_workers=num_workers)
    for images, labels in loader:
        rows = torch.cat([images.flatten(1).float(), labels.float().unsqueeze(1)], dim=1)
        padded = rows.new_zeros(world * per_rank, rows.shape[1])
        padded[:, -1] = -1
        padded[:len(rows)] = rows
        yield list(padded.to(device).chunk(world))


def _loss_correct_count(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 [sum of losses, correct predictions, samples] over the samples whose label is not -1."""
    valid = labels >= 0
    logits, labels = logits[valid], labels[valid]
    loss = F.cross_entropy(logits.double(), labels, reduction="sum")  # summed in float64: many samples
    correct = (logits.argmax(dim=1) == labels).sum().double()
    return torch.stack([loss, correct, torch.tensor(float(len(labels)), dtype=torch.float64, device=logits.device)])


@torch.no_grad()
def validation_sums(model: nn.Module, val_set: Dataset | None, per_rank: int, ctx,
                    num_workers: int = 0) -> torch.Tensor:
    """[loss sum, correct, count] (float64, CPU) of ``model`` on the validation set, on every rank.

    Only rank 0 holds ``val_set`` (None elsewhere) and scatters it in rounds of
    ``world x per_rank`` images; every rank evaluates its pieces in eval mode, and one
    all_reduce adds up the sums. Sums and counts, never averages: the result is exact for any
    world size and set size.
    """
    device = ctx.device
    header = torch.zeros(4, dtype=torch.int64, device=device)  # rounds, C, H, W
    if ctx.is_master:
        rounds = math.ceil(len(val_set) / (ctx.world_size * per_rank))
        header = torch.tensor([rounds, *val_set[0][0].shape], device=device)
    dist.broadcast(header, src=0)
    rounds, shape = int(header[0]), header[1:].tolist()
    pieces = _scatter_rounds(val_set, per_rank, ctx.world_size, device, num_workers) if ctx.is_master else None
    piece = torch.empty(per_rank, math.prod(shape) + 1, device=device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    dtype = next(model.parameters()).dtype  # images travel as float32 and are evaluated in the model's dtype
    model.eval()
    for _ in range(rounds):
        dist.scatter(piece, next(pieces) if ctx.is_master else None, src=0)
        sums += _loss_correct_count(model(piece[:, :-1].view(-1, *shape).to(dtype)), piece[:, -1].long())
    dist.all_reduce(sums)
    return sums.cpu()
