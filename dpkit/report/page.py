"""The report page: what report.ipynb's cells write to, so that each cell is one call into ``dpkit.report``.

    from dpkit.report import page, syncbn_section
    report = page.Page.in_notebook()        # results/ (or $REPORT_RESULTS) and seeds.json; shows as it goes
    syncbn_section.speed(report)

A ``Page`` reads result files (``load``: None and a visible line naming the command when one is missing) and
emits blocks: markdown (``say``, ``show`` for a table) and PNG images (``draw`` for a matplotlib figure,
``image`` for a file). In a notebook each block is displayed at once; elsewhere (the tests) the blocks are kept
in ``page.blocks`` as ``("markdown", text)`` and ``("png", bytes)``. Figures are written small (``DPI``, at
most ``MAX_WIDTH`` pixels wide, 256 colours), so the committed notebook stays small with its figures in it.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Callable

from dpkit.bench.results import markdown_table, read_results
from dpkit.report import paths

DPI = 72  # pixels per inch of an embedded figure
MAX_WIDTH = 1000  # pixels: wider images (files written at a higher dpi) are scaled down


def compact_png(data: bytes, max_width: int = MAX_WIDTH) -> bytes:
    """``data`` (a PNG) at most ``max_width`` pixels wide, in 256 colours: a chart's few colours survive."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    if image.width > max_width:
        image = image.resize((max_width, round(image.height * max_width / image.width)), Image.LANCZOS)
    out = io.BytesIO()
    image.quantize(256).save(out, format="PNG", optimize=True)
    return out.getvalue()


def figure_png(figure, dpi: int = DPI) -> bytes:
    """A matplotlib figure as a compact PNG; the figure is closed (a notebook of many figures keeps no memory)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(figure)
    return compact_png(buffer.getvalue())


def notebook_display(kind: str, value) -> None:
    """Show one block in the running notebook (IPython is imported only there)."""
    from IPython.display import Image, Markdown, display

    display(Markdown(value) if kind == "markdown" else Image(data=value))


class Page:
    """Result files in, markdown and images out; ``emit(kind, value)`` receives each block."""

    def __init__(self, results: Path, seeds: dict, emit: Callable[[str, object], None] | None = None):
        self.results, self.seeds, self.blocks = Path(results), seeds, []
        self.emit = emit or (lambda kind, value: self.blocks.append((kind, value)))
        self.cache: dict[str, dict | None] = {}

    @classmethod
    def open(cls, root: Path = Path("."), emit=None) -> "Page":
        """The page of ``root``'s results (``$REPORT_RESULTS`` when set) and seeds."""
        results = Path(os.environ.get("REPORT_RESULTS", root / "results"))
        return cls(results, json.loads((Path(root) / "seeds.json").read_text()), emit)

    @classmethod
    def in_notebook(cls, root: Path = Path(".")) -> "Page":
        return cls.open(root, notebook_display)

    def load(self, name: str) -> dict | None:
        """``results/<name>.json``, or None with a line saying which command writes it (said once)."""
        if name not in self.cache:
            path = self.results / f"{name}.json"
            self.cache[name] = read_results(str(path)) if path.exists() else None
            if self.cache[name] is None:
                self.say(f"*`{name}.json` is not in this results directory: `python run_experiments.py --only {name}` "
                         "writes it.*")
        return self.cache[name]

    def say(self, text: str, doc: dict | None = None, label: bool = True) -> None:
        """Markdown; each [shared_memory] in it names its path, zero copy or staged (``paths.label``; ``doc``:
        its file)."""
        self.emit("markdown", paths.label(text, doc) if label else text)

    def show(self, rows, columns, doc: dict | None = None, label: bool = True) -> None:
        self.say(markdown_table(rows, columns), doc, label)

    def missing(self, what: str) -> None:
        self.say(f"*not in this results file: {what}*")

    def draw(self, figure) -> None:
        self.emit("png", figure_png(figure))

    def image(self, path: str) -> None:
        self.emit("png", compact_png(Path(path).read_bytes()))

    def markdown(self) -> list[str]:
        """The markdown blocks emitted so far (for tests and for reading a section back)."""
        return [value for kind, value in self.blocks if kind == "markdown"]
