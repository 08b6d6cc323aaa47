"""The public contracts of ``dpkit.train`` that hold in one process, against plain single-process autograd; the
distributed ones (checkpoints, validation, every engine's loop) are checked by tests/test_ddp_cifar100.py."""

import dataclasses
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpkit.train.metrics import StepMeter
from dpkit.train.parallel import Parallel
from dpkit.train.step import epoch_seed, forward_backward, optimizer_step


class _Counting(nn.Linear):
    """A layer with a ``no_sync()`` that records each entry, as the engines' wrappers have."""

    def __init__(self):
        super().__init__(6, 5)
        self.no_sync_entered = 0

    @contextmanager
    def no_sync(self):
        self.no_sync_entered += 1
        yield


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, generator=gen), torch.randint(0, 5, (4,), generator=gen)


def test_forward_backward_adds_the_window_mean_gradient_and_skips_communication_until_the_window_ends():
    torch.manual_seed(0)
    model = _Counting()
    images, labels = _batch()
    window = 12  # samples of the whole window on this rank: each micro-batch adds its share of the mean
    first = forward_backward(model, images, labels, window, sync=False)
    second = forward_backward(model, images, labels, window, sync=True)
    assert model.no_sync_entered == 1, "no_sync on the micro-batch that does not end the window only"
    oracle = nn.Linear(6, 5)
    oracle.load_state_dict({k: v for k, v in model.state_dict().items()})
    want = F.cross_entropy(oracle(images).double(), labels, reduction="sum")
    (2 * F.cross_entropy(oracle(images), labels, reduction="sum") / window).backward()
    assert first.dtype == torch.float64 and not first.requires_grad
    torch.testing.assert_close(first, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(second, first)
    torch.testing.assert_close(model.weight.grad, oracle.weight.grad)


def test_forward_backward_under_bfloat16_autocast_computes_the_logits_in_bfloat16():
    model = _Counting()
    seen = []
    model.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    images, labels = _batch()
    forward_backward(model, images, labels, 4, sync=True, dtype=torch.bfloat16)
    forward_backward(model, images, labels, 4, sync=True)
    assert seen == [torch.bfloat16, torch.float32] and model.weight.grad.dtype == torch.float32


def test_optimizer_step_steps_and_clears_the_gradients():
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.ones(1, 3)).sum().backward()
    optimizer_step(model, optimizer)  # a plain module: nothing to synchronise
    assert model.weight.grad is None
    torch.testing.assert_close(model.weight.detach(), before - 0.5)


def test_epoch_seed_is_a_pure_function_of_seed_epoch_and_rank():
    assert epoch_seed(0, 1, 2) == epoch_seed(0, 1, 2)
    assert len({epoch_seed(s, e, r) for s in (0, 1) for e in (0, 1) for r in (0, 1)}) == 8
    assert all(0 <= epoch_seed(0, e, 0) < 2**63 for e in range(4))


def test_parallel_is_named_values_that_refuse_unknown_engines():
    parallel = Parallel("pytorch", "zero1", 4.0, "torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallel.engine = "fsdp"
    with pytest.raises(ValueError, match="unknown impl 'mine': choose one of ours, pytorch"):
        Parallel("mine")
    with pytest.raises(ValueError, match="unknown engine 'zero3': choose one of ddp, zero1, zero2, fsdp, hsdp"):
        Parallel(engine="zero3")
    with pytest.raises(ValueError, match="'zero2' has no 'pytorch' implementation: it has ours"):
        Parallel("pytorch", "zero2")


# The spellings of before the names were unified: unknown names now, like any other.
@pytest.mark.parametrize("impl, engine, refused", [
    ("selfmade", "ddp", "unknown impl 'selfmade': choose one of ours, pytorch"),
    ("ours", "none", "unknown engine 'none': choose one of ddp, zero1, zero2, fsdp, hsdp"),
    ("pytorch", "zero", "unknown engine 'zero': choose one of ddp, zero1, zero2, fsdp, hsdp")])
def test_parallel_refuses_an_old_spelling_as_an_unknown_name_listing_the_known_ones(impl, engine, refused):
    with pytest.raises(ValueError, match=f"Parallel: {refused}"):
        Parallel(impl, engine)


def test_step_meter_measures_memory_through_the_probe_steps_then_times_each_step():
    meter = StepMeter(torch.device("cpu"), probe_steps=2)
    kept = torch.zeros(1 << 16)  # 256 KiB allocated under the probe
    meter.stepped()
    assert meter.probing and meter.step_times == []
    meter.stepped()  # the last probed step: closes the profiler, not timed
    assert not meter.probing and meter.step_times == [] and meter.peak_bytes >= kept.numel() * 4
    meter.epoch_starts()
    meter.stepped()
    assert len(meter.step_times) == 1 and meter.step_times[0] >= 0
    meter.close()  # idempotent: every path out of a trainer calls it
