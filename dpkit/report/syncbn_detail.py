"""The rest of ``results/syncbn.json`` for the report: every stored ratio against its target (2 workers and one
process, each dtype), the sizes that miss and why, a figure of the ratios, the profiled operators, one iteration
cut at its collectives, and what cold caches add.

    from dpkit.report import page, syncbn_detail
    syncbn_detail.targets(page.Page.open())
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from dpkit.report import findings, plots
from dpkit.report.syncbn_section import transports
from dpkit.report.wording import wire

# The file's labels of the settings and implementations the cold-cache sentence compares.
COLD, LOCAL, SINGLE = "1 process, cold caches", "BatchNorm1d (local)", "1 process"
SYNC_PATH, WORKERS = "ours, synchronized path without collectives", "workers"
RATIO_COLUMNS = [("setting", "setting", "s"), ("on", "transport", "s"), ("dtype", "dtype", "s"),
                 ("batch", "batch", "d"), ("hidden", "hidden", "d"), ("ratio", "time ratio", "s"),
                 ("target", "target", "s"), ("verdict", "verdict", "s"), ("saved_ratio", "saved bytes ratio", ".2f"),
                 ("peak_ratio", "peak memory ratio", ".2f")]


def kind(doc: dict, name: str) -> list[dict]:
    return [r for r in doc["results"] if r["kind"] == name]


def fmt(r: dict) -> str:
    return f"{r['median']:.2f}x [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def named(name: str, on: list) -> str:
    """``name [shared_memory]`` when every row of a table has that one transport on this side, else the bare name."""
    on = set(on)
    return f"{name} [{on.pop()}]" if len(on) == 1 and None not in on else name


def on_text(r: dict) -> str:
    """The transports of one ratio row: [shared_memory] when both sides share it, [shared_memory] / [torch]
    when they differ."""
    ours, theirs = r.get("transport"), r.get("versus_transport")
    if ours == theirs:
        return "-" if ours is None else f"[{ours}]"
    return f"[{ours or '-'}] / [{theirs or '-'}]" if theirs else f"[{ours}] / local"


def ratio_tables(page, doc: dict) -> None:
    """One table per (implementation, reference) pair: each stored ratio with its target and verdict."""
    for mine, versus in dict.fromkeys((r["impl"], r["versus"]) for r in kind(doc, "ratio")):
        group = [r for r in kind(doc, "ratio") if (r["impl"], r["versus"]) == (mine, versus)]
        page.say(f"{named(mine, [r.get('transport') for r in group])} / "
                 f"{named(versus, [r.get('versus_transport') for r in group])} "
                 "(median of per-round ratios [95 % bootstrap interval over rounds])", doc)
        page.show([{**r, "ratio": fmt(r), "target": "-" if r["target"] is None else f"<= {r['target']}",
                    "on": on_text(r), "verdict": r["verdict"] or "-"} for r in group], RATIO_COLUMNS, doc)


def targets(page) -> None:
    """The ratios, the targets, the floor's bounds, the sizes that miss and why, and the figure of the ratios."""
    doc = page.load("syncbn")
    ratio_tables(page, doc)
    page.show([{**t, "value": fmt(t) if "median" in t else f"{t['sizes_met']} of {t['sizes']} sizes"}
               for t in kind(doc, "target")], [("name", "target", "s"), ("value", "measured", "s"),
                                               ("verdict", "verdict", "s")], doc)
    if kind(doc, "bound"):  # the floor (workers on one CPU host): bounds without a target
        page.show([{**b, "value": fmt(b)} for b in kind(doc, "bound")],
                  [("name", "bound (no target)", "s"), ("value", "measured", "s")], doc)
    whys = [r["why"] for r in kind(doc, "ratio") if r.get("why")]
    if whys:
        page.say("**Sizes that do not meet their target (missed or inconclusive), and why**\n\n"
                 + "\n".join(f"* {w}" for w in whys), doc)
    page.draw(ratio_figure(doc))


def ratio_panel(ax, doc: dict, setting: str, versus: str, on: str | None) -> None:
    """Ours / reference per size with its interval, one series per dtype; the float32 target as a line."""
    for i, dtype in enumerate(["float32", "float16", "bfloat16"]):
        pts = [r for r in kind(doc, "ratio") if (r["impl"], r["setting"], r["versus"], r["dtype"], r.get("transport"))
               == ("ours", setting, versus, dtype, on)]
        if pts:
            ax.errorbar([j + 0.2 * (i - 1) for j in range(len(pts))], [r["median"] for r in pts], fmt="o",
                        label=dtype, capsize=3, yerr=[[r["median"] - r["ci_low"] for r in pts],
                                                      [r["ci_high"] - r["median"] for r in pts]])
            ax.set_xticks(range(len(pts)), [f"{r['batch']}x{r['hidden']}" for r in pts], rotation=45)
    for t in kind(doc, "target"):
        if (t["setting"], t.get("versus"), t.get("transport")) == (setting, versus, on) and "every size" in t["name"]:
            ax.axhline(t["limit"], ls="--", lw=1, color="grey")
    ax.set(title=f"{setting}{f' [{on}]' if on else ''}: ours / ({versus})", xlabel="global batch x hidden",
           ylabel="time ratio")
    ax.legend()


def ratio_figure(doc: dict):
    panels = [("workers", plots.SYNCBN_REFERENCE, t) for t in transports(doc)] + [("1 process", LOCAL, None)]
    panels = [p for p in panels if any((r["setting"], r["versus"], r.get("transport")) == p
                                       for r in kind(doc, "ratio"))]
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        ratio_panel(ax, doc, *panel)
    figure.tight_layout()
    return figure


def profiles(page) -> None:
    """Where one forward + backward spends its CPU time (top operators by self time, per iteration), and one
    2-worker iteration cut at its two collectives (median per phase, slowest rank)."""
    doc = page.load("syncbn")
    for r in kind(doc, "breakdown"):
        page.say(f"{r['setting']}, {r['batch']}x{r['hidden']}, {r['impl']}: {1e6 * r['top_self_s']:.0f} us in the "
                 "top operators", doc)
        page.show([{**o, "us": 1e6 * o["self_s"]} for o in r["ops"][:8]],
                  [("op", "operator", "s"), ("us", "self CPU (us/iter)", ".1f"), ("calls", "calls/iter", "g")],
                  doc)
    phases = list(dict.fromkeys(p for r in kind(doc, "phases") for p in r["phases_s"]))
    page.say("2 workers: one iteration cut at its collectives (median per phase, slowest rank)")
    page.show([{"size": f"{r['batch']}x{r['hidden']}", "impl": f"{r['impl']} [{r.get('transport')}]",
                **{p: 1e6 * s for p, s in r["phases_s"].items()}, "iteration": 1e6 * r["iteration_s"]}
               for r in kind(doc, "phases")],
              [("size", "size", "s"), ("impl", "implementation", "s")] + [(p, f"{p} (us)", ".0f") for p in phases]
              + [("iteration", "median iteration (us)", ".0f")], doc)


def cold_caches_text(doc: dict, batch: int, hidden: int) -> str:
    """BatchNorm1d and our synchronized path in one process, warm and cold, beside the workers' BatchNorm1d."""
    times = {(r["impl"], r["setting"]): r["time_s"] for r in kind(doc, "time")
             if r["dtype"] == "float32" and (r["batch"], r["hidden"]) == (batch, hidden)}
    us = lambda impl, setting: 1e6 * times[impl, setting]  # noqa: E731
    warm_extra, cold_extra = us(SYNC_PATH, SINGLE) - us(LOCAL, SINGLE), us(SYNC_PATH, COLD) - us(LOCAL, COLD)
    text = (f"*Cold caches.* At {batch}x{hidden}, `BatchNorm1d` forward + backward takes {us(LOCAL, SINGLE):.0f} us "
            f"in one process, {us(LOCAL, COLD):.0f} us in one process with cold caches and {us(LOCAL, WORKERS):.0f} "
            "us in the workers (no collective in between: each iteration starts after a barrier). Our synchronized "
            f"path without collectives takes {us(SYNC_PATH, SINGLE):.0f} us warm and {us(SYNC_PATH, COLD):.0f} us "
            f"cold: what our layer adds to BatchNorm's kernels, {warm_extra:.0f} us warm, is {cold_extra:.0f} us "
            f"cold, {_more(cold_extra - warm_extra)}. ")
    return text + gap_text(doc, batch, hidden, cold_extra - warm_extra)


def _more(us: float) -> str:
    return f"{us:.0f} us more" if us >= 0 else f"{-us:.0f} us less"


def gap_text(doc: dict, batch: int, hidden: int, cold_us: float) -> str:
    """How much of the extra compute of the 2-worker iteration cold caches could explain, per transport: a share
    only where both are extra (ours computes more than the reference, and cold caches add to our layer)."""
    gaps = {t: 1e6 * g for t in transports(doc) if (g := findings.compute_gap(doc, batch, hidden, t))}
    if not gaps:
        return ""
    parts, shares = [], []
    for t, g in gaps.items():
        part = f"through {wire(t)} ours computes {_more(g)} than the reference outside its two collectives"
        if g > 0 and cold_us > 0:
            shares.append(cold_us / g)
            part += f", of which the cold caches' {cold_us:.0f} us are {100 * shares[-1]:.0f} %"
        parts.append(part)
    if cold_us <= 0:
        verdict = "cold caches add nothing to what our layer computes, so they explain none of it."
    elif not shares:
        verdict = "ours computes no more than the reference: there is no extra compute for cold caches to explain."
    elif max(shares) < 0.5:
        verdict = "cold caches of this kind account for a minority of that extra compute."
    else:
        verdict = "cold caches of this kind could account for most of that extra compute."
    return f"In the 2-worker iteration at that size (the table above), {'; '.join(parts)}: {verdict}"


def cold_caches(page) -> None:
    doc = page.load("syncbn")
    cold = sorted({(r["batch"], r["hidden"]) for r in kind(doc, "time") if r["setting"] == COLD})
    if cold:
        page.say(cold_caches_text(doc, *cold[0]), doc)
    else:
        page.missing("rows of the setting '1 process, cold caches' (python syncbn_benchmark.py --settings single)")
