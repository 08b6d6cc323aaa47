"""Our DDP in a world of one (nothing divided, no collective called, one copy per gradient), and
ddp_step_profile.py's counts of what each engine adds to a training step.

Everything runs in this process, in a world of one over gloo (no worker is spawned). The oracle of the
DDP cases is the same model trained without DDP: in a world of one the average is the gradient itself,
so every parameter must end bitwise equal. The script's oracle is the engine's design: ours adds
exactly one aten::copy_ per parameter to a step with ``zero_grad(set_to_none=True)``, and nothing else.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import ddp_step_profile
from common import PG_TIMEOUT_S, CountingTransport
from dpkit.bench.results import read_results
from dpkit.comm.process_groups import distributed
from dpkit.engines.ddp import DDP
from dpkit.models import Net

STEPS, ACCUM = 3, 2


class WithUnused(nn.Module):
    """A linear layer and one that forward never reaches (its gradient stays None)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        return self.used(x)


def train(model: nn.Module, set_to_none: bool) -> None:
    """SGD with momentum, ``ACCUM`` micro-batches per step (all but the last inside ``no_sync``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for micro in range(ACCUM):
            x = torch.randn(4, 6, generator=generator)
            context = model.no_sync() if micro < ACCUM - 1 and isinstance(model, DDP) else _nothing()
            with context:
                model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def _world_of_one_cases() -> dict:
    out = {}
    for set_to_none in (True, False):
        for find_unused in (True, False):
            torch.manual_seed(0)
            plain = WithUnused()
            wrapped = copy.deepcopy(plain)
            counting = CountingTransport("torch")
            model = DDP(wrapped, bucket_cap_mb=0.0, find_unused_parameters=find_unused, transport=counting)
            train(plain, set_to_none)
            train(model, set_to_none)
            equal = all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))
            ops = _step_ops(model, plain, set_to_none)  # ends with a synchronised backward: the grads are set
            views = {id(v) for b in model.buckets for v in b.views}
            out[set_to_none, find_unused] = {
                "equal": equal, "ops": ops, "unused_grad": wrapped.unused.weight.grad,
                "collectives": counting.collectives,
                "views": all(id(p.grad) in views for p in wrapped.used.parameters())}
            model.remove_hooks()
    return out


def _step_ops(model: DDP, plain: nn.Module, set_to_none: bool) -> Counter:
    """aten operators of one synchronised backward of ``model`` beyond those of the same backward of ``plain``
    (the same model unwrapped: ``model.module`` would still run DDP's gradient hooks, which are its
    parameters')."""
    def ops(run):
        with torch.profiler.profile() as prof:
            run()
        return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))

    x = torch.randn(4, 6)
    model.zero_grad(set_to_none=set_to_none)
    model(x).square().mean().backward()  # the grads are the bucket views from here on (set_to_none=False)
    model.zero_grad(set_to_none=set_to_none)
    with_ddp = ops(lambda: model(x).square().mean().backward())
    plain.zero_grad(set_to_none=set_to_none)
    plain(x).square().mean().backward()
    plain.zero_grad(set_to_none=set_to_none)
    without = ops(lambda: plain(x).square().mean().backward())
    return with_ddp - without


@pytest.fixture(scope="module")
def world_of_one(monkeypatch_module):
    with distributed("gloo", PG_TIMEOUT_S, "cpu"):
        return _world_of_one_cases()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RANK", raising=False)  # a world of one in this process, even under torchrun
        yield patch


@pytest.mark.parametrize("set_to_none", (True, False))
@pytest.mark.parametrize("find_unused", (True, False))
def test_in_a_world_of_one_ddp_trains_bitwise_like_the_plain_model_and_calls_no_collective(world_of_one, set_to_none,
                                                                                           find_unused):
    case = world_of_one[set_to_none, find_unused]
    assert case["equal"] and case["collectives"] == 0 and case["views"]
    # No rank had a gradient for it: kept None with used-flags; without them the average with zeros is zeros.
    assert case["unused_grad"] is None if find_unused else torch.equal(case["unused_grad"], torch.zeros(3, 6))


@pytest.mark.parametrize("set_to_none", (True, False))
def test_in_a_world_of_one_a_gradient_costs_one_copy_into_its_bucket_or_nothing_and_is_never_divided(world_of_one,
                                                                                                    set_to_none):
    ops = world_of_one[set_to_none, False]["ops"]
    # Without used-flags. set_to_none: the used layer's two fresh gradients copied into their views, the unused
    # layer's two views zeroed at the end of backward; else every gradient already is its view: nothing at all.
    assert ops == (Counter({"aten::copy_": 2, "aten::zero_": 2}) if set_to_none else Counter())


def test_the_profile_counts_one_copy_per_parameter_for_ours_and_writes_the_shared_layout(tmp_path, monkeypatch_module,
                                                                                         capsys):
    path = tmp_path / "profile.json"
    ddp_step_profile.main(["--models", "cnn", "--baseline", "HEAD", "--steps", "1", "--timed-steps", "1",
                           "--rounds", "1", "--warmup", "1", "--batch-size", "2", "--json", str(path)])
    doc = read_results(str(path))
    rows = {r["variant"]: r for r in doc["results"]}
    assert list(rows) == ["no ddp", "ddp pytorch", "ddp pytorch best", "ddp ours@HEAD", "ddp ours"]
    parameters = sum(1 for p in Net().parameters() if p.requires_grad)
    ours = rows["ddp ours"]
    added = (ours["ops_over_no_ddp"], ours["copies_over_no_ddp"], ours["allocations_over_no_ddp"])
    assert added == (parameters,) * 2 + (0,)
    assert ours["collectives"] == 0 and rows["ddp pytorch"]["collectives"] > 0
    assert all(r["step_s"] > 0 for r in rows.values())
    if rows["no ddp"]["hooks_s"] is not None:  # None: this torch's profiler records no Python frames
        assert ours["hooks_s"] > 0 and rows["no ddp"]["hooks_s"] == 0
    assert [t["verdict"] for t in doc["targets"]] == ["met"] and doc["env"]["world_size"] == 1
    assert "ddp ours@HEAD" in capsys.readouterr().out


def test_help_gives_the_defaults(capsys):
    with pytest.raises(SystemExit):
        ddp_step_profile.main(["--help"])
    assert "(default: ['resnet18', 'cnn'])" in capsys.readouterr().out
