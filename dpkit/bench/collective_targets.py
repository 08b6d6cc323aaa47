"""The targets of the collectives benchmark and its verdicts on them: per (target, process count, size) the
row's ratio to the axis's reference (torch's collective; gloo's on the backend axis) with its 95 % interval,
met / missed / inconclusive, as printed and as stored in the results file beside the rows.

    checks = target_checks(rows)        # dicts: axis, label, limit, ratio, verdict, ...
    print("\n".join(target_lines(rows)))
"""

from __future__ import annotations

import os

from dpkit.bench.collectives import BACKEND, NAMES, allreduce_rows, format_size, ratio_of
from dpkit.bench.measure import format_ratio, verdict

LARGE = (10 << 20, 100 << 20)
ZERO_COPY = "shared_memory"  # the transport on the buffers it allocates
# (axis, label, sizes it applies to or None for every size, process counts or None for any, largest p50 /
# torch's p50 on that axis). Algorithms: the ring within 10 % of torch at 10 and 100 MB (the first
# all-reduce work), auto within 10 % from the homework's 1,000 elements up and no slower at 10 and 100 MB.
# Transports: the all-reduce of a buffer the shared-memory transport allocated (no copy in or out), 2 ranks.
TARGET = 1.10
TARGETS = [("algorithm", "ring", LARGE, None, TARGET), ("algorithm", "auto", None, None, TARGET),
           ("algorithm", "auto", LARGE, None, 1.00),
           ("transport", ZERO_COPY, (10 << 20,), (2,), 0.45), ("transport", ZERO_COPY, (100 << 20,), (2,), 0.30)]
# Reduce-scatter and all-gather: p2p (the ring) at 10 and 100 MB. gloo emulates reduce-scatter with a full
# all-reduce (twice the bytes of a ring reduce-scatter), so ours should be well under torch's time there.
COLLECTIVE_TARGETS = {"reduce_scatter": 0.70, "all_gather": 1.10}
# Every collective of the backend axis that moves data, on "dpkit" over the same call on gloo, 2 ranks, from
# 4 KiB to 1 MiB (the barrier moves none).
BACKEND_TARGET = ("backend", BACKEND, (4 << 10, 64 << 10, 1 << 20), (2,), 0.25)
# The row each axis's ratios divide by.
REFERENCES = {"algorithm": "torch", "transport": "torch", "backend": "gloo"}


def ratio_text(row: dict) -> str:
    """The row's ratio with its interval, as the tables and the target lines print it ("-": none)."""
    return "-" if row.get("vs_torch") is None else format_ratio(ratio_of(row))


def target_checks(rows: list[dict]) -> list[dict]:
    """One check per (target, process count, size): the ratio to torch on the row's axis, its interval and
    met / missed / inconclusive.

    All-reduce rows meet ``TARGETS``; reduce-scatter and all-gather rows p2p's ``COLLECTIVE_TARGETS`` at
    10 and 100 MB (their sizes are rounded down to a multiple of the world size, as in nccl-tests); every
    backend row but the barrier's ``BACKEND_TARGET``."""
    checks = []
    for row in rows:
        collective = row.get("collective", "allreduce")
        targets = [BACKEND_TARGET] if collective != "barrier" else []
        if collective == "allreduce":
            targets += TARGETS
        elif collective in COLLECTIVE_TARGETS:
            targets.append(("transport", "p2p", LARGE, None, COLLECTIVE_TARGETS[collective]))
        for axis, label, sizes, worlds, limit in targets:
            if (row["axis"], row["label"]) != (axis, label) or row.get("vs_torch") is None:
                continue
            if worlds is not None and row["world_size"] not in worlds:
                continue
            near = min(sizes, key=lambda size: abs(size - row["bytes"])) if sizes is not None else row["bytes"]
            if abs(near - row["bytes"]) >= 64:
                continue
            checks.append({"collective": collective, "axis": axis, "label": label, "algorithm": row["algorithm"],
                           "world_size": row["world_size"], "bytes": near, "limit": limit, "ratio": ratio_of(row),
                           "reference": REFERENCES[axis],
                           "verdict": verdict(ratio_of(row), limit), "oversubscribed": bool(row.get("oversubscribed")),
                           "row": row})
    return checks


def target_line(check: dict) -> str:
    """One check of ``target_checks`` as a printed line."""
    name = check["label"] if check["axis"] == "algorithm" else f"{NAMES[check['collective']]} through {check['label']}"
    label = (f" [oversubscribed: {check['world_size']} processes on {os.cpu_count()} cores]"
             if check["oversubscribed"] else "")
    reference = check.get("reference", "torch")
    return (f"target {name} <= {check['limit']:.2f}x {reference}, {check['world_size']} processes, "
            f"{format_size(check['bytes'])}: {ratio_text(check['row'])} {check['verdict']}{label}")


def target_lines(rows: list[dict]) -> list[str]:
    """``target_checks`` as one printed line each."""
    return [target_line(check) for check in target_checks(rows)]


def stored_targets(rows: list[dict]) -> list[dict]:
    """``target_checks`` as the results file keeps them: each check without its row, with its printed line."""
    return [{**{k: v for k, v in check.items() if k != "row"}, "text": target_line(check)}
            for check in target_checks(allreduce_rows(rows))]
