"""Task 1: ranks print in order through the real torchrun, using point-to-point messages only."""

import pytest
import torch
import torch.distributed as dist

from common import OFF_HOST, CollectiveCounter, run_torchrun, run_workers
from sequential_print import run_sequential, transcript


def expected_output(nproc: int, order: str, num_iter: int) -> list[str]:
    """The specification, written out independently of the module: each iteration prints ranks
    0..N-1 (updown: then N-1..0), one "Process r" line each; iterations are separated by "---"."""
    ranks = list(range(nproc)) + (list(range(nproc - 1, -1, -1)) if order == "updown" else [])
    iteration = "\n".join(f"Process {r}" for r in ranks)
    return "\n---\n".join([iteration] * num_iter).split("\n")


def test_transcript_of_three_processes_two_iterations_updown():
    assert transcript(3, num_iter=2, order="updown") == [
        "Process 0", "Process 1", "Process 2", "Process 2", "Process 1", "Process 0", "---",
        "Process 0", "Process 1", "Process 2", "Process 2", "Process 1", "Process 0",
    ]


# Every torchrun job costs seconds of importing torch per process: one runs by default (both directions of the
# order), two more with `python -m pytest -m slow` (one process; more processes than cores).
CASES = [pytest.param(2, "updown"), pytest.param(1, "up", marks=pytest.mark.slow),
         pytest.param(3, "up", marks=pytest.mark.slow)]


@pytest.mark.parametrize("nproc, order", CASES)
def test_torchrun_output_is_exactly_the_specified_lines(nproc, order):
    result = run_torchrun("sequential_print.py", nproc, "--num-iter", "3", "--order", order)
    assert result.stdout.splitlines() == expected_output(nproc, order, num_iter=3)
    expected = expected_output(nproc, order, num_iter=3)
    assert transcript(nproc, num_iter=3, order=order) == expected, "what --json records"


def _print_and_count(ctx):
    with CollectiveCounter() as counter:
        run_sequential(ctx.rank, ctx.world_size, num_iter=2, order="updown")
    run_sequential(ctx.rank, ctx.world_size, device=OFF_HOST)  # the token goes through host memory, as on CUDA
    return {"calls": dict(counter.calls), "wrong_token": _wrong_token(ctx)}


def _wrong_token(ctx):
    """Rank 0 hands rank 1 a token of the wrong turn; rank 1, printing in a world of 2, must refuse it."""
    if ctx.rank == 0:
        dist.send(torch.tensor([41]), dst=1)
    if ctx.rank != 1:
        return None
    try:
        run_sequential(ctx.rank, 2)
    except Exception as error:
        return type(error).__name__, str(error)
    return None


@pytest.fixture(scope="module")
def three_ranks():
    return run_workers(_print_and_count, 3)


def test_only_send_and_recv_are_used(three_ranks):
    calls = [result["calls"] for result in three_ranks]
    # One token passes between consecutive different printers: 0>1>2, 2>1>0, then 0>1>2, 2>1>0
    # with the hand-over 0 -> 0 between iterations needing no message.
    assert calls[0] == {"send": 2, "recv": 2}
    assert calls[1] == {"send": 4, "recv": 4}
    assert calls[2] == {"send": 2, "recv": 2}


def test_a_token_of_the_wrong_turn_raises_a_real_error_not_an_assert(three_ranks):
    """``assert`` disappears under ``python -O``; the protocol check must not."""
    kind, message = three_ranks[1]["wrong_token"]
    assert kind == "RuntimeError" and "expected the token of turn 0 from rank 0, got 41" in message
