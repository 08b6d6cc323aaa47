"""A shared file: one rank makes it, its peers map it, and no name ever points at it; the ranks' records in it.

    fd = make(nbytes, allocate=True)          # the maker; OSError ENOSPC when /dev/shm has no room
    words = describe(fd)                      # what it publishes: (pid, start time, PID namespace, fd)
    fd = attach(words, nbytes)                # a peer, through /proc/<pid>/fd/<fd>; Refused, saying why
    sign(record)                              # each rank, in its record of the file, before its first call
    wait_for(records, target, rank, timeout_s)    # every rank posted call ``target``, or PeerFailedError

The maker opens /dev/shm with O_TMPFILE (memfd_create where the kernel cannot): the file lives in
/dev/shm's tmpfs and counts against its size, but has no name, so a process killed at any moment
leaves nothing behind and nobody deletes a path read from outside. A peer maps it only if it is what
the maker said: a regular file of this user, private to it, of the expected size, with no name, held
by the process that started when the words say (a recycled pid is refused). Whoever can write the
store through which the words travel can at worst make the set-up fail.

Every rank keeps a record of RECORD_WORDS int64 in the file: its counter first, its identity (pid,
start time, PID namespace) and a broken word last. A wait names a peer that broke at once (its counter
went negative: ``mark_broken``), a late one whose process is gone within LOOK_S (same namespace, and its
pid no longer has that start time), any other late one at the timeout; and then this rank breaks too.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from typing import Sequence

import numpy as np

from dpkit.comm.process_groups import PeerFailedError, start_time

SHM_DIRECTORY = "/dev/shm"
RECORD_WORDS = 16  # int64 words per rank: two cache lines
COUNTER = 0  # how far the rank got; negative once it broke
PID, STARTED, PID_NAMESPACE, BROKEN = 12, 13, 14, 15  # words 1 to 11 are the caller's
BREAKS = ("", "timeout", "dead peer", "mismatch", "peer broken", "other")  # the broken word indexes this
LOOK_S = 0.1  # how often a wait looks in /proc for late peers' processes
_SLEEP_S = 5e-5  # a wait's pause between polls, once spinning and yielding found nobody


class Refused(RuntimeError):
    """A peer's shared file that this rank will not map; the message says why."""


# ---- the file


def make(nbytes: int, allocate: bool = False, directory: str = SHM_DIRECTORY) -> int:
    """A descriptor of a new file of ``nbytes`` that no name points at (close it once every peer attached).
    ``allocate``: its pages exist now (a full /dev/shm says ENOSPC here, not SIGBUS at a first write);
    else it is sparse. OSError when it cannot be made."""
    fd = _anonymous(directory)
    try:
        os.fchmod(fd, 0o600)  # memfd_create makes it 0777, and a peer refuses a file others may open
        os.ftruncate(fd, nbytes)
        if allocate:
            os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _anonymous(directory: str) -> int:
    """A file with no name in ``directory`` (O_TMPFILE); where the kernel or the file system cannot make one, a
    memfd (no name either, but counted against memory rather than /dev/shm's size)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):  # what a kernel without it says
            raise
    return os.memfd_create("dpkit", os.MFD_CLOEXEC)


def describe(fd: int) -> tuple[int, int, int, int]:
    """What the maker publishes so that peers can attach its file ``fd``: (pid, start time, PID namespace, fd)."""
    pid = os.getpid()
    return pid, start_time(pid) or 0, pid_namespace(), fd


def to_text(words: Sequence[int]) -> str:
    return " ".join(str(int(w)) for w in words)


def from_text(text: str) -> tuple[int, ...]:
    """``describe``'s words from ``to_text``'s text; Refused for anything else."""
    if not re.fullmatch(r"\d+ \d+ \d+ \d+", text, re.ASCII):
        raise Refused(f"{text[:80]!r} does not describe a shared file (pid, start time, PID namespace, fd)")
    return tuple(int(w) for w in text.split())


def attach(words: Sequence[int], nbytes: int) -> int:
    """A descriptor of the file ``describe`` gave ``words`` for, after checking it is the maker's anonymous
    file of ``nbytes``; Refused, saying why, for any other (nothing is mapped, nothing is deleted)."""
    pid, started, namespace, number = (int(w) for w in words)
    if namespace != pid_namespace():
        raise Refused("ranks in different PID namespaces cannot open each other's shared file")
    _check_maker(pid, started)
    path = f"/proc/{pid}/fd/{number}"
    try:
        before = os.stat(path)
        if not stat.S_ISREG(before.st_mode):  # not even opened: opening a device or a fifo can act
            raise Refused(f"{path} is not a regular file")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as error:
        raise Refused(f"cannot open {path} ({error.strerror}): the maker closed it or died, or this process "
                      "may not see its files") from None
    try:
        _check_maker(pid, started)  # still that process: a pid is not reused while its process lives
        _check_file(os.fstat(fd), nbytes, (before.st_dev, before.st_ino))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_maker(pid: int, started: int) -> None:
    if start_time(pid) != started:
        raise Refused(f"process {pid} is not the one that made the shared file: it is gone, or its pid was reused")


def _check_file(found: os.stat_result, nbytes: int, identity: tuple[int, int]) -> None:
    wrong = [what for what, bad in (
        ("not a regular file", not stat.S_ISREG(found.st_mode)),
        (f"owned by uid {found.st_uid}, not {os.geteuid()}", found.st_uid != os.geteuid()),
        (f"mode {stat.S_IMODE(found.st_mode):o} lets others in", found.st_mode & 0o077),
        (f"{found.st_size} bytes where {nbytes} were expected", found.st_size != nbytes),
        (f"{found.st_nlink} name(s) point at it", found.st_nlink != 0),
        ("replaced while it was opened", (found.st_dev, found.st_ino) != identity)) if bad]
    if wrong:
        raise Refused("the shared file is not what its maker made: " + ", ".join(wrong))


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 if unknown): pids and start times compare only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


# ---- the ranks' records: ``records`` is an (n, RECORD_WORDS) int64 view of the file, row r rank r's


def sign(record: np.ndarray) -> None:
    """Write this process's identity into its record, for peers to tell whether it is still alive."""
    pid = os.getpid()
    record[PID], record[STARTED], record[PID_NAMESPACE] = pid, start_time(pid) or 0, pid_namespace()


def gone(records: np.ndarray, ranks: Sequence[int]) -> list[int]:
    """Those of ``ranks`` whose process is gone: signed, in this PID namespace, and their pid now names no process
    or one that started at another time. A peer in another namespace is never judged (its pid means nothing here)."""
    mine = pid_namespace()
    return [r for r in ranks if records[r, PID] > 0 and mine and records[r, PID_NAMESPACE] == mine
            and start_time(int(records[r, PID])) != int(records[r, STARTED])]


def mark_broken(record: np.ndarray, code: str, passed: int) -> None:
    """This rank's calls failed (``code`` in BREAKS) after it passed call ``passed``: its counter becomes
    ``-1 - passed``, so a peer's wait for a later call stops at once and names the code, while a peer still in
    an earlier one (whose data this rank posted) completes it. The first failure stays."""
    if record[BROKEN] == 0:
        record[BROKEN] = BREAKS.index(code)
        record[COUNTER] = -1 - passed  # after the code: a peer that sees it sees the code (x86 keeps stores in order)


def reached(counters: Sequence[int]) -> list[int]:
    """The last call each rank posted: its counter, or for a rank that broke the last one it passed."""
    return [c if c >= 0 else -1 - c for c in counters]


def wait_for(records: np.ndarray, target: int, rank: int, timeout_s: float, spins: int = 0) -> None:
    """Returns once every rank posted call ``target``. Else PeerFailedError naming the ranks that hold it up (at
    once for one that broke before it, within LOOK_S for one whose process is gone, after ``timeout_s`` for one
    late), and this rank's record is marked broken. ``spins``: polls before yielding the core."""
    counters, polls, deadline, look = records[:, COUNTER], 0, 0.0, 0.0
    while True:
        low = min(counters.tolist())
        if low >= target or (low < 0 and _past_the_broken(records, target, rank)):
            return
        polls += 1
        if polls <= spins:
            continue
        if polls <= spins + 1000:
            os.sched_yield()  # a peer may need this core
            continue
        time.sleep(_SLEEP_S)
        now = time.monotonic()
        deadline = deadline or now + timeout_s
        if now < look and now < deadline:
            continue
        look = now + LOOK_S
        late = [r for r, c in enumerate(reached(counters.tolist())) if c < target]
        _fail_if_dead(records, rank, target, late)
        if now > deadline and late:
            _fail(records, rank, target, "timeout", f"a peer failed, diverged or stopped answering: rank(s) {late} "
                  f"did not reach the shared-memory collective within the {timeout_s:g} s process-group timeout "
                  "(this rank timed out waiting)")  # " timeout ": the words torch's own tests look for


def _past_the_broken(records: np.ndarray, target: int, rank: int) -> bool:
    """Whether every rank posted call ``target``, counting those that broke after it; raises naming any that
    broke before it (it never will)."""
    counters = records[:, COUNTER].tolist()
    stopped = [(r, BREAKS[min(int(records[r, BROKEN]), len(BREAKS) - 1)]) for r, c in enumerate(counters)
               if c < 0 and -1 - c < target]
    if stopped:  # a peer that broke because another died: name the dead one, as that peer did
        _fail_if_dead(records, rank, target, [r for r, c in enumerate(reached(counters)) if c < target])
        _fail(records, rank, target, "peer broken", "a peer failed: " + ", ".join(
            f"rank {r} broke off ({code})" for r, code in stopped)
            + ": a call of the shared-memory collective failed there, so no later call can pair with it")
    return min(reached(counters)) >= target


def _fail_if_dead(records: np.ndarray, rank: int, target: int, late: list[int]) -> None:
    dead = gone(records, late)
    if dead:
        _fail(records, rank, target, "dead peer", f"a peer failed: rank(s) {dead} did not reach the "
              "shared-memory collective: their process is gone (killed or crashed)")


def _fail(records: np.ndarray, rank: int, target: int, code: str, why: str) -> None:
    mark_broken(records[rank], code, target - 1)
    raise PeerFailedError(f"rank {rank}/{len(records)}: {why}")
