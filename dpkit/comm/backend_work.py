"""Work: what a call of the "dpkit" backend returns, and the queue that runs the calls of one group in order.

    queue = CallQueue("dpkit group 0")
    work = queue.submit(lambda: slots.all_reduce(flat, "sum"), result=[tensor])   # returns at once
    work.wait()                        # runs it here if no thread has taken it yet, else waits for it

Every collective of a group goes into its ``CallQueue``, in the order the program calls them (so on every rank
the same order, as gloo's one work queue per group keeps it). Who runs a call:
- the caller, in ``submit``: a call whose caller said it waits at once (``async_op=False``, most calls; torch
  passes it as ``opts.asyncOp``) runs before ``submit`` returns when nothing is queued before it, and no other
  thread is woken;
- the caller, in ``wait()``: a queued call whose result is waited for at once;
- the queue's thread, when nobody waits for it within ``HANDOVER_S``: an ``async_op=True`` call goes on while the
  caller does something else (computes, or receives from a peer that must first reach this collective).
Either way a call runs once, after every call queued before it.

A call that raises breaks the queue: that call's work and every later one fail with ``BrokenGroupError`` naming
the first failure (``on_failure`` tells the backend, which tells its peers). A work answers every question torch
may ask of one (``is_completed``, ``is_success``, ``exception``, ``result``, ``source_rank``, ``get_future``).
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from typing import Callable

import numpy as np
import torch

from dpkit.comm.process_groups import PeerFailedError

HANDOVER_S = 2e-4  # how long a call waits for its caller to run it before the queue's thread does


class BrokenGroupError(PeerFailedError):
    """A call of a group after one of its calls failed on this rank or a peer: the ranks no longer agree on
    which message is which, so nothing is sent."""


class Work:
    """One call: run once by ``CallQueue``; its result, or its error, kept for whoever asks."""

    def __init__(self, run: Callable[[], None], result: list | None, queue: "CallQueue | None"):
        self._run, self._result, self._queue = run, result if result is not None else [], queue
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None  # made when asked for (most calls never are)
        self._future_lock = threading.Lock()

    def execute(self) -> BaseException | None:
        """Run the call (on whichever thread the queue chose); its error, if it raised. ``finish`` completes it."""
        try:
            with torch.no_grad():  # tensors that require grad (DDP under create_graph) are written in place
                self._run()
        except BaseException as error:  # noqa: BLE001  (kept for every waiter; the queue breaks first)
            return error
        return None

    def finish(self, error: BaseException | None) -> None:
        """Complete the call: wake its waiters, complete its future (with ``error`` when it failed)."""
        self._error = error
        with self._future_lock:
            self._done.set()
            future = self._future
        if future is not None:
            _complete(future, self._result, error)

    # ---- what torch asks (the C++ Work forwards each of these; see dpkit/native/c10d_backend.cpp)

    def wait(self, timeout_ms: int = 0) -> bool:
        """Block until the call completed (running it here when it is next and nobody runs it); raise its error."""
        if not self._done.is_set() and self._queue is not None:
            self._queue.run_until(self)
        if not self._done.wait(timeout_ms / 1000 if timeout_ms else None):
            raise TimeoutError(f"backend 'dpkit': a call did not complete within the {timeout_ms} ms given to wait")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        return -1  # only a receive from any source has one (``Delegated``)

    def get_future(self) -> torch.futures.Future:
        """A future completed with the result (the tensors, as gloo's), or with the error, when the call is."""
        with self._future_lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done.is_set():
                    _complete(self._future, self._result, self._error)
            return self._future


def _complete(future: torch.futures.Future, result: list, error: BaseException | None) -> None:
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class CallQueue:
    """The calls of one group, run in order (see the module docstring). ``on_failure(error)`` is told of the first
    call that raises; from then on every call fails at once with ``BrokenGroupError``."""

    def __init__(self, name: str, on_failure: Callable[[BaseException], None] = lambda error: None):
        self.name = name
        self._on_failure = on_failure
        self._pending: collections.deque[tuple[float, Work]] = collections.deque()
        self._running = threading.RLock()  # held by whichever thread runs calls: one at a time, in order (a
        # future's callback that waits for a later call runs it on the same thread)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.broken: str | None = None
        self.outstanding = np.zeros(1, np.int64)  # calls submitted and not yet run: the C++ fast path reads it
        # (it runs a call itself only when none is, so that calls run in program order)

    def submit(self, run: Callable[[], None], result: list | None = None, now: bool = False) -> Work:
        """Queue ``run`` (a call's communication; its arguments already checked); a Work for it. ``now``: its caller
        waits for it at once, so when no call is queued before it, it runs here and now, and the queue's thread is
        not woken (waking it costs more than a short call)."""
        self.refuse_if_broken()
        work = Work(run, result, self)
        if now and self.outstanding[0] == 0:
            with self._running:
                self.outstanding[0] += 1
                self._execute(work)
            return work
        with self._wake:
            self.outstanding[0] += 1
            self._pending.append((time.monotonic(), work))
            self._start_thread()
            self._wake.notify()
        return work

    def refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise BrokenGroupError(f"{self.name}: refused: the group is broken since a collective failed "
                                   f"({self.broken}); make a new group")

    def break_(self, why: str) -> None:
        """From now on refuse every call, naming ``why`` (a peer's failure, told by the shared memory)."""
        if self.broken is None:
            self.broken = why

    def run_until(self, work: Work) -> None:
        """Run the queued calls, in order, up to and including ``work`` (unless another thread is running it)."""
        while not work.is_completed():
            with self._running:
                with self._wake:
                    if not self._pending or not any(w is work for _, w in self._pending):
                        return  # the queue's thread took it: the caller waits for it to complete
                    _, next_work = self._pending.popleft()
                self._execute(next_work)

    def _execute(self, work: Work) -> None:
        if self.broken is not None:
            self.outstanding[0] -= 1
            work.finish(BrokenGroupError(f"{self.name}: not run: the group broke before this call ({self.broken})"))
            return
        error = work.execute()
        if error is not None:  # broken before anyone hears of the failure, here or (told) on the peers
            self.break_(f"{type(error).__name__}: {error}")
            self._on_failure(error)
        self.outstanding[0] -= 1  # before its waiter wakes: its next call may take the fast path
        work.finish(error)

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"{self.name} calls", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        """The queue's thread: run each call nobody ran within ``HANDOVER_S`` of its submission."""
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                queued, work = self._pending[0]
                left = queued + HANDOVER_S - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
            with self._running:
                with self._wake:
                    if not self._pending or self._pending[0][1] is not work:
                        continue  # its caller ran it meanwhile
                    self._pending.popleft()
                self._execute(work)

    def close(self) -> None:
        """Stop the thread after the calls already queued have been run or failed."""
        with self._wake:
            pending = [w for _, w in self._pending]
            self._pending.clear()
            self._closed = True
            self._wake.notify_all()
        for work in pending:
            work.finish(BrokenGroupError(f"{self.name}: not run: the group was shut down"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class Delegated:
    """A work of gloo's (the backend's point-to-point calls), answering as ``Work`` does."""

    def __init__(self, work):
        self._work = work

    def wait(self, timeout_ms: int = 0) -> bool:
        return self._work.wait(datetime.timedelta(milliseconds=timeout_ms)) if timeout_ms else self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_completed() and self._work.exception() is None

    def exception(self):
        return self._work.exception()

    def result(self) -> list:
        return self._work.result()

    def source_rank(self) -> int:
        return self._work._source_rank()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()
