"""A communication thread: collectives run in the background, in order, in a process group of their own.

A transport made with ``background=True`` (``transport.SharedMemory``, ``allreduce.MessagePassing``)
runs every call on one ``CommThread``, so that ``async_op=True`` returns at once and the caller
computes while the thread sends, receives and adds::

    comm = CommThread(process_group, device, name="shm-comm")
    future = comm.submit(fn, *args)      # fn runs on the thread, after every earlier submission
    ...                                  # compute meanwhile
    comm.wait(future)                    # raises fn's error, or after the group's timeout
    comm.close()

* One thread per ``CommThread`` and a new process group over the same ranks (``comm.group``):
  calls submitted in the same order on every rank run in that order, and never interleave with
  the caller's collectives on the original group. Every member must create it, in the same order.
* The new group inherits the original group's timeout (``new_group`` would otherwise take the
  30-minute default), and ``wait`` gives up after that timeout too: nothing waits forever.
* ``enabled=False`` runs every submitted call inline (the same code path, no overlap).
* On CUDA the thread uses the caller's device and its default stream, as the caller does.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from dpkit.comm.process_groups import new_subgroups


def group_timeout(process_group, device: torch.device) -> float | None:
    """Seconds of ``process_group``'s timeout (None for a backend that does not expose it)."""
    group = process_group or dist.group.WORLD
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


class CommThread:
    """One background thread and a process group of its own over ``process_group``'s ranks (see the module
    docstring)."""

    def __init__(self, process_group, device: torch.device, *, enabled: bool = True, name: str = "comm"):
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.timeout_s = group_timeout(process_group, device)
        self.group = new_subgroups(process_group, [ranks], self.timeout_s, device)[0]
        # On CUDA the thread must use this rank's device (a new thread starts on device 0).
        init = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix=name, initializer=init[0], initargs=init[1])
                          if enabled else None)
        self._in_use: list[tuple[Future, tuple]] = []  # collectives' arguments, kept until done (see submit)
        self._finalizer = weakref.finalize(self, _shutdown, self._executor)

    @property
    def enabled(self) -> bool:
        return self._executor is not None

    def submit(self, fn, *args, **kwargs) -> Future:
        """``fn(*args, **kwargs)`` on the communication thread (inline when not enabled).

        The thread lets go of ``args`` before it completes the future, and the caller's thread
        keeps them until it has seen the future done (``drop_finished``): so every buffer of a
        collective is freed by the thread that allocated it, at a point the caller chooses, not
        when the other thread happens to drop it. (``measure.PeakMemory`` sees only the calling
        thread's frees: a buffer the other thread freed counted as alive until the end of the step.)
        """
        if self._executor is None:
            future = Future()
            future.set_result(fn(*args, **kwargs))
            return future
        box = [args]
        future = self._executor.submit(lambda: fn(*box.pop(), **kwargs))
        self._in_use.append((future, args))
        return future

    def wait(self, future: Future):
        """``future``'s result, raising its exception, or TimeoutError after the process group's timeout."""
        try:
            return future.result(timeout=self.timeout_s)
        finally:
            self.drop_finished()

    def drop_finished(self) -> None:
        """Let go of the arguments of the calls that are done (see ``submit``)."""
        self._in_use = [entry for entry in self._in_use if not entry[0].done()]

    def close(self, wait: bool = True) -> None:
        """Stop the thread once the queued calls are done; ``wait``: join it (each call is bounded by the
        group's timeout). Idempotent; also run, without joining, when the object is garbage collected."""
        self._finalizer.detach()
        if self._executor is not None:
            self._executor.shutdown(wait=wait)


def _shutdown(executor: ThreadPoolExecutor | None) -> None:
    if executor is not None:
        executor.shutdown(wait=False)
