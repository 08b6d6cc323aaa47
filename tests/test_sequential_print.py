"""Task 1: ranks print in order through the real torchrun, using point-to-point messages only."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from common import CollectiveCounter, run_torchrun, run_workers
from sequential_print import run_sequential, transcript


def test_transcript_of_three_processes_two_iterations_updown():
    assert transcript(3, num_iter=2, order="updown") == [
        "Process 0", "Process 1", "Process 2", "Process 2", "Process 1", "Process 0", "---",
        "Process 0", "Process 1", "Process 2", "Process 2", "Process 1", "Process 0",
    ]


CASES = [(nproc, order) for nproc in (1, 2, 3, 5) for order in ("up", "updown")]


@pytest.fixture(scope="module")
def torchrun_runs():
    """All torchrun jobs of this file, two at a time: each starts with seconds of importing torch
    in one process, so a pair keeps both cores busy."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {(nproc, order): pool.submit(run_torchrun, "sequential_print.py", nproc, "--num-iter", "3", "--order", order)
                for nproc, order in CASES}


@pytest.mark.parametrize("nproc, order", CASES)
def test_torchrun_output_is_exactly_the_transcript(torchrun_runs, nproc, order):
    result = torchrun_runs[nproc, order].result()
    assert result.stdout.splitlines() == transcript(nproc, num_iter=3, order=order)


def _print_and_count(ctx):
    with CollectiveCounter() as counter:
        run_sequential(ctx.rank, ctx.world_size, num_iter=2, order="updown")
    return dict(counter.calls)


def test_only_send_and_recv_are_used():
    calls = run_workers(_print_and_count, 3)
    # One token passes between consecutive different printers: 0>1>2, 2>1>0, then 0>1>2, 2>1>0
    # with the hand-over 0 -> 0 between iterations needing no message.
    assert calls[0] == {"send": 2, "recv": 2}
    assert calls[1] == {"send": 4, "recv": 4}
    assert calls[2] == {"send": 2, "recv": 2}
