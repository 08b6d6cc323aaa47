"""The CIFAR-100 data the trainer reads: the real files (read, or downloaded by one rank per node), or a
learnable synthetic stand-in when they are missing (``choose_dataset`` says so, loudly), and each rank's share.

    name, notices = choose_dataset("auto", "./data", ctx)     # every rank: they agree on "cifar100" or "synthetic"
    train_set, val_set = build_datasets(name, "./data", None, None, with_val=ctx.is_master)
    loader = train_loader(train_set, ctx, batch_size=64, seed=0, num_workers=0)   # call loader.sampler.set_epoch
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from dpkit.models import NUM_CLASSES

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


class SyntheticCIFAR100(Dataset):
    """A learnable stand-in for CIFAR-100: 3x32x32 images in 100 classes, made on the fly, no files.

    Each class has a fixed smooth random pattern (its prototype). Image i is its class's
    prototype shifted by up to 4 pixels each way, plus noise six times stronger than the pattern,
    clamped to [0, 1] like real pixels, then normalised with CIFAR-100's constants. The noise
    images come from a fixed bank of 1,024, so a sample costs a few tensor operations.
    Everything is a function of (seed, split, index): identical on every rank and in every
    run, and a smaller set is a prefix of a bigger one. Train and validation share the
    prototypes, not the samples. The homework's CNN learns it well above chance (1 %) within a few
    epochs: ``results/train_ours.json`` holds the committed run.
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
        self.shifts = np.random.default_rng((seed, split, 1)).integers(-self.SHIFT, self.SHIFT + 1,
                                                                       size=(size, 2)).tolist()
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
        group = None
        if dist.is_initialized():
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=DOWNLOAD_WAIT_S))
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
            raise ValueError(f"asked for {size} {'training' if train else 'validation'} images, the split has "
                             f"{len(full)}")
        return Subset(full, range(size))

    return split(True, train_size), (split(False, val_size) if with_val else None)


def train_loader(train_set: Dataset, ctx, batch_size: int, seed: int, num_workers: int) -> DataLoader:
    """Per-rank micro-batches in the order of a seeded ``DistributedSampler`` (call ``set_epoch``)."""
    # drop_last=True: every rank gets the same number of samples, so their windows match.
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return DataLoader(train_set, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=ctx.device.type == "cuda", persistent_workers=num_workers > 0)
