"""Which path a shared-memory row took, so that no label says only [shared_memory]: the transport's own buffers,
summed where they lie ("zero copy"), or tensors the caller allocated, copied into the arena and back ("staged").

    from dpkit.report import paths
    paths.label("ddp pytorch best 25M [shared_memory]", doc)   # "ddp pytorch best 25M [shared_memory, staged]"
    paths.axis(check, doc)                                 # "transport" when the two rows took different paths

The benchmarks' labels name the transport as the registry does ([shared_memory], [shared_memory:thread]). Where a
row took, it says itself, never guessed from its label's words:
- ddp_benchmark.py's and sharding_benchmark.py's rows record their ``path`` (a staging block used in the measured
  iterations: the tensors were copied in; ``row_identity.recorded_path``), and each check the identity of both
  sides (``row``, ``reference_row``);
- a syncbn_benchmark.py file says where its layers summed (``config["sums"]``);
- collectives_benchmark.py's rows are "shared_memory" (its buffers: zero copy) or "shared_memory:staged".
A label no row of its file records has no path (None). A comparison of a zero-copy row with a staged row compares
transports, whatever engines it names.
"""

from __future__ import annotations

import re

from dpkit.bench.row_identity import STAGED, ZERO_COPY

SHM = re.compile(r"\[(shared_memory(?::thread)?)\]")
# A bracket with up to four words before it ("ddp pytorch best 25M [shared_memory]"): the label it closes, in a
# table cell or a sentence.
LABELLED = re.compile(r"((?:[\w.+:-]+ ){0,4})\[(shared_memory(?::thread)?)\]")
RECORDED_BENCHMARKS = ("ddp_benchmark", "sharding_benchmark")  # rows that carry their path
SUMMING_BENCHMARKS = ("syncbn_benchmark",)  # the file's config says where its layers summed (``sums``)
# How a SyncBatchNorm row on shared memory summed, in words (``path`` says which, from its file).
SYNCBN_SUMS = {STAGED: "each sum's small tensor copied in and out",
               ZERO_COPY: "each sum in the transport's own buffer, summed where it lies"}


def _row_path(words: list[str], bracket: str, doc: dict) -> str | None:
    """The path the row of ``doc`` recorded (its ``path`` field), for the longest label these words end."""
    rows = {r.get("label") or r.get("variant"): r for r in doc.get("results", []) if "path" in r}
    for k in range(len(words), 0, -1):
        row = rows.get(f"{' '.join(words[-k:])} [{bracket}]")
        if row is not None:
            return row["path"]
    return None


def path(label: str, doc: dict | None = None) -> str | None:
    """"zero copy", "staged", or None for a label on no shared memory."""
    if label == "shared_memory" or STAGED in label:  # collectives_benchmark.py's rows say it
        return ZERO_COPY if label == "shared_memory" else STAGED
    found = SHM.search(label)
    if not found:
        return None
    if (doc or {}).get("benchmark") in SUMMING_BENCHMARKS:
        return doc["config"]["sums"]
    if (doc or {}).get("benchmark") in RECORDED_BENCHMARKS:
        return _row_path(label[:found.start()].split()[-4:], found.group(1), doc)
    return None


def label(text: str, doc: dict | None = None) -> str:
    """``text`` (a label, a table, a sentence) with each [shared_memory] or [shared_memory:thread] naming its path,
    where its file records one."""
    def named(m):
        found = path(m.group(0), doc)
        return m.group(0) if found is None else f"{m.group(1)}[{m.group(2)}, {found}]"

    return LABELLED.sub(named, text)


def sides(check: dict) -> tuple[str, str]:
    """The two labels a stored check compares (ddp_benchmark.py: label / reference; sharding_benchmark.py:
    numerator / denominator; others: the label and torch's)."""
    return (check.get("label") or check.get("numerator") or "",
            check.get("reference") or check.get("denominator") or "")


def side_paths(check: dict, doc: dict | None = None) -> tuple[str | None, str | None]:
    """The paths of a check's two sides: as stored with them (``row`` and ``reference_row``; a count against an
    ideal has no reference), else from their labels."""
    if "row" in check:
        return check["row"].get("path"), (check.get("reference_row") or {}).get("path")
    ours, theirs = (path(s, doc) for s in sides(check))
    return ours, theirs


def axis(check: dict, doc: dict | None = None) -> str:
    """The stored axis, or "transport" where the two sides took different shared-memory paths (one side zero
    copy, the other staged): such a ratio holds the copy, not only the engine."""
    ours, theirs = side_paths(check, doc)
    if ours and theirs and ours != theirs:
        return "transport"
    return check["axis"]
