"""The report and the commands around it: report.ipynb re-executes on the committed results and shows
what is committed; every experiment's command is one its script accepts; the README's commands are CI's."""

import importlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

from common import REPO
from dpkit.bench.results import read_results
import run_experiments

RESULTS = REPO / "results"


def _text_outputs(notebook) -> list[list[str]]:
    """Each code cell's text outputs (streams, markdown tables); pictures are left out (their bytes vary)."""
    cells = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        texts = []
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                texts.append(output.text)
            elif output.output_type in ("display_data", "execute_result") and "text/markdown" in output.data:
                texts.append(output.data["text/markdown"])
        cells.append(texts)
    return cells


@pytest.fixture(scope="module")
def executed():
    """report.ipynb as committed, and re-executed on the committed results (once for every test here)."""
    committed = nbformat.read(REPO / "report.ipynb", as_version=4)
    fresh = nbformat.read(REPO / "report.ipynb", as_version=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REPORT_RESULTS", str(RESULTS))
        NotebookClient(fresh, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    return committed, fresh


def test_report_executes_top_to_bottom_on_the_committed_results_and_shows_them(executed):
    committed, fresh = executed
    pictures = sum("image/png" in o.get("data", {}) for c in fresh.cells if c.cell_type == "code" for o in c.outputs)
    assert pictures >= 4, "the training, all-reduce, bandwidth and DDP sections draw their plots"
    assert _text_outputs(fresh) == _text_outputs(committed), \
        "report.ipynb is stale: run `python run_experiments.py --quick --report` (or execute it on results/) and commit"


# A number: digits with optional thousands commas, decimals and exponent, not part of a name (float32, resnet18).
NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])")


def numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def test_numbers_in_the_hand_written_text_appear_in_what_the_code_computed(executed):
    """Hand-written markdown may hold prose, or numbers that the code cells' outputs also show; a number
    typed by hand that the data does not produce (a stale claim) fails here."""
    _, fresh = executed
    computed = numbers("\n".join(text for cell in _text_outputs(fresh) for text in cell))
    for cell in fresh.cells:
        if cell.cell_type == "markdown":
            typed = numbers(cell.source) - computed
            assert not typed, f"numbers {sorted(typed)} in a markdown cell appear in no computed output:\n{cell.source[:300]}"


def test_the_number_check_catches_a_typed_claim():
    assert numbers("the gap shrinks from 1.33 to 1.42 (1,597,952 bytes, 1e-5), float32 resnet18") == \
        {"1.33", "1.42", "1597952", "1e-5"}


def test_the_committed_results_come_from_one_complete_run():
    manifest = read_results(str(RESULTS / "manifest.json"))
    assert [r["experiment"] for r in manifest["results"]] == list(run_experiments.NAMES)
    assert all(r["status"] == "ok" for r in manifest["results"])


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
@pytest.mark.parametrize("experiment", run_experiments.EXPERIMENTS, ids=lambda e: e.name)
def test_every_experiment_command_is_accepted_by_its_script(experiment, quick):
    command = experiment.command(quick, RESULTS)
    if "pytest" in command:
        assert (REPO / command[command.index("pytest") + 1]).is_file()
        return
    script = next(arg for arg in command if arg.endswith(".py"))
    module = importlib.import_module(script[:-3])
    module.parse_args(command[command.index(script) + 1:])  # argparse exits (SystemExit) on a flag it does not know


def test_readme_opens_with_the_two_commands_and_ci_runs_its_test_command():
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(first_block) == 2
    install_and_run, test = first_block
    assert install_and_run.startswith("pip install -r requirements.txt && torchrun ")
    assert "ddp_cifar100.py" in install_and_run and "--dataset synthetic" in install_and_run
    ci = (REPO / ".ci" / "run").read_text()
    assert test in ci.splitlines(), f"CI must run the README's test command {test!r}"
