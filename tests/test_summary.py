"""README.md's headline block is rendered from the committed results: a claim cannot drift from its data."""

import shutil

import pytest

import run_experiments
import summary
from common import REPO


def test_the_readme_block_is_exactly_what_the_committed_results_render():
    rendered = summary.render(REPO / "results", run_experiments.producers())
    assert summary.readme_block((REPO / "README.md").read_text()) == rendered, (
        "README.md's headline block differs from the committed results: run `python run_experiments.py --summary`")


def test_a_missing_results_file_is_named_with_the_command_that_writes_it(tmp_path):
    for path in (REPO / "results").glob("*.json"):
        if path.name != "ddp_benchmark.json":
            shutil.copy(path, tmp_path / path.name)
    with pytest.raises(summary.MissingResults, match=r"ddp_benchmark.json is missing(.|\n)*"
                                                     r"python run_experiments.py --quick --only ddp_benchmark"):
        summary.render(tmp_path, run_experiments.producers())


def test_update_rewrites_only_the_block_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{summary.BEGIN}\nold claim: 9.99x\n{summary.END}\noutro\n")
    block = f"{summary.BEGIN}\nnew claim\n{summary.END}"
    assert summary.update_readme(readme, block)
    assert readme.read_text() == f"intro\n{block}\noutro\n"
    assert not summary.update_readme(readme, block), "nothing to change the second time"
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="no headline block"):
        summary.update_readme(readme, block)
