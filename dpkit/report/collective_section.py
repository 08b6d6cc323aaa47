"""The report's section on the collectives (``results/collectives.json``, ``reduce_scatter.json``,
``all_gather.json``, from collectives_benchmark.py): all-reduce at every size with the fitted latency-bandwidth
model, auto's choices and the stored targets; every row and chart; reduce-scatter and all-gather; the gloo
bandwidth beside the seed's.

    from dpkit.report import collective_section, page
    collective_section.model(page.Page.open())

The algorithms' latency-bandwidth model is ``dpkit.bench.latency_model``'s; auto's table, ``message_passing``'s.
"""

from __future__ import annotations

import os
import tempfile

import matplotlib.pyplot as plt

from dpkit.bench import latency_model
from dpkit.bench.collectives import allreduce_rows, format_size
from dpkit.bench.point_to_point import point_to_point_rows
from dpkit.comm import message_passing
from dpkit.report import collective_plots, findings, plots, sentences
from dpkit.report.wording import span

MIB = 2**20
GRID = [int(2 ** (12 + k / 4)) for k in range(4 * 16)]  # 4 KiB .. 128 MiB, 4 points per octave
ROW_COLUMNS = [("world_size", "procs", "d"), ("over", "oversubscribed", "s"), ("bytes", "bytes", ",d"),
               ("axis", "axis", "s"), ("label", "algorithm or transport", "s"), ("transport", "wire", "s"),
               ("p50_s", "p50 (s)", ".5f"), ("p95_s", "p95 (s)", ".5f"), ("algbw_gbps", "algbw GB/s", ".3f"),
               ("busbw_gbps", "busbw GB/s", ".3f"), ("vs_torch", "p50 / torch (median over rounds)", ".2f"),
               ("correct", "correct", "")]
OTHER_COLUMNS = [("world_size", "procs", "d"), ("bytes", "bytes", ",d"), ("label", "transport", "s"),
                 ("p50_s", "p50 (s)", ".5f"), ("algbw_gbps", "algbw GB/s", ".3f"),
                 ("vs_torch", "p50 / torch (median over rounds)", ".2f"), ("correct", "correct", "")]


def panels(rows: list[dict]) -> list[tuple[str, int]]:
    return sorted({(r["backend"], r["world_size"]) for r in rows})


def model_figure(rows: list[dict], fits: list[dict]):
    """The per-size chart (one line per algorithm, auto's choice ringed) above the fitted model, per world."""
    figure, axes = plt.subplots(2, len(panels(rows)), figsize=(5.2 * len(panels(rows)), 8), squeeze=False)
    for column, (backend, n) in enumerate(panels(rows)):
        collective_plots.draw_per_size(axes[0][column], rows, backend, n)
        collective_plots.draw_model(axes[1][column], rows, fits, backend, n)
    axes[0][0].set_ylabel("p50 time (ms)")
    axes[1][0].set_ylabel("time (ms)")
    for row_axes in axes:
        if row_axes[-1].get_legend_handles_labels()[0]:  # the model's panel is empty where no fit has two sizes
            row_axes[-1].legend(fontsize="x-small")
    figure.tight_layout()
    return figure


def fit_table(fits: list[dict]) -> str:
    lines = ["| procs | algorithm | alpha (us per step) | 1/beta (GB/s) | worst model error |", "|---|---|---|---|---|"]
    return "\n".join(lines + [f"| {f['world_size']} | {f['algorithm']} | {f['alpha_s'] * 1e6:.0f} | "
                              f"{'-' if f['gbps'] is None else format(f['gbps'], '.2f')} | {f['max_rel_error']:.0%} |"
                              for f in fits])


def first_size_where(fits: list[dict], slower: str, faster: str, n: int) -> int | None:
    """The first size of ``GRID`` from which the model says ``faster`` beats ``slower`` (None if never)."""
    fit = {f["algorithm"]: f for f in fits if f["world_size"] == n}
    if slower not in fit or faster not in fit:
        return None
    faster_at = (s for s in GRID if latency_model.predict(fit[faster], s) < latency_model.predict(fit[slower], s))
    return next(faster_at, None)


def crossover_lines(fits: list[dict], rows: list[dict]) -> list[str]:
    """Per world: the dependent steps of recursive doubling and the ring, and where the model says they cross."""
    lines = []
    for _, n in panels(rows):
        fit = {f["algorithm"] for f in fits if f["world_size"] == n}
        if {"recursive_doubling", "ring"} <= fit:
            cross = first_size_where(fits, "recursive_doubling", "ring", n)
            steps = [latency_model.model_terms(a, n, 4000)[0] for a in ("recursive_doubling", "ring")]
            table = ", ".join(f"{name} up to {format_size(b)}" if b else name
                              for b, name in message_passing.crossover_for("cpu").get(n, ()))
            lines.append(f"* {n} processes: recursive doubling makes {steps[0]} dependent steps, the ring {steps[1]}; "
                         "with the fitted alpha and beta the ring becomes faster from "
                         f"{format_size(cross) if cross else 'no measured size'} on (auto's table: {table}).")
    return lines


def _lowest_text(winner: dict, tied: list[dict], size: int) -> str:
    """"tree at 4 KiB (fastest)", or "tree at 10 MiB (not separated from ring, butterfly)"."""
    apart = "fastest" if not tied else "not separated from " + ", ".join(r["label"] for r in tied)
    return f"{winner['label']} at {format_size(size)} ({apart})"


def fastest_lines(rows: list[dict]) -> list[str]:
    """Per world above one, at each size: the homework's algorithm of the lowest p50, called the fastest only where
    its paired interval against every other stays below 1 (``findings.lowest_p50``)."""
    lines = []
    for _, n in panels(rows):
        mine = [r for r in rows if r["world_size"] == n and r["axis"] == "algorithm"
                and r["label"] not in ("torch", "auto")]
        if n > 1 and mine:
            sizes = sorted({r["bytes"] for r in mine})
            lowest = {b: findings.lowest_p50([r for r in mine if r["bytes"] == b]) for b in sizes}
            separated = sum(not tied for _, tied in lowest.values())
            over = " (oversubscribed)" if any(r.get("oversubscribed") for r in mine) else ""
            lines.append(f"* {n} processes{over}: the lowest p50 is "
                         + ", ".join(_lowest_text(winner, tied, b) for b, (winner, tied) in lowest.items())
                         + f"; one algorithm is the fastest at {separated} of {len(sizes)} sizes.")
    return lines


def auto_lines(doc: dict, rows: list[dict], crossover_file: str) -> list[str]:
    """Which table auto used, and per world how often it ran the algorithm of the lowest p50."""
    lines = ["* auto's table in use: " + ("`results/crossover.json`, written by `collectives_benchmark.py --tune`"
                                         if os.path.exists(crossover_file) else
                                         "`allreduce.DEFAULT_CROSSOVER` (no `results/crossover.json` here: "
                                         "`collectives_benchmark.py --tune` writes one)")]
    for backend, n in panels(rows):
        hits = findings.auto_choices(rows, n)
        if n > 1 and hits:
            over = " (oversubscribed)" if findings.oversubscribed({"world_size": n}, doc["env"]) else ""
            misses = [h for h in hits if not h["hit"]]
            lines.append(f"* {n} processes{over}: auto ran the algorithm of the lowest p50 (over {backend}) at "
                         f"{sum(h['hit'] for h in hits)} of {len(hits)} sizes"
                         + (": " + ", ".join(f"{h['choice']} where {h['lowest']} had the lowest p50 at "
                                             f"{format_size(h['bytes'])}"
                                             + (f" (not separated from {', '.join(h['tied'])})" if h["tied"] else "")
                                             for h in misses) if misses else "") + ".")
    return lines


def step_line(row: dict) -> str:
    """One exchange step of an implementation, named by the bytes it moves: ours (isend/irecv) sends the whole
    tensor each way; gloo's 2-rank all_reduce is a ring of two steps of half the tensor (the row stores the tensor's
    bytes)."""
    if row["impl"] == "ours":
        what = f"one exchange step of our message passing (isend/irecv), {format_size(row['bytes'])} each way"
    else:
        what = (f"one of the two steps of gloo's all_reduce of {format_size(row['bytes'])} (its 2-rank ring), "
                f"{format_size(row['bytes'] // 2)}")
    return f"* {what}: {row['step_s'] * 1e6:.0f} us, {row['step_gbps']:.2f} GB/s (a single median, no interval)"


def model(page) -> None:
    """All-reduce at every size: the figure, the fitted model, its crossovers, one step of ours and of gloo's, auto's
    choices and the stored targets."""
    doc = page.load("collectives")
    rows, steps = allreduce_rows(doc["results"]), point_to_point_rows(doc["results"])
    fits = latency_model.fit_model(rows)
    page.draw(model_figure(rows, fits))
    text = [fit_table(fits), "", *crossover_lines(fits, rows)]
    text += [step_line(r) for r in steps]
    text += fastest_lines(rows) + auto_lines(doc, rows, message_passing.CROSSOVER_FILE)
    text += sentences.collective_targets(doc, page.load("allreduce"))
    if not doc.get("targets"):
        text.append("*not in this results file: the stored target checks (collectives_benchmark.py writes them)*")
    page.say("\n".join(text), label=False)


def marked_rows(doc: dict) -> list[dict]:
    """The sweep's rows (the file also holds one-step engine rows), each marked when oversubscribed."""
    return [{**r, "over": "yes" if plots.oversubscribed(r, doc["env"]) else "no"}
            for r in allreduce_rows(doc["results"])]


def every_row(page) -> None:
    """Every row of the all-reduce sweep, its charts, then reduce-scatter and all-gather with their targets."""
    doc = page.load("collectives")
    page.show(marked_rows(doc), ROW_COLUMNS)
    with tempfile.TemporaryDirectory() as directory:  # the function that also writes results/plots/
        fits = latency_model.fit_model(allreduce_rows(doc["results"]))
        for path in collective_plots.plot(doc["results"], directory, fits):
            page.image(path)
    for name in ("reduce_scatter", "all_gather"):
        if other := page.load(name):
            page.say(f"**{name.replace('_', '-')}** (`results/{name}.json`)")
            page.show(allreduce_rows(other["results"]), OTHER_COLUMNS)
            page.say("\n".join(f"* {t['text']}" for t in other.get("targets") or [])
                     or "*no stored target checks in this file*")


def algbw(rows: list[dict], world: int, size_key: str, value) -> dict[int, float]:
    return {r[size_key]: value(r) for r in rows if r.get("world_size", r.get("processes")) == world}


def seed_algbw(row: dict) -> float:
    return row["size_bytes"] / (row["avg_time_ms"] / 1e3) / 1e9


def bandwidth_figure(ours: list[dict], seed_rows: list[dict], doc: dict, seed: dict, env: dict):
    label = lambda w: f"torch, {w} processes" + (" (oversubscribed)" if plots.oversubscribed({"world_size": w}, doc["env"]) else "")  # noqa: E731,E501
    return plots.beside_seed(
        {label(w): ([r["bytes"] for r in ours if r["world_size"] == w],
                    [r["algbw_gbps"] for r in ours if r["world_size"] == w], "torch")
         for w in sorted({r["world_size"] for r in ours})},
        {f"torch, {w} processes": ([r["size_bytes"] for r in seed_rows if r["processes"] == w],
                                   [seed_algbw(r) for r in seed_rows if r["processes"] == w])
         for w in sorted({r["processes"] for r in seed_rows})},
        xlabel="message size", ylabel="algbw (GB/s, bytes / average time)", xbytes=True,
        ours_title=f"ours: gloo, {env['device_model']}, {env['cpus']} cores",
        seed_title=f"seed: {seed['hardware'].split(';')[0]}")


def bandwidth_text(ours: list[dict], seed_rows: list[dict], doc: dict, seed: dict, env: dict) -> str | None:
    """Absolute bandwidth (not comparable), the plateau's shape, and what 4 processes do to it, ours and the seed's;
    None where ours has no size measured at both 2 and 4 processes, or none of 10 MiB or more."""
    ours2, ours4 = (algbw(ours, w, "bytes", lambda r: r["algbw_gbps"]) for w in (2, 4))
    plateau = [ours2[b] for b in sorted(ours2) if b >= 10 * MIB]
    if not (set(ours2) & set(ours4) and plateau):
        return None
    seed2, seed4 = (algbw(seed_rows, w, "size_bytes", seed_algbw) for w in (2, 4))
    top, seed_top = max(set(ours2) & set(ours4)), max(set(seed2) & set(seed4))
    seed_plateau = [v for b, v in seed2.items() if b >= 10 * MIB]
    return (f"Hardware: seed on {seed['hardware']}; ours on {env['device_model']} ({env['cpus']} cores). "
            f"**Absolute bandwidth: not comparable** (different CPUs): at {plots.format_bytes(top)} with 2 processes "
            f"ours reaches {ours2[top]:.2f} GB/s, the seed {seed2.get(top, seed2[seed_top]):.2f} GB/s at "
            f"{plots.format_bytes(top if top in seed2 else seed_top)}. **Shape.** From 10 MiB on, our 2-process algbw "
            f"spans {span(plateau)} GB/s (largest / smallest {max(plateau) / min(plateau):.2f}), the seed's "
            f"{span(seed_plateau)} GB/s ({max(seed_plateau) / min(seed_plateau):.2f}); ours are the algorithm axis' "
            "rows of torch's all_reduce. Going from 2 to 4 processes multiplies algbw by "
            f"{ours4[top] / ours2[top]:.2f} "
            f"here at {plots.format_bytes(top)} and by {seed4[seed_top] / seed2[seed_top]:.2f} in the seed at "
            f"{plots.format_bytes(seed_top)}"
            + (f"; our 4-process runs are oversubscribed ({env['cpus']} cores), so that factor measures the shared "
               "cores as much as the algorithm." if plots.oversubscribed({"world_size": 4}, doc["env"]) else "."))


def beside_seed(page) -> None:
    """torch's all_reduce over gloo (one row per size) beside the seed's gloo bandwidth table."""
    doc, seed = page.load("collectives"), page.seeds["allreduce_bandwidth"]
    ours = [r for r in marked_rows(doc) if r["label"] == "torch" and r["axis"] == "algorithm"]
    seed_rows = [r for r in seed["rows"] if r["backend"] == "gloo"]
    if not ours:
        page.missing("torch's all_reduce on the algorithm axis (collectives_benchmark.py --axis algorithms)")
        return
    page.draw(bandwidth_figure(ours, seed_rows, doc, seed, doc["env"]))
    if text := bandwidth_text(ours, seed_rows, doc, seed, doc["env"]):
        page.say(text)
    else:
        page.missing("the sizes the shape and scaling are compared at: one measured at both 2 and 4 processes, and "
                     "one of 10 MiB or more")
