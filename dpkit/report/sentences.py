"""The report's computed sentences, one function per sentence, so that report.ipynb's cells are calls and the
words are tested here: a trend word only where ``findings.trend`` resolves one, a comparison with PyTorch only as
the stored paired ratio with its interval, "above" or "below" a target only where the interval lies there, and
verdicts counted per axis and kind (``findings.tally``).

    from dpkit.report import sentences
    sentences.allreduce_commentary(read_results("results/allreduce.json"))

Each function takes result documents in the layout of ``dpkit.bench.results`` and returns markdown.
"""

from __future__ import annotations

from dpkit.bench.measure import format_ratio
from dpkit.report import findings


def ring_vs_torch(doc: dict, world: int) -> list[tuple[int, float, float, float]]:
    """(elements, median, low, high) of allreduce.py's stored paired ratio ring / torch at ``world`` processes."""
    return [(r["numel"], r["vs_torch"], r["vs_torch_ci_low"], r["vs_torch_ci_high"]) for r in doc["results"]
            if r.get("algorithm") == "ring" and r["world_size"] == world and r.get("vs_torch_ci_low") is not None]


def allreduce_commentary(doc: dict) -> str:
    """Per process count that is not oversubscribed: ring / torch as the stored paired ratios with their intervals,
    and the trend word their intervals decide; then the largest error of any algorithm."""
    env = doc["env"]
    worlds = sorted({r["world_size"] for r in doc["results"] if r["world_size"] > 1
                     and not findings.oversubscribed(r, env)})
    parts = []
    for w in worlds:
        points = ring_vs_torch(doc, w)
        if points:
            word = findings.trend([(x, low, high) for x, _, low, high in points])
            parts.append(f"at {w} processes ring / torch (paired by round, {findings.interval_name(None)}) "
                         f"{findings.TREND_WORDS[word]} with the tensor size ({findings.series_text(points)} float32 "
                         "elements)")
    errors = [r["max_abs_error"] for r in doc["results"] if r["world_size"] in worlds and "max_abs_error" in r]
    accuracy = (f" At {' and '.join(map(str, worlds))} processes every algorithm stays within {max(errors):.1e} of "
                "the exact mean, a few float32 rounding steps." if errors else "")
    return (f"*Commentary.* Without oversubscription, over gloo on {env['device_model']} ({env['cpus']} cores): "
            + "; ".join(parts) + "." + accuracy + " The rows with more processes than cores are shaded in the "
            "figure and not used here.")


def counts_paragraph(sources: list[tuple[dict, list[dict]]], lead: str) -> str:
    """``lead`` then one line per axis and kind of ``findings.tally`` over ``sources`` ((doc, checks) pairs)."""
    rows = findings.tally(sources)
    if not rows:
        return f"{lead}: no target checked outside one-process and oversubscribed runs."
    return f"{lead}:\n\n" + "\n".join(f"* {findings.tally_text(r)}" for r in rows)


def sharding_counts(doc: dict, name: str) -> str:
    """The targets of one sharding_benchmark.py file, counted per axis and kind, and what was left out."""
    checks = [t for t in doc["results"] if "target" in t]
    apart = [t for t in checks if t["limit"] is not None and t not in findings.counted(checks, doc["env"])]
    worlds = sorted({t["world_size"] for t in apart})
    left = (f" ({len(apart)} targets of runs at {' and '.join(map(str, worlds))} processes left out: one process "
            f"communicates nothing, and more processes than {doc['env']['cpus']} cores is oversubscribed)"
            if apart else "")
    return counts_paragraph([(doc, checks)], f"Targets of `{name}.json`, per axis and kind{left}")


def counts_inline(sources: list[tuple[dict, list[dict]]]) -> str:
    """``findings.tally`` over ``sources`` on one line: "engine, time: 1 met, 0 missed, 1 inconclusive of 2; ..."."""
    return "; ".join(findings.tally_text(r) for r in findings.tally(sources)) or "no target counted"


def again_text(other: dict | None) -> str:
    """The verdict allreduce.py's run gave the same auto / torch comparison (``findings.repeated_allreduce``)."""
    if other is None:
        return ""
    return (f" (`allreduce.py`, another run of this comparison, {other['ratio']['rounds']} rounds: "
            f"{format_ratio(other['ratio'])} {other['verdict']})")


def collective_targets(doc: dict, homework: dict | None) -> list[str]:
    """collectives_benchmark.py's stored targets as markdown lines: the counts per axis and kind, then each target
    not oversubscribed, with allreduce.py's verdict beside where it checked the same comparison, then the rest."""
    stored = doc.get("targets") or []
    counted = findings.counted(stored, doc["env"])
    again = {id(c): o for c, o in findings.repeated_allreduce(doc, homework or {})}
    apart = [t for t in stored if t not in counted]
    lines = ["", f"Targets without oversubscription, per axis and kind: {counts_inline([(doc, stored)])}:", ""]
    lines += [f"* {t['text']}{again_text(again.get(id(t)))}" for t in counted]
    if apart:
        lines += ["", f"Oversubscribed, more processes than the {doc['env']['cpus']} cores (shown, not counted):", ""]
        lines += [f"* {t['text']}" for t in apart]
    return lines
