"""The floor of a SyncBatchNorm benchmark: the least a synchronized BatchNorm written as a Python autograd.Function
pays with the two sums such a layer makes, each where the layer must make it (row ``syncbn_verdicts.FLOOR``).

    layer = ThroughFunction(hidden, FloorFunction, sums, wire)    # see ``syncbn_contenders.make_layer``

Its arithmetic is BatchNorm's own (``native_batch_norm`` and its backward, the kernels ``BatchNorm1d`` runs), not a
copy of the synchronized layer's: ours / floor is the price of the synchronisation's arithmetic, floor /
(BatchNorm1d + 2 all_reduce) on the same transport the price of the Function and of the sums' place in the graph.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class FloorFunction(torch.autograd.Function):
    """A timing device, not a layer: BatchNorm's fused kernels in training mode (which also update the running
    statistics) on the local batch, with a sum across ranks through ``transport`` of ``sums[0]`` (2C + 1 float64
    values) inside forward, before the output exists, and of ``sums[1]`` (2C) inside backward, before the input
    gradient does. The sums are zeros in buffers the transport allocated, made once, outside the timed region.

    ``forward(x, weight, bias, running_mean, running_var, eps, momentum, sums, transport)``: BatchNorm's
    arguments, then the two buffers and the transport.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, sums, transport):
        y, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
        transport.all_reduce(sums[0])  # (2C + 1,) float64: the forward's statistics
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.eps, ctx.sums, ctx.transport = eps, sums, transport
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        grads = torch.ops.aten.native_batch_norm_backward(dy, x, weight, None, None, mean, invstd, True, ctx.eps,
                                                          list(ctx.needs_input_grad[:3]))
        ctx.transport.all_reduce(ctx.sums[1])  # (2C,) float64: the backward's two sums
        return (*grads, None, None, None, None, None, None)


class ThroughFunction(torch.nn.BatchNorm1d):
    """BatchNorm1d's parameters and buffers through an autograd Function that takes BatchNorm's arguments:
    ``function.apply(x, weight, bias, running_mean, running_var, eps, momentum, *extra)``.

    With ``FloorFunction`` and (sums, transport): the floor. With the layer's own ``SyncBatchNormFunction`` and
    (None,): the synchronized computation without its collectives (nobody to sum with)."""

    def __init__(self, hidden: int, function, *extra):
        super().__init__(hidden)
        self.function, self.extra = function, extra

    def forward(self, x):
        return self.function.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                   self.momentum, *self.extra)
