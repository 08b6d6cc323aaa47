"""The registry of transports: every name exists as soon as ``resolve`` can be called, whatever was imported
before (a fresh interpreter that imports only the package), and a transport registered from outside the
package is made by name like a built-in one. One subprocess serves both tests: it imports nothing first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common import REPO

# Run in a fresh interpreter, in a world of one process (process_groups.distributed without torchrun).
SCRIPT = """
import json, sys
from dpkit.comm import transport                      # the first import of the package: nothing else before it
out = {"names": list(transport.names()), "root scripts imported": sorted({"allreduce", "syncbn"} & set(sys.modules))}
from dpkit.comm import process_groups, registry


class Toy(transport.Wrapped):
    name = "toy"


registry.register("toy", lambda group, option: Toy(transport.Torch(group)), options=("x",), devices=("cpu",))
with process_groups.distributed("gloo", timeout_s=30.0, device="cpu"):
    made = transport.resolve("toy")
    out["toy"] = [type(made).__name__, type(made.inner).__name__, made.describe()]
    out["made once"] = transport.resolve("toy") is made
    out["with an option"] = type(transport.resolve("toy:x")).__name__
    out["names after"] = [n for n in transport.names() if n.startswith("toy")]
    refusals = {}
    for case, call in {"toy for meta tensors": lambda: transport.resolve("toy", None, "meta"),
                       "torch again": lambda: registry.register("torch", lambda group, option: None),
                       "auto": lambda: registry.register("auto", lambda group, option: None),
                       "a colon": lambda: registry.register("a:b", lambda group, option: None)}.items():
        try:
            call()
            refusals[case] = None
        except ValueError as error:
            refusals[case] = str(error)
    out["refusals"] = refusals
    x = made.allocate(3, dtype=__import__("torch").float32).fill_(2.0)
    made.all_reduce(x)
    out["sum of one rank"] = x.tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_built_in_name_exists_at_the_first_import_of_the_package_whatever_was_imported_before(fresh):
    assert fresh["root scripts imported"] == [], "the package must not import a script at the root"
    assert fresh["names"] == ["auto", "torch", "torch:dpkit", "shared_memory", "shared_memory:thread",
                              "shared_memory:staged", "hierarchical", "p2p", "p2p:ring", "p2p:butterfly",
                              "p2p:halving_doubling", "p2p:recursive_doubling", "p2p:tree"]


def test_a_transport_registered_from_outside_is_made_by_name_once_per_group_and_refused_where_it_cannot_serve(fresh):
    assert fresh["toy"] == ["Toy", "Torch", "toy torch (gloo)"]
    assert fresh["made once"] and fresh["with an option"] == "Toy"
    assert fresh["names after"] == ["toy", "toy:x"]
    assert fresh["sum of one rank"] == [2.0, 2.0, 2.0]
    assert fresh["refusals"] == {
        "toy for meta tensors": "this engine: transport 'toy' takes CPU tensors, not meta ones: use 'torch' (NCCL) "
                                "or 'auto'",
        "torch again": "cannot register 'torch': a built-in name, or one with a ':'",
        "auto": "cannot register 'auto': a built-in name, or one with a ':'",
        "a colon": "cannot register 'a:b': a built-in name, or one with a ':'"}
