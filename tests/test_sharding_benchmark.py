"""sharding_benchmark.py: the registry's names, transports, axes and targets (no process); then a tiny run on 2
spawned ranks (one launch), its rows, targets and byte counts against a count made here from the model's
shapes and zero.partition, and what the shared-memory transport holds in /dev/shm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import run_workers
from dpkit.bench import sharding_run, sharding_setups, transport_choice
from dpkit.bench.row_identity import ZERO_COPY, identity
from dpkit.bench import sharding_variants as variants
from dpkit.bench.sharding_targets import AXES, SCOPES, TARGET_STATE_VS_IDEAL, Target, target_rows
from dpkit.comm import slots, transport
from dpkit.comm.shared_memory import SLOTS_BYTES
from dpkit.engines import registry, zero
from dpkit.models import build_model
from dpkit.report.sharding_printout import report
import run_experiments
import sharding_benchmark as bench
import toy_engine

ARGS = ["--models", "gpt", "--gpt-vocab", "64", "--gpt-seq-len", "8", "--gpt-width", "16", "--gpt-depth", "1",
        "--gpt-heads", "2", "--batch-size", "2", "--iters", "4", "--rounds", "2", "--warmup", "1",
        "--variants", "ddp ours [torch]", "ddp ours [shared_memory]", "ddp pytorch", "zero1 ours [torch]",
        "zero1 ours [shared_memory]",
        "zero1 ours tensor [torch]", "zero2 ours", "zero1 pytorch", "fsdp ours", "fsdp pytorch",
        "fsdp ours bf16 [torch]"]
WORLD = 2

SLOTS_HELD = slots.file_bytes(WORLD, SLOTS_BYTES) // WORLD  # a rank's share of the shared-memory transport's slots


# --------------------------------------------------------------------------- the registry, without a process


def test_every_variant_is_an_engine_on_a_named_transport():
    for name, v in variants.VARIANTS.items():
        assert name == variants.label(v.engine, v.impl, v.option, v.transport), name
        assert v.transport in transport_choice.choices() and v.engine in registry.names(), name
        assert v.impl in registry.IMPLS and v.impl in registry.get(v.engine).impls, name
    assert variants.label("zero1", "ours", "in step", "shared_memory") == "zero1 ours in step [shared_memory]"
    assert variants.label("fsdp", "pytorch") == "fsdp pytorch"
    pytorch_zero = [v.transport for v in variants.VARIANTS.values() if v.base == "zero1 pytorch"]
    assert pytorch_zero == ["torch"], "ZeroRedundancyOptimizer broadcasts through torch.distributed: no other transport"
    for base in ("ddp ours", "ddp pytorch", "zero1 ours", "fsdp ours", "fsdp pytorch", "fsdp ours keep",
                 "fsdp pytorch bf16"):
        assert {f"{base} [torch]", f"{base} [shared_memory]"} <= set(variants.VARIANTS), base
    threaded = {v.base for v in variants.VARIANTS.values() if v.transport == "shared_memory:thread"}
    # what replaced comm_thread=False: inline is [shared_memory]
    assert threaded == {"ddp ours", "zero1 ours", "fsdp ours"}
    assert not [n for n in variants.VARIANTS if "blocking" in n or "inline" in n]


def test_targets_change_one_axis_and_carry_the_issue_limits():
    """An impl or engine target compares two variants on the same transport; a transport target one engine
    on two transports; ours on shared memory is never divided by PyTorch's on gloo."""
    limits = {}
    for v in variants.VARIANTS.values():
        for t in v.targets:
            other = variants.VARIANTS[t.other]
            assert t.axis in AXES, (v.name, t)
            if t.axis == "transport":
                assert other.base == v.base and other.transport != v.transport, (v.name, t)
            else:
                assert other.transport == v.transport, (v.name, t)
            if t.axis == "impl":
                assert (v.impl, other.impl) == ("ours", "pytorch"), (v.name, t)
                assert (other.engine, other.option) == (v.engine, v.option), (v.name, t)
            if t.axis == "engine":
                assert v.engine in ("zero1", "zero2") and other.engine == "ddp", (v.name, t)
                assert (other.impl, other.option) == (v.impl, v.option), (v.name, t)
            limits[f"{v.name} / {t.other}"] = (t.axis, t.limit, t.scope)
    for engine, on in (("ddp", ("torch", "shared_memory")), ("zero1", ("torch",)),
                       ("fsdp", ("torch", "shared_memory"))):
        for t in on:
            assert limits[f"{engine} ours [{t}] / {engine} pytorch [{t}]"] == ("impl", 1.00, None)
    for t in ("torch", "shared_memory"):
        assert limits[f"zero1 ours [{t}] / ddp ours [{t}]"] == ("engine", 1.05, None)
        assert limits[f"zero2 ours [{t}] / zero1 ours [{t}]"] == ("option", None, None)  # stage 2 / stage 1
        assert limits[f"zero2 ours [{t}] / ddp ours [{t}]"] == ("engine", None, None)
    assert limits["zero1 pytorch [torch] / ddp pytorch [torch]"] == ("engine", 1.05, None)
    assert limits["fsdp pytorch [shared_memory] / fsdp pytorch [torch]"] == ("transport", 0.85, "gpt default")
    assert limits["ddp pytorch [shared_memory] / ddp pytorch [torch]"] == ("transport", None, None)
    assert limits["fsdp ours [shared_memory:thread] / fsdp ours [shared_memory]"] == ("transport", None, None)
    # PyTorch's engines unchanged on a "dpkit" process group against the same on gloo
    assert limits["fsdp pytorch [torch:dpkit] / fsdp pytorch [torch]"] == ("transport", 0.85, "gpt default")
    assert limits["ddp pytorch [torch:dpkit] / ddp pytorch [torch]"] == ("transport", None, None)
    assert [k for k, (axis, limit, _) in limits.items() if axis == "transport" and limit is not None] == [
        "fsdp pytorch [shared_memory] / fsdp pytorch [torch]", "fsdp pytorch [torch:dpkit] / fsdp pytorch [torch]"]
    on_dpkit = {v.base for v in variants.VARIANTS.values() if v.transport == "torch:dpkit"}
    assert on_dpkit == {"ddp pytorch", "fsdp pytorch"}


def test_names_without_a_transport_expand_and_one_process_runs_torch_only():
    assert variants.select(["fsdp pytorch", "zero1 ours [shared_memory]"]) == [
        "fsdp pytorch [torch]", "fsdp pytorch [shared_memory]", "fsdp pytorch [torch:dpkit]",
        "zero1 ours [shared_memory]"]
    with pytest.raises(ValueError, match="unknown variant 'zero1 ours blocking'"):
        variants.select(["zero1 ours blocking"])
    every = list(variants.VARIANTS)
    assert variants.runnable(every, 1, torch.device("cpu")) == [n for n in every if n.endswith("[torch]")]
    assert variants.runnable(every, 2, torch.device("cpu")) == every
    assert variants.runnable(every, 2, torch.device("cuda")) == [n for n in every if n.endswith("[torch]")]


def _experiment_args(name: str, quick: bool = True):
    experiment = next(e for e in run_experiments.EXPERIMENTS if e.name == name)
    command = experiment.quick if quick else experiment.full
    return bench.parse_args([a.format(out="/tmp") for a in command[1:]])


def _targets_measured(names: list[str]) -> set[str]:
    return {f"{n} / {t.other}" for n in names for t in variants.VARIANTS[n].targets if t.other in names}


def test_each_sharding_experiment_measures_the_targets_it_is_for():
    """The quick sweep and resnet18: every engine target on [torch] and [shared_memory], ZeRO / DDP, the transports;
    sharding_gpt: fully_shard on shared memory and on a "dpkit" group against gloo at the GPT's default size (where
    its limit holds)."""
    for name in ("sharding", "sharding_resnet18"):
        measured = _targets_measured(_experiment_args(name).variants)
        for t in ("torch", "shared_memory"):
            assert {f"ddp ours [{t}] / ddp pytorch [{t}]", f"fsdp ours [{t}] / fsdp pytorch [{t}]",
                    f"zero1 ours [{t}] / ddp ours [{t}]"} <= measured, (name, t)
        assert {"zero1 ours [torch] / zero1 pytorch [torch]", "zero1 pytorch [torch] / ddp pytorch [torch]",
                "ddp pytorch [shared_memory] / ddp pytorch [torch]",
                "fsdp pytorch [shared_memory] / fsdp pytorch [torch]"} <= measured, name
    for quick in (True, False):
        args = _experiment_args("sharding_gpt", quick)
        measured = _targets_measured(args.variants)
        assert {"fsdp pytorch [shared_memory] / fsdp pytorch [torch]",
                "fsdp pytorch [torch:dpkit] / fsdp pytorch [torch]",
                "ddp ours [shared_memory] / ddp pytorch [shared_memory]",
                "zero1 ours [shared_memory] / ddp ours [shared_memory]"} <= measured
        assert SCOPES["gpt default"][1]("gpt", args)
    assert not SCOPES["gpt default"][1]("gpt", _experiment_args("sharding"))


def test_a_scoped_limit_holds_only_in_its_scope():
    rows = [{"model": "gpt", "world_size": 2, "variant": v, "round_p50_s": [s] * 4, "state_vs_ideal": 1.0}
            for v, s in (("fsdp pytorch [torch]", 1.0), ("fsdp pytorch [shared_memory]", 0.5))]
    targets = {r["variant"]: variants.VARIANTS[r["variant"]].targets for r in rows}
    for args, limit, result in ((bench.parse_args([]), 0.85, "met"), (bench.parse_args(["--quick"]), None, "-")):
        (row,) = [t for t in target_rows(rows, args, targets) if t["axis"] == "transport"]
        assert row["limit"] == limit and row["verdict"] == result and row["ratio"]["median"] == pytest.approx(0.5)
        assert row["scope"] == "the GPT at its default size" and row["scoped_limit"] == 0.85
    quick = target_rows(rows, bench.parse_args(["--quick"]), targets)
    assert "target <= 0.85 on the GPT at its default size only: for information here" in report(quick)


def test_quick_settings_yield_to_explicit_flags():
    args = bench.parse_args(["--quick", "--iters", "3"])
    assert args.iters == 3 and args.rounds == bench.QUICK["rounds"] and args.models == bench.QUICK["models"]
    assert args.variants == bench.QUICK["variants"]
    assert bench.parse_args([]).models == list(bench.MODELS)
    assert bench.parse_args([]).variants == [n for n, v in variants.VARIANTS.items() if v.default]


# --------------------------------------------------------------------------- a tiny run


def tiny_args():
    """ARGS and the toy engine (tests/toy_engine.py, our DDP under another name) on both transports."""
    with toy_engine.registered():
        return bench.parse_args([*ARGS, "toy ours"])


def _worker_with_the_toy(ctx, args):
    with toy_engine.registered():  # in each spawned rank: the registry is per process
        return bench.worker(ctx, args)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return run_workers(_worker_with_the_toy, WORLD, tiny_args())[0]


def model_tensors() -> list[torch.Tensor]:
    return list(build_model("gpt", sharding_run.gpt_config(bench.parse_args(ARGS))).parameters())


def measured_rows(rows) -> dict[str, dict]:
    return {row["variant"]: row for row in rows if "variant" in row}


def bucket_bytes(row: dict, exact: int, buckets: int) -> bool:
    """A shared-memory transport hands out blocks of whole cache lines (``transport.ALIGN`` bytes): each of the
    ``buckets`` it allocated may hold up to ALIGN - 1 bytes more than the tensor; torch's allocator, none."""
    slack = 0 if row["transport"] == "torch" else buckets * (transport.ALIGN - 1)
    return exact <= row["grads_bytes"] <= exact + slack


def test_every_variant_has_a_row_with_its_transport_times_and_memory(rows):
    measured = measured_rows(rows)
    assert list(measured) == tiny_args().variants
    for name, row in measured.items():
        assert 0 < row["p50_s"] <= row["p95_s"] and len(row["round_p50_s"]) == 2
        assert row["activation_bytes"] > 0 and row["peak_bytes"] >= row["params_bytes"] + row["state_bytes"]
        assert {k: row[k] for k in variants.FIELDS} == variants.VARIANTS[name].fields(), name
        assert name == variants.label(row["engine"], row["impl"], row["option"], row["transport"]), name
        assert row["transport_detail"] == {"torch": "torch (gloo)", "shared_memory": "shared_memory",
                                           "shared_memory:thread": "shared_memory",
                                           "torch:dpkit": "torch (dpkit)"}[row["transport"]], name
    assert measured["ddp pytorch [torch]"]["exposed_comm_s"] is None, "PyTorch's wait happens inside backward"
    assert measured["zero1 ours [shared_memory]"]["exposed_comm_s"] > 0


def test_each_row_records_its_path_and_each_target_the_identity_of_both_sides(rows):
    """On shared memory a row says which path its measured iterations took (``row_identity.recorded_path``); the
    report reads it there, never from the label. Our engines allocate through the transport: zero copy."""
    measured = measured_rows(rows)
    for name, row in measured.items():
        on_shared_memory = row["transport"] in ("shared_memory", "shared_memory:thread")
        assert (row["path"] is not None) == on_shared_memory, name
    assert {measured[f"{e} ours [shared_memory]"]["path"] for e in ("ddp", "zero1", "zero2", "fsdp")} == {ZERO_COPY}
    for target in (r for r in rows if "target" in r):
        assert target["row"] == identity(measured[target["numerator"]]), target["target"]
        if "denominator" in target:
            assert target["reference_row"] == identity(measured[target["denominator"]]), target["target"]


def test_a_registered_engine_is_a_variant_on_each_transport_and_runs_as_the_engine_it_wraps(rows):
    """The toy (our DDP under another name, registered in one place) is offered, measured and counted like
    "ddp ours"; unregistered, it is gone."""
    with toy_engine.registered():
        assert variants.select(["toy ours"]) == ["toy ours [torch]", "toy ours [shared_memory]"]
        assert variants.VARIANTS["toy ours [shared_memory]"].targets == (Target("toy ours [torch]", "transport"),)
    measured = measured_rows(rows)
    for t in ("torch", "shared_memory"):
        toy, ddp = measured[f"toy ours [{t}]"], measured[f"ddp ours [{t}]"]
        assert toy["p50_s"] > 0 and (toy["engine"], toy["impl"], toy["option"]) == ("toy", "ours", None)
        for key in ("params_bytes", "grads_bytes", "state_bytes", "ideal_bytes"):
            assert toy[key] == ddp[key], (t, key)
    with pytest.raises(ValueError, match="unknown variant 'toy ours'"):
        variants.select(["toy ours"])


def test_pytorchs_engines_train_on_a_dpkit_process_group_beside_gloo_with_the_transport_ratio(rows):
    """The tiny run's "ddp pytorch" and "fsdp pytorch" ran on [torch:dpkit] too (the same builders, given that group):
    each has its times and the same model-state bytes as on [torch], and a target row against [torch] (the
    0.85 limit of fully_shard holds at the GPT's default size only: here for information)."""
    m = measured_rows(rows)
    for base in ("ddp pytorch", "fsdp pytorch"):
        backed, gloo = m[f"{base} [torch:dpkit]"], m[f"{base} [torch]"]
        assert 0 < backed["p50_s"] and backed["model_state_bytes"] == gloo["model_state_bytes"], base
        (target,) = [r for r in rows if r.get("target") == f"{base} [torch:dpkit] / {base} [torch]"]
        assert target["axis"] == "transport" and target["limit"] is None and target["verdict"] == "-"
        assert target["ratio"]["median"] == pytest.approx(float(np.median(
            np.divide(backed["round_p50_s"], gloo["round_p50_s"]))))
    assert [r["scoped_limit"] for r in rows
            if r.get("target") == "fsdp pytorch [torch:dpkit] / fsdp pytorch [torch]"] == [0.85]


def test_what_the_transport_holds_in_shared_memory_is_counted(rows):
    """The buffers a shared-memory transport allocated lie in /dev/shm, where PeakMemory does not look: they are
    counted as kept (DDP's buckets; ZeRO's all-gather buffers too), and the staging block of what is staged."""
    m = measured_rows(rows)
    params = model_tensors()
    buffers = WORLD * -(-sum(p.numel() for p in params) // WORLD) * 4  # (n, largest share) float32, one bucket
    for name, row in m.items():
        if row["transport"] in ("torch", "torch:dpkit"):  # the backend "dpkit"'s slots are its group's, not counted
            assert row["shared_peak_bytes"] == 0, name
        else:
            assert row["shared_peak_bytes"] > 0, name
    ddp, zero1 = m["ddp ours [shared_memory]"], m["zero1 ours [shared_memory]"]
    assert ddp["shared_peak_bytes"] >= ddp["grads_bytes"]  # the buckets hold them
    assert zero1["shared_peak_bytes"] >= zero1["grads_bytes"] + buffers
    # The peak counts them as it counts the same buffers in torch's allocator on [torch].
    for name in ("ddp ours [shared_memory]", "zero1 ours [shared_memory]"):
        assert m[name]["peak_bytes"] >= m[name]["params_bytes"] + m[name]["state_bytes"] + m[name]["shared_peak_bytes"]
    # PyTorch's DDP over our hook: this model's buckets are short, so they go through the transport's slots, which
    # are counted (a longer one would be staged, in a block of at least one MiB).
    assert m["ddp pytorch [shared_memory]"]["shared_peak_bytes"] >= SLOTS_HELD


def flat_shares(params: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """(elements, pieces) of each rank's share under ZeRO's flat partition of one bucket: ranges of ceil(N / n)
    of the parameters back to back, a piece per parameter a range crosses."""
    ends = torch.tensor([p.numel() for p in params]).cumsum(0).tolist()
    width = -(-ends[-1] // WORLD)
    edges = [min(r * width, ends[-1]) for r in range(WORLD + 1)]
    pieces = [sum(1 for end, p in zip(ends, params) if end - p.numel() < edges[r + 1] and end > edges[r])
              for r in range(WORLD)]
    return [edges[r + 1] - edges[r] for r in range(WORLD)], pieces


def test_the_byte_counts_equal_a_count_from_the_shapes(rows):
    """Every rank holds all parameters and gradients; AdamW keeps 2 moments per element and a step per
    tensor (per piece of a tensor): all of it under DDP, the owned share under ZeRO (ours, flat: ranges of
    ceil(N / n) of the parameters back to back; ours, tensor: zero.partition; any: they add up). Our ZeRO's
    parameters are views of its all-gather buffer, n rows as long as the largest share: its padding counts."""
    params = model_tensors()
    total = sum(p.numel() * 4 for p in params)
    state = {id(p): 2 * p.numel() * 4 + 4 for p in params}
    owners = zero.partition([p.numel() for p in params], [0] * WORLD)
    whole_tensors = [sum(state[id(p)] for p, o in zip(params, owners) if o == r) for r in range(WORLD)]
    largest_whole = max(sum(p.numel() for p, o in zip(params, owners) if o == r) for r in range(WORLD))
    elements, pieces = flat_shares(params)
    gathered = {"zero1 ours [": WORLD * max(elements) * 4, "zero1 ours tensor [": WORLD * largest_whole * 4}
    flat = [8 * elements[r] + 4 * pieces[r] for r in range(WORLD)]
    for name, row in measured_rows(rows).items():
        if row["engine"] in ("fsdp", "zero2"):  # (stage 2's gradients: the test below)
            continue
        # ddp.DDP's buckets hold the gradients and one float32 used-flag per parameter after them
        flags = 4 * len(params) if " ours" in name else 0
        in_buffer = next((b for prefix, b in gathered.items() if name.startswith(prefix)), total)
        slack = transport.ALIGN - 1 if row["transport"] != "torch" and in_buffer != total else 0  # whole cache lines
        assert in_buffer <= row["params_bytes"] <= in_buffer + slack, name
        assert bucket_bytes(row, total + flags, len(params)), name
        if row["engine"] in ("ddp", toy_engine.NAME):  # nothing sharded
            assert row["state_bytes_per_rank"] == [sum(state.values())] * WORLD
        else:
            split = sum(pieces) - len(params)  # a tensor cut between two ranks has a step count on each
            flat_partition = name.startswith("zero1 ours [")
            assert sum(row["state_bytes_per_rank"]) == sum(state.values()) + 4 * split * flat_partition, name
            assert row["ideal_bytes"] == 2 * total + sum(state.values()) // WORLD
        if name.startswith("zero1 ours ["):
            assert row["state_bytes_per_rank"] == flat, name
        if name.startswith("zero1 ours tensor"):
            assert row["state_bytes_per_rank"] == whole_tensors, name


def test_zero_stage2_keeps_one_nth_of_the_gradients_per_rank(rows):
    """Stage 2: each rank's gradients are one buffer of the largest share's elements plus a float32 used-flag per
    piece (the same flat partition as the optimizer state's, which matches stage 1's); about 1/n of what stage 1
    holds on every rank (all of them, in DDP's bucket with a flag per parameter)."""
    params = model_tensors()
    total = sum(p.numel() * 4 for p in params)
    state = sum(2 * p.numel() * 4 + 4 for p in params)
    elements, pieces = flat_shares(params)
    share = 4 * max(e + k for e, k in zip(elements, pieces))  # the reduce-scatter's row: every rank's is as long
    gathered = WORLD * max(elements) * 4  # the parameters: views of the all-gather buffer, as at stage 1
    # The reduce-scatter pool: two slots, each 1/32 of the parameters' bytes (at least 64 KiB) but no more than
    # one chunk of the whole bucket needs (n rows and an output row), in whole cache lines.
    slot = min((WORLD + 1) * share, max(zero.POOL_MIN_BYTES, total // zero.POOL_FRACTION))
    pool = zero.POOL_SLOTS * -(-slot // zero.POOL_ALIGN) * zero.POOL_ALIGN
    measured = measured_rows(rows)
    for t in ("torch", "shared_memory"):
        row, stage1 = measured[f"zero2 ours [{t}]"], measured[f"zero1 ours [{t}]"]
        slack = 0 if t == "torch" else transport.ALIGN - 1  # one buffer on shared memory: whole cache lines
        assert len(row["grads_bytes_per_rank"]) == WORLD, t
        assert gathered <= row["params_bytes"] <= gathered + slack, t
        assert all(share <= held <= share + slack for held in row["grads_bytes_per_rank"]), (t, row)
        assert stage1["grads_bytes_per_rank"] == [stage1["grads_bytes"]] * WORLD
        for held in row["grads_bytes_per_rank"]:  # 1/n, but for the flags and the uneven cut
            assert abs(WORLD * held - stage1["grads_bytes"]) <= WORLD * (4 * (len(params) + 1) + slack), (t, held)
        assert row["state_bytes_per_rank"] == stage1["state_bytes_per_rank"], t
        assert row["ideal_bytes"] == total + (total + state) // WORLD
        # Held: parameters (in their all-gather buffer), optimizer state, the gradient share and the reduce-scatter
        # pool (nothing the size of the gradients is kept between steps); on shared memory all but the state in the
        # arena, in whole cache lines, and the transport's slots for short all-reduces. (Maxima over ranks, possibly
        # of different ranks: a rank's state differs by a step count per piece.)
        held = gathered + row["state_bytes"] + share + pool + (SLOTS_HELD if t == "shared_memory" else 0)
        assert held - 4 * len(params) <= row["model_state_bytes"] <= held + 3 * slack, (t, row["model_state_bytes"])
        assert row["state_vs_ideal"] == row["model_state_bytes"] / row["ideal_bytes"], t
    assert "grads MiB per rank" in report(rows)


def test_fsdp_byte_counts_equal_a_count_from_the_shapes(rows):
    """Ours: each linear or embedding layer's parameters in one flat shard of ceil(numel / n) elements per
    rank (the head is tied to the embedding: no unit of its own); the LayerNorms replicated, their
    gradients in ddp.DDP's bucket with a float32 used-flag each; AdamW's two moments and a step per tensor."""
    model = build_model("gpt", sharding_run.gpt_config(bench.parse_args(ARGS)))
    seen, shards, replicated = set(), [], []
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if isinstance(m, sharding_setups.FSDP_SHARD_TYPES) and own:
            shards.append(-(-sum(p.numel() for p in own) // WORLD) * 4)
        elif not isinstance(m, sharding_setups.FSDP_SHARD_TYPES):
            replicated += [p.numel() * 4 for p in own]
    held = sum(shards) + sum(replicated)
    measured = measured_rows(rows)
    for name in ("fsdp ours "
                 "[torch]", "fsdp ours [shared_memory]", "fsdp ours [shared_memory:thread]", "fsdp ours bf16 [torch]"):
        row = measured[name]
        assert row["params_bytes"] == held and bucket_bytes(row, held + 4 * len(replicated), len(replicated)), name
        assert row["state_bytes_per_rank"] == [2 * held + 4 * (len(shards) + len(replicated))] * WORLD, name
    for name in ("fsdp ours [torch]", "fsdp pytorch [torch]"):
        assert measured[name]["state_vs_ideal"] <= TARGET_STATE_VS_IDEAL, name
        assert measured[name]["model_state_bytes"] < 0.6 * measured["ddp ours [torch]"]["model_state_bytes"], name
    for name in ("fsdp ours "
                 "[shared_memory]", "fsdp pytorch "
                                    "[shared_memory]"):  # the arena's pages count (a staging block: 1 MiB at least)
        row, on_torch = measured[name], measured[name.replace("[shared_memory]", "[torch]")]
        assert row["shared_peak_bytes"] <= row["model_state_bytes"], name
        assert row["model_state_bytes"] <= on_torch["model_state_bytes"] + row["shared_peak_bytes"], name


def test_each_target_is_a_paired_ratio_with_an_axis_and_a_verdict(rows):
    targets = {row["target"]: row for row in rows if "target" in row}
    expected = {"ddp ours [torch] / ddp pytorch [torch]": "impl",
                "ddp ours [shared_memory] / ddp pytorch [shared_memory]": "impl",
                "zero1 ours [torch] / zero1 pytorch [torch]": "impl",
                "fsdp ours [shared_memory] / fsdp pytorch [shared_memory]": "impl",
                "zero1 ours [shared_memory] / ddp ours [shared_memory]": "engine",
                "zero1 pytorch [torch] / ddp pytorch [torch]": "engine",
                "fsdp pytorch [shared_memory] / fsdp pytorch [torch]": "transport",
                "fsdp ours [shared_memory:thread] / fsdp ours [shared_memory]": "transport",
                "zero1 ours tensor [torch] / zero1 ours [torch]": "option",
                "zero1 ours [shared_memory] state / ideal": "memory",
                "zero2 ours [shared_memory] / zero1 ours [shared_memory]": "option",
                "zero2 ours [torch] / ddp ours [torch]": "engine"}
    assert {name: targets[name]["axis"] for name in expected} == expected
    assert all("variant" not in row and row["target"].startswith(row["numerator"]) for row in targets.values())
    assert not [name for name in targets if "[shared_memory" in name.split(" / ")[0]
                and "[torch]" in name.split(" / ")[-1] and targets[name]["axis"] != "transport"], \
        "an engine credited with a transport's gain"
    for name, row in targets.items():
        assert row["verdict"] in ("met", "missed", "inconclusive", "-"), name
        if row["ratio"] is not None:
            assert row["ratio"]["rounds"] == 2
            assert row["ratio"]["ci_low"] <= row["ratio"]["median"] <= row["ratio"]["ci_high"]
    assert targets["fsdp pytorch [shared_memory] / fsdp pytorch [torch]"]["limit"] is None, "a toy GPT: for information"
    assert targets["zero1 ours [torch] state / ideal"]["value"] <= TARGET_STATE_VS_IDEAL
    text = report(rows)
    assert "targets by axis" in text and "zero1 ours [shared_memory] / ddp ours [shared_memory]" in text
    assert all(f"  {axis} (" in text for axis in AXES)
