"""The targets of ``sharding_benchmark.py``: each divides the times of two variants that differ on one axis only
(``AXES``), judged against its limit where its scope holds (``SCOPES``), plus each variant's held bytes against
the ideal; stored as rows beside the measured ones.

    rows += target_rows(rows, args, {name: VARIANTS[name].targets for name in names})
"""

from __future__ import annotations

from dataclasses import dataclass

from dpkit.bench.measure import paired_ratio, verdict
from dpkit.bench.row_identity import identity

TARGET_VS_PYTORCH = 1.00  # ours / PyTorch's sec/iter: the same engine on the same transport
TARGET_ZERO_VS_DDP = 1.05  # ZeRO / DDP sec/iter: the same implementation on the same transport
TARGET_SHM_VS_TORCH = 0.85  # fully_shard on our shared memory / fully_shard on gloo, the GPT at its default size
TARGET_STATE_VS_IDEAL = 1.10  # per-rank held bytes (model states, engine buffers, transport memory) / ideal

# What a target's two variants differ in (one thing only); every target row names its axis.
AXES = {"impl": "ours / PyTorch's: the same engine on the same transport",
        "engine": "ZeRO (stage 1 or 2) / DDP: the same implementation on the same transport",
        "transport": "one engine: shared memory or a \"dpkit\" process group / torch.distributed (gloo), or on a "
                     "communication thread / inline",
        "option": "one engine on one transport: an option / its default",
        "memory": "bytes a rank holds (model states, the engine's buffers, its transport's memory) / the ideal"}
# The GPT's default size: the benchmark's defaults, and where the transport target's limit holds.
GPT_DEFAULT = dict(gpt_vocab=8192, gpt_seq_len=64, gpt_width=256, gpt_depth=4, gpt_heads=4)


def at_gpt_default(model: str, args) -> bool:
    return model == "gpt" and all(getattr(args, k) == v for k, v in GPT_DEFAULT.items())


# Where a target's limit holds (elsewhere its ratio is shown for information): a reader's phrase and a test.
SCOPES = {"gpt default": ("the GPT at its default size", at_gpt_default)}


@dataclass(frozen=True)
class Target:
    """This variant's sec/iter over ``other``'s, which differs from it on ``axis`` only."""

    other: str  # the other variant's label
    axis: str  # a key of AXES
    limit: float | None = None  # at most this; None: for information
    scope: str | None = None  # a key of SCOPES: where the limit holds


def _everywhere(model: str, args) -> bool:
    return True


def _timed(row: dict, other: dict, target: Target, args) -> dict:
    """``row``'s time over ``other``'s, paired by round; its limit only where its scope holds."""
    ratio = paired_ratio(row["round_p50_s"], other["round_p50_s"])
    phrase, applies = SCOPES[target.scope] if target.scope else (None, _everywhere)
    limit = target.limit if applies(row["model"], args) else None
    return {"target": f"{row['variant']} / {target.other}", "axis": target.axis, "numerator": row["variant"],
            "denominator": target.other, "row": identity(row), "reference_row": identity(other), "limit": limit,
            "ratio": ratio, "verdict": "-" if limit is None else verdict(ratio, limit), "scope": phrase,
            "scoped_limit": target.limit if phrase else None}


def _held(row: dict) -> dict:
    """The bytes ``row``'s variant holds against the ideal: one count, no interval."""
    return {"target": f"{row['variant']} state / ideal", "axis": "memory", "numerator": row["variant"],
            "row": identity(row), "limit": TARGET_STATE_VS_IDEAL, "ratio": None,
            "verdict": "met" if row["state_vs_ideal"] <= TARGET_STATE_VS_IDEAL else "missed",
            "value": row["state_vs_ideal"]}


def target_rows(rows: list[dict], args, targets: dict[str, tuple[Target, ...]]) -> list[dict]:
    """Every target of every measured variant (``targets``, by label) whose other variant was measured too, as
    rows (no "variant" key: that marks the measured rows): the paired ratio, its axis and verdict; a limit
    outside its scope is shown for information (verdict "-")."""
    by_label = {row["variant"]: row for row in rows}
    out = []
    for row in rows:
        where = {"model": row["model"], "world_size": row["world_size"]}
        out += [{**where, **_timed(row, by_label[t.other], t, args)}
                for t in targets[row["variant"]] if t.other in by_label]
        out.append({**where, **_held(row)})
    return out
