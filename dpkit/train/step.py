"""One training step of a data-parallel model, the same for every engine: micro-batches accumulate their
gradients without communication (``no_sync``), the last of a window communicates, then the optimizer steps.

    plan = micro_batch_plan(len(loader.sampler), loader.batch_size, accum=4)   # (steps?, window) per micro-batch
    for (images, labels), (steps, window) in zip(loader, plan):
        loss_sum = forward_backward(model, images, labels, window, sync=steps, dtype=None)
        if steps:
            optimizer_step(model, optimizer)
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F



def micro_batch_plan(samples: int, batch_size: int, accum: int) -> list[tuple[bool, int]]:
    """For each micro-batch of an epoch: (optimizer steps after it, samples in its window on this rank).

    ``samples`` per rank make ceil(samples / batch_size) micro-batches (the last may be short).
    A window is ``accum`` consecutive micro-batches; the epoch's last window may hold fewer
    (the leftover), and steps with its own sample count: nothing is dropped or carried into the
    next epoch. Each micro-batch's summed loss is divided by its window's sample count, so a step's
    gradient is that of the mean loss over the window's global batch (the sampler gives every rank
    the same number of samples, so the ranks' windows match).
    """
    count = math.ceil(samples / batch_size)
    plan = []
    for j in range(count):
        start = j - j % accum
        end = min(start + accum, count)
        plan.append((j + 1 == end, min(end * batch_size, samples) - start * batch_size))
    return plan


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The RNG seed of one rank in one epoch (dropout masks): a pure function, so a resumed run draws the same."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Forward passes in ``dtype`` where autocast allows (matmuls, convolutions); None: as the parameters."""
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def no_sync(model: nn.Module):
    """The wrapper's ``no_sync()``; PyTorch's ``fully_shard`` has none (it reduce-scatters every micro-batch)."""
    method = getattr(model, "no_sync", None)
    return method() if method is not None else nullcontext()


def forward_backward(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, window: int, sync: bool,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """Forward and backward of one micro-batch; gradients communicate only where ``sync`` (the window's last).
    Returns the summed loss, detached, in float64."""
    with nullcontext() if sync else no_sync(model):
        with autocast(images.device, dtype):
            loss_sum = F.cross_entropy(model(images), labels, reduction="sum")
        # Gradients of a window's micro-batches add up in .grad, and DDP averages them over
        # ranks; dividing by the window's samples per rank makes the step's gradient that of
        # the mean loss over the window's global batch (full window: mean / grad-accum-steps).
        (loss_sum / window).backward()
    return loss_sum.detach().double()


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The step after a window's last backward, then the gradients cleared: every engine, ours and PyTorch's,
    finished its gradients' sums inside that backward."""
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
