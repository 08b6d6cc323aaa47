"""The collectives' charts: per size, every algorithm and transport with auto's choice marked; the fitted
latency-bandwidth model against the measurements; and the PNG files ``collectives_benchmark.py`` writes.

    from dpkit.report.collective_plots import plot
    plot(read_results("results/collectives.json")["results"], "results/plots")   # -> the paths written
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt

import numpy as np

from dpkit.bench.collectives import AXIS_TITLES, NAMES, allreduce_rows
from dpkit.bench.point_to_point import point_to_point_rows
from dpkit.report import plots


def draw_per_size(ax, rows: list[dict], backend: str, world_size: int, key: str = "p50_s", scale: float = 1e3,
                  bound: float | None = None, axis: str = "algorithm") -> None:
    """``key`` x ``scale`` against size on log axes for the rows of one axis ("algorithm" or "transport"):
    one line per label in its report colour, with a 95 % bootstrap interval over its per-call rounds where
    the row has them; ``auto``'s measured calls as black crosses, a ring around the algorithm ``auto``
    chose at each size, and ``bound`` as a dashed line."""
    rows = [r for r in rows if (r["backend"], r["world_size"]) == (backend, world_size)]
    mine = [r for r in rows if r["axis"] == axis]
    for label in dict.fromkeys(r["label"] for r in mine):
        points = sorted((r for r in mine if r["label"] == label), key=lambda r: r["bytes"])
        xs, ys = [r["bytes"] for r in points], [r[key] * scale for r in points]
        if label == "auto":
            ax.plot(xs, ys, "kx", markersize=9, label="auto (measured)")
            continue
        spans = [plots.interval(r, key) for r in points]  # None where the row has no per-round values
        errors = [(0.0, 0.0) if span is None else (y - span[0] * scale, span[1] * scale - y)
                  for y, span in zip(ys, spans)]
        ax.errorbar(xs, ys, yerr=np.array(errors).T, marker="o", markersize=4, capsize=2, color=plots.colour(label),
                    label=label if axis == "transport" else label.replace("_", " "))  # transports: registry names
    chosen = [(a["bytes"], r[key] * scale) for a in mine if a["label"] == "auto" and a.get("choice")
              for r in mine if r["label"] == a["choice"] and r["bytes"] == a["bytes"]]
    if chosen:
        ax.plot(*zip(*chosen), "o", markersize=13, markerfacecolor="none", markeredgecolor="k", label="auto's choice")
    if bound:
        ax.axhline(bound, color="#555555", linestyle="--", linewidth=1, label="loopback: one large message")
    sizes = sorted({r["bytes"] for r in mine})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plots.log_axis(ax.xaxis, sizes, lambda v, _: plots.format_bytes(v))
    plots.log_axis(ax.yaxis)
    ax.tick_params(axis="x", labelrotation=45)
    suffix = " (oversubscribed)" if any(r.get("oversubscribed") for r in mine) else ""
    ax.set_title(f"{AXIS_TITLES[axis].format(backend=backend)}, {world_size} processes{suffix}")
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)
    if not mine:
        plots.missing(ax, f"{axis} rows for {world_size} processes on {backend}")


def draw_model(ax, rows: list[dict], fits: list[dict], backend: str, world_size: int) -> None:
    """Measured p50 (points) and the fitted model's prediction (lines: each fit's ``curve``, as
    ``latency_model.fit_model`` returns it), one colour per algorithm."""
    rows = [r for r in rows if r["axis"] == "algorithm"]
    for fit in (f for f in fits if (f["backend"], f["world_size"]) == (backend, world_size)):
        colour = plots.colour(fit["algorithm"])
        ax.plot([b for b, _ in fit["curve"]], [t * 1e3 for _, t in fit["curve"]], color=colour,
                label=f"{fit['algorithm']} (model)")
        measured = sorted((r["bytes"], r["p50_s"] * 1e3) for r in rows
                          if (r["backend"], r["world_size"], r["algorithm"]) == (backend, world_size, fit["algorithm"]))
        ax.plot(*zip(*measured), "o", color=colour)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{backend}, {world_size} processes: model (lines) vs p50 (points)")
    ax.set_xlabel("message size (bytes)")
    ax.grid(True, which="both", alpha=0.3)


def plot(rows: list[dict], directory: str, fits: list[dict] = ()) -> list[str]:
    """Three charts, one column of panels per backend and process count: p50 time and bus bandwidth per size
    (a row of panels per axis: the algorithms over one wire, the transports), and ``fits`` (the fitted model
    of the algorithms, ``latency_model.fit_model``) against their measurements. Returns the paths written."""
    os.makedirs(directory, exist_ok=True)
    # The bus bandwidth's ceiling here: the fastest single large point-to-point message measured on this
    # machine's loopback (ours or gloo's: ``point_to_point``'s rows, written with the 2-process sweep).
    bound = max((r["step_gbps"] for r in point_to_point_rows(rows) if r["bytes"] >= 2**20), default=None)
    rows = allreduce_rows(rows)
    panels = sorted({(row["backend"], row["world_size"]) for row in rows})
    present = [axis for axis in ("algorithm", "transport") if any(row["axis"] == axis for row in rows)]
    paths = []
    collective = rows[0].get("collective", "allreduce") if rows else "allreduce"
    charts = [("time", "p50 time (ms)"), ("busbw", "bus bandwidth (GB/s)")]
    charts += [("model", "time (ms)")] if fits and collective == "allreduce" else []  # the model is all-reduce's
    for chart, label in charts:
        shown = ["algorithm"] if chart == "model" else present
        figure, axes = plt.subplots(len(shown), len(panels), figsize=(4.6 * len(panels) + 2.5, 4.2 * len(shown)),
                                    squeeze=False, layout="constrained")
        for row_axes, axis in zip(axes, shown):
            for ax, (backend, world) in zip(row_axes, panels):
                if chart == "time":
                    draw_per_size(ax, rows, backend, world, axis=axis)
                elif chart == "busbw":
                    draw_per_size(ax, rows, backend, world, key="busbw_gbps", scale=1.0, bound=bound, axis=axis)
                else:
                    draw_model(ax, rows, fits, backend, world)
            row_axes[0].set_ylabel(label)
        handles = {label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())}
        figure.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize="small", frameon=False)
        figure.suptitle(f"{NAMES[collective]}: {label} against size")
        path = os.path.join(directory, f"{collective}_{chart}.png")
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths
