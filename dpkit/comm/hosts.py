"""Which host each rank of a process group runs on: the real hosts, or hosts simulated on one machine.

    DPKIT_HOSTS=2,2 torchrun --standalone --nproc_per_node=4 train.py   # 4 ranks as 2 hosts of 2 ranks
    DPKIT_HOSTS=2,1 ...                                                 # uneven: ranks 0, 1 | rank 2
    process_groups.launch(fn, 3, hosts=(2, 1))                          # the launcher's way to say the same
    host_indices(group)     # (0, 0, 1, 1): each group rank's host (a collective, made once per group)

``DPKIT_HOSTS`` lists the ranks of each host in global rank order; they must add up to the world
size. Without it the hosts are the real ones: ranks share a host when they share a host name, a
boot and a /dev/shm (so a container with a /dev/shm of its own is a host of its own). With it,
the simulated hosts subdivide the real ones: two ranks share a host only when both views agree.

``host_indices`` gathers every rank's view, so every rank raises the same ValueError for a layout
that does not fit the world or for ranks that were given different layouts; the shared-memory
transport serves only ranks of one host, and ``transport.resolve("auto")`` reads the hosts to
choose between shared memory, hierarchical collectives and ``torch.distributed``'s.
"""

from __future__ import annotations

import bisect
import itertools
import os
import socket
import weakref
from typing import Sequence

import torch.distributed as dist

HOSTS_ENV = "DPKIT_HOSTS"
EXAMPLE = f"{HOSTS_ENV}=2,2 for 4 ranks on 2 hosts, {HOSTS_ENV}=2,1 for 3 ranks on 2 hosts"

# group -> its ranks' host indices. Weak: a process group must be free to go at destroy_process_group.
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def parse_layout(text: str) -> tuple[int, ...]:
    """``"2,1"`` -> ``(2, 1)``: ranks per host, each at least one; ValueError naming the variable otherwise."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"{HOSTS_ENV}={text!r} is not a host layout: give the number of ranks on each host "
                         f"(at least one), in rank order, separated by commas ({EXAMPLE})")
    return counts


def layout_value(per_host: Sequence[int], world_size: int) -> str:
    """The value of ``DPKIT_HOSTS`` for ``per_host`` ranks on each host, checked against ``world_size``."""
    if isinstance(per_host, (str, bytes)) or not all(isinstance(c, int) and not isinstance(c, bool)
                                                     for c in per_host):
        raise TypeError(f"hosts must be a sequence of ranks per host, e.g. (2, 2), got {per_host!r}")
    text = ",".join(str(c) for c in per_host)
    check_fits(parse_layout(text), world_size, text)
    return text


def check_fits(counts: tuple[int, ...], world_size: int, text: str) -> None:
    """ValueError unless the layout places exactly ``world_size`` ranks."""
    if sum(counts) != world_size:
        raise ValueError(f"{HOSTS_ENV}={text} places {sum(counts)} ranks on {len(counts)} hosts, but the world has "
                         f"{world_size} ranks: the ranks per host must add up to the world size ({EXAMPLE})")


def simulated_host(global_rank: int, counts: tuple[int, ...]) -> int:
    """The host of a global rank under the layout ``counts`` (hosts hold consecutive ranks)."""
    return bisect.bisect_right(list(itertools.accumulate(counts)), global_rank)


def real_host() -> str:
    """This process's host as shared memory sees it: host name, boot, and the identity of /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        shm = os.stat("/dev/shm")
        where = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        where = ""
    return f"{socket.gethostname()}/{boot}/{where}"


def host_indices(group=None) -> tuple[int, ...]:
    """The host of each rank of ``group``, in group-rank order, numbered 0, 1, ... in order of first
    appearance (a collective: every member calls it; once per group, then cached)."""
    group = group if group is not None else dist.group.WORLD
    found = _CACHE.get(group)
    if found is not None:
        return found
    ranks = dist.get_process_group_ranks(group)
    mine = (os.environ.get(HOSTS_ENV), real_host())
    everyone: list = [mine]
    if len(ranks) > 1:
        everyone = [None] * len(ranks)
        dist.all_gather_object(everyone, mine, group=group)
    found = _CACHE[group] = number_hosts(everyone, ranks, dist.get_world_size())
    return found


def number_hosts(views: list[tuple[str | None, str]], ranks: list[int], world_size: int) -> tuple[int, ...]:
    """Host indices from every group rank's (``DPKIT_HOSTS``, real host); the same ValueError on every rank
    for a layout the ranks disagree on or that does not fit the world."""
    texts = [text for text, _ in views]
    if len(set(texts)) > 1:
        table = ", ".join(f"rank {rank}: {text!r}" for rank, text in zip(ranks, texts))
        raise ValueError(f"the ranks were given different {HOSTS_ENV} ({table}): every rank of a job must see "
                         "the same layout")
    keys = [real for _, real in views]
    if texts[0] is not None:
        counts = parse_layout(texts[0])
        check_fits(counts, world_size, texts[0])
        keys = [(simulated_host(rank, counts), real) for rank, (_, real) in zip(ranks, views)]
    numbers: dict = {}
    return tuple(numbers.setdefault(key, len(numbers)) for key in keys)


def ranks_by_host(indices: Sequence[int]) -> list[list[int]]:
    """The group ranks on each host (ascending), from ``host_indices``."""
    hosts: list[list[int]] = [[] for _ in range(max(indices) + 1)]
    for rank, host in enumerate(indices):
        hosts[host].append(rank)
    return hosts
