"""One vocabulary of transports: a transport registered once (``registry.register``) is a choice of every
benchmark and runs there; an unknown name (an old spelling too) is refused with one error listing the known ones.

One group of 2 spawned ranks runs each benchmark's own ``worker`` on the toy (a few iterations each); the
rest runs in this process without a process group.
"""

from __future__ import annotations

import argparse

import pytest

import toy_transport
from common import run_workers
import collectives_benchmark
import ddp_benchmark
import sharding_benchmark
import syncbn_benchmark
from dpkit.bench import sharding_variants, transport_choice
from dpkit.comm import registry

TOY = toy_transport.NAME


@pytest.fixture
def toy():
    with toy_transport.registered():
        yield TOY


# Each benchmark's flags for a tiny run on the toy (and torch, the reference where the benchmark needs one).
TINY = {
    "ddp_benchmark": ["--models", "cnn", "--variants", "ddp ours", "ddp pytorch best", "--transports", TOY,
                      "--bucket-sizes", "25", "--batch-size", "2", "--iters", "2", "--rounds", "1", "--warmup", "0",
                      "--no-breakdown"],
    "sharding_benchmark": ["--quick", "--models", "gpt", "--variants", f"ddp ours [{TOY}]", f"fsdp ours [{TOY}]",
                           "--iters", "2", "--rounds", "1", "--warmup", "0"],
    "syncbn_benchmark": ["--transports", "torch", TOY, "--batch", "4", "--hidden", "8", "--dtypes", "float32",
                         "--iters", "2", "--rounds", "1", "--warmup", "0", "--settings", "workers"],
    "collectives_benchmark": ["--axis", "transports", "--transports", "torch", TOY, "--sizes", "4096",
                              "--iters", "2", "--warmup", "0"],
}
MODULES = {m.__name__: m for m in (ddp_benchmark, sharding_benchmark, syncbn_benchmark, collectives_benchmark)}


def _every_benchmark_on_the_toy(ctx) -> dict:
    """Each benchmark's worker on the toy, on this rank: {benchmark: [(label or variant, transport), ...]}."""
    toy_transport.register()  # a fresh process: registered as a user's start-up code would
    out = {}
    for name, flags in TINY.items():
        rows = MODULES[name].worker(ctx, MODULES[name].parse_args(flags))
        out[name] = sorted({(r.get("label") or r.get("variant") or r.get("impl"), r.get("transport"),
                             r.get("correct")) for r in rows if TOY in str(r.get("transport") or r.get("variant"))},
                           key=str)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(_every_benchmark_on_the_toy, 2)


def test_a_registered_transport_runs_in_every_benchmark(runs):
    for rank in runs:
        assert rank == runs[0]
    ran = runs[0]
    assert ("ddp ours 25M [toy]", TOY, None) in ran["ddp_benchmark"]
    assert ("ddp pytorch best 25M [toy]", TOY, None) in ran["ddp_benchmark"]  # PyTorch's DDP through the comm hook
    assert {label for label, _, _ in ran["sharding_benchmark"]} == {"ddp ours [toy]", "fsdp ours [toy]"}
    assert any(t == TOY for _, t, _ in ran["syncbn_benchmark"])
    # the row labelled by the registry's name, its transport field what ran (describe()), exact on the pattern
    assert ran["collectives_benchmark"] == [(TOY, "toy torch (gloo)", True)]


def test_a_registered_transport_is_a_choice_of_every_benchmark_and_named_in_its_help(toy, capsys):
    for name, module in MODULES.items():
        args = module.parse_args(TINY[name])
        chosen = args.variants if name == "sharding_benchmark" else args.transports
        assert any(TOY in c for c in chosen), name
    for module, flags in ((ddp_benchmark, ["run", "--help"]), (syncbn_benchmark, ["--help"]),
                          (collectives_benchmark, ["--help"]), (sharding_benchmark, ["--help"])):
        with pytest.raises(SystemExit):
            module.parse_args(flags)
        assert TOY in capsys.readouterr().out, module.__name__
    assert TOY in transport_choice.choices()
    registry.unregister(TOY)
    assert TOY not in transport_choice.choices()
    toy_transport.register()  # for the fixture's teardown


# The spellings of before the names were one: unknown names now, like any other.
@pytest.mark.parametrize("name", ["gloo", "shm", "shm-thread", "zero_copy", "staged", "dpkit"])
def test_an_unknown_transport_name_is_refused_listing_the_known_ones(name, capsys):
    known = ", ".join(transport_choice.choices())
    message = f"unknown transport '{name}': choose one of {known}"
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        transport_choice.argument(name)
    for module in (ddp_benchmark, syncbn_benchmark, collectives_benchmark):
        with pytest.raises(SystemExit):
            module.parse_args(["--transports", name])
        err = capsys.readouterr().err
        assert message in err and "deprecated" not in err and err.count("error:") == 1, module.__name__
    with pytest.raises(ValueError, match=message):
        sharding_variants.select([f"ddp ours [{name}]"])
    with pytest.raises(ValueError, match=f"unknown transport '{name}': choose one of auto, "):
        registry.checked(name)  # the registry's own list holds "auto"


def test_a_benchmark_refuses_auto_a_row_names_what_it_ran_on():
    with pytest.raises(argparse.ArgumentTypeError, match="not 'auto'"):
        transport_choice.argument("auto")
