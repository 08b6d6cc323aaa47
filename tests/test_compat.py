"""The supported torch range: an older torch is refused at import with both versions named, the names that
differ between releases are bridged by feature in dpkit/compat.py alone, and the bridges neither warn on the
newer releases nor fail on the older ones (CI runs this file on both ends: .ci/run)."""

import ast
import datetime
import os
import re
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from common import REPO
from dpkit import compat
from syncbn import SyncBatchNorm

# The names newer than the oldest supported torch: called anywhere but compat.py, they break that torch.
NEWER_FUNCTIONS = {"all_gather_single", "reduce_scatter_single"}  # torch.distributed's, from 2.13
NEWER_KEYWORDS = {"forward_sync_buffers"}  # DistributedDataParallel's, from 2.13
# How the kit spells torch.distributed (a backend's own methods of those names are not calls into torch).
TORCH_MODULES = {"dist", "torch.distributed", "c10d", "torch.distributed.distributed_c10d"}
SOURCES = sorted([*REPO.glob("*.py"), *(REPO / "dpkit").rglob("*.py")])


@pytest.mark.parametrize("version, release", [("2.11.0", (2, 11)), ("2.11.0+cu130", (2, 11)),
                                              ("2.15.0.dev20261101", (2, 15)), ("2.9.1", (2, 9)), ("3.0.0a0", (3, 0))])
def test_the_release_is_read_from_any_version_string(version, release):
    assert compat.release(version) == release


@pytest.mark.parametrize("version", ["2.10.1", "2.4.0+cpu", "1.13.1"])
def test_a_torch_older_than_the_range_is_refused_naming_the_installed_and_the_supported_versions(version):
    with pytest.raises(ImportError, match=rf"needs torch 2\.11 to 2\.15; this is torch {re.escape(version)}\."):
        compat.check_torch(version)


@pytest.mark.parametrize("version", ["2.11.0", "2.14.1+cu130", "2.15.0", "2.16.0.dev20270101"])
def test_a_torch_in_the_range_or_newer_is_accepted(version):
    compat.check_torch(version)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_only_compat_names_what_newer_torch_releases_added(path):
    if path.name == "compat.py":
        return
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr in NEWER_FUNCTIONS
                and ast.unparse(node.value) in TORCH_MODULES):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.keyword) and node.arg in NEWER_KEYWORDS:
            found.append(f"line {node.lineno}: {node.arg}=")
    assert not found, f"{path.name} calls names torch 2.11 lacks; go through dpkit.compat:\n" + "\n".join(found)


@pytest.fixture
def world_of_one():
    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_the_collective_bridges_move_the_data_without_a_deprecation_warning(world_of_one):
    shard, full = torch.arange(4.0), torch.empty(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.all_gather_single(full, shard)
        torch.testing.assert_close(full, shard)
        out = torch.empty(4)
        compat.reduce_scatter_single(out, torch.arange(4.0) * 3)
        torch.testing.assert_close(out, torch.arange(4.0) * 3)
        work = compat.all_gather_single(full, shard * 2, async_op=True)
        work.wait()
        torch.testing.assert_close(full, shard * 2)


def test_pytorchs_ddp_is_built_without_buffer_sync_and_without_a_deprecation_warning(world_of_one):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = nn.parallel.DistributedDataParallel(nn.BatchNorm1d(3), **compat.NO_BUFFER_SYNC)
    assert list(compat.NO_BUFFER_SYNC.values()) == [False]
    model(torch.randn(4, 3))  # a forward that would broadcast the running statistics if the keyword were lost


def test_a_batchnorm_without_bias_has_the_weight_alone_on_every_release():
    layer = SyncBatchNorm(5, bias=False)
    assert layer.bias is None and layer.weight.shape == (5,)
    assert list(layer.state_dict()) == ["weight", "running_mean", "running_var", "num_batches_tracked"]
    layer.weight.data.fill_(3.0)
    layer.reset_parameters()
    assert torch.equal(layer.weight, torch.ones(5)) and layer.bias is None
    assert [name for name, _ in SyncBatchNorm(5).named_parameters()] == ["weight", "bias"]
