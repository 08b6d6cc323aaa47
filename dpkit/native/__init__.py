"""C helpers compiled at first use by this machine's C compiler, cached; None where there is none.

    from dpkit import native
    library = native.load("syncbn_channels")    # a ctypes.CDLL of syncbn_channels.c, or None
    native.compiler()                           # the compiler used: $CC, else cc, gcc or clang on PATH; or None

There is no build step: ``native.load()`` compiles a C file of this folder (``syncbn_channels``: SyncBatchNorm's
per-channel arithmetic, and its passes over (N, C) inputs) once per source, compiler and CPU into the cache
folder (``$DPKIT_CACHE``, else ``$XDG_CACHE_HOME/dpkit``, else ``~/.cache/dpkit``) and later loads it from
there. Every user of a helper keeps a pure-PyTorch path, tested, for where ``native.load()`` returns None: no compiler
(the GPU image may have none), a compile that fails (a warning names the compiler's error), or ``DPKIT_NATIVE=0``
in the environment (to time or debug that path). Processes that compile at once each write their own
file and rename it into place, so that none loads a half-written library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
# -ffp-contract=off: no a * b + c fused into one rounding, so that the C arithmetic rounds as PyTorch's does.
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off")
# This CPU's vector instructions (PyTorch's kernels pick theirs at run time), where the compiler takes the flag;
# the cache key then names the CPU (``_cpu``), so that a cache folder shared by other machines is not misread.
NATIVE = "-march=native"
COMPILE_TIMEOUT_S = 120.0


def enabled() -> bool:
    """False when ``DPKIT_NATIVE=0`` asks for the pure-PyTorch paths."""
    return os.environ.get("DPKIT_NATIVE", "1") != "0"


def compiler() -> str | None:
    """The C compiler's path: ``$CC`` where set, else the first of cc, gcc and clang on PATH."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return next((found for found in map(shutil.which, names) if found), None)


def cache_folder() -> Path:
    if os.environ.get("DPKIT_CACHE"):
        return Path(os.environ["DPKIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dpkit"


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL | None:
    """The library compiled from ``<name>.c`` of this folder, compiled now if it is not in the cache; None where
    ``enabled()`` is False, there is no compiler, or compiling fails (with a RuntimeWarning naming why)."""
    cc = compiler()
    if not enabled() or cc is None:
        return None
    source = (HERE / f"{name}.c").read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(FLAGS).encode(), _cpu()])).hexdigest()[:16]
    target = cache_folder() / f"{name}-{key}.so"
    try:
        if not target.exists():
            try:
                _compile(cc, [*FLAGS, NATIVE], HERE / f"{name}.c", target)
            except OSError:  # a compiler without -march=native (clang on some ARM machines): portable code
                _compile(cc, FLAGS, HERE / f"{name}.c", target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        warnings.warn(f"dpkit.native: could not build {name}.c with {cc} ({error}); using the pure-PyTorch path",
                      RuntimeWarning, stacklevel=2)
        return None


def _cpu() -> bytes:
    """What names this CPU's instruction set: its model and flags where Linux lists them, else the platform's."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in ("model name", "flags",
                                                                                          "Features")})).encode()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _compile(cc: str, flags, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", prefix=f".{target.stem}-", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run([cc, *flags, "-o", partial, str(source), "-lm"], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode:
            raise OSError(f"exit {done.returncode}: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)  # atomic: a process that compiles beside this one loads a whole file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
