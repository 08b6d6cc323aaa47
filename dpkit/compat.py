"""The torch releases the kit runs on, and the one place that bridges the names they differ in.

    from dpkit import compat
    compat.all_gather_single(output, input, group=group)          # all_gather_into_tensor before it
    nn.parallel.DistributedDataParallel(module, **compat.NO_BUFFER_SYNC)

Each bridge looks at the running torch (does the function exist, does the signature take the keyword)
and never at its version string, so a backport or a nightly gets the right name. The version is read
once, to refuse a torch older than ``OLDEST`` at import with both versions named.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

OLDEST = (2, 11)  # the oldest release the default suite runs on in CI (.ci/run)
NEWEST = (2, 15)  # the newest release the kit is declared for (pyproject.toml)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.11.0+cu130" -> (2, 11)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch(version: str = torch.__version__) -> None:
    """Raise ImportError naming the installed and the supported releases where torch is too old."""
    if release(version) < OLDEST:
        raise ImportError(f"dpkit needs torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}; this is torch "
                          f"{version}. Install a supported one: python -m pip install -r requirements.txt")


check_torch()  # before the bridges below, which a much older torch may lack the names for


def _takes(function, keyword: str) -> bool:
    return keyword in inspect.signature(function).parameters


# BatchNorm's keyword-only ``bias=`` (False: a weight and no bias). Where the running torch lacks it, the
# module is built with both and ``drop_bias`` removes the bias.
BATCHNORM_TAKES_BIAS = _takes(_NormBase.__init__, "bias")

# The keyword that stops DDP from broadcasting buffers before every forward: ``forward_sync_buffers`` where
# it exists (the older ``broadcast_buffers`` warns there that it is deprecated), else ``broadcast_buffers``.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if _takes(nn.parallel.DistributedDataParallel.__init__, "forward_sync_buffers")
                  else {"broadcast_buffers": False})

# The tensor forms of all-gather and reduce-scatter: ``*_single`` where they exist (the older names warn
# there), else ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, with the same arguments.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``output`` (world * n) <- every rank's ``input`` (n), in rank order."""
    return _ALL_GATHER(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """``output`` (n) <- this rank's n-slice of the ``op`` over every rank's ``input`` (world * n)."""
    return _REDUCE_SCATTER(output, input, op, group=group, async_op=async_op)


def drop_bias(module: _NormBase) -> None:
    """Make a norm layer built with a bias into one without (``bias=False``), as newer torch builds it."""
    module.bias = None  # nn.Module: setting a registered parameter to None keeps the name, holding None
