"""The DDP benchmark's tables, from our results files: PyTorch's DDP benchmark formats (seed 004), the block of
sec/iter and ex/sec at four percentiles per row and the diff of two runs row by row; and ours, each row's
communication, overhead, ratios and memory, and where its time goes.

    from dpkit.report.ddp_tables import comm_table, format_diff, percentile_table
    print("\n".join(percentile_table(read_results("results/ddp_benchmark.json")["results"])))
    print(format_diff(read_results("base.json"), read_results("test.json")))   # ValueError: nothing in common

``ddp_benchmark.py`` prints them (``ddp_benchmark.py diff A.json B.json``) and the report shows them.
"""

from __future__ import annotations

from dpkit.bench.ddp_run import PERCENTILES, block_key
from dpkit.bench.row_identity import identity, label, what
from dpkit.bench.measure import PHASES, format_ratio, percentile
from dpkit.bench.results import check_comparable, config_differences, incomplete_note

DIFF_PERCENTILES = (75, 95)  # the diff table (seed 004)
MIB = 2**20


def row_prefix(row: dict, path: bool = False, width: int = 39) -> str:
    """"   2 ranks -- <label>:", the label right-aligned in ``width`` (39: "ddp ours overlap [shared_memory:thread]");
    ``path``: the label names the path the row recorded."""
    mark = "*" if row.get("oversubscribed") else " "
    return f"{row['world_size']:4d}{mark}ranks -- {label(row, path):>{width}s}:"


def percentile_table(rows: list[dict], path: bool = False) -> list[str]:
    """Seed 004's block: sec/iter and ex/sec at every percentile, one fixed-width line per row (``path``: each
    label names the path its row recorded)."""
    width = max(39, *(len(label(r, path)) for r in rows))
    header = " " * len(row_prefix(rows[0], path, width)) + "".join(f"{'sec/iter':>16s}{'ex/sec':>10s}"
                                                                   for _ in PERCENTILES)
    lines = [header]
    for row in rows:
        cells = "".join(f"  p{p:02d}: {row[f'p{p}_s']:8.4f}s {row[f'p{p}_ex_per_s']:7.0f}/s" for p in PERCENTILES)
        lines.append(row_prefix(row, path, width) + cells)
    return lines


def _seconds(value: float | None, width: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width - 1}.4f}s"


def _percent(value: float | None, width: int, sign: str = "") -> str:
    return f"{'-':>{width}s}" if value is None else f"{100 * value:{sign}{width - 1}.1f}%"


def _mib(value: int | None, width: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value / MIB:{width - 4}.1f} MiB"


def _ratio(value: dict | None, width: int) -> str:
    return f"{'-' if value is None else format_ratio(value):>{width}s}"


COMM_COLUMNS = ("p50 sec/iter", "comm wait", "of iter", "DDP overhead", "vs ddp pytorch 25M [95% CI]",
                "vs pytorch best 25M", "all-reduces", "peak memory")  # vs columns: PyTorch on the row's transport


def comm_table(rows: list[dict]) -> list[str]:
    """Communication, overhead, ratios against PyTorch and memory of each row."""
    widths = (13, 11, 9, 19, 29, 22, 12, 13)
    lines = [" " * len(row_prefix(rows[0])) + "".join(f"{h:>{w}s}" for h, w in zip(COMM_COLUMNS, widths))]
    for row in rows:
        alone = row["engine"] is None  # no DDP: no overhead, no all-reduce
        overhead = "-" if row.get("overhead_s") is None or alone else (
            f"{row['overhead_s']:+.4f}s {100 * row['overhead_frac']:+5.1f}%")
        reduces = "-" if row["all_reduces"] is None or alone else str(row["all_reduces"])
        cells = (_seconds(row["p50_s"], widths[0]), _seconds(row["comm_wait_s"], widths[1]),
                 _percent(row["comm_share"], widths[2]), f"{overhead:>{widths[3]}s}",
                 _ratio(row.get("vs_pytorch"), widths[4]), _ratio(row.get("vs_pytorch_best"), widths[5]),
                 f"{reduces:>{widths[6]}s}", _mib(row["peak_bytes"], widths[7]))
        lines.append(row_prefix(row) + "".join(cells))
    return lines


def breakdown_table(rows: list[dict]) -> list[str]:
    """Where one iteration's time goes (rank 0, under the profiler) for the rows that carry a breakdown."""
    rows = [r for r in rows if r.get("breakdown")]
    if not rows:
        return []
    lines = ["", "Where the time goes (rank 0, profiled, CPU seconds per iteration; top operators by self time):"]
    for row in rows:
        spans = row["breakdown"]["ranges"]
        lines.append(row_prefix(row) + "".join(f"  {name} {spans.get(name, 0.0):.4f}s" for name in PHASES))
        lines.append(" " * 8 + ", ".join(f"{op['op']} {op['self_s']:.4f}s" for op in row["breakdown"]["ops"][:5]))
    return lines


DIFF_ENV_KEYS = ("torch", "cuda", "torchvision", "backend", "device_model", "threads", "world_size", "git_commit")
DIFF_CONFIG_KEYS = ("bucket_sizes", "batch_size", "image_size", "iters", "rounds", "warmup")
DIFF_IGNORED = {"json", "profile", "command", "time", "host"}  # always differ; say nothing about the measurement


def row_key(row: dict) -> tuple:
    """Where a row ran and what it is, by its fields (not its path: the same row may record another one)."""
    return (*block_key(row), row["world_size"], *what(row))


def diff_rows(base: dict, test: dict) -> tuple[list[dict], list[str]]:
    """Rows of two result files matched by (model, batch, input, world size, the row's identity).

    For each p in DIFF_PERCENTILES: test's sec/iter and ex/sec, and the % difference in time,
    negated as in PyTorch's diff.py (lower time is better): +10% = test 10% faster. Percentiles
    are recomputed from the per-iteration samples. Also returns the unmatched rows, described.
    """
    base_rows = {row_key(r): r for r in base["results"]}
    test_rows = {row_key(r): r for r in test["results"]}
    diffs = []
    for key, b in base_rows.items():
        t = test_rows.get(key)
        if t is None:
            continue
        entry = {"model": b["model"], "batch_size": b["batch_size"], "input": b["input"],
                 "world_size": b["world_size"], **identity(t), "label": t["label"]}
        for p in DIFF_PERCENTILES:
            vb, vt = percentile(b["samples_s"], p), percentile(t["samples_s"], p)
            entry.update({f"p{p}_base_s": vb, f"p{p}_test_s": vt, f"p{p}_test_ex_per_s": t["global_batch"] / vt,
                          f"p{p}_diff_pct": -100 * (vt - vb) / vb})
        diffs.append(entry)
    unmatched = [f"only in baseline: {_describe(r)}" for k, r in base_rows.items() if k not in test_rows]
    unmatched += [f"only in test: {_describe(r)}" for k, r in test_rows.items() if k not in base_rows]
    return diffs, unmatched


def _describe(row: dict) -> str:
    return f"{row['model']} (batch {row['batch_size']}, {row['input']}), {row['world_size']} ranks, {label(row)}"


def _header_lines(base: dict, test: dict) -> list[str]:
    """Seed 004's header: chosen env and config values side by side, plus any other config key that differs."""
    pairs = [(k, base["env"].get(k, "-"), test["env"].get(k, "-")) for k in DIFF_ENV_KEYS]
    others = (set(base["config"]) | set(test["config"])) - set(DIFF_CONFIG_KEYS) - DIFF_IGNORED
    keys = list(DIFF_CONFIG_KEYS) + sorted(others)
    for k in keys:
        vb, vt = base["config"].get(k, "-"), test["config"].get(k, "-")
        if k in DIFF_CONFIG_KEYS or vb != vt:
            pairs.append((k, vb, vt))
    lines = [f"{'':20s} {'baseline':>24s}      {'test':>24s}", f"{'':20s} {'-' * 24:>24s}      {'-' * 24:>24s}"]
    for k, vb, vt in pairs:
        mark = "" if vb == vt else "   <- differs"
        lines.append(f"{k + ':':20s} {_text(vb):>24s}  vs  {_text(vt):>24s}{mark}")
    return lines


def _text(value) -> str:
    if not isinstance(value, list):
        return str(value)
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)


def format_diff(base: dict, test: dict) -> str:
    """Seed 004's diff table; ValueError, saying what differs, when the two runs share no row."""
    check_comparable(base, test)
    diffs, unmatched = diff_rows(base, test)
    if not diffs:
        differences = config_differences(base, test, DIFF_IGNORED) or ["(no setting differs: the rows do)"]
        raise ValueError("the two runs measured nothing in common (no row has the same model, batch, input, world "
                         "size and variant in both); their settings differ in:\n  " + "\n  ".join(differences))
    lines = _header_lines(base, test)
    lines += [f"{which}: {incomplete_note(doc)}" for which, doc in (("baseline", base), ("test", test))
              if incomplete_note(doc)]
    blocks: dict[tuple, list[dict]] = {}
    for d in diffs:
        blocks.setdefault((d["model"], d["batch_size"], d["input"]), []).append(d)
    for (model, batch, shape), block in blocks.items():
        lines += ["", f"Benchmark: {model} with batch size {batch} per rank, {shape} inputs", ""]
        pad = len(row_prefix(block[0]))
        lines.append(" " * pad + "".join(f"{'sec/iter':>16s}{'ex/sec':>10s}{'diff':>10s}" for _ in DIFF_PERCENTILES))
        for d in block:
            cells = "".join(f"  p{p:02d}: {d[f'p{p}_test_s']:8.4f}s {d[f'p{p}_test_ex_per_s']:7.0f}/s "
                            f"{d[f'p{p}_diff_pct']:+8.1f}%" for p in DIFF_PERCENTILES)
            lines.append(row_prefix(d) + cells)
    lines += ["", "diff: % change in time, sign flipped (positive = test faster); sec/iter and ex/sec are the test's"]
    return "\n".join(lines + [""] + unmatched if unmatched else lines)
