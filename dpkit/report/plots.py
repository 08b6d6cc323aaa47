"""How this project draws its figures: one style, and one function per figure of the report.

    from dpkit.report import plots
    from dpkit.bench import results
    figure = plots.ddp_variants(results.read_results("results/ddp_benchmark.json"))
    figure.savefig("ddp.png")

Every function takes loaded result documents (the layout of ``results.read_results``) and
returns a matplotlib Figure; nothing is shown or saved here. The style is the same in every
figure: one colour per implementation or algorithm (``colour``), one line style per world size
(``line_style``), legends outside the data, log axes with plain tick labels, sizes in
KiB/MiB/GiB, error bars from 95 % bootstrap intervals over rounds wherever a row carries its
per-round values (their range below ``MIN_BOOTSTRAP_ROUNDS`` rounds; or ``ci_low``/``ci_high``),
and runs with more processes than CPU cores (oversubscribed) drawn grey and hatched. Rows are
read by field name; a figure whose optional fields are missing says so on the figure instead of failing.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable

import matplotlib.pyplot as plt  # without a display, matplotlib picks its Agg backend itself
import matplotlib.ticker as ticker
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dpkit.bench import row_identity, syncbn_verdicts
from dpkit.bench.measure import PHASES, bootstrap_ci, paired_ratio
from dpkit.engines import registry
# Re-exported: the report reads them from here with the figures.
from dpkit.report.findings import MIN_BOOTSTRAP_ROUNDS, interval_name, oversubscribed  # noqa: F401

# One colour per implementation or algorithm, in every figure (Okabe-Ito, readable by colour-blind readers).
COLOURS = {
    "ours": "#0072B2", "ddp ours": "#0072B2", "ring": "#0072B2",  # "ddp ours": ddp_benchmark's rows of our DDP
    "pytorch": "#E69F00", "ddp pytorch": "#E69F00", "torch": "#E69F00",
    "ddp pytorch best": "#D55E00",
    "ddp ours overlap": "#009E73", "butterfly": "#009E73",
    "ddp ours flat": "#CC79A7", "halving_doubling": "#CC79A7",
    "ddp ours naive": "#56B4E9", "tree": "#56B4E9",
    "recursive_doubling": "#882255", "shared_memory": "#999933", "auto": "#000000",
    # The transports of collectives_benchmark.py (rows labelled by transport, not by algorithm).
    "shared_memory:staged": "#DDCC77", "p2p": "#332288",
    "no ddp": "#000000", "no_ddp": "#000000",
    "BatchNorm1d (local)": "#999999", "BatchNorm1d + 2 all_reduce": "#000000",
    "BatchNorm1d + 2 shared-memory all_reduce": "#555555",
}
OTHER = "#7F7F7F"
# A name without a colour above (an engine or transport a user registered): one of these, the same for the name in
# every figure and run (grey stays for oversubscribed runs).
MORE_COLOURS = ("#117733", "#44AA99", "#AA4499", "#661100", "#6699CC", "#888800")
LINE_STYLES = {1: ":", 2: "-", 4: "--", 8: "-.", 16: (0, (5, 1)), 32: (0, (1, 1))}
OVERSUBSCRIBED = dict(color="#BBBBBB", hatch="///", edgecolor="#555555")
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SEED_STYLE = dict(color="#555555")  # a seed's numbers, drawn beside ours


# --------------------------------------------------------------------------- style helpers


def is_pytorch_best(row: dict) -> bool:
    """PyTorch's DDP at its best documented settings: a row of implementation "pytorch" and option "best", or a
    'ddp pytorch...' row whose configuration sets gradient_as_bucket_view."""
    if (row.get("impl"), row.get("option")) == ("pytorch", "best"):
        return True
    return str(row.get("label", "")).startswith("ddp pytorch") and "gradient_as_bucket_view" in json.dumps(row)


def kind(row_or_name) -> str:
    """The implementation a row or name belongs to: 'ddp ours 25M' -> 'ddp ours', a best-settings PyTorch row ->
    'ddp pytorch best'."""
    if isinstance(row_or_name, dict):
        if "bucket_cap_mb" in row_or_name and "engine" in row_or_name:  # ddp_benchmark.py's rows, by their fields
            return row_identity.name(row_or_name)
        if is_pytorch_best(row_or_name):
            return "ddp pytorch best"
        name = (row_or_name.get("variant") or row_or_name.get("algorithm") or row_or_name.get("impl")
                or row_or_name.get("label", ""))
    else:
        name = row_or_name
    name = str(name)
    if name in COLOURS:
        return name
    return re.sub(r"[ _-]?\d+(\.\d+)?M$", "", name.strip())  # drop a bucket-size suffix


def colour(row_or_name) -> str:
    name = kind(row_or_name)
    if name in COLOURS:
        return COLOURS[name]
    return MORE_COLOURS[zlib.crc32(name.encode()) % len(MORE_COLOURS)] if name else OTHER


def line_style(world_size: int):
    return LINE_STYLES.get(int(world_size), "-")


def format_bytes(n: float) -> str:
    """Binary units: 65536 -> '64 KiB', 10485760 -> '10 MiB'."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) or value >= 10 else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def log_axis(axis, values: Iterable[float] | None = None, formatter=None) -> None:
    """Plain tick labels (or ``formatter``'s) on an axis already set to log scale, at ``values`` when given."""
    fmt = formatter or (lambda v, _: f"{v:g}")
    if values is not None:
        axis.set_major_locator(ticker.FixedLocator(sorted(set(values))))
    axis.set_major_formatter(ticker.FuncFormatter(fmt))
    axis.set_minor_formatter(ticker.NullFormatter())


def _log_x(ax, values=None, formatter=None):
    ax.set_xscale("log")
    log_axis(ax.xaxis, values, formatter)


def _log_y(ax, values=None, formatter=None):
    ax.set_yscale("log")
    log_axis(ax.yaxis, values, formatter)


def _figure(nrows: int = 1, ncols: int = 1, width: float = 11.0, height: float = 3.6, **kw):
    figure, axes = plt.subplots(nrows, ncols, figsize=(width, height * nrows), squeeze=False, layout="constrained",
                                **kw)
    for ax in axes.flat:
        ax.grid(True, which="major", alpha=0.3)
    return figure, axes


def _legend_outside(figure: Figure, handles=None, labels=None, title: str | None = None) -> None:
    """One legend for the whole figure, right of the data."""
    if handles is None:
        seen = {}
        for ax in figure.axes:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(label, handle)
        labels, handles = list(seen), list(seen.values())
    if handles:
        figure.legend(handles, labels, loc="outside right upper", title=title, fontsize="small", frameon=False)


def missing(ax, what: str) -> None:
    """Say on the figure what the results file lacks, instead of failing or drawing nothing silently."""
    ax.text(0.5, 0.5, f"not in this results file:\n{what}", transform=ax.transAxes, ha="center", va="center",
            fontsize="small", color="#AA0000", wrap=True)


def shade_oversubscribed(ax, worlds: Iterable[int], label: str = "oversubscribed") -> None:
    """Grey, hatched band over the oversubscribed world sizes of a log x axis (nothing when there are none)."""
    worlds = list(worlds)
    if worlds:
        ax.axvspan(min(worlds) / 1.2, max(worlds) * 1.2, facecolor=OVERSUBSCRIBED["color"], alpha=0.35,
                   hatch=OVERSUBSCRIBED["hatch"], edgecolor=OVERSUBSCRIBED["edgecolor"], linewidth=0, label=label)


# --------------------------------------------------------------------------- intervals


def round_values(row: dict, key: str) -> list[float] | None:
    """The per-round values of statistic ``key`` (``round_p50_s`` for ``p50_s``), or None."""
    values = row.get(f"round_{key}")
    return [float(v) for v in values] if isinstance(values, list) and values else None


def interval(row: dict, key: str) -> tuple[float, float] | None:
    """An interval of ``row[key]``: ``<key>_ci_low``/``_ci_high`` when the row has them, else over its per-round
    values ``round_<key>`` the 95 % bootstrap interval of their median, or with fewer than
    ``MIN_BOOTSTRAP_ROUNDS`` rounds their range (min, max); None without rounds."""
    low, high = row.get(f"{key}_ci_low"), row.get(f"{key}_ci_high")
    if low is not None and high is not None:
        return float(low), float(high)
    rounds = round_values(row, key)
    if not rounds or len(rounds) < 2:
        return None
    return bootstrap_ci(rounds) if len(rounds) >= MIN_BOOTSTRAP_ROUNDS else (min(rounds), max(rounds))


def ratio(ours: dict, theirs: dict, key: str = "p50_s") -> dict | None:
    """ours / theirs: the paired per-round ratio with its interval when both rows hold the same rounds,
    else the plain ratio of ``key`` with no interval (``ci_low``/``ci_high`` None)."""
    a, b = round_values(ours, key), round_values(theirs, key)
    if a and b and len(a) == len(b):
        return paired_ratio(a, b)
    if ours.get(key) is None or not theirs.get(key):
        return None
    return {"median": ours[key] / theirs[key], "ci_low": None, "ci_high": None, "rounds": None}


def _yerr(centre: float, bounds: tuple[float, float] | None) -> list[list[float]]:
    if bounds is None:
        return [[0.0], [0.0]]
    return [[max(0.0, centre - bounds[0])], [max(0.0, bounds[1] - centre)]]


# --------------------------------------------------------------------------- training


def training_curves(runs: dict[str, dict]) -> Figure:
    """Loss and accuracy against epoch, and the time per optimizer step, for each training run
    (``{"ours": doc, "pytorch": doc}`` of ``ddp_cifar100.py --metrics-json``)."""
    figure, axes = _figure(1, 3, height=3.4)
    loss_ax, acc_ax, time_ax = axes[0]
    markers = ("o", "x", "s", "^")
    for (name, doc), marker in zip(runs.items(), markers):
        epochs = [r for r in doc["results"] if r.get("kind") == "epoch"]
        x = [r["epoch"] for r in epochs]
        c = colour(name)
        # Dashes on the second run let identical curves both show.
        dash = "-" if marker == "o" else "--"
        loss_ax.plot(x, [r["train_loss"] for r in epochs], dash, color=c, marker=marker, label=name)
        loss_ax.plot(x, [r["val_loss"] for r in epochs], dash, color=c, marker=marker, alpha=0.45)
        acc_ax.plot(x, [100 * r["val_acc"] for r in epochs], dash, color=c, marker=marker)
        if all("epoch_time_s" in r and r.get("steps") for r in epochs):
            steps = np.diff([0] + [r["steps"] for r in epochs])  # ``steps`` counts from the start of training
            time_ax.plot(x, [r["epoch_time_s"] / n for r, n in zip(epochs, steps)], dash, color=c, marker=marker)
        final = next((r for r in doc["results"] if r.get("kind") == "final"), {})
        if final.get("step_time_median_s") is not None:
            time_ax.axhline(final["step_time_median_s"], color=c, linestyle=":",
                            label=f"{name}: median step of the run")
    loss_ax.set(xlabel="epoch", ylabel="cross-entropy loss (nats)", title="loss: train (dark), validation (light)")
    acc_ax.set(xlabel="epoch", ylabel="validation accuracy (%)", title="validation accuracy")
    time_ax.set(xlabel="epoch", ylabel="time per optimizer step (s)", title="time per step (epoch mean)")
    if not time_ax.lines:
        missing(time_ax, "epoch_time_s / steps")
    time_ax.set_ylim(bottom=0)
    for ax in axes[0]:
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    _legend_outside(figure)
    return figure


# --------------------------------------------------------------------------- SyncBatchNorm


SYNCBN_REFERENCE = "BatchNorm1d + 2 all_reduce"
# The least a Python autograd.Function with those two sums costs, drawn against the reference.
SYNCBN_FLOOR = syncbn_verdicts.FLOOR


_ONLY = object()  # syncbn_ratios' default transport: the one the file times ``impl`` and ``reference`` on


def syncbn_ratios(doc: dict, reference: str = SYNCBN_REFERENCE, impl: str = "ours", transport=_ONLY) -> list[dict]:
    """Per (batch, hidden): ``impl`` / ``reference`` time on one transport (rows of ``transport``), paired by round,
    with its interval. By default the file's only transport for these two; ValueError when it has several (a ratio
    never mixes two transports)."""
    # syncbn_benchmark.py also writes one-process, float16/bfloat16, ratio and target rows: keep float32 times of
    # the workers.
    times = [r for r in doc["results"] if r["kind"] == "time" and (r["setting"], r["dtype"]) == ("workers", "float32")]
    if transport is _ONLY:
        present = sorted({r["transport"] for r in times if r["impl"] in (impl, reference)}, key=str)
        if len(present) > 1:
            raise ValueError(f"the file times {impl!r} and {reference!r} on transports {present}: pass transport=")
        transport = present[0] if present else None
    rows = [r for r in times if r["transport"] == transport]
    ref = {(r["batch"], r["hidden"]): r for r in rows if r["impl"] == reference}
    return [{"batch": r["batch"], "hidden": r["hidden"], "workers": r["workers"], "transport": transport,
             **ratio(r, ref[(r["batch"], r["hidden"])], "p50_s")}
            for r in rows if r["impl"] == impl and (r["batch"], r["hidden"]) in ref]


def _ratio_bars(ax, points: list[dict], offset: float, width: float, color: str, label: str,
                interval_label: str | None) -> None:
    """Bars of ``points`` (paired ratio rows, in x order) shifted by ``offset``, with their 95 % intervals."""
    x = np.arange(len(points)) + offset
    ax.bar(x, [p["median"] for p in points], color=color, width=width, label=label)
    if points:
        yerr = np.array([_yerr(p["median"], (p["ci_low"], p["ci_high"])) for p in points])
        ax.errorbar(x, [p["median"] for p in points], yerr=yerr[:, :, 0].T, fmt="none", ecolor="black", capsize=4,
                    label=interval_label)


def syncbn_grid(doc: dict, target: float = 1.3) -> Figure:
    """Ours / (BatchNorm1d + the two all_reduce calls any synchronized BatchNorm needs) on the same transport,
    per size, one panel per batch, a bar per transport in the file (gloo; this host's shared memory), and the
    floor / the reference on shared memory (the least a layer written as a Python Function costs there);
    error bars: 95 % intervals where the rows carry them; the target as a line. Engine against engine only:
    no bar divides a time on one transport by a time on another."""
    transports = sorted({r["transport"] for r in doc["results"] if r["kind"] == "time" and r["impl"] == "ours"
                         and r["setting"] == "workers"}, key=str)
    # Ours in its own colour on torch.distributed's, in each other transport's elsewhere (one bar per transport).
    pairs = [("ours", t, colour("ours") if t == "torch" else colour(t)) for t in transports]
    pairs += [(SYNCBN_FLOOR, t, "#BBBBBB") for t in transports if t == "shared_memory"]
    series = [(impl, t, bar, syncbn_ratios(doc, SYNCBN_REFERENCE, impl, t)) for impl, t, bar in pairs]
    series = [s for s in series if s[-1]] or series[:1] or [("ours", None, colour("ours"), [])]
    batches = sorted({r["batch"] for r in series[0][-1]})
    figure, axes = _figure(1, max(1, len(batches)), width=4.2 * max(1, len(batches)) + 2, height=3.4, sharey=True)
    width = 0.6 / len(series)
    for ax, batch in zip(axes[0], batches):
        for k, (impl, transport, bar, ratios) in enumerate(series):
            points = sorted((r for r in ratios if r["batch"] == batch), key=lambda r: r["hidden"])
            on = f" [{transport}]" if transport else ""
            _ratio_bars(ax, points, (k - (len(series) - 1) / 2) * width, width, bar,
                        f"{'floor' if impl == SYNCBN_FLOOR else impl}{on} / ({SYNCBN_REFERENCE}){on}",
                        "95 % interval" if k == 0 else None)
        ax.axhline(target, color="#AA0000", linestyle="--", label=f"target {target:g}x")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(points)), [str(p["hidden"]) for p in points])
        workers = points[0].get("workers") if points else None
        ax.set(xlabel="hidden size (channels)", title=f"batch {batch}" + (f", {workers} workers" if workers else ""))
    if not batches:
        missing(axes[0][0], "rows of impl 'ours' and 'BatchNorm1d + 2 all_reduce'")
    axes[0][0].set_ylabel("time ratio (x)")
    _legend_outside(figure)
    return figure


# --------------------------------------------------------------------------- all-reduce (the homework's tables)


def allreduce_table(doc: dict) -> Figure:
    """The homework's all-reduce tables as a chart: time (top) and error against the exact mean
    (bottom) against world size, one panel per tensor size, one colour per algorithm, every algorithm
    over the same wire (the run's backend); world sizes above the machine's cores are shaded as
    oversubscribed."""
    rows, env = doc["results"], doc.get("env", {})
    sizes = sorted({r["numel"] for r in rows})
    worlds = sorted({r["world_size"] for r in rows})
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    figure, axes = _figure(2, len(sizes), width=3.6 * len(sizes) + 2, height=3.0, sharex=True)
    for column, numel in enumerate(sizes):
        time_ax, error_ax = axes[0][column], axes[1][column]
        for algorithm in algorithms:
            style = dict(color=colour(algorithm), linestyle="-")
            points = sorted((r["world_size"], r) for r in rows if r["numel"] == numel and r["algorithm"] == algorithm)
            time_ax.plot([w for w, _ in points], [1e3 * r["time_s"] for _, r in points], marker="o",
                         label=algorithm.replace("_", "-"), **style)
            errors = [(w, r["max_abs_error"]) for w, r in points if w > 1 and r.get("max_abs_error") is not None]
            error_ax.plot([w for w, _ in errors], [e for _, e in errors], marker="o", **style)
        over = [w for w in worlds if oversubscribed({"world_size": w}, env)]
        for ax in (time_ax, error_ax):
            _log_x(ax, worlds)
            shade_oversubscribed(ax, over, f"oversubscribed (> {env.get('cpus')} cores)")
        _log_y(time_ax)
        time_ax.set(title=f"{numel:,} float32 ({format_bytes(4 * numel)})")
        error_ax.set_ylim(bottom=0)
        error_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        error_ax.set(xlabel="processes")
    axes[0][0].set_ylabel("time (ms, median of slowest rank)")
    axes[1][0].set_ylabel("max |result - exact mean|")
    wire = env.get("backend") or "one backend"
    figure.suptitle(f"all-reduce algorithms, all over {wire}")
    _legend_outside(figure)
    return figure


# --------------------------------------------------------------------------- DDP variants and bucket sizes


# One line style per transport of ddp_benchmark.py's rows (the colour is the implementation's).
TRANSPORT_LINES = {"torch": "-", "shared_memory": "--", "shared_memory:thread": ":", "torch:dpkit": "-."}
# A transport without a line above (one a user registered): one of these dash patterns, the same in every figure.
MORE_LINES = ((0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (8, 2)), (0, (1, 3)))


def transport_line(transport: str | None):
    """The line style of a transport's series (None, the model alone: solid)."""
    if transport is None or transport in TRANSPORT_LINES:
        return TRANSPORT_LINES.get(transport, "-")
    return MORE_LINES[zlib.crc32(transport.encode()) % len(MORE_LINES)]


def _models(rows):
    return list(dict.fromkeys(r["model"] for r in rows))


def ddp_variants(doc: dict) -> Figure:
    """Per model: p50 time per iteration against bucket size for ours and PyTorch's (defaults, and
    best settings when measured) with 95 % intervals over rounds, and every variant's p50 with the
    exposed communication wait marked; oversubscribed rows grey and hatched."""
    rows, env = doc["results"], doc.get("env", {})
    models = _models(rows)
    figure, axes = _figure(len(models), 2, width=13, height=3.8, gridspec_kw={"width_ratios": [1, 1.25]})
    for (sweep_ax, bar_ax), model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        caps = sorted({r["bucket_cap_mb"] for r in mine if r.get("bucket_cap_mb")})
        series = list(dict.fromkeys((kind(r), r["transport"]) for r in mine if r.get("bucket_cap_mb")))  # one each
        for i, (name, on) in enumerate(series):
            points = sorted(((r["bucket_cap_mb"], r) for r in mine if (kind(r), r["transport"]) == (name, on)
                             and r.get("bucket_cap_mb")), key=lambda point: point[0])
            shift = 1.06 ** (i - (len(series) - 1) / 2)  # side by side, so the error bars stay apart
            x = [b * shift for b, _ in points]
            y = [r["p50_s"] for _, r in points]
            yerr = np.array([_yerr(r["p50_s"], interval(r, "p50_s")) for _, r in points])[:, :, 0].T
            sweep_ax.errorbar(x, y, yerr=yerr, marker="o", capsize=3, color=colour(name),
                              linestyle=transport_line(on), label=_series_label(name, on, points[0][1]))
        baseline = next((r for r in mine if r["engine"] is None), None)
        if baseline:
            sweep_ax.axhline(baseline["p50_s"], color=colour("no ddp"), linestyle=":",
                             label="no ddp (no communication)")
        _log_x(sweep_ax, caps)
        sweep_ax.set(xlabel="bucket cap (MiB)", ylabel="time per iteration (s, p50)", title=f"{model}: bucket size")
        sweep_ax.set_ylim(bottom=0)
        _variant_bars(bar_ax, mine, env, model)
    _legend_outside(figure)
    return figure


def _series_label(name: str, on: str | None, row: dict) -> str:
    """"ddp ours [shared_memory, zero copy]": an implementation, its transport and, on shared memory, the path
    ``row`` recorded."""
    if not on:
        return name
    where = f", {row['path']}" if row.get("path") else ""
    return f"{name} [{on}{where}]"


def _variant_bars(ax, rows: list[dict], env: dict, model: str) -> None:
    labels = [row_identity.label(r, path=True) for r in rows]  # each [shared_memory] names its path
    y = np.arange(len(rows))[::-1]
    for yi, r in zip(y, rows):
        over = oversubscribed(r, env)
        style = dict(OVERSUBSCRIBED) if over else dict(color=colour(r))  # OVERSUBSCRIBED: color, hatch, edgecolor
        bounds = interval(r, "p50_s")
        ax.barh(yi, r["p50_s"], xerr=np.array(_yerr(r["p50_s"], bounds)), capsize=3, height=0.7, **style)
        if r.get("comm_wait_s"):
            ax.barh(yi, r["comm_wait_s"], height=0.25, color="white", edgecolor="black", linewidth=0.6)
    ax.set_yticks(y, labels, fontsize="small")
    ax.set(xlabel="time per iteration (s, p50; bar = 95 % interval over rounds)", title=f"{model}: every variant")
    # Empty rectangles carry these two entries into the figure's legend.
    ax.add_patch(Rectangle((0, 0), 0, 0, facecolor="white", edgecolor="black",
                           label="exposed communication wait (ours)"))
    if any(oversubscribed(r, env) for r in rows):
        ax.add_patch(Rectangle((0, 0), 0, 0, label="oversubscribed", facecolor=OVERSUBSCRIBED["color"],
                               hatch=OVERSUBSCRIBED["hatch"], edgecolor=OVERSUBSCRIBED["edgecolor"]))


def time_breakdown(doc: dict) -> Figure:
    """Where one iteration's time goes, per profiled variant (rows with a ``breakdown`` of
    ``measure.op_breakdown``): the CPU seconds of each phase, stacked, one panel per model."""
    rows = [r for r in doc["results"] if r.get("breakdown")]
    models = _models(rows) or [""]
    figure, axes = _figure(len(models), 1, width=11,
                           height=0.5 + 0.45 * max(1,
                                                   max((sum(r["model"] == m for r in rows) for m in models),
                                                       default=1)))
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in rows if r["model"] == model]
        y = np.arange(len(mine))[::-1]
        for yi, r in zip(y, mine):
            left = 0.0
            for phase in COMPUTE_PHASES:
                seconds = r["breakdown"]["ranges"].get(phase)
                if seconds:
                    ax.barh(yi, 1e3 * seconds, left=left, height=0.6, color=PHASE_COLOURS[phase], edgecolor=colour(r),
                            linewidth=1.5, label=phase)
                    left += 1e3 * seconds
        ax.set_yticks(y, [row_identity.label(r, path=True) for r in mine], fontsize="small")
        ax.set(xlabel="CPU time per iteration, rank 0, under the profiler (ms)",
               title=f"{model}: where one iteration's time goes")
        if not mine:
            missing(ax, "rows with a 'breakdown' (ddp_benchmark.py --breakdown)")
    _legend_outside(figure)
    return figure


# --------------------------------------------------------------------------- world-size sweep


def ddp_sweep(doc: dict) -> Figure:
    """p50 time per iteration (bars: ``interval``, the range of the rounds below ``MIN_BOOTSTRAP_ROUNDS``) and
    whole-job examples per second against world size, one colour per variant and a line style per transport;
    oversubscribed world sizes shaded
    grey and hatched, points hollow."""
    rows, env = doc["results"], doc.get("env", {})
    figure, axes = _figure(1, 2, width=12, height=3.8)
    time_ax, throughput_ax = axes[0]
    worlds = sorted({r["world_size"] for r in rows})
    for series in dict.fromkeys(map(row_identity.what, rows)):  # a row's path may differ between world sizes
        points = sorted(((r["world_size"], r) for r in rows if row_identity.what(r) == series), key=lambda p: p[0])
        c = colour(points[0][1])
        x = [w for w, _ in points]
        yerr = np.array([_yerr(r["p50_s"], interval(r, "p50_s")) for _, r in points])[:, :, 0].T
        line = transport_line(points[0][1]["transport"])  # a variant on two transports: two line styles
        time_ax.errorbar(x, [r["p50_s"] for _, r in points], yerr=yerr, color=c, capsize=3, linestyle=line,
                         label=row_identity.label(points[-1][1], path=True))
        throughput_ax.plot(x, [r["p50_ex_per_s"] for _, r in points], color=c, linestyle=line)
        for ax, key in ((time_ax, "p50_s"), (throughput_ax, "p50_ex_per_s")):
            for w, r in points:
                over = oversubscribed(r, env)
                ax.plot([w], [r[key]], marker="o", markersize=7, color=c, markerfacecolor="white" if over else c)
    over = [w for w in worlds if any(oversubscribed(r, env) for r in rows if r["world_size"] == w)]
    for ax in (time_ax, throughput_ax):
        _log_x(ax, worlds)
        shade_oversubscribed(ax, over, f"oversubscribed: more processes than the {env.get('cpus', '?')} CPU cores "
                                       "(hollow points)")
        ax.set_xlabel("processes (world size)")
        ax.set_ylim(bottom=0)
    model = rows[0].get("model", "") if rows else ""
    time_ax.set(ylabel="time per iteration (s, p50)", title=f"{model}: time per iteration")
    throughput_ax.set(ylabel="examples per second (whole job, p50)", title=f"{model}: throughput")
    _legend_outside(figure)
    return figure


# --------------------------------------------------------------------------- overlap timeline (Chrome traces)


# The record_function ranges of one benchmark iteration (dpkit.bench.ddp_step.Replica.step), in order.
COMPUTE_PHASES = PHASES
# The profiler ranges of a collective: gloo's and NCCL's own, and transport.SharedMemory's ("shared_memory:<kind>").
COLLECTIVE_RANGES = ("gloo", "nccl", "shared_memory")
# Greys for compute, so that the communication lanes carry the implementation's colour; waiting in red.
PHASE_COLOURS = {"forward": "#CCCCCC", "backward": "#777777", "sync_gradients": "#AA0000", "optimizer_step": "#333333"}


def timeline_events(trace: dict, iteration: int = -1) -> dict:
    """One iteration of a Chrome trace written by ``ddp_benchmark.py --profile``: the compute phases
    (record_function ranges of the main thread) and each bucket's all-reduce (gloo's or NCCL's on their
    threads, or ours through shared memory on our communication thread), in ms from the iteration's
    start. Returns {"phases": [(name, start, duration)], "comm": {lane: [(start, duration)]}, "length": ms}."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    iterations = sorted((e for e in events if str(e.get("name", "")).startswith("iteration ")), key=lambda e: e["ts"])
    if not iterations:
        raise ValueError("no 'iteration N' ranges in this trace: not written by ddp_benchmark.py --profile")
    it = iterations[iteration]
    start, end = it["ts"], it["ts"] + it["dur"]
    inside = [e for e in events if start <= e["ts"] < end]
    phases = [(e["name"], (e["ts"] - start) / 1e3, e["dur"] / 1e3) for e in inside
              if e["name"] in COMPUTE_PHASES and e.get("tid") == it.get("tid")]
    comm: dict = {}
    for e in sorted(inside, key=lambda e: e["ts"]):
        name = str(e["name"])
        if "all_reduce" in name.replace("allreduce", "all_reduce") and name.startswith(COLLECTIVE_RANGES):
            comm.setdefault(e.get("tid"), []).append(((e["ts"] - start) / 1e3, e["dur"] / 1e3))
    # A sum made by the compute thread itself (shared memory, inline in the backward hook) gets a lane of its own
    # below the compute lane, so that it shows beside the phase it interrupts.
    inline = comm.pop(it.get("tid"), None)
    lanes = {f"comm thread {i + 1}": spans
             for i, (_, spans) in enumerate(sorted(comm.items(), key=lambda kv: str(kv[0])))}
    if inline:
        lanes["sums in the compute thread"] = inline
    return {"phases": sorted(phases, key=lambda p: p[1]), "comm": lanes, "length": it["dur"] / 1e3}


def overlap_timeline(traces: dict[str, dict]) -> Figure:
    """One panel per DDP variant (``{label: loaded Chrome trace}``, ours beside PyTorch's), one
    iteration of rank 0: the compute phases on one lane, every bucket's all-reduce on the lanes of
    the communication threads; time in ms on a shared axis."""
    figure, axes = _figure(len(traces), 1, width=12, height=1.35 + 0.25, sharex=True)
    for ax, (label, trace) in zip(axes[:, 0], traces.items()):
        t = timeline_events(trace)
        lanes = ["compute", *t["comm"]]
        ypos = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
        for name, begin, length in t["phases"]:
            label_ = "sync_gradients (waiting for communication)" if name == "sync_gradients" else name
            ax.broken_barh([(begin, length)], (ypos["compute"] - 0.4, 0.8), color=PHASE_COLOURS[name], label=label_)
        for lane, spans in t["comm"].items():
            ax.broken_barh(spans, (ypos[lane] - 0.4, 0.8), facecolor=colour(label), edgecolor="black", linewidth=0.5,
                           label=f"all-reduce of a bucket ({kind(label)})")
        ax.set_yticks(list(ypos.values()), list(ypos), fontsize="small")
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        buckets = sum(len(s) for s in t["comm"].values())
        ax.set_title(f"{label}: one iteration, {t['length']:.0f} ms, {buckets} all-reduce calls", fontsize="small",
                     loc="left")
    axes[-1][0].set_xlabel("time since the iteration started (ms)")
    _legend_outside(figure)
    return figure


def trim_trace(trace: dict) -> dict:
    """The events ``timeline_events`` reads (iterations, phases, collectives): a few kB instead of a few
    MB, small enough to commit beside the results. Still a Chrome trace. ``ddp_benchmark.py --trim-traces`` hands it
    to ``dpkit.bench.ddp_run.write_trace``, which may not import the report."""
    keep = ("iteration ", *COMPUTE_PHASES, *(f"{name}:" for name in COLLECTIVE_RANGES))
    return {"traceEvents": [e for e in trace.get("traceEvents", [])
                            if e.get("ph") == "X" and str(e.get("name", "")).startswith(keep)]}


def load_traces(directory: str, model: str, labels: Iterable[str], rank: int = 0) -> dict[str, dict]:
    """``{label: trace}`` of the traces ``ddp_benchmark.py --profile DIR`` wrote for ``model`` (any world
    size) and this rank; labels without a trace are left out."""
    found = {}
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    for label in labels:
        slug = label.replace(" ", "-")
        match = next((n for n in names if n.startswith(f"{model}-") and n.endswith(f"-{slug}-rank{rank}.json")), None)
        if match:
            with open(os.path.join(directory, match)) as f:
                found[label] = json.load(f)
    return found


# --------------------------------------------------------------------------- beside a seed


def beside_seed(ours: dict[str, tuple], seed: dict[str, tuple], *, xlabel: str, ylabel: str, ours_title: str,
                seed_title: str, xbytes: bool = False, logx: bool = True, logy: bool = False,
                sharey: bool = False) -> Figure:
    """Two panels, ours (left) and a seed's (right), each ``{series label: (x, y[, implementation])}``,
    with the same axis labels and scales and the hardware in the titles (never one axis: different
    machines). Our series take their implementation's colour; the seed's are grey; series of one
    colour differ by line style and marker. Legends sit under the panels."""
    figure, axes = _figure(1, 2, width=12, height=4.2, sharey=sharey)
    for ax, series, title, default in ((axes[0][0], ours, ours_title, None),
                                       (axes[0][1], seed, seed_title, SEED_STYLE["color"])):
        used: dict[str, int] = {}
        for label, (x, y, *impl) in series.items():
            c = colour(impl[0]) if impl else (default or OTHER)
            n = used[c] = used.get(c, -1) + 1
            ax.plot(x, y, color=c, linestyle=SERIES_LINES[n % len(SERIES_LINES)],
                    marker=SERIES_MARKERS[n % len(SERIES_MARKERS)], label=label)
        if logx:
            values = sorted({v for x, *_ in series.values() for v in x})
            _log_x(ax, values, (lambda v, _: format_bytes(v)) if xbytes else None)
        if logy:
            _log_y(ax)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.set_title(title, fontsize="small")
        ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    return figure


SERIES_LINES = ("-", "--", ":", "-.")
SERIES_MARKERS = ("o", "s", "^", "v", "D", "x")


# --------------------------------------------------------------------------- sharded data parallelism

# The parts of what a rank holds, stacked bottom to top (sharding_benchmark.py's byte fields).
MEMORY_PARTS = (("params_bytes", "parameters", "#56B4E9"), ("grads_bytes", "gradients", "#009E73"),
                ("state_bytes", "optimizer state", "#CC79A7"), ("activation_bytes", "activations", "#F0E442"))


def our_variant(rows: list[dict], engine: str) -> str | None:
    """Our variant of ``engine`` at its default option in sharding_benchmark rows, preferably on [shared_memory]
    (memory does not depend on the transport but for its buffers, which this variant's rows count), else the
    first."""
    names = list(dict.fromkeys(r["variant"] for r in rows
                               if (r["engine"], r["impl"], r["option"]) == (engine, "ours", None)))
    shared = [n for n in names if any(r["variant"] == n and r["transport"] == "shared_memory" for r in rows)]
    return (shared or names or [None])[0]


def sharding_memory(doc: dict) -> Figure:
    """What one rank holds (the largest rank), per model: parameters, gradients, optimizer state and
    activations stacked, for our variant of every registered engine (DDP, ZeRO stages 1 and 2, FSDP, ...) at every
    world size measured; a dash at the ideal model-state bytes of that engine; oversubscribed runs hatched."""
    rows, env = [r for r in doc["results"] if "variant" in r], doc.get("env", {})
    models = _models(rows) or [""]
    figure, axes = _figure(len(models), 1, width=11, height=3.8)
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in rows if r["model"] == model]
        cell = {(r["variant"], r["world_size"]): r for r in mine}
        bars = [(e, cell[v, w]) for e in registry.names() if (v := our_variant(mine, e))
                for w in sorted({r["world_size"] for r in mine}) if (v, w) in cell]
        for x, (engine, r) in enumerate(bars):
            bottom = 0.0
            for key, label, c in MEMORY_PARTS:
                ax.bar(x, r[key] / MIB, bottom=bottom, color=c, label=label,
                       hatch=OVERSUBSCRIBED["hatch"] if oversubscribed(r, env) else None, edgecolor="white")
                bottom += r[key] / MIB
            ax.plot([x - 0.4, x + 0.4], [r["ideal_bytes"] / MIB] * 2, color="black", linestyle="--",
                    label="ideal model states (parameters + gradients + optimizer state)")
        ax.set_xticks(range(len(bars)),
                      [f"{row_identity.label(r, path=True)}\n{r['world_size']} rank{'s' * (r['world_size'] > 1)}"
                                         for _, r in bars], fontsize="small", rotation=90)
        ax.set(ylabel="MiB per rank (largest rank)", title=f"{model}: what one rank holds, AdamW")
        if not bars:
            missing(ax, "sharding_benchmark.py rows of our variants")
    if any(oversubscribed(r, env) for r in rows):
        axes[0][0].add_patch(Rectangle((0, 0), 0, 0, label="oversubscribed", facecolor="white",
                                       hatch=OVERSUBSCRIBED["hatch"], edgecolor=OVERSUBSCRIBED["edgecolor"]))
    _legend_outside(figure)
    return figure


def cluster_model(doc: dict) -> Figure:
    """``multihost_benchmark.py``'s model of a cluster: communication per step of each engine against the number
    of hosts, one panel per model, both axes logarithmic."""
    rows = [r for r in doc["results"] if r["kind"] == "cluster"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, axes = _figure(1, max(1, len(models)))
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for engine, marker in zip(dict.fromkeys(r["engine"] for r in mine), "osv^Dx"):
            points = sorted((r["hosts"], r["communication_s"] * 1e3) for r in mine if r["engine"] == engine)
            ax.plot(*zip(*points), marker=marker, fillstyle="none", linestyle="--" if "flat" in engine else "-",
                    label=engine)
        hosts = sorted({r["hosts"] for r in mine})
        _log_x(ax, hosts, formatter=lambda v, _: f"{v:g}")
        ax.set_yscale("log")
        ax.set_title(f"{model}: {mine[0]['param_bytes'] / 2 ** 20:.0f} MiB of float32 parameters")
        ax.set_xlabel(f"hosts ({mine[0]['ranks_per_host']} ranks each)")
        ax.set_ylabel("communication ms per step (model)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    _legend_outside(figure, handles, labels, title="engine")
    return figure
