"""The report's section beyond one host (``results/multihost.json``, from multihost_benchmark.py): a simulated
job of several hosts on one machine, measured beside the latency-bandwidth model fitted to it, and the model of
a cluster built from this machine's shared memory and a stated network.

    from dpkit.report import multihost_section, page
    multihost_section.job(page.Page.open())
"""

from __future__ import annotations

from dpkit.bench.collectives import format_size
from dpkit.report import plots
from dpkit.report.wording import ratio_text

JOB_COLUMNS = [("label", "what", "s"), ("size", "size", "s"), ("measured", "measured p50 ms", ".2f"),
               ("model", "model ms", ".2f"), ("off", "measured / model", ".2f")]
INSIDE = "memory (the model's inside a host)"  # the link the file fitted to shared memory


def rows(doc: dict, *kinds: str) -> list[dict]:
    return [r for r in doc["results"] if r["kind"] in kinds]


def links(doc: dict) -> dict[str, dict]:
    return {r["label"]: r for r in rows(doc, "link")}


def oversubscribed_text(doc: dict) -> str:
    return " (oversubscribed)" if rows(doc, "collective", "step")[0]["oversubscribed"] else ""


def job_view(r: dict) -> dict:
    return {**r, "size": format_size(r["bytes"]) if "bytes" in r else "one step", "measured": r["p50_s"] * 1e3,
            "model": r.get("predicted_s", float("nan")) * 1e3,
            "off": r["p50_s"] / r["predicted_s"] if r.get("predicted_s") else None}


def job_text(doc: dict) -> str:
    hosts = rows(doc, "collective", "step")[0]["hosts"]
    return (f"**The simulated job**: {len(hosts)} hosts of {hosts[0]} ranks, {sum(hosts)} processes on "
            f"{doc['env']['cpus']} cores{oversubscribed_text(doc)}, {doc['config']['rounds']} rounds. Links fitted to "
            "its own measurements: "
            + "; ".join(f"{name} alpha {link['alpha_s'] * 1e6:.0f} us, beta {link['gbps']:.2f} GB/s"
                        for name, link in links(doc).items() if "source" not in link) + ".")


def steps_text(doc: dict) -> str:
    steps, label = {r["label"]: r["p50_s"] for r in rows(doc, "step")}, oversubscribed_text(doc)
    return (f"Measured, one step{label}: HSDP / FSDP [torch] {steps['HSDP'] / steps['FSDP [torch]']:.2f}x, "
            f"ZeRO-2 / ZeRO-1 {steps['ZeRO-2 [hierarchical]'] / steps['ZeRO-1 [hierarchical]']:.2f}x, "
            f"DDP [hierarchical] / DDP [torch] {steps['DDP [hierarchical]'] / steps['DDP [torch]']:.2f}x (p50 of "
            f"{doc['config']['iters']} iterations each).")


def job(page) -> None:
    """The simulated job: its links, each collective and step measured beside the model, and their ratios."""
    if not (doc := page.load("multihost")):
        return
    page.say(job_text(doc))
    page.show([job_view(r) for r in rows(doc, "collective", "step")], JOB_COLUMNS)
    page.say("Hierarchical / flat all-reduce [torch], same job, paired by round" + oversubscribed_text(doc) + ": "
             + ", ".join(f"{format_size(r['bytes'])} {ratio_text(r)}" for r in rows(doc, "ratio")) + ".")
    page.say(steps_text(doc))


def assumptions_text(doc: dict) -> str:
    memory, c = links(doc)[INSIDE], doc["config"]
    return (f"**The model of a cluster.** Assumptions: {c['ranks_per_host']} ranks per host; inside a host, this "
            f"machine's shared-memory all-reduce (alpha {memory['alpha_s'] * 1e6:.0f} us, {memory['gbps']:.2f} GB/s, "
            f"fitted to {memory['source']}); between hosts {c['network_gbps']:g} Gb/s per host and "
            f"{c['network_latency_us']:g} us per message, shared by the host's ranks when they send at once; "
            "gradients as large as the float32 parameters; DDP and ZeRO in 25 MiB buckets, FSDP and HSDP one unit per "
            "module holding parameters, each collective paying its latency; nothing overlapped with compute (an upper "
            "bound where it overlaps). 'ddp flat' is one ring over every rank; the other engines use the hierarchical "
            "form across hosts.")


def cluster_text(doc: dict, model: str, hosts: int) -> str:
    """At the most hosts modelled: which engine communicates least, and the engines' ratios."""
    mine = {r["engine"]: r["communication_s"] for r in rows(doc, "cluster")
            if r["model"] == model and r["hosts"] == hosts}
    least = min(mine.values())
    best = " and ".join(e for e in mine if mine[e] <= least * 1.001)  # ties: DDP and ZeRO-2 move the same bytes
    return (f"{model} at {hosts} hosts: least communication with {best} ({least * 1e3:.0f} ms per step); "
            f"hierarchical DDP / flat-ring DDP {mine['ddp'] / mine['ddp flat']:.2f}x, "
            f"HSDP / FSDP {mine['hsdp'] / mine['fsdp']:.2f}x, ZeRO-2 / ZeRO-1 {mine['zero2'] / mine['zero1']:.2f}x.")


def cluster(page) -> None:
    """The model of a cluster: its assumptions, its figure, and per model the engine that communicates least."""
    if not (doc := page.load("multihost")):
        return
    page.say(assumptions_text(doc))
    page.draw(plots.cluster_model(doc))
    at = max(r["hosts"] for r in rows(doc, "cluster"))
    for model in dict.fromkeys(r["model"] for r in rows(doc, "cluster")):
        page.say(cluster_text(doc, model, at))
