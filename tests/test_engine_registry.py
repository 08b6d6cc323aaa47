"""The engines' one vocabulary (dpkit.engines.registry): its names, labels and refusals (an old spelling is an
unknown name like any other); committed results files in these names; and a toy engine registered in
one place appearing where engines are compared (the cluster model, the trainer's choices, sharding_benchmark.py's
variants, the memory figure). No process is spawned here: the toy runs in test_sharding_benchmark.py's and
test_ddp_cifar100.py's groups."""

from __future__ import annotations

import pytest

from common import REPO
import ddp_cifar100 as trainer
import run_experiments
import toy_engine
from dpkit.bench import cluster, ddp_step, sharding_variants
from dpkit.bench.results import read_results
from dpkit.engines import registry
from dpkit.report import plots

RESULTS = REPO / "results"


def test_one_name_per_engine_and_stage_with_what_it_shards_and_its_implementations():
    assert registry.names() == ("ddp", "zero1", "zero2", "fsdp", "hsdp")
    assert [registry.get(n).shards for n in registry.names()] == [0, 1, 2, 3, 3] and registry.get("hsdp").hybrid
    assert registry.names("pytorch") == ("ddp", "zero1", "fsdp")
    assert registry.label("zero1", "pytorch") == "ZeRO-1 (PyTorch's)" and registry.label("fsdp") == "FSDP"
    with pytest.raises(ValueError, match="engine 'hsdp' has no 'pytorch' implementation: it has ours"):
        registry.impl("hsdp", "pytorch")
    with pytest.raises(ValueError, match="shards must be 0 to 3 and implementations among"):
        registry.register(registry.Engine("bad", shards=4, label="bad"))


# The spellings of before the names were unified: unknown names now, like any other.
@pytest.mark.parametrize("flag, old, kind, known", [
    ("--engine", "zero", "engine", "ddp, zero1, zero2, fsdp, hsdp"),
    ("--engine", "none", "engine", "ddp, zero1, zero2, fsdp, hsdp"),
    ("--impl", "selfmade", "impl", "ours, pytorch"),
    ("--sync-bn", "selfmade", "sync-bn", "auto, ours, pytorch, none")])
def test_an_old_engine_name_is_an_unknown_name_refused_listing_the_known_ones(flag, old, kind, known, capsys):
    message = f"unknown {kind} '{old}': choose one of {known}"
    if kind != "sync-bn":
        with pytest.raises(ValueError, match=message):
            registry.checked(old, kind)
    with pytest.raises(SystemExit):
        trainer.parse_args([flag, old])
    err = capsys.readouterr().err
    assert message in err and "deprecated" not in err and err.count("error:") == 1


def test_an_unknown_name_lists_the_known_ones_on_the_command_line_too(capsys):
    with pytest.raises(ValueError, match="unknown engine 'zero3': choose one of ddp, zero1, zero2, fsdp, hsdp"):
        registry.checked("zero3", "engine")
    with pytest.raises(SystemExit):
        trainer.parse_args(["--impl", "mine"])
    assert "unknown impl 'mine': choose one of ours, pytorch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trainer.parse_args(["--engine", "zero2", "--impl", "pytorch"])
    assert "--engine zero2 has no 'pytorch' implementation" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the experiment's file before the engines' names were unified
        run_experiments.parse_args(["--only", "train_selfmade"])
    assert "invalid choice: 'train_selfmade'" in capsys.readouterr().err


def test_the_committed_results_files_name_engines_as_the_registry_does():
    ours = read_results(str(RESULTS / "train_ours.json"))
    assert (ours["config"]["impl"], ours["config"]["engine"]) == ("ours", "ddp")
    sharding = read_results(str(RESULTS / "sharding.json"))
    engines = {r["engine"] for r in sharding["results"] if "variant" in r}
    assert engines <= set(registry.names()) and "zero1" in engines
    assert not [t["target"] for t in sharding["targets"] if t["target"].startswith("zero ")]
    ddp = read_results(str(RESULTS / "ddp_benchmark.json"))
    kinds = {(r["engine"], r["impl"], r["option"]) for r in ddp["results"]}
    assert kinds == {(None, None, None), *ddp_step.DDP_FIELDS.values()}
    assert {r["engine"] for r in ddp["results"]} - {None} <= set(registry.names())
    labels = [r["label"] for r in ddp["results"]] + ddp["config"]["variants"] \
        + [t[k] for t in ddp["targets"] for k in ("label", "reference")]
    assert all(x == "no ddp" or x.startswith("ddp ") for x in labels) and "ddp ours 25M [shared_memory]" in labels
    assert ddp["config"]["variants"] == [r["label"] for r in ddp["results"] if r["model"] == "cnn"]


def test_a_registered_engine_appears_wherever_engines_are_compared():
    with toy_engine.registered():
        assert "toy" in cluster.engines()
        c = cluster.Cluster(2, 2, cluster.Link(1e-5, 1e-9), cluster.Link(1e-5, 1e-9))
        assert cluster.communication_seconds("toy", c, 2**20) == cluster.communication_seconds("ddp", c, 2**20)
        assert trainer.parse_args(["--engine", "toy"]).engine == "toy"
        assert sharding_variants.select(["toy ours"]) == ["toy ours [torch]", "toy ours [shared_memory]"]
        row = {"model": "gpt", "variant": "toy ours [shared_memory]", "engine": "toy", "impl": "ours", "option": None,
               "transport": "shared_memory", "world_size": 2,
               "params_bytes": 4, "grads_bytes": 4, "state_bytes": 8, "activation_bytes": 1, "ideal_bytes": 16}
        ax = plots.sharding_memory({"results": [row], "env": {"cpus": 2}}).axes[0]
        (tick,) = [t.get_text() for t in ax.get_xticklabels()]
        assert tick.startswith("toy ours [shared_memory"), tick
    assert "toy" not in cluster.engines()
    with pytest.raises(SystemExit):
        trainer.parse_args(["--engine", "toy"])
