"""How one process reads what another has just written: a copy out of shared memory, or process_vm_readv.

    python -m dpkit.bench.peer_read                                    # 512 KiB and 1 MiB, 200 reads each way
    python -m dpkit.bench.peer_read --bytes 1048576 --reads 400 --json results/peer_read.json

Why it exists: the backend moves a message through shared memory in two copies, the sender's into its slot and
each receiver's out of it. A single-copy path, where a receiver reads the sender's own tensor with
``process_vm_readv`` (Linux's cross-memory attach, as Open MPI's ``smsc/cma`` does), would save the first copy;
it pays only where that one read costs less than the two copies. This probe times the read itself. Two
processes: in each turn the writer fills its private buffer and a shared one (the data freshly written, in the
writer's cache, as a peer's tensor is when a collective starts); then the reader either reads the private
buffer with ``process_vm_readv`` or copies the shared one out, alternately, each read checked. A row: the median
seconds of one way at one size; the paired ratio (median of the ratios of adjacent turns, 95 % bootstrap
interval) says which way is faster. Where the kernel refuses the read (ptrace rules), the probe says so.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing
import os
import time

import numpy as np
import torch

from dpkit.bench.measure import format_ratio, paired_ratio
from dpkit.bench.results import environment, format_environment, write_results

WAYS = ("process_vm_readv", "copy out of shared memory")
TIMEOUT_S = 60.0  # a turn that takes longer means the other process is gone: stop, do not hang


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _process_vm_readv():
    """libc's process_vm_readv, typed; None where libc has none (not Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    read = getattr(libc, "process_vm_readv", None)
    if read is not None:
        read.restype = ctypes.c_ssize_t
        read.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                         ctypes.c_ulong, ctypes.c_ulong]
    return read


def _await(turn: np.ndarray, value: int) -> None:
    """Spin until ``turn[0] == value`` (two processes, one core each), or TimeoutError."""
    deadline = time.monotonic() + TIMEOUT_S
    while turn[0] != value:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other process did not reach turn {value} within {TIMEOUT_S:g} s")


def _writer(shared: mmap.mmap, words: mmap.mmap, nbytes: int, turns: int, pipe) -> None:
    """Fill a private and a shared buffer with the turn's number before each of the reader's ``turns`` reads."""
    torch.set_num_threads(1)
    turn = np.frombuffer(words, np.int64)
    own = torch.zeros(nbytes // 4)
    public = torch.frombuffer(shared, dtype=torch.float32, count=nbytes // 4)
    pipe.send((os.getpid(), own.data_ptr()))
    for t in range(1, turns + 1):
        _await(turn, 2 * t - 1)
        own.fill_(t)
        public.fill_(t)
        turn[0] = 2 * t  # written: the reader's turn


def measure(nbytes: int, reads: int) -> dict[str, list[float]]:
    """Seconds of each of ``reads`` reads of ``nbytes`` per way (alternating, the first a process_vm_readv), or
    RuntimeError saying why the kernel refused one."""
    read = _process_vm_readv()
    shared, words = mmap.mmap(-1, nbytes), mmap.mmap(-1, 8)  # anonymous: shared with the fork, no file anywhere
    turn = np.frombuffer(words, np.int64)
    mine, theirs = multiprocessing.get_context("fork").Pipe()
    writer = multiprocessing.get_context("fork").Process(target=_writer, args=(shared, words, nbytes, 2 * reads,
                                                                                theirs), daemon=True)
    writer.start()
    try:
        if not mine.poll(TIMEOUT_S):
            raise TimeoutError("the writer did not start")
        pid, address = mine.recv()
        into = torch.empty(nbytes // 4)
        public = torch.frombuffer(shared, dtype=torch.float32, count=nbytes // 4)
        local, remote = _IoVec(into.data_ptr(), nbytes), _IoVec(address, nbytes)
        seconds = {way: [] for way in WAYS}
        for t in range(1, 2 * reads + 1):
            turn[0] = 2 * t - 1
            _await(turn, 2 * t)
            way = WAYS[(t - 1) % 2]
            start = time.perf_counter()
            if way == WAYS[0]:
                got = read(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) if read else -1
                if got != nbytes:
                    raise RuntimeError(f"process_vm_readv read {got} of {nbytes} bytes: "
                                       f"{os.strerror(ctypes.get_errno()) if read else 'not in this libc'}")
            else:
                into.copy_(public)
            seconds[way].append(time.perf_counter() - start)
            if into[0].item() != t or into[-1].item() != t:
                raise RuntimeError(f"turn {t}: read {into[0].item()}, {into[-1].item()}, not {t}")
    except BaseException:
        writer.kill()  # it waits for a turn that will not come
        raise
    finally:
        writer.join(timeout=TIMEOUT_S)
    return seconds


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, nargs="+", default=[1 << 19, 1 << 20],
                        help="sizes of one read, multiples of 4 (default: %(default)s)")
    parser.add_argument("--reads", type=int, default=200, help="reads per way and size (default: %(default)s)")
    parser.add_argument("--json", default=None, help="write the rows here in the shared layout (default: none)")
    args = parser.parse_args(argv)
    if args.reads < 1 or any(n < 4 or n % 4 for n in args.bytes):
        parser.error("--reads must be positive and --bytes positive multiples of 4")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    env = environment("none", "cpu", 2)
    print(format_environment(env))
    rows = []
    for nbytes in args.bytes:
        try:
            seconds = measure(nbytes, args.reads)
        except RuntimeError as refused:
            print(f"{nbytes:>9} B  {WAYS[0]} not measured: {refused}")
            continue
        ratio = paired_ratio(seconds[WAYS[0]], seconds[WAYS[1]])
        for way in WAYS:
            rows.append({"bytes": nbytes, "way": way, "p50_s": float(np.median(seconds[way])), "reads": args.reads,
                         "vs_copy": ratio["median"] if way == WAYS[0] else 1.0,
                         "vs_copy_ci_low": ratio["ci_low"] if way == WAYS[0] else 1.0,
                         "vs_copy_ci_high": ratio["ci_high"] if way == WAYS[0] else 1.0})
            print(f"{nbytes:>9} B  {way:<28} {rows[-1]['p50_s'] * 1e6:9.1f} us")
        print(f"{nbytes:>9} B  {WAYS[0]} / {WAYS[1]}: {format_ratio(ratio)}")
    if args.json:
        write_results(args.json, "peer_read", env, vars(args), rows)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
