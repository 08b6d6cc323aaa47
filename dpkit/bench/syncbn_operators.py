"""What one iteration of a SyncBatchNorm benchmark dispatches: on the CPU the aten operators called on this thread
plus the calls into ``syncbn_channels.c`` (each one step of the layer done in C where PyTorch would dispatch
several), on CUDA the kernels launched. Information, not a verdict: -1 where it cannot be counted.

    ops = operators(step, device)      # per iteration
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from dpkit.native import syncbn_channels

OPERATOR_ITERS = 3  # iterations whose dispatched operators (CUDA: kernel launches) are counted, per iteration


def dispatch_counter():
    """A context manager class whose instances count the aten operators dispatched on this thread (``count``),
    or None where this torch lacks the hook: the benchmark's one private torch name (a Python dispatch mode),
    imported here only, so a torch without it loses the count and nothing else."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return None

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))
    return Counter


def _kernel_launches(step: Callable[[], None], iters: int) -> float:
    """CUDA: the kernel launches of ``iters`` calls of ``step`` (the profiler's runtime events), per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return sum("LaunchKernel" in e.name for e in profiler.events()) / iters


@contextlib.contextmanager
def _counting_c_calls():
    """Counts the calls into syncbn_channels.c (``dpkit.native``) while it is open: ``yield``s a list whose one
    element is the count. Each call is one step of the layer done in C where PyTorch would dispatch several."""
    counted, originals = [0], []
    for functions in filter(None, map(syncbn_channels.for_dtype, (torch.float32, torch.float64))):
        for name, function in list(vars(functions).items()):
            def counting(*args, _function=function):
                counted[0] += 1
                return _function(*args)
            originals.append((functions, name, function))
            setattr(functions, name, counting)
    try:
        yield counted
    finally:
        for functions, name, function in originals:
            setattr(functions, name, function)


def operators(step: Callable[[], None], device: torch.device, iters: int = OPERATOR_ITERS) -> float:
    """What one iteration dispatches: on the CPU the aten operators called on this thread (the autograd
    engine runs the CPU backward here too; a transport's own threads are not counted) plus the calls into
    syncbn_channels.c, on CUDA the kernels launched. -1 where it cannot be counted (a warning says why): the
    count is information, not a verdict."""
    try:
        if device.type == "cuda":
            return _kernel_launches(step, iters)
        counter = dispatch_counter()
        if counter is None:
            return -1.0
        with counter() as mode, _counting_c_calls() as c_calls:
            for _ in range(iters):
                step()
        return (mode.count + c_calls[0]) / iters
    except Exception as error:  # a profiler or dispatch mode this torch refuses: no count, the run goes on
        warnings.warn(f"syncbn_benchmark: operators not counted ({type(error).__name__}: {error})")
        return -1.0
