"""One step of our message passing (``dpkit.comm.message_passing``) against one step of gloo's all-reduce, on two
processes: the alpha and beta of the latency-bandwidth model seen from a single exchange, per byte, single medians
of batches of back-to-back steps (``measure.time_batches``).

    rows = point_to_point(ctx, iters=20, warmup=5)     # rows of kind "point_to_point", "impl": "ours" or "gloo"
    point_to_point_rows(read_results("results/collectives.json")["results"])   # those rows of a file

``collectives_benchmark.py`` stores these rows beside its sweep's (2 processes, the algorithm axis).
"""

from __future__ import annotations

import torch

from dpkit.bench.measure import BATCH_S, time_batches
from dpkit.comm.message_passing import pair_exchange
from dpkit.comm.process_groups import message_device

KIND = "point_to_point"  # a row's "kind": one exchange step, not a row of the collectives' sweep


def point_to_point(ctx, iters: int, warmup: int, sizes=(4, 64 << 20), batch_s: float = BATCH_S) -> list[dict]:
    """Two processes: one step of our message passing (an exchange of n bytes each way with isend/irecv, as recursive
    doubling makes it) against one step of gloo's all_reduce (its ring on 2 ranks makes 2 steps of n/2 bytes), each
    timed in batches of calls that last ``batch_s``."""
    rows = []
    wire = message_device(ctx.device)  # a step is a message on the wire: host memory where gloo carries it
    for nbytes in sizes:
        # gloo's all-reduce sums x in place: zeros (refilled before the counts and each batch) stay zeros.
        x, y = torch.zeros(nbytes // 4, device=wire), torch.empty(nbytes // 4, device=wire)
        timings, counts = time_batches({"ours": lambda: pair_exchange(x, y, 1 - ctx.rank, None),
                                        "gloo": lambda: torch.distributed.all_reduce(x)},
                                       iters, warmup, rounds=iters, device=wire, setup=x.zero_, seconds=batch_s)
        for impl, steps, step_bytes in (("ours", 1, nbytes), ("gloo", 2, nbytes / 2)):
            step = timings[impl].median / steps
            rows.append({"kind": KIND, "backend": ctx.backend, "impl": impl, "bytes": nbytes, "step_s": step,
                         "step_gbps": step_bytes / step / 1e9, "calls_per_round": counts[impl]})
    return rows


def point_to_point_rows(rows: list[dict]) -> list[dict]:
    """The one-step rows among a results file's rows."""
    return [row for row in rows if row.get("kind") == KIND]
