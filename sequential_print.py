"""Homework Task 1: N processes print their ranks in a fixed order, enforced with point-to-point messages only.

    torchrun --nproc_per_node 4 sequential_print.py --num-iter 2 --order updown

prints (4 processes, two iterations, up then down):

    Process 0
    Process 1
    Process 2
    Process 3
    Process 3
    Process 2
    Process 1
    Process 0
    ---
    Process 0
    ...

A token travels along the printing order: a process waits for it (``recv``), prints and
flushes its line, then hands the token on (``send``). Because a line is written to the
shared stdout before the token leaves, the order holds in torchrun's merged output too.
No barrier or other collective is used. The environment header goes to stderr so that
stdout holds exactly the printed lines.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from dpkit.bench.results import environment, format_environment, write_results
from dpkit.comm.process_groups import add_common_args, distributed, message_device, parse_checked


def print_order(size: int, order: str = "up") -> list[int]:
    """The ranks in the order they print during one iteration."""
    up = list(range(size))
    if order == "up":
        return up
    if order == "updown":
        return up + up[::-1]
    raise ValueError(f"unknown order {order!r}: choose up or updown")


def transcript(size: int, num_iter: int = 1, order: str = "up") -> list[str]:
    """Exactly the lines ``run_sequential`` prints, in order, across all processes."""
    one = [f"Process {rank}" for rank in print_order(size, order)]
    lines = []
    for iteration in range(num_iter):
        lines += one + (["---"] if iteration < num_iter - 1 else [])
    return lines


def run_sequential(rank: int, size: int, num_iter: int = 1, order: str = "up",
                   device: str | torch.device = "cpu") -> None:
    """Print ``Process {rank}`` at this rank's turns; iterations are separated by a ``---`` line.

    ``turns`` is the global printing sequence over all iterations. The token sent from
    turn i to turn i + 1 carries i, so each receiver checks that no turn was skipped.
    Consecutive turns of the same rank (the middle of ``updown``) need no message.
    """
    one = print_order(size, order)
    turns = one * num_iter
    token = torch.zeros(1, dtype=torch.int64, device=message_device(device))
    for i, turn in enumerate(turns):
        if turn != rank:
            continue
        if i > 0 and turns[i - 1] != rank:
            dist.recv(token, src=turns[i - 1])
            if token.item() != i - 1:  # a real check, not an assert: python -O must not remove it
                raise RuntimeError(f"rank {rank}: expected the token of turn {i - 1} from rank {turns[i - 1]}, got "
                                   f"{token.item()}: the ranks disagree on the printing order (run every rank with "
                                   "the same --num-iter and --order)")
        print(f"Process {rank}", flush=True)
        if (i + 1) % len(one) == 0 and i + 1 < len(turns):
            print("---", flush=True)
        if i + 1 < len(turns) and turns[i + 1] != rank:
            token.fill_(i)
            dist.send(token, dst=turns[i + 1])


def main(ctx, args) -> None:
    if ctx.is_master:
        env = environment(ctx.backend, ctx.device, ctx.world_size)
        print(format_environment(env), file=sys.stderr, flush=True)
    run_sequential(ctx.rank, ctx.world_size, args.num_iter, args.order, ctx.device)
    if ctx.is_master and args.json:
        lines = transcript(ctx.world_size, args.num_iter, args.order)
        rows = [{"line": i, "text": text} for i, text in enumerate(lines)]
        write_results(args.json, "sequential_print", env, vars(args), rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-iter", type=int, default=1, help="iterations, separated by '---' (default: %(default)s)")
    parser.add_argument("--order", choices=("up", "updown"), default="up",
                        help="up: ranks 0..N-1; updown: 0..N-1 then N-1..0 in each iteration (default: %(default)s)")
    add_common_args(parser, json_help="rank 0 writes the printed lines here in the shared JSON layout")
    args = parse_checked(parser, argv)
    if args.num_iter < 1:
        parser.error("--num-iter must be at least 1")
    return args


if __name__ == "__main__":
    args = parse_args()
    with distributed(args.backend, args.timeout, args.device) as ctx:
        main(ctx, args)
