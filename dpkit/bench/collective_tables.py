"""The printed report of the collectives benchmark: one table per axis, the correctness line, the target
lines, the anchors' ratios, the latency-bandwidth model, the one-step rows and the backend's latency floor.

    python collectives_benchmark.py --from-json results/collectives.json     # prints it again from a file
    print(report(rows, p2p=point_to_point_rows(rows), fits=fit_model(allreduce_rows(rows))))
"""

from __future__ import annotations

import os

from dpkit.bench import anchors
from dpkit.bench.collective_targets import ratio_text, target_lines
from dpkit.bench.collectives import AXIS_TITLES, NAMES, allreduce_rows, format_size
from dpkit.bench.results import markdown_table
from dpkit.comm import backend

COLUMNS = {
    "algorithm": [("world_size", "procs", "d"), ("size", "size", "s"), ("label", "algorithm", "s"),
                  ("avg_ms", "avg ms", ".3f"), ("p50_ms", "p50 ms", ".3f"), ("p95_ms", "p95 ms", ".3f"),
                  ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"),
                  ("ratio", "p50 / torch [95% CI]", "s"), ("choice", "auto ran", "s"),
                  ("max_abs_error", "max error", ".1e")],
    "transport": [("world_size", "procs", "d"), ("size", "size", "s"), ("label", "transport", "s"),
                  ("algorithm", "algorithm", "s"), ("avg_ms", "avg ms", ".3f"), ("p50_ms", "p50 ms", ".3f"),
                  ("p95_ms", "p95 ms", ".3f"), ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"),
                  ("ratio", "p50 / torch [95% CI]", "s"), ("choice", "auto ran", "s"),
                  ("max_abs_error", "max error", ".1e")],
    "backend": [("world_size", "procs", "d"), ("algorithm", "call", "s"), ("size", "size", "s"),
                ("label", "backend", "s"), ("avg_ms", "avg ms", ".3f"), ("p50_ms", "p50 ms", ".3f"),
                ("p95_ms", "p95 ms", ".3f"), ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"),
                ("ratio", "p50 / gloo [95% CI]", "s"), ("max_abs_error", "max error", ".1e")],
}
FLOOR_COLUMNS = [("world_size", "procs", "d"), ("size", "size", "s"), ("case", "case", "s"),
                 ("us", "us per call", ".1f")]
MODEL_COLUMNS = [("world_size", "procs", "d"), ("algorithm", "algorithm", "s"), ("alpha_us", "alpha us/step", ".1f"),
                 ("gbps", "1/beta GB/s", ".3f"), ("max_rel_error", "worst |pred - meas| / meas", ".2f")]


def floor_table(rows: list[dict]) -> list[str]:
    """The backend's latency floor (rows of ``backend_latency.floor_rows``), one table, oversubscribed runs said so."""
    floor = [r for r in rows if r.get("kind") == "latency floor"]
    if not floor:
        return []
    crowded = sorted({r["world_size"] for r in floor if r.get("oversubscribed")})
    note = f" (oversubscribed: {', '.join(map(str, crowded))} processes on {os.cpu_count()} cores)" if crowded else ""
    shown = [{**r, "size": format_size(r["bytes"]), "us": r["seconds_per_call"] * 1e6} for r in floor]
    return ["", f"## the all-reduce's latency floor on {backend.NAME!r} and what it is made of "
                f"(dpkit/bench/backend_latency.py){note}", "", markdown_table(shown, FLOOR_COLUMNS)]


def report(rows: list[dict], p2p: list[dict] | None = None, fits: list[dict] = ()) -> str:
    """One table per axis, the correctness line, the targets, the model (``fits``: the latency-bandwidth model
    fitted per algorithm, as ``latency_model.fit_model`` gives it), the one-step rows and the backend's latency
    floor."""
    floor = floor_table(rows)
    rows = allreduce_rows(rows)
    lines = []
    for axis in ("algorithm", "transport", "backend"):
        mine = [row for row in rows if row["axis"] == axis]
        if not mine:
            continue
        backends = ", ".join(sorted({row["backend"] for row in mine}))
        collectives = ", ".join(NAMES[c] for c in dict.fromkeys(row.get("collective", "allreduce") for row in mine))
        shown = [{**row, "size": format_size(row["bytes"]), "avg_ms": row["avg_s"] * 1e3, "p50_ms": row["p50_s"] * 1e3,
                  "p95_ms": row["p95_s"] * 1e3, "ratio": ratio_text(row)} for row in mine]
        crowded = sorted({row["world_size"] for row in mine if row.get("oversubscribed")})
        note = (f" (oversubscribed: {', '.join(map(str, crowded))} processes on {os.cpu_count()} cores)"
                if crowded else "")
        lines += [f"## {collectives}: {AXIS_TITLES[axis].format(backend=backends)}{note}", "",
                  markdown_table(shown, COLUMNS[axis]), ""]
    wrong = [row for row in rows if not row["correct"]]
    lines.append(f"correctness: {'all exact' if not wrong else f'{len(wrong)} WRONG results: ' + str(wrong)}")
    lines += target_lines(rows) + anchors.ratio_lines(rows)
    if fits:
        lines += ["", "latency-bandwidth model T = steps x alpha + bytes x beta, fitted per algorithm (model_terms):",
                  markdown_table([{**f, "alpha_us": f["alpha_s"] * 1e6} for f in fits], MODEL_COLUMNS)]
    for row in p2p or []:
        lines.append(f"one step, {row['impl']:>4}: {format_size(row['bytes']):>6}: {row['step_s'] * 1e6:10.1f} us, "
                     f"{row['step_gbps']:.3f} GB/s")
    return "\n".join(lines + floor)
