"""PyTorch's own distributed test base, run on gloo and on "dpkit" with gloo's skip decisions.

    python tests/pytorch_suite.py                          # both backends, every test: results/pytorch_suite.json
    python tests/pytorch_suite.py --backends gloo          # one backend: the other's rows in the file are kept
    python tests/pytorch_suite.py --backends dpkit -k '^test_all_reduce_sum$' --out /tmp/one.json   # one test
    python tests/pytorch_suite.py --list                   # the test names, nothing run

``torch/testing/_internal/distributed/distributed_test.py`` ships in torch's wheel; its ``_DistTestBase`` is what
``test/distributed/test_distributed_spawn.py`` runs for each backend (env ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR``).
Here it runs with ``BACKEND=gloo`` (so every skip is gloo's) twice: as it is, and with every process group the
tests make created on "dpkit" instead (``_new_process_group_helper``, through which ``init_process_group``,
``new_group`` and device meshes all pass, is handed "dpkit" where it was handed "gloo"). Each test spawns its
ranks afresh; a test's outcome is pass, fail, error or skip, as unittest says. The JSON (the shared layout) holds
each test's outcome on each backend and, as its target, gloo parity with the counts; README's section on the
backend quotes them, and tests/test_pytorch_suite.py holds the committed file to them.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

SUITE_BACKEND = "DPKIT_SUITE_BACKEND"  # which backend the tests' groups are made on: gloo or dpkit
WORLD_SIZE = 2
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: the package beside tests/


def redirect_to_dpkit() -> None:
    """Every process group the tests make, made on "dpkit" where they ask for gloo (in this process and, since
    the test module is imported again there, in every rank it spawns)."""
    import torch.distributed.distributed_c10d as c10d

    import dpkit  # noqa: F401  (registers the backend)
    helper = c10d._new_process_group_helper
    signature = inspect.signature(helper)

    def on_dpkit(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        name = str(bound.arguments["backend"])
        bound.arguments["backend"] = ",".join(
            part.replace("gloo", "dpkit") if part.split(":")[-1] == "gloo" else part for part in name.split(","))
        return helper(*bound.args, **bound.kwargs)
    c10d._new_process_group_helper = on_dpkit


if os.environ.get(SUITE_BACKEND):  # the suite's own process and every rank it spawns (which unpickle the class)
    if os.environ[SUITE_BACKEND] == "dpkit":
        redirect_to_dpkit()
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """The test case class ``test_distributed_spawn.py`` builds for gloo."""

        def setUp(self):
            super().setUp()
            self._spawn_processes()


class Outcomes(unittest.TextTestResult):
    """unittest's result, keeping one outcome per test name: a line per test on stdout, and the outcomes so far in
    ``OUTCOMES_FILE`` after each test (an interrupted run keeps what it finished)."""

    total = 0
    path = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}
        self._started = 0.0

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def _keep(self, test, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        seconds = round(time.monotonic() - self._started, 2)
        self.outcomes[name] = {"outcome": outcome, "seconds": seconds, "detail": detail[-2000:]}
        print(f"[{len(self.outcomes)}/{self.total}] {outcome:5} {name} ({seconds:.1f} s)", flush=True)
        Path(self.path).write_text(json.dumps(self.outcomes, indent=1, sort_keys=True))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._keep(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._keep(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._keep(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._keep(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._keep(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._keep(test, "fail", "unexpected success")


def names(patterns: list[str]) -> list[str]:
    """The test names of the base, those any of ``patterns`` (regular expressions) finds in (all when none)."""
    found = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    return [n for n in found if not patterns or any(re.search(p, n) for p in patterns)]


def run_one_backend(patterns: list[str], out: str) -> None:
    """In a process whose env names the backend: run the chosen tests, write {name: outcome} to ``out``."""
    chosen = names(patterns)
    Outcomes.total, Outcomes.path = len(chosen), out
    runner = unittest.TextTestRunner(resultclass=Outcomes, verbosity=0, stream=sys.stderr)
    runner.run(unittest.TestSuite(TestDistBackendWithSpawn(n) for n in chosen))


def suite_env(backend: str, temp: str) -> dict:
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE=str(WORLD_SIZE), TEMP_DIR=temp, **{SUITE_BACKEND: backend})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return env


def run_backend(backend: str, patterns: list[str], timeout_s: float, log: Path) -> dict:
    """Every chosen test on ``backend``, in a subprocess (the test base reads its env at import); the ranks'
    own output goes to ``log``."""
    with tempfile.TemporaryDirectory() as temp, open(log, "w") as stderr:
        out = os.path.join(temp, "outcomes.json")
        command = [sys.executable, __file__, "--one", "--out", out, *[a for p in patterns for a in ("-k", p)]]
        print(f"{backend}: the ranks' output goes to {log}", flush=True)
        suite = subprocess.Popen(command, env=suite_env(backend, temp), stderr=stderr, start_new_session=True)
        try:
            suite.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"{backend}: stopped after {timeout_s:g} s; keeping the tests it finished", flush=True)
        finally:  # the suite and every rank it spawned (they share its session)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(suite.pid, signal.SIGKILL)
            suite.wait()
        return json.loads(Path(out).read_text()) if os.path.exists(out) else {}


def counts(outcomes: dict) -> dict:
    return {k: sum(o["outcome"] == k for o in outcomes.values()) for k in ("pass", "fail", "error", "skip")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["gloo", "dpkit"], choices=["gloo", "dpkit"],
                        help="the backends whose groups the tests make (default: gloo dpkit)")
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run only tests in whose name this regular expression is found (repeatable; "
                             "'name$' for one test; default: every test)")
    parser.add_argument("--out", default=str(REPO / "results" / "pytorch_suite.json"),
                        help="the JSON to write (default: results/pytorch_suite.json)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds one backend's run may take (default: 3600)")
    parser.add_argument("--list", action="store_true", help="print the test names and run nothing")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # inside one backend's process
    args = parser.parse_args()
    if args.one:
        print("\n".join(names(args.patterns))) if args.list else run_one_backend(args.patterns, args.out)
        return
    from dpkit.bench.results import environment, format_environment, write_results
    env = environment(",".join(args.backends), "cpu", WORLD_SIZE)
    print(format_environment(env), flush=True)
    if args.list:
        listing = [sys.executable, __file__, "--one", "--list", *[a for p in args.patterns for a in ("-k", p)]]
        subprocess.run(listing, env=suite_env("gloo", tempfile.gettempdir()), check=True)
        return
    rows, runs = kept_rows(args.out, args.backends, args.patterns)
    for backend in args.backends:
        started = time.monotonic()
        outcomes = run_backend(backend, args.patterns, args.timeout, Path(args.out).with_suffix(f".{backend}.log"))
        rows += [{"backend": backend, "test": name, "torch": torch_version(), **o} for name, o in outcomes.items()]
        seconds = time.monotonic() - started
        runs[backend] = {"commit": env["git_commit"], "time": env["time"], "seconds": round(seconds, 1)}
        print(f"{backend}: {counts(outcomes)} in {seconds:.0f} s", flush=True)
    config = {"world_size": WORLD_SIZE, "patterns": args.patterns, "redirected": "gloo -> dpkit", "runs": runs}
    rows.sort(key=lambda r: (r["backend"], r["test"]))
    write_results(args.out, "pytorch_suite", env, config, rows, targets=[parity(rows)])
    print(f"{parity(rows)['verdict']}: {parity(rows)['target']}\nwrote {args.out}")


def torch_version() -> str:
    import torch
    return torch.__version__


def kept_rows(path: str, rerun: list[str], patterns: list[str]) -> tuple[list[dict], dict[str, dict]]:
    """The rows of the backends not run now, from an earlier run of the same tests on this torch (so that one
    backend at a time fills one file), and those backends' runs (commit, time, seconds) as that file records them."""
    from dpkit.bench.results import read_results
    if not os.path.exists(path):
        return [], {}
    doc = read_results(path)
    if doc["config"].get("patterns") != patterns:
        return [], {}
    rows = [r for r in doc["results"] if r["backend"] not in rerun and r.get("torch") == torch_version()]
    kept = {r["backend"] for r in rows}
    return rows, {b: run for b, run in doc["config"].get("runs", {}).items() if b in kept}


def parity(rows: list[dict]) -> dict:
    """The target: every test that passes on gloo passes on dpkit (the counts of each backend beside it)."""
    outcome = {(r["backend"], r["test"]): r["outcome"] for r in rows}
    on_gloo = [t for (b, t), o in outcome.items() if b == "gloo" and o == "pass"]
    missing = sorted(t for t in on_gloo if outcome.get(("dpkit", t)) != "pass")
    counted = {b: counts({t: {"outcome": o} for (bb, t), o in outcome.items() if bb == b}) for b in ("gloo", "dpkit")}
    both = all(counted[b]["pass"] + counted[b]["fail"] + counted[b]["error"] + counted[b]["skip"] for b in counted)
    return {"target": "every test that passes on gloo passes on dpkit", "counts": counted, "not passed": missing,
            "verdict": ("met" if not missing else "missed") if both else "not measured (run both backends)"}


if __name__ == "__main__":
    main()
