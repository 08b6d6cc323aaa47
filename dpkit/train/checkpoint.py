"""Checkpoints of a data-parallel run: written durably by rank 0 after every epoch, resumed at start from the
newest one that loads, refused when another run wrote it, never deleted when unreadable (set aside instead).

    checkpoints = Checkpoints("ckpt", timeout_s=1800, restart_from_scratch=False, identity={"lr": 0.01})
    resumed = checkpoints.resume(device)            # every rank: (path, state) or None
    checkpoints.save(epoch, state if ctx.is_master else None)   # every rank; raises CheckpointError on all

The ranks wait for rank 0's checkpoint I/O in a gloo group of their own whose timeout is the
checkpoint's, so slow shared storage is not a peer failure. A checkpoint holds no RNG state:
every draw of the trainer is a function of (seed, epoch, rank).
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from dpkit.bench.results import write_durably
from dpkit.comm.process_groups import print0

CHECKPOINTS_KEPT = 2


class CheckpointError(RuntimeError):
    """The checkpoint directory cannot be resumed from or written to (raised on every rank)."""


def save_atomically(obj, path: str) -> None:
    """``torch.save`` through ``write_durably``: a reader never sees half a file."""
    write_durably(path, lambda f: torch.save(obj, f))


def checkpoint_path(directory: str, epoch: int) -> str:
    return os.path.join(directory, f"epoch-{epoch:04d}.pt")


def checkpoint_epochs(directory: str) -> list[int]:
    """Epochs with a checkpoint in ``directory``, newest first."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted((int(m.group(1)) for m in map(re.compile(r"epoch-(\d+)\.pt$").match, names) if m), reverse=True)


def scan_checkpoints(directory: str) -> tuple[int, list[tuple[str, str]]]:
    """The newest epoch whose checkpoint loads (0 for none), and (path, why) of every newer one that does not."""
    unreadable = []
    for epoch in checkpoint_epochs(directory):
        path = checkpoint_path(directory, epoch)
        try:
            torch.load(path, map_location="cpu", weights_only=True)
            return epoch, unreadable
        except Exception as error:  # truncated, corrupt, or written by a torch this one cannot read
            unreadable.append((path, f"{type(error).__name__}: {str(error).strip()[:200]}"))
    return 0, unreadable


def choose_checkpoint(directory: str, restart_from_scratch: bool) -> tuple[str | None, list[str]]:
    """Rank 0: the checkpoint to resume from (None: start from scratch) and notices for the log.

    Unreadable checkpoints newer than the chosen one are set aside (renamed ``*.unreadable``,
    never deleted) so this run's new checkpoints cannot replace them. When there are
    checkpoints and none loads, raises ``CheckpointError`` unless ``restart_from_scratch``:
    training from scratch would silently throw their progress away.
    """
    epoch, unreadable = scan_checkpoints(directory)
    if unreadable and not epoch and not restart_from_scratch:
        listing = "\n".join(f"  {path}: {why}" for path, why in unreadable)
        raise CheckpointError(
            f"--checkpoint-dir {directory}: no checkpoint in it can be read, so resuming would lose their progress:\n"
            f"{listing}\nIf another torch version wrote them, resume with that version. To train from scratch "
            "anyway, add --restart-from-scratch (the unreadable files are kept, renamed *.unreadable).")
    notices = []
    for path, why in unreadable:
        aside = f"{path}.unreadable"
        if os.path.exists(aside):
            aside = f"{aside}.{os.getpid()}"
        os.replace(path, aside)
        notices.append(f"checkpoint {path} unreadable ({why}): kept as {aside}")
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if re.match(r"epoch-\d+\.pt\.tmp\d+$", name):  # left by a writer that was killed mid-save
            os.remove(os.path.join(directory, name))
    return (checkpoint_path(directory, epoch) if epoch else None), notices


class Checkpoints:
    """The checkpoints of one run in ``directory``; every method is a collective of every rank.

    ``identity`` is what a checkpoint must match to be resumed (everything that shapes the
    trajectory); ``timeout_s`` bounds the ranks' wait for rank 0's saves and loads.
    """

    def __init__(self, directory: str, timeout_s: float, restart_from_scratch: bool = False,
                 identity: dict | None = None):
        self.directory, self.restart_from_scratch, self.identity = directory, restart_from_scratch, identity or {}
        # Checkpoint I/O on shared storage may take minutes: the ranks wait for it in a group of
        # their own with a long timeout, not in the training group's short one.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.written: list[str] = []  # checkpoints this run wrote, oldest first: the only ones it prunes

    def resume(self, device: torch.device) -> tuple[str, dict] | None:
        """The newest checkpoint rank 0 can read, loaded on every rank: (path, state), or None for none.
        Raises ``CheckpointError`` on every rank when none can be read (see ``choose_checkpoint``)
        and ``ValueError`` when it belongs to another run."""
        choice = None
        if dist.get_rank() == 0:
            try:
                choice = choose_checkpoint(self.directory, self.restart_from_scratch)
            except (CheckpointError, OSError) as error:
                choice = str(error)
        choice = self._from_rank0(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        path, notices = choice
        for notice in notices:
            print0(f"NOTICE: {notice}")
        if path is None:
            return None
        state = torch.load(path, map_location=device, weights_only=True)
        dist.barrier(group=self.group)  # the slowest rank's load
        saved = state["identity"]
        different = {k for k in self.identity.keys() | saved.keys() if self.identity.get(k) != saved.get(k)}
        if different:
            raise ValueError(f"checkpoint {path} belongs to a different run ({', '.join(sorted(different))} differ): "
                             "use a fresh --checkpoint-dir")
        print0(f"resumed from {path}: {state['epoch']} epoch(s), {state['step']} optimizer step(s) done")
        return path, state

    def save(self, epoch: int, state: dict | None) -> None:
        """Rank 0 writes ``state`` (None on the other ranks) as epoch ``epoch``'s checkpoint and prunes; every
        rank waits for it and raises ``CheckpointError`` if it failed.

        Durably (``write_durably``: a temporary file, fsync, rename, fsync of the directory); the oldest
        checkpoint this run wrote beyond the newest ``CHECKPOINTS_KEPT`` is deleted, never another's."""
        failure = None
        if dist.get_rank() == 0:
            path = checkpoint_path(self.directory, epoch)
            try:
                save_atomically({**state, "identity": self.identity}, path)
                self.written.append(path)
                while len(self.written) > CHECKPOINTS_KEPT:
                    os.remove(self.written.pop(0))
            except OSError as error:
                failure = str(error)
        failure = self._from_rank0(failure)  # the peers wait here, however slow the storage
        if failure:
            raise CheckpointError(f"saving the checkpoint of epoch {epoch} failed on rank 0: {failure}")

    def _from_rank0(self, value):
        """Rank 0's ``value`` (picklable) on every rank, through the checkpoint group's long timeout."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
