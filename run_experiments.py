"""Regenerate every result file the report reads, then re-execute the report.

    python run_experiments.py --quick --report    # every experiment, small settings (README gives the time per CPU)
    python run_experiments.py --report            # the full settings (the homework solution's 16-epoch run,
                                                  # messages up to 100 MB, ...): for GPU machines
    python run_experiments.py --quick --only syncbn allreduce
    python run_experiments.py --list              # what would run, and the exact commands
    python run_experiments.py --summary           # rewrite README.md's generated blocks from results/
    python run_experiments.py --suite             # time `python -m pytest` and `-m slow` into results/suite.json

Each experiment is one command of this repository's own scripts, run as a subprocess with
a time limit; its JSON (the shared layout of ``results.write_results``) goes to
``--out`` (default ``results/``), its console output to ``<out>/logs/<name>.log``. A failing
experiment does not stop the others; the run exits non-zero and names it. ``--report``
then executes ``report.ipynb`` top to bottom in place (it only reads ``<out>``), so the
committed notebook always shows the committed results. ``<out>/manifest.json`` records
what ran, how long it took and how it ended.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dpkit.bench.results import (environment, format_environment, markdown_table, read_results,
                                 write_durably, write_results)
from dpkit.report import backend_lines, summary

REPO = Path(__file__).resolve().parent
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")
# How long one experiment may run before it is killed: a guard against a hung run (every benchmark's process
# groups time out far sooner), not a budget. The quick collectives experiment times fixed-length batches of calls
# on every axis at 2 and 4 ranks, and the calls of its large sizes take longer on a slower CPU: the quick guard
# leaves it room on the slower CPU (results/manifest.json has each experiment's time and CPU).
QUICK_TIMEOUT_S, FULL_TIMEOUT_S = 1800.0, 86400.0


@dataclass(frozen=True)
class Experiment:
    name: str
    what: str
    quick: tuple[str, ...]  # arguments after the launcher, in quick mode
    full: tuple[str, ...]
    nproc: int = 0  # 0: plain python (the script spawns its own workers); N: torchrun with N processes

    def command(self, quick: bool, out: Path) -> list[str]:
        """The command, run from the repository root; ``out`` is shown relative to it where it lies inside."""
        where = os.path.relpath(out, REPO) if out.is_relative_to(REPO) else str(out)
        args = [a.format(out=where) for a in (self.quick if quick else self.full)]
        launcher = [*TORCHRUN, f"--nproc_per_node={self.nproc}"] if self.nproc else [sys.executable]
        return [*launcher, *args]


# Quick training: the homework solution's hyper-parameters on a small synthetic set, 2 micro-batches per step instead
# of its 4 (the full run keeps 4): 96 optimizer steps in 3 epochs of 8192 images, as many as 16384 images at 4
# would take, in half the time. Fewer steps leave the curve flat (48 steps, 8192 images at 4: 3.6 % accuracy).
_QUICK_TRAIN = ("--dataset", "synthetic", "--train-size", "8192", "--val-size", "2048", "--num-epochs", "3",
                "--grad-accum-steps", "2")
_FULL_TRAIN = ("--num-epochs", "16", "--grad-accum-steps", "4")

# The GPT at its default size: the engine on one transport (ours / PyTorch's DDP, ZeRO / DDP, all on shared
# memory) and the transport under one engine (fully_shard on shared memory, and on a "dpkit" process group, / on
# gloo: its target is for this size).
SHARDING_GPT_VARIANTS = ("ddp ours [shared_memory]", "ddp pytorch [shared_memory]", "zero1 ours [shared_memory]",
                         "fsdp pytorch [torch]", "fsdp pytorch [shared_memory]", "fsdp pytorch [torch:dpkit]",
                         "fsdp ours [torch]", "fsdp ours [shared_memory]")

EXPERIMENTS = (
    Experiment("syncbn_tests", "SyncBatchNorm against BatchNorm on the global batch (the homework grid)",
               ("-m", "pytest", "tests/test_syncbn.py", "-q", "-p", "no:cacheprovider",
                "--junitxml={out}/syncbn_tests.xml"),
               ("-m", "pytest", "tests/test_syncbn.py", "-q", "-p", "no:cacheprovider",
                "--junitxml={out}/syncbn_tests.xml")),
    Experiment("syncbn", "SyncBatchNorm time and memory, ours vs PyTorch",
               ("syncbn_benchmark.py", "--quick", "--json", "{out}/syncbn.json"),
               ("syncbn_benchmark.py", "--json", "{out}/syncbn.json")),
    Experiment("train_ours", "CIFAR-100 training, our DDP + SyncBatchNorm",
               ("ddp_cifar100.py", "--impl", "ours", *_QUICK_TRAIN,
                "--metrics-json", "{out}/train_ours.json"),
               ("ddp_cifar100.py", "--impl", "ours", *_FULL_TRAIN,
                "--metrics-json", "{out}/train_ours.json"),
               nproc=2),
    Experiment("train_pytorch", "CIFAR-100 training, PyTorch's DDP (+ its SyncBatchNorm on GPU)",
               ("ddp_cifar100.py", "--impl", "pytorch", *_QUICK_TRAIN,
                "--metrics-json", "{out}/train_pytorch.json"),
               ("ddp_cifar100.py", "--impl", "pytorch", *_FULL_TRAIN,
                "--metrics-json", "{out}/train_pytorch.json"),
               nproc=2),
    Experiment("allreduce", "every all-reduce and auto vs torch.distributed.all_reduce (homework Task 4)",
               ("allreduce.py", "--quick", "--world-sizes", "1", "2", "4", "8", "--sizes", "1000", "10000", "100000",
                "--json", "{out}/allreduce.json"),
               ("allreduce.py", "--json", "{out}/allreduce.json")),
    Experiment("collectives", "all-reduce bandwidth sweep (seed 001, nccl-tests conventions); torch.distributed's "
               "collectives on the backend \"dpkit\" against gloo, and its latency floor",
               ("collectives_benchmark.py", "--quick", "--axis", "all", "--sizes", "4000", "64KB", "1MB", "10MB",
                "100MB", "--json", "{out}/collectives.json", "--plot-dir", "{out}/plots"),
               ("collectives_benchmark.py", "--axis", "all", "--json", "{out}/collectives.json",
                "--plot-dir", "{out}/plots")),
    Experiment("reduce_scatter", "ring reduce-scatter vs torch's reduce_scatter_single (sharded data parallelism)",
               ("collectives_benchmark.py", "--collective", "reduce_scatter", "--procs", "2", "--sizes", "10MB",
                "100MB", "--iters", "20", "--json", "{out}/reduce_scatter.json"),
               ("collectives_benchmark.py", "--collective", "reduce_scatter", "--json", "{out}/reduce_scatter.json")),
    Experiment("all_gather", "ring all-gather vs torch's all_gather_single (sharded data parallelism)",
               ("collectives_benchmark.py", "--collective", "all_gather", "--procs", "2", "--sizes", "10MB", "100MB",
                "--iters", "20", "--json", "{out}/all_gather.json"),
               ("collectives_benchmark.py", "--collective", "all_gather", "--json", "{out}/all_gather.json")),
    Experiment("ddp_benchmark", "iteration time of every DDP variant and bucket size (seeds 002 and 004)",
               ("ddp_benchmark.py", "--bucket-sizes", "1", "25", "100", "--batch-size", "16", "--iters", "12",
                "--rounds", "6", "--warmup", "1", "--json", "{out}/ddp_benchmark.json"),
               ("ddp_benchmark.py", "--json", "{out}/ddp_benchmark.json"), nproc=2),
    Experiment("ddp_headline", "our DDP (ddp ours) against PyTorch's on each transport (gloo, shared memory), the "
               "transports under each engine (PyTorch's DDP on a \"dpkit\" process group too), and a communication "
               "thread against summing in the backward hook; "
               "resnet18, many rounds (the targets; ddp ours naive for the exposed wait)",
               ("ddp_benchmark.py", "--models", "resnet18", "--variants", "ddp pytorch", "ddp pytorch best", "ddp ours",
                "ddp ours naive", "--transports", "torch", "shared_memory", "shared_memory:thread", "torch:dpkit",
                "--bucket-sizes", "25",
                "--batch-size", "16", "--iters", "60", "--rounds", "15", "--warmup", "1", "--no-breakdown",
                "--json", "{out}/ddp_headline.json"),
               ("ddp_benchmark.py", "--models", "resnet18", "--variants", "ddp pytorch", "ddp pytorch best", "ddp ours",
                "ddp ours naive", "--transports", "torch", "shared_memory", "shared_memory:thread", "torch:dpkit",
                "--bucket-sizes", "25",
                "--iters", "320", "--rounds", "80", "--no-breakdown", "--json", "{out}/ddp_headline.json"), nproc=2),
    Experiment("ddp_traces", "Chrome traces of one resnet18 iteration per variant, for the overlap timeline",
               ("ddp_benchmark.py", "--models", "resnet18", "--variants", "ddp pytorch best", "ddp ours",
                "--transports", "torch", "shared_memory", "shared_memory:thread", "--bucket-sizes", "25",
                "--batch-size", "16",
                "--iters", "2", "--rounds", "1", "--warmup", "2", "--no-breakdown", "--profile", "{out}/traces",
                "--trim-traces"),
               ("ddp_benchmark.py", "--models", "resnet18", "--variants", "ddp pytorch best", "ddp ours",
                "--transports", "torch", "shared_memory", "shared_memory:thread", "--bucket-sizes", "25",
                "--iters", "2", "--rounds", "1",
                "--no-breakdown", "--profile", "{out}/traces", "--trim-traces"), nproc=2),
    Experiment("ddp_sweep", "DDP world-size sweep with the no-DDP row (seed 004's rows)",
               ("ddp_benchmark.py", "sweep", "--world-sizes", "1", "2", "4", "--models", "resnet18", "--variants",
                "ddp pytorch", "ddp ours", "--bucket-sizes", "25", "--batch-size", "16", "--iters", "6",
                "--rounds", "2", "--warmup", "1", "--json", "{out}/ddp_sweep.json"),
               ("ddp_benchmark.py", "sweep", "--world-sizes", "1", "2", "4", "--json", "{out}/ddp_sweep.json")),
    Experiment("sharding", "sharded data parallelism: DDP, ZeRO and FSDP, ours and PyTorch's, time and per-rank "
               "memory at 1, 2, 4 ranks",
               ("sharding_benchmark.py", "--quick", "--json", "{out}/sharding.json"),
               ("sharding_benchmark.py", "--json", "{out}/sharding.json")),
    Experiment("sharding_resnet18", "the same on resnet18 at 2 ranks, more rounds (ZeRO against DDP on a "
               "convolutional model)",
               ("sharding_benchmark.py", "--quick", "--models", "resnet18", "--procs", "2", "--iters", "12",
                "--rounds", "6", "--json", "{out}/sharding_resnet18.json"),
               ("sharding_benchmark.py", "--models", "resnet18", "--procs", "2", "--iters", "96", "--rounds", "24",
                "--json", "{out}/sharding_resnet18.json")),
    Experiment("sharding_gpt", "the GPT at its default size (the quick sweep's is a toy) at 2 ranks: DDP and ZeRO, "
               "ours and PyTorch's DDP on shared memory; FSDP, ours and fully_shard, each on shared memory and on "
               "gloo (fully_shard also on a \"dpkit\" process group)",
               ("sharding_benchmark.py", "--models", "gpt", "--procs", "2", "--variants", *SHARDING_GPT_VARIANTS,
                "--iters", "30", "--rounds", "15", "--warmup", "2", "--json", "{out}/sharding_gpt.json"),
               ("sharding_benchmark.py", "--models", "gpt", "--procs", "2", "--variants", *SHARDING_GPT_VARIANTS,
                "--iters", "120", "--rounds", "40", "--json", "{out}/sharding_gpt.json")),
    Experiment("multihost", "beyond one host: 2 simulated hosts of 2 ranks (oversubscribed), hierarchical all-reduce, "
               "DDP, ZeRO 1 and 2, FSDP and HSDP measured beside a two-link model, and the model of a cluster",
               ("multihost_benchmark.py", "--quick", "--memory-link", "{out}/collectives.json",
                "--json", "{out}/multihost.json"),
               ("multihost_benchmark.py", "--hosts", "2", "2", "2", "--memory-link", "{out}/collectives.json", "--json",
                "{out}/multihost.json")),
)
NAMES = tuple(e.name for e in EXPERIMENTS)


def shown(command: list[str]) -> str:
    """The command as a reader would type it: ``python`` for this interpreter, no absolute path of this machine."""
    return shlex.join(["python" if command[0] == sys.executable else command[0], *command[1:]])  # quoted names


def rounds_of(path: Path) -> int | None:
    """The independent rounds (or repeats) the experiment's results file says it measured, if any."""
    try:
        config = read_results(str(path))["config"]
    except (OSError, ValueError, KeyError):
        return None
    return config.get("rounds", config.get("repeats"))


def run_one(command: list[str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    """Run ``command`` from the repository root, its output both on the console and in ``log_path``.

    Returns (exit code, seconds). Past ``timeout_s`` the command's whole process group
    (torchrun and its workers, or spawned workers) is killed and the code is -9.
    """
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {shown(command)}\n")
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True,
                                   env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                        "TQDM_MININTERVAL": "10"})
        try:
            for line in _lines_until(process, start + timeout_s):
                sys.stdout.write(line)
                log.write(line)
            return process.wait(), time.monotonic() - start
        except BaseException:  # timeout or Ctrl-C: nothing this run started may outlive it
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        finally:
            sys.stdout.flush()


class ExperimentTimeout(Exception):
    pass


def _lines_until(process: subprocess.Popen, deadline: float):
    """The process's output lines; raises ExperimentTimeout once ``deadline`` (monotonic) passes."""
    def alarm(*_):
        raise ExperimentTimeout()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, deadline - time.monotonic()))
    try:
        yield from process.stdout
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def execute_report(out: Path, timeout_s: float) -> None:
    """Run report.ipynb top to bottom on ``out`` and save it with its outputs."""
    import nbformat
    from nbclient import NotebookClient

    path = REPO / "report.ipynb"
    notebook = nbformat.read(path, as_version=4)
    os.environ["REPORT_RESULTS"] = str(out.resolve())
    NotebookClient(notebook, timeout=int(timeout_s), kernel_name="python3",
                   resources={"metadata": {"path": str(REPO)}}).execute()
    text = nbformat.writes(notebook)
    write_durably(str(path), lambda f: f.write((text if text.endswith("\n") else text + "\n").encode()))


# The test suite's two commands (README's, and CI's slow run), timed by --suite.
SUITE = (("-m", "pytest", "-q", "-p", "no:cacheprovider"),
         ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow"))


def outcome(log_path: Path) -> str:
    """pytest's closing summary ("2177 passed, 36 skipped in ..."), without its time, from the log."""
    lines = [line.strip(" =\n") for line in log_path.read_text().splitlines() if " in " in line and (
        "passed" in line or "failed" in line or "error" in line)]
    return lines[-1].rsplit(" in ", 1)[0] if lines else "no pytest summary line"


def time_suite(out: Path, timeout_s: float) -> int:
    """Run the test suite's commands one after the other and write their times, exit codes and outcomes, with
    this machine's environment, to ``<out>/suite.json``: the source of the suite's time in README."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env, rows = environment("-", "cpu", 1), []
    for i, args in enumerate(SUITE):
        command, log = [sys.executable, *args], out / "logs" / f"suite_{i}.log"
        try:
            code, seconds = run_one(command, log, timeout_s)
        except ExperimentTimeout:
            code, seconds = -9, timeout_s
        rows.append({"command": shown(command).replace(" -q -p no:cacheprovider", ""), "exit_code": code,
                     "seconds": seconds, "outcome": outcome(log) if code != -9 else f"killed after {timeout_s:g} s"})
    write_results(str(out / "suite.json"), "run_experiments --suite", env,
                  {"commands": [shown([sys.executable, *a]) for a in SUITE]}, rows)
    print("\n" + markdown_table(rows, [("command", "command", "s"), ("seconds", "seconds", ".0f"),
                                       ("outcome", "outcome", "s")]))
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small settings: minutes, not hours (README gives the time per CPU) (default: off)")
    parser.add_argument("--only", nargs="+", choices=NAMES, default=list(NAMES), metavar="NAME",
                        help=f"run only these experiments, of: {', '.join(NAMES)} (default: all)")
    parser.add_argument("--out", type=Path, default=REPO / "results", help="where results go (default: results/)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds one experiment may take before it is killed (default: "
                             f"{QUICK_TIMEOUT_S:g} with --quick, else {FULL_TIMEOUT_S:g})")
    parser.add_argument("--report", action="store_true",
                        help="then execute report.ipynb in place on --out (default: off)")
    parser.add_argument("--list", action="store_true", help="print the experiments and their commands, run nothing")
    parser.add_argument("--summary", action="store_true",
                        help="run nothing: render README.md's generated blocks (the headline results, the "
                             "backend's) from --out (also done after every "
                             "successful --report run) (default: off)")
    parser.add_argument("--suite", action="store_true",
                        help="run no experiment: time `python -m pytest` and `python -m pytest -m slow` and write "
                             "<out>/suite.json, the source of the suite's time in README (default: off)")
    args = parser.parse_args(argv)
    if args.timeout is None:
        args.timeout = QUICK_TIMEOUT_S if args.quick else FULL_TIMEOUT_S
    return args


def main(args: argparse.Namespace) -> int:
    chosen = [e for e in EXPERIMENTS if e.name in args.only]
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    if args.list:
        for e in chosen:
            print(f"{e.name}: {e.what}\n    {shown(e.command(args.quick, out))}")
        return 0
    if args.summary:
        return write_summary(out)
    if args.suite:
        return time_suite(out, args.timeout)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = environment("-", "cpu", 1)
    print(format_environment(env), flush=True)
    rows = []
    for i, experiment in enumerate(chosen, 1):
        command = experiment.command(args.quick, out)
        print(f"\n=== [{i}/{len(chosen)}] {experiment.name}: {experiment.what}\n$ {shown(command)}", flush=True)
        try:
            code, seconds = run_one(command, out / "logs" / f"{experiment.name}.log", args.timeout)
            status = "ok" if code == 0 else f"failed (exit code {code})"
        except ExperimentTimeout:
            code, seconds, status = -9, args.timeout, f"killed after {args.timeout:g} s"
        rows.append({"experiment": experiment.name, "status": status, "seconds": seconds,
                     "command": shown(command), "rounds": rounds_of(out / f"{experiment.name}.json"),
                     "device_model": env["device_model"], "git_commit": env["git_commit"]})
        print(f"=== {experiment.name}: {status} in {seconds:.0f} s", flush=True)
    write_results(str(out / "manifest.json"), "run_experiments", env, {"quick": args.quick, "only": args.only},
                  sorted(kept_rows(out / "manifest.json", args.quick, rows) + rows,
                         key=lambda r: NAMES.index(r["experiment"])))
    print("\n" + markdown_table(rows, [("experiment", "experiment", "s"), ("status", "status", "s"),
                                       ("seconds", "seconds", ".0f")]))
    failed = [r["experiment"] for r in rows if r["status"] != "ok"]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}; see {out / 'logs'}", file=sys.stderr)
        return 1
    if args.report:
        start = time.monotonic()
        execute_report(out, args.timeout)
        print(f"report.ipynb executed on {out} in {time.monotonic() - start:.0f} s")
        return write_summary(out)
    return 0


def kept_rows(manifest: Path, quick: bool, rows: list[dict]) -> list[dict]:
    """The rows of an earlier manifest at the same settings for the experiments this run did not repeat (``--only``
    reruns some and keeps the others' record), each with the machine and commit it ran on; none where the
    settings differ, since the results files of other settings were overwritten or are not this run's."""
    try:
        old = read_results(str(manifest))
    except (OSError, ValueError):
        return []
    if old.get("config", {}).get("quick") != quick:
        return []
    ran = {r["experiment"] for r in rows}
    machine = {"device_model": old["env"].get("device_model"), "git_commit": old["env"].get("git_commit")}
    return [{**machine, **r} for r in old["results"] if r["experiment"] not in ran and r["experiment"] in NAMES]


def producers() -> dict[str, str]:
    """For each result file, the command that writes it (named when --summary finds it missing)."""
    # One per results/<name>.json.
    commands = {e.name: f"python run_experiments.py --quick --only {e.name}" for e in EXPERIMENTS}
    return commands | {"manifest": "python run_experiments.py --quick"}


def write_summary(out: Path) -> int:
    """Render README.md's generated blocks (the headline results, the backend's) from ``out``; 1 (and the reason)
    when a result file is missing."""
    try:
        block = summary.render(out, producers())
    except summary.MissingResults as missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    changed = [summary.update_readme(REPO / "README.md", block)]
    missing = [name for name in backend_lines.FILES if not (out / f"{name}.json").exists()]
    if missing:  # files no experiment writes (README gives their commands): kept as they are elsewhere
        backend = f"README.md's backend block left as it is: {out} has no {', '.join(missing)}"
    else:
        backend = backend_lines.render(out)
        changed.append(summary.update_readme(REPO / "README.md", backend, (backend_lines.BEGIN, backend_lines.END)))
    print(block + "\n\n" + backend + f"\n\nREADME.md {'updated' if any(changed) else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
