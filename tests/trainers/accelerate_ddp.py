"""A Hugging Face accelerate training loop over the backend --backend names, under torchrun, on 2 CPU processes.

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 tests/trainers/accelerate_ddp.py --backend dpkit final.pt

accelerate makes its own process group on CPU only for gloo (or MPI): ``InitProcessGroupKwargs(backend="dpkit")``
is refused ("Your assigned backend dpkit is not available, please use gloo"). It takes a group made before it,
so for dpkit the script calls ``dist.init_process_group("dpkit")`` before ``Accelerator()``; the rest of the loop
is accelerate's own. accelerate still names gloo in ``accelerator.state.backend`` then; the script prints that
beside the group's real backend.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader, TensorDataset

import dpkit  # noqa: F401  (registers the torch.distributed backend "dpkit")

PG_TIMEOUT = datetime.timedelta(seconds=60)  # a dead peer fails the run in a minute, not gloo's 30
SAMPLES, FEATURES, CLASSES = 256, 8, 3  # a synthetic classification set, the same on every rank


def make_accelerator(backend: str) -> Accelerator:
    if backend == "gloo":
        return Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=PG_TIMEOUT)])
    # accelerate refuses any CPU backend but gloo and MPI by name; it adopts a process group that already exists.
    dist.init_process_group(backend, timeout=PG_TIMEOUT)
    return Accelerator(cpu=True)


def make_data(seed: int, batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def main(backend: str, out: str, epochs: int, batch_size: int, seed: int, initial: str | None) -> None:
    accelerator = make_accelerator(backend)
    accelerator.print(f"process group backend: {dist.get_backend()} | accelerate reports backend "
                      f"{accelerator.state.backend!r}, distributed_type {accelerator.distributed_type}")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
    if initial and accelerator.is_main_process:
        torch.save(model.state_dict(), initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, make_data(seed, batch_size))
    for epoch in range(epochs):
        for x, y in data:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
        accelerator.print(f"epoch {epoch} | last loss {loss.item():.4f}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # only rank 0 saves
        torch.save(accelerator.unwrap_model(model).state_dict(), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="accelerate training of a tiny classifier under torchrun, on CPU.")
    parser.add_argument("out", help="where rank 0 saves the final state_dict")
    parser.add_argument("--backend", choices=("gloo", "dpkit"), default="dpkit",
                        help="torch.distributed backend (default: dpkit)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs over the data (default: 3)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    parser.add_argument("--initial", default=None, help="also save the weights before training here (default: no)")
    args = parser.parse_args()
    main(args.backend, args.out, args.epochs, args.batch_size, args.seed, args.initial)
