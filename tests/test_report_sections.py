"""report.ipynb is a list of calls into ``dpkit.report``: each code cell a few lines that call a section module
(no definitions, loops or branches in the notebook), the committed file small; and what those section modules
state is checked here against the committed result files, read independently of the code under test. The
notebook's own cells run here, without Jupyter, on a page that keeps its blocks (the slow test in
tests/test_report.py executes it in a kernel)."""

import ast
import io
import json
import xml.etree.ElementTree as ET

import matplotlib
import matplotlib.pyplot as plt
import pytest

from common import REPO
from dpkit.bench.results import read_results
from dpkit.bench.row_identity import label as row_label, what
from dpkit.report import (allreduce_section, ddp_formats, ddp_section, multihost_section, overview, page,
                          sharding_section, summary, syncbn_detail, syncbn_section, training_section, wording)

matplotlib.use("Agg")

NOTEBOOK = REPO / "report.ipynb"
RESULTS = REPO / "results"
MAX_CELL_LINES = 8  # a cell is a call or a few, each with a comment at most
MAX_NOTEBOOK_BYTES = 1_200_000  # the whole notebook, its figures embedded
CELL_STATEMENTS = (ast.Expr, ast.Import, ast.ImportFrom, ast.Assign)  # calls, the imports, the page


def code_cells() -> list[str]:
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]


def report_modules(cells: list[str]) -> set[str]:
    """The names the notebook imports from dpkit.report."""
    return {alias.asname or alias.name for cell in cells for node in ast.walk(ast.parse(cell))
            if isinstance(node, ast.ImportFrom) and node.module == "dpkit.report" for alias in node.names}


def root(node: ast.expr) -> str | None:
    """``x`` of ``x.a.b``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def called_modules(cell: str) -> set[str]:
    """``x`` of every call ``x.f(...)`` or ``x.A.f(...)`` in a cell."""
    return {root(node.func) for node in ast.walk(ast.parse(cell))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}


def logic(cell: str) -> list[str]:
    """The statements of a cell that are not a call, an import or a plain assignment (a def, a loop, a branch)."""
    return [type(node).__name__ for node in ast.parse(cell).body if not isinstance(node, CELL_STATEMENTS)]


def test_every_code_cell_is_a_few_lines_calling_dpkit_report():
    cells = code_cells()
    modules = report_modules(cells)
    assert {"page", "syncbn_section", "overview"} <= modules, "the first cell imports the section modules"
    for cell in cells:
        lines = [line for line in cell.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert len(lines) <= MAX_CELL_LINES, f"a cell of {len(lines)} lines: move its logic into dpkit.report\n{cell}"
        assert not logic(cell), f"a cell with {logic(cell)}: move it into dpkit.report\n{cell}"
        assert called_modules(cell) & modules, f"a cell that calls nothing of dpkit.report:\n{cell}"


def test_the_shape_rules_see_a_cell_with_logic():
    assert logic("for r in rows:\n    show(r)\nx = 1\nsyncbn_section.speed(report)") == ["For"]
    assert called_modules("syncbn_section.speed(report)  # the table") == {"syncbn_section"}
    assert called_modules("report = page.Page.open()\nprint(1)") == {"page"}
    assert report_modules(["from dpkit.report import page, overview as o"]) == {"page", "o"}


def test_the_committed_notebook_stays_small():
    size = NOTEBOOK.stat().st_size
    assert size <= MAX_NOTEBOOK_BYTES, (
        f"report.ipynb is {size:,} bytes (at most {MAX_NOTEBOOK_BYTES:,}): a figure drawn outside page.draw, or a "
        "large text output?")


@pytest.fixture(scope="module")
def blocks():
    """Every block the notebook's cells emit on the committed results, per cell, run here without a kernel."""
    cells, per_cell = code_cells(), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REPORT_RESULTS", str(RESULTS))
        patch.chdir(REPO)
        report = page.Page.open(REPO)
        patch.setattr(page.Page, "in_notebook", classmethod(lambda cls, root=None: report))
        # Drawn, not encoded: encoding is test_a_figure_is_embedded_small's, and costs seconds a figure here.
        patch.setattr(page, "figure_png", lambda figure: plt.close(figure) or b"figure")
        patch.setattr(page, "compact_png", lambda data: b"image")
        namespace = {}
        for cell in cells:
            before = len(report.blocks)
            exec(compile(cell, "report.ipynb", "exec"), namespace)
            per_cell.append(report.blocks[before:])
    return per_cell


@pytest.mark.slow  # every cell's blocks: seconds of figures (the default suite checks the sections' words below)
def test_every_section_of_the_notebook_emits_on_the_committed_results(blocks):
    assert all(blocks[1:]), "every cell after the imports shows something"
    pictures = [value for cell in blocks for kind, value in cell if kind == "png"]
    assert pictures.count(b"figure") >= 15 and pictures.count(b"image") == 3, "each section draws its figures"


def test_the_summary_cell_is_readmes_block():
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index(summary.BEGIN) + len(summary.BEGIN):readme.index(summary.END)].strip("\n")
    report = page.Page.open(REPO)
    overview.headline(report)
    assert report.markdown() == [block], "the notebook's summary and README's block are one function's output"


def test_the_environment_lists_every_machine_and_commit_the_files_came_from():
    env = {"torch": "2.14.1", "cuda": None, "device": "cpu", "device_model": "AMD EPYC", "cpus": 2, "threads": 1,
           "backend": "gloo", "python": "3.11.7", "git_commit": "aaaa"}
    rows = overview.environment_rows([env, {**env, "device_model": "Intel Xeon", "git_commit": "bbbb"}, env], None)
    values = {r["item"]: r["value"] for r in rows}
    assert values["device model"] == "AMD EPYC; Intel Xeon" and values["git commit"] == "aaaa; bbbb"
    assert values["torch"] == "2.14.1" and values["CUDA"] == "none (CPU)" and values["settings"] == "full"


def test_each_section_names_the_machine_of_its_own_file(tmp_path):
    """A results directory whose parts ran on two machines: the all-reduce section names the one its file says."""
    results = tmp_path / "results"
    results.mkdir()
    for name in ("syncbn", "allreduce"):
        (results / f"{name}.json").write_bytes((REPO / "results" / f"{name}.json").read_bytes())
    doc = json.loads((results / "allreduce.json").read_text())
    doc["env"]["device_model"] = "a machine of its own"
    (results / "allreduce.json").write_text(json.dumps(doc))
    report = page.Page(results, json.loads((REPO / "seeds.json").read_text()))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(page, "figure_png", lambda figure: plt.close(figure) or b"figure")
        allreduce_section.beside_seed(report)
    assert "ours on a machine of its own (2 cores, gloo)" in report.markdown()[-1]


def test_a_missing_file_is_none_and_a_line_naming_its_command(tmp_path):
    (tmp_path / "seeds.json").write_text("{}")
    report = page.Page(tmp_path / "results", {})
    assert report.load("syncbn") is None and report.load("syncbn") is None
    assert report.markdown() == ["*`syncbn.json` is not in this results directory: `python run_experiments.py "
                                 "--only syncbn` writes it.*"], "said once"


def test_a_figure_is_embedded_small():
    figure, ax = plt.subplots(figsize=(30, 4))
    ax.plot(range(100))
    data = page.figure_png(figure)
    from PIL import Image
    image = Image.open(io.BytesIO(data))
    assert image.width == page.MAX_WIDTH and image.mode == "P", "scaled down, 256 colours"
    assert figure.number not in plt.get_fignums(), "the figure is closed"


# --------------------------------------------------------------------------- the sections against the files


@pytest.fixture(scope="module")
def syncbn():
    return read_results(str(RESULTS / "syncbn.json"))


def test_syncbn_table_states_each_sizes_time_and_memory_from_the_file(syncbn):
    rows, _ = syncbn_section.speed_table(syncbn)
    times = [r for r in syncbn["results"] if r.get("kind") == "time" and r["setting"] == "workers"
             and r["dtype"] == "float32"]
    local = {(r["batch"], r["hidden"]): r for r in times if r["impl"] == "BatchNorm1d (local)"}
    assert [(r["batch"], r["hidden"]) for r in rows] == sorted(local)
    for t in ("torch", "shared_memory"):
        ours = {(r["batch"], r["hidden"]): r for r in times if r["impl"] == "ours" and r["transport"] == t}
        for row in rows:
            size = row["batch"], row["hidden"]
            assert row[f"ms_{t}"] == pytest.approx(1e3 * ours[size]["time_s"])
            assert row[f"mem_{t}"] == pytest.approx(ours[size]["peak_bytes"] / local[size]["peak_bytes"])


def test_syncbn_commentary_counts_the_sizes_the_benchmark_judged_met(syncbn):
    """The benchmark stored how many sizes met the every-size target per transport: the sentence agrees."""
    stored = {t["transport"]: t for t in syncbn["results"] if t.get("kind") == "target" and t["setting"] == "workers"
              and t.get("versus") == "BatchNorm1d + 2 all_reduce" and "every size" in t["name"]}
    assert set(stored) == {"torch", "shared_memory"}
    for transport, target in stored.items():
        sentence = syncbn_section.transport_sentence(syncbn, transport)
        assert f"met on {target['sizes_met']}," in sentence and f"of the {target['sizes']} sizes" in sentence
        assert f"<= {target['limit']}x" in sentence


def test_syncbn_test_outcomes_add_up_to_the_junit_file():
    suite = ET.parse(RESULTS / "syncbn_tests.xml").getroot().find("testsuite")
    attributes, rows = syncbn_section.test_outcomes(RESULTS)
    assert sum(r["passed"] + r["failed"] + r["skipped"] for r in rows) == int(suite.get("tests"))
    assert sum(r["failed"] for r in rows) == int(suite.get("failures")) + int(suite.get("errors"))
    assert attributes["tests"] == suite.get("tests")


def test_training_difference_is_the_largest_gap_between_the_two_runs_epochs():
    runs = {impl: read_results(str(RESULTS / f"train_{impl}.json")) for impl in ("ours", "pytorch")}
    epochs = [[r for r in runs[impl]["results"] if r["kind"] == "epoch"] for impl in ("ours", "pytorch")]
    expected = max(abs(a[k] - b[k]) for a, b in zip(*epochs) for k in ("train_loss", "val_loss", "val_acc"))
    assert training_section.largest_difference(runs) == expected
    assert f"is {expected:.3g}:" in training_section.commentary_text(runs)


def test_training_runs_of_different_settings_are_not_compared_in_the_commentary_or_beside_the_seed():
    runs = {impl: read_results(str(RESULTS / f"train_{impl}.json")) for impl in ("ours", "pytorch")}
    runs["pytorch"]["config"]["seed_used"] += 1
    assert training_section.commentary_text(runs) == (
        f"*Commentary.* The two runs are not the same experiment (seed {runs['ours']['config']['seed_used']} / "
        f"{runs['pytorch']['config']['seed_used']}, ours / PyTorch's): their curves, losses and times are not "
        "compared.")
    seed = json.loads((REPO / "seeds.json").read_text())["homework_solution"]
    text = training_section.seed_text(runs, training_section.seed_rows(runs, seed), seed, runs["ours"]["env"])
    assert "Ours: not compared, the two runs are not the same experiment (seed " in text


def test_allreduce_rows_carry_each_algorithms_time_and_error_from_the_file():
    doc = read_results(str(RESULTS / "allreduce.json"))
    short = dict(allreduce_section.ALGORITHMS)
    rows = {(r["world"], r["elements"]): r for r in allreduce_section.rows(doc)}
    for measured in (r for r in doc["results"] if r["algorithm"] in short):
        row = rows[measured["world_size"], measured["numel"]]
        assert row[f"{short[measured['algorithm']]}_ms"] == pytest.approx(1e3 * measured["time_s"])
        assert row[f"{short[measured['algorithm']]}_err"] == measured["max_abs_error"]


def test_zero_balance_is_the_worst_rank_of_each_stage_over_every_rank_count():
    doc = read_results(str(RESULTS / "sharding.json"))
    rows = [r for r in doc["results"] if "variant" in r]
    text = sharding_section.zero_balance_text(rows)
    for stage in ("zero1", "zero2"):
        worst = max(r["model_state_bytes"] / r["ideal_bytes"] for r in rows if r["variant"].startswith(f"{stage} ours"))
        assert f"{stage} at most {worst:.2f}x" in text


def test_the_bucket_sentence_names_the_sweeps_fastest_cap_per_transport():
    doc = read_results(str(RESULTS / "ddp_benchmark.json"))
    ours = [r for r in doc["results"] if (r["engine"], r["impl"], r["option"]) == ("ddp", "ours", None)
            and r["model"] == "resnet18"]
    assert ours, "the committed file has our DDP's rows"
    text = ddp_section.caps_text(doc["results"])
    for transport in {r["transport"] for r in ours}:
        best = min((r for r in ours if r["transport"] == transport), key=lambda r: r["p50_s"])
        assert f"on {transport}, the lowest p50 is {row_label(best, path=True)}" in text


def test_the_sweep_scaling_is_examples_per_second_at_the_most_processes_within_the_cores():
    doc = read_results(str(RESULTS / "ddp_sweep.json"))
    cpus = doc["env"]["cpus"]
    rows = {(what(r), r["world_size"]): r for r in doc["results"]}  # a series: one row's fields but its path
    text = ddp_formats.scaling_text(ddp_formats.marked(doc), cpus)
    stated = 0
    for series in {series for series, _ in rows}:
        if (series, 1) in rows and (series, cpus) in rows:
            top, one = rows[series, cpus], rows[series, 1]
            gain = top["p50_ex_per_s"] / one["p50_ex_per_s"]
            # the range: the fastest round at the cores' count against the slowest at one process, and back
            per_round = [(top["global_batch"] / a) / (one["global_batch"] / b)
                         for a in top["round_p50_s"] for b in one["round_p50_s"]]
            named = row_label(top, path=True)  # the path its row at that world size recorded
            assert (f"{named}: {gain:.2f}x [{min(per_round):.2f}, {max(per_round):.2f}] the examples per second "
                    "of 1 process") in text
            stated += 1
    assert stated >= 2, "the committed sweep has DDP and no DDP at 1 process and at the cores' count"


def test_the_simulated_jobs_step_ratios_are_the_files_p50_times():
    doc = read_results(str(RESULTS / "multihost.json"))
    steps = {r["label"]: r["p50_s"] for r in doc["results"] if r["kind"] == "step"}
    text = multihost_section.steps_text(doc)
    assert f"HSDP / FSDP [torch] {steps['HSDP'] / steps['FSDP [torch]']:.2f}x" in text
    assert f"ZeRO-2 / ZeRO-1 {steps['ZeRO-2 [hierarchical]'] / steps['ZeRO-1 [hierarchical]']:.2f}x" in text


def test_the_report_words_a_ratio_with_its_interval_and_a_range_of_values():
    assert wording.span([1.4, 1.2, 1.3]) == "1.20 to 1.40" and wording.span([2, 2], "d") == "2"
    assert wording.ratio_text(None) == "n/a" and wording.verdict_text({"median": 1.0}, 1.1) == "n/a"
    assert wording.ratio_text({"median": 0.5}).endswith("(no interval: the file has no per-round values)")
    assert wording.verdict_text({"median": 1.0, "ci_low": 0.9, "ci_high": 1.05}, 1.1) == "met"
    assert wording.verdict_text({"median": 1.3, "ci_low": 1.2, "ci_high": 1.4}, 1.1) == "missed"
    assert wording.interval_text(None) == "-" and wording.interval_text((0.1, 0.2)) == "[0.1000, 0.2000]"


def test_the_sweep_growth_names_our_ddp_beside_no_ddp_and_the_seed():
    doc = read_results(str(RESULTS / "ddp_sweep.json"))
    seed = json.loads((REPO / "seeds.json").read_text())["pytorch_ddp_benchmark"]
    text = ddp_formats.growth_text(ddp_formats.marked(doc), seed, doc["env"])
    first = next(r for r in doc["results"] if (r["engine"], r["impl"], r["option"]) == ("ddp", "ours", None))
    ours = [r for r in doc["results"] if what(r) == what(first)]  # one series: its transport at every world size
    assert f"Ours ({row_label(ours[-1], path=True)}) grows by " in text
    assert "without DDP (no communication at all)" in text


def test_every_syncbn_cell_reads_a_file_of_any_transport_and_names_it(tmp_path):
    """The committed run of SyncBatchNorm on a "dpkit" group beside gloo (results/syncbn_backend.json), as the
    report's syncbn.json, its second transport renamed to one the report has no words for (registered by the run
    that wrote the file): every SyncBatchNorm cell shows it (none raises), the table has its columns, and the
    commentary names it by its registry name."""
    name = "toy"
    text = (RESULTS / "syncbn_backend.json").read_text().replace('"torch:dpkit"', json.dumps(name))
    (tmp_path / "syncbn.json").write_text(text)
    (tmp_path / "syncbn_tests.xml").write_bytes((RESULTS / "syncbn_tests.xml").read_bytes())
    report = page.Page(tmp_path, json.loads((REPO / "seeds.json").read_text()))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(page, "figure_png", lambda figure: plt.close(figure) or b"figure")
        for cell in (syncbn_section.speed, syncbn_section.commentary, syncbn_section.beside_seed):
            cell(report)
    said = [value for kind, value in report.blocks if kind == "markdown"]
    assert f"ours [{name}] (ms, median)" in said[0], "the speed table has a column per transport"
    commentary = next(text for text in said if text.startswith("*Commentary.*"))
    assert "through torch.distributed (gloo) ours takes" in commentary and f"through the transport {name} ours takes" \
        in commentary


@pytest.mark.parametrize("gaps, cold_us, said", [
    ({"torch": 100e-6}, 30.0, "ours computes 100 us more than the reference outside its two collectives, of which the "
                              "cold caches' 30 us are 30 %: cold caches of this kind account for a minority"),
    ({"torch": 100e-6}, -10.0, "cold caches add nothing to what our layer computes, so they explain none of it."),
    ({"shared_memory": -37e-6}, 30.0, "ours computes 37 us less than the reference outside its two collectives: "
                                      "ours computes no more than the reference"),
])
def test_the_cold_cache_sentence_gives_a_share_only_where_both_are_extra(monkeypatch, gaps, cold_us, said):
    monkeypatch.setattr(syncbn_detail, "transports", lambda doc: list(gaps))
    monkeypatch.setattr(syncbn_detail.findings, "compute_gap", lambda doc, batch, hidden, t: gaps[t])
    text = syncbn_detail.gap_text({}, 32, 128, cold_us)
    assert said in text and "-" not in text.split("table above")[1]
