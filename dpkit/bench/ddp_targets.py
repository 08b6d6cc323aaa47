"""Comparisons within one ``ddp_benchmark.py`` run: every row's overhead and ratios to no DDP and to PyTorch's
DDP (``relate``), and the targets, each a paired ratio against its limit with a verdict (``target_checks``),
stored beside the rows.

    relate(rows)                  # adds overhead_s, vs_no_ddp, vs_pytorch, vs_pytorch_best to every row
    checks = target_checks(rows)  # [{"row": {"engine": ...}, "reference_row": {...}, "ratio": ..., "verdict": ...}]

Rows are found by their fields (``rows.IDENTITY``); each check stores the identity of both sides (the path each
recorded included) beside their labels, which are for reading only.
"""

from __future__ import annotations

from dpkit.bench.ddp_run import block_key
from dpkit.bench.ddp_step import NAIVE, OURS, PYTORCH, PYTORCH_BEST_KIND, PYTORCH_DEFAULT_BUCKET_MB, PYTORCH_KINDS
from dpkit.bench.ddp_variants import ASYNCHRONOUS, ON_DPKIT, SHARED, THREAD, Variant, registered_kinds, variant
from dpkit.bench.measure import paired_ratio, verdict
from dpkit.bench.row_identity import identity, what

TARGET_VS_PYTORCH = 1.00  # impl: ddp ours 25M p50 / the faster PyTorch 25M p50 on the same transport
TARGET_MEMORY = 1.00  # ddp ours 25M peak memory / the same PyTorch row's
TARGET_HIDDEN = 0.50  # exposed wait / naive's all-reduce time, for ddp ours (overlap too) on asynchronous transports
TARGET_HOOK = 0.95  # transport: PyTorch's DDP summing through our shared memory (its comm hook) / through gloo
TARGET_VS_NO_DDP = 1.15  # ddp ours 25M on the default transport / no DDP at all
TARGET_BACKEND = 0.93  # transport: PyTorch's DDP (best settings), unchanged, on a "dpkit" process group / on gloo


def _peers(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by (block, world size): the rows of one run that may be compared."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((block_key(row), row["world_size"]), []).append(row)
    return groups


def find(peers: list[dict], wanted: Variant) -> dict | None:
    """The row of ``peers`` whose fields are ``wanted``'s."""
    return next((r for r in peers if what(r) == what(wanted.fields())), None)


def faster_pytorch(peers: list[dict], transport: str) -> dict | None:
    """The PyTorch 25M row on ``transport`` with the lower p50, at its defaults or its best settings: the
    reference of our engine on that transport."""
    candidates = [find(peers, variant(kind, PYTORCH_DEFAULT_BUCKET_MB, transport)) for kind in PYTORCH_KINDS]
    return min((c for c in candidates if c), key=lambda r: r["p50_s"], default=None)


def relate(rows: list[dict]) -> None:
    """Add to every row its DDP overhead (p50 minus the no-ddp p50 of the same block and world size), its
    time against no DDP, and against PyTorch's DDP at 25M on the same transport (engine against engine),
    at its defaults and at its best settings: the median of the per-round p50 ratios with a 95 % bootstrap
    interval over rounds (``measure.paired_ratio``)."""
    for peers in _peers(rows).values():
        base = find(peers, Variant())
        for row in peers:
            row["overhead_s"] = row["p50_s"] - base["p50_s"] if base else None
            row["overhead_frac"] = row["overhead_s"] / base["p50_s"] if base else None
            row["vs_no_ddp"] = paired_ratio(row["round_p50_s"], base["round_p50_s"]) if base else None
            for kind, key in ((PYTORCH, "vs_pytorch"), (PYTORCH_BEST_KIND, "vs_pytorch_best")):
                reference = find(peers, variant(kind, PYTORCH_DEFAULT_BUCKET_MB, row.get("transport")))
                row[key] = paired_ratio(row["round_p50_s"], reference["round_p50_s"]) if reference else None


def _check(block: tuple, world: int, target: str, row: dict, reference: dict, ratio: dict, limit: float | None,
           oversub: bool, note: str = "", axis: str = "impl") -> dict:
    """One comparison of a run: ``row`` / ``reference``, each stored by its identity (and labelled for reading);
    against ``limit`` when there is one (else the verdict is "information": a measurement the report states, with
    no target)."""
    model, batch, shape = block
    return {"model": model, "batch_size": batch, "input": shape, "world_size": world, "target": target,
            "axis": axis, "label": row["label"], "reference": reference["label"], "row": identity(row),
            "reference_row": identity(reference), "ratio": ratio, "limit": limit,
            "verdict": "information" if limit is None else verdict(ratio, limit), "oversubscribed": oversub,
            "note": note}


def _exact(value: float) -> dict:
    """A ratio measured once (memory is deterministic up to gloo's timing): its interval is itself."""
    return {"median": value, "ci_low": value, "ci_high": value, "rounds": 1, "method": "single measurement"}


def target_checks(rows: list[dict]) -> list[dict]:
    """The targets, evaluated on every block with at least 2 ranks that has the rows they need.

    Axes, never mixed. Impl (one transport): ddp ours 25M against the faster of PyTorch's 25M rows on the same
    transport, time and memory (each registered engine's 25M row against the same, for information). Transport
    (one engine): PyTorch's DDP at its best settings through our shared memory (its comm hook) and on a "dpkit"
    process group against its own gloo. Overhead: our DDP on shared
    memory against no DDP at all. Overlap: on the asynchronous transports, the exposed wait of ours overlap and
    of ours at every bucket size against ours naive's all-reduce time on the same transport, paired by round.
    They are set for CPU, 2 ranks, resnet18; elsewhere they are reported for information.
    """
    checks = []
    for (block, world), peers in _peers(rows).items():
        if world < 2:
            continue
        oversub = any(r["oversubscribed"] for r in peers)
        checks += _impl_checks(block, world, peers, oversub)
        hooked, own, backed = (find(peers, variant(PYTORCH_BEST_KIND, PYTORCH_DEFAULT_BUCKET_MB, t))
                               for t in (SHARED, "torch", ON_DPKIT))
        for other, limit in ((hooked, TARGET_HOOK), (backed, TARGET_BACKEND)):
            if other and own:
                checks.append(_check(block, world, "p50 / the same engine on torch", other, own,
                                     paired_ratio(other["round_p50_s"], own["round_p50_s"]), limit, oversub,
                                     axis="transport"))
        ours, base = find(peers, variant(OURS, PYTORCH_DEFAULT_BUCKET_MB, SHARED)), find(peers, Variant())
        if ours and base:
            checks.append(_check(block, world, "p50 / no DDP", ours, base, ours["vs_no_ddp"]
                                 or paired_ratio(ours["round_p50_s"], base["round_p50_s"]), TARGET_VS_NO_DDP, oversub,
                                 axis="overhead"))  # what data parallelism costs on top of the model, not a transport
        checks += _overlap_checks(block, world, peers, oversub) + _thread_checks(block, world, peers, oversub)
    return checks


def _impl_checks(block: tuple, world: int, peers: list[dict], oversub: bool) -> list[dict]:
    """Per transport, ddp ours 25M against the faster PyTorch 25M row: time, and peak memory; each registered
    engine's 25M row against the same row, time, for information (the target is our DDP's)."""
    checks = []
    for name in dict.fromkeys(r["transport"] for r in peers if r.get("transport")):
        ours, theirs = find(peers, variant(OURS, PYTORCH_DEFAULT_BUCKET_MB, name)), faster_pytorch(peers, name)
        if theirs:
            checks += [_check(block, world, "p50 / faster pytorch p50, same transport", row, theirs,
                              paired_ratio(row["round_p50_s"], theirs["round_p50_s"]), None, oversub)
                       for row in (find(peers, variant(kind, PYTORCH_DEFAULT_BUCKET_MB, name))
                                   for kind in registered_kinds()) if row]
        if ours and theirs:
            checks.append(_check(block, world, "p50 / faster pytorch p50, same transport", ours, theirs,
                                 paired_ratio(ours["round_p50_s"], theirs["round_p50_s"]), TARGET_VS_PYTORCH, oversub))
            if ours["peak_bytes"] and theirs["peak_bytes"]:
                checks.append(_check(block, world, "peak memory / same pytorch row", ours, theirs,
                                     _exact(ours["peak_bytes"] / theirs["peak_bytes"]), TARGET_MEMORY, oversub))
    return checks


def _thread_checks(block: tuple, world: int, peers: list[dict], oversub: bool) -> list[dict]:
    """Information: each variant summing on a communication thread (so that its sums can overlap backward)
    against the same sums made in the thread that completes each bucket."""
    checks = []
    for row in (r for r in peers if r["transport"] == THREAD):
        inline = find(peers, Variant(row["engine"], row["impl"], row["option"], row["bucket_cap_mb"], SHARED))
        if inline:
            checks.append(_check(block, world, "p50 / the same sums in the backward hook", row, inline,
                                 paired_ratio(row["round_p50_s"], inline["round_p50_s"]), None, oversub,
                                 axis="overlap"))
    return checks


def _overlap_checks(block: tuple, world: int, peers: list[dict], oversub: bool) -> list[dict]:
    """Exposed wait against naive's all-reduce time on the same asynchronous transport. (On an inline one the
    sums run inside backward, on the critical path: a small wait there hides nothing; its overhead says more.)"""
    checks = []
    for name in ASYNCHRONOUS:
        # naive's sums on the same wire (it sums after backward: a thread would change nothing for it)
        naive = find(peers, variant(NAIVE, None, SHARED if name == THREAD else name))
        if not naive or not naive["comm_wait_s"]:
            continue
        for row in peers:
            if (row["engine"], row["impl"], row["option"]) in (("ddp", "ours", "overlap"), ("ddp", "ours", None)) \
                    and row["transport"] == name:
                ratio = paired_ratio(row["round_comm_wait_s"], naive["round_comm_wait_s"])
                note = ("one bucket holds every gradient: it is complete only when backward ends, so nothing can "
                        "overlap" if row["all_reduces"] == 1 and ratio["median"] > TARGET_HIDDEN else "")
                checks.append(_check(block, world, "exposed wait / naive's all-reduce time", row, naive, ratio,
                                     TARGET_HIDDEN, oversub, note, axis="overlap"))
    return checks
