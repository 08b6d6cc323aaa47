"""The facts behind the report's sentences and README's headline block, computed from result rows, so that
no comparison in either is typed by hand.

    from dpkit.report import findings
    findings.countable(doc["targets"], doc["env"])     # the target checks a count or a headline may rest on

Each function reads rows in the layout of ``dpkit.bench.results`` and returns numbers, rows or a short
fragment; the caller composes the sentence and names hardware, transport and denominator. A run with more
processes than CPU cores (``oversubscribed``) never enters a count, and an interval over fewer than
``MIN_BOOTSTRAP_ROUNDS`` rounds is called the range of those rounds, not a 95 % interval. Words follow the
intervals: "above" or "below" a target only where the whole interval is (``position``), a trend only where
intervals are apart (``trend``), and counts per axis and kind, without one-process runs (``tally``). Nothing here
imports matplotlib: README's block is rendered from these functions too.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence

from dpkit.bench.measure import format_ratio, paired_ratio
from dpkit.bench.row_identity import what
from dpkit.report import paths

VERDICTS = ("met", "missed", "inconclusive")
# A percentile bootstrap over fewer rounds than this gives back little more than the spread of the few values.
MIN_BOOTSTRAP_ROUNDS = 5
# The fields that make two stored target checks the same comparison (ddp_benchmark.py's checks): each side by
# its identity (``rows.what``: the fields but the path).
CHECK_KEY = ("model", "world_size", "axis", "row", "reference_row", "target")
SYNCBN_REFERENCE = "BatchNorm1d + 2 all_reduce"  # syncbn_benchmark.py's label of BatchNorm plus the two sums


def oversubscribed(row: dict, env: dict | None = None) -> bool:
    """The row's own flag, or more processes than the machine's CPUs on a CPU run: a row or a target check
    (sharding_benchmark.py's carry no flag) of 4 processes on 2 cores is oversubscribed whatever its fields say."""
    env = env or {}
    device = row.get("device", env.get("device", "cpu"))
    cpus = env.get("cpus")
    return bool(row.get("oversubscribed")) or (device == "cpu" and bool(cpus)
                                               and int(row.get("world_size", 1)) > int(cpus))


def interval_name(rounds: int | None) -> str:
    """What an interval over ``rounds`` rounds is, for a column header or a sentence: "95 % interval", or
    "range of 2 rounds" below ``MIN_BOOTSTRAP_ROUNDS`` (None: rounds unknown, the interval stored with the row)."""
    if rounds is not None and rounds < MIN_BOOTSTRAP_ROUNDS:
        return f"range of {rounds} rounds"
    return "95 % interval"


def round_p50_interval_name(rounds: int | None) -> str:
    """The header of a column of ``plots.interval(row, "p50_s")``: an interval of the median of the rounds' p50s,
    which a p50 over all iterations pooled (the column beside it) may lie outside."""
    if rounds is not None and rounds < MIN_BOOTSTRAP_ROUNDS:
        return f"range of the {rounds} rounds' p50s"
    return "95 % interval of the median round p50"


# --------------------------------------------------------------------------- target checks


def countable(checks: Iterable[dict], env: dict | None) -> list[dict]:
    """The checks a count or a headline may rest on: those with a target (``limit`` set) whose run is not
    oversubscribed on the machine of ``env``."""
    return [c for c in checks if c.get("limit") is not None and not oversubscribed(c, env)]


def verdict_counts(checks: Iterable[dict]) -> dict[str, int]:
    """{"met": n, "missed": n, "inconclusive": n} over ``checks``."""
    checks = list(checks)
    return {v: sum(c.get("verdict") == v for c in checks) for v in VERDICTS}


def counts_text(checks: Iterable[dict]) -> str:
    """"3 met, 0 missed, 1 inconclusive": every verdict, zeros included."""
    return ", ".join(f"{n} {v}" for v, n in verdict_counts(checks).items())


def paired_checks(checks: Iterable[dict], others: Iterable[dict], key: Sequence[str] = CHECK_KEY) -> list[tuple]:
    """(check, other) for each comparison (same ``key`` fields) both lists made, in the order of ``checks``; a
    comparison only one of them made is left out."""
    def fields(check: dict) -> tuple:
        return tuple(what(v) if isinstance(v := check.get(k), dict) else v for k in key)

    theirs = {fields(o): o for o in others}
    pairs = [(c, theirs.get(fields(c))) for c in checks]
    return [(c, o) for c, o in pairs if o is not None]


def differing_verdicts(checks: Iterable[dict], others: Iterable[dict], key: Sequence[str] = CHECK_KEY) -> list[tuple]:
    """The pairs of ``paired_checks`` whose two verdicts differ (two runs of one benchmark that disagree)."""
    return [(c, o) for c, o in paired_checks(checks, others, key) if o.get("verdict") != c.get("verdict")]


KINDS = ("time", "memory", "bytes bookkeeping")
ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def kind(check: dict) -> str:
    """What a check measures: "bytes bookkeeping" (model-state bytes against their ideal: sizes added up, nothing
    timed), "memory" (a peak, or bytes saved or held, measured once), or "time"."""
    # Transport names in brackets are not what is measured ("[shared_memory]" says where, not "memory").
    text = re.sub(r"\[[^\]]*\]", "", check.get("target") or check.get("name") or "")
    if "/ ideal" in text:
        return "bytes bookkeeping"
    return "memory" if "memory" in text or "_bytes" in text else "time"


def single_measurement(check: dict) -> bool:
    """True when the verdict rests on one measurement: no ratio with an interval over two rounds or more
    (syncbn_benchmark.py's per-size target rows: their memory is measured once, their times in rounds)."""
    if check.get("kind") == "target":
        return kind(check) != "time"
    ratio = check.get("ratio")
    return not isinstance(ratio, dict) or (ratio.get("rounds") or 1) < 2 or ratio.get("ci_low") is None


def counted(checks: Iterable[dict], env: dict | None) -> list[dict]:
    """The checks a count rests on: ``countable`` ones of runs that communicate."""
    return _communicating(countable(checks, env))


def judged(checks: Iterable[dict], env: dict | None) -> list[dict]:
    """Every verdict of runs that communicate, not oversubscribed, those judged without a numeric limit included (a
    requirement met or missed: PyTorch's test base passing on "dpkit" as on gloo)."""
    return _communicating(c for c in checks if c.get("verdict") in VERDICTS and not oversubscribed(c, env))


def _communicating(checks: Iterable[dict]) -> list[dict]:
    """Checks of more than one process, and not syncbn_benchmark.py's one-process setting."""
    return [c for c in checks if int(c.get("world_size", 2)) > 1 and c.get("setting") != "1 process"]


def tally(sources: Iterable[tuple[dict, Iterable[dict]]]) -> list[dict]:
    """Verdict counts per (axis, kind) over ``(doc, checks)`` pairs, counting only ``counted`` checks, each on
    ``paths.axis`` (a zero-copy row against a staged one is on the transport axis; bookkeeping on "ideal"): rows
    of {"axis", "kind", "met", "missed", "inconclusive", "total", "single"} ("single": how many rest on one
    measurement; "moved": the stored axis of each check counted on another, by its paths)."""
    out: dict[tuple[str, str], dict] = {}
    for doc, checks in sources:
        for c in counted(checks, doc.get("env")):
            axis = "ideal" if kind(c) == "bytes bookkeeping" else paths.axis(c, doc)
            row = out.setdefault((axis, kind(c)), {"axis": axis, "kind": kind(c), **dict.fromkeys(VERDICTS, 0),
                                                   "total": 0, "single": 0, "moved": []})
            row[c["verdict"]] += 1
            row["total"] += 1
            row["single"] += single_measurement(c)
            if axis == "transport" and c.get("axis") not in (None, axis):
                row["moved"].append(c["axis"])
    return sorted(out.values(), key=lambda r: (r["axis"], KINDS.index(r["kind"])))


def tally_text(row: dict) -> str:
    """"engine, time: 14 met, 1 missed, 11 inconclusive of 26" and how many rest on a single measurement."""
    single = {0: "", row["total"]: ", each on a single measurement"}.get(
        row["single"], f", {row['single']} of them on a single measurement")
    moved = row.get("moved") or []
    moved_text = (f" ({len(moved)} of them stored as {' and '.join(sorted(set(moved)))} checks, counted here: each "
                  "compares a zero-copy row with a staged one)") if moved else ""
    return f"{row['axis']}, {row['kind']}: {counts_text([{'verdict': v} for v in VERDICTS for _ in range(row[v])])} " \
           f"of {row['total']}{single}{moved_text}"


def repeated_allreduce(collectives: dict, allreduce: dict) -> list[tuple[dict, dict]]:
    """(collectives_benchmark.py's check, allreduce.py's check) for each auto / torch comparison both files
    stored: the same process count, message bytes (allreduce.py's elements times their size) and limit."""
    size = ITEM_BYTES.get((allreduce.get("config") or {}).get("dtype", "float32"), 4)
    theirs = {(c["world_size"], c["numel"] * size, c["limit"]): c for c in allreduce.get("targets") or []
              if c.get("target") == "auto / torch"}
    pairs = [(c, theirs.get((c.get("world_size"), c.get("bytes"), c.get("limit"))))
             for c in collectives.get("targets") or []
             if c.get("label") == "auto" and c.get("axis") == "algorithm"]
    return [(c, o) for c, o in pairs if o is not None]


# --------------------------------------------------------------------------- series


def position(ratio: dict | None, limit: float) -> str:
    """Where a ratio's interval lies against ``limit``: "below" (all of it at or under), "above" (all of it over)
    or "inconclusive" (it holds ``limit``, or there is no interval: a single measurement or none)."""
    if not ratio or ratio.get("ci_low") is None or ratio.get("ci_high") is None or (ratio.get("rounds") or 2) < 2:
        return "inconclusive"
    if ratio["ci_high"] <= limit:
        return "below"
    return "above" if ratio["ci_low"] > limit else "inconclusive"


def against_pytorch(ratio: dict | None, what: str) -> str:
    """``what`` (e.g. "ring / torch") as its stored paired ratio with the interval and what the interval says:
    "ring / torch <median>x [<low>, <high>], slower than PyTorch's"; "no paired ratio stored" without one."""
    if not ratio or ratio.get("median") is None:
        return f"{what}: no paired ratio stored"
    side = position(ratio, 1.0)
    said = {"below": "faster than PyTorch's", "above": "slower than PyTorch's",
            "inconclusive": "no difference from PyTorch's resolved (the interval holds 1)"}[side]
    return f"{what} {format_ratio({'rounds': 2, **ratio})}, {said}"


def trend(points: Iterable[tuple[float, float, float]]) -> str:
    """Which way ``(x, low, high)`` intervals go along x, from pairs whose intervals do not overlap: "rises" when
    some later point lies wholly above an earlier one and none wholly below, and the last above the first;
    "falls" the mirror; "varies" when both happen; "unresolved" otherwise (no two intervals apart, the ends'
    intervals overlapping, or fewer than two points). A series whose intervals overlap is not called flat:
    overlap shows no difference, not none."""
    spans = [(low, high) for _, low, high in sorted(points)]
    up = any(spans[j][0] > spans[i][1] for i in range(len(spans)) for j in range(i + 1, len(spans)))
    down = any(spans[j][1] < spans[i][0] for i in range(len(spans)) for j in range(i + 1, len(spans)))
    if up and down:
        return "varies"
    if up and spans[-1][0] > spans[0][1]:
        return "rises"
    if down and spans[-1][1] < spans[0][0]:
        return "falls"
    return "unresolved"  # one resolved step, but the ends' intervals overlap: no trend from end to end


TREND_WORDS = {"rises": "rises", "falls": "falls", "varies": "goes up and down beyond its intervals",
               "unresolved": "shows no trend from end to end that its intervals resolve"}


def series_text(points: Iterable[tuple], x_format: str = ",d", y_format: str = ".2f") -> str:
    """Every point of a series, by x: "<y> at <x>, <y> at <x> and <y> at <x>"; a point ``(x, y, low, high)``
    is written with its interval, "<y> [<low>, <high>] at <x>"."""
    def one(x, y, *interval):
        bracket = f" [{interval[0]:{y_format}}, {interval[1]:{y_format}}]" if interval else ""
        return f"{y:{y_format}}{bracket} at {x:{x_format}}"

    parts = [one(*p) for p in sorted(points)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + f" and {parts[-1]}"


def growth(rows: Iterable[dict], start: int, end: int) -> tuple[float, float, float] | None:
    """How much the p50 of one series' rows (one row per world size, each a run of its own) grows from ``start``
    to ``end`` processes (0.3: by 30 %), with the range the rounds allow: (median, low, high) from the rows' p50s
    and their per-round p50s (``unpaired_range``); None when either world size is missing."""
    at = {r["world_size"]: r for r in rows}
    if start not in at or end not in at:
        return None
    low, high = unpaired_range(at[end]["round_p50_s"], at[start]["round_p50_s"])
    return at[end]["p50_s"] / at[start]["p50_s"] - 1, low - 1, high - 1


def unpaired_range(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """The range of a ratio of two runs that share no rounds (two world sizes): its least and greatest value over
    the rounds of each, min(numerator) / max(denominator) to max(numerator) / min(denominator)."""
    return min(numerator) / max(denominator), max(numerator) / min(denominator)


# --------------------------------------------------------------------------- all-reduce


def lowest_p50(rows: list[dict]) -> tuple[dict, list[dict]]:
    """The row of the lowest p50 among ``rows`` (timed in the same rounds), and the others it is not separated
    from: those whose paired ratio with it (its p50 / theirs, round by round) has a 95 % interval reaching 1, or
    that hold too few rounds to bootstrap one. Only with none left is the first row the fastest."""
    winner = min(rows, key=lambda r: r["p50_s"])
    tied = []
    for row in rows:
        if row is winner:
            continue
        a, b = winner.get("round_p50_s") or [], row.get("round_p50_s") or []
        if len(a) != len(b) or len(a) < MIN_BOOTSTRAP_ROUNDS or paired_ratio(a, b)["ci_high"] >= 1:
            tied.append(row)
    return winner, tied


def auto_choices(rows: Iterable[dict], world: int) -> list[dict]:
    """Per size, at ``world`` processes on the algorithm axis of collectives_benchmark.py's rows: the algorithm
    auto ran (its row's ``choice``) and the message-passing algorithm of the lowest p50 (torch's collective and
    auto itself left out); ``hit`` when they are the same, ``tied`` the algorithms not separated from the lowest
    (``lowest_p50``). Sizes without an auto row are left out."""
    mine = [r for r in rows if r.get("world_size") == world and r.get("axis", "algorithm") == "algorithm"]
    out = []
    for size in sorted({r["bytes"] for r in mine}):
        auto = next((r for r in mine if r["bytes"] == size and r["label"] == "auto" and r.get("choice")), None)
        others = [r for r in mine if r["bytes"] == size and r["label"] not in ("torch", "auto")]
        if auto and others:
            winner, tied = lowest_p50(others)
            out.append({"bytes": size, "choice": auto["choice"], "lowest": winner["label"],
                        "tied": [r["label"] for r in tied], "hit": auto["choice"] == winner["label"]})
    return out


# --------------------------------------------------------------------------- SyncBatchNorm


def _syncbn_times(doc: dict, impl: str, transport: str | None) -> dict[tuple[int, int], float]:
    """(batch, hidden) -> seconds of ``impl``'s float32 rows of the workers on ``transport``."""
    return {(r["batch"], r["hidden"]): r["time_s"] for r in doc["results"]
            if r.get("kind", "time") == "time" and r.get("setting", "workers") == "workers"
            and r.get("dtype", "float32") == "float32" and r.get("impl") == impl and r.get("transport") == transport}


def syncbn_extra(doc: dict, transport: str, impl: str = "ours", reference: str = SYNCBN_REFERENCE) -> dict | None:
    """What ``impl`` adds to ``reference`` on one transport, over the sizes both were timed at: the median of
    the per-size differences (``extra_s``) and the reference's median time (``reference_s``), in seconds."""
    ours, ref = _syncbn_times(doc, impl, transport), _syncbn_times(doc, reference, transport)
    sizes = sorted(set(ours) & set(ref))
    if not sizes:
        return None
    return {"extra_s": statistics.median(ours[k] - ref[k] for k in sizes),
            "reference_s": statistics.median(ref[k] for k in sizes), "sizes": len(sizes)}


def compute_gap(doc: dict, batch: int, hidden: int, transport: str, impl: str = "ours",
                reference: str = SYNCBN_REFERENCE) -> float | None:
    """Seconds per iteration ``impl`` computes beyond ``reference`` outside its collectives at one size and
    transport: the sum of the "compute ..." phases of syncbn_benchmark.py's phases rows, one minus the other."""
    def computing(name):
        row = next((r for r in doc["results"] if r.get("kind") == "phases" and r["impl"] == name
                    and (r["batch"], r["hidden"], r.get("transport")) == (batch, hidden, transport)), None)
        return None if row is None else sum(s for p, s in row["phases_s"].items() if p.startswith("compute"))

    mine, theirs = computing(impl), computing(reference)
    return None if mine is None or theirs is None else mine - theirs


# The settings that make two ddp_cifar100.py runs the same experiment (config keys, as the run resolved them): the
# engine and transport may differ, as they are what the comparison is of.
TRAINING_SETTINGS = ("model_used", "dataset_used", "train_size_used", "val_size_used", "world_size_used",
                     "global_batch", "grad_accum_steps_used", "seed_used", "lr_used", "momentum_used", "num_epochs",
                     "autocast_used")


def final_row(doc: dict) -> dict:
    """A ddp_cifar100.py run's final row: its last epoch's losses and accuracy, its times and memory."""
    return next(r for r in doc["results"] if r["kind"] == "final")


def steps_timed(*docs: dict) -> bool:
    """Whether every run timed an optimizer step (a run of too few steps times none)."""
    return all(final_row(doc)["step_time_median_s"] for doc in docs)


def training_differences(ours: dict, theirs: dict) -> list[str]:
    """The settings two training runs do not share ("num_epochs 1 / 3"): where there is one, their curves, losses
    and times are not the same experiment's and are not compared."""
    a, b = ours["config"], theirs["config"]
    return [f"{key.removesuffix('_used')} {a.get(key)} / {b.get(key)}" for key in TRAINING_SETTINGS
            if a.get(key) != b.get(key)]

