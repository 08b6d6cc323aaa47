"""Results: the shared JSON layout and tables; every file we produce is written whole or not at
all, flushed to the disk (results, checkpoints, the executed notebook)."""

import builtins
import errno
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from dpkit.bench import results
from dpkit.bench.results import markdown_table, read_results, write_durably, write_results
from dpkit.train.checkpoint import save_atomically
import run_experiments

FSYNC = os.fsync  # the real one, for tests that patch it


def test_results_round_trip_in_the_shared_layout(tmp_path):
    env = results.environment("gloo", "cpu", 2)
    assert {"torch", "backend", "device", "device_model", "threads", "world_size", "command"} <= env.keys()
    path = tmp_path / "r.json"
    results.write_results(str(path), "demo", env, {"iters": 3}, [{"size": 1, "time_s": 0.5}])
    doc = results.read_results(str(path))
    assert doc["benchmark"] == "demo" and doc["config"] == {"iters": 3}
    assert doc["results"] == [{"size": 1, "time_s": 0.5}]
    path.write_text('{"schema": "other"}')
    with pytest.raises(ValueError, match="not a results file"):
        results.read_results(str(path))


def test_a_stopped_runs_file_is_read_as_incomplete(tmp_path):
    path = tmp_path / "r.json"
    rows = [{"size": 1, "time_s": 0.5}]
    for complete in (True, False):
        results.write_results(str(path), "demo", {}, {}, rows, complete=complete)
        doc = results.read_results(str(path))
        assert doc["complete"] is complete and doc["results"] == rows
        assert results.incomplete_note(doc) == ("" if complete else
                                                "incomplete run: demo was stopped; 1 rows of the configurations it "
                                                "finished, no targets")


def test_markdown_table_formats_and_marks_missing_values():
    table = markdown_table([{"n": 2, "t": 0.5}, {"n": 4}], [("n", "world", "d"), ("t", "time (s)", ".3f")])
    assert table.splitlines() == ["| world | time (s) |", "|-------|----------|", "| 2 | 0.500 |", "| 4 | - |"]


def test_a_file_of_an_older_layout_is_refused_naming_both_layouts(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"schema": "dp-kit-results/0", "benchmark": "demo"}')
    with pytest.raises(ValueError, match=rf"not a results file of layout {results.RESULTS_SCHEMA} "
                                         r"\(it says schema='dp-kit-results/0'\): re-run the command"):
        results.read_results(str(path))


def test_durable_write_flushes_the_file_renames_then_flushes_the_directory(tmp_path, monkeypatch):
    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync",
                        lambda fd: (calls.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}"))), fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", str(b))), replace(a, b)))
    path = tmp_path / "out.bin"
    write_durably(str(path), lambda f: f.write(b"payload"))
    tmp = f"{path}.tmp{os.getpid()}"
    assert calls == [("fsync", tmp), ("replace", str(path)), ("fsync", str(tmp_path))]
    assert path.read_bytes() == b"payload" and os.listdir(tmp_path) == ["out.bin"]


def _no_space(fd):
    raise OSError(errno.ENOSPC, "No space left on device")


def _read_only(file, mode="r", *args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied", str(file))  # what open() raises in a read-only directory


@pytest.mark.parametrize("fault, cause", [("unpicklable", "Can't pickle"), ("disk full", "No space left on device"),
                                          ("read-only", "Permission denied")])
def test_a_failed_durable_write_names_path_and_cause_leaves_no_temporary_file_and_keeps_the_old_file(
        tmp_path, monkeypatch, fault, cause):
    path = tmp_path / "epoch-0001.pt"
    save_atomically({"epoch": 1}, str(path))
    obj = {"epoch": 2}
    if fault == "unpicklable":
        obj["hook"] = lambda: 0
    elif fault == "disk full":
        monkeypatch.setattr(os, "fsync", _no_space)
    else:
        monkeypatch.setattr(builtins, "open", _read_only)
    with pytest.raises(OSError, match=f"could not write {path} .*{cause}") as failure:
        save_atomically(obj, str(path))
    monkeypatch.undo()
    assert "Check the free space and the permissions" in str(failure.value)
    assert os.listdir(tmp_path) == ["epoch-0001.pt"]
    assert torch.load(path, weights_only=True) == {"epoch": 1}


def test_write_results_is_durable_and_an_unserialisable_row_leaves_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    write_results(str(path), "b", {"env": 1}, {}, [{"x": 1.5}])
    assert read_results(str(path))["results"] == [{"x": 1.5}]
    with pytest.raises(TypeError, match="not JSON serialisable: object"):
        write_results(str(path), "b", {"env": 1}, {}, [{"x": object()}])
    assert os.listdir(tmp_path) == ["r.json"] and read_results(str(path))["results"] == [{"x": 1.5}]


def test_write_results_on_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_results(str(path), "b", {}, {}, [{"x": 1}])
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(OSError, match=f"could not write {path} .*No space left on device"):
        write_results(str(path), "b", {}, {}, [{"x": 2}])
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["r.json"] and read_results(str(path))["results"] == [{"x": 1}]


def test_the_executed_notebook_is_written_durably_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
    """execute_report rewrites report.ipynb in place: a full disk must not leave half a notebook."""
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    (tmp_path / "report.ipynb").write_text(nbformat.writes(notebook))
    before = (tmp_path / "report.ipynb").read_bytes()

    class NotebookClient:  # no kernel: the test is about the write, not the execution
        def __init__(self, notebook, **kwargs):
            self.notebook = notebook

        def execute(self):
            self.notebook.cells[0].outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"},
                                                                     execution_count=1)]

    monkeypatch.setattr(run_experiments, "REPO", tmp_path)
    monkeypatch.setattr("nbclient.NotebookClient", NotebookClient)
    monkeypatch.setenv("REPORT_RESULTS", str(tmp_path))
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(OSError, match="could not write .*report.ipynb .*No space left on device"):
        run_experiments.execute_report(tmp_path, timeout_s=10)
    assert os.listdir(tmp_path) == ["report.ipynb"] and (tmp_path / "report.ipynb").read_bytes() == before
    monkeypatch.setattr(os, "fsync", FSYNC)
    run_experiments.execute_report(tmp_path, timeout_s=10)
    executed = nbformat.read(tmp_path / "report.ipynb", as_version=4)
    assert executed.cells[0].outputs[0].data == {"text/plain": "2"} and os.listdir(tmp_path) == ["report.ipynb"]



def test_the_environment_of_a_cpu_run_has_the_gpu_fields_empty_and_a_gpu_header_names_them():
    env = results.environment("gloo", "cpu", 2)
    assert {k: env[k] for k in ("cuda", "nccl", "gpu_memory_bytes", "gpu_capability")} == dict.fromkeys(
        ("cuda", "nccl", "gpu_memory_bytes", "gpu_capability"))
    assert "NCCL" not in results.format_environment(env) and "GiB" not in results.format_environment(env)
    gpu = {**env, "device": "cuda", "device_model": "NVIDIA A100", "cuda": "13.0", "nccl": "2.27.3", "gpus": 8,
           "gpu_memory_bytes": 80 * 2 ** 30}
    header = results.format_environment(gpu).splitlines()
    assert header[0].endswith(", CUDA 13.0, NCCL 2.27.3") and header[1].endswith("(NVIDIA A100, 80 GiB, 8 visible)")


def test_a_rerun_of_some_experiments_keeps_the_others_record_in_the_manifest_with_their_machine(tmp_path):
    env = {"device_model": "Intel Xeon", "git_commit": "aaaa"}
    earlier = [{"experiment": "syncbn", "seconds": 80.0}, {"experiment": "allreduce", "seconds": 30.0},
               {"experiment": "no_longer_an_experiment", "seconds": 1.0}]
    write_results(str(tmp_path / "manifest.json"), "run_experiments", env, {"quick": True}, earlier)
    rerun = [{"experiment": "allreduce", "seconds": 20.0, "device_model": "AMD EPYC", "git_commit": "bbbb"}]

    kept = run_experiments.kept_rows(tmp_path / "manifest.json", True, rerun)

    assert kept == [{"experiment": "syncbn", "seconds": 80.0, "device_model": "Intel Xeon", "git_commit": "aaaa"}]
    assert run_experiments.kept_rows(tmp_path / "manifest.json", False, rerun) == []  # other settings: not kept
    assert run_experiments.kept_rows(tmp_path / "missing.json", True, rerun) == []


def test_a_run_from_changed_code_says_its_commit_is_dirty_but_not_for_what_runs_write(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    for name in ("dpkit/bench/results.py", "syncbn.py", "README.md", "report.ipynb", "results/manifest.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("committed\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "code")
    commit = git("rev-parse", "--short", "HEAD")
    monkeypatch.setattr(results.os.path, "abspath", lambda _: str(tmp_path / "dpkit" / "bench" / "results.py"))
    for written in ("README.md", "report.ipynb", "results/manifest.json"):  # what a run rewrites
        (tmp_path / written).write_text("rendered again\n")
    assert results.git_commit() == commit
    (tmp_path / "syncbn.py").write_text("changed\n")
    assert results.git_commit() == f"{commit}+dirty"


def test_readmes_trainer_run_is_the_committed_junit_file():
    """README's count of the real trainers' run (Lightning, accelerate, torchrun) is the committed file's."""
    repo = Path(__file__).resolve().parents[1]
    suite = ET.parse(repo / "results" / "trainers_tests.xml").getroot().find("testsuite")
    passed = int(suite.get("tests")) - sum(int(suite.get(k)) for k in ("failures", "errors", "skipped"))
    assert f"{passed} of {suite.get('tests')} tests passed" in " ".join((repo / "README.md").read_text().split())

