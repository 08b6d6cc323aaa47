"""Homework Tasks 2 and 3: data-parallel CIFAR-100 training with our DDP and SyncBatchNorm, or PyTorch's.

    torchrun --standalone --nproc_per_node 2 ddp_cifar100.py --dataset synthetic --train-size 8192 --val-size 2048 --num-epochs 2
    torchrun --nproc_per_node 2 ddp_cifar100.py --num-epochs 16 --grad-accum-steps 4 --distributed-impl selfmade  # the homework solution's run
    torchrun --nproc_per_node 2 ddp_cifar100.py --num-epochs 16 --grad-accum-steps 4 --distributed-impl pytorch
    torchrun --standalone --nproc_per_node 2 ddp_cifar100.py --dataset synthetic --sharding fsdp   # or zero
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 3 \
        ddp_cifar100.py --checkpoint-dir ckpt --metrics-json m.json    # survives killed workers (pytorch#135712)

Both implementations run the same loop (``Trainer``) from the same start: the model is built after
``torch.manual_seed(seed)`` on every rank, ``DistributedSampler`` orders the data, and dropout draws from
a generator reseeded from (seed, epoch, rank), so a resumed run draws the same. With the same seed, world
size and thread count two CPU runs give bit-identical parameters (deterministic algorithms on; gloo adds
the ranks in a fixed order). Where each choice is made and why:

* the data (``choose_dataset``: CIFAR-100 from disk or download; ``--dataset auto`` falls back to the
  synthetic set loudly and the metrics record which was used);
* the engines (``wrap_model``: ``ddp.DDP`` or PyTorch's DDP, ``--sharding zero|fsdp``, all through one
  ``--transport``) and the BatchNorm flavour (``resolve_sync_bn``; PyTorch's needs CUDA tensors);
* gradient accumulation (``micro_batch_plan``: ``no_sync`` on micro-batches, for both DDPs);
* validation (``validation_sums``: rank 0 scatters the set, one float64 sum, exact for any world size);
* checkpoints (``choose_checkpoint``, ``Trainer._save_checkpoint``: durable, resumed on restart, never deleted when
  unreadable) and the measurements (``summarize``).

Faults (killed workers mid-step, slow or read-only storage) are injected from outside by
``tests/faulty_ddp_cifar100.py``, which runs this script with patched functions.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import statistics
import textwrap
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
# At the top, before the process group exists (half a second per process): imported after it, one of its
# functions would keep the default group as a default argument after teardown (see process_groups.teardown).
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from dpkit.bench.measure import PeakMemory, gather_rows
from dpkit.bench.results import environment, format_environment, markdown_table, write_durably, write_results
from dpkit.comm import transport as transports
from dpkit.comm.process_groups import add_common_args, distributed, parse_checked, print0, progress, synchronize
from dpkit.engines.ddp import broadcast_module_state, make_ddp
from dpkit.engines.fsdp import FSDP
from dpkit.engines.zero import ShardedOptimizer
from dpkit.models import NUM_CLASSES, build_model
from syncbn import convert_sync_batchnorm

# Per-channel mean and standard deviation of the CIFAR-100 training images (pixels in [0, 1]).
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_FILES = ("train", "test", "meta")
CIFAR100_SIZES = {True: 50_000, False: 10_000}  # train, test
# A dead network must fail in seconds; a slow download may take minutes, so the other ranks
# wait for it in a group of their own with this timeout, not the short training timeout.
DOWNLOAD_SOCKET_TIMEOUT_S = 20.0
DOWNLOAD_WAIT_S = 900.0
CHECKPOINTS_KEPT = 2
# Peak memory is measured from before resuming and wrapping through this optimizer step. On
# CPU, gloo's buffers for an all_reduce in flight overlap backward's allocations by timing,
# so one step's peak varies by a gradient or two; the maximum over several steps is steadier.
MEMORY_PROBE_STEPS = 4
# Shared storage can be slow: rank 0's checkpoint saves and loads may take this long (--checkpoint-timeout).
CHECKPOINT_WAIT_S = 1800.0
SHARDINGS = ("none", "zero", "fsdp")
# What --sharding fsdp shards (ours and PyTorch's): nearly all of the CNN's and resnet18's parameters.
FSDP_SHARD_TYPES = (nn.Conv2d, nn.Linear)


# --------------------------------------------------------------------------- data


class SyntheticCIFAR100(Dataset):
    """A learnable stand-in for CIFAR-100: 3x32x32 images in 100 classes, made on the fly, no files.

    Each class has a fixed smooth random pattern (its prototype). Image i is its class's
    prototype shifted by up to 4 pixels each way, plus noise six times stronger than the pattern,
    clamped to [0, 1] like real pixels, then normalised with CIFAR-100's constants. The noise
    images come from a fixed bank of 1,024, so a sample costs a few tensor operations.
    Everything is a function of (seed, split, index): identical on every rank and in every
    run, and a smaller set is a prefix of a bigger one. Train and validation share the
    prototypes, not the samples. On two ranks (global batch 128) the homework's CNN goes from
    chance (1 %) to about 38 % validation accuracy in two epochs of 8,192 images, 54 % in three.
    """

    SHIFT = 4        # pixels, each way
    SIGNAL = 0.04    # prototype amplitude (pixel units; prototypes have unit std)
    NOISE = 0.25     # noise std (pixel units)
    BANK = 1024      # distinct noise images

    def __init__(self, size: int, train: bool, seed: int = 0):
        shared = np.random.default_rng((seed, 0))
        low = torch.from_numpy(shared.standard_normal((NUM_CLASSES, 3, 4, 4), dtype=np.float32))
        prototypes = F.interpolate(low, size=(32, 32), mode="bicubic", align_corners=False)
        self.prototypes = prototypes / prototypes.std()  # (100, 3, 32, 32)
        self.noise = torch.from_numpy(shared.standard_normal((self.BANK, 3, 32, 32), dtype=np.float32))
        split = 1 if train else 2
        self.targets = np.random.default_rng((seed, split, 0)).integers(NUM_CLASSES, size=size).tolist()
        self.shifts = np.random.default_rng((seed, split, 1)).integers(-self.SHIFT, self.SHIFT + 1, size=(size, 2)).tolist()
        self.noise_index = np.random.default_rng((seed, split, 2)).integers(self.BANK, size=size).tolist()
        self.mean = torch.tensor(CIFAR100_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR100_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        pattern = torch.roll(self.prototypes[self.targets[i]], shifts=tuple(self.shifts[i]), dims=(1, 2))
        image = (0.5 + self.SIGNAL * pattern + self.NOISE * self.noise[self.noise_index[i]]).clamp_(0, 1)
        return (image - self.mean) / self.std, self.targets[i]


def cifar100_on_disk(data_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(data_dir, CIFAR100_FOLDER, name)) for name in CIFAR100_FILES)


def load_cifar100(data_dir: str, train: bool) -> Dataset:
    """One CIFAR-100 split from ``<data_dir>/cifar-100-python``, read by torchvision's CIFAR100 code.

    torchvision checks the md5 of each extracted file, which rejects files written by tests or
    converted elsewhere; the subclass turns that check off (``check_integrity(path, None)``
    only checks that the file exists) and keeps everything else: the pickle parsing, the
    HWC layout, ``ToTensor`` and ``Normalize``. Downloads keep their md5 checks.
    """
    if not cifar100_on_disk(data_dir):
        folder = os.path.join(os.path.abspath(data_dir), CIFAR100_FOLDER)
        raise FileNotFoundError(f"CIFAR-100 not found: {folder} must contain the files {', '.join(CIFAR100_FILES)} "
                                "(the extracted cifar-100-python.tar.gz)")
    # torchvision is imported here, not at the top: importing it costs seconds per process.
    from torchvision import transforms
    from torchvision.datasets import CIFAR100

    class LocalCIFAR100(CIFAR100):
        train_list = [[name, None] for name, _ in CIFAR100.train_list]
        test_list = [[name, None] for name, _ in CIFAR100.test_list]
        meta = {**CIFAR100.meta, "md5": None}

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR100_MEAN, CIFAR100_STD)])
    return LocalCIFAR100(data_dir, train=train, transform=transform)


def download_cifar100(data_dir: str) -> str | None:
    """Download and extract CIFAR-100 into ``data_dir`` (md5 checked). None on success, else why not."""
    from torchvision.datasets import CIFAR100

    created = not os.path.exists(data_dir)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_SOCKET_TIMEOUT_S)
    try:
        CIFAR100(data_dir, train=True, download=True)
        return None
    except Exception as error:  # no network, DNS, HTTP, disk or checksum errors all mean "not available"
        if created and os.path.isdir(data_dir) and not os.listdir(data_dir):
            os.rmdir(data_dir)  # leave no empty directory behind
        return f"{type(error).__name__}: {error}"
    finally:
        socket.setdefaulttimeout(previous)


def _everywhere(flag: bool, ctx, group=None) -> bool:
    """True when ``flag`` is true on every rank (an all_reduce MIN); the flag itself without a process group."""
    if not dist.is_initialized():
        return flag
    device = ctx.device if group is None else torch.device("cpu")
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def choose_dataset(requested: str, data_dir: str, ctx, download: bool = True) -> tuple[str, list[str]]:
    """The data set every rank trains on, 'cifar100' or 'synthetic', and notices for the log and metrics.

    All ranks take part and agree. When CIFAR-100 is missing, each node's local rank 0
    downloads it while the other ranks wait (in a gloo group with a long timeout); nodes that
    share one file system should download it beforehand.
    ``requested='cifar100'`` raises ``FileNotFoundError`` instead of falling back.
    """
    if requested == "synthetic":
        return "synthetic", []
    present = _everywhere(cifar100_on_disk(data_dir), ctx)
    failure = "not on disk, and downloading is off"
    if not present and download:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=DOWNLOAD_WAIT_S)) if dist.is_initialized() else None
        failure = download_cifar100(data_dir) if ctx.local_rank == 0 else "see local rank 0's download error"
        _everywhere(True, ctx, group)  # the wait for every node's download
        present = _everywhere(cifar100_on_disk(data_dir), ctx)
    if present:
        return "cifar100", []
    where = os.path.join(os.path.abspath(data_dir), CIFAR100_FOLDER)
    if requested == "cifar100":
        raise FileNotFoundError(f"--dataset cifar100: CIFAR-100 is not in {where} and could not be downloaded "
                                f"({failure}). Put the extracted files there, or use --dataset synthetic or auto.")
    return "synthetic", [f"CIFAR-100 is not in {where} and could not be downloaded ({failure}): training on a "
                         "SYNTHETIC CIFAR-shaped data set instead; its accuracies are not CIFAR-100 accuracies"]


def build_datasets(name: str, data_dir: str, train_size: int | None, val_size: int | None,
                   with_val: bool) -> tuple[Dataset, Dataset | None]:
    """The training split (every rank) and the validation split (only where ``with_val``: rank 0 scatters it)."""
    def split(train: bool, size: int | None) -> Dataset:
        if name == "synthetic":
            return SyntheticCIFAR100(CIFAR100_SIZES[train] if size is None else size, train)
        full = load_cifar100(data_dir, train)
        if size is None:
            return full
        if size > len(full):
            raise ValueError(f"asked for {size} {'training' if train else 'validation'} images, the split has {len(full)}")
        return Subset(full, range(size))

    return split(True, train_size), (split(False, val_size) if with_val else None)


def train_loader(train_set: Dataset, ctx, batch_size: int, seed: int, num_workers: int) -> DataLoader:
    """Per-rank micro-batches in the order of a seeded ``DistributedSampler`` (call ``set_epoch``)."""
    # drop_last=True: every rank gets the same number of samples, so their windows match.
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return DataLoader(train_set, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=ctx.device.type == "cuda", persistent_workers=num_workers > 0)


# --------------------------------------------------------------------------- model


def resolve_sync_bn(requested: str, impl: str, device: torch.device) -> tuple[str, list[str]]:
    """The BatchNorm flavour to use, and notices. PyTorch's SyncBatchNorm needs CUDA tensors."""
    if requested == "pytorch" and device.type != "cuda":
        raise RuntimeError("--sync-bn pytorch: torch.nn.SyncBatchNorm only runs on CUDA tensors and this job runs on "
                           f"{device.type}. Use --sync-bn selfmade (syncbn.py, runs on CPU), none, or auto.")
    if requested != "auto":
        return requested, []
    if impl == "selfmade":
        return "selfmade", []
    if device.type == "cuda":
        return "pytorch", []
    return "selfmade", ["--sync-bn auto with --distributed-impl pytorch on CPU: torch.nn.SyncBatchNorm cannot run "
                        "on CPU tensors, so BatchNorm is synchronised by syncbn.py (ours) instead"]


def convert_batchnorm(model: nn.Module, sync_bn: str, transport: str = "auto") -> nn.Module:
    if sync_bn == "selfmade":
        return convert_sync_batchnorm(model, transport=transport)
    if sync_bn == "pytorch":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def wrap_model(model: nn.Module, impl: str, bucket_cap_mb: float, sharding: str = "none",
               transport: str = "auto") -> nn.Module:
    """Our DDP (ddp.DDP) or PyTorch's (also for ``sharding="zero"``, which shards only the optimizer);
    for ``"fsdp"`` our ``fsdp.FSDP`` or PyTorch's ``fully_shard`` on each ``FSDP_SHARD_TYPES`` layer and
    the root. All take rank 0's parameters at construction, and all communicate through ``transport``
    (``transport.resolve``): PyTorch's through its communication hook, or fully_shard's custom
    all-gather and reduce-scatter, unless it is "torch" (their own).

    PyTorch's DDP gets ``forward_sync_buffers=False`` (from ``ddp.make_ddp``), like ours: BatchNorm
    buffers are either kept equal by SyncBatchNorm or per-rank by choice (--sync-bn none), and
    the trainer hands every rank rank 0's buffers before validating; the default would add a
    broadcast per optimizer step.
    """
    if sharding != "fsdp":
        return make_ddp("bucketed" if impl == "selfmade" else "pytorch", model, bucket_cap_mb, transport=transport)
    if impl == "selfmade":
        return FSDP(model, shard_types=FSDP_SHARD_TYPES, transport=transport)
    broadcast_module_state(model)  # fully_shard shards what each rank holds: make it rank 0's first
    for layer in model.modules():
        if isinstance(layer, FSDP_SHARD_TYPES):
            fully_shard(layer)
    model = fully_shard(model)
    chosen = transports.resolve(transport, None, next(model.parameters()).device, engine="fully_shard")
    if not isinstance(chosen, transports.Torch):
        transports.use_with_fully_shard(model, chosen)
    return model


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD (lr, momentum) over what this rank updates of the wrapped ``model``; ``--sharding zero``
    shards its state: ``zero.ShardedOptimizer`` (ours) or ``ZeroRedundancyOptimizer`` (PyTorch's)."""
    options = dict(lr=args.lr, momentum=args.momentum)
    if args.sharding != "zero":
        return torch.optim.SGD(model.parameters(), **options)
    if args.distributed_impl == "selfmade":
        return ShardedOptimizer(model.parameters(), torch.optim.SGD, transport=args.transport, **options)
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, **options)


def _full_state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)  # cpu_offload: the values on rank 0 only


def full_model_state(model: nn.Module, module: nn.Module, args: argparse.Namespace) -> dict:
    """The unwrapped model's ``state_dict`` (full tensors, plain keys) for rank 0 to save. A collective
    for ``--sharding fsdp``: every rank must call it."""
    if args.sharding != "fsdp":
        return module.state_dict()
    if args.distributed_impl == "selfmade":
        return model.full_state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_state_options())


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace):
    """The optimizer state for rank 0 to save; every rank must call it (sharded states are collectives).

    Consolidated where the implementation offers it (ours and PyTorch's ZeRO, PyTorch's FSDP); for
    our FSDP, whose optimizer holds the state of this rank's flat shards, the list of every rank's."""
    if args.sharding == "none" or (args.sharding == "zero" and args.distributed_impl == "selfmade"):
        return optimizer.state_dict()  # ShardedOptimizer.state_dict() consolidates on every rank
    if args.sharding == "zero":
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if dist.get_rank() == 0 else None
    if args.distributed_impl == "pytorch":
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_full_state_options())
    states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(optimizer.state_dict(), states, dst=0)
    return states


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state, args: argparse.Namespace) -> None:
    """Load what ``full_optimizer_state`` saved, on every rank (each keeps its own part)."""
    if args.sharding == "fsdp" and args.distributed_impl == "pytorch":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    elif args.sharding == "fsdp":
        optimizer.load_state_dict(state[dist.get_rank()])
    else:
        optimizer.load_state_dict(state)


# --------------------------------------------------------------------------- accumulation schedule


def micro_batch_plan(samples: int, batch_size: int, accum: int) -> list[tuple[bool, int]]:
    """For each micro-batch of an epoch: (optimizer steps after it, samples in its window on this rank).

    ``samples`` per rank make ceil(samples / batch_size) micro-batches (the last may be short).
    A window is ``accum`` consecutive micro-batches; the epoch's last window may hold fewer
    (the leftover), and steps with its own sample count: nothing is dropped or carried into the
    next epoch. Each micro-batch's summed loss is divided by its window's sample count, so a step's
    gradient is that of the mean loss over the window's global batch (the sampler gives every rank
    the same number of samples, so the ranks' windows match).
    """
    count = math.ceil(samples / batch_size)
    plan = []
    for j in range(count):
        start = j - j % accum
        end = min(start + accum, count)
        plan.append((j + 1 == end, min(end * batch_size, samples) - start * batch_size))
    return plan


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The RNG seed of one rank in one epoch (dropout masks): a pure function, so a resumed run draws the same."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


# --------------------------------------------------------------------------- validation


def _scatter_rounds(val_set: Dataset, per_rank: int, world: int, device: torch.device, num_workers: int):
    """Rank 0: the validation set as rounds of ``world`` pieces, each (per_rank, pixels + 1) float32.

    A row is an image's pixels followed by its label, so one scatter moves both. scatter needs
    pieces of equal size: the last round is padded with zero images labelled -1. Labels are
    small integers, exact in float32.
    """
    loader = DataLoader(val_set, batch_size=world * per_rank, shuffle=False, num_workers=num_workers)
    for images, labels in loader:
        rows = torch.cat([images.flatten(1).float(), labels.float().unsqueeze(1)], dim=1)
        padded = rows.new_zeros(world * per_rank, rows.shape[1])
        padded[:, -1] = -1
        padded[:len(rows)] = rows
        yield list(padded.to(device).chunk(world))


def _loss_correct_count(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 [sum of losses, correct predictions, samples] over the samples whose label is not -1."""
    valid = labels >= 0
    logits, labels = logits[valid], labels[valid]
    loss = F.cross_entropy(logits.double(), labels, reduction="sum")  # summed in float64: many samples
    correct = (logits.argmax(dim=1) == labels).sum().double()
    return torch.stack([loss, correct, torch.tensor(float(len(labels)), dtype=torch.float64, device=logits.device)])


@torch.no_grad()
def validation_sums(model: nn.Module, val_set: Dataset | None, per_rank: int, ctx, num_workers: int = 0) -> torch.Tensor:
    """[loss sum, correct, count] (float64, CPU) of ``model`` on the validation set, on every rank.

    Only rank 0 holds ``val_set`` (None elsewhere) and scatters it in rounds of
    ``world x per_rank`` images; every rank evaluates its pieces in eval mode, and one
    all_reduce adds up the sums. Sums and counts, never averages: the result is exact for any
    world size and set size.
    """
    device = ctx.device
    header = torch.zeros(4, dtype=torch.int64, device=device)  # rounds, C, H, W
    if ctx.is_master:
        rounds = math.ceil(len(val_set) / (ctx.world_size * per_rank))
        header = torch.tensor([rounds, *val_set[0][0].shape], device=device)
    dist.broadcast(header, src=0)
    rounds, shape = int(header[0]), header[1:].tolist()
    pieces = _scatter_rounds(val_set, per_rank, ctx.world_size, device, num_workers) if ctx.is_master else None
    piece = torch.empty(per_rank, math.prod(shape) + 1, device=device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    dtype = next(model.parameters()).dtype  # images travel as float32 and are evaluated in the model's dtype
    model.eval()
    for _ in range(rounds):
        dist.scatter(piece, next(pieces) if ctx.is_master else None, src=0)
        sums += _loss_correct_count(model(piece[:, :-1].view(-1, *shape).to(dtype)), piece[:, -1].long())
    dist.all_reduce(sums)
    return sums.cpu()


# --------------------------------------------------------------------------- checkpoints


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


# --------------------------------------------------------------------------- training


class Trainer:
    """Trains ``model`` (unwrapped, on ``ctx.device``) data-parallel; the same loop for both DDPs.

    ``optimizer`` is built over the unwrapped model, or a function of the wrapped one (which
    ``--sharding fsdp`` needs: the optimizer updates FSDP's shards). ``args`` supplies
    distributed_impl, sharding, bucket_cap_mb, grad_accum_steps, num_epochs, max_steps,
    seed, checkpoint_dir, val_batch_size and num_workers. ``identity`` is what a checkpoint
    must match to be resumed (everything that shapes the trajectory).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | Callable[[nn.Module], torch.optim.Optimizer],
                 loader: DataLoader, val_set: Dataset | None, ctx, args: argparse.Namespace, identity: dict | None = None):
        self.module, self.optimizer, self.loader, self.val_set, self.ctx, self.args = model, optimizer, loader, val_set, ctx, args
        self._optimizer_state = None  # a checkpoint's, loaded once the optimizer exists
        self.identity = identity or {}
        if len(loader.sampler) == 0:
            raise ValueError(f"{len(loader.dataset)} training images cannot feed {ctx.world_size} ranks")
        self.plan = micro_batch_plan(len(loader.sampler), loader.batch_size, args.grad_accum_steps)
        assert len(self.plan) == len(loader), "one plan entry per micro-batch"
        self.epoch, self.step, self.history = 0, 0, []   # epochs done, optimizer steps done, per-epoch rows
        self.train_time, self.step_times, self._steps_here = 0.0, [], 0
        self._written: list[str] = []  # checkpoints this run wrote, oldest first: the only ones it prunes
        # Opened before a resume creates the optimizer state, so fresh and resumed runs count
        # the same tensors; closed after MEMORY_PROBE_STEPS optimizer steps (see _step).
        self.memory = PeakMemory(ctx.device)
        self.memory.__enter__()
        self._probing = True
        try:
            self.resumed_from = self._resume()
            self.model = wrap_model(model, args.distributed_impl, args.bucket_cap_mb, args.sharding, args.transport)
            if callable(optimizer):  # built over the wrapped model: FSDP's parameters are its shards
                self.optimizer = optimizer(self.model)
            if self._optimizer_state is not None:
                load_optimizer_state(self.model, self.optimizer, self._optimizer_state, args)
                self._optimizer_state = None
        except BaseException:
            self._close_memory_probe()  # a refused checkpoint must not leave the profiler running
            raise

    @property
    def done(self) -> bool:
        return self.epoch >= self.args.num_epochs or (self.args.max_steps is not None and self.step >= self.args.max_steps)

    def train(self) -> None:
        while not self.done:
            start = time.perf_counter()
            train_loss, complete = self._run_epoch(self.epoch)
            elapsed = time.perf_counter() - start
            self.train_time += elapsed
            self._log_epoch({"train_loss": train_loss, "epoch_time_s": elapsed, **self._validate()})
            if not complete:  # cut short by --max-steps: the run ends here, nothing to checkpoint
                break
            self.epoch += 1
            if self.args.checkpoint_dir:
                self._save_checkpoint()
        self._close_memory_probe()

    def _run_epoch(self, epoch: int) -> tuple[float, bool]:
        """One pass over this rank's shard. Returns the global mean training loss and whether the epoch completed."""
        self.model.train()
        self.loader.sampler.set_epoch(epoch)
        torch.manual_seed(epoch_seed(self.args.seed, epoch, self.ctx.rank))
        sums = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)  # [loss sum, samples]
        self._last_step_end = time.perf_counter()
        batches = progress(self.loader, desc=f"epoch {epoch + 1}/{self.args.num_epochs}", unit="batch")
        for j, ((images, labels), (steps, window)) in enumerate(zip(batches, self.plan)):
            images, labels = images.to(self.ctx.device, non_blocking=True), labels.to(self.ctx.device, non_blocking=True)
            sums += torch.stack([self._run_batch(images, labels, steps, window), sums.new_tensor(len(labels))])
            if steps and self.done:
                break
        getattr(batches, "close", lambda: None)()
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).item(), j + 1 == len(self.plan)

    def _run_batch(self, images: torch.Tensor, labels: torch.Tensor, steps: bool, window: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; communicates gradients only when the optimizer steps after it."""
        with nullcontext() if steps else self._no_sync():
            with self._autocast():
                loss_sum = F.cross_entropy(self.model(images), labels, reduction="sum")
            # Gradients of a window's micro-batches add up in .grad, and DDP averages them over
            # ranks; dividing by the window's samples per rank makes the step's gradient that of
            # the mean loss over the window's global batch (full window: mean / grad-accum-steps).
            (loss_sum / window).backward()
        if steps:
            self._step()
        return loss_sum.detach().double()

    def _no_sync(self):
        """The wrapper's ``no_sync()``; PyTorch's ``fully_shard`` has none (it reduce-scatters every micro-batch)."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else nullcontext()

    def _step(self) -> None:
        self.optimizer.step()  # every engine, ours and PyTorch's, finished its gradients' sums inside backward
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._steps_here += 1
        synchronize(self.ctx.device)
        now = time.perf_counter()
        if self._probing:
            if self._steps_here >= MEMORY_PROBE_STEPS:
                self._close_memory_probe()
        else:  # steps timed under the memory profiler are not representative
            self.step_times.append(now - self._last_step_end)
        self._last_step_end = now

    def _validate(self) -> dict:
        start = time.perf_counter()
        # Every rank evaluates rank 0's model: parameters are equal already, but per-rank
        # BatchNorm (--sync-bn none) leaves each rank its own running statistics.
        sharded = self.args.sharding == "fsdp"
        for tensor in self.module.buffers() if sharded else ():
            dist.broadcast(tensor, src=0)  # the sharded parameters are equal by construction
        if not sharded:
            broadcast_module_state(self.module)
        # Our FSDP's layers have parameters only inside the wrapper's forward.
        evaluated = self.model if sharded else self.module
        with self._autocast():
            loss, correct, count = validation_sums(evaluated, self.val_set, self.args.val_batch_size, self.ctx,
                                                   self.args.num_workers).tolist()
        return {"val_loss": loss / count, "val_acc": correct / count, "val_count": int(count),
                "val_time_s": time.perf_counter() - start}

    def _autocast(self):
        """``--autocast bf16``: the forward passes in bfloat16 where autocast allows (matmuls, convolutions)."""
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.args.autocast == "bf16")

    def _log_epoch(self, row: dict) -> None:
        row = {"kind": "epoch", "epoch": self.epoch + 1, "steps": self.step, **row, "peak_memory_bytes": self.memory.bytes}
        self.history.append(row)
        print0(f"epoch {row['epoch']:3d}/{self.args.num_epochs} | step {self.step:6d} | train loss {row['train_loss']:7.4f} | "
               f"val loss {row['val_loss']:7.4f} | val acc {row['val_acc']:6.4f} | time {row['epoch_time_s']:7.2f} s "
               f"(+{row['val_time_s']:.2f} s val) | peak mem {self.memory.bytes / 2**20:6.1f} MiB")

    def _save_checkpoint(self) -> None:
        """Rank 0 writes the checkpoint durably and prunes; every rank waits for it and fails if it failed.

        Durably: a temporary file, fsync, rename, fsync of the directory; the oldest checkpoint this run
        wrote beyond the newest two is deleted. The ranks wait in a gloo group with ``--checkpoint-timeout``,
        so slow storage is not a peer failure. Sharded runs save the full model and a consolidated optimizer
        state where the engine offers one (ZeRO, PyTorch's FSDP), else every rank's (our FSDP: resume with
        the same world size). No RNG state: every draw is a function of (seed, epoch, rank)."""
        model_state = full_model_state(self.model, self.module, self.args)  # every rank: collectives when sharded
        optimizer_state = full_optimizer_state(self.model, self.optimizer, self.args)
        failure = None
        if self.ctx.is_master:
            state = {"model": model_state, "optimizer": optimizer_state, "epoch": self.epoch,
                     "step": self.step, "history": self.history, "identity": self.identity}
            path = checkpoint_path(self.args.checkpoint_dir, self.epoch)
            try:
                save_atomically(state, path)
                self._written.append(path)
                # Only files this run wrote, oldest first: never an unreadable one or another run's progress.
                while len(self._written) > CHECKPOINTS_KEPT:
                    os.remove(self._written.pop(0))
            except OSError as error:
                failure = str(error)
        failure = self._from_rank0(failure)  # the peers wait here, however slow the storage
        if failure:
            raise CheckpointError(f"saving the checkpoint of epoch {self.epoch} failed on rank 0: {failure}")

    def _resume(self) -> str | None:
        """Load the newest checkpoint rank 0 can read, on every rank (before wrapping: DDP then broadcasts it)."""
        if not self.args.checkpoint_dir:
            return None
        # Checkpoint I/O on shared storage may take minutes: the ranks wait for it in a group of
        # their own with a long timeout, not in the training group's short one.
        self._checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.args.checkpoint_timeout))
        choice = None
        if self.ctx.is_master:
            try:
                choice = choose_checkpoint(self.args.checkpoint_dir, self.args.restart_from_scratch)
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
        state = torch.load(path, map_location=self.ctx.device, weights_only=True)
        dist.barrier(group=self._checkpoint_group)  # the slowest rank's load
        different = {k for k in self.identity.keys() | state["identity"].keys()
                     if self.identity.get(k) != state["identity"].get(k)}
        if different:
            raise ValueError(f"checkpoint {path} belongs to a different run ({', '.join(sorted(different))} differ): "
                             "use a fresh --checkpoint-dir")
        self.module.load_state_dict(state["model"])
        self._optimizer_state = state["optimizer"]
        self.epoch, self.step, self.history = state["epoch"], state["step"], state["history"]
        print0(f"resumed from {path}: {self.epoch} epoch(s), {self.step} optimizer step(s) done")
        return path

    def _from_rank0(self, value):
        """Rank 0's ``value`` (picklable) on every rank, through the checkpoint group's long timeout."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._checkpoint_group)
        return box[0]

    def _close_memory_probe(self) -> None:
        if self._probing:
            self.memory.__exit__(None, None, None)
            self._probing = False


# --------------------------------------------------------------------------- the job


def build_trainer(args: argparse.Namespace, ctx, sync_bn: str, train_set: Dataset, val_set: Dataset | None,
                  identity: dict | None = None) -> Trainer:
    """Model (after seeding: the same initial weights on every rank and for both DDPs), SGD, data, Trainer."""
    torch.manual_seed(args.seed)
    model = convert_batchnorm(build_model(args.model), sync_bn, args.transport).to(ctx.device)
    loader = train_loader(train_set, ctx, args.batch_size, args.seed, args.num_workers)
    return Trainer(model, lambda wrapped: build_optimizer(wrapped, args), loader, val_set, ctx, args, identity)


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def summarize(trainer: Trainer, ctx) -> tuple[dict, list[dict]]:
    """Every rank's time and memory (collective), the final row and per-rank rows (None: not measured).

    Time: the training loop's wall time per rank (validation and checkpoints excluded), maximum over
    ranks; time per optimizer step: median over steps of the slowest rank, the first four left out. Peak
    memory: the most tensor bytes allocated above the level before the model is wrapped, through the
    fourth optimizer step (``measure.PeakMemory``; on CUDA also ``torch.cuda.max_memory_allocated``)."""
    cuda_peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else math.nan
    local_median = statistics.median(trainer.step_times) if trainer.step_times else math.nan
    per_rank = gather_rows([trainer.train_time, local_median, trainer.memory.bytes, cuda_peak])
    step_median = math.nan
    if trainer.step_times:  # every rank made the same number of steps
        step_median = statistics.median(gather_rows(trainer.step_times).max(dim=0).values.tolist())
    ranks = [{"kind": "rank", "rank": r, "train_time_s": t, "step_time_median_s": _number(s), "peak_memory_bytes": int(m),
              "cuda_max_memory_allocated_bytes": None if math.isnan(c) else int(c)}
             for r, (t, s, m, c) in enumerate(per_rank.tolist())]
    last = trainer.history[-1] if trainer.history else {}
    final = {"kind": "final", "epochs": trainer.epoch, "steps": trainer.step, "train_loss": last.get("train_loss"),
             "val_loss": last.get("val_loss"), "val_acc": last.get("val_acc"), "val_count": last.get("val_count"),
             "train_time_max_s": max(r["train_time_s"] for r in ranks), "step_time_median_s": _number(step_median),
             "peak_memory_max_bytes": max(r["peak_memory_bytes"] for r in ranks)}
    return final, ranks


def run_identity(args: argparse.Namespace, ctx, sync_bn: str, dataset: str, train_size: int) -> dict:
    """Everything that shapes the training trajectory: a checkpoint resumes only into the same."""
    return {"distributed_impl": args.distributed_impl, "sharding": args.sharding, "model": args.model, "sync_bn": sync_bn, "dataset": dataset,
            "train_size": train_size, "batch_size": args.batch_size, "grad_accum_steps": args.grad_accum_steps,
            "lr": args.lr, "momentum": args.momentum, "seed": args.seed, "world_size": ctx.world_size,
            "autocast": args.autocast}


def resolved_config(args: argparse.Namespace, ctx, identity: dict, notices: list[str], trainer: Trainer) -> dict:
    """The flags, what they resolved to, and what the measurements mean: printed once, stored in the metrics."""
    used = transports.resolve(args.transport, None, ctx.device, engine="ddp_cifar100").describe()  # a collective
    return {**vars(args), **{f"{k}_used": v for k, v in identity.items()}, "notices": notices, "transport_used": used,
            "global_batch": args.batch_size * args.grad_accum_steps * ctx.world_size,
            "steps_per_epoch": sum(steps for steps, _ in trainer.plan), "device": str(ctx.device),
            "val_size_used": len(trainer.val_set) if trainer.val_set is not None else None,
            "resumed_from": trainer.resumed_from,
            "time_scope": "training loops only (validation and checkpoints excluded); step time = median over "
                          f"optimizer steps after the first {MEMORY_PROBE_STEPS} of the slowest rank",
            "memory_scope": "peak tensor bytes above the level before resuming and wrapping the model, through "
                            f"optimizer step {MEMORY_PROBE_STEPS}: DDP buffers, gradients, optimizer state, activations "
                            "(torch profiler on CPU, CUDA allocator statistics on GPU)"}


def main(ctx, args: argparse.Namespace) -> None:
    sync_bn, notices = resolve_sync_bn(args.sync_bn, args.distributed_impl, ctx.device)
    if ctx.device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    dataset, data_notices = choose_dataset(args.dataset, args.data_dir, ctx)
    notices += data_notices
    env = environment(ctx.backend, ctx.device, ctx.world_size) if ctx.is_master else None
    if ctx.is_master:
        print(format_environment(env), flush=True)
        for notice in notices:
            print(f"\n{'!' * 100}\nNOTICE: {notice}\n{'!' * 100}\n", flush=True)
    train_set, val_set = build_datasets(dataset, args.data_dir, args.train_size, args.val_size, ctx.is_master)
    identity = run_identity(args, ctx, sync_bn, dataset, len(train_set))
    trainer = build_trainer(args, ctx, sync_bn, train_set, val_set, identity)
    config = resolved_config(args, ctx, identity, notices, trainer)
    shown = " ".join(f"{k}={v}" for k, v in config.items() if k not in ("notices", "time_scope", "memory_scope"))
    print0(textwrap.fill(f"config: {shown}", width=120, subsequent_indent="    "))
    trainer.train()
    final, ranks = summarize(trainer, ctx)
    final_state = full_model_state(trainer.model, trainer.module, args) if args.save_model else None  # every rank
    if ctx.is_master:
        report(final, ranks, dataset)
        metrics_path = args.metrics_json or args.json
        if metrics_path:
            write_results(metrics_path, "ddp_cifar100", env, config, trainer.history + [final] + ranks)
        if args.save_model:
            save_atomically(final_state, args.save_model)


def report(final: dict, ranks: list[dict], dataset: str) -> None:
    """Rank 0's closing lines: the final metrics and the per-rank table the homework solution printed."""
    step = "-" if final["step_time_median_s"] is None else f"{final['step_time_median_s']:.4f} s"
    print(f"final: val loss {final['val_loss']:.4f} | val acc {final['val_acc']:.4f} ({final['val_count']} images, "
          f"{dataset}) | {final['steps']} steps | train time {final['train_time_max_s']:.2f} s (max over ranks) | "
          f"step {step} (median)", flush=True)
    columns = [("rank", "rank", "d"), ("train_time_s", "train time (s)", ".3f"),
               ("step_time_median_s", "step time, median (s)", ".4f"), ("peak_memory_bytes", "peak memory (bytes)", "d")]
    if ranks[0]["cuda_max_memory_allocated_bytes"] is not None:
        columns.append(("cuda_max_memory_allocated_bytes", "max memory allocated (bytes)", "d"))
    print(markdown_table(ranks, columns), flush=True)


@record  # under torchrun, a failing rank's traceback is recorded and printed as the root cause
def run(args: argparse.Namespace) -> None:
    with distributed(args.backend, args.timeout, args.device) as ctx:
        main(ctx, args)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distributed-impl", choices=("selfmade", "pytorch"), default="selfmade",
                   help="selfmade: ddp.DDP; pytorch: torch.nn.parallel.DistributedDataParallel (default: %(default)s)")
    p.add_argument("--sharding", choices=SHARDINGS, default="none",
                   help="none: DDP; zero: DDP + optimizer state sharded (ZeRO stage 1); fsdp: parameters, gradients "
                        "and optimizer state sharded (FSDP), ours or PyTorch's per --distributed-impl (default: %(default)s)")
    p.add_argument("--num-epochs", type=int, default=10, help="epochs; the homework template's (default: %(default)s)")
    p.add_argument("--grad-accum-steps", type=int, default=1,
                   help="micro-batches per optimizer step; gradients are communicated only on the last (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="micro-batch size per rank (default: %(default)s)")
    p.add_argument("--val-batch-size", type=int, default=256,
                   help="validation images per rank in each scatter round; bounds memory (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate; the template's (default: %(default)s)")
    p.add_argument("--momentum", type=float, default=0.5, help="SGD momentum; the template's (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order, dropout (default: %(default)s)")
    p.add_argument("--model", choices=("cnn", "resnet18"), default="cnn",
                   help="cnn: the homework's small CNN; resnet18: torchvision's, 100 classes (default: %(default)s)")
    p.add_argument("--sync-bn", choices=("auto", "selfmade", "pytorch", "none"), default="auto",
                   help="BatchNorm: selfmade = syncbn.py; pytorch = torch.nn.SyncBatchNorm (CUDA only); none = per rank; "
                        "auto = the implementation's own, ours on CPU (default: %(default)s)")
    p.add_argument("--dataset", choices=("auto", "cifar100", "synthetic"), default="auto",
                   help="auto: CIFAR-100 if on disk or downloadable, else synthetic (announced); cifar100: never falls "
                        "back; synthetic: CIFAR-shaped, learnable, no files (default: %(default)s)")
    p.add_argument("--data-dir", default="./data", help="where cifar-100-python/ is or goes (default: %(default)s)")
    p.add_argument("--train-size", type=int, default=None,
                   help="use this many training images (CIFAR-100: the first N) (default: all 50,000)")
    p.add_argument("--val-size", type=int, default=None,
                   help="use this many validation images (CIFAR-100: the first N of the test split) (default: all 10,000)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps (default: no limit)")
    p.add_argument("--autocast", choices=("none", "bf16"), default="none",
                   help="bf16: forward passes (training and validation) under torch.autocast with bfloat16; parameters, "
                        "gradients and the optimizer stay float32 (default: %(default)s)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket size for both DDPs (default: %(default)s)")
    p.add_argument("--transport", choices=transports.names(), default="auto",
                   help="how every engine's tensors travel, for both implementations (PyTorch's DDP through its comm "
                        "hook, fully_shard through its custom collectives; its ZeroRedundancyOptimizer always uses "
                        "torch.distributed): torch (gloo, NCCL), shared_memory (ranks on one host, CPU), p2p "
                        "(allreduce.py's algorithms); auto = shared_memory on one CPU host, else torch "
                        "(default: %(default)s)")
    p.add_argument("--num-workers", type=int, default=0,
                   help="DataLoader worker processes; 0 loads in the training process (default: %(default)s)")
    p.add_argument("--save-model", metavar="PATH", default=None,
                   help="rank 0 saves the final model's state_dict here, unwrapped, same keys for both impls (default: none)")
    p.add_argument("--metrics-json", metavar="PATH", default=None,
                   help="rank 0 writes config, environment, per-epoch and per-rank metrics here (default: none)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save a checkpoint here after every epoch and resume from the newest at start (default: none)")
    p.add_argument("--restart-from-scratch", action="store_true",
                   help="when --checkpoint-dir holds checkpoints and none can be read, train from scratch (keeping "
                        "them, renamed *.unreadable) instead of stopping with an error (default: off)")
    p.add_argument("--checkpoint-timeout", type=float, default=CHECKPOINT_WAIT_S,
                   help="seconds the ranks wait for rank 0 to save or find a checkpoint (slow shared storage); "
                        "--timeout does not apply to that wait (default: %(default)s)")
    add_common_args(p, json_help="same as --metrics-json")
    args = parse_checked(p, argv)
    for name in ("num_epochs", "grad_accum_steps", "batch_size", "val_batch_size", "train_size", "val_size", "max_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.num_workers < 0:
        p.error("--num-workers must be 0 or more")
    if args.restart_from_scratch and not args.checkpoint_dir:
        p.error("--restart-from-scratch only applies with --checkpoint-dir")
    if args.checkpoint_timeout <= 0:
        p.error(f"--checkpoint-timeout must be positive (seconds), got {args.checkpoint_timeout:g}")
    if args.json and args.metrics_json and args.json != args.metrics_json:
        p.error("--json and --metrics-json name different files; give one")
    return args


if __name__ == "__main__":
    run(parse_args())
