"""Which path a shared-memory row took, so that no label says only [shm]: the transport's own buffers, summed
where they lie ("zero copy"), or tensors the caller allocated, copied into the arena and back ("staged").

    from dpkit.report import paths
    paths.label("pytorch-best 25M [shm]", doc)     # "pytorch-best 25M [shm, staged]"
    paths.axis(check, doc)                          # "transport" when the two rows took different paths

The benchmarks' labels name the transport ([shm], [shm-thread]); the path is read from the row where it says
(ddp_benchmark.py's ``transport_staging_bytes``: a staging block means the tensors were copied in), else from
who allocates the tensors a collective is handed, which the code fixes per engine:
- our DDP, ZeRO and FSDP allocate buckets, shards and gathered tensors through the transport: zero copy;
- PyTorch's DDP reaches a transport only through ``transport.ddp_comm_hook``, handed PyTorch's bucket: staged;
- ``fully_shard`` through ``transport.use_with_fully_shard`` has the transport allocate its buffers: zero copy;
- SyncBatchNorm (ours, and the reference's two sums) sums small tensors it makes itself: staged;
- collectives_benchmark.py's labels already say "zero copy" or "staged".
A comparison of a zero-copy row with a staged row compares transports, whatever engines it names.
"""

from __future__ import annotations

import re

ZERO_COPY, STAGED = "zero copy", "staged"
SHM = re.compile(r"\[(shm(?:-thread)?)\]")
# Engines (a label's words before its bracket begin so) that hand the transport tensors it did not allocate.
STAGED_ENGINES = ("pytorch", "ddp pytorch", "naive")
STAGED_BENCHMARKS = ("syncbn_benchmark",)  # every sum of a SyncBatchNorm row is of a tensor the layer made


def _row(label: str, doc: dict | None) -> dict | None:
    return next((r for r in (doc or {}).get("results", []) if r.get("label", r.get("variant")) == label), None)


def path(label: str, doc: dict | None = None) -> str | None:
    """"zero copy", "staged", or None for a label on no shared memory."""
    if ZERO_COPY in label or STAGED in label:
        return ZERO_COPY if ZERO_COPY in label else STAGED
    if not SHM.search(label):
        return None
    row = _row(label, doc)
    if row is not None and row.get("transport_staging_bytes") is not None:
        return STAGED if row["transport_staging_bytes"] > 0 else ZERO_COPY
    if (doc or {}).get("benchmark") in STAGED_BENCHMARKS:
        return STAGED
    engine = label.split(" [")[0]
    return STAGED if any(engine == e or engine.startswith(e + " ") or engine.startswith(e + "-")
                         for e in STAGED_ENGINES) else ZERO_COPY


def label(text: str, doc: dict | None = None) -> str:
    """``text`` (a label, or labels joined by " / ") with each [shm] or [shm-thread] naming its path."""
    parts = text.split(" / ")
    return " / ".join(SHM.sub(lambda m: f"[{m.group(1)}, {path(p, doc)}]", p) if path(p, doc) else p for p in parts)


def sides(check: dict) -> tuple[str, str]:
    """The two labels a stored check compares (ddp_benchmark.py: label / reference; sharding_benchmark.py:
    numerator / denominator; others: the label and torch's)."""
    return (check.get("label") or check.get("numerator") or "",
            check.get("reference") or check.get("denominator") or "")


def axis(check: dict, doc: dict | None = None) -> str:
    """The stored axis, or "transport" where the two sides took different shared-memory paths (one side zero
    copy, the other staged): such a ratio holds the copy, not only the engine."""
    ours, theirs = (path(s, doc) for s in sides(check))
    if ours and theirs and ours != theirs:
        return "transport"
    return check.get("axis") or "engine"
