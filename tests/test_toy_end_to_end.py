"""A transport and an engine registered once, by a user's start-up code, go from every benchmark to the report:
each benchmark script runs them as a user runs it (its own command line, its own spawned ranks or torchrun's,
writing its results file), and those files, in place of the committed ones they stand for, run through every cell
of report.ipynb and README's block: the toy's rows are in the tables, its series in the figures (in a style of its
own) and its name in the block. Nothing outside the tests names the toy.

The start-up code is a ``sitecustomize`` on PYTHONPATH, so every process (the script, torchrun's agent, each
spawned rank) registers the toy before it runs anything, as ``import dpkit`` registers the built-in names.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import toy_engine
import toy_transport
from common import run_script, run_torchrun
from test_report_any_name import assert_shown_everywhere, render_everything

REPO = Path(__file__).resolve().parent.parent
TOY, ENGINE = toy_transport.NAME, toy_engine.NAME
STARTUP = f"""import sys
sys.path.insert(0, {str(REPO / "tests")!r})
import toy_engine, toy_transport
toy_engine.register()
toy_transport.register()
"""
TINY = ["--iters", "2", "--warmup", "0"]
# Each results file the report reads, written by its benchmark with the toy beside the reference it needs.
TRAIN = ["--transport", TOY, "--dataset", "synthetic", "--train-size", "128", "--val-size", "32", "--batch-size", "8",
         "--num-epochs", "1"]
RUNS = {
    "train_ours": ("torchrun", "ddp_cifar100.py", "--engine", ENGINE, *TRAIN),
    "train_pytorch": ("torchrun", "ddp_cifar100.py", "--impl", "pytorch", *TRAIN),
    "ddp_headline": ("torchrun", "ddp_benchmark.py", "--models", "resnet18",
                     "--variants", "ddp pytorch best", "ddp ours", f"{ENGINE} ours", "--transports", "torch", TOY,
                     "--bucket-sizes", "25", "--batch-size", "2", "--rounds", "2", "--no-breakdown", *TINY),
    "syncbn": ("python", "syncbn_benchmark.py", "--transports", "torch", TOY, "--batch", "4", "--hidden", "8",
               "--dtypes", "float32", "--rounds", "2", "--settings", "workers", *TINY),
    # both axes: the algorithms' rows carry the file's stored targets (auto against torch), the transports' the toy
    "collectives": ("python", "collectives_benchmark.py", "--axis", "both", "--procs", "2",
                    "--transports", "torch", TOY, "--sizes", "4096", *TINY),
    "sharding_gpt": ("python", "sharding_benchmark.py", "--quick", "--models", "gpt", "--procs", "2",
                     "--variants", f"ddp ours [{TOY}]", f"{ENGINE} ours [{TOY}]", "ddp ours [torch]",
                     "--rounds", "2", *TINY),
}


def run_as_a_user(name: str, results: Path, env: dict) -> None:
    how, script, *flags = RUNS[name]
    flags = [*flags, "--metrics-json" if script == "ddp_cifar100.py" else "--json", str(results / f"{name}.json")]
    if how == "torchrun":
        run_torchrun(script, 2, *flags, env=env)
    else:
        run_script([script, *flags], env=env)


@pytest.fixture(scope="module")
def shown(tmp_path_factory):
    """(markdown of every cell, the words and legends of every figure, README's block) on the committed results
    with the toy runs in place of the files they stand for."""
    root = tmp_path_factory.mktemp("toy")
    (root / "startup").mkdir()
    (root / "startup" / "sitecustomize.py").write_text(STARTUP)
    results = root / "results"
    shutil.copytree(REPO / "results", results)
    env = {"PYTHONPATH": os.pathsep.join([str(root / "startup"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    for name in RUNS:
        run_as_a_user(name, results, env)
    with toy_transport.registered(), toy_engine.registered():  # this process draws the toy's rows as the user's
        return render_everything(results)


@pytest.mark.slow  # four benchmark runs and every cell of the notebook
def test_a_registered_transport_goes_from_every_benchmark_to_every_table_figure_and_the_block(shown):
    assert_shown_everywhere(shown, TOY)


@pytest.mark.slow
def test_a_registered_engine_goes_from_the_benchmarks_to_their_tables_figures_and_the_block(shown):
    markdown, figures, block = shown
    assert f"{ENGINE} ours 25M [{TOY}]" in markdown  # the DDP benchmark's row
    assert f"{ENGINE} ours [{TOY}]" in markdown  # the sharding benchmark's
    assert f"{ENGINE} ours" in "\n".join(words for words, _ in figures)
    assert f"{ENGINE} ours" in block
    # ddp_cifar100.py trained with it, on the toy transport, beside PyTorch's DDP on the same settings
    assert f"**ours**: engine {ENGINE} (ours), transport {TOY} " in markdown
    assert f"with our engine {ENGINE} and SyncBatchNorm" in block and f"the same transport ({TOY} " in block


@pytest.mark.slow
def test_what_a_tiny_run_lacks_is_said_where_the_report_would_show_it(shown):
    markdown, _, block = shown
    # the toy's SyncBatchNorm grid (4 x 8) holds no size of the seed's, its collectives run no 4-process world
    assert "*not in this results file: a size of the seed's grid (batch, hidden) in results/syncbn.json*" in markdown
    assert "*not in this results file: the sizes the shape and scaling are compared at:" in markdown
    assert "; no timed comparison in this run" in block  # the sharding run compares no two timed rows
