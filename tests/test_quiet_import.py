"""A quiet import: ``import dpkit`` registers the torch.distributed backend and reads no results file; the
transports' "auto" reads its crossover table (results/crossover.json) when it first needs it, once."""

import json
import subprocess
import sys

from common import REPO
from dpkit.bench.results import environment, write_results
from dpkit.comm import message_passing

# Run in a fresh interpreter: argv[1] the repository's results/ folder, argv[2] a crossover file elsewhere.
# Prints, as JSON lines, what was opened or looked at in either after the imports, then after auto's calls.
PROBE = r"""
import json, os, sys
watched, seen = (sys.argv[1], sys.argv[2]), []

def note(kind, path):
    if isinstance(path, str) and os.path.abspath(path).startswith(watched):
        seen.append([kind, os.path.abspath(path)])

sys.addaudithook(lambda event, args: event == "open" and note("open", args[0]))
real_stat = os.stat

def stat(path, *args, **kwargs):  # os.path.exists looks through os.stat, which raises no audit event
    note("stat", path)
    return real_stat(path, *args, **kwargs)

os.stat = stat
import torch
import torch.distributed as dist
import dpkit
import dpkit.comm.transport  # every transport, message passing's "auto" among them
from dpkit.comm import message_passing as mp
print(json.dumps({"seen": seen, "backend": "dpkit" in dist.Backend.backend_list}))

mp.CROSSOVER_FILE = sys.argv[2]  # a test points auto at its own file before the first use
mp.group_rank = lambda group: (0, 2)  # rank 0 of 2 without peers: only auto's choice is made
choices = [mp.auto_algorithm(torch.ones(numel)) for numel in (1, 1 << 20, 2)]  # 4 bytes, 4 MiB, 8 bytes
choices.append(mp.choose_algorithm(8, 2))
print(json.dumps({"seen": seen, "choices": choices, "kept": mp.CROSSOVER is mp.crossover_for("cpu")}))
"""


def test_import_dpkit_reads_no_results_file_and_auto_reads_its_table_at_first_use_once(tmp_path):
    results = REPO / "results"
    assert message_passing.CROSSOVER_FILE == str(results / "crossover.json"), "auto's table is the checkout's"
    table = tmp_path / "crossover.json"
    write_results(str(table), "collectives_benchmark --tune", environment("gloo", "cpu", 2), {},
                  message_passing.crossover_rows({2: ((1024, "tree"), (None, "butterfly"))}))
    probe = subprocess.run([sys.executable, "-c", PROBE, str(results) + "/", str(table)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    imported, used = (json.loads(line) for line in probe.stdout.splitlines()[-2:])
    assert imported["backend"], "import dpkit registers the torch.distributed backend 'dpkit'"
    assert imported["seen"] == [], "importing the package opens or looks at no results file"
    assert used["choices"] == ["tree", "butterfly", "tree", "tree"], "the table of the file auto was pointed at"
    assert used["seen"] == [["stat", str(table)], ["open", str(table)]], "read at auto's first use, once"
    assert used["kept"]
