"""Real trainers on the backend "dpkit": each script of tests/trainers/ (PyTorch Lightning, Hugging Face accelerate,
plain DDP after pytorch/examples) runs through the real torchrun on 2 CPU processes, once on gloo and once on dpkit.

    pip install -r requirements-trainers.txt
    python -m pytest -m slow tests/test_trainers.py

Both runs must save the same final weights, bit for bit (with two ranks every sum is a + b, whichever rank adds),
and weights that moved from the initial ones. Lightning's metrics logged with ``sync_dist=True`` must be what
``ReduceOp.AVG`` defines, integers as NCCL divides them. A test whose package is missing is skipped, saying so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from common import REPO, run_torchrun

pytestmark = pytest.mark.slow

BACKENDS = ("gloo", "dpkit")
WORLD_SIZE = 2
TIMEOUT_S = 300.0  # one run takes 15 to 30 s on 2 shared cores; importing lightning is most of it
# The scripts are user programs: they import dpkit as an installed package would be found.
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(script, backend)``: the run's folder (initial.pt, final.pt, metrics/) and stdout, run once per
    module; a failed run fails every test that asks for it, with torchrun's output."""
    runs: dict[tuple[str, str], tuple[Path, str] | AssertionError] = {}

    def run(script: str, backend: str) -> tuple[Path, str]:
        if (script, backend) not in runs:
            folder = tmp_path_factory.mktemp(f"{Path(script).stem}_{backend}")
            extra = ["--metrics-dir", str(folder / "metrics")] if script.endswith("lightning_ddp.py") else []
            try:
                result = run_torchrun(script, WORLD_SIZE, "--backend", backend, "--initial", str(folder / "initial.pt"),
                                      *extra, str(folder / "final.pt"), timeout_s=TIMEOUT_S, env=ENV)
                runs[script, backend] = (folder, result.stdout)
            except AssertionError as failure:
                runs[script, backend] = failure
        outcome = runs[script, backend]
        if isinstance(outcome, AssertionError):
            raise AssertionError(f"{backend} run of {script} failed:\n{outcome}")
        return outcome

    return run


def bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor's bytes: equal bytes are equal weights, with no NaN != NaN or -0.0 == 0.0 to hide a difference."""
    return {name: tensor.detach().reshape(-1).view(torch.uint8) for name, tensor in state.items()}


def assert_same_training(script: str, trained) -> None:
    """gloo and dpkit start from the same weights and end at the same ones, bit for bit, which moved."""
    runs = {backend: trained(script, backend) for backend in BACKENDS}
    for backend, (_, stdout) in runs.items():
        # The group really ran on the backend asked for (not a silent fallback to gloo).
        assert f"process group backend: {backend}" in stdout, stdout[-3000:]
    initial, final = ({backend: bits(torch.load(folder / name)) for backend, (folder, _) in runs.items()}
                      for name in ("initial.pt", "final.pt"))
    assert initial["gloo"].keys() == initial["dpkit"].keys() == final["gloo"].keys() == final["dpkit"].keys()
    for name in final["gloo"]:
        assert torch.equal(initial["gloo"][name], initial["dpkit"][name]), f"{script}: {name} starts apart"
        assert torch.equal(final["gloo"][name], final["dpkit"][name]), f"{script}: {name} differs after training"
        assert not torch.equal(final["gloo"][name], initial["gloo"][name]), f"{script}: {name} did not train"


def test_torchrun_ddp_trains_the_same_weights_on_dpkit_as_on_gloo(trained):
    assert_same_training("tests/trainers/torchrun_ddp.py", trained)


def test_accelerate_trains_the_same_weights_on_dpkit_as_on_gloo(trained):
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -r requirements-trainers.txt")
    assert_same_training("tests/trainers/accelerate_ddp.py", trained)
    # accelerate adopts the "dpkit" group made before it, and still names its own CPU backend (README says so)
    _, stdout = trained("tests/trainers/accelerate_ddp.py", "dpkit")
    assert "process group backend: dpkit | accelerate reports backend 'gloo'" in stdout, stdout[-3000:]


def test_lightning_trains_the_same_weights_on_dpkit_as_on_gloo(trained):
    pytest.importorskip("lightning", reason="lightning is not installed: pip install -r requirements-trainers.txt")
    assert_same_training("tests/trainers/lightning_ddp.py", trained)


def expected_synced(logged: list[list[dict]]) -> dict[str, float]:
    """The metrics Lightning must report from each rank's logged values (``logged[rank]``: one dict a step).

    A step's value is the ranks' mean. An epoch's is Lightning's weighted mean: the ranks' AVG of sum(value x batch
    size), over the ranks' AVG of sum(batch size), an int64 tensor, which NCCL's ncclAvg divides as C does: the
    sum divided by the world size, rounded toward zero (the sum is positive, so ``//``). Lightning keeps the values
    in float32, so the count's mean is computed in float32 too, where each operation is exact or rounded once.
    """
    world = len(logged)
    samples = sum(step["batch_size"] for steps in logged for step in steps)
    assert samples % world, "the batch sizes must add up to an odd number, or the integer average's rounding hides"
    expected = {}
    for name in ("loss", "correct"):
        weighted = sum(step[name] * step["batch_size"] for steps in logged for step in steps)
        expected[f"{name}_epoch"] = (torch.tensor(weighted / world, dtype=torch.float32) / (samples // world)).item()
        last = torch.tensor([steps[-1][name] for steps in logged], dtype=torch.float32)
        expected[f"{name}_step"] = (last.sum() / world).item()
    return expected


def test_lightning_syncs_an_integer_count_and_a_float_loss_as_nccl_averages(trained):
    pytest.importorskip("lightning", reason="lightning is not installed: pip install -r requirements-trainers.txt")
    reports = {}
    for backend in BACKENDS:
        folder, _ = trained("tests/trainers/lightning_ddp.py", backend)
        ranks = [json.loads((folder / "metrics" / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
        synced = ranks[0]["synced"]
        assert all(rank["synced"] == synced for rank in ranks), f"{backend}: the ranks disagree on the synced metrics"
        expected = expected_synced([rank["logged"] for rank in ranks])
        # The count's sums are whole numbers in float32 and every division is rounded once: exact.
        assert synced["correct_epoch"] == expected["correct_epoch"], (backend, synced, expected)
        assert synced["correct_step"] == expected["correct_step"], (backend, synced, expected)
        # The loss's float32 sums depend on Lightning's order of addition.
        assert synced["loss_epoch"] == pytest.approx(expected["loss_epoch"], rel=1e-6), (backend, synced, expected)
        assert synced["loss_step"] == pytest.approx(expected["loss_step"], rel=1e-6), (backend, synced, expected)
        reports[backend] = synced
    assert reports["dpkit"] == reports["gloo"]
