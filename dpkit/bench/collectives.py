"""What a row of a collectives results file means: message sizes, bus bandwidth, the axis and label of each
row, and its ratio to torch's collective.

    from dpkit.bench.collectives import allreduce_rows, ratio_of
    rows = allreduce_rows(read_results("results/collectives.json")["results"])
    ratio_of(rows[0])                       # p50 / torch's p50 on the row's axis, with its interval

``collectives_benchmark.py`` writes the rows and the report reads them, both through these functions (the
latency-bandwidth model of the algorithms is ``latency_model.fit_model``).
"""

from __future__ import annotations

import argparse
import re

UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


# The transport axis by default, by the registry's names, which are its rows' labels: "shared_memory" works on the
# buffers it allocates (zero copy), "shared_memory:staged" on plain tensors, copied in and out.
TRANSPORTS = ("torch", "shared_memory", "shared_memory:staged", "p2p")
# The backend axis: rows of torch.distributed's calls on a group of the backend "dpkit", against the same on gloo.
BACKEND = "dpkit backend"


def parse_size(text: str) -> int:
    """'10MB' or '10MiB' -> 10 * 2**20 bytes (binary units, as nccl-tests); a bare number is bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)I?(B?)\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 64KiB, 10MiB, 1GiB; KB = KiB)")
    return int(float(match.group(1)) * UNITS[match.group(2) + "B" if match.group(2) else ""])


def format_size(nbytes: int) -> str:
    """65536 -> '64KiB': binary units, written as such."""
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit[0]}iB"
    return f"{nbytes}B"


def bus_factor(world_size: int, collective: str = "allreduce") -> float:
    """busbw / algbw: the share of the tensor each rank must send and receive (nccl-tests): 2(n-1)/n for an
    all-reduce, (n-1)/n for a reduce-scatter, an all-gather or an all-to-all, 1 for a broadcast or a reduce
    (0 for a barrier, which moves no data)."""
    if collective in ("broadcast", "reduce", "barrier"):
        return 0.0 if collective == "barrier" else 1.0
    return (2 if collective == "allreduce" else 1) * (world_size - 1) / world_size


NAMES = {"allreduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
         "broadcast": "broadcast", "reduce": "reduce", "all_to_all": "all-to-all", "barrier": "barrier"}
AXIS_TITLES = {"algorithm": "algorithms over {backend}", "transport": "transports",
               "backend": "torch.distributed on a \"dpkit\" group against a gloo group"}


def allreduce_rows(rows: list[dict]) -> list[dict]:
    """The sweep's rows of a results file (each with its ``axis``, ``transport``, ``algorithm`` and ``label``); the
    file also holds the one-step rows of ``point_to_point``."""
    return [row for row in rows if "algorithm" in row]


def ratio_of(row: dict) -> dict:
    """The row's ratio to torch (``vs_torch``, paired by round, with its interval) in the form of
    ``measure.paired_ratio``."""
    return {"median": row["vs_torch"], "ci_low": row["vs_torch_ci_low"], "ci_high": row["vs_torch_ci_high"],
            "rounds": row["rounds"]}
