"""A benchmark row's identity as fields, and the one function that formats its label from them: readers group,
join and judge by the fields, and show the label.

    row = {"engine": "ddp", "impl": "pytorch", "option": "best", "bucket_cap_mb": 25.0,
           "transport": "shared_memory", "path": "staged"}
    label(row)              # "ddp pytorch best 25M [shared_memory]"
    label(row, path=True)   # "ddp pytorch best 25M [shared_memory, staged]"
    name(row)               # "ddp pytorch best": engine, implementation and option, a figure's series
    identity(row)           # the fields of IDENTITY, to store with a check
    what(row)               # the same but the path, as a tuple: a join's or a series' key

The format is the engine registry's ("<engine> <ours|pytorch>[ option][ <cap>M] [<transport>]",
``dpkit.engines.registry``); a row without an engine is the model alone, "no ddp".
"""

from __future__ import annotations

from typing import Mapping

# What a row is, apart from where it ran (model, batch, input, world size): the registered engine (None: the
# model alone), its implementation ("ours" / "pytorch"), an option of it ("best", "naive", ...; None), the bucket
# cap in MiB (None or 0: not a setting of the row), the transport's registry name, and on shared memory the path
# the benchmark recorded ("zero copy": the transport's own buffers; "staged": copied in and out; None elsewhere).
IDENTITY = ("engine", "impl", "option", "bucket_cap_mb", "transport", "path")
ZERO_COPY, STAGED = "zero copy", "staged"
NO_ENGINE = "no ddp"


def recorded_path(transport) -> str | None:
    """The path the iterations since ``transport.release_staging()`` took through a transport with a staging block
    (shared memory): "staged" when it had to copy a tensor it did not allocate into that block, else "zero copy";
    None for any other transport."""
    if not hasattr(transport, "staging_bytes"):
        return None
    return STAGED if transport.staging_bytes > 0 else ZERO_COPY


def identity(row: Mapping) -> dict:
    return {key: row.get(key) for key in IDENTITY}


# What makes two rows the same comparison's side, in two runs or at two world sizes: the identity but the path,
# which the benchmark records from what a run did (a world of one moves nothing: no path).
WHAT = tuple(k for k in IDENTITY if k != "path")


def what(row: Mapping) -> tuple:
    """The fields of WHAT as a hashable tuple, in that order (a join's or a series' key)."""
    return tuple(row.get(k) for k in WHAT)


def name(row: Mapping) -> str:
    """"ddp ours overlap": engine, implementation and option; "no ddp" without an engine."""
    if row.get("engine") is None:
        return NO_ENGINE
    return " ".join(w for w in (row["engine"], row.get("impl"), row.get("option")) if w)


def label(row: Mapping, path: bool = False) -> str:
    """"ddp ours 25M [shared_memory]" (the cap when it is set; the transport when there is one); ``path``: the
    recorded path inside the bracket, "[shared_memory, zero copy]"."""
    text = name(row)
    if row.get("engine") is None:
        return text
    if row.get("bucket_cap_mb"):
        text += f" {row['bucket_cap_mb']:g}M"
    if not row.get("transport"):
        return text
    where = f", {row['path']}" if path and row.get("path") else ""
    return f"{text} [{row['transport']}{where}]"
