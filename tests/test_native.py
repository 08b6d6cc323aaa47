"""dpkit.native: helpers compiled at first use, cached, and None (the pure-PyTorch paths) where they cannot be.

What the helpers compute is tested where they are used (tests/test_syncbn.py runs every case with syncbn_channels.c
and with PyTorch's operations); here, when ``load`` and ``load_extension`` compile, when they reuse the cache, what
they refuse to trust and when they give None. One C++ extension is compiled in the default run (``adder``, shared
by the tests that need one); a second, to see a corrupt one rebuilt, is marked slow.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpkit import native
from dpkit.native import syncbn_channels

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on PATH: load gives None")
needs_cxx = pytest.mark.skipif(native.cxx_compiler() is None, reason="no C++ compiler on PATH: load_extension gives "
                               "None")
ROOT = Path(__file__).resolve().parents[1]
# A C++ extension that compiles in seconds: pybind11 alone, from torch's include folder, not torch/extension.h.
ADDER = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) { module.def("add", [](int a, int b) { return a + b; }); }
"""
# What a process asking for the adder prints: its sum and the file it imported.
LOAD_ADDER = ("import sys; from dpkit import native; m = native.load_extension('adder', sys.argv[1]); "
              "print(m.add(2, 3), m.__file__)")


def _load(name: str = "syncbn_channels"):
    return native.load.__wrapped__(name)  # past the per-process cache: each call compiles or reads the folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("DPKIT_NATIVE", raising=False)
    return tmp_path


@needs_compiler
def test_the_first_load_compiles_into_the_cache_and_later_ones_reuse_it(cache, monkeypatch):
    """Into a cache folder it makes private (0o700), with the library's SHA-256 recorded beside it."""
    monkeypatch.setenv("DPKIT_CACHE", str(cache / "made"))
    assert _load() is not None
    built = list((cache / "made").glob("syncbn_channels-*.so"))
    assert len(built) == 1 and not list(cache.glob("made/.*")), "one library, and no partial file left behind"
    assert stat.S_IMODE((cache / "made").stat().st_mode) == 0o700
    assert _recorded(built[0]) == _sha256(built[0])
    modified = built[0].stat().st_mtime_ns
    assert _load() is not None and built[0].stat().st_mtime_ns == modified


@pytest.fixture
def one(cache):
    """A C helper that compiles at once, in a folder of its own: ``load`` of it, past the per-process cache."""
    (cache / "source").mkdir()
    (cache / "source" / "one.c").write_text("int one(void) { return 1; }\n")
    return lambda: native.load.__wrapped__("one", cache / "source")


def _library(cache: Path) -> Path:
    (built,) = cache.glob("one-*.so")
    return built


def _recorded(library: Path) -> str:
    return library.with_name(library.name + ".sha256").read_text().strip()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _replace(path: Path, data: bytes) -> None:
    """A new file in place of ``path``: the inode a load of this process maps is left whole (no SIGBUS)."""
    path.with_name("replacement").write_bytes(data)
    os.replace(path.with_name("replacement"), path)


@needs_compiler
@pytest.mark.parametrize("damage", ["truncated", "replaced", "record deleted"])
def test_a_library_that_does_not_match_its_recorded_hash_is_rebuilt_and_the_rebuild_loaded(cache, one, monkeypatch,
                                                                                            damage):
    monkeypatch.setenv("DPKIT_CACHE", str(cache / "first"))
    assert one() is not None
    # Under a new path, so that the load below opens the file (a library loaded once is found by its path).
    (cache / "first").rename(cache / "second")
    monkeypatch.setenv("DPKIT_CACHE", str(cache / "second"))
    library = _library(cache / "second")
    whole = library.read_bytes()
    if damage == "record deleted":
        library.with_name(library.name + ".sha256").unlink()
    else:
        _replace(library, whole[:len(whole) // 2] if damage == "truncated" else bytes(len(whole)))
    loaded = one()
    assert loaded is not None and loaded.one() == 1
    assert _recorded(library) == _sha256(library)


@needs_compiler
@pytest.mark.parametrize("owner", ["writable by others", "writable by its group", "another user's"])
def test_a_library_not_this_users_alone_is_rebuilt(cache, one, owner):
    assert one() is not None
    library = _library(cache)
    if owner == "another user's":
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(library, os.geteuid() + 1, -1)
    else:
        library.chmod(0o757 if owner == "writable by others" else 0o775)
    inode = library.stat().st_ino
    assert one() is not None
    assert library.stat().st_ino != inode and library.stat().st_uid == os.geteuid()
    assert not library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH) and _recorded(library) == _sha256(library)


@pytest.mark.parametrize("loader", ["load", "load_extension"])
def test_a_relative_dpkit_cache_is_refused_with_a_warning_naming_it(cache, monkeypatch, loader):
    monkeypatch.chdir(cache)
    monkeypatch.setenv("DPKIT_CACHE", "relative/cache")
    load = getattr(native, loader).__wrapped__
    with pytest.warns(RuntimeWarning, match="DPKIT_CACHE='relative/cache' is a relative path"):
        assert load("syncbn_channels" if loader == "load" else "adder") is None
    assert not (cache / "relative").exists()


@pytest.mark.parametrize("problem", ["writable by others", "writable by its group", "owned by uid"])
def test_a_cache_folder_not_this_users_alone_is_refused_with_a_warning(cache, one, monkeypatch, problem):
    if problem == "owned by uid":
        euid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: euid + 1)  # the folder is then another user's
    else:
        cache.chmod(0o777 if problem == "writable by others" else 0o770)
    with pytest.warns(RuntimeWarning, match=f"DPKIT_CACHE=.* is {problem}"):
        assert one() is None
    assert not list(cache.glob("*.so*")), "nothing compiled into it"


def test_dpkit_native_0_gives_none_without_compiling(cache, monkeypatch):
    monkeypatch.setenv("DPKIT_NATIVE", "0")
    assert _load() is None and not list(cache.iterdir())


def test_no_compiler_on_path_gives_none_without_a_word(cache, monkeypatch):
    """An image without a compiler: the PyTorch paths serve, and nothing was asked of the compiler that is absent."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(cache))
    assert native.compiler() is None and _load() is None


def test_a_cc_whose_first_word_is_not_on_path_gives_none_with_a_warning_naming_it(cache, monkeypatch):
    monkeypatch.setenv("CC", "no-such-ccache gcc")
    assert native.compiler() is None
    with pytest.warns(RuntimeWarning, match="with no-such-ccache gcc .*no-such-ccache is not found on PATH"):
        assert _load() is None


@needs_compiler
def test_cc_may_carry_arguments_split_as_a_shell_would(cache, monkeypatch):
    real = shlex.join(native.compiler())
    logging = _script(cache / "bin" / "logging-cc", f'echo "$@" >> {cache / "log"}\nexec {real} "$@"')
    monkeypatch.setenv("PATH", f"{logging.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CC", "logging-cc -DDPKIT_WAS_HERE")
    assert native.compiler() == [str(logging), "-DDPKIT_WAS_HERE"]
    assert _load() is not None and "-DDPKIT_WAS_HERE" in (cache / "log").read_text()


@needs_compiler
def test_a_build_asks_for_this_cpus_instructions_and_builds_portable_code_where_the_compiler_refuses_them(
        cache, monkeypatch):
    real, log = shlex.join(native.compiler()), cache / "log"
    refusing = _script(cache / "bin" / "refusing-cc", f'echo "$@" >> {log}\n'
                       f'case " $* " in *" -march=native "*) exit 1;; esac\nexec {real} "$@"')
    monkeypatch.setenv("CC", str(refusing))
    assert _load() is not None
    asked, built = [line.split() for line in log.read_text().splitlines() if "-shared" in line.split()]
    assert "-march=native" in asked and "-march=native" not in built


def test_a_compiler_that_fails_gives_none_with_a_warning_naming_it(cache, monkeypatch):
    failing = _script(cache / "failing-cc", "echo 'cc: fatal error: no input' >&2\nexit 1")
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


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


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


@pytest.fixture(scope="module")
def adder(tmp_path_factory):
    """The adder extension, built by two processes started together: the folder of its source, the cache it was
    built in, the compiler that counts its compiles, the compiles and what each process printed."""
    folder = tmp_path_factory.mktemp("adder")
    (folder / "adder.cpp").write_text(ADDER)
    counting = _script(folder / "counting-c++", 'case " $* " in *" -shared "*) echo compile >> '
                       f'"${{DPKIT_TEST_COMPILES:-/dev/null}}";; esac\nexec {shlex.join(native.cxx_compiler())} "$@"')
    environment = {**os.environ, "DPKIT_CACHE": str(folder / "cache"), "CXX": str(counting),
                   "DPKIT_TEST_COMPILES": str(folder / "compiles")}
    environment.pop("DPKIT_NATIVE", None)
    printed = _together(2, environment, folder)
    return folder, folder / "cache", counting, (folder / "compiles").read_text().splitlines(), printed


def _together(count: int, environment: dict, folder: Path, timeout_s: float = 300) -> list[str]:
    """What ``count`` processes, started together, print when each loads the adder (each bounded by a timeout)."""
    processes = [subprocess.Popen([sys.executable, "-c", LOAD_ADDER, str(folder)], cwd=ROOT, env=environment,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        outputs = [process.communicate(timeout=timeout_s) for process in processes]
    finally:
        for process in processes:
            process.kill()  # those a timeout left running
    for process, (_, errors) in zip(processes, outputs):
        assert process.returncode == 0, errors[-2000:]
    return [printed for printed, _ in outputs]


@needs_cxx
@pytest.mark.slow  # a C++ compile: CI's `python -m dpkit.native` builds the backend's before the suite
@pytest.mark.solo
def test_two_processes_asking_at_once_compile_the_extension_once_and_both_load_it(adder):
    folder, cache, _, compiles, printed = adder
    assert len(compiles) == 1, "the second process waits for the first one's build"
    (built,) = cache.glob("dpkit_adder_*.so")
    assert [line.split() for line in printed] == [["5", str(built)]] * 2
    assert _recorded(built) == _sha256(built) and stat.S_IMODE(cache.stat().st_mode) == 0o700


@needs_cxx
@pytest.mark.slow  # a C++ compile: CI's `python -m dpkit.native` builds the backend's before the suite
@pytest.mark.solo
def test_a_built_extension_is_imported_from_the_cache_without_compiling(adder, monkeypatch):
    folder, cache, counting, _, _ = adder
    monkeypatch.setenv("DPKIT_CACHE", str(cache))
    monkeypatch.setenv("CXX", str(counting))
    monkeypatch.setenv("DPKIT_TEST_COMPILES", str(folder / "compiles"))
    monkeypatch.delenv("DPKIT_NATIVE", raising=False)
    module = native.load_extension.__wrapped__("adder", folder)
    assert module.add(2, 3) == 5 and module.__name__.startswith("dpkit_adder_")
    assert Path(module.__file__).parent == cache and len((folder / "compiles").read_text().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.solo
@needs_cxx
def test_a_corrupt_extension_is_rebuilt_and_the_rebuild_imported(adder, tmp_path):
    folder, cache, counting, _, _ = adder
    shutil.copytree(cache, tmp_path / "cache")
    (built,) = (tmp_path / "cache").glob("dpkit_adder_*.so")
    _replace(built, built.read_bytes()[:4096])
    environment = {**os.environ, "DPKIT_CACHE": str(tmp_path / "cache"), "CXX": str(counting),
                   "DPKIT_TEST_COMPILES": str(tmp_path / "compiles")}
    environment.pop("DPKIT_NATIVE", None)
    assert _together(1, environment, folder) == [f"5 {built}\n"]
    assert len((tmp_path / "compiles").read_text().splitlines()) == 1 and _recorded(built) == _sha256(built)


def test_load_extension_gives_none_without_a_word_where_dpkit_native_is_0(cache, monkeypatch):
    monkeypatch.setenv("DPKIT_NATIVE", "0")
    (cache / "adder.cpp").write_text(ADDER)
    assert native.load_extension.__wrapped__("adder", cache) is None and not list(cache.glob("*.so*"))


def test_load_extension_without_a_cxx_compiler_gives_none_with_a_warning(cache, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(cache))
    (cache / "adder.cpp").write_text(ADDER)
    with pytest.warns(RuntimeWarning, match="could not build adder.cpp with no compiler .*none of c\\+\\+, g\\+\\+"):
        assert native.load_extension.__wrapped__("adder", cache) is None


@needs_cxx
def test_an_extension_that_fails_to_compile_gives_none_with_a_warning_naming_the_compiler(cache, monkeypatch):
    (cache / "broken.cpp").write_text("#error not ready\n")  # fails at once: no header is read
    monkeypatch.setenv("CXX", f"{shlex.join(native.cxx_compiler())} -DDPKIT_CXX_AS_GIVEN")
    with pytest.warns(RuntimeWarning, match="could not build broken.cpp with .* -DDPKIT_CXX_AS_GIVEN .*not ready"):
        assert native.load_extension.__wrapped__("broken", cache) is None


@needs_compiler
@needs_cxx
@pytest.mark.slow  # compiles a folder of helpers, C++ among them: seconds of both cores
@pytest.mark.solo
def test_python_m_dpkit_native_builds_every_helper_of_a_folder_and_says_why_not(cache):
    (cache / "one.c").write_text("int one(void) { return 1; }\n")
    (cache / "broken.cpp").write_text("#error not ready\n")
    environment = {**os.environ, "DPKIT_CACHE": str(cache / "cache")}
    environment.pop("DPKIT_NATIVE", None)
    done = subprocess.run([sys.executable, "-m", "dpkit.native", str(cache)], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=300)
    (built,) = (cache / "cache").glob("one-*.so")
    assert done.returncode == 1, "a helper that could not be built fails the command"
    assert f"built one.c: {built}" in done.stdout
    assert "not built: could not build broken.cpp with" in done.stdout and "not ready" in done.stdout
