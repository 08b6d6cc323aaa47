"""Synchronized BatchNorm: batch statistics over every rank, one sum across ranks per pass.

    from syncbn import SyncBatchNorm, convert_sync_batchnorm
    model = convert_sync_batchnorm(model)      # every BatchNorm1d/2d/3d becomes a SyncBatchNorm

``SyncBatchNorm`` is a drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (inputs (N, C, *), contiguous or
channels_last) whose training-mode statistics are those of the global batch, the concatenation of
every rank's batch. It runs on CPU with gloo (``torch.nn.SyncBatchNorm`` refuses CPU tensors) and on
CUDA with NCCL. ``tests/test_syncbn.py`` proves it against BatchNorm on the whole global batch;
``python syncbn_benchmark.py`` times it against BatchNorm plus the same two sums on the same transport.

The two sums. Forward: each rank's moments (n_r, m_r, M2_r) combine as Chan's parallel variance
(``_global_moments``), so one float64 sum of [n_r m_r, M2_r + n_r m_r^2, n_r] carries everything:
sums and counts, never means, so ranks may hold different numbers of samples, even none, and M2_r
stays exact at any offset (no E[x^2] - E[x]^2 in the input's precision). Backward: one sum of
[sum(dy), sum(dy * x_hat)] gives dx (``_input_grad``); dweight and dbias stay local sums, as in
PyTorch, for DDP to average.

The sums go through the layer's ``transport`` ("auto": this host's shared memory when every rank is
on it and the input on the CPU, else ``torch.distributed``), in buffers it allocated (``_Workspace``):
summed where they lie. Every operation costs a dispatch, as much as a pass over x at these sizes, so
on the CPU the per-channel arithmetic is one C call per step (``syncbn_channels.c`` of ``dpkit.native``,
compiled at first use), and on a contiguous (N, C) input the passes too: two calls
around each sum. Elsewhere (CUDA, no compiler, other shapes) each pass is a BatchNorm kernel and the
arithmetic PyTorch operations: the same formulas. Half inputs: statistics in float32, as BatchNorm.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from dpkit import compat
from dpkit.comm import transport as comm_transport
from dpkit.native import syncbn_channels

__all__ = ["SyncBatchNorm", "SyncBatchNormFunction", "convert_sync_batchnorm"]

_TOO_FEW_VALUES = "Expected more than 1 value per channel when training"


def _per_channel(vector: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """C values ((C) or (1, C)) as a tensor that broadcasts against x of shape (N, C, *)."""
    return vector if x.dim() == 2 else vector.view(-1, *(1,) * (x.dim() - 2))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are computed in at least float32: float16/bfloat16 inputs use float32, as BatchNorm does."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _as(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


@functools.lru_cache(maxsize=256)
def _constant(value: float, dtype: torch.dtype, device: torch.device, channels: int = 1) -> torch.Tensor:
    """A read-only tensor of ``channels`` times ``value``, made once: a Python number in a tensor operation
    costs a conversion each call, and every operation costs microseconds, as much as a pass over x at these
    sizes. Never written: every use reads it."""
    return torch.full((channels,), value, dtype=dtype, device=device)


def _check_dtypes(x, weight, bias, running_mean, running_var, eps) -> None:
    """Parameters of a dtype BatchNorm refuses for ``x`` raise BatchNorm's own error, before any communication."""
    for tensor in (weight, bias, running_mean, running_var):  # a loop: the common case costs no generator
        if tensor is not None and tensor.dtype != x.dtype:
            _probe_dtypes(x.device, x.dtype, *(None if t is None else t.dtype
                                               for t in (weight, bias, running_mean, running_var)))
            return


@functools.lru_cache(maxsize=64)
def _probe_dtypes(device, x, weight, bias, running_mean, running_var) -> None:
    """BatchNorm itself on a tiny probe of these dtypes: its dtype rules, its message. What passes is
    remembered (a raise is not), so that half inputs with float32 parameters pay for it once."""
    def probe(dtype):
        return None if dtype is None else torch.zeros(2, dtype=dtype, device=device)
    with torch.no_grad():
        torch.batch_norm(probe(x).view(1, 2).expand(2, 2), probe(weight), probe(bias), probe(running_mean),
                         probe(running_var), running_mean is None, 0.0, 1e-5, False)


# --------------------------------------------------------------------------- BatchNorm's kernels, CPU and CUDA alike
# Outside the C path every per-element pass is one of BatchNorm's own kernels, which exist on both devices
# (batch_norm_stats, batch_norm_elemt and batch_norm_backward_reduce do not exist on the CPU): the CPU tests run
# the CUDA code (tests/test_syncbn.py runs every case with the C functions and without). The per-channel
# arithmetic is then a handful of operations on (C) vectors, each a dispatch (a kernel launch on CUDA):
# ``python syncbn_benchmark.py --quick`` counts them per iteration ("operators"), and the C calls beside them.


def _local_moments(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-channel mean and biased variance (C each) in ``dtype``, from one fused pass over x.

    BatchNorm's statistics kernel: ``torch.var_mean`` gives the same but reduces over dimension 0 of
    an (N, C) input far slower on the CPU; compare ``python -m timeit -s "import torch;
    x = torch.randn(32, 1024)" "torch.var_mean(x, [0], correction=0)"`` with
    ``"torch.batch_norm_update_stats(x, None, None, 0.0)"``.
    """
    if x.dtype == dtype:
        return torch.batch_norm_update_stats(x, None, None, 0.0)
    # Half inputs: with float32 buffers the kernel returns float32 statistics. With momentum 0 it writes each
    # buffer back as it was, so one scratch pair (never read for a result) serves every call.
    return torch.batch_norm_update_stats(x, *_scratch(x.size(1), dtype, x.device), 0.0)


@functools.lru_cache(maxsize=64)
def _scratch(channels: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, channels, dtype=dtype, device=device).unbind()


class _Workspace:
    """The per-channel buffers of one layer size and transport, made once per (transport, C, dtype, device,
    thread) and reused by every call: each operation on them is in place or writes ``out=``, one dispatch with
    no allocation. What the transport sums lies in memory it allocated (``Transport.allocate``: on shared
    memory its arena, summed where it lies, with no copy in or out). Nothing in them outlives the pass that
    fills it (what backward needs is saved in fresh tensors), and one thread runs one pass at a time.

    ``packed`` (2C + 1, float64, the transport's): the forward's sums, blocks ``sum_x``, ``sum_square``,
    ``counted``. ``rows`` (3, C, the transport's): [-a, -b, 1] in backward, its first two rows ``sums``
    summed across ranks. ``coefficients`` (3, C): [gamma, alpha', s] computed from ``rows``
    (``_input_grad``); ``scaled`` (3, C) the same times invstd, for half inputs.
    """

    def __init__(self, channels: int, dtype: torch.dtype, device: torch.device, transport):
        # A transport that cannot take this device (shared memory, a GPU tensor) refuses it at its first sum.
        allocate = transport.allocate if transport is not None and transport.supports(device) else _plain_allocate
        self.packed = allocate(2 * channels + 1, dtype=torch.float64, device=device).zero_()
        self.sum_x, self.sum_square, self.counted = self.packed.split_with_sizes((channels, channels, 1))
        self.rows = allocate((3, channels), dtype=dtype, device=device).fill_(1)
        self.sums = self.rows[:2]
        self.coefficients = torch.empty(3, channels, dtype=dtype, device=device)
        self.gamma, self.alpha_prime, self.scale = self.coefficients.unbind()
        self.scaled = torch.empty(3, channels, dtype=dtype, device=device)  # half inputs: coefficients * invstd
        self.alpha = self.scaled[1]
        # Where the C functions (``syncbn_channels``) read and write them: the buffers never move.
        self.packed_at, self.rows_at, self.coefficients_at = (t.data_ptr() for t in (self.packed, self.rows,
                                                                                     self.coefficients))
        self.unused = (torch.empty(0, dtype=dtype, device=device), torch.empty(0, dtype=dtype, device=device))
        self.zeros = torch.zeros(channels, dtype=dtype, device=device)


def _plain_allocate(shape, *, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


# id(transport) -> {(C, dtype, device, thread): workspace}, dropped when the transport is collected (a closed one
# goes with its buffers); id(None): no transport (one process, the benchmark's synchronized path without collectives).
_WORKSPACES: dict[int, dict] = {}


def _workspace(channels: int, dtype: torch.dtype, device: torch.device, transport) -> _Workspace:
    key = (channels, dtype, device, threading.get_ident())
    known = _WORKSPACES.get(id(transport))  # by id, a plain dict's lookup: a WeakKeyDictionary's costs more
    if known is None:
        known = _WORKSPACES[id(transport)] = {}
        if transport is not None:  # its workspaces go with it, before its id can be reused
            weakref.finalize(transport, _WORKSPACES.pop, id(transport), None)
    work = known.get(key)
    if work is None:
        if len(known) > 64:  # threads and sizes come and go: forget the old ones
            known.clear()
        work = known[key] = _Workspace(channels, dtype, device, transport)
    return work


def _channel_functions(x: torch.Tensor, dtype: torch.dtype, *tensors: torch.Tensor | None):
    """``syncbn_channels``' C functions where they serve this call (x on the CPU, statistics in float32 or float64,
    every given per-channel tensor contiguous in that dtype), else None: PyTorch's operations do their work."""
    if x.device.type != "cpu" or _forced_path == "pytorch":
        return None
    functions = syncbn_channels.for_dtype(dtype)
    for tensor in tensors:
        if tensor is not None and (tensor.dtype != dtype or not tensor.is_contiguous()):
            return None
    return functions


# The C functions make BatchNorm's per-element passes too (``_normalize_in_c``, ``_grad_sums_in_c``,
# ``_input_grad_in_c``) on a contiguous x of shape (N, C), any float dtype: at any size on one intra-op
# thread (their loops, built for this CPU, keep up with BatchNorm's kernels), with more threads up to this many
# elements, where PyTorch's kernels gain little from them. ``python syncbn_benchmark.py --threads 2`` times both.
C_PASSES_ELEMENTS = 32768
# The three ways the layer runs on the CPU, each doing in Python more than the one before: "c", as above;
# "kernels", BatchNorm's kernels making the passes and the C functions the per-channel arithmetic (inputs of any
# other shape); "pytorch", PyTorch's operations doing both (CUDA, or no C compiler). ``forced_path`` picks one,
# so that ``syncbn_benchmark.py --settings paths`` can weigh each path's code against what it gains.
PATHS = ("c", "kernels", "pytorch")
_forced_path: str | None = None


@contextlib.contextmanager
def forced_path(name: str):
    """Within the block, this process's layers run by ``name`` (one of ``PATHS``) where a faster path would serve:
    the same formulas, another path (forward and backward both run inside the block)."""
    global _forced_path
    if name not in PATHS:
        raise ValueError(f"unknown path {name!r}: choose one of {', '.join(PATHS)}")
    before, _forced_path = _forced_path, name
    try:
        yield
    finally:
        _forced_path = before


def _passes_in_c(x: torch.Tensor, functions):
    """``syncbn_channels.Passes`` for x where the C functions make the passes over it too, else None."""
    if (functions is None or _forced_path in ("kernels", "pytorch") or x.dim() != 2 or not x.is_contiguous()
            or (x.numel() > C_PASSES_ELEMENTS and torch.get_num_threads() > 1)):
        return None
    return syncbn_channels.passes_for(x.dtype)


def _normalize_in_c(x, dtype: torch.dtype, weight, bias, eps: float, transport, running: tuple | None, passes):
    """The forward where ``syncbn_channels`` makes every pass (``_passes_in_c``): y and ``_global_moments``'s
    (mean, var, N), from two C calls around the sum. Its sums are those of ``_global_moments``, with S_r = n_r m_r
    summed in float64 from x rather than from m_r rounded to x's dtype."""
    batch, channels = x.shape
    work = _workspace(channels, dtype, x.device, transport)
    syncbn_channels.checked(passes.local_sums(x.data_ptr(), batch, channels, work.packed_at))
    if transport is not None:
        transport.all_reduce(work.packed)  # now the global sums, where they lie
    mean, var, y = torch.empty(channels, dtype=dtype), torch.empty(channels, dtype=dtype), torch.empty_like(x)
    running_mean, running_var, momentum = running or (None, None, 0.0)
    total = syncbn_channels.checked(passes.normalize(
        work.packed_at, channels, mean.data_ptr(), var.data_ptr(), _address(running_mean), _address(running_var),
        momentum, _address(weight), _address(bias), eps, x.data_ptr(), batch, y.data_ptr()))
    return y, mean, var, total


def _grad_sums_in_c(dy, x, mean, var, eps: float, total: int, transport, passes):
    """``_backward_sums`` and ``_minus_means`` in one C call (``_passes_in_c``): sum(dy), sum(dy * x_hat), and the
    workspace whose rows hold them times -1/N."""
    batch, channels = x.shape
    work = _workspace(channels, mean.dtype, x.device, transport)
    sum_dy, sum_dy_xhat = torch.empty(channels, dtype=mean.dtype), torch.empty(channels, dtype=mean.dtype)
    syncbn_channels.checked(passes.backward_sums(
        dy.data_ptr(), x.data_ptr(), mean.data_ptr(), var.data_ptr(), eps, batch, channels, total,
        sum_dy.data_ptr(), sum_dy_xhat.data_ptr(), work.rows_at))
    return sum_dy, sum_dy_xhat, work


def _input_grad_in_c(dy, x, weight, mean, var, eps: float, work: _Workspace, passes) -> torch.Tensor:
    """``_coefficients`` and ``_input_grad`` in one C call (``_passes_in_c``)."""
    grad = torch.empty_like(x)
    syncbn_channels.checked(passes.input_grad(
        dy.data_ptr(), x.data_ptr(), work.rows_at, _address(weight), mean.data_ptr(), var.data_ptr(), eps,
        x.size(0), x.size(1), grad.data_ptr()))
    return grad


def _global_moments(x: torch.Tensor, count: int, dtype: torch.dtype, transport, running: tuple | None,
                    functions) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The global batch's per-channel mean and biased variance (in ``dtype``) and its count N: one sum across ranks.
    ``running`` (running_mean, running_var, momentum): the running statistics to update with them, or None.

    Chan's parallel variance, rank r holding n_r values with mean m_r and M2_r = sum (x - m_r)^2:
        m = sum n_r m_r / N,    M2 = sum M2_r + sum n_r m_r^2 - N m^2.
    This rank sends [n_r m_r, M2_r + n_r m_r^2, n_r] (C, C, 1 -> 2C + 1) in float64. Only the
    between-rank term is a difference; in float64 it stays exact to float32's resolution for
    |m| / std up to about 1e4. The one input-precision rounding left is each m_r's, which moves the
    variance by at most 2 |m_r - m| u |m_r| (u the unit roundoff). An empty rank sends zeros and
    still joins. The mean and variance returned are fresh tensors (backward keeps them); N < 2: None, None, N.
    ``functions`` (``syncbn_channels``, or None for PyTorch's operations) do the per-channel arithmetic.
    """
    channels = x.size(1)
    work = _workspace(channels, dtype, x.device, transport)
    if count:
        mean, var = _local_moments(x, dtype)
    else:
        mean, var = torch.zeros(2, channels, dtype=dtype, device=x.device).unbind()
    if functions is None:
        return _moments_in_torch(mean, var, count, transport, running, work)
    functions.pack(mean.data_ptr(), var.data_ptr(), channels, count, work.packed_at)  # [n_r m_r, M2_r + .., n_r]
    if transport is not None:
        transport.all_reduce(work.packed)  # now the global sums, where they lie
    running_mean, running_var, momentum = running or (None, None, 0.0)
    # The global [m, M2 / N] into mean and var, where they lie, and the running statistics updated: one call.
    total = functions.combine(work.packed_at, channels, mean.data_ptr(), var.data_ptr(), _address(running_mean),
                              _address(running_var), momentum)
    return (mean, var, total) if total >= 2 else (None, None, total)


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _moments_in_torch(mean, var, count: int, transport, running: tuple | None, work: _Workspace):
    """``_global_moments`` in PyTorch's operations on the workspace, for where ``syncbn_channels`` does not serve."""
    channels, dtype, device = mean.size(0), mean.dtype, mean.device
    local = torch.cat((mean, var, _constant(1.0, dtype, device)))  # [m_r, v_r, 1]
    # A float64 factor: the product is float64, so n_r m_r is exact.
    torch.mul(local, _constant(count, torch.float64, device), out=work.packed)  # [n_r m_r, M2_r, n_r]
    work.sum_square.addcmul_(work.sum_x, work.sum_x, value=1.0 / count if count else 0.0)  # M2_r + (n_r m_r)^2 / n_r
    if transport is not None:
        transport.all_reduce(work.packed)  # now the global sums, where they lie
    total = int(work.counted)  # the same on every rank: all raise or none do
    if total < 2:
        return None, None, total
    work.sum_square.addcmul_(work.sum_x, work.sum_x, value=-1.0 / total).clamp_(min=0)  # M2 (float64)
    # [m, M2 / N, 1], divided in float64, then rounded once into local's (2C + 1) ``dtype`` values. (Two
    # operations: one ``torch.div(..., out=local)`` rounds through a float64 temporary, and takes longer.)
    local.copy_(work.packed.div_(_constant(total, torch.float64, device)))
    mean, var, _ = local.split_with_sizes((channels, channels, 1))
    if running is not None:
        _update_running_stats(*running[:2], mean, var, total, running[2])
    return mean, var, total


def _update_running_stats(running_mean, running_var, mean, var, total: int, momentum: float) -> None:
    """BatchNorm's update with the global statistics; the variance unbiased over the global count N."""
    running_mean.lerp_(_as(mean, running_mean.dtype), momentum)
    running_var.mul_(_constant(1 - momentum, running_var.dtype, running_var.device))
    running_var.add_(var, alpha=momentum * total / (total - 1))


_BATCH_NORM_BACKWARD = torch.ops.aten.native_batch_norm_backward.default  # the overload: no lookup per call


def _backward_sums(dy, x, weight, mean, var, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sum(dy) and sum(dy * x_hat) (C each, x_hat with the global statistics)."""
    if not x.numel():  # an empty rank still joins the collective
        zeros = mean.new_zeros(x.size(1))
        return zeros, zeros
    # In eval form (train=False) BatchNorm's backward kernel normalizes with the given statistics: its
    # weight gradient is sum(dy * (x - mean) * invstd), its bias gradient sum(dy).
    _, sum_dy_xhat, sum_dy = _BATCH_NORM_BACKWARD(
        dy, x, weight, mean, var, None, None, False, eps, [False, True, True])
    return sum_dy, sum_dy_xhat


def _minus_means(sum_dy, sum_dy_xhat, mean, total: int, transport, functions) -> _Workspace:
    """The workspace (of ``mean``'s dtype) whose ``rows`` hold [-sum(dy) / N, -sum(dy * x_hat) / N, 1] of this
    rank's sums: its ``sums`` (C, C -> 2C) summed across ranks make them -[a, b], the global means."""
    channels = mean.size(-1)
    work = _workspace(channels, mean.dtype, mean.device, transport)
    if functions is not None:
        functions.stage(sum_dy.data_ptr(), sum_dy_xhat.data_ptr(), channels, total, work.rows_at)
    else:
        torch.stack((sum_dy, sum_dy_xhat), out=work.sums)
        work.sums.mul_(_constant(-1.0 / total, mean.dtype, mean.device))
    return work


def _coefficients(work: _Workspace, weight, var, eps: float, functions) -> None:
    """``work.coefficients`` = [gamma, alpha', s] from ``work.rows`` = [-a, -b, 1] (the global sums): each row
    times s = weight * invstd (``_input_grad``). PyTorch: BatchNorm's inference kernel on the rows, with weight w,
    mean 0 and variance var, in one operation."""
    if functions is not None:
        functions.coefficients(work.rows_at, _address(weight), var.data_ptr(), eps, var.size(0), work.coefficients_at)
    else:
        torch.native_batch_norm(work.rows, weight, None, work.zeros, var, False, 0.0, eps,
                                out=(work.coefficients, *work.unused))


# float16/bfloat16: dx is made in float32 in this many slices of rows (``_half_input_grad``), a sixth of
# the batch, so that the float32 temporary is a fraction of dx's own size and peak memory stays BatchNorm's.
HALF_CHUNKS = 6


def _input_grad(dy, x, weight, mean, var, eps, work: _Workspace, functions) -> torch.Tensor:
    """dx = weight * invstd * (dy - a - x_hat * b) with the global a = sum(dy) / N, b = sum(dy * x_hat) / N.

    ``work.coefficients`` holds [gamma, alpha', s] (``_coefficients``): s = w * invstd, gamma = -s a,
    alpha' = -s b. Then dx = (x - mean) * invstd * alpha' + gamma + s * dy: BatchNorm's inference kernel
    (x in, the first term a new tensor) and one addcmul_, two passes. float16/bfloat16: ``_half_input_grad``.
    """
    if not x.numel():
        return torch.zeros_like(x)
    _coefficients(work, weight, var, eps, functions)
    if x.dtype == mean.dtype:
        grad = torch.native_batch_norm(x, work.alpha_prime, work.gamma, mean, var, False, 0.0, eps)[0]
        return grad.addcmul_(dy, _per_channel(work.scale, x))
    return _half_input_grad(dy, x, mean, var, eps, work)


def _half_input_grad(dy, x, mean, var, eps, work: _Workspace) -> torch.Tensor:
    """dx for a float16/bfloat16 x: dx = alpha * x + beta + s * dy summed in float32 and rounded once to x's dtype
    (the inference kernel would round its term before the second is added), a sixth of the rows at a time
    (``HALF_CHUNKS``) into dx itself: the float32 temporaries (the slice's terms, and the float32 copies of its
    half slices that the CPU's mixed-dtype arithmetic makes) are a fraction of dx's size, not twice it."""
    # The kernel once more, without weight, multiplies the coefficients by invstd: alpha = alpha' * invstd.
    torch.native_batch_norm(work.coefficients, None, None, work.zeros, var, False, 0.0, eps,
                            out=(work.scaled, *work.unused))
    alpha, scale = _per_channel(work.alpha, x), _per_channel(work.scale, x)
    beta = _per_channel(torch.addcmul(work.gamma, work.alpha, mean, value=-1), x)
    grad = torch.empty_like(x)  # x's memory format; its slices along dimension 0 keep it
    step = -(-x.size(0) // HALF_CHUNKS)
    for rows, x_rows, dy_rows in zip(grad.split(step), x.split(step), dy.split(step)):
        rows.copy_(torch.addcmul(beta, x_rows, alpha).addcmul_(dy_rows, scale))
    return grad


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization over the batch of every rank of ``transport`` (``None``: this process only).

    ``forward(x, weight, bias, running_mean, running_var, eps, momentum, transport)``: x is
    (N, C, *); weight and bias (C) or None; running_mean and running_var (C) are updated
    in place with factor ``momentum`` when given (None: no update); ``transport`` a
    ``transport.Transport`` over the ranks to synchronise. Every one of its ranks must call
    it, whatever its local N (0 included), and the same number of times; a global count of
    one value per channel raises ValueError on every rank.

    Saved for backward: x, weight and the global mean and variance (views of one 2C + 1
    vector), no more than BatchNorm saves. On CUDA, reading the global count (``.item()``) is
    one host synchronisation per forward: every rank needs it on the host to raise the same error.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, transport):
        _check_dtypes(x, weight, bias, running_mean, running_var, eps)
        channels = x.size(1)
        count = x.numel() // channels if channels else 0  # local values per channel
        dtype = _compute_dtype(x.dtype)
        weight = _as(weight, dtype)  # the kernels take half inputs with float32 parameters
        running = (running_mean, running_var, momentum) if running_mean is not None and momentum else None
        functions = _channel_functions(x, dtype, weight, bias, *(running or ())[:2])
        passes = _passes_in_c(x, functions)
        if passes is not None:
            y, mean, var, total = _normalize_in_c(x, dtype, weight, bias, eps, transport, running, passes)
        else:
            mean, var, total = _global_moments(x, count, dtype, transport, running, functions)
        if total == 1:
            where = " on this rank, and 1 value per channel over all ranks" if transport is not None else ""
            raise ValueError(f"{_TOO_FEW_VALUES}, got input size {x.shape}{where}")
        ctx.transport, ctx.total, ctx.eps, ctx.functions, ctx.passes = transport, total, eps, functions, passes
        ctx.dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        ctx.empty_channels = channels if total == 0 else None
        if total == 0:  # an empty global batch, as BatchNorm: empty output, statistics untouched
            return x.clone()
        ctx.save_for_backward(x, weight, mean, var)
        if passes is not None:
            return y
        # (x - mean) / sqrt(var + eps) * weight + bias in x's dtype and memory format: BatchNorm's inference kernel.
        return torch.native_batch_norm(x, weight, _as(bias, dtype), mean, var, False, 0.0, eps)[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        weight_dtype, bias_dtype = ctx.dtypes
        if ctx.empty_channels is not None:  # empty global batch: zero gradients, nothing to communicate
            zeros = dy.new_zeros(ctx.empty_channels)
            return (torch.zeros_like(dy) if need_x else None, _as(zeros, weight_dtype) if need_weight else None,
                    _as(zeros, bias_dtype) if need_bias else None, None, None, None, None, None)
        x, weight, mean, var = ctx.saved_tensors
        passes = ctx.passes if dy.dtype == x.dtype and dy.is_contiguous() else None  # (N, C) in C: dy as x
        if passes is not None:
            sum_dy, sum_dy_xhat, work = _grad_sums_in_c(dy, x, mean, var, ctx.eps, ctx.total, ctx.transport, passes)
        else:
            sum_dy, sum_dy_xhat = _backward_sums(dy, x, weight, mean, var, ctx.eps)  # local
            work = _minus_means(sum_dy, sum_dy_xhat, mean, ctx.total, ctx.transport, ctx.functions) if need_x else None
        grad_weight = _as(sum_dy_xhat, weight_dtype) if need_weight else None  # the local sums
        grad_bias = _as(sum_dy, bias_dtype) if need_bias else None
        grad_x = None
        if need_x:
            if ctx.transport is not None:
                ctx.transport.all_reduce(work.sums)  # rows becomes [-a, -b, 1] with the global a and b
            if passes is not None:
                grad_x = _input_grad_in_c(dy, x, weight, mean, var, ctx.eps, work, passes)
            else:
                grad_x = _input_grad(dy, x, weight, mean, var, ctx.eps, work, ctx.functions)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    r"""BatchNorm over the global batch of all ranks: a drop-in for ``torch.nn.BatchNorm1d/2d/3d``.

    Args are BatchNorm's (``num_features``, ``eps=1e-5``, ``momentum=0.1``, ``affine=True``,
    ``track_running_stats=True``, ``device``, ``dtype``, keyword ``bias=True``) plus
    ``process_group`` (default ``None``: the whole world) and keyword ``transport`` (default
    ``"auto"``; a name of ``transport.names()`` or a ``Transport`` over the group's ranks): what
    carries the sums, resolved by ``transport.resolve`` (a collective) at the first
    synchronized forward and kept; every rank must pass the same, or all of them raise
    ValueError there. A deep copy shares the process group and a ``Transport`` object, and
    resolves its own transport again.

    Same parameters, buffers and state_dict keys as BatchNorm (``weight``, ``bias``,
    ``running_mean``, ``running_var``, ``num_batches_tracked``), so state dicts load both
    ways. In training, the statistics are those of the global batch (one sum across ranks
    in forward, one in backward); ``running_var`` is updated with the unbiased variance
    over the global count; ``momentum=None`` is a cumulative moving average. When there is
    nobody to synchronise with (eval mode, world size 1, no initialised process group) it
    calls BatchNorm's own ``F.batch_norm``, as ``torch.nn.SyncBatchNorm`` does: eval mode
    uses the running statistics (without them, the local batch's), and nothing is communicated.

    Every rank of the group must call it in training mode, even with an empty local
    batch. Bad input (fewer than 2 dimensions, a channel count other than
    ``num_features``, a non-floating dtype, parameters of a dtype BatchNorm refuses for
    the input, with BatchNorm's error) raises before any communication.

    Note:
        The gradients of ``weight`` and ``bias`` are the local ones, as in PyTorch: wrap
        the model in DDP (or reduce them yourself) to combine them across ranks.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None, *, bias: bool = True,
                 transport="auto"):
        if compat.BATCHNORM_TAKES_BIAS:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        else:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
            if not bias:
                compat.drop_bias(self)
        self.process_group = process_group
        self.transport = transport
        # (id of the group, device type) -> (the group, weakly; its transport): resolved once per group and device.
        self._resolved: dict[tuple, tuple[weakref.ref, comm_transport.Transport | None]] = {}

    def reset_parameters(self) -> None:
        # BatchNorm's own, but for a bias that is None (``bias=False``), which releases without ``bias=`` reset too.
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def _check_input_dim(self, x) -> None:
        """Bad input fails here, on the rank that has it, before any communication."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"SyncBatchNorm expected a tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expected input of shape (N, C, *) with at least 2 dimensions, "
                             f"got {x.dim()}-D input of shape {tuple(x.shape)}")
        if x.size(1) != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) expected {self.num_features} channels in "
                             f"dimension 1, got {x.size(1)} (input shape {tuple(x.shape)})")
        if not x.is_floating_point():
            raise TypeError(f"SyncBatchNorm expected a floating-point input, got {x.dtype}")

    def _momentum(self) -> float | None:
        """BatchNorm's factor for the running statistics; counts the batch. None: no update."""
        if not (self.training and self.track_running_stats):
            return None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def _transport(self, x: torch.Tensor):
        """The transport to reduce over, or None when there is nobody else to talk to. Resolved (a collective)
        at the first synchronized forward on each device type, then reused."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        key = (id(group), x.device.type)
        known, chosen = self._resolved.get(key, (None, None))
        if known is None or known() is not group:  # never resolved, or a freed group's id reused
            chosen = None  # a group of one: nobody to synchronise with, remembered like a transport
            if dist.get_world_size(group) > 1:
                # Parameters of a dtype BatchNorm refuses for x raise here, before the collective (as they do later).
                _check_dtypes(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps)
                chosen = comm_transport.resolve(self.transport, group, x.device, engine="SyncBatchNorm")
            self._resolved[key] = (weakref.ref(group), chosen)
        return chosen

    def __getstate__(self):
        """Pickled and deep-copied without the resolved transports (shared memory is this process's)."""
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "_resolved": {}}

    def __deepcopy__(self, memo):
        """A copy shares the process group and a ``Transport`` passed as ``transport`` (where the ranks meet:
        neither can be copied) and resolves its own transport at its first synchronized forward."""
        for shared in (self.process_group, self.transport):
            if shared is not None and not isinstance(shared, str):
                memo.setdefault(id(shared), shared)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        transport = self._transport(input) if self.training else None  # before counting the batch: it may refuse
        momentum = self._momentum()
        if transport is None:
            # Nobody to synchronise with (eval mode, one process, world size 1): BatchNorm itself, as
            # torch.nn.SyncBatchNorm does. Eval uses the running statistics, or without them the batch's.
            running = not self.training or self.track_running_stats
            return F.batch_norm(input, self.running_mean if running else None, self.running_var if running else None,
                                self.weight, self.bias, self.training or self.running_mean is None, momentum or 0.0,
                                self.eps)
        update = momentum is not None
        return SyncBatchNormFunction.apply(input, self.weight, self.bias, self.running_mean if update else None,
                                           self.running_var if update else None, self.eps, momentum, transport)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def convert_sync_batchnorm(module: nn.Module, process_group=None, transport="auto") -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` by a ``SyncBatchNorm`` sharing its state
    (all of them summing through ``transport``, see ``SyncBatchNorm``).

    The new layers hold the same ``Parameter`` objects (an optimizer built before the
    conversion keeps working) and the same buffers, and keep the training flag. Returns
    ``module`` converted in place, or a new layer if ``module`` itself is a BatchNorm.
    """
    converted = module
    if isinstance(module, _BATCH_NORMS):
        if any(nn.parameter.is_lazy(t) for t in (*module.parameters(False), *module.buffers(False))):
            raise ValueError("convert_sync_batchnorm: run a forward pass through lazy BatchNorm layers first")
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group, device="meta",
                                  bias=module.bias is not None, transport=transport)
        for name in ("weight", "bias"):
            setattr(converted, name, getattr(module, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(converted, name, getattr(module, name))
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group, transport))
    return converted
