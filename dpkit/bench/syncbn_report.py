"""The printed report of a SyncBatchNorm benchmark run (``syncbn_benchmark.py``): the header printed before
measuring, then times and peak memory per setting and dtype, every ratio with its target and verdict, where the
time goes, the bounds, the targets.

    print(header(env, args))
    print(report(rows))
"""

from __future__ import annotations

from dpkit.bench.measure import format_ratio, oversubscribed
from dpkit.bench.results import format_environment, markdown_table
from dpkit.bench.syncbn_run import SINGLE_ITERS_FACTOR
from dpkit.bench.syncbn_verdicts import (CPU_TARGET, COLD, DTYPES, PATHS, PHASES, REFERENCE, SINGLE, TARGET_GRID,
                                         WORKERS, label, times_by_size)

RATIO_COLUMNS = [("setting", "setting", "s"), ("dtype", "dtype", "s"), ("batch", "batch", "d"),
                 ("hidden", "hidden", "d"), ("text", "ratio [95 % CI]", "s"), ("target", "target", "s"),
                 ("verdict", "verdict", "s"), ("saved_ratio", "saved ratio", ".2f"),
                 ("peak_ratio", "peak ratio", ".2f")]
ATTRIBUTION_COLUMNS = [("size", "size", "s"), ("text", "ours / reference", "s"), ("verdict", "verdict", "s"),
                       ("excess", "ours - reference (us)", ".0f"), ("floor", "of which the floor's (us)", ".0f"),
                       ("own", "of which ours beyond the floor (us)", ".0f"),
                       ("left", f"left to <= {CPU_TARGET} (us)", ".0f"),
                       ("left_grid", f"left to <= {TARGET_GRID} (us)", ".0f")]


def header(env: dict, args) -> str:
    """The environment and how the times were taken (``args.iters`` and ``args.rounds``), printed before measuring."""
    oversub = oversubscribed(env["world_size"], env["device"])
    return (f"{format_environment(env)}\n"
            f"* {args.iters} iterations per implementation and size ({SINGLE_ITERS_FACTOR}x as many with one process "
            f"and warm caches) in {args.rounds} interleaved rounds; "
            "times are medians of the per-iteration maximum over ranks; [torch]: torch.distributed's all_reduce, "
            "[shared_memory]: this host's shared memory"
            + ("; OVERSUBSCRIBED (more processes than cores): timings say little" if oversub else ""))


def _time_table(rows: list[dict], setting: str, dtype: str) -> str:
    impls = list(dict.fromkeys((r["impl"], r.get("transport")) for r in rows if r["kind"] == "time"
                               and r["setting"] == setting and r["dtype"] == dtype))
    by_impl = {c: times_by_size(rows, *c, setting, dtype) for c in impls}
    table = []
    for key in sorted(by_impl[impls[0]]):
        entry = {"batch": key[0], "hidden": key[1]}
        for c in impls:
            entry[label(*c)] = 1e3 * by_impl[c][key]["time_s"]
            entry[label(*c) + " peak"] = by_impl[c][key]["peak_bytes"] / 1024
            entry[label(*c) + " ops"] = by_impl[c][key]["operators"]
        table.append(entry)
    what = "kernels" if rows[0]["device"] == "cuda" else "ops"  # see ``operators``
    columns = [("batch", "batch", "d"), ("hidden", "hidden", "d")]
    columns += [(label(*c), f"{label(*c)} (ms)", ".3f") for c in impls]
    columns += [(label(*c) + " peak", f"{label(*c)} peak (KiB)", ".0f") for c in impls]
    columns += [(label(*c) + " ops", f"{label(*c)} {what}/iter", ".0f") for c in impls]
    return markdown_table(table, columns)


def _breakdown_text(rows: list[dict]) -> list[str]:
    lines = []
    for row in (r for r in rows if r["kind"] == "breakdown"):
        ops = ", ".join(f"{o['op']} {1e6 * o['self_s']:.1f}us x{o['calls']:g}" for o in row["ops"])
        lines.append(f"  {row['setting']}, {row['batch']}x{row['hidden']}, {label(row['impl'], row.get('transport'))}: "
                     f"top operators {1e6 * row['top_self_s']:.0f} us self CPU per iteration: {ops}")
    return lines


def _phases_table(rows: list[dict]) -> str:
    table = [{"size": f"{r['batch']}x{r['hidden']}", "impl": label(r["impl"], r.get("transport")),
              "iteration": 1e6 * r["iteration_s"], **{p: 1e6 * s for p, s in r["phases_s"].items()}}
             for r in rows if r["kind"] == "phases"]
    return markdown_table(table, [("size", "size", "s"), ("impl", "implementation", "s")]
                          + [(p, f"{p} (us)", ".0f") for p in PHASES] + [("iteration", "iteration (us)", ".0f")])


def attribution_lines(rows: list[dict]) -> list[str]:
    """Per transport with engine targets: a table of ours' time beyond the reference split with the floor, then
    what is left and why at every size that does not meet the per-size target."""
    lines = []
    engine = [r for r in rows if r["kind"] == "ratio" and "excess_s" in r]
    for t in dict.fromkeys(r["transport"] for r in engine):
        mine = [r for r in engine if r["transport"] == t]
        table = [{"size": f"{r['batch']}x{r['hidden']}", "text": format_ratio(r), "verdict": r["verdict"],
                  "excess": 1e6 * r["excess_s"], "floor": 1e6 * r["floor_excess_s"], "own": 1e6 * r["own_excess_s"],
                  "left": 1e6 * r["left_s"], "left_grid": 1e6 * r["left_grid_s"]} for r in mine]
        lines.append(f"\n{WORKERS} [{t}]: ours' time beyond {REFERENCE} [{t}], split with the floor "
                     f"(paired per-round medians, us per iteration)\n{markdown_table(table, ATTRIBUTION_COLUMNS)}")
        lines += [f"  {r['why']}" for r in mine if "why" in r]
    return lines




# What the peak column counts, and what every implementation holds outside it alike.
PEAK_LEGEND = ("peak: the bytes torch's allocator held during one iteration above the level before it (no "
               "implementation takes shared memory during an iteration: each sums in buffers made before it); what "
               "each keeps between iterations (parameters, running statistics, the 2C + 1 and 3C values it sums, on "
               "shared memory in the transport's arena, gloo's own buffers on torch) is held before it and not "
               "counted, for any of them")


def report(rows: list[dict]) -> str:
    """Times and peak memory per setting and dtype, the ratios, where the time goes, the bounds, the targets."""
    lines = []
    for setting in (WORKERS, SINGLE, COLD, PATHS):
        for dtype in DTYPES:
            if any(r["kind"] == "time" and r["setting"] == setting and r["dtype"] == dtype for r in rows):
                lines.append(f"\n{setting}, {dtype}: median time per iteration, peak memory, operators dispatched "
                             f"per iteration (with ours' calls into syncbn_channels.c; CUDA: kernels launched; -1: "
                             f"not counted)\n{PEAK_LEGEND}\n"
                             f"{_time_table(rows, setting, dtype)}")
    ratio_rows = [{**r, "text": format_ratio(r), "target": "-" if r["target"] is None else f"<= {r['target']}",
                   "verdict": r["verdict"] or "-"} for r in rows if r["kind"] == "ratio"]
    pairs = dict.fromkeys((r["axis"], r["impl"], r["transport"], r["versus"], r["versus_transport"])
                          for r in ratio_rows)
    for axis, mine, t_mine, versus, t_versus in pairs:
        table = [r for r in ratio_rows if (r["axis"], r["impl"], r["transport"], r["versus"], r["versus_transport"])
                 == (axis, mine, t_mine, versus, t_versus)]
        lines.append(f"\n{axis}: {label(mine, t_mine)} / {label(versus, t_versus)}\n"
                     f"{markdown_table(table, RATIO_COLUMNS)}")
    lines += ["\nWhere the time goes (profiled, self CPU time per iteration):", "\n".join(_breakdown_text(rows))]
    if any(r["kind"] == "phases" for r in rows):
        lines.append(f"\n{WORKERS}: one iteration cut at its two sums (median per phase, slowest rank)\n"
                     f"{_phases_table(rows)}")
    lines.append("\n".join(attribution_lines(rows)))
    if any(r["kind"] in ("bound", "comparison") for r in rows):
        lines.append("\nBounds and the transport axis (no target):")
        lines += [f"  {b['name']}: {format_ratio(b)}" for b in rows if b["kind"] in ("bound", "comparison")]
    lines.append("\nTargets:")
    for t in (r for r in rows if r["kind"] == "target"):
        detail = f" ({format_ratio(t)})" if "median" in t else f" ({t['sizes_met']} of {t['sizes']} sizes)"
        lines.append(f"  {t['name']}: {t['verdict'].upper()}{detail}" + (f": {t['why']}" if "why" in t else ""))
    return "\n".join(lines)
