"""The report and the commands around it: report.ipynb re-executes on the committed results and shows
what is committed; every experiment's command is one its script accepts; the README's commands are CI's."""

import importlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

from common import REPO
from dpkit.bench.results import read_results
from dpkit.report import findings
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


@pytest.mark.slow  # executing the notebook takes half a minute: CI runs it with the slow tests
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


@pytest.mark.slow
def test_numbers_in_the_hand_written_text_appear_in_what_the_code_computed(executed):
    """Hand-written markdown may hold prose, or numbers that the code cells' outputs also show; a number
    typed by hand that the data does not produce (a stale claim) fails here."""
    _, fresh = executed
    computed = numbers("\n".join(text for cell in _text_outputs(fresh) for text in cell))
    for cell in fresh.cells:
        if cell.cell_type == "markdown":
            typed = numbers(cell.source) - computed
            assert not typed, (f"numbers {sorted(typed)} in a markdown cell appear in no computed output:\n"
                               f"{cell.source[:300]}")


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


# --------------------------------------------------------------------------- findings: the numbers behind the sentences


def target(world, verdict, limit=1.0, option=None, **fields):
    """A stored check of ours (with ``option``) against PyTorch's DDP, each side by its identity."""
    ours = {"engine": "ddp", "impl": "ours", "option": option, "bucket_cap_mb": 25.0, "transport": "torch"}
    return {"model": "resnet18", "world_size": world, "axis": "impl", "label": " ".join(filter(None, ["ours", option])),
            "reference": "pytorch", "row": {**ours, "path": None},
            "reference_row": {**ours, "impl": "pytorch", "option": None, "path": None},
            "target": "p50 / pytorch p50", "limit": limit, "verdict": verdict, **fields}


def test_counts_leave_out_oversubscribed_runs_and_checks_without_a_target():
    env = {"cpus": 2, "device": "cpu"}
    checks = [target(1, "met"), target(2, "missed"), target(2, "inconclusive"), target(4, "met"),
              target(4, "missed", oversubscribed=False), target(2, "information", limit=None)]
    counted = findings.countable(checks, env)
    assert [c["world_size"] for c in counted] == [1, 2, 2]
    assert findings.verdict_counts(counted) == {"met": 1, "missed": 1, "inconclusive": 1}
    assert findings.counts_text(counted[:1]) == "1 met, 0 missed, 0 inconclusive"
    assert len(findings.countable(checks, {"cpus": 4, "device": "cpu"})) == 5  # 4 processes fit on 4 cores


def test_two_runs_verdicts_are_compared_on_the_same_comparison_only():
    headline = [target(2, "met"), target(2, "inconclusive", option="flat"), target(2, "met", option="overlap")]
    sweep = [target(2, "inconclusive"), target(2, "inconclusive", option="flat"), target(2, "met", option="naive"),
             target(2, "missed", model="cnn")]
    sweep[1]["row"]["path"] = "zero copy"  # the path a run recorded does not make it another comparison
    pairs = [(c["label"], o["label"]) for c, o in findings.paired_checks(headline, sweep)]
    assert pairs == [("ours", "ours"), ("ours flat", "ours flat")]
    differ = findings.differing_verdicts(headline, sweep)
    assert [(c["verdict"], o["verdict"]) for c, o in differ] == [("met", "inconclusive")]


def test_a_series_text_follows_its_points_in_x_order_with_their_intervals():
    assert findings.series_text([(10_000, 1.37), (1_000, 1.39), (100_000, 3.28)]) == \
        "1.39 at 1,000, 1.37 at 10,000 and 3.28 at 100,000"
    assert findings.series_text([(2, 0.5)], "d", ".1f") == "0.5 at 2"
    assert (findings.series_text([(2, 1.8, 1.49, 3.3), (1, 1.0, 0.9, 1.1)], "d")
            == "1.00 [0.90, 1.10] at 1 and 1.80 [1.49, 3.30] at 2")


def test_growth_is_from_one_world_size_to_another_of_one_series_with_the_range_its_rounds_allow():
    rows = [{"world_size": 1, "p50_s": 0.10, "round_p50_s": [0.09, 0.11]},
            {"world_size": 2, "p50_s": 0.13, "round_p50_s": [0.12, 0.15]}]
    assert findings.growth(rows, 1, 2) == pytest.approx((0.3, 0.12 / 0.11 - 1, 0.15 / 0.09 - 1))
    assert findings.growth(rows, 2, 1) == pytest.approx((0.10 / 0.13 - 1, 0.09 / 0.15 - 1, 0.11 / 0.12 - 1))
    assert findings.growth(rows[:1], 1, 2) is None


def allreduce_row(world, size, label, p50, choice=None, axis="algorithm", rounds=None):
    return {"world_size": world, "bytes": size, "label": label, "p50_s": p50, "choice": choice, "axis": axis,
            "round_p50_s": rounds}


def test_auto_choices_compare_autos_pick_with_the_lowest_p50_of_the_run():
    rows = [allreduce_row(2, 4000, "torch", 0.1), allreduce_row(2, 4000, "ring", 3.0),
            allreduce_row(2, 4000, "tree", 0.6), allreduce_row(2, 4000, "auto", 0.5, "tree"),
            allreduce_row(2, 2**20, "torch", 0.1), allreduce_row(2, 2**20, "ring", 1.0),
            allreduce_row(2, 2**20, "tree", 2.0), allreduce_row(2, 2**20, "auto", 0.05, "tree"),
            allreduce_row(2, 2**20, "p2p", 0.01, "ring", axis="transport"),  # another axis: not an algorithm
            allreduce_row(4, 4000, "ring", 0.1), allreduce_row(4, 4000, "auto", 0.2, "tree")]
    # No rounds to pair: the lowest p50 is separated from nothing.
    assert findings.auto_choices(rows, 2) == [
        {"bytes": 4000, "choice": "tree", "lowest": "tree", "tied": ["ring"], "hit": True},
        {"bytes": 2**20, "choice": "tree", "lowest": "ring", "tied": ["tree"], "hit": False}]  # the algorithms' p50
    assert findings.auto_choices(rows, 4) == [{"bytes": 4000, "choice": "tree", "lowest": "ring", "tied": [],
                                               "hit": False}]
    assert findings.auto_choices(rows, 8) == []


def test_the_lowest_p50_is_the_fastest_only_where_its_paired_interval_stays_below_1():
    """tree is 0.5x ring in every round (separated); halving_doubling is 0.9x or 1.1x tree's time in alternate
    rounds (its interval holds 1: not separated); butterfly has too few rounds to pair."""
    load = [1.0, 1.3] * 4
    tree = allreduce_row(2, 4000, "tree", 1.0, rounds=load)
    ring = allreduce_row(2, 4000, "ring", 2.0, rounds=[2 * x for x in load])
    halving = allreduce_row(2, 4000, "halving_doubling", 1.05,
                            rounds=[x * f for x, f in zip(load, [1 / 0.9, 1 / 1.1] * 4)])
    butterfly = allreduce_row(2, 4000, "butterfly", 5.0, rounds=[5.0, 5.0])
    winner, tied = findings.lowest_p50([ring, halving, tree, butterfly])
    assert winner is tree and tied == [halving, butterfly]
    assert findings.lowest_p50([ring, tree]) == (tree, [])


def syncbn_time(impl, transport, batch, seconds, **fields):
    return {"kind": "time", "setting": "workers", "dtype": "float32", "impl": impl, "transport": transport,
            "batch": batch, "hidden": 128, "time_s": seconds, **fields}


def test_syncbn_extra_is_the_median_time_ours_adds_to_the_reference_on_one_transport():
    ref = findings.SYNCBN_REFERENCE
    doc = {"results": [syncbn_time("ours", "torch", 32, 4.0), syncbn_time(ref, "torch", 32, 3.0),
                       syncbn_time("ours", "torch", 64, 6.0), syncbn_time(ref, "torch", 64, 3.0),
                       syncbn_time("ours", "torch", 128, 9.0),  # no reference at this size: left out
                       syncbn_time("ours", "shared_memory", 32, 1.5), syncbn_time(ref, "shared_memory", 32, 1.0),
                       syncbn_time("ours", "shared_memory", 64, 1.5, dtype="float16"),
                       syncbn_time(ref, "shared_memory", 64, 0.1, dtype="float16")]}
    assert findings.syncbn_extra(doc, "torch") == {"extra_s": 2.0, "reference_s": 3.0, "sizes": 2}
    # float32 only
    assert findings.syncbn_extra(doc, "shared_memory") == {"extra_s": 0.5, "reference_s": 1.0, "sizes": 1}
    assert findings.syncbn_extra(doc, "nccl") is None


def test_compute_gap_sums_the_compute_phases_outside_the_collectives():
    def phases(impl, transport, before, between, after, wait):
        return {"kind": "phases", "impl": impl, "transport": transport, "batch": 32, "hidden": 128,
                "phases_s": {"compute before": before, "forward all_reduce": wait, "compute between": between,
                             "backward all_reduce": wait, "compute after": after}}

    doc = {"results": [phases("ours", "torch", 2.0, 3.0, 1.0, 9.0),
                       phases(findings.SYNCBN_REFERENCE, "torch", 1.0, 1.0, 0.5, 1.0)]}
    assert findings.compute_gap(doc, 32, 128, "torch") == pytest.approx(3.5)  # 6.0 - 2.5: the waits do not count
    assert findings.compute_gap(doc, 32, 128, "shared_memory") is None
    assert findings.compute_gap(doc, 64, 128, "torch") is None
