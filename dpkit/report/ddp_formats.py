"""The report's comparison with PyTorch's DDP benchmark (``benchmarks/distributed/ddp/benchmark.py``): its
percentile table and its diff of two runs, in its own format, beside ours from ``results/ddp_benchmark.json``,
and the world-size sweep (``results/ddp_sweep.json``) beside its world sizes.

    from dpkit.report import ddp_formats, page
    ddp_formats.percentiles(page.Page.open())
"""

from __future__ import annotations

from dpkit.bench import row_identity
from dpkit.report import ddp_tables, findings, plots
from dpkit.report.wording import interval_text, ratio_text, span

ONE, TWENTY_FIVE = 1.0, 25.0  # the bucket caps (MiB) of PyTorch's DDP that PyTorch's diff compares
SWEEP_COLUMNS = [("world_size", "processes", "d"), ("over", "oversubscribed", "s"), ("label", "variant", "s"),
                 ("p50_s", "p50 s/iter", ".4f"), ("p50_ci", "interval", "s"), ("p50_ex_per_s", "ex/s (p50)", ".0f"),
                 ("p95_s", "p95 s/iter", ".4f")]


def fenced(text: str) -> str:
    return f"```text\n{text}\n```"


def resnet18(doc: dict) -> list[dict]:
    return [r for r in doc["results"] if r["model"] == "resnet18"] or doc["results"]


def as_run(doc: dict, row: dict, cap: float) -> dict:
    """One row as a file of its own at one bucket size, the way PyTorch's diff reads two runs: the cap moves from
    the row's fields to the file's settings, so that the two rows are the same row of two runs."""
    same = {**row, "bucket_cap_mb": None}
    return {**doc, "config": {**doc["config"], "bucket_sizes": [cap]},
            "results": [{**same, "label": row_identity.label(same)}]}


def direction(ratio: dict) -> str:
    if ratio.get("ci_low") is not None and ratio["ci_low"] > 1:
        return "**the same direction** (1 MiB slower)."
    if ratio.get("ci_high") is not None and ratio["ci_high"] < 1:
        return "**the opposite direction** (1 MiB faster)."
    return "**not resolved**: the interval contains 1, where the effect the seed measured is a few percent."


def diff(page, doc: dict, rows: dict[float, dict], seed: dict) -> None:
    """PyTorch's diff (25 MiB baseline, 1 MiB test) beside ours within our run, and whether the direction agrees."""
    page.say("PyTorch's diff (25 MiB baseline, 1 MiB test):\n\n" + fenced(seed["diff"]["format_excerpt"])
             + "\n\nOurs, the same comparison within our run:\n\n"
             + fenced(ddp_tables.format_diff(as_run(doc, rows[TWENTY_FIVE], 25.0), as_run(doc, rows[ONE], 1.0))),
             label=False)
    one_vs_25, seed_diffs = plots.ratio(rows[ONE], rows[TWENTY_FIVE]), [r["p75_diff_pct"] for r in seed["diff"]["rows"]]
    env = doc["env"]
    page.say(f"Hardware: PyTorch's on {seed['hardware']}; ours on {env['device_model']} ({env['cpus']} cores, gloo). "
             f"There, 1 MiB buckets changed p75 time by {span(seed_diffs, '+.1f')} % against 25 MiB (negative: "
             f"slower), over {len(seed_diffs)} model and GPU-count pairs. Here, PyTorch's DDP [torch] with 1 MiB / "
             "25 MiB buckets at p50 (ours at p50, the seed's at p75: our rounds hold p50 only): "
             f"{ratio_text(one_vs_25)}: " + direction(one_vs_25)
             + " The format is the same; ours also states the environment header and which configuration keys differ.")


def percentiles(page) -> None:
    """PyTorch's percentile table, ours in the same format, then the two bucket sizes' diff."""
    doc, seed = page.load("ddp_benchmark"), page.seeds["pytorch_ddp_benchmark"]
    rows = resnet18(doc)
    page.say(f"PyTorch's benchmark ({seed['hardware']}):\n\n" + fenced(seed["benchmark"]["format_excerpt"])
             + f"\n\nOurs (ddp_benchmark.json, {rows[0]['model']}):\n\n"
             + fenced("\n".join(ddp_tables.percentile_table(rows, path=True))), label=False)
    pytorch = {r["bucket_cap_mb"]: r for r in rows
               if (r["engine"], r["impl"], r["option"], r["transport"]) == ("ddp", "pytorch", None, "torch")}
    if ONE in pytorch and TWENTY_FIVE in pytorch:
        diff(page, doc, pytorch, seed)
    else:
        page.missing("PyTorch's DDP at 1 MiB and at 25 MiB buckets (rows 'ddp pytorch 1M [torch]' and "
                     "'ddp pytorch 25M [torch]')")


def within_cores(rows: list[dict]) -> list[int]:
    return sorted({r["world_size"] for r in rows if r["over"] == "no"})


def marked(doc: dict) -> list[dict]:
    return [{**r, "over": "yes" if plots.oversubscribed(r, doc["env"]) else "no",
             "p50_ci": interval_text(plots.interval(r, "p50_s"))} for r in doc["results"]]


def scaling_text(rows: list[dict], cpus: int) -> str:
    """Examples per second at the most processes within the cores against one process, per variant."""
    fits, lines = within_cores(rows), []
    for series in dict.fromkeys(map(row_identity.what, rows)):
        pts = {r["world_size"]: r for r in rows if row_identity.what(r) == series}
        if 1 in pts and max(fits) in pts and max(fits) > 1:
            top, one = pts[max(fits)], pts[1]
            gain = top["p50_ex_per_s"] / one["p50_ex_per_s"]
            # Examples per second is the global batch over a time: the times' range, inverted, scaled by the batches.
            low, high = (top["global_batch"] / one["global_batch"] / t
                         for t in reversed(findings.unpaired_range(top["round_p50_s"], one["round_p50_s"])))
            lines.append(f"{row_identity.label(top, path=True)}: {gain:.2f}x [{low:.2f}, {high:.2f}] the examples "
                         "per second of 1 process")
    over = sorted({r["world_size"] for r in rows if r["over"] == "yes"})
    return (f"*Commentary.* From 1 to {max(fits)} processes (both within the {cpus} cores; in brackets the range "
            "over the rounds of the two runs, which share no rounds): " + "; ".join(lines) + ". "
            + (f"The runs with {', '.join(map(str, over))} processes are oversubscribed: their processes share {cpus} "
               "cores, so their times are shown but not used." if over else ""))


def sweep(page) -> None:
    """Every row of the world-size sweep, its figure, and how the examples per second scale."""
    doc = page.load("ddp_sweep")
    rows = marked(doc)
    columns = [c if c[0] != "p50_ci" else ("p50_ci", findings.round_p50_interval_name(doc["config"].get("rounds")), "s")
               for c in SWEEP_COLUMNS]
    ordered = sorted(rows, key=lambda r: (r["engine"] is not None, r["label"], r["world_size"]))  # series together
    page.show([{**r, "label": row_identity.label(r, path=True)} for r in ordered], columns, label=False)
    page.draw(plots.ddp_sweep(doc))
    page.say(scaling_text(rows, doc["env"]["cpus"]), label=False)


def sweep_figure(rows: list[dict], seed: dict, env: dict):
    """Time per iteration against processes, ours (oversubscribed shaded) beside PyTorch's against GPUs."""
    theirs = [r for r in seed["benchmark"]["rows"] if r["model"] == "resnet50"]
    pick = lambda ddp: ([r["gpus"] for r in theirs if (r["label"] != "no ddp") == ddp],  # noqa: E731
                        [r["p50_s"] for r in theirs if (r["label"] != "no ddp") == ddp])
    ordered = sorted(rows, key=lambda r: r["world_size"])
    what = row_identity.what
    series = {s: [r for r in ordered if what(r) == s] for s in dict.fromkeys(map(what, rows))}
    ours = {f"{rows[0]['model']}, {row_identity.label(rs[-1], path=True)}":
            ([r["world_size"] for r in rs], [r["p50_s"] for r in rs], row_identity.name(rs[-1]))
            for rs in series.values()}
    figure = plots.beside_seed(ours, {"resnet50, DDP": pick(True), "resnet50, no ddp": pick(False)},
                               xlabel="processes (ours) / GPUs (seed)", ylabel="time per iteration (s, p50)",
                               ours_title=f"ours: {env['device_model']}, {env['cpus']} cores (shaded: oversubscribed)",
                               seed_title=f"seed: {seed['hardware']}")
    plots.shade_oversubscribed(figure.axes[0], sorted({r["world_size"] for r in rows if r["over"] == "yes"}))
    for ax in figure.axes:
        ax.set_ylim(bottom=0)
    return figure


def growth_text(rows: list[dict], seed: dict, env: dict) -> str:
    """How time per iteration grows with the processes: PyTorch's on GPUs, ours with DDP and without it."""
    ddp_seed = [r for r in seed["benchmark"]["rows"] if r["model"] == "resnet50" and r["label"] != "no ddp"]
    seed_growth, top = ddp_seed[-1]["p50_s"] / ddp_seed[0]["p50_s"] - 1, max(within_cores(rows))
    first = next((r for r in rows if row_identity.name(r) == "ddp ours"), None)  # our DDP, bucketed: its first series
    mine = [r for r in rows if first and row_identity.what(r) == row_identity.what(first)]
    label = row_identity.label(mine[-1], path=True) if mine else None
    ours = findings.growth(mine, 1, top) if mine else None
    no_ddp = findings.growth([r for r in rows if r["engine"] is None], 1, top)
    text = (f"Hardware: PyTorch's on {seed['hardware']}; ours on {env['device_model']} ({env['cpus']} cores). "
            f"With one GPU per process, its sec/iter grows by {100 * seed_growth:.0f} % from {ddp_seed[0]['gpus']} "
            f"to {ddp_seed[-1]['gpus']} GPUs. ")
    if ours is None:
        return text
    text += f"Ours ({label}) grows by {_growth_text(ours)} from 1 to {top} processes"
    if no_ddp is not None:
        text += f", and the same model without DDP (no communication at all) by {_growth_text(no_ddp)}"
        if no_ddp[1] >= ours[2] / 2:  # decided by the ranges: the least growth without DDP, half the most with it
            text += ": at least half of our growth is there without any communication"
    return text + (" (in brackets the range over the rounds of the two runs, which share no rounds). "
                   "**Not comparable** beyond the shape; oversubscribed runs are left out.")


def _growth_text(growth: tuple[float, float, float]) -> str:
    """"12 % [8, 15] %": a growth and its range (``findings.growth``)."""
    median, low, high = (100 * g for g in growth)
    return f"{median:.0f} % [{low:.0f}, {high:.0f}] %"


def sweep_beside_seed(page) -> None:
    doc, seed = page.load("ddp_sweep"), page.seeds["pytorch_ddp_benchmark"]
    rows = marked(doc)
    page.draw(sweep_figure(rows, seed, doc["env"]))
    page.say(growth_text(rows, seed, doc["env"]), label=False)
