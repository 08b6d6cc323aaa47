"""Small-message latency of the "dpkit" backend, and what sets its floor.

    python -m dpkit.bench.backend_latency                        # 2 ranks, 4 KiB, float32
    python -m dpkit.bench.backend_latency --procs 2 4 --bytes 4096 65536 --json results/backend_latency.json

Each row is the time per call of back-to-back calls (median over rounds, slowest rank):

* ``dist.all_reduce [dpkit]``: PyTorch's call on any CPU tensor, through the backend (targets: <= 60 us at 4 KiB);
* ``slots.all_reduce``: the backend's slots called directly on any tensor (no dispatch; target <= 30 us);
* what the floor is made of: ``dispatch`` (``dist.all_reduce`` on a one-rank "dpkit" group, which the C++ face
  completes at once: torch's Python and C++ layers and the Work, what any C++ backend's call costs; on torch's
  Python-backend route, also the call into Python), taken apart on the same group by calling each layer below
  ``dist.all_reduce`` itself: ``ProcessGroup.allreduce`` (torch's dispatcher op and the Work, if any, without
  ``dist.all_reduce``'s Python) and ``Backend.allreduce`` (the backend alone, through its Python binding);
  ``wait`` (one exchange of no data: post the counter, see the peers'), ``reduction`` (the copy into the slot and
  the sum into the output, alone);
* for comparison, ``dist.all_reduce [gloo]`` and the kit's ``SharedMemory`` transport on its own buffer and
  on any tensor (staged: what ``dist.all_reduce`` through it would cost); long messages with ``--bytes 67108864``.

``collectives_benchmark.py --axis backends`` stores these rows (``floor_rows``) beside its backend rows.
Timings on a machine others are loading are not to be trusted: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from dpkit.bench.measure import in_turn
from dpkit.bench.results import environment, format_environment, write_results
from dpkit.comm import backend, process_groups
from dpkit.comm.transport import SharedMemory


def per_call(cases: dict[str, Callable[[], object]], calls: int, rounds: int, group=None) -> dict[str, float]:
    """Seconds per call of each of ``cases`` run ``calls`` times back to back: the median over ``rounds``, slowest
    rank. Every round times every case, in an order that turns by one each round: a slow spell of the host falls on
    all of them alike, so the cases can be set against each other."""
    names = list(cases)
    samples = {name: [] for name in names}
    for k in range(rounds):
        for name in in_turn(names, k):
            fn = cases[name]
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    value = torch.tensor([statistics.median(samples[name]) for name in names], dtype=torch.float64)
    dist.all_reduce(value, dist.ReduceOp.MAX, group=group)
    return dict(zip(names, value.tolist()))


def cases(nbytes: int, world_size: int, group=None, gloo=None) -> tuple[dict, SharedMemory, list]:
    """(name -> a function of no arguments making one call, the ``SharedMemory`` transport they use: close it,
    the groups made here: destroy them). ``group``: a "dpkit" group over every rank (default: the world's);
    ``gloo``: a gloo group over them (default: a new one). Every rank makes the same groups, in one order."""
    numel = nbytes // 4
    made = [] if gloo is not None else [dist.new_group(backend="gloo")]
    gloo = gloo if gloo is not None else made[0]
    singles = [dist.new_group([r], backend=backend.NAME) for r in range(world_size)]
    made += [g for g in singles if g != dist.GroupMember.NON_GROUP_MEMBER]  # a rank holds only its own
    alone = singles[dist.get_rank()]
    slots = backend.slots_of(group)
    shm = SharedMemory(gloo)
    tensor, on_gloo, owned = torch.ones(numel), torch.ones(numel), shm.allocate((numel,), dtype=torch.float32)
    plain, direct = torch.ones(numel), torch.ones(numel)
    a, b, c = torch.ones(numel), torch.ones(numel), torch.empty(numel)
    opts, cpu_backend = sum_waited(), backend.cpu_backend(alone)
    return {
        "dist.all_reduce [dpkit]": lambda: dist.all_reduce(tensor, group=group),
        "slots.all_reduce": lambda: slots.all_reduce(direct),
        "dispatch (one-rank group)": lambda: dist.all_reduce(tensor, group=alone),
        "ProcessGroup.allreduce (one-rank group)": lambda: waited(alone.allreduce([tensor], opts)),
        "Backend.allreduce (one-rank group)": lambda: waited(cpu_backend.allreduce([tensor], opts)),
        "wait (exchange of no data)": slots.barrier,
        "reduction (copy in, sum out)": lambda: (a.copy_(b), torch.add(a, b, out=c)),
        "dist.all_reduce [gloo]": lambda: dist.all_reduce(on_gloo, group=gloo),
        "SharedMemory.all_reduce [own buffer]": lambda: shm.all_reduce(owned),
        "SharedMemory.all_reduce [any tensor]": lambda: shm.all_reduce(plain),
    }, shm, made


def sum_waited() -> dist.AllreduceOptions:
    """The options ``dist.all_reduce(t)`` hands its group: a sum whose caller waits (``asyncOp`` where this torch
    has it)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    return opts


def waited(work) -> None:
    """Wait as ``dist.all_reduce`` does: on the call's Work, where the backend returns one (a backend that completed
    a call whose caller waits at once may return none)."""
    if work is not None:
        work.wait()


def calls_for(nbytes: int, calls: int) -> int:
    """``calls`` for small messages, fewer for long ones (about a GiB moved per round at most)."""
    return max(3, min(calls, (1 << 30) // nbytes))


def floor_rows(world_size: int, nbytes: int, calls: int, rounds: int, group=None, gloo=None) -> list[dict]:
    """One row per case of ``cases`` at ``nbytes``: seconds per call (``per_call``: the cases in turn each round),
    the same on every rank. The groups it makes are destroyed before it returns, so a sweep over sizes holds no
    more groups than one size."""
    made, shm, groups = cases(nbytes, world_size, group, gloo)
    try:
        for fn in made.values():
            for _ in range(3):
                fn()
        seconds = per_call(made, calls_for(nbytes, calls), rounds)
    finally:
        shm.close()
        for made_group in groups:
            dist.destroy_process_group(made_group)
    return [{"world_size": world_size, "bytes": nbytes, "case": name, "seconds_per_call": value}
            for name, value in seconds.items()]


def worker(ctx, sizes: list[int], calls: int, rounds: int) -> list[dict]:
    return [row for nbytes in sizes for row in floor_rows(ctx.world_size, nbytes, calls, rounds)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[2], help="ranks per run (default: %(default)s)")
    parser.add_argument("--bytes", type=int, nargs="+", default=[4096], help="message sizes (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=2000, help="back-to-back calls per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds; the median is kept (default: %(default)s)")
    parser.add_argument("--json", default=None, help="write the rows here in the shared layout (default: none)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    for n in args.procs:
        print(format_environment(environment(backend.NAME, "cpu", n)))
        rows += process_groups.launch(worker, n, args.bytes, args.calls, args.rounds, backend=backend.NAME,
                                      timeout_s=600)[0]
    for row in rows:
        print(f"{row['world_size']:>3} ranks {row['bytes']:>9} B  {row['case']:<38} "
              f"{row['seconds_per_call'] * 1e6:9.1f} us")
    if args.json:
        write_results(args.json, "backend_latency", environment(backend.NAME, "cpu", max(args.procs)), vars(args), rows)


if __name__ == "__main__":
    main()
