"""sharding_benchmark.py: a tiny run on 2 spawned ranks (one launch), its rows, targets and byte counts
against a count made here from the model's shapes and zero.partition."""

from __future__ import annotations

import pytest
import torch

import allreduce
import sharding_benchmark as bench
import zero
from common import run_workers
from models import build_model

ARGS = ["--models", "gpt", "--gpt-vocab", "64", "--gpt-seq-len", "8", "--gpt-width", "16", "--gpt-depth", "1",
        "--gpt-heads", "2", "--batch-size", "2", "--iters", "4", "--rounds", "2", "--warmup", "1",
        "--variants", "ddp ours", "ddp pytorch", "zero ours", "zero ours broadcast", "zero ours tensor",
        "zero pytorch", "fsdp ours", "fsdp pytorch", "fsdp ours bf16"]
WORLD = 2


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    args = bench.parse_args(ARGS)
    return run_workers(bench.worker, WORLD, args)[0]


def model_tensors() -> list[torch.Tensor]:
    return list(build_model("gpt", bench.gpt_config(bench.parse_args(ARGS))).parameters())


def test_every_variant_has_a_row_with_times_and_memory(rows):
    measured = {row["variant"]: row for row in rows if "variant" in row}
    assert list(measured) == bench.parse_args(ARGS).variants
    for row in measured.values():
        assert 0 < row["p50_s"] <= row["p95_s"] and len(row["round_p50_s"]) == 2
        assert row["activation_bytes"] > 0 and row["peak_bytes"] >= row["params_bytes"] + row["state_bytes"]
    assert measured["ddp pytorch"]["exposed_comm_s"] is None, "PyTorch's wait happens inside backward: not measurable"
    assert measured["zero ours"]["exposed_comm_s"] > 0


def test_the_byte_counts_equal_a_count_from_the_shapes(rows):
    """Every rank holds all parameters and gradients; AdamW keeps 2 moments per element and a step per
    tensor (per piece of a tensor): all of it under DDP, the owned share under ZeRO (ours, flat: n
    near-equal ranges of the parameters back to back; ours, tensor: zero.partition; any: they add up)."""
    params = model_tensors()
    total = sum(p.numel() * 4 for p in params)
    state = {id(p): 2 * p.numel() * 4 + 4 for p in params}
    owners = zero.partition([p.numel() for p in params], [0] * WORLD)
    whole_tensors = [sum(state[id(p)] for p, o in zip(params, owners) if o == r) for r in range(WORLD)]
    ends = torch.tensor([p.numel() for p in params]).cumsum(0).tolist()
    edges = allreduce.bounds(ends[-1], WORLD)
    pieces = [sum(1 for end, p in zip(ends, params) if end - p.numel() < edges[r + 1] and end > edges[r])
              for r in range(WORLD)]
    flat = [8 * (edges[r + 1] - edges[r]) + 4 * pieces[r] for r in range(WORLD)]
    for row in (r for r in rows if "variant" in r and r["sharding"] != "fsdp"):
        # ddp.DDP's buckets hold the gradients and one float32 used-flag per parameter after them
        flags = 4 * len(params) if " ours" in row["variant"] else 0
        assert row["params_bytes"] == total and row["grads_bytes"] == total + flags, row["variant"]
        if row["sharding"] == "ddp":
            assert row["state_bytes_per_rank"] == [sum(state.values())] * WORLD
        else:
            split = sum(pieces) - len(params)  # a tensor cut between two ranks has a step count on each
            flat_partition = row["variant"] in ("zero ours", "zero ours broadcast")
            assert sum(row["state_bytes_per_rank"]) == sum(state.values()) + 4 * split * flat_partition, row["variant"]
            assert row["ideal_bytes"] == 2 * total + sum(state.values()) // WORLD
        if row["variant"] in ("zero ours", "zero ours broadcast"):
            assert row["state_bytes_per_rank"] == flat
        if row["variant"] == "zero ours tensor":
            assert row["state_bytes_per_rank"] == whole_tensors


def test_fsdp_byte_counts_equal_a_count_from_the_shapes(rows):
    """Ours: each linear or embedding layer's parameters in one flat shard of ceil(numel / n) elements per
    rank (the head is tied to the embedding: no unit of its own); the LayerNorms replicated, their
    gradients in ddp.DDP's bucket with a float32 used-flag each; AdamW's two moments and a step per tensor."""
    model = build_model("gpt", bench.gpt_config(bench.parse_args(ARGS)))
    seen, shards, replicated = set(), [], []
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if isinstance(m, bench.FSDP_SHARD_TYPES) and own:
            shards.append(-(-sum(p.numel() for p in own) // WORLD) * 4)
        elif not isinstance(m, bench.FSDP_SHARD_TYPES):
            replicated += [p.numel() * 4 for p in own]
    held = sum(shards) + sum(replicated)
    measured = {row["variant"]: row for row in rows if "variant" in row}
    for name in ("fsdp ours", "fsdp ours bf16"):
        row = measured[name]
        assert row["params_bytes"] == held and row["grads_bytes"] == held + 4 * len(replicated), name
        assert row["state_bytes_per_rank"] == [2 * held + 4 * (len(shards) + len(replicated))] * WORLD, name
    for name in ("fsdp ours", "fsdp pytorch"):
        assert measured[name]["state_vs_ideal"] <= bench.TARGET_STATE_VS_IDEAL, name
        assert measured[name]["model_state_bytes"] < 0.6 * measured["ddp ours"]["model_state_bytes"], name


def test_each_target_is_a_paired_ratio_with_a_verdict(rows):
    targets = {(row["target"]): row for row in rows if "target" in row}
    assert {"zero ours / zero pytorch", "zero ours / ddp ours", "ddp ours / ddp pytorch", "zero ours broadcast / zero ours",
            "zero ours state / ideal", "fsdp ours / fsdp pytorch", "fsdp ours state / ideal"} <= set(targets)
    for name, row in targets.items():
        assert row["verdict"] in ("met", "missed", "inconclusive", "-"), name
        if row["ratio"] is not None:
            assert row["ratio"]["rounds"] == 2 and row["ratio"]["ci_low"] <= row["ratio"]["median"] <= row["ratio"]["ci_high"]
    assert targets["zero ours state / ideal"]["value"] <= bench.TARGET_STATE_VS_IDEAL
    assert "targets (ratios" in bench.report(rows) and "zero ours / ddp ours" in bench.report(rows)


def test_quick_settings_yield_to_explicit_flags():
    args = bench.parse_args(["--quick", "--iters", "3"])
    assert args.iters == 3 and args.rounds == bench.QUICK["rounds"] and args.models == bench.QUICK["models"]
    assert bench.parse_args([]).models == list(bench.MODELS)
