"""ddp_cifar100.py with injected faults, for the fault-injection tests (never for training).

    DP_FAULTS=forward@1,allreduce@4 torchrun --standalone --nproc_per_node 2 --max-restarts 2 \
        tests/faulty_ddp_cifar100.py --dataset synthetic --checkpoint-dir ckpt ...

takes the same flags as ``ddp_cifar100.py``. ``DP_FAULTS`` lists one fault per torchrun attempt:
the i-th fires in attempt i (``TORCHELASTIC_RESTART_COUNT``), so one job can die several times
in different places. A fault is ``point@n``:

* ``forward@n``: the last rank is SIGKILLed inside the first training forward after n optimizer steps;
* ``allreduce@n``: the last rank is SIGKILLed right after launching a gradient bucket's
  asynchronous all-reduce, after n optimizer steps (the all-reduce is in flight);
* ``scatter@n``: the last rank is SIGKILLed as it enters the second scatter of epoch n's validation;
* ``checkpoint@n``: rank 0 is SIGKILLed halfway through writing epoch n's checkpoint;
* ``slow-checkpoint@n``: rank 0's write of epoch n's checkpoint first sleeps ``DP_SLOW_S`` seconds;
* ``readonly@0``: every write under ``--checkpoint-dir`` fails with PermissionError, as in a
  read-only directory (the tests run as root, for whom permission bits do not apply).

The patches wrap functions from outside (Trainer.__init__, torch.distributed.all_reduce and
scatter, CommThread.submit, torch.save, open), so the trainer itself carries no test plumbing.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ddp_cifar100  # noqa: E402
from dpkit.comm import shared_memory  # noqa: E402

RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
LAST = WORLD - 1
trainer: ddp_cifar100.Trainer | None = None  # the job's Trainer, once built


def die(what: str) -> None:
    print(f"rank {RANK}: fault injected: SIGKILL {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def current_fault() -> tuple[str, int] | None:
    faults = [f for f in os.environ.get("DP_FAULTS", "").split(",") if f]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(faults):
        return None
    point, n = faults[attempt].split("@")
    return point, int(n)


def install(point: str, n: int, checkpoint_dir: str | None) -> None:
    original_init = ddp_cifar100.Trainer.__init__

    def init(self, *args, **kwargs):
        global trainer
        trainer = self
        original_init(self, *args, **kwargs)
        if point == "forward" and RANK == LAST:
            first = next(self.module.children())  # inside the forward: after the first layer
            first.register_forward_hook(lambda m, i, o: die(f"in the forward after step {n}")
                                        if m.training and self.step == n else None)

    ddp_cifar100.Trainer.__init__ = init

    if point == "allreduce" and RANK == LAST:
        all_reduce, sum_chunk = dist.all_reduce, shared_memory.sum_chunk

        def all_reduce_then_die(tensor, *args, **kwargs):  # torch's: the bucket's sum in flight
            work = all_reduce(tensor, *args, **kwargs)
            if kwargs.get("async_op") and trainer is not None and trainer.step == n:
                die(f"with a bucket's all-reduce in flight after step {n}")
            return work

        def sum_then_die(*args, **kwargs):  # one host: in the middle of a shared-memory sum
            if trainer is not None and trainer.step == n:
                die(f"in the middle of a bucket's shared-memory sum after step {n}")
            return sum_chunk(*args, **kwargs)

        dist.all_reduce, shared_memory.sum_chunk = all_reduce_then_die, sum_then_die

    if point == "scatter" and RANK == LAST:
        scatter, calls = dist.scatter, {}

        def scatter_then_die(*args, **kwargs):
            epoch = trainer.epoch + 1  # validation runs before the epoch counts as done
            calls[epoch] = calls.get(epoch, 0) + 1
            if epoch == n and calls[epoch] == 2:
                die(f"in the second scatter of epoch {n}'s validation")
            return scatter(*args, **kwargs)

        dist.scatter = scatter_then_die

    if point in ("checkpoint", "slow-checkpoint") and RANK == 0:
        save = torch.save

        def faulty_save(obj, f, *args, **kwargs):
            if not (isinstance(obj, dict) and obj.get("epoch") == n and "optimizer" in obj):
                return save(obj, f, *args, **kwargs)
            if point == "slow-checkpoint":
                time.sleep(float(os.environ["DP_SLOW_S"]))
                return save(obj, f, *args, **kwargs)
            whole = io.BytesIO()
            save(obj, whole, *args, **kwargs)
            f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            f.flush()
            die(f"halfway through writing epoch {n}'s checkpoint")

        torch.save = faulty_save

    if point == "readonly" and checkpoint_dir:
        root, real_open = os.path.abspath(checkpoint_dir), builtins.open

        def read_only_open(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+") and os.path.abspath(str(file)).startswith(root):
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return real_open(file, mode, *args, **kwargs)

        builtins.open = read_only_open


if __name__ == "__main__":
    args = ddp_cifar100.parse_args()
    fault = current_fault()
    if fault is not None:
        install(*fault, args.checkpoint_dir)
    ddp_cifar100.run(args)
