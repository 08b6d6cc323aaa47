"""What a SyncBatchNorm benchmark times: each implementation by name (``syncbn_verdicts``' names), built as a layer,
and one iteration of it, forward, the homework's loss, backward.

    sources = Sources(syncbn)                           # the script passes the layer's module in
    layer = make_layer(OURS, 1024, device, sources, wire)
    step = make_step(OURS, layer, x, loss_rows, sources, wire)

The synchronized layer's code is passed in (``Sources``): a package module never imports a script at the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from dpkit.bench.syncbn_floor import FloorFunction, ThroughFunction
from dpkit.bench.syncbn_verdicts import FLOOR, JUDGED, LOCAL, OURS, PATH_IMPLS, REFERENCE, SYNC_PATH, TORCH, TORCH_SYNC
from dpkit.comm import transport

Contender = tuple[str, "str | None"]  # (impl, transport name or None)


@dataclass(frozen=True)
class Sources:
    """Where the synchronized layer's code comes from: ``current``, the module ``syncbn.py`` as the script imported
    it, and ``baseline``, ``syncbn.py`` of another revision (``syncbn_baseline.load_baseline``) or None. Each offers
    ``SyncBatchNorm`` and ``SyncBatchNormFunction``; ``current`` also ``forced_path``."""

    current: ModuleType
    baseline: ModuleType | None = None

    def of(self, impl: str) -> ModuleType:
        """The module ``impl`` runs: the baseline's for a name "...@REV", else the current one."""
        return self.baseline if "@" in impl else self.current


def make_layer(impl: str, hidden: int, device: torch.device, sources: Sources,
               wire: transport.Transport | None = None) -> torch.nn.Module:
    """``impl``'s layer of ``hidden`` channels on ``device`` in training mode, summing through ``wire`` (None: one
    process, nobody to synchronise with)."""
    module = sources.of(impl)
    if impl == FLOOR:
        sums = tuple(sum_buffer(wire, n, torch.float64, device) for n in (2 * hidden + 1, 2 * hidden))
        layer = ThroughFunction(hidden, FloorFunction, sums, wire)
    elif impl.startswith(SYNC_PATH):
        layer = ThroughFunction(hidden, module.SyncBatchNormFunction, None)
    elif impl.startswith(OURS):
        layer = module.SyncBatchNorm(hidden) if wire is None else module.SyncBatchNorm(hidden, transport=wire)
    elif impl == TORCH_SYNC:
        layer = torch.nn.SyncBatchNorm(hidden)
    else:
        layer = torch.nn.BatchNorm1d(hidden)
    return layer.to(device).train()


def sum_buffer(wire: transport.Transport, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros in memory ``wire`` allocated (``Transport.allocate``), made once, outside the timed region."""
    return wire.allocate(numel, dtype=dtype, device=device).zero_()


def make_step(impl: str, layer: torch.nn.Module, x: torch.Tensor, loss_rows: int, sources: Sources,
              wire: transport.Transport | None = None) -> Callable[[], None]:
    """One iteration: forward, the homework's loss over this rank's share of the first B/2 samples, backward."""
    path = {name: p for p, name in PATH_IMPLS.items() if name != SYNC_PATH}.get(impl)  # a path forced by name
    if path is not None:
        def forced_step():
            x.grad = None
            with sources.current.forced_path(path):  # forward and backward
                layer(x)[:loss_rows].sum().backward()
        return forced_step
    if impl != REFERENCE or wire is None:
        def step():
            x.grad = None
            layer(x)[:loss_rows].sum().backward()
        return step
    return _reference_step(layer, x, loss_rows, wire)


def _reference_step(layer: torch.nn.Module, x: torch.Tensor, loss_rows: int,
                    wire: transport.Transport) -> Callable[[], None]:
    """BatchNorm's own work plus the two sums a synchronized BatchNorm cannot avoid, in buffers the transport
    allocates, as ours sums its statistics (on shared memory: where they lie, no copy in or out)."""
    channels = x.size(1)
    forward_stats, backward_stats = (sum_buffer(wire, 2 * channels + 1, torch.float32, x.device) for _ in range(2))

    def reference_step():
        x.grad = None
        y = layer(x)
        wire.all_reduce(forward_stats)
        y[:loss_rows].sum().backward()
        wire.all_reduce(backward_stats)
    return reference_step


def contenders(device: torch.device, transport_names, baseline: str | None, dtype: str) -> list[Contender]:
    """The timed (implementation, transport) pairs of the workers: on each transport ours, the reference and (in
    the judged dtypes: it attributes the targets' misses) the floor; BatchNorm1d without communication; on CUDA
    torch's SyncBatchNorm. float16/bfloat16 (information) run on one transport, the one "auto" picks (the last
    made), which keeps the quick run's time."""
    names = list(transport_names)
    out: list[Contender] = []
    for t in names if dtype == "float32" else names[-1:]:
        out += [(OURS, t), (REFERENCE, t)] + ([(FLOOR, t)] if dtype in JUDGED else [])
        out += [(f"{OURS}@{baseline}", t)] if baseline else []
    out.append((LOCAL, None))
    return out + ([(TORCH_SYNC, TORCH)] if device.type == "cuda" else [])
