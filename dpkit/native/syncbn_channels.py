"""syncbn_channels.c from Python: SyncBatchNorm's per-channel arithmetic, one C call each, on CPU tensors;
on a contiguous (N, C) input the per-element passes too (``passes_for``).

    from dpkit.native import syncbn_channels
    functions = syncbn_channels.for_dtype(torch.float32)   # None: no C compiler (syncbn.py's PyTorch path serves)
    functions.pack(mean.data_ptr(), var.data_ptr(), channels, count, packed.data_ptr())
    passes = syncbn_channels.passes_for(torch.bfloat16)    # the whole layer on a bfloat16 (N, C) input

The arguments are data pointers of contiguous CPU tensors (ints; None for an absent one), sizes and scalars; the
C file says what each function computes and which function of syncbn.py it stands for.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from dpkit import native

_SUFFIXES = {torch.float32: "float32", torch.float64: "float64"}
# The dtypes of x the passes take (half ones: statistics in float32).
_INPUTS = {**_SUFFIXES, torch.bfloat16: "bfloat16", torch.float16: "float16"}


class Functions:
    """The per-channel functions of syncbn_channels.c for statistics of one dtype (``suffix``), typed for ctypes."""

    def __init__(self, library: ctypes.CDLL, suffix: str):
        pointer, size, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
        self.pack = _typed(library, f"syncbn_pack_{suffix}", [pointer, pointer, size, size, pointer], None)
        self.combine = _typed(library, f"syncbn_combine_{suffix}",
                              [pointer, size, pointer, pointer, pointer, pointer, real], size)
        self.stage = _typed(library, f"syncbn_stage_{suffix}", [pointer, pointer, size, size, pointer], None)
        self.coefficients = _typed(library, f"syncbn_coefficients_{suffix}",
                                   [pointer, pointer, pointer, real, size, pointer], None)


class Passes:
    """The functions of syncbn_channels.c that make the whole layer on a contiguous (N, C) x of one dtype
    (``suffix``), typed for ctypes. A return of -1 is a failed malloc (``checked``)."""

    def __init__(self, library: ctypes.CDLL, suffix: str):
        pointer, size, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
        self.local_sums = _typed(library, f"syncbn_local_sums_{suffix}", [pointer, size, size, pointer], size)
        self.normalize = _typed(library, f"syncbn_normalize_{suffix}", [pointer, size, pointer, pointer, pointer,
                                pointer, real, pointer, pointer, real, pointer, size, pointer], size)
        self.backward_sums = _typed(library, f"syncbn_backward_sums_{suffix}", [pointer, pointer, pointer, pointer,
                                    real, size, size, size, pointer, pointer, pointer], size)
        self.input_grad = _typed(library, f"syncbn_input_grad_{suffix}", [pointer, pointer, pointer, pointer,
                                 pointer, pointer, real, size, size, pointer], size)


def checked(result: int) -> int:
    """``result`` of a function that allocates scratch, or MemoryError where it could not (-1)."""
    if result < 0:
        raise MemoryError("syncbn_channels.c: malloc failed for a few values per channel")
    return result


def _typed(library: ctypes.CDLL, name: str, arguments: list, result):
    function = library[name]
    function.argtypes, function.restype = arguments, result
    return function


@functools.lru_cache(maxsize=None)
def for_dtype(dtype: torch.dtype) -> Functions | None:
    """The functions for statistics in ``dtype`` (float32 or float64); None for another dtype or where
    ``native.load`` gives no library."""
    library = native.load("syncbn_channels") if dtype in _SUFFIXES else None
    return None if library is None else Functions(library, _SUFFIXES[dtype])


@functools.lru_cache(maxsize=None)
def passes_for(dtype: torch.dtype) -> Passes | None:
    """The whole layer's functions for an x of ``dtype`` (float32, float64, bfloat16 or float16; its statistics
    in float32 or float64); None for another dtype or where ``native.load`` gives no library."""
    library = native.load("syncbn_channels") if dtype in _INPUTS else None
    return None if library is None else Passes(library, _INPUTS[dtype])
