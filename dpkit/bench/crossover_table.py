"""Auto's crossover table derived from measured rows: per world size, which point-to-point all-reduce is
fastest up to which size, in the form ``dpkit.comm.message_passing`` reads from results/crossover.json.

    python collectives_benchmark.py --tune      # measures the algorithms, writes the table
    table = crossover_table(rows, ("ring", "recursive_doubling")); print(format_table(table))
"""

from __future__ import annotations

import math

from dpkit.bench.collectives import format_size


def crossover_table(rows: list[dict], algorithms) -> dict[int, tuple]:
    """Per world size: the fastest of ``algorithms`` (the point-to-point ones) at each measured size, in the
    form of ``message_passing.CROSSOVER``; consecutive sizes with the same winner merge, and a bound between two
    sizes sits at their geometric mean.

    The winner at a size minimises its p50 relative to the fastest, averaged (geometrically) over
    that size and its two neighbours: on a shared machine single sizes flip between algorithms
    within a few per cent, and a table that flips with them would be noise, not a crossover.
    """
    table = {}
    for n in sorted({r["world_size"] for r in rows if r["world_size"] > 1}):
        mine = [r for r in rows if r["world_size"] == n and r["algorithm"] in algorithms
                and r.get("axis", "algorithm") == "algorithm"]
        sizes = sorted({r["bytes"] for r in mine})
        names = sorted({r["algorithm"] for r in mine})
        p50 = {(r["algorithm"], r["bytes"]): r["p50_s"] for r in mine}
        # log(p50 / fastest p50) per (algorithm, size); an algorithm not measured at a size never wins there.
        relative = {(a, s): math.log(p50[a, s] / min(p50[b, s] for b in names if (b, s) in p50))
                    if (a, s) in p50 else math.inf
                    for a in names for s in sizes}
        winners = []
        for i, size in enumerate(sizes):
            around = sizes[max(0, i - 1):i + 2]
            winners.append(min(names, key=lambda a: (relative[a, size] == math.inf,
                                                     sum(relative[a, s] for s in around) / len(around))))
        entries = []
        for i, name in enumerate(winners):
            if i + 1 < len(winners) and winners[i + 1] != name:
                entries.append((int(math.sqrt(sizes[i] * sizes[i + 1])), name))
        entries.append((None, winners[-1]))
        table[n] = tuple(entries)
    return table


def format_table(table: dict[int, tuple]) -> str:
    """One line per world size: which algorithm auto runs up to which size."""
    return "\n".join(f"{n} processes: " + ", ".join(f"{name} up to {format_size(bound)}" if bound else f"{name} above"
                                                   for bound, name in entries) for n, entries in table.items())
