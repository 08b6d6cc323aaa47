"""What a SyncBatchNorm benchmark's rows mean, and what is judged from them (``syncbn_benchmark.py`` measures them):
the implementations and settings by name, the paired ratios of every comparison the rows allow (axis "impl": two
implementations, one transport; "transport": one implementation, two transports; "path": one layer, another of
``syncbn.PATHS``), the targets with their verdicts and, where one is not met, what is left and why, and the bounds.

    rows = ratios(time_rows)                      # one per (setting, dtype, size, comparison)
    checks = targets(rows, time_rows)             # met / missed / inconclusive, per transport and dtype
    rows = judged(measured_rows)                  # the measured rows, then all of the above and the bounds
"""

from __future__ import annotations

import numpy as np
import torch

from dpkit.bench import transport_choice
from dpkit.bench.measure import format_ratio, paired_ratio, verdict

OURS, LOCAL, REFERENCE = "ours", "BatchNorm1d (local)", "BatchNorm1d + 2 all_reduce"
TORCH_SYNC = "torch.nn.SyncBatchNorm"
# The least a synchronized BatchNorm written as a Python autograd.Function pays with the same two sums
# (``syncbn_floor.FloorFunction``).
FLOOR = "floor: BatchNorm in a Python Function + 2 sums"
# With one process the layer is F.batch_norm; this row times the synchronized computation without its collectives.
SYNC_PATH = "ours, synchronized path without collectives"
WORKERS, SINGLE = "workers", "1 process"  # settings: the spawned group, and one process without a process group
# A third setting, one process again, with a core's own caches emptied before every iteration (``syncbn_run``): the
# state a collective leaves them in for the work after it. It separates the cold caches from the shared cores.
COLD = "1 process, cold caches"
# A fourth, on request (--settings paths): the synchronized path without collectives on each of syncbn.PATHS, one
# process, so that each path's code is weighed against what it gains (axis "path": one layer, another path).
PATHS = "1 process, each path"
PATH_IMPLS = {"c": SYNC_PATH, "kernels": f"{SYNC_PATH}, passes in BatchNorm's kernels",
              "pytorch": f"{SYNC_PATH}, PyTorch operations"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = tuple(DTYPES)
# The ``transport`` field of a row: what carries its sums (None: no sum across ranks, e.g. BatchNorm1d (local)).
TORCH, SHM = "torch", "shared_memory"
# CPU targets (2 workers), per transport t and judged dtype: ours [t] / (BatchNorm1d + 2 all_reduce) [t] per size and
# as the median over the grid; ours / BatchNorm1d with one process. CUDA: ours / torch.nn.SyncBatchNorm.
CPU_TARGET, TARGET_GRID, TARGET_SINGLE, TARGET_CUDA = 1.3, 1.15, 1.2, 1.0
# The dtypes the time targets judge (float16 is timed for information); bfloat16 on the transport "auto" picks.
JUDGED = ("float32", "bfloat16")
# Bounds on each transport, printed as medians over the grid without targets: what ours costs beyond the floor,
# and what the floor costs beyond BatchNorm1d and the same two sums made outside autograd.
BOUNDS = ((OURS, FLOOR), (FLOOR, REFERENCE))

# One iteration with two collectives, cut where the caller blocks on each: what runs around them, how long each waits.
PHASES = ("compute before", "forward all_reduce", "compute between", "backward all_reduce", "compute after")
COMPUTE_PHASES, SUM_PHASES = PHASES[0::2], PHASES[1::2]


def label(impl: str, transport: str | None) -> str:
    """``ours [shared_memory]``: an implementation and the transport of its sums."""
    return impl if transport is None else f"{impl} [{transport}]"


def times_by_size(rows: list[dict], impl: str, transport: str | None, setting: str,
                  dtype: str) -> dict[tuple[int, int], dict]:
    """(batch, hidden) -> the time row of ``impl`` on ``transport`` in ``setting`` and ``dtype``."""
    return {(r["batch"], r["hidden"]): r for r in rows
            if r["kind"] == "time" and (r["impl"], r.get("transport"), r["setting"], r["dtype"]) ==
            (impl, transport, setting, dtype)}


def _transports_in(rows: list[dict]) -> list[str]:
    return transport_choice.in_order(r["transport"] for r in rows if r["kind"] == "time" and r.get("transport"))


def comparisons(rows: list[dict]) -> list[tuple]:
    """(setting, (impl, transport), (versus, transport), target or None, axis) for every ratio the rows allow.
    Axis "impl": two implementations, one transport (or none); "transport": one implementation, two transports."""
    device = rows[0]["device"]
    present = _transports_in(rows)
    out = []
    for t in present:
        out += [(WORKERS, (OURS, t), (REFERENCE, t), CPU_TARGET if device == "cpu" else None, "impl"),
                (WORKERS, (OURS, t), (LOCAL, None), None, "impl"),
                *((WORKERS, (mine, t), (versus, t), None, "impl") for mine, versus in BOUNDS)]
    # The transport axis: each layer on every other transport against itself on torch's (gloo on a CPU), ours and
    # PyTorch's alike (on "torch:dpkit", unchanged code on a process group of the backend "dpkit").
    if TORCH in present:
        out += [(WORKERS, (impl, t), (impl, TORCH), None, "transport")
                for t in present if t != TORCH for impl in (OURS, REFERENCE)]
    if device == "cuda":
        out.append((WORKERS, (OURS, TORCH), (TORCH_SYNC, TORCH), TARGET_CUDA, "impl"))
    out += [(PATHS, (impl, None), (SYNC_PATH, None), None, "path") for impl in list(PATH_IMPLS.values())[1:]]
    out += [(SINGLE, (OURS, None), (LOCAL, None), TARGET_SINGLE, "impl"),
            (SINGLE, (SYNC_PATH, None), (LOCAL, None), None, "impl"),
            (COLD, (SYNC_PATH, None), (LOCAL, None), None, "impl")]
    # --baseline: the A/B of a change, ours now against ours at the given revision, on the same transport.
    for impl, t in dict.fromkeys((r["impl"], r.get("transport")) for r in rows if r["kind"] == "time"):
        if "@" in impl:
            out.append((WORKERS if impl.startswith(OURS + "@") else SINGLE, (impl.split("@")[0], t), (impl, t), None,
                        "impl"))
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """One row per (setting, dtype, size, comparison): the paired ratio of round medians, and a verdict when
    it carries a target (float32 only); the engine targets on the CPU carry their attribution (``_attribution``)."""
    device = rows[0]["device"]
    out = []
    for setting, (mine, t_mine), (versus, t_versus), limit, axis in comparisons(rows):
        for dtype in sorted({r["dtype"] for r in rows if r["kind"] == "time" and r["setting"] == setting}):
            ours = times_by_size(rows, mine, t_mine, setting, dtype)
            theirs = times_by_size(rows, versus, t_versus, setting, dtype)
            floors = times_by_size(rows, FLOOR, t_mine, setting, dtype) if versus == REFERENCE and mine == OURS else {}
            for key in sorted(set(ours) & set(theirs)):
                ratio = paired_ratio(ours[key]["round_p50_s"], theirs[key]["round_p50_s"])
                target = limit if dtype in JUDGED else None
                row = {"kind": "ratio", "impl": mine, "versus": versus, "transport": t_mine,
                       "versus_transport": t_versus, "axis": axis, "setting": setting, "dtype": dtype,
                       "device": device, "batch": key[0], "hidden": key[1], **ratio, "target": target,
                       "verdict": None if target is None else verdict(ratio, target),
                       "saved_ratio": ours[key]["saved_bytes"] / theirs[key]["saved_bytes"],
                       "peak_ratio": ours[key]["peak_bytes"] / max(1, theirs[key]["peak_bytes"])}
                if target is not None and key in floors:
                    row.update(_attribution(ours[key], theirs[key], floors[key], target,
                                            _phases_of(rows, t_mine, key, dtype)))
                    if row["verdict"] != "met":
                        row["why"] = _why(row)
                out.append(row)
    return out


def _phases_of(rows: list[dict], transport: str, key: tuple[int, int], dtype: str) -> dict[str, dict]:
    """impl -> its phases row at this size on this transport (phases are cut at the profiled sizes, float32, only)."""
    return {r["impl"]: r for r in rows if r["kind"] == "phases" and r.get("transport") == transport
            and (r["batch"], r["hidden"]) == key and r["dtype"] == dtype}


def _attribution(ours: dict, reference: dict, floor: dict, limit: float, cut: dict[str, dict]) -> dict:
    """Where ours' time beyond the reference goes at one size, from per-round medians paired round by round.

    ``excess_s``: ours - reference; ``floor_excess_s``: floor - reference (the Python Function frame and the sums'
    place in the graph, which any layer of this design pays); ``own_excess_s``: the rest, ours beyond the floor
    (packing, the float64 combination, dx's global terms). ``left_s`` / ``left_grid_s``: what ours must lose to be
    ``limit`` / ``TARGET_GRID`` times the reference (negative: within it). With phases at this size,
    ``compute_excess_s`` and ``wait_excess_s`` split ours - reference into compute and waiting in the two sums."""
    o, r, f = (np.array(row["round_p50_s"]) for row in (ours, reference, floor))
    excess, floor_excess = float(np.median(o - r)), float(np.median(f - r))
    out = {"excess_s": excess, "floor_excess_s": floor_excess, "own_excess_s": excess - floor_excess,
           "left_s": float(np.median(o - limit * r)), "left_grid_s": float(np.median(o - TARGET_GRID * r)),
           "floor_ratio": float(np.median(f / r)), "floor_verdict": verdict(paired_ratio(list(f), list(r)), limit)}
    if OURS in cut and REFERENCE in cut:
        total = {impl: (sum(cut[impl]["phases_s"][p] for p in COMPUTE_PHASES),
                        sum(cut[impl]["phases_s"][p] for p in SUM_PHASES)) for impl in (OURS, REFERENCE)}
        out["compute_excess_s"] = total[OURS][0] - total[REFERENCE][0]
        out["wait_excess_s"] = total[OURS][1] - total[REFERENCE][1]
    return out


def _us(seconds: float) -> str:
    return f"{1e6 * seconds:.0f} us"


def _signed(seconds: float) -> str:
    return f"{1e6 * seconds:+.0f} us"


def _share(part: float, whole: float) -> str:
    return f" ({100 * part / whole:.0f} %)"


def _more(seconds: float) -> str:
    """``<n> us more`` or ``<n> us less``."""
    return f"{_us(abs(seconds))} {'more' if seconds >= 0 else 'less'}"


def _why(row: dict) -> str:
    """One size's miss of the engine target (a ratio row with ``_attribution``), said from its numbers."""
    limit, excess = row["target"], row["excess_s"]
    own, floor = row["own_excess_s"], row["floor_excess_s"]
    if row["left_s"] > 0:
        left = f"it must lose {_us(row['left_s'])} of its {_us(excess)} beyond the reference to meet <= {limit}"
    else:
        left = (f"its median is {_us(-row['left_s'])} within <= {limit} but the interval reaches above it: "
                "more rounds would decide")
    shares = floor >= 0 and own >= 0 and excess > 0  # parts of the excess only when both are
    size = f"{row['batch']}x{row['hidden']}{_tag(row['transport'], row['dtype'])}"
    text = (f"{size}: ours {format_ratio(row)} the reference, {row['verdict']}; {left}. The floor (a Python "
            f"autograd.Function around BatchNorm's kernels, the sums inside it) takes {row['floor_ratio']:.2f}x the "
            f"reference: {_signed(floor)}"
            f"{_share(floor, excess) if shares else ''} is that frame and the sums' place in the graph, "
            f"{_signed(own)}{_share(own, excess) if shares else ''} ours beyond the floor (packing, the float64 "
            "combination, dx's global terms: on the CPU its C calls).")
    if row["floor_verdict"] == "missed":  # the floor's whole interval above the target, not its median alone
        text += f" The floor alone is above {limit}x: no layer written as a Python autograd.Function meets it here."
    elif row["floor_ratio"] > limit:
        text += (f" The floor's median is above {limit}x, its interval not: whether the floor alone misses is "
                 "inconclusive.")
    elif row["left_s"] > 0:
        text += f" The floor is within it: ours beyond the floor ({_us(own)}) must shrink by {_us(row['left_s'])}."
    if "compute_excess_s" in row:
        text += (f" Cut at its two sums, ours computes {_more(row['compute_excess_s'])} than the reference per "
                 f"iteration and waits {_more(row['wait_excess_s'])} in the sums.")
    return text


def _grid_ratio(entries: list[dict]) -> dict:
    """The median over the grid, round by round (round r of every size), summarised like one paired ratio."""
    per_round = np.median(np.array([e["per_round"] for e in entries]), axis=0)
    ratio = paired_ratio(list(per_round), [1.0] * len(per_round))
    return {**ratio, "sizes": len(entries)}


def _tag(transport: str | None, dtype: str = "float32") -> str:
    """How a target's name says its transport and, other than float32, its dtype: " [shared_memory], bfloat16"."""
    return ("" if transport is None else f" [{transport}]") + ("" if dtype == "float32" else f", {dtype}")


def _grid_why(entries: list[dict]) -> str:
    """Why the median over the grid misses ``TARGET_GRID``: the sizes above it, and the floor's share there."""
    def size(e: dict) -> str:
        cut = f" ({_us(e['left_grid_s'])} to cut)" if e.get("left_grid_s", 0) > 0 else ""
        return f"{e['batch']}x{e['hidden']} {e['median']:.2f}x{cut}"

    above = [e for e in entries if e["median"] > TARGET_GRID]
    text = (f"{len(above)} of {len(entries)} sizes above {TARGET_GRID}x: {', '.join(map(size, above))}." if above else
            f"no size's median is above {TARGET_GRID}x, but the interval over the grid reaches above it.")
    floors = [e["floor_ratio"] for e in entries if "floor_ratio" in e]
    if floors:
        floor = float(np.median(floors))
        text += (f" The floor's median over the grid is {floor:.2f}x the reference"
                 + (f", itself above {TARGET_GRID}x: the Function frame alone misses it." if floor > TARGET_GRID
                    else ": ours beyond the floor is what must shrink."))
    return text


def targets(ratio_rows: list[dict], time_rows: list[dict]) -> list[dict]:
    """The issue's targets, each with its verdict, per transport and dtype (``JUDGED``; memory: every dtype timed);
    a missed engine target says why."""
    out = []
    groups = dict.fromkeys((r["setting"], r["versus"], r["transport"], r["dtype"]) for r in ratio_rows
                           if r["target"] is not None)
    for setting, versus, t, dtype in groups:
        entries = [r for r in ratio_rows if (r["setting"], r["versus"], r["transport"], r["dtype"]) ==
                   (setting, versus, t, dtype) and r["target"] and r["impl"] == OURS]
        limit = entries[0]["target"]
        verdicts = [e["verdict"] for e in entries]
        worst = "missed" if "missed" in verdicts else ("inconclusive" if "inconclusive" in verdicts else "met")
        row = {"kind": "target", "name": f"{setting}{_tag(t, dtype)}: every size, ours / ({versus}) <= {limit}",
               "axis": "impl", "setting": setting, "versus": versus, "transport": t, "dtype": dtype, "limit": limit,
               "verdict": worst, "sizes_met": verdicts.count("met"), "sizes": len(entries)}
        if worst != "met":
            missed = ", ".join(f"{e['batch']}x{e['hidden']} {e['verdict']}" for e in entries if e["verdict"] != "met")
            row["why"] = f"not met at {missed}" + ("; per size, the ratio rows' 'why'"
                                                   if any("why" in e for e in entries)
                                                   else "")
        out.append(row)
        if setting == WORKERS and versus == REFERENCE:
            grid = _grid_ratio(entries)
            name = f"{setting}{_tag(t, dtype)}: median over the grid, ours / ({versus}) <= {TARGET_GRID}"
            row = {"kind": "target", "name": name, "axis": "impl", "setting": setting, "versus": versus, "transport": t,
                   "dtype": dtype, "limit": TARGET_GRID, **grid, "verdict": verdict(grid, TARGET_GRID)}
            if row["verdict"] != "met":
                row["why"] = _grid_why(entries)
            out.append(row)
    timed = dict.fromkeys((r["setting"], r["dtype"]) for r in time_rows if r["kind"] == "time")
    for what in ("saved_bytes", "peak_bytes"):
        for setting, dtype in sorted(timed, key=lambda pair: (pair[0], DTYPE_NAMES.index(pair[1]))):
            local = times_by_size(time_rows, LOCAL, None, setting, dtype)
            for t in (_transports_in(time_rows) if setting == WORKERS else [None]):
                ours = times_by_size(time_rows, OURS, t, setting, dtype)
                if not ours:  # COLD times the synchronized path only; half dtypes run on one transport
                    continue
                worse = [key for key in ours if key in local and ours[key][what] > local[key][what]]
                out.append({"kind": "target",
                            "name": f"{setting}{_tag(t, dtype)}: {what} of ours <= BatchNorm1d's at every size",
                            "axis": "impl", "setting": setting, "transport": t, "dtype": dtype, "limit": 1.0,
                            "verdict": "missed" if worse else "met", "sizes": len(ours),
                            "sizes_met": len(ours) - len(worse)})
    return out


def bounds(ratio_rows: list[dict]) -> list[dict]:
    """Medians over the grid without a target (float32): each of ``BOUNDS`` on each transport (kind "bound"), and
    the transport axis, each layer on each other transport / itself on torch's (kind "comparison")."""
    out = []
    float32 = [r for r in ratio_rows if r["dtype"] == "float32" and r["setting"] == WORKERS]
    for t in transport_choice.in_order(r["transport"] for r in float32 if r["transport"]):
        for mine, versus in BOUNDS:
            entries = [r for r in float32 if (r["impl"], r["versus"], r["transport"], r["versus_transport"]) ==
                       (mine, versus, t, t)]
            if entries:
                out.append({"kind": "bound", "name": f"{WORKERS}{_tag(t)}: median over the grid, {mine} / ({versus})",
                            "setting": WORKERS, "impl": mine, "versus": versus, "transport": t, **_grid_ratio(entries)})
    across = [r for r in float32 if r["axis"] == "transport"]
    for impl, t, versus_t in dict.fromkeys((r["impl"], r["transport"], r["versus_transport"]) for r in across):
        entries = [r for r in across if (r["impl"], r["transport"], r["versus_transport"]) == (impl, t, versus_t)]
        out.append({"kind": "comparison", "name": f"{WORKERS}: median over the grid, {label(impl, t)} / "
                    f"{label(impl, versus_t)} (the transport alone, the same layer)", "setting": WORKERS,
                    "impl": impl, "versus": impl, "transport": t, "versus_transport": versus_t,
                    **_grid_ratio(entries)})
    return out


def judged(rows: list[dict]) -> list[dict]:
    """The measured rows (times, profiles, phases), then the ratios, the targets and the bounds derived from them."""
    time_rows = [r for r in rows if r["kind"] in ("time", "breakdown", "phases")]
    ratio_rows = ratios(time_rows)
    return time_rows + ratio_rows + targets(ratio_rows, time_rows) + bounds(ratio_rows)
