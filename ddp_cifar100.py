"""Homework Tasks 2 and 3: data-parallel CIFAR-100 training with our DDP and SyncBatchNorm, or PyTorch's.

    torchrun --standalone --nproc_per_node 2 ddp_cifar100.py --dataset synthetic --train-size 8192 --val-size 2048 \
        --num-epochs 2
    torchrun --nproc_per_node 2 ddp_cifar100.py --num-epochs 16 --grad-accum-steps 4 --impl ours  # the homework's run
    torchrun --nproc_per_node 2 ddp_cifar100.py --num-epochs 16 --grad-accum-steps 4 --impl pytorch
    torchrun --standalone --nproc_per_node 2 ddp_cifar100.py --dataset synthetic --engine fsdp   # or zero1, zero2
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 3 \
        ddp_cifar100.py --checkpoint-dir ckpt --metrics-json m.json    # survives killed workers (pytorch#135712)

Every engine runs the same loop (``Trainer``, below) from the same start: the model is built after
``torch.manual_seed(seed)`` on every rank, ``DistributedSampler`` orders the data, and dropout draws from a
generator reseeded from (seed, epoch, rank), so a resumed run draws the same: two CPU runs with the same seed,
world size and thread count give bit-identical parameters. The pieces live in ``dpkit.train``: ``data``,
``parallel`` (the engine), ``step`` (accumulation with ``no_sync``), ``validation`` (rank 0 scatters the
set, one float64 sum), ``checkpoint`` (durable, resumed on restart) and ``metrics``. Faults are injected from
outside by ``tests/faulty_ddp_cifar100.py``.
"""

from __future__ import annotations

import argparse
import textwrap
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

from dpkit.bench.results import environment, format_environment, write_results
from dpkit.comm import transport
from dpkit.comm.process_groups import add_common_args, distributed, parse_checked, print0, progress
from dpkit.engines import registry
from dpkit.models import build_model
from dpkit.train.checkpoint import Checkpoints, save_atomically
from dpkit.train.data import build_datasets, choose_dataset, train_loader
from dpkit.train.metrics import StepMeter, print_summary, summarize
from dpkit.train.parallel import Parallel, named, resolve_sync_bn, engines
from dpkit.train.step import autocast, epoch_seed, forward_backward, micro_batch_plan, optimizer_step
from dpkit.train.validation import rank0_model, validation_sums
from syncbn import convert_sync_batchnorm

# Peak memory is measured from before resuming and wrapping through this optimizer step (StepMeter).
MEMORY_PROBE_STEPS = 4
# Shared storage can be slow: rank 0's checkpoint saves and loads may take this long (--checkpoint-timeout).
CHECKPOINT_WAIT_S = 1800.0


# --------------------------------------------------------------------------- configuration


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", type=named("impl"), default="ours", metavar="{ours,pytorch}",
                   help="ours: dpkit's engines (ddp.DDP, ...); pytorch: PyTorch's (DistributedDataParallel, ...) "
                        "(default: %(default)s)")
    p.add_argument("--engine", type=named("engine"), default="ddp", metavar=f"{{{','.join(engines())}}}",
                   help=f"the engine, one of {', '.join(engines())}: ddp; zero1: DDP + optimizer state sharded; "
                        "zero2: gradients too; fsdp: parameters, gradients and optimizer state sharded; hsdp: FSDP "
                        "inside each host; ours or PyTorch's per --impl (default: %(default)s)")
    p.add_argument("--num-epochs", type=int, default=10, help="epochs; the homework template's (default: %(default)s)")
    p.add_argument("--grad-accum-steps", type=int, default=1,
                   help="micro-batches per optimizer step; gradients are communicated only on the last "
                        "(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="micro-batch size per rank (default: %(default)s)")
    p.add_argument("--val-batch-size", type=int, default=256,
                   help="validation images per rank in each scatter round; bounds memory (default: %(default)s)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate; the template's (default: %(default)s)")
    p.add_argument("--momentum", type=float, default=0.5, help="SGD momentum; the template's (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order, dropout (default: %(default)s)")
    p.add_argument("--model", choices=("cnn", "resnet18"), default="cnn",
                   help="cnn: the homework's small CNN; resnet18: torchvision's, 100 classes (default: %(default)s)")
    p.add_argument("--sync-bn", type=named("sync_bn"), default="auto", metavar="{auto,ours,pytorch,none}",
                   help="BatchNorm: ours = syncbn.py; pytorch = torch.nn.SyncBatchNorm "
                        "(CUDA only); none = per rank; auto = the implementation's own, ours on CPU "
                        "(default: %(default)s)")
    p.add_argument("--dataset", choices=("auto", "cifar100", "synthetic"), default="auto",
                   help="auto: CIFAR-100 if on disk or downloadable, else synthetic (announced); cifar100: never falls "
                        "back; synthetic: CIFAR-shaped, learnable, no files (default: %(default)s)")
    p.add_argument("--data-dir", default="./data", help="where cifar-100-python/ is or goes (default: %(default)s)")
    p.add_argument("--train-size", type=int, default=None,
                   help="use this many training images (CIFAR-100: the first N) (default: all 50,000)")
    p.add_argument("--val-size", type=int, default=None,
                   help="use this many validation images (CIFAR-100: the first N of the test split) "
                        "(default: all 10,000)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps (default: no limit)")
    p.add_argument("--autocast", choices=("none", "bf16"), default="none",
                   help="bf16: forward passes (training and validation) under torch.autocast with bfloat16; "
                        "parameters, gradients and the optimizer stay float32 (default: %(default)s)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="gradient bucket size for both DDPs (default: %(default)s)")
    p.add_argument("--transport", choices=transport.names(), default="auto",
                   help="how every engine's tensors travel, for both implementations (PyTorch's DDP through its comm "
                        "hook, fully_shard through its custom collectives; its ZeroRedundancyOptimizer always uses "
                        "torch.distributed): torch (gloo, NCCL), shared_memory (ranks on one host, CPU), p2p "
                        "(allreduce.py's algorithms); auto = shared_memory on one CPU host, else torch "
                        "(default: %(default)s)")
    p.add_argument("--num-workers", type=int, default=0,
                   help="DataLoader worker processes; 0 loads in the training process (default: %(default)s)")
    p.add_argument("--save-model", metavar="PATH", default=None,
                   help="rank 0 saves the final model's state_dict here, unwrapped, same keys for both impls "
                        "(default: none)")
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
    for name in ("num_epochs", "grad_accum_steps", "batch_size", "val_batch_size", "train_size", "val_size",
                 "max_steps"):
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
    if args.impl not in registry.get(args.engine).impls:
        p.error(f"--engine {args.engine} has no {args.impl!r} implementation: "
                f"--impl {' or '.join(registry.get(args.engine).impls)}")
    return args


# --------------------------------------------------------------------------- the model


def convert_batchnorm(model: nn.Module, sync_bn: str, transport: str = "auto") -> nn.Module:
    """The model with its BatchNorm layers as ``sync_bn`` says (``resolve_sync_bn``): ours, PyTorch's, or as built."""
    if sync_bn == "ours":
        return convert_sync_batchnorm(model, transport=transport)
    if sync_bn == "pytorch":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


# --------------------------------------------------------------------------- the loop


class Trainer:
    """Trains ``model`` (unwrapped, on ``ctx.device``) data-parallel; the same loop for every engine.

    ``optimizer``: one over the unwrapped model, or None for the flags' SGD over the wrapped one (with
    ``--engine fsdp`` it updates FSDP's shards). ``args`` are this script's flags; ``dpkit.train`` gets
    named values. ``identity`` is what a checkpoint must match to be resumed (what shapes the trajectory).
    """

    def __init__(self, model: nn.Module, optimizer, loader, val_set, ctx, args: argparse.Namespace,
                 identity: dict | None = None):
        self.module, self.loader, self.val_set, self.ctx, self.args = model, loader, val_set, ctx, args
        self.parallel = Parallel(args.impl, args.engine, args.bucket_cap_mb, args.transport)
        self.autocast_dtype = torch.bfloat16 if args.autocast == "bf16" else None
        if len(loader.sampler) == 0:
            raise ValueError(f"{len(loader.dataset)} training images cannot feed {ctx.world_size} ranks")
        self.plan = micro_batch_plan(len(loader.sampler), loader.batch_size, args.grad_accum_steps)
        assert len(self.plan) == len(loader), "one plan entry per micro-batch"
        self.epoch, self.step, self.history = 0, 0, []   # epochs done, optimizer steps done, per-epoch rows
        self.train_time = 0.0
        # Opened before a resume creates the optimizer state, so fresh and resumed runs count the same tensors.
        self.meter = StepMeter(ctx.device, MEMORY_PROBE_STEPS)
        try:
            self.checkpoints = Checkpoints(args.checkpoint_dir, args.checkpoint_timeout, args.restart_from_scratch,
                                           identity) if args.checkpoint_dir else None
            optimizer_state = self._resume()
            self.model = self.parallel.wrap(model)
            if optimizer is None:  # over the wrapped model: FSDP's parameters are its shards
                optimizer = self.parallel.optimizer(self.model, args.lr, args.momentum)
            self.optimizer = optimizer
            if optimizer_state is not None:
                self.parallel.load_optimizer_state(self.model, self.optimizer, optimizer_state)
        except BaseException:
            self.meter.close()  # a refused checkpoint must not leave the profiler running
            raise

    @property
    def done(self) -> bool:
        return self.epoch >= self.args.num_epochs or (self.args.max_steps is not None
                                                      and self.step >= self.args.max_steps)

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
            if self.checkpoints:
                self._save_checkpoint()
        self.meter.close()

    def _run_epoch(self, epoch: int) -> tuple[float, bool]:
        """One pass over this rank's shard. Returns the global mean training loss and whether the epoch completed."""
        self.model.train()
        self.loader.sampler.set_epoch(epoch)
        torch.manual_seed(epoch_seed(self.args.seed, epoch, self.ctx.rank))
        sums = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)  # [loss sum, samples]
        self.meter.epoch_starts()
        batches = progress(self.loader, desc=f"epoch {epoch + 1}/{self.args.num_epochs}", unit="batch")
        for j, ((images, labels), (steps, window)) in enumerate(zip(batches, self.plan)):
            images = images.to(self.ctx.device, non_blocking=True)
            labels = labels.to(self.ctx.device, non_blocking=True)
            loss_sum = forward_backward(self.model, images, labels, window, sync=steps, dtype=self.autocast_dtype)
            sums += torch.stack([loss_sum, sums.new_tensor(len(labels))])
            if steps:
                optimizer_step(self.model, self.optimizer)
                self.step += 1
                self.meter.stepped()
                if self.done:
                    break
        getattr(batches, "close", lambda: None)()
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).item(), j + 1 == len(self.plan)

    def _validate(self) -> dict:
        start = time.perf_counter()
        evaluated = rank0_model(self.model, self.module, sharded=self.parallel.shards == 3)
        with autocast(self.ctx.device, self.autocast_dtype):
            loss, correct, count = validation_sums(evaluated, self.val_set, self.args.val_batch_size, self.ctx,
                                                   self.args.num_workers).tolist()
        return {"val_loss": loss / count, "val_acc": correct / count, "val_count": int(count),
                "val_time_s": time.perf_counter() - start}

    def _log_epoch(self, row: dict) -> None:
        row = {"kind": "epoch", "epoch": self.epoch + 1, "steps": self.step, **row,
               "peak_memory_bytes": self.meter.peak_bytes}
        self.history.append(row)
        print0(f"epoch {row['epoch']:3d}/{self.args.num_epochs} | step {self.step:6d} | train loss "
               f"{row['train_loss']:7.4f} | val loss {row['val_loss']:7.4f} | val acc {row['val_acc']:6.4f} | time "
               f"{row['epoch_time_s']:7.2f} s (+{row['val_time_s']:.2f} s val) | peak mem "
               f"{self.meter.peak_bytes / 2**20:6.1f} MiB")

    def _save_checkpoint(self) -> None:
        """The full model and optimizer state (collectives when sharded), written by rank 0 (``Checkpoints.save``)."""
        model_state = self.parallel.full_model_state(self.model, self.module)
        optimizer_state = self.parallel.full_optimizer_state(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "epoch": self.epoch, "step": self.step,
                 "history": self.history} if self.ctx.is_master else None
        self.checkpoints.save(self.epoch, state)

    def _resume(self):
        """Load the newest readable checkpoint into the unwrapped model (wrapping then broadcasts it) and the
        counters; returns its optimizer state, loaded once the optimizer exists (None: nothing resumed)."""
        resumed = self.checkpoints.resume(self.ctx.device) if self.checkpoints else None
        self.resumed_from, state = resumed or (None, None)
        if state is None:
            return None
        self.module.load_state_dict(state["model"])
        self.epoch, self.step, self.history = state["epoch"], state["step"], state["history"]
        return state["optimizer"]


# --------------------------------------------------------------------------- the job


def build_trainer(args: argparse.Namespace, ctx, sync_bn: str, train_set, val_set,
                  identity: dict | None = None) -> Trainer:
    """Model (after seeding: the same initial weights on every rank and for both DDPs), SGD, data, Trainer."""
    torch.manual_seed(args.seed)
    model = convert_batchnorm(build_model(args.model), sync_bn, args.transport).to(ctx.device)
    loader = train_loader(train_set, ctx, args.batch_size, args.seed, args.num_workers)
    return Trainer(model, None, loader, val_set, ctx, args, identity)


def run_identity(args: argparse.Namespace, ctx, sync_bn: str, dataset: str, train_size: int) -> dict:
    """Everything that shapes the training trajectory: a checkpoint resumes only into the same."""
    return {"impl": args.impl, "engine": args.engine, "model": args.model,
            "sync_bn": sync_bn, "dataset": dataset, "train_size": train_size, "batch_size": args.batch_size,
            "grad_accum_steps": args.grad_accum_steps, "lr": args.lr, "momentum": args.momentum, "seed": args.seed,
            "world_size": ctx.world_size, "autocast": args.autocast}


def resolved_config(args: argparse.Namespace, ctx, identity: dict, notices: list[str], trainer: Trainer) -> dict:
    """The flags, what they resolved to, and what the measurements mean: printed once, stored in the metrics."""
    used = transport.resolve(args.transport, None, ctx.device, engine="ddp_cifar100").describe()  # a collective
    return {**vars(args), **{f"{k}_used": v for k, v in identity.items()}, "notices": notices, "transport_used": used,
            "global_batch": args.batch_size * args.grad_accum_steps * ctx.world_size,
            "steps_per_epoch": sum(steps for steps, _ in trainer.plan), "device": str(ctx.device),
            "val_size_used": len(trainer.val_set) if trainer.val_set is not None else None,
            "resumed_from": trainer.resumed_from,
            "time_scope": "training loops only (validation and checkpoints excluded); step time = median over "
                          f"optimizer steps after the first {MEMORY_PROBE_STEPS} of the slowest rank",
            "memory_scope": "peak tensor bytes above the level before resuming and wrapping the model, through "
                            f"optimizer step {MEMORY_PROBE_STEPS}: DDP buffers, gradients, optimizer state, "
                            "activations (torch profiler on CPU, CUDA allocator statistics on GPU)"}


def main(ctx, args: argparse.Namespace) -> None:
    sync_bn, notices = resolve_sync_bn(args.sync_bn, args.impl, ctx.device)
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
    final, ranks = summarize(trainer.history, trainer.epoch, trainer.step, trainer.train_time, trainer.meter.step_times,
                             trainer.meter.peak_bytes, ctx.device)
    # on every rank
    final_state = trainer.parallel.full_model_state(trainer.model, trainer.module) if args.save_model else None
    if ctx.is_master:
        print_summary(final, ranks, dataset)
        metrics_path = args.metrics_json or args.json
        if metrics_path:
            write_results(metrics_path, "ddp_cifar100", env, config, trainer.history + [final] + ranks)
        if args.save_model:
            save_atomically(final_state, args.save_model)


@record  # under torchrun, a failing rank's traceback is recorded and printed as the root cause
def run(args: argparse.Namespace) -> None:
    with distributed(args.backend, args.timeout, args.device) as ctx:
        main(ctx, args)


if __name__ == "__main__":
    run(parse_args())
