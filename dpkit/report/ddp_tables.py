"""PyTorch's DDP benchmark formats (seed 004), from our results files: the block of sec/iter and ex/sec at four
percentiles per row, and the diff of two runs row by row.

    from dpkit.report.ddp_tables import format_diff, percentile_table
    print("\n".join(percentile_table(read_results("results/ddp_benchmark.json")["results"])))
    print(format_diff(read_results("base.json"), read_results("test.json")))   # ValueError: nothing in common

``ddp_benchmark.py`` prints them (``ddp_benchmark.py diff A.json B.json``) and the report shows them.
"""

from __future__ import annotations

from dpkit.bench.measure import percentile
from dpkit.bench.results import check_comparable, config_differences, incomplete_note
PERCENTILES = (50, 75, 90, 95)  # the benchmark table (seed 004)
DIFF_PERCENTILES = (75, 95)  # the diff table (seed 004)


def block_key(row: dict) -> tuple:
    return row["model"], row["batch_size"], row["input"]


def row_prefix(row: dict) -> str:
    mark = "*" if row.get("oversubscribed") else " "
    return f"{row['world_size']:4d}{mark}ranks -- {row['label']:>39s}:"  # 39: "ddp ours overlap [shared_memory:thread]"


def percentile_table(rows: list[dict]) -> list[str]:
    """Seed 004's block: sec/iter and ex/sec at every percentile, one fixed-width line per row."""
    header = " " * len(row_prefix(rows[0])) + "".join(f"{'sec/iter':>16s}{'ex/sec':>10s}" for _ in PERCENTILES)
    lines = [header]
    for row in rows:
        cells = "".join(f"  p{p:02d}: {row[f'p{p}_s']:8.4f}s {row[f'p{p}_ex_per_s']:7.0f}/s" for p in PERCENTILES)
        lines.append(row_prefix(row) + cells)
    return lines
DIFF_ENV_KEYS = ("torch", "cuda", "torchvision", "backend", "device_model", "threads", "world_size", "git_commit")
DIFF_CONFIG_KEYS = ("bucket_sizes", "batch_size", "image_size", "iters", "rounds", "warmup")
DIFF_IGNORED = {"json", "profile", "command", "time", "host"}  # always differ; say nothing about the measurement


def row_key(row: dict) -> tuple:
    return (*block_key(row), row["world_size"], row["label"])


def diff_rows(base: dict, test: dict) -> tuple[list[dict], list[str]]:
    """Rows of two result files matched by (model, batch, input, world size, variant).

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
        entry = {"model": key[0], "batch_size": key[1], "input": key[2], "world_size": key[3], "label": key[4]}
        for p in DIFF_PERCENTILES:
            vb, vt = percentile(b["samples_s"], p), percentile(t["samples_s"], p)
            entry.update({f"p{p}_base_s": vb, f"p{p}_test_s": vt, f"p{p}_test_ex_per_s": t["global_batch"] / vt,
                          f"p{p}_diff_pct": -100 * (vt - vb) / vb})
        diffs.append(entry)
    unmatched = [f"only in baseline: {_describe(k)}" for k in base_rows if k not in test_rows]
    unmatched += [f"only in test: {_describe(k)}" for k in test_rows if k not in base_rows]
    return diffs, unmatched


def _describe(key: tuple) -> str:
    model, batch, shape, world, label = key
    return f"{model} (batch {batch}, {shape}), {world} ranks, {label}"


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
