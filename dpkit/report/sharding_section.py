"""The report's section on sharded data parallelism (``results/sharding.json``, ``sharding_resnet18.json``,
``sharding_gpt.json``, from sharding_benchmark.py): what one rank holds under our DDP, ZeRO and FSDP, then per
file the time per iteration, the model states against the ideal, and every stored target.

    from dpkit.report import page, sharding_section
    sharding_section.tables(page.Page.open())
"""

from __future__ import annotations

from dpkit.report import findings, plots, sentences
from dpkit.report.wording import ratio_text

MIB = 2**20
FILES = ("sharding", "sharding_resnet18", "sharding_gpt")
ROW_COLUMNS = [("procs", "procs", "s"), ("variant", "variant", "s"), ("p50_ms", "p50 ms/iter", ".1f"),
               ("p95_ms", "p95 ms/iter", ".1f"), ("exposed_ms", "exposed comm ms", ".1f"),
               ("states_mib", "model states MiB", ".2f"), ("ideal_mib", "ideal MiB", ".2f"),
               ("state_vs_ideal", "states / ideal", ".2f"), ("peak_mib", "peak MiB", ".1f")]
TARGET_COLUMNS = [("procs", "procs", "s"), ("model", "model", "s"), ("target", "ratio", "s"),
                  ("value", "median [95 % CI]", "s"), ("limit_text", "target", "s"), ("verdict", "verdict", "s")]


def memory(page) -> None:
    """What one rank holds under our DDP, ZeRO and FSDP at each rank count."""
    if doc := page.load("sharding"):
        page.draw(plots.sharding_memory(doc))


def procs_text(row: dict, doc: dict) -> str:
    return f"{row['world_size']}{' (oversubscribed)' if findings.oversubscribed(row, doc['env']) else ''}"


def row_view(r: dict, doc: dict) -> dict:
    """One row in the table's units: milliseconds and MiB."""
    exposed = r["exposed_comm_s"]
    return {**r, "procs": procs_text(r, doc), "p50_ms": r["p50_s"] * 1e3, "p95_ms": r["p95_s"] * 1e3,
            "exposed_ms": None if exposed is None else exposed * 1e3, "states_mib": r["model_state_bytes"] / MIB,
            "ideal_mib": r["ideal_bytes"] / MIB, "peak_mib": r["peak_bytes"] / MIB}


def target_view(t: dict, doc: dict) -> dict:
    return {**t, "value": ratio_text(t["ratio"]) if t["ratio"] else f"{t['value']:.2f}x", "procs": procs_text(t, doc),
            "limit_text": "-" if t["limit"] is None else f"<= {t['limit']:.2f}"}


def zero_balance_text(rows: list[dict]) -> str:
    """The largest rank of each stage of our ZeRO the file has, against the ideal share of the model states."""
    stages = [(stage, [r["state_vs_ideal"] for r in rows if (r["engine"], r["impl"]) == (stage, "ours")])
              for stage in ("zero1", "zero2")]
    held = "; ".join(f"{stage} at most {max(values):.2f}x" for stage, values in stages if values)
    return (f"The largest rank of our ZeRO holds, of the ideal model-state bytes over every rank count measured: "
            f"{held} (bytes bookkeeping, one measurement each; its flat partition cuts the parameters into n "
            "near-equal ranges, so no single tensor unbalances it).")


def file_tables(page, doc: dict, name: str) -> None:
    """Per model its rows, then the file's targets, their counts and ZeRO's balance."""
    rows = [r for r in doc["results"] if "variant" in r]
    for model in dict.fromkeys(r["model"] for r in rows):
        page.say(f"**{model}** (`{name}.json`, {doc['config']['rounds']} rounds)")
        page.show([row_view(r, doc) for r in rows if r["model"] == model], ROW_COLUMNS)
    page.show([target_view(t, doc) for t in doc["results"] if "target" in t], TARGET_COLUMNS)
    page.say(sentences.sharding_counts(doc, name))
    page.say(zero_balance_text(rows))


def tables(page) -> None:
    """The quick GPT run at 1, 2 and 4 ranks, resnet18 at 2 ranks, the GPT at its default size at 2 ranks."""
    for name in FILES:
        if doc := page.load(name):
            file_tables(page, doc, name)
