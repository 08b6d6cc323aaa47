"""The report's DDP section (``results/ddp_benchmark.json``, the bucket-size sweep, and
``results/ddp_headline.json``, the headline run, from ddp_benchmark.py): every row and stored check, the
commentary, the traced iteration, the bucket sizes beside the seed's, and PyTorch's benchmark formats.

    from dpkit.report import ddp_section, page
    ddp_section.runs(page.Page.open())
"""

from __future__ import annotations

import os

from dpkit.bench import row_identity
from dpkit.report import findings, paths, plots, sentences, summary
from dpkit.report.wording import interval_text, ratio_text, span

CHECK_COLUMNS = [("model", "model", "s"), ("axis", "axis", "s"), ("label", "variant", "s"),
                 ("reference", "against", "s"), ("target", "measure", "s"), ("value", "median [95 % CI]", "s"),
                 ("limit_text", "target", "s"), ("judged", "verdict", "s")]


def row_columns(rounds: int | None) -> list[tuple[str, str, str]]:
    return [("label", "variant [transport]", "s"), ("p50_s", "p50 s/iter", ".4f"),
            ("p50_ci", findings.round_p50_interval_name(rounds), "s"), ("p90_s", "p90", ".4f"),
            ("comm_wait_s", "comm wait (s)", ".4f"), ("overhead_s", "overhead (s)", ".4f"),
            ("all_reduces", "all-reduces", "d"), ("peak_bytes", "peak memory (bytes)", ",d"),
            ("over", "oversubscribed", "s")]


def model_rows(page, doc: dict, model: str) -> None:
    """One model's settings in a line, then its rows with their intervals."""
    rows = [r for r in doc["results"] if r["model"] == model]
    first = rows[0]
    page.say(f"**{model}**: batch {first['batch_size']} per rank, {first['world_size']} ranks"
             + (" (oversubscribed)" if plots.oversubscribed(first, doc["env"]) else "")
             + f", {first['params']:,} parameters, {first['iters']} timed iterations per variant in "
               f"{first['rounds']} rounds.")
    page.show([{**r, "label": row_identity.label(r, path=True), "p50_ci": interval_text(plots.interval(r, "p50_s")),
                "over": "yes" if plots.oversubscribed(r, doc["env"]) else "no"} for r in rows],
              row_columns(first.get("rounds")), label=False)


def sides(check: dict) -> tuple[str, str]:
    """The labels of a stored check's two sides, from their stored fields, each naming the path it recorded."""
    return row_identity.label(check["row"], path=True), row_identity.label(check["reference_row"], path=True)


def pair(check: dict) -> str:
    """"label / reference" (``sides``)."""
    return " / ".join(sides(check))


def checks_table(page, checks: list[dict], doc: dict) -> None:
    """The stored checks, each on the axis the verdict counts put it (``paths.axis``: a zero-copy side against a
    staged one is on the transport axis, whatever it was stored as)."""
    page.show([{**c, "axis": _axis(c, doc), "label": sides(c)[0], "reference": sides(c)[1],
                "value": ratio_text(c["ratio"]),
                "limit_text": "-" if c["limit"] is None else f"<= {c['limit']:.2f}",
                "judged": c["verdict"] if c["limit"] is not None else "information"} for c in checks], CHECK_COLUMNS,
              label=False)


def _axis(check: dict, doc: dict) -> str:
    axis = paths.axis(check, doc)
    return axis if axis == check["axis"] else f"{axis} (stored as {check['axis']}: zero copy against staged)"


def file_section(page, doc: dict) -> None:
    """Every row of a ddp_benchmark.py file per model, the targets it checked and stored, and its figure."""
    for model in dict.fromkeys(r["model"] for r in doc["results"]):
        model_rows(page, doc, model)
    if doc.get("targets"):
        checks_table(page, doc["targets"], doc)
    else:
        page.missing("stored target checks (written by ddp_benchmark.py with its rows)")
    page.draw(plots.ddp_variants(doc))


def runs(page) -> None:
    page.say("### The bucket-size sweep (`results/ddp_benchmark.json`)")
    file_section(page, page.load("ddp_benchmark"))
    if headline := page.load("ddp_headline"):
        page.say("### The headline run: more rounds, one bucket size, every transport (`results/ddp_headline.json`)")
        file_section(page, headline)


def checks_source(page) -> tuple[dict, str]:
    """The file whose checks the commentary counts: the headline run's, else the sweep's."""
    headline = page.load("ddp_headline")
    return (headline, "ddp_headline.json") if headline else (page.load("ddp_benchmark"), "ddp_benchmark.json")


def thread_text(checks: list[dict]) -> str:
    """A communication thread against summing each bucket in the backward hook (information, no target)."""
    def direction(r):
        return "slower" if r["ci_low"] > 1 else "faster" if r["ci_high"] < 1 else "no difference resolved"

    return "; ".join(f"{pair(c)} {ratio_text(c['ratio'])} ({direction(c['ratio'])})"
                     for c in checks if c["axis"] == "overlap" and c["limit"] is None)


def separated(a: dict, b: dict) -> bool:
    """Whether two rows' p50 intervals do not overlap (False without intervals)."""
    x, y = plots.interval(a, "p50_s"), plots.interval(b, "p50_s")
    return bool(x and y and (x[1] < y[0] or y[1] < x[0]))


def caps_text(rows: list[dict]) -> str:
    """Per transport, the bucket cap with the lowest p50 in the sweep (resnet18), and which others it does not beat."""
    texts = []
    ours = [r for r in rows if row_identity.name(r) == "ddp ours" and r["model"] == "resnet18"]
    for transport in dict.fromkeys(r["transport"] for r in ours):
        caps = sorted((r for r in ours if r["transport"] == transport), key=lambda r: r["bucket_cap_mb"])
        best = min(caps, key=lambda r: r["p50_s"])
        overlapping = [row_identity.label(r, path=True) for r in caps if r is not best
                       and plots.interval(best, "p50_s") and plots.interval(r, "p50_s")
                       and plots.interval(best, "p50_s")[1] >= plots.interval(r, "p50_s")[0]]
        texts.append(f"on {transport}, the lowest p50 is {row_identity.label(best, path=True)}"
                     + (f", its interval overlapping those of {', '.join(overlapping)} (not decided by this run)"
                        if overlapping else ""))
    return "; ".join(texts)


def differ_text(judged: list[dict], sweep: dict) -> str:
    """The headline run's checks that the sweep checked too, and where their verdicts differ."""
    broad = sweep.get("targets") or []
    # One comparison in both runs: the same key but the reference row, which is "the faster PyTorch setting" and may
    # be another setting in the other run.
    loose = [k for k in findings.CHECK_KEY if k != "reference"]
    pairs, strict = findings.paired_checks(judged, broad, loose), findings.paired_checks(judged, broad)
    differ = [(c, o) for c, o in pairs if c.get("verdict") != o.get("verdict")]
    moved = len(pairs) - len(strict)
    return (f"Of these, the bucket-size sweep (`ddp_benchmark.json`, {sweep['config']['rounds']} rounds) checked "
            f"{len(pairs)} too" + (f" ({moved} against another reference row there: PyTorch's faster setting "
                                   "differs between the runs)" if moved else "")
            + f", with another verdict for {len(differ)}"
            + (": " + "; ".join(f"{pair(c)} ({c['target']}): {c['verdict']} here, "
                                f"{o['verdict']} there" + (f" (against {sides(o)[1]})"
                                                          if o.get("reference") != c.get("reference") else "")
                                for c, o in differ) if differ else "") + ". ")


def commentary(page) -> None:
    """The stored checks of the headline run (resnet18, 2 ranks) counted per axis, and the sweep's bucket sizes."""
    doc, name = checks_source(page)
    sweep = page.load("ddp_benchmark")
    checks = [c for c in doc.get("targets") or [] if not findings.oversubscribed(c, doc["env"])]
    judged, thread = [c for c in checks if c["limit"] is not None], thread_text(checks)
    page.say(f"*Commentary.* On {doc['env']['device_model']} ({doc['env']['cpus']} cores), of the targets of `{name}` "
             f"({doc['config']['rounds']} rounds; {', '.join(sorted({c['model'] for c in judged}))}, "
             f"{', '.join(map(str, sorted({c['world_size'] for c in judged})))} processes), per axis and kind: "
             f"{sentences.counts_inline([(doc, checks)])}. "
             + (differ_text(judged, sweep) if doc is not sweep else "")
             + (f"A communication thread against summing each bucket in the backward hook, on shared memory: "
                f"{thread}. " if thread else "")
             + f"Bucket sizes in the sweep (resnet18): {caps_text(sweep['results'])}.", label=False)


def traces(page) -> None:
    """The traced iteration of each variant (resnet18) as a timeline, and its share waiting in sync_gradients."""
    doc, _ = checks_source(page)
    where = page.results / "traces"
    traced = {r["label"]: r for r in doc["results"] if r["model"] == "resnet18" and r["engine"] is not None}
    found = plots.load_traces(str(where), "resnet18", traced)  # by label: a trace's file name is its row's slug
    if not found:
        page.missing(f"Chrome traces in {os.path.relpath(where)}/ (`python run_experiments.py --only ddp_traces`)")
        return
    page.draw(plots.overlap_timeline(found))
    spans = {label: plots.timeline_events(t) for label, t in found.items()}
    waits = {label: sum(d for name, _, d in s["phases"] if name == "sync_gradients") / s["length"]
             for label, s in spans.items()}
    page.say("Share of the traced iteration spent waiting in `sync_gradients`: "
             + "; ".join(f"{row_identity.label(traced[label], path=True)} {100 * w:.0f} %"
                         for label, w in waits.items())
             + " (one traced iteration each: an illustration, not a measurement).", label=False)


def bucket_series(rows: list[dict]) -> dict[str, list[dict]]:
    """Per model and transport, the rows of our DDP ("ddp ours", bucketed) by bucket cap, named by the first one's
    fields but the cap ("resnet18, ddp ours [shared_memory, zero copy]")."""
    ours = [r for r in rows if row_identity.name(r) == "ddp ours"]
    series = [sorted((r for r in ours if (r["model"], r["transport"]) == key), key=lambda r: r["bucket_cap_mb"])
              for key in dict.fromkeys((r["model"], r["transport"]) for r in ours)]
    return {f"{rs[0]['model']}, {row_identity.label({**rs[0], 'bucket_cap_mb': None}, path=True)}": rs for rs in series}


def seed_groups(seed: dict) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in seed["rows"]:
        groups.setdefault((r["local_batch_size"], r["seq_len"]), []).append(r)
    return groups


def buckets_figure(doc: dict, seed: dict, env: dict):
    """Time per iteration against the bucket cap, relative to the smallest cap, ours beside the seed's."""
    ours = {name: ([r["bucket_cap_mb"] for r in rs], [r["p50_s"] / rs[0]["p50_s"] for r in rs], "ddp ours")
            for name, rs in bucket_series(doc["results"]).items()}
    theirs = {f"batch {b}, seq {s}": ([r["bucket_size_mb"] for r in g],
                                      [r["train_time_s"] / g[0]["train_time_s"] for r in g])
              for (b, s), g in seed_groups(seed).items()}
    figure = plots.beside_seed(ours, theirs, xlabel="bucket cap (MiB for ours, MB for the seed)",
                               ylabel="time per iteration / at the smallest bucket",
                               ours_title=f"ours: {env['device_model']}, {doc['results'][0]['world_size']} processes",
                               seed_title=f"seed: {seed['hardware']}")
    for ax in figure.axes:
        ax.axhline(1, color="black", linewidth=0.8)
    return figure


def buckets_text(doc: dict, seed: dict, env: dict) -> str:
    groups, caps = seed_groups(seed), bucket_series(doc["results"])
    seed_fastest = sum(min(g, key=lambda r: r["train_time_s"])["bucket_size_mb"] == max(r["bucket_size_mb"] for r in g)
                       for g in groups.values())
    seed_spread = [max(r["train_time_s"] for r in g) / min(r["train_time_s"] for r in g) - 1 for g in groups.values()]
    spread = {m: max(r["p50_s"] for r in rs) / min(r["p50_s"] for r in rs) - 1 for m, rs in caps.items()}
    largest_fastest = [m for m, rs in caps.items() if min(rs, key=lambda r: r["p50_s"]) is rs[-1]]
    resolved = sum(all(separated(a, b) for a, b in zip(rs, rs[1:])) for rs in caps.values())
    return (f"Hardware: seed on {seed['hardware']}; ours on {summary.hardware(env)}. "
            f"In the seed the largest cap has the lowest time in {seed_fastest} of its {len(groups)} settings (one "
            f"measurement each), and the time "
            f"per iteration varies by {span([100 * s for s in seed_spread], '.1f')} % across caps; ours varies by "
            + ", ".join(f"{100 * s:.1f} % ({m})" for m, s in spread.items())
            + f", the largest cap of the lowest p50 in {len(largest_fastest)} of our {len(caps)} series. "
            + f"Every pair of neighbouring caps is separated by its 95 % intervals in {resolved} of our {len(caps)} "
            "series: "
            + ("on this machine the bucket size is mostly not resolved by this run, so the two shapes are **not "
               "comparable in detail**." if resolved < len(caps) else "the differences are resolved."))


def buckets_beside_seed(page) -> None:
    doc, seed = page.load("ddp_benchmark"), page.seeds["bucketed_ddp"]
    page.draw(buckets_figure(doc, seed, doc["env"]))
    page.say(buckets_text(doc, seed, doc["env"]), label=False)
