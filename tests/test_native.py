"""dpkit.native: C helpers compiled at first use, cached, and None (the pure-PyTorch paths) where they cannot be.

What the helpers compute is tested where they are used (tests/test_syncbn.py runs every case with syncbn_channels.c
and with PyTorch's operations); here, when ``load`` compiles, when it reuses the cache and when it gives None.
"""

from __future__ import annotations

import ctypes
import os
import stat

import pytest
import torch

from dpkit import native
from dpkit.native import syncbn_channels

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on PATH: load gives None")


def _load(name: str = "syncbn_channels"):
    return native.load.__wrapped__(name)  # past the per-process cache: each call compiles or reads the folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("DPKIT_NATIVE", raising=False)
    return tmp_path


@needs_compiler
def test_the_first_load_compiles_into_the_cache_and_later_ones_reuse_it(cache):
    assert _load() is not None
    built = list(cache.glob("syncbn_channels-*.so"))
    assert len(built) == 1 and not list(cache.glob(".*")), "one library, and no partial file left behind"
    modified = built[0].stat().st_mtime_ns
    assert _load() is not None and built[0].stat().st_mtime_ns == modified


def test_dpkit_native_0_gives_none_without_compiling(cache, monkeypatch):
    monkeypatch.setenv("DPKIT_NATIVE", "0")
    assert _load() is None and not list(cache.iterdir())


def test_no_compiler_gives_none(cache, monkeypatch):
    monkeypatch.setenv("CC", str(cache / "no-such-compiler"))
    assert native.compiler() is None and _load() is None


def test_a_compiler_that_fails_gives_none_with_a_warning_naming_it(cache, monkeypatch):
    failing = cache / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'cc: fatal error: no input' >&2\nexit 1\n")
    failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(failing))
    with pytest.warns(RuntimeWarning, match="could not build syncbn_channels.c with .*failing-cc.*no input"):
        assert _load() is None
    assert not [p for p in cache.iterdir() if p.suffix == ".so"], "nothing half-built is left in the cache"


@needs_compiler
def test_statistics_are_float32_or_float64_and_the_passes_take_every_float_input():
    assert syncbn_channels.for_dtype(torch.float32) is not None
    assert syncbn_channels.for_dtype(torch.float64) is not None
    assert syncbn_channels.for_dtype(torch.bfloat16) is None and syncbn_channels.for_dtype(torch.float16) is None
    assert all(syncbn_channels.passes_for(dtype) is not None for dtype in (torch.float32, torch.float64,
                                                                          torch.bfloat16, torch.float16))
    assert syncbn_channels.passes_for(torch.int32) is None and syncbn_channels.passes_for(torch.complex64) is None


@needs_compiler
def test_pack_and_combine_give_chans_global_moments_in_float64():
    """Two ranks' halves of one batch, packed and summed by hand: the combination gives the whole batch's mean and
    biased variance, and the running statistics BatchNorm's update would (unbiased over N). An empty rank packs
    zeros."""
    functions = syncbn_channels.for_dtype(torch.float64)
    x = torch.randn(10, 3, dtype=torch.float64) * 3 + 1e4
    packed = torch.zeros(7, dtype=torch.float64)
    for half in x.split(5):
        mine, (mean, var) = torch.empty(7, dtype=torch.float64), (half.mean(0), half.var(0, unbiased=False))
        functions.pack(mean.data_ptr(), var.data_ptr(), 3, 5, mine.data_ptr())  # pointers: the tensors held
        packed += mine
    empty = torch.full((7,), float("nan"), dtype=torch.float64)  # a rank with no values sends zeros and still joins
    functions.pack(mean.data_ptr(), var.data_ptr(), 3, 0, empty.data_ptr())
    assert torch.equal(empty, torch.zeros(7, dtype=torch.float64))
    mean, var = torch.empty(3, dtype=torch.float64), torch.empty(3, dtype=torch.float64)
    running_mean, running_var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    total = functions.combine(packed.data_ptr(), 3, mean.data_ptr(), var.data_ptr(), running_mean.data_ptr(),
                              running_var.data_ptr(), 0.1)
    assert total == 10
    torch.testing.assert_close(mean, x.mean(0), rtol=0, atol=1e-9)
    torch.testing.assert_close(var, x.var(0, unbiased=False), rtol=1e-7, atol=0)  # float32 would be off by ~1
    torch.testing.assert_close(running_mean, 0.1 * x.mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(running_var, 0.9 + 0.1 * x.var(0), rtol=1e-7, atol=0)


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("DPKIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.cache_folder() == tmp_path / "dpkit"
    monkeypatch.setenv("DPKIT_CACHE", os.fspath(tmp_path / "mine"))
    assert native.cache_folder() == tmp_path / "mine"


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_half_conversions_are_pytorchs_on_every_value(dtype):
    """Every one of the 65,536 bit patterns read as PyTorch reads it (NaN as NaN); every value of the dtype, every
    midpoint between neighbours (ties go to even) and a million floats from 1e-9 to 1e5 rounded as ``.to(dtype)``."""
    library, name = native.load("syncbn_channels"), {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    read = torch.empty(65536)
    library[f"syncbn_from_{name}"](ctypes.c_void_p(patterns.data_ptr()), ctypes.c_void_p(read.data_ptr()),
                                   ctypes.c_int64(65536))
    expected = patterns.view(dtype).float()
    assert torch.equal(read.isnan(), expected.isnan()) and torch.equal(read[~read.isnan()], expected[~read.isnan()])
    values = expected[expected.isfinite()].unique().double()
    floats = torch.cat([expected, ((values[1:] + values[:-1]) / 2).float(),
                        torch.randn(1_000_000, generator=torch.Generator().manual_seed(0)) *
                        torch.logspace(-9, 5, 1_000_000)])
    written = torch.empty(floats.numel(), dtype=torch.int16)
    library[f"syncbn_to_{name}"](ctypes.c_void_p(floats.data_ptr()), ctypes.c_void_p(written.data_ptr()),
                                 ctypes.c_int64(floats.numel()))
    rounded = floats.to(dtype)
    same = (written == rounded.view(torch.int16)) | (written.view(dtype).isnan() & rounded.isnan())
    assert same.all(), f"{int((~same).sum())} of {floats.numel()} values rounded otherwise, e.g. {floats[~same][:4]}"
