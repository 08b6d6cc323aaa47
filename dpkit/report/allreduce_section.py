"""The report's section on the homework's all-reduce algorithms (``results/allreduce.json``, allreduce.py's
benchmark): ring, butterfly and halving-doubling against torch's all_reduce at each world and size, and the
homework solution's ring / torch beside ours.

    from dpkit.report import allreduce_section, page
    allreduce_section.table(page.Page.open())
"""

from __future__ import annotations

from dpkit.report import findings, plots, sentences
from dpkit.report.wording import span

ALGORITHMS = (("ring", "ring"), ("butterfly", "bfly"), ("halving_doubling", "hd"), ("torch", "torch"))
ERRORS = ("ring_err", "bfly_err", "hd_err", "torch_err")
COLUMNS = [("world", "processes", "d"), ("over", "oversubscribed", "s"), ("elements", "float32 elements", ",d"),
           ("ring_ms", "ring ms", ".3f"), ("bfly_ms", "butterfly ms", ".3f"), ("hd_ms", "halving-doubling ms", ".3f"),
           ("torch_ms", "torch ms", ".3f"), ("ring_vs_torch", "ring / torch (paired)", ".2f"),
           ("ring_vs_torch_ci", "95 % interval", "s"), ("ring_kib", "ring KiB", ".1f"),
           ("bfly_kib", "butterfly KiB", ".1f"), ("hd_kib", "h-d KiB", ".1f"), ("ring_err", "error ring", ".1e"),
           ("bfly_err", "error butterfly", ".1e"), ("hd_err", "error h-d", ".1e"), ("torch_err", "error torch", ".1e")]


def over(doc: dict, world: int) -> bool:
    return plots.oversubscribed({"world_size": world}, doc["env"])


def cell_row(doc: dict, cell: dict, world: int, n: int) -> dict:
    """One world and size: each algorithm's time, memory and error, and the ring's paired ratio to torch."""
    row = {"world": world, "elements": n, "over": "yes" if over(doc, world) else "no"}
    for alg, short in ALGORITHMS:
        if r := cell.get((world, n, alg)):
            row |= {f"{short}_ms": 1e3 * r["time_s"], f"{short}_kib": r["memory_bytes"] / 1024,
                    f"{short}_err": r["max_abs_error"]}
    ring = cell.get((world, n, "ring"))
    if ring and ring.get("vs_torch_ci_low") is not None:  # the paired ratio the file stores, not a ratio of medians
        row |= {"ring_vs_torch": ring["vs_torch"],
                "ring_vs_torch_ci": f"[{ring['vs_torch_ci_low']:.2f}, {ring['vs_torch_ci_high']:.2f}]"}
    return row


def rows(doc: dict) -> list[dict]:
    cell = {(r["world_size"], r["numel"], r["algorithm"]): r for r in doc["results"]}
    return [cell_row(doc, cell, w, n) for w in worlds(doc) for n in sizes(doc)]


def worlds(doc: dict) -> list[int]:
    return sorted({r["world_size"] for r in doc["results"]})


def sizes(doc: dict) -> list[int]:
    return sorted({r["numel"] for r in doc["results"]})


def table(page) -> None:
    doc = page.load("allreduce")
    page.show(rows(doc), COLUMNS)
    page.draw(plots.allreduce_table(doc))
    page.say(sentences.allreduce_commentary(doc))


def ours_ratio(doc: dict) -> dict[int, dict[int, float]]:
    """Per size, per world above one: ring / torch, paired by round."""
    return {n: {r["world"]: r["ring_vs_torch"] for r in rows(doc)
                if r["elements"] == n and r["world"] > 1 and "ring_vs_torch" in r} for n in sizes(doc)}


def seed_figure(doc: dict, seed: dict, env: dict):
    seed_ratio = {r["world_size"]: r["ring_time_s"] / r["torch_time_s"] for r in seed["allreduce"]["ring_vs_torch"]}
    figure = plots.beside_seed(
        {f"ring / torch, {n:,} elements": (list(v), list(v.values()), "ring") for n, v in ours_ratio(doc).items()},
        {"ring / torch (its sizes grow with the world)": ([w for w in seed_ratio if w > 1],
                                                          [seed_ratio[w] for w in seed_ratio if w > 1])},
        xlabel="processes", ylabel="time ratio ring / torch (x)", seed_title=f"seed: {seed['hardware']}",
        ours_title=f"ours: {env['device_model']}, {env['cpus']} cores (shaded: oversubscribed)")
    plots.shade_oversubscribed(figure.axes[0], [w for w in worlds(doc) if over(doc, w)])
    for ax in figure.axes:
        ax.axhline(1, color="black", linewidth=0.8)
    return figure


def seed_text(doc: dict, seed: dict, env: dict) -> str:
    """Ring / torch at the world sizes both measured, and why the two are not comparable."""
    seed_ar = seed["allreduce"]
    seed_ratio = {r["world_size"]: r["ring_time_s"] / r["torch_time_s"] for r in seed_ar["ring_vs_torch"]}
    ours = ours_ratio(doc).values()
    common = sorted(w for w in seed_ratio if w > 1 and not over(doc, w) and any(w in v for v in ours))
    tables = ("ring_vs_butterfly", "ring_vs_torch")
    seed_errors = [v for t in tables for r in seed_ar[t] for k, v in r.items() if k.startswith("diff_")]
    errors = [r[k] for r in rows(doc) if r["world"] > 1 for k in ERRORS if k in r]
    over_worlds = [w for w in worlds(doc) if over(doc, w)]
    return (f"Hardware: seed on {seed['hardware']}; ours on {env['device_model']} ({env['cpus']} cores, gloo). "
            f"At {', '.join(map(str, common))} processes (the counts both measured, ours without oversubscription) "
            f"the seed's ring took {span([seed_ratio[w] for w in common])} times its torch time (its own times, no "
            "interval); ours, paired by round: "
            + "; ".join(findings.against_pytorch({"median": m, "ci_low": lo, "ci_high": hi, "rounds": 2},
                                                 f"ring / torch at {w} processes, {n:,} elements")
                        for w in common for n, m, lo, hi in sentences.ring_vs_torch(doc, w)) + ". "
            + "**Not comparable**: the seed does not say what its times span nor where its all-reduce ran (seeds.json "
              f"on its times: \"{seed_ar['time_unit']}\"). Its ring / torch tensors had "
              f"{span([r['tensor_size'] for r in seed_ar['ring_vs_torch']], ',d')} elements and its tables go to "
              f"{', '.join(map(str, sorted({r['world_size'] for t in tables for r in seed_ar[t]})))} processes; ours "
              f"ran {', '.join(map(str, worlds(doc)))} processes"
            + (f", {' and '.join(map(str, over_worlds))} of them oversubscribed on {env['cpus']} cores"
               if over_worlds else "")
            + ". The seed's largest difference from the exact result, over both its tables, is "
              f"{max(seed_errors):.1e}, "
              f"in a dtype it does not state (seeds.json: \"{seed_ar['dtype']}\"); ours, over our algorithms and "
              f"torch's alike (as the seed's tables hold its algorithms and torch's), is {max(errors):.1e} in "
              f"{', '.join(sorted({r['dtype'] for r in doc['results']}))}.")


def beside_seed(page) -> None:
    doc, seed = page.load("allreduce"), page.seeds["homework_solution"]
    page.draw(seed_figure(doc, seed, doc["env"]))
    page.say(seed_text(doc, seed, doc["env"]))
