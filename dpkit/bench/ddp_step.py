"""One DDP variant's training step as the DDP benchmarks time it (``ddp_benchmark.py``, ``ddp_step_profile.py``):
the engines' row names, PyTorch's best settings, the loss and the optimizer, and ``Replica``, whose ``step()`` is
one iteration: forward, cross-entropy, backward, gradient synchronisation, SGD with momentum and
``zero_grad(set_to_none=True)``.

    replica = Replica(model, sgd(model), inputs, targets, waits=[])
    replica.step()                      # one timed iteration; replica.waits[-1]: its exposed communication wait
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from dpkit.engines.ddp import sync_gradients

# The engine registry's names ("ddp", an implementation, an option: dpkit.engines.registry's docstring), also
# the rows' order. "ddp ours" is ddp.make_ddp's "ours" (bucketed); "ddp pytorch best", PyTorch's DDP at
# PYTORCH_BEST.
OURS, PYTORCH, PYTORCH_BEST_KIND, NAIVE = "ddp ours", "ddp pytorch", "ddp pytorch best", "ddp ours naive"
# Each name's fields as a row stores them (engine, implementation, option): ``dpkit.bench.row_identity.name`` of them is
# the name.
DDP_FIELDS = {PYTORCH: ("ddp", "pytorch", None), PYTORCH_BEST_KIND: ("ddp", "pytorch", "best"),
              NAIVE: ("ddp", "ours", "naive"), "ddp ours flat": ("ddp", "ours", "flat"),
              "ddp ours overlap": ("ddp", "ours", "overlap"), OURS: ("ddp", "ours", None)}
DDP_KINDS = tuple(DDP_FIELDS)
PYTORCH_KINDS = (PYTORCH, PYTORCH_BEST_KIND)
# PyTorch's DDP at its best documented settings: gradients are views of its buckets (no copy, no second
# gradient-sized buffer) and the graph is declared static (no per-iteration search for unused parameters,
# buckets rebuilt once in the order gradients actually arrive). Valid for every model here: each uses all
# of its parameters in every iteration.
PYTORCH_BEST = {"gradient_as_bucket_view": True, "static_graph": True}
PYTORCH_DEFAULT_BUCKET_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's default bucket_cap_mb
# SGD with momentum, as seed 004. A small learning rate keeps many steps on random labels finite.
LR, MOMENTUM = 0.01, 0.9


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy: logits (N, classes) with targets (N,), or (B, T, vocab) with (B, T)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The benchmarks' optimizer over ``model``'s parameters."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


@dataclass
class Replica:
    """A variant's model, optimizer and batch on this rank; ``step()`` is one timed iteration."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    waits: list[float]  # each step's exposed communication wait (0 where there is none to read)

    def step(self) -> None:
        # The labels show in --profile traces; outside a profiler record_function costs about a microsecond.
        with record_function("forward"):
            loss = loss_of(self.model(self.inputs), self.targets)
        with record_function("backward"):
            loss.backward()
        with record_function("sync_gradients"):
            sync_gradients(self.model)
        self.waits.append(getattr(self.model, "last_wait_s", 0.0))
        with record_function("optimizer_step"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
