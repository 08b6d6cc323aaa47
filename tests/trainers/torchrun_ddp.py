"""Plain DDP training under torchrun, as pytorch/examples' ddp-tutorial-series/multigpu_torchrun.py, on CPU.

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 tests/trainers/torchrun_ddp.py --backend dpkit final.pt

The program differs from its gloo twin only in ``import dpkit`` and the backend's name: with a fixed seed it
trains the same weights, bit for bit, on ``--backend gloo`` and ``--backend dpkit`` (tests/test_trainers.py).
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dpkit  # noqa: F401  (registers the torch.distributed backend "dpkit")

PG_TIMEOUT = datetime.timedelta(seconds=60)  # a dead peer fails the run in a minute, not gloo's 30
SAMPLES, FEATURES, CLASSES = 256, 8, 3  # a synthetic classification set, the same on every rank


def ddp_setup(backend: str) -> None:
    dist.init_process_group(backend, timeout=PG_TIMEOUT)


def make_dataset(seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, optimizer: torch.optim.Optimizer, out: str):
        self.rank = dist.get_rank()
        self.model = DDP(model)
        self.data = data
        self.optimizer = optimizer
        self.out = out

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        self.data.sampler.set_epoch(epoch)
        losses = [self._run_batch(source, targets) for source, targets in self.data]
        print(f"[rank {self.rank}] epoch {epoch} | steps {len(losses)} | last loss {losses[-1]:.4f}", flush=True)

    def _save(self) -> None:
        torch.save(self.model.module.state_dict(), self.out)
        print(f"[rank {self.rank}] saved the weights to {self.out}", flush=True)

    def train(self, epochs: int) -> None:
        for epoch in range(epochs):
            self._run_epoch(epoch)
        if self.rank == 0:  # only rank 0 saves
            self._save()


def main(backend: str, out: str, epochs: int, batch_size: int, seed: int, initial: str | None) -> None:
    ddp_setup(backend)
    print(f"[rank {dist.get_rank()}] process group backend: {dist.get_backend()}", flush=True)
    torch.manual_seed(seed)
    model = make_model()
    if initial and dist.get_rank() == 0:
        torch.save(model.state_dict(), initial)
    dataset = make_dataset(seed)
    data = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset, seed=seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    Trainer(model, data, optimizer, out).train(epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Plain DDP training of a tiny classifier under torchrun, on CPU.")
    parser.add_argument("out", help="where rank 0 saves the final state_dict")
    parser.add_argument("--backend", choices=("gloo", "dpkit"), default="dpkit",
                        help="torch.distributed backend (default: dpkit)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs over the data (default: 3)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (default: 16)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights, the data and the sampler (default: 0)")
    parser.add_argument("--initial", default=None, help="also save the weights before training here (default: no)")
    args = parser.parse_args()
    main(args.backend, args.out, args.epochs, args.batch_size, args.seed, args.initial)
