"""The report's SyncBatchNorm section: the test outcomes, time and memory per size against BatchNorm plus the
same two sums, the commentary, and the comparison with the homework solution we started from.

    from dpkit.report import page, syncbn_section
    syncbn_section.speed(page.Page.open())

It reads ``results/syncbn.json`` (syncbn_benchmark.py) and ``results/syncbn_tests.xml`` (pytest's report of
tests/test_syncbn.py); ``syncbn_detail`` has the rest of the file (one process, low precision, profiles).
"""

from __future__ import annotations

import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

from dpkit.bench import transport_choice
from dpkit.report import findings, paths, plots, summary
from dpkit.report.wording import ratio_text, span, verdict_text, wire

LOCAL = "BatchNorm1d (local)"


def test_outcomes(results: Path) -> tuple[dict, list[dict]]:
    """The suite's attributes (tests, failures, errors, skipped, time) and per test function its outcomes."""
    suite = ET.parse(Path(results) / "syncbn_tests.xml").getroot().find("testsuite")
    by_test: dict[str, dict] = {}
    for case in suite.findall("testcase"):
        name = case.get("name").split("[")[0]
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        by_test.setdefault(name, {"test": name, "passed": 0, "failed": 0, "skipped": 0})[outcome] += 1
    return dict(suite.attrib), sorted(by_test.values(), key=lambda r: r["test"])


def tests(page) -> None:
    suite, rows = test_outcomes(page.results)
    page.say(f"{suite['tests']} test cases: {suite['failures']} failed, {suite['errors']} errors, "
             f"{suite['skipped']} skipped, in {float(suite['time']):.1f} s.")
    page.show(rows, [("test", "test", "s"), ("passed", "passed", "d"), ("failed", "failed", "d"),
                     ("skipped", "skipped", "d")])


def timed(doc: dict) -> list[dict]:
    """The workers' float32 time rows (the file also holds one-process, low-precision, ratio, target and
    profile rows: ``syncbn_detail`` reads those)."""
    return [r for r in doc["results"] if r.get("kind", "time") == "time" and r.get("setting", "workers") == "workers"
            and r.get("dtype", "float32") == "float32"]


def target(doc: dict) -> float:
    """The benchmark's own limit for the workers at every size."""
    return next(t["limit"] for t in doc["results"]
                if t.get("kind") == "target" and t["setting"] == "workers" and "every size" in t["name"])


def transports(doc: dict) -> list[str]:
    return transport_choice.in_order(r["transport"] for r in timed(doc) if r.get("transport"))


def key(r: dict) -> tuple[int, int]:
    return r["batch"], r["hidden"]


def by_size(rows) -> dict[tuple[int, int], dict]:
    return {key(r): r for r in rows}


def ratios(doc: dict, transport: str) -> dict[tuple[int, int], dict]:
    """Ours / (BatchNorm + the same two sums), per size."""
    return by_size(plots.syncbn_ratios(doc, transport=transport))


def floor_ratios(doc: dict, transport: str) -> dict[tuple[int, int], dict]:
    """The floor (BatchNorm in a Python Function + 2 sums) / the reference, per size."""
    return by_size(plots.syncbn_ratios(doc, plots.SYNCBN_REFERENCE, plots.SYNCBN_FLOOR, transport))


def over_floor(doc: dict, transport: str) -> dict[tuple[int, int], dict]:
    return by_size(plots.syncbn_ratios(doc, plots.SYNCBN_FLOOR, "ours", transport))


def ours(doc: dict, transport: str) -> dict[tuple[int, int], dict]:
    return by_size(r for r in timed(doc) if r["impl"] == "ours" and r.get("transport") == transport)


def speed_row(doc: dict, size: tuple[int, int], transport: str, limit: float, ratio: dict | None,
              floor: dict | None) -> dict:
    """One size's columns for one transport: time, ratio (``ratios``' of the size) and verdict, the floor
    (``floor_ratios``'), memory against BatchNorm."""
    mine, local = ours(doc, transport)[size], by_size(r for r in timed(doc) if r["impl"] == LOCAL)[size]
    t = transport
    return {f"ms_{t}": 1e3 * mine["time_s"], f"ratio_{t}": ratio_text(ratio),
            f"verdict_{t}": verdict_text(ratio, limit),
            f"floor_{t}": ratio_text(floor) if floor else "-", f"mem_{t}": mine["peak_bytes"] / local["peak_bytes"],
            f"saved_{t}": mine["saved_bytes"] / local["saved_bytes"]}


def speed_table(doc: dict) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """One row per size, each transport's columns side by side."""
    limit, wires = target(doc), transports(doc)
    sizes = sorted(key(r) for r in timed(doc) if r["impl"] == LOCAL)
    # Each transport's ratios once (an interval is a bootstrap over rounds), then a row per size.
    paired = {t: (ratios(doc, t), floor_ratios(doc, t)) for t in wires}
    rows = [{"batch": b, "hidden": h} | {k: v for t in wires for k, v in speed_row(
                doc, (b, h), t, limit, paired[t][0].get((b, h)), paired[t][1].get((b, h))).items()}
            for b, h in sizes]
    columns = [("batch", "batch", "d"), ("hidden", "hidden", "d")]
    for t in wires:
        columns += [(f"ms_{t}", f"ours [{t}] (ms, median)", ".3f"),
                    (f"ratio_{t}", f"ours / (BN + 2 sums) [{t}], 95 % interval", "s"),
                    (f"verdict_{t}", f"target <= {limit}", "s"), (f"floor_{t}", f"floor / (BN + 2 sums) [{t}]", "s")]
    first = wires[0]
    columns += [(f"mem_{first}", "peak memory ours / BN", ".2f"),
                (f"saved_{first}", "bytes saved for backward ours / BN", ".2f")]
    return rows, columns


def speed(page) -> None:
    """The table of every size, a line when the file has no intervals, and the grid figure."""
    doc = page.load("syncbn")
    rows, columns = speed_table(doc)
    page.show(rows, columns, doc)
    if all(r.get("ci_low") is None for t in transports(doc) for r in ratios(doc, t).values()):
        page.missing("per-round SyncBN times or ci_low/ci_high (no confidence intervals for these ratios)")
    page.draw(plots.syncbn_grid(doc, target(doc)))


def below_floor_text(doc: dict, transport: str) -> str:
    """Where ours measured below the floor, and whether the interval resolves it."""
    below = [(k, r) for k, r in sorted(over_floor(doc, transport).items()) if r["median"] < 1]
    if not below:
        return ""
    resolved = sum(r["ci_high"] is not None and r["ci_high"] < 1 for _, r in below)
    return (f" (below the floor at {', '.join(f'{b}x{h}' for (b, h), _ in below)}: "
            + ("the interval holds 1 there, so the difference is not resolved" if not resolved else
               f"resolved at {resolved} of them") + ")")


def transport_sentence(doc: dict, transport: str) -> str:
    """Ours against the reference through one transport: the span, the verdicts, the floor."""
    rs, limit = list(ratios(doc, transport).values()), target(doc)
    counts = {v: sum(verdict_text(r, limit) == v for r in rs) for v in ("met", "missed", "inconclusive")}
    shm = paths.path("[shared_memory]", doc)  # zero copy or staged, as the file says
    named = wire(transport) + (f" ({shm}: {paths.SYNCBN_SUMS[shm]})" if transport == "shared_memory" else "")
    text = (f"through {named} ours takes {span([r['median'] for r in rs])} times BatchNorm plus the same "
            f"two sums: the target <= {limit}x is met on {counts['met']}, missed on {counts['missed']} and "
            f"inconclusive on {counts['inconclusive']} of the {len(rs)} sizes")
    floor, over = floor_ratios(doc, transport), over_floor(doc, transport)
    if floor and over:
        text += (f"; the floor takes {span([r['median'] for r in floor.values()])} times the reference and ours "
                 f"{span([r['median'] for r in over.values()])} times the floor" + below_floor_text(doc, transport))
    return text


def targets_text(doc: dict) -> str:
    return "; ".join(transport_sentence(doc, t) for t in transports(doc))


def extra_text(doc: dict) -> str:
    """The time ours adds per transport, beside the reference's own time: why the ratios differ."""
    extra = {t: findings.syncbn_extra(doc, t) for t in transports(doc)}
    if set(extra) != {"torch", "shared_memory"} or not all(extra.values()):
        return ""
    cheaper = {t: statistics.median(r["median"] for r in ratios(doc, t).values()) for t in extra}
    g, m = extra["torch"], extra["shared_memory"]
    text = (f"Per size, ours adds a median of {1e6 * g['extra_s']:.0f} us to the reference through gloo and "
            f"{1e6 * m['extra_s']:.0f} us through shared memory, where the reference itself takes a median of "
            f"{1e6 * g['reference_s']:.0f} us and {1e6 * m['reference_s']:.0f} us (median ratio "
            f"{cheaper['torch']:.2f} and {cheaper['shared_memory']:.2f}): ")
    smaller = (cheaper["shared_memory"] > cheaper["torch"] and m["reference_s"] < g["reference_s"]
               and m["extra_s"] <= g["extra_s"])
    return text + ("the ratio is larger on shared memory because the reference is smaller there, not because ours "
                   "adds more. " if smaller else "compare the time added, not the ratios, across transports. ")


def memory_span(doc: dict) -> str:
    rows, _ = speed_table(doc)
    return span([r[f"mem_{transports(doc)[0]}"] for r in rows])


def commentary(page) -> None:
    """The sentences of the table above, from its ratios and the benchmark's own target rows."""
    doc = page.load("syncbn")
    page.say(f"*Commentary.* On {doc['env']['device_model']} ({doc['env']['cpus']} cores), {doc['config']['workers']} "
             "workers, "
             f"over the {len(speed_table(doc)[0])} sizes, {targets_text(doc)}. " + extra_text(doc)
             + f"Memory: ours peaks at {memory_span(doc)} times `BatchNorm1d`'s memory in float32 and keeps no more "
               "bytes for backward, because it saves the input and a few per-channel vectors.", doc)


def seed_rows(doc: dict, seed: dict) -> list[dict]:
    """Per size both measured: the seed's layer / PyTorch's SyncBN, ours / BatchNorm1d (memory and time)."""
    theirs = {(r["batch_size"], r["hidden_dim"]): r for r in seed["syncbn"]["selfmade"]}
    torch_sync = {(r["batch_size"], r["hidden_dim"]): r for r in seed["syncbn"]["pytorch"]}
    first = transports(doc)[0]
    mine, local, ratio = ours(doc, first), by_size(r for r in timed(doc) if r["impl"] == LOCAL), ratios(doc, first)
    return [{"batch": b, "hidden": h,
             "seed_mem": theirs[b, h]["max_memory_allocated_bytes"] / torch_sync[b, h]["max_memory_allocated_bytes"],
             "seed_time": theirs[b, h]["median_time_s"] / torch_sync[b, h]["median_time_s"],
             "our_mem": mine[b, h]["peak_bytes"] / local[b, h]["peak_bytes"], "our_time": ratio[b, h]["median"]}
            for b, h in sorted(set(theirs) & set(mine))]


def seed_figure(rows: list[dict], seed: dict, env: dict):
    """Peak memory ratio per hidden size, ours beside the seed's, one line per batch."""
    batches = sorted({r["batch"] for r in rows})
    series = lambda b, k: ([r["hidden"] for r in rows if r["batch"] == b], [r[k] for r in rows if r["batch"] == b])  # noqa: E731
    figure = plots.beside_seed(
        {f"ours / BatchNorm1d, batch {b}": (*series(b, "our_mem"), "ours") for b in batches},
        {f"seed / PyTorch SyncBN, batch {b}": series(b, "seed_mem") for b in batches},
        xlabel="hidden size (channels)", ylabel="peak memory ratio (x)", sharey=True,
        ours_title=f"ours: {env['device_model']}, {env['cpus']} cores, gloo", seed_title=f"seed: {seed['hardware']}")
    for ax in figure.axes:
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_ylim(bottom=0)
    return figure


def seed_text(rows: list[dict], seed: dict, env: dict, transport: str) -> str:
    our_mem, where = [r["our_mem"] for r in rows], "CPU" if env["device"] == "cpu" else "GPU"  # PyTorch's: GPUs only
    return (f"Hardware: seed on {seed['hardware']}; ours on {summary.hardware(env)}. "
            f"**Memory, each against its own reference** (not a ranking: the references, devices and dtypes differ). "
            f"The seed's layer used {span([r['seed_mem'] for r in rows])} times the memory of PyTorch's SyncBatchNorm "
            f"on GPUs; ours uses {span(our_mem)} times that of `BatchNorm1d` in float32 on {where} "
            f"({'under' if max(our_mem) < 1 else 'not under'} 1 at every size). **Time: not comparable.** The seed's "
            f"layer ran at {span([r['seed_time'] for r in rows])} times PyTorch's SyncBatchNorm on GPUs; on {where} "
            + ("ours has no PyTorch SyncBatchNorm to be compared with, and" if where == "CPU" else
               "ours (its `torch.nn.SyncBatchNorm` column is in `syncbn.json`)")
            + f" takes {span([r['our_time'] for r in rows])} times `BatchNorm1d` plus the two `all_reduce` calls "
              f"through {transport} (a different denominator: BatchNorm with the bare collectives, not another "
              "synchronized layer).")


def beside_seed(page) -> None:
    """The homework solution's SyncBatchNorm table beside ours: a table, a figure, what compares and what not."""
    doc, seed = page.load("syncbn"), page.seeds["homework_solution"]
    rows, first = seed_rows(doc, seed), transports(doc)[0]
    if not rows:
        page.missing("a size of the seed's grid (batch, hidden) in results/syncbn.json")
        return
    page.show(rows, [("batch", "batch", "d"), ("hidden", "hidden", "d"),
                     ("seed_mem", "seed: memory, its layer / PyTorch SyncBN", ".2f"),
                     ("our_mem", "ours: memory / BatchNorm1d (local)", ".2f"),
                     ("seed_time", "seed: time, its layer / PyTorch SyncBN", ".2f"),
                     ("our_time", f"ours: time / (BatchNorm1d + 2 all_reduce) [{first}], median over rounds", ".2f")])
    page.draw(seed_figure(rows, seed, doc["env"]))
    page.say(seed_text(rows, seed, doc["env"], first))
