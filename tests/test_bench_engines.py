"""One vocabulary of engines: a DDP engine registered once (``engines.registry.register``, the toy of
tests/toy_engine.py: our DDP under another name) is a variant of ddp_benchmark.py, runs there as our DDP does, its
rows carrying its fields (engine, implementation, option, bucket cap, transport, path), and is drawn in a colour of
its own; without it registered, its name is an unknown variant.

One group of 2 spawned ranks runs the benchmark's own ``worker``; the rest runs in this process.
"""

from __future__ import annotations

import argparse

import pytest

import ddp_benchmark
import toy_engine
from common import run_workers
from dpkit.bench import ddp_step, ddp_variants, row_identity
from dpkit.report import plots

TINY = ["--models", "cnn", "--variants", "ddp ours", "toy ours", "--transports", "torch", "shared_memory",
        "--bucket-sizes", "25",
        "--batch-size", "2", "--iters", "2", "--rounds", "1", "--warmup", "0", "--no-breakdown"]


def _benchmark_with_the_toy(ctx) -> list[dict]:
    """This rank's rows of the DDP benchmark with the toy registered, as a user's start-up code would: each row's
    label, identity and whether it was timed."""
    with toy_engine.registered():
        rows = ddp_benchmark.worker(ctx, ddp_benchmark.parse_args(TINY))
    return [{"label": r["label"], **row_identity.identity(r), "timed": r["p50_s"] > 0} for r in rows]


@pytest.fixture(scope="module")
def runs() -> list[list[tuple]]:
    return run_workers(_benchmark_with_the_toy, 2)


def test_a_registered_ddp_engine_runs_in_the_ddp_benchmark_beside_ours_with_its_fields(runs):
    assert runs[0] == runs[1], "every rank reports the same rows"
    rows = {r["label"]: r for r in runs[0]}
    assert list(rows) == ["no ddp", "ddp ours 25M [torch]", "ddp ours 25M [shared_memory]", "toy ours 25M [torch]",
                          "toy ours 25M [shared_memory]"]
    toy = {"engine": "toy", "impl": "ours", "option": None, "bucket_cap_mb": 25.0, "timed": True}
    # The toy is our DDP: on shared memory it sums in the buckets the transport allocated, and the run records so.
    assert rows["toy ours 25M [torch]"] == {"label": "toy ours 25M [torch]", **toy, "transport": "torch",
                                            "path": None}
    assert rows["toy ours 25M [shared_memory]"] == {"label": "toy ours 25M [shared_memory]", **toy,
                                                    "transport": "shared_memory", "path": "zero copy"}
    assert rows["ddp ours 25M [torch]"]["engine"] == "ddp" and rows["no ddp"]["engine"] is None
    assert all(r["label"] == row_identity.label(r) for r in runs[0])


def test_a_registered_ddp_engine_is_a_variant_named_in_the_help_and_unknown_once_gone(capsys):
    with toy_engine.registered():
        assert "toy ours" in ddp_variants.kinds() and "toy ours" in ddp_benchmark.parse_args(["run"]).variants
        with pytest.raises(SystemExit):
            ddp_benchmark.parse_args(["run", "--help"])
        assert '"toy ours"' in capsys.readouterr().out
    with pytest.raises(argparse.ArgumentTypeError, match="unknown DDP variant 'toy ours': choose among 'ddp pytorch'"):
        ddp_benchmark.variant_argument("toy ours")


def test_a_name_without_a_colour_of_its_own_is_drawn_in_one_colour_in_every_figure_never_grey():
    """Grey is for oversubscribed runs; a registered engine's rows take one of the extra colours, always the same."""
    toy = plots.colour({"label": "toy ours 25M [torch]", "engine": "toy", "impl": "ours", "option": None,
                        "bucket_cap_mb": 25.0, "transport": "torch"})
    assert toy in plots.MORE_COLOURS and toy == plots.colour("toy ours") != plots.OTHER
    assert toy not in {plots.colour(k) for k in ddp_step.DDP_KINDS}
