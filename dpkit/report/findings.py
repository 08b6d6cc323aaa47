"""The facts behind the report's sentences and README's headline block, computed from result rows, so that
no comparison in either is typed by hand.

    from dpkit.report import findings
    findings.countable(doc["targets"], doc["env"])     # the target checks a count or a headline may rest on

Each function reads rows in the layout of ``dpkit.bench.results`` and returns numbers, rows or a short
fragment; the caller composes the sentence and names hardware, transport and denominator. A run with more
processes than CPU cores (``oversubscribed``) never enters a count, and an interval over fewer than
``MIN_BOOTSTRAP_ROUNDS`` rounds is called the range of those rounds, not a 95 % interval. Nothing here
imports matplotlib: README's block is rendered from these functions too.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

VERDICTS = ("met", "missed", "inconclusive")
# A percentile bootstrap over fewer rounds than this gives back little more than the spread of the few values.
MIN_BOOTSTRAP_ROUNDS = 5
# The fields that make two stored target checks the same comparison (ddp_benchmark.py's checks).
CHECK_KEY = ("model", "world_size", "axis", "label", "reference", "target")
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
    theirs = {tuple(o.get(k) for k in key): o for o in others}
    pairs = [(c, theirs.get(tuple(c.get(k) for k in key))) for c in checks]
    return [(c, o) for c, o in pairs if o is not None]


def differing_verdicts(checks: Iterable[dict], others: Iterable[dict], key: Sequence[str] = CHECK_KEY) -> list[tuple]:
    """The pairs of ``paired_checks`` whose two verdicts differ (two runs of one benchmark that disagree)."""
    return [(c, o) for c, o in paired_checks(checks, others, key) if o.get("verdict") != c.get("verdict")]


# --------------------------------------------------------------------------- series


def trend(points: Iterable[tuple[float, float]]) -> str:
    """Which way ``(x, y)`` points go along x: "rises" when the y at the largest x is the largest and above the
    first, "falls" when it is the smallest and below the first, else "varies" (fewer than two points: "varies")."""
    ys = [y for _, y in sorted(points)]
    if len(ys) < 2:
        return "varies"
    if ys[-1] > ys[0] and ys[-1] == max(ys):
        return "rises"
    if ys[-1] < ys[0] and ys[-1] == min(ys):
        return "falls"
    return "varies"


def series_text(points: Iterable[tuple[float, float]], x_format: str = ",d", y_format: str = ".2f") -> str:
    """Every point of a series, by x: "<y> at <x>, <y> at <x> and <y> at <x>"."""
    parts = [f"{y:{y_format}} at {x:{x_format}}" for x, y in sorted(points)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + f" and {parts[-1]}"


def growth(rows: Iterable[dict], label: str, start: int, end: int, key: str = "p50_s") -> float | None:
    """How much ``key`` of the rows labelled ``label`` grows from ``start`` to ``end`` processes (0.3: by 30 %);
    None when either world size is missing."""
    at = {r["world_size"]: r[key] for r in rows if r.get("label") == label}
    return at[end] / at[start] - 1 if start in at and end in at else None


# --------------------------------------------------------------------------- all-reduce


def auto_choices(rows: Iterable[dict], world: int) -> list[dict]:
    """Per size, at ``world`` processes on the algorithm axis of collectives_benchmark.py's rows: the algorithm
    auto ran (its row's ``choice``) and the fastest message-passing algorithm by p50 (torch's collective and auto
    itself left out); ``hit`` when they are the same. Sizes without an auto row are left out."""
    mine = [r for r in rows if r.get("world_size") == world and r.get("axis", "algorithm") == "algorithm"]
    out = []
    for size in sorted({r["bytes"] for r in mine}):
        auto = next((r for r in mine if r["bytes"] == size and r["label"] == "auto" and r.get("choice")), None)
        others = [r for r in mine if r["bytes"] == size and r["label"] not in ("torch", "auto")]
        if auto and others:
            fastest = min(others, key=lambda r: r["p50_s"])["label"]
            out.append({"bytes": size, "choice": auto["choice"], "fastest": fastest, "hit": auto["choice"] == fastest})
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
