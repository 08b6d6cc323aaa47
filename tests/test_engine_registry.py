"""The engines' one vocabulary (dpkit.engines.registry): its names, labels and refusals; old spellings read with
a deprecation naming the new one; committed results files read in today's names; and a toy engine registered in
one place appearing where engines are compared (the cluster model, the trainer's choices, sharding_benchmark.py's
variants, the memory figure). No process is spawned here: the toy runs in test_sharding_benchmark.py's and
test_ddp_cifar100.py's groups."""

from __future__ import annotations

import pytest

from common import REPO
import ddp_cifar100 as trainer
import run_experiments
import sharding_benchmark
import toy_engine
from dpkit.bench import cluster
from dpkit.bench.results import current_engine_names as current_names, read_results, results_file
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


@pytest.mark.parametrize("kind, old, new", [("engine", "zero", "zero1"), ("engine", "none", "ddp"),
                                            ("impl", "selfmade", "ours")])
def test_an_old_spelling_is_read_with_a_deprecation_naming_the_new_one(kind, old, new):
    with pytest.warns(FutureWarning, match=f"{kind} '{old}' is now spelled '{new}'"):
        assert registry.canonical(old, kind) == new


def test_an_unknown_name_lists_the_known_ones_on_the_command_line_too(capsys):
    with pytest.raises(ValueError, match="unknown engine 'zero3': choose one of ddp, zero1, zero2, fsdp, hsdp"):
        registry.canonical("zero3", "engine")
    with pytest.raises(SystemExit):
        trainer.parse_args(["--distributed-impl", "mine"])
    assert "unknown impl 'mine': choose one of ours, pytorch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trainer.parse_args(["--sharding", "zero2", "--distributed-impl", "pytorch"])
    assert "--sharding zero2 has no 'pytorch' implementation" in capsys.readouterr().err
    args = trainer.parse_args(["--sharding", "zero", "--sync-bn", "selfmade"])
    assert (args.sharding, args.sync_bn, args.distributed_impl) == ("zero1", "ours", "ours")
    err = capsys.readouterr().err
    assert "deprecated: engine 'zero' is now spelled 'zero1'" in err and "sync-bn 'selfmade'" in err


def test_old_labels_are_respelled_word_by_word_and_nothing_else():
    assert registry.current_label("zero ours [shm, zero copy] / zero pytorch [torch]") == \
        "zero1 ours [shm, zero copy] / zero1 pytorch [torch]"
    for same in ("zero2 ours [shm]", "shared_memory (zero copy)", "zero_copy", "zero-copy", "ours", "bucketed 25M"):
        assert registry.current_label(same) == same
    assert registry.current_label("selfmade") == "ours"
    doc = {"config": {"sharding": "none", "variants": ["zero ours [shm]"], "sync_bn": "none"},
           "results": [{"variant": "zero ours [shm]", "sharding": "zero", "label": "zero copy"}]}
    assert current_names(doc) == {"config": {"sharding": "ddp", "variants": ["zero1 ours [shm]"], "sync_bn": "none"},
                                  "results": [{"variant": "zero1 ours [shm]", "sharding": "zero1",
                                               "label": "zero copy"}]}


def test_a_checkpoint_identity_of_the_old_spellings_is_todays():
    """What Checkpoints compares before resuming: a run started as --distributed-impl selfmade --sharding none
    resumes as ours / ddp."""
    old = {"distributed_impl": "selfmade", "sharding": "none", "sync_bn": "none", "lr": 0.01, "model": "cnn"}
    assert {k: registry.current_field(k, v) for k, v in old.items()} == {
        "distributed_impl": "ours", "sharding": "ddp", "sync_bn": "none", "lr": 0.01, "model": "cnn"}


def test_committed_files_written_with_the_old_names_are_read_in_todays(capsys):
    assert run_experiments.parse_args(["--only", "train_selfmade"]).only == ["train_ours"]
    assert "deprecated: experiment 'train_selfmade' is now 'train_ours'" in capsys.readouterr().err
    ours = read_results(str(results_file(RESULTS, "train_ours")))
    assert (ours["config"]["distributed_impl"], ours["config"]["sharding"]) == ("ours", "ddp")
    sharding = read_results(str(RESULTS / "sharding.json"))
    engines = {r["sharding"] for r in sharding["results"] if "variant" in r}
    assert engines <= set(registry.names()) and "zero1" in engines
    assert not [t["target"] for t in sharding["targets"] if t["target"].startswith("zero ")]
    ddp = read_results(str(RESULTS / "ddp_benchmark.json"))  # written as "bucketed 25M [shm]", "pytorch-best", ...
    kinds = {r["variant"] for r in ddp["results"]}
    assert kinds == {"no_ddp", "ddp pytorch", "ddp pytorch best", "ddp ours naive", "ddp ours flat",
                     "ddp ours overlap", "ddp ours"}
    labels = [r["label"] for r in ddp["results"]] + ddp["config"]["variants"] \
        + [t[k] for t in ddp["targets"] for k in ("label", "reference")]
    assert all(x == "no ddp" or x.startswith("ddp ") for x in labels) and "ddp ours 25M [shared_memory]" in labels
    assert ddp["config"]["variants"] == [r["label"] for r in ddp["results"] if r["model"] == "cnn"]


def test_old_ddp_labels_are_respelled_in_the_ddp_benchmarks_files_only():
    old = ["bucketed 25M [shm]", "pytorch-best 25M [torch]", "pytorch 1M [torch]", "naive [torch]", "flat", "overlap",
           "no ddp", "ddp ours 25M [torch]", "ddp pytorch best 25M [torch]"]
    assert [registry.current_ddp_label(x) for x in old] == [
        "ddp ours 25M [shm]", "ddp pytorch best 25M [torch]", "ddp pytorch 1M [torch]", "ddp ours naive [torch]",
        "ddp ours flat", "ddp ours overlap", "no ddp", "ddp ours 25M [torch]", "ddp pytorch best 25M [torch]"]
    assert registry.current_ddp_label("pytorch-bestish") == "pytorch-bestish"  # whole words only
    row = {"variant": "pytorch", "label": "pytorch 25M [torch]", "distributed_impl": "pytorch"}
    assert current_names({"benchmark": "ddp_benchmark", "results": [dict(row)]})["results"] == [
        {"variant": "ddp pytorch", "label": "ddp pytorch 25M [torch]", "distributed_impl": "pytorch"}]
    # elsewhere "pytorch" alone is an implementation: a training run's, a SyncBatchNorm row's
    assert current_names({"benchmark": "ddp_cifar100", "results": [dict(row)]})["results"] == [row]


def test_a_registered_engine_appears_wherever_engines_are_compared():
    with toy_engine.registered():
        assert "toy" in cluster.engines()
        c = cluster.Cluster(2, 2, cluster.Link(1e-5, 1e-9), cluster.Link(1e-5, 1e-9))
        assert cluster.communication_seconds("toy", c, 2**20) == cluster.communication_seconds("ddp", c, 2**20)
        assert trainer.parse_args(["--sharding", "toy"]).sharding == "toy"
        assert sharding_benchmark.select(["toy ours"]) == ["toy ours [torch]", "toy ours [shared_memory]"]
        row = {"model": "gpt", "variant": "toy ours [shared_memory]", "sharding": "toy", "world_size": 2,
               "params_bytes": 4, "grads_bytes": 4, "state_bytes": 8, "activation_bytes": 1, "ideal_bytes": 16}
        ax = plots.sharding_memory({"results": [row], "env": {"cpus": 2}}).axes[0]
        (tick,) = [t.get_text() for t in ax.get_xticklabels()]
        assert tick.startswith("toy ours [shared_memory"), tick
    assert "toy" not in cluster.engines()
    with pytest.raises(SystemExit):
        trainer.parse_args(["--sharding", "toy"])
