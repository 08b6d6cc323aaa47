"""The torch releases the kit runs on, and the one place that bridges the names they differ in.

    from dpkit import compat
    compat.all_gather_single(output, input, group=group)          # all_gather_into_tensor before it
    nn.parallel.DistributedDataParallel(module, **compat.NO_BUFFER_SYNC)
    with compat.subgroup_names_by_count(): ...                     # subgroups named alike on every member

Each bridge looks at the running torch (does the function exist, does the signature take the keyword)
and never at its version string, so a backport or a nightly gets the right name. The version is read
once, to refuse a torch older than ``OLDEST`` at import with both versions named.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
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

# The names of torch.distributed's tensor forms of all-gather and reduce-scatter: ``*_single`` where they
# exist (the older names warn there), else ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, with the
# same arguments. Looked up at each call, so a wrapper installed on torch.distributed (a counter) sees it.
ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_SINGLE = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``output`` (world * n) <- every rank's ``input`` (n), in rank order."""
    return getattr(dist, ALL_GATHER_SINGLE)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """``output`` (n) <- this rank's n-slice of the ``op`` over every rank's ``input`` (world * n)."""
    return getattr(dist, REDUCE_SCATTER_SINGLE)(output, input, op, group=group, async_op=async_op)


def _hash_by_count(ranks) -> str:
    """A group's name from its ranks and the process's group count, as torch from 2.12 names it."""
    return hashlib.sha1(f"dpkit_{'_'.join(map(str, ranks))}_{c10d._world.group_count}".encode()).hexdigest()


def _names_follow_the_count() -> bool:
    """Whether torch salts the name of a group made by its members alone with the group count (releases
    before that salt it with the number of groups the process holds, which members need not agree on)."""
    saved = c10d._world.group_count
    try:
        names = set()
        for count in (0, 1):
            c10d._world.group_count = count
            names.add(c10d._hash_ranks_to_str([0]))
    finally:
        c10d._world.group_count = saved
    return len(names) == 2


NAMES_FOLLOW_THE_COUNT = _names_follow_the_count()


@contextlib.contextmanager
def subgroup_names_by_count():
    """Inside: groups made with ``use_local_synchronization`` are named after their ranks and the group
    count, on every release (``process_groups.new_subgroups`` aligns the count among the members)."""
    if NAMES_FOLLOW_THE_COUNT:
        yield
        return
    torch_own = c10d._hash_ranks_to_str
    c10d._hash_ranks_to_str = _hash_by_count
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = torch_own


def drop_bias(module: _NormBase) -> None:
    """Make a norm layer built with a bias into one without (``bias=False``), as newer torch builds it."""
    module.bias = None  # nn.Module: setting a registered parameter to None keeps the name, holding None
