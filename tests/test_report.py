"""The report and the commands around it: report.ipynb re-executes on the committed results and shows
what is committed; every experiment's command is one its script accepts; the README's commands are CI's."""

import importlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

import run_experiments
from common import REPO
from results import read_results

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


def test_report_executes_top_to_bottom_on_the_committed_results_and_shows_them(monkeypatch):
    committed = nbformat.read(REPO / "report.ipynb", as_version=4)
    fresh = nbformat.read(REPO / "report.ipynb", as_version=4)
    monkeypatch.setenv("REPORT_RESULTS", str(RESULTS))
    NotebookClient(fresh, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    pictures = sum("image/png" in o.get("data", {}) for c in fresh.cells if c.cell_type == "code" for o in c.outputs)
    assert pictures >= 4, "the training, all-reduce, bandwidth and DDP sections draw their plots"
    assert _text_outputs(fresh) == _text_outputs(committed), \
        "report.ipynb is stale: run `python run_experiments.py --quick --report` (or execute it on results/) and commit"


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
