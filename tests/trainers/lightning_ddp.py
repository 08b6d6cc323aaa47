"""A LightningModule trained by Lightning's DDPStrategy over the backend --backend names, under torchrun, on CPU.

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 tests/trainers/lightning_ddp.py --backend dpkit \
        --metrics-dir metrics final.pt

The one change for dpkit is ``DDPStrategy(process_group_backend="dpkit")`` and ``import dpkit``. The module logs an
integer count (correct predictions) and the float loss with ``sync_dist=True``: Lightning averages them by
``ReduceOp.AVG`` on every backend but gloo, integer tensors included, as NCCL allows (a logged mean divides by the
accumulated batch sizes, an int64 tensor, averaged so). Rank r takes BATCH + r samples a step from its own shard,
so the batch sizes' sum is odd and the integer average's rounding shows in the logged means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import dpkit  # noqa: F401  (registers the torch.distributed backend "dpkit")

PG_TIMEOUT = datetime.timedelta(seconds=60)  # a dead peer fails the run in a minute, not gloo's 30
FEATURES, CLASSES = 8, 3
BATCH = 4  # rank r's batch holds BATCH + r samples
STEPS = 5  # steps in the one epoch; odd, so that the ranks' batch sizes add up to an odd number


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
        self.logged: list[dict] = []  # this rank's values as passed to self.log, before any sync

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        correct = (logits.argmax(dim=1) == y).sum()  # an int64 tensor
        self.log("loss", loss, on_step=True, on_epoch=True, sync_dist=True, reduce_fx="mean")
        self.log("correct", correct, on_step=True, on_epoch=True, sync_dist=True, reduce_fx="mean")
        self.logged.append({"loss": loss.item(), "correct": correct.item(), "batch_size": len(y)})
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def shard(rank: int, world_size: int, seed: int) -> DataLoader:
    """Rank ``rank``'s contiguous shard of one synthetic set: STEPS batches of BATCH + rank samples."""
    sizes = [(BATCH + r) * STEPS for r in range(world_size)]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(dim=1)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    return DataLoader(TensorDataset(x[mine], y[mine]), batch_size=BATCH + rank, shuffle=False)


def write_metrics(directory: str, rank: int, model: Classifier, trainer: L.Trainer) -> None:
    """Each rank writes what it logged and what Lightning synced (callback_metrics) to DIR/rank{rank}.json."""
    os.makedirs(directory, exist_ok=True)
    synced = {name: value.item() for name, value in trainer.callback_metrics.items()}
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump({"logged": model.logged, "synced": synced}, f, indent=1)


def main(backend: str, out: str, seed: int, metrics_dir: str | None, initial: str | None) -> None:
    L.seed_everything(seed)
    model = Classifier()
    strategy = DDPStrategy(process_group_backend=backend, timeout=PG_TIMEOUT)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, max_epochs=1,
                        use_distributed_sampler=False, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    if initial and trainer.global_rank == 0:
        torch.save(model.state_dict(), initial)
    data = shard(trainer.global_rank, trainer.world_size, seed)
    trainer.fit(model, data)
    print(f"[rank {trainer.global_rank}] process group backend: {torch.distributed.get_backend()}", flush=True)
    if metrics_dir:
        write_metrics(metrics_dir, trainer.global_rank, model, trainer)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Lightning DDP training of a tiny classifier under torchrun, on "
                                                 "2 CPU processes, with metrics synced across ranks.")
    parser.add_argument("out", help="where rank 0 saves the final state_dict")
    parser.add_argument("--backend", choices=("gloo", "dpkit"), default="dpkit",
                        help="torch.distributed backend (default: dpkit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    parser.add_argument("--metrics-dir", default=None,
                        help="each rank writes its logged and synced metrics to DIR/rank{r}.json (default: no)")
    parser.add_argument("--initial", default=None, help="also save the weights before training here (default: no)")
    args = parser.parse_args()
    main(args.backend, args.out, args.seed, args.metrics_dir, args.initial)
