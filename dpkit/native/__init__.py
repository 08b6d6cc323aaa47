"""Native helpers compiled at first use by this machine's compilers, cached; None where they cannot be.

    from dpkit import native
    library = native.load("syncbn_channels")        # a ctypes.CDLL of syncbn_channels.c, or None
    module = native.load_extension("c10d_backend")  # the Python module built from c10d_backend.cpp, or None
    python -m dpkit.native                          # builds every .c and .cpp of this folder now (CI, images)

The first call compiles into the cache folder (``$DPKIT_CACHE``, else ``$XDG_CACHE_HOME/dpkit``, else
``~/.cache/dpkit``); later calls load from there. A C++ extension compiles far longer than a C file, so
``python -m dpkit.native`` (``__main__``) does it ahead of time (CI, an image's build) and prints what it built or
why not. The helpers: ``syncbn_channels.c`` (SyncBatchNorm's arithmetic; ``syncbn_channels`` is its ctypes face)
and ``c10d_backend.cpp`` (the C++ face of the backend "dpkit").
Every user of a helper keeps a pure-PyTorch path, tested, for where these give None: no compiler (the GPU image may
have none), a compile that fails, a cache that cannot be trusted (each with a RuntimeWarning saying why), or
``DPKIT_NATIVE=0``.

Only what this user built is loaded, as OpenSSH treats its key files: the cache folder (created 0o700, its path
absolute) and each library must be this user's and writable by no one else, and a library's SHA-256 must be the
one recorded beside it at its build; one that fails (corrupt, truncated, replaced) is rebuilt. A lock file per
library makes processes that ask at once build it once; the others wait and load that build.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
# -ffp-contract=off: no a * b + c fused into one rounding, so that the C arithmetic rounds as PyTorch's does.
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off")
# This CPU's vector instructions (PyTorch's kernels pick theirs at run time), for the C helpers and the C++ extension
# alike (the backend's sums), where the compiler takes the flag; the cache key then names the CPU (``_cpu``), so that
# a cache folder shared by other machines is not misread.
NATIVE = "-march=native"
COMPILE_TIMEOUT_S = 120.0
C_COMPILERS = ("cc", "gcc", "clang")

CXX_COMPILERS = ("c++", "g++", "clang++")
# -w: torch's headers warn by the hundred; an error is still printed. TORCH_API_INCLUDE_EXTENSION_H: the macro
# torch's own extension builds define, which torch/extension.h checks. -O3: GCC vectorizes a loop of unknown length
# (the backend's sums) only there; -ffp-contract=off: no fused multiply-add changes a rounding.
CXX_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC", "-fvisibility=hidden", "-w",
             "-DTORCH_API_INCLUDE_EXTENSION_H")
# torch 2.14's headers need C++20; older torch's take it too, so C++17 only where the compiler has no C++20.
CXX_STANDARDS = ("-std=c++20", "-std=c++17")
TORCH_LIBRARIES = ("-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python")
EXTENSION_TIMEOUT_S = 600.0  # a bound far above what torch/extension.h's headers take to compile


class _Refused(Exception):
    """Why a helper is not loaded; ``load`` and ``load_extension`` give None with this as a RuntimeWarning."""


class _NoCompiler(_Refused):
    """No compiler named and none on PATH: ``load`` gives None without a warning (an image without one)."""


def enabled() -> bool:
    """False when ``DPKIT_NATIVE=0`` asks for the pure-PyTorch paths."""
    return os.environ.get("DPKIT_NATIVE", "1") != "0"


def compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` split as a shell would (``ccache gcc``), its first word found on PATH;
    else the first of cc, gcc and clang on PATH; None where there is none."""
    with contextlib.suppress(_Refused):
        return _compiler("CC", C_COMPILERS)
    return None


def cxx_compiler() -> list[str] | None:
    """The C++ compiler's command: ``$CXX`` split as a shell would, else the first of c++, g++ and clang++ on PATH."""
    with contextlib.suppress(_Refused):
        return _compiler("CXX", CXX_COMPILERS)
    return None


def cache_folder() -> Path:
    if os.environ.get("DPKIT_CACHE"):
        return Path(os.environ["DPKIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dpkit"


@functools.lru_cache(maxsize=None)
def load(name: str, folder: Path = HERE) -> ctypes.CDLL | None:
    """The library compiled from ``<name>.c`` of ``folder``, compiled now where the cache holds no verified one;
    None where ``enabled()`` is False or there is no C compiler, and None with a RuntimeWarning saying why where
    ``$CC`` is not found, compiling fails or the cache is not this user's alone."""
    if not enabled():
        return None
    try:
        return _library(name, Path(folder))[1]
    except _NoCompiler:
        return None
    except (_Refused, OSError, subprocess.SubprocessError) as error:
        _warn(Path(folder) / f"{name}.c", error)
        return None


@functools.lru_cache(maxsize=None)
def load_extension(name: str, folder: Path = HERE):
    """The Python module built from the C++ PyTorch extension ``<name>.cpp`` of ``folder`` against the running
    torch, compiled now where the cache holds no verified build; None where ``enabled()`` is False, and None with a
    RuntimeWarning saying why where there is no C++ compiler, compiling or importing fails or the cache is not
    trusted. The source defines its module with ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``."""
    if not enabled():
        return None
    try:
        return _extension(name, Path(folder))[1]
    except (_Refused, OSError, subprocess.SubprocessError, ImportError) as error:
        _warn(Path(folder) / f"{name}.cpp", error)
        return None


def _warn(source: Path, error: Exception) -> None:
    warnings.warn(f"dpkit.native: {_failure(source, error)}; using the pure-PyTorch path", RuntimeWarning,
                  stacklevel=3)


def _failure(source: Path, error: Exception) -> str:
    """Why ``source`` is not loaded, naming its compiler as the environment gives it."""
    variable, defaults = ("CC", C_COMPILERS) if source.suffix == ".c" else ("CXX", CXX_COMPILERS)
    given = os.environ.get(variable, "").strip() or next(filter(None, map(shutil.which, defaults)), "no compiler")
    return f"could not build {source.name} with {given} ({error})"


def _library(name: str, folder: Path) -> tuple[Path, ctypes.CDLL]:
    cc, cache = _compiler("CC", C_COMPILERS), _trusted_cache()
    source = folder / f"{name}.c"
    target = cache / f"{name}-{_key(source.read_bytes(), *cc, *FLAGS, _cpu())}.so"

    build = functools.partial(_compile_native, cc, [*FLAGS, str(source), "-lm"], target, COMPILE_TIMEOUT_S)
    return target, _built(target, build, lambda: ctypes.CDLL(str(target)))


def _extension(name: str, folder: Path):
    import torch  # here, not at the top: the C helpers load without it

    cxx, cache = _compiler("CXX", CXX_COMPILERS), _trusted_cache()
    source = folder / f"{name}.cpp"
    lib = Path(torch.__file__).parent / "lib"
    flags = [_cxx_standard(tuple(cxx)), *CXX_FLAGS, *_torch_flags()]
    links = [f"-L{lib}", *TORCH_LIBRARIES, f"-Wl,-rpath,{lib}"]  # after the source: linkers that drop unused -l
    module = f"dpkit_{name}_{_key(source.read_bytes(), *cxx, *flags, *links, torch.__version__, sys.version, _cpu())}"
    target = cache / f"{module}{sysconfig.get_config_var('EXT_SUFFIX')}"
    arguments = [*flags, f"-DTORCH_EXTENSION_NAME={module}", str(source), *links]
    build = functools.partial(_compile_native, cxx, arguments, target, EXTENSION_TIMEOUT_S)
    return target, _built(target, build, lambda: _import(module, target))


def _torch_flags() -> list[str]:
    """Where the running torch's and Python's headers are, and the C++ ABI torch was built with."""
    import torch

    # Its import warns, in every process of a machine without CUDA, that no CUDA runtime is found: nothing a CPU
    # extension needs, and a training run's ranks would each print it.
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import include_paths
    finally:
        quiet.setLevel(level)

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    return [*(f"-I{path}" for path in includes), f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


@functools.lru_cache(maxsize=None)
def _cxx_standard(cxx: tuple[str, ...]) -> str:
    """The first of CXX_STANDARDS the compiler takes, asked on an empty file."""
    for standard in CXX_STANDARDS[:-1]:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if subprocess.run([*cxx, standard, "-x", "c++", "-fsyntax-only", "-"], input="", capture_output=True,
                              timeout=COMPILE_TIMEOUT_S).returncode == 0:
                return standard
    return CXX_STANDARDS[-1]


def _import(module: str, path: Path):
    spec = importlib.util.spec_from_file_location(module, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    sys.modules[module] = loaded
    return loaded


def _compiler(variable: str, defaults: tuple[str, ...]) -> list[str]:
    """``$variable`` split into words, the first resolved on PATH; else the first of ``defaults`` on PATH."""
    given = os.environ.get(variable, "").strip()
    if not given:
        found = next(filter(None, map(shutil.which, defaults)), None)
        if found is None:
            raise _NoCompiler(f"{variable} is not set and none of {', '.join(defaults)} is on PATH")
        return [found]
    try:
        words = shlex.split(given)
    except ValueError as error:
        raise _Refused(f"{variable}={given!r} does not split into words ({error})") from None
    found = shutil.which(words[0])
    if found is None:
        raise _Refused(f"{variable}={given!r}: {words[0]} is not found on PATH")
    return [found, *words[1:]]


def _key(*parts: str | bytes) -> str:
    """What names a build in the cache: a digest of everything that changes the built file."""
    return hashlib.sha256(b"\0".join(part if isinstance(part, bytes) else part.encode() for part in parts)
                          ).hexdigest()[:16]


def _cpu() -> bytes:
    """What names this CPU's instruction set: its model and flags where Linux lists them, else the platform's."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in ("model name", "flags",
                                                                                          "Features")})).encode()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _trusted_cache() -> Path:
    """The cache folder, created 0o700 where absent; refused where its path is relative (it would follow the working
    directory) or it is not this user's alone (another could plant a library in it)."""
    folder = cache_folder()
    named = next((f"{variable}={os.environ[variable]!r}" for variable in ("DPKIT_CACHE", "XDG_CACHE_HOME")
                  if os.environ.get(variable)), f"the cache folder {str(folder)!r}")
    if not folder.is_absolute():
        raise _Refused(f"{named} is a relative path, which would follow the working directory")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = _not_private(folder.stat())
    if problem:
        raise _Refused(f"{named} is {problem}, so another user could plant a library in it")
    return folder


def _not_private(status: os.stat_result) -> str | None:
    """What makes a file or folder not this user's alone, or None."""
    if status.st_uid != os.geteuid():
        return f"owned by uid {status.st_uid}, not this user ({os.geteuid()})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by {'others' if status.st_mode & stat.S_IWOTH else 'its group'} (mode {status.st_mode:o})"
    return None


def _verified(target: Path) -> bool:
    """Whether ``target`` and its record are this user's own regular files, writable by no one else, and the
    target's SHA-256 is the one recorded at its build."""
    try:
        files = [target, _record(target)]
        if any(not stat.S_ISREG(s.st_mode) or _not_private(s) for s in (os.lstat(path) for path in files)):
            return False
        return _record(target).read_text().strip() == hashlib.sha256(target.read_bytes()).hexdigest()
    except OSError:
        return False


def _record(target: Path) -> Path:
    return target.with_name(f"{target.name}.sha256")


def _built(target: Path, build, load):
    """``load()`` of ``target``, after ``build()`` where the cache holds no verified one. The lock, held to the
    end, makes a process that asks at once wait, then load this build rather than compile its own."""
    with _locked(target):
        if not _verified(target):
            build()
            if not _verified(target):
                raise _Refused(f"{target} fails verification right after its build")
        return load()


@contextlib.contextmanager
def _locked(target: Path):
    descriptor = os.open(f"{target}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)  # released when the descriptor closes, also if this process dies
        yield
    finally:
        os.close(descriptor)


def _compile_native(command: list[str], arguments: list[str], target: Path, timeout_s: float) -> None:
    """``_compile`` for this CPU's vector instructions (NATIVE); portable code where the compiler fails with them
    (clang without -march=native on some ARM machines)."""
    try:
        _compile(command, [NATIVE, *arguments], target, timeout_s)
    except OSError:
        _compile(command, arguments, target, timeout_s)


def _compile(command: list[str], arguments: list[str], target: Path, timeout_s: float) -> None:
    """Compiles into a temporary file, then moves it and its SHA-256 record into place, each atomically: a process
    that dies midway leaves no file that passes verification."""
    partial = _temporary(target)
    try:
        done = subprocess.run([*command, *arguments, "-o", partial], capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode:
            raise OSError(f"exit {done.returncode}: {done.stderr.strip()[-400:]}")
        _write(_record(target), hashlib.sha256(Path(partial).read_bytes()).hexdigest() + "\n")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _write(path: Path, text: str) -> None:
    partial = _temporary(path)
    try:
        Path(partial).write_text(text)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _temporary(target: Path) -> str:
    """A new file of this user's, mode 0o600, beside ``target`` (so that os.replace is a rename)."""
    handle, partial = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    os.close(handle)
    return partial


def build_all(folder: Path = HERE) -> list[tuple[str, Path | None, str | None]]:
    """Builds (or verifies) and loads every C helper and C++ extension of ``folder``: (source, the built file or
    None, why not or None) for each."""
    outcomes = []
    for source in sorted(Path(folder).glob("*.c")) + sorted(Path(folder).glob("*.cpp")):
        make = _library if source.suffix == ".c" else _extension
        try:
            outcomes.append((source.name, make(source.stem, Path(folder))[0], None))
        except (_Refused, OSError, subprocess.SubprocessError, ImportError) as error:
            outcomes.append((source.name, None, _failure(source, error)))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """``python -m dpkit.native [FOLDER]``: builds every helper ahead of its first use; exit 1 where one could not
    be built."""
    parser = argparse.ArgumentParser(prog="python -m dpkit.native", description=main.__doc__)
    parser.add_argument("folder", nargs="?", type=Path, default=HERE,
                        help="the folder whose .c and .cpp files to build (default: dpkit/native)")
    folder = parser.parse_args(argv).folder
    if not enabled():
        print("dpkit.native: DPKIT_NATIVE=0, nothing built")
        return 0
    outcomes = build_all(folder)
    for source, built, why in outcomes:
        print(f"built {source}: {built}" if built else f"not built: {why}")
    return int(any(built is None for _, built, _ in outcomes))
