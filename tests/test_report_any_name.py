"""A transport or an engine the report has no words for is shown like any other: the committed results, with one
transport renamed in every file that holds it and one engine renamed in the sharding files, run through every
cell of report.ipynb and README's block: no cell raises, and the new names appear in the tables, in the figures
(with a colour of their own) and in the block. tests/test_transport_choice.py shows the other half: a transport
registered once runs in every benchmark and names its rows; tests/test_toy_end_to_end.py joins the two, the
benchmarks' own files run through every cell.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer, ErrorbarContainer
import pytest

import run_experiments
import toy_engine
from dpkit.report import page, plots, summary
from test_report_sections import code_cells

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
WIRE = "toywire"  # a transport no module of dpkit knows
# The transport each family of files is renamed in: one its report sections show beside torch's.
RENAMED = {"ddp_": "shared_memory:thread", "sharding": "shared_memory", "syncbn.json": "shared_memory",
           "collectives.json": "shared_memory:staged", "all_gather.json": "shared_memory:staged",
           "reduce_scatter.json": "shared_memory:staged"}
ENGINE = "zero2"  # renamed to the toy engine's name (tests/toy_engine.py) in the sharding files


def renamed_results(directory: Path) -> Path:
    shutil.copytree(RESULTS, directory)
    for path in directory.glob("*.json"):
        old = next((wire for prefix, wire in RENAMED.items() if path.name.startswith(prefix)), None)
        if old is None:
            continue
        text = path.read_text().replace(f'"{old}"', f'"{WIRE}"').replace(f"[{old}]", f"[{WIRE}]")
        if path.name.startswith("sharding"):
            text = text.replace(f'"{ENGINE}"', f'"{toy_engine.NAME}"').replace(f"{ENGINE} ours",
                                                                            f"{toy_engine.NAME} ours")
        path.write_text(text)
    return directory


def figure_words(figure) -> str:
    """Every labelled series and tick label of a figure."""
    words = []
    for ax in figure.axes:
        words += [t.get_text() for t in (*ax.get_xticklabels(), *ax.get_yticklabels())]
    return "\n".join(words + [text for legend in legends(figure) for text, _ in legend])


def legends(figure) -> list[list[tuple[str, tuple]]]:
    """Each panel's labelled series as (label, style: colour, line style, hatch) pairs, from the artists drawn
    (an error bar's data line, a bar container's first bar)."""
    return [[(label, style(handle)) for handle, label in zip(*ax.get_legend_handles_labels())]
            for ax in figure.axes]


def style(handle) -> tuple:
    if isinstance(handle, ErrorbarContainer):  # its data line, or its bars where it draws no line
        handle = handle.lines[0] or handle.lines[2][0]
    elif isinstance(handle, BarContainer):
        handle = handle.patches[0]
    colour = handle.get_color() if hasattr(handle, "get_color") else handle.get_facecolor()
    # A line's dashes as drawn: get_linestyle() calls every dash pattern "--".
    dashes = getattr(handle, "_unscaled_dash_pattern", None) or getattr(handle, "get_linestyle", lambda: None)()
    return to_hex(colour), str(dashes), getattr(handle, "get_hatch", lambda: None)()


def shared_styles(figures, name: str = WIRE) -> list[str]:
    """Legend entries of transport ``name`` drawn exactly like an entry of another in the same legend."""
    clashes = []
    for legend in (legend for figure in figures for legend in figure):
        others = {look for text, look in legend if name not in text}
        clashes += [text for text, look in legend if name in text and look in others]
    return clashes


def render_everything(results: Path) -> tuple[str, list, str]:
    """(markdown of every cell of report.ipynb, the words and legends of every figure, README's block) on the
    results folder ``results``."""
    figures = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REPORT_RESULTS", str(results))
        patch.chdir(REPO)
        report = page.Page(results, json.loads((REPO / "seeds.json").read_text()))
        patch.setattr(page.Page, "in_notebook", classmethod(lambda cls, root=None: report))
        patch.setattr(page, "figure_png", lambda figure: figures.append((figure_words(figure), legends(figure)))
                      or plt.close(figure) or b"figure")
        patch.setattr(page, "compact_png", lambda data: b"image")
        namespace = {}
        for cell in code_cells():
            exec(compile(cell, "report.ipynb", "exec"), namespace)
        markdown = [value for kind, value in report.blocks if kind == "markdown"]
        block = summary.render(results, run_experiments.producers())
    return "\n".join(markdown), figures, block


@pytest.fixture(scope="module")
def shown(tmp_path_factory):
    """(markdown of every cell, the words of every figure, README's block) on the renamed results."""
    results = renamed_results(tmp_path_factory.mktemp("any_name") / "results")
    with toy_engine.registered():
        return render_everything(results)


@pytest.mark.slow  # every cell of the notebook: seconds of figures
def test_a_transport_no_module_knows_is_shown_in_every_section_and_figure(shown):
    assert_shown_everywhere(shown, WIRE)
    assert plots.colour(WIRE) not in (plots.OTHER, plots.colour("torch"))


def assert_shown_everywhere(shown: tuple[str, list, str], transport: str) -> None:
    """``transport``'s rows in the DDP, sharding, SyncBatchNorm and collectives tables, its series in the figures
    in a style of its own, and its name in README's block."""
    markdown, figures, block = shown
    for label in (f"ddp ours 25M [{transport}",  # the DDP tables
                  f"ddp ours [{transport}",  # the sharding tables
                  f"ours [{transport}]",  # SyncBatchNorm's
                  f"| {transport} |"):  # a collectives table's row
        assert label in markdown, label
    assert f"[{transport}" in "\n".join(words for words, _ in figures)
    assert not shared_styles((legend for _, legend in figures), transport), "drawn like another transport"
    assert f"[{transport}" in block


@pytest.mark.slow
def test_an_engine_registered_in_a_test_is_shown_in_the_sharding_tables_and_figures(shown):
    markdown, figures, _ = shown
    assert f"{toy_engine.NAME} ours [torch]" in markdown
    assert f"{toy_engine.NAME} ours" in "\n".join(words for words, _ in figures)
