"""A variant's replica on this rank, as ``ddp_benchmark.py`` builds it: the model from the same seed for every
variant, round and rank, this rank's random batch, and the model wrapped by the variant's engine.

    batch = make_batch("resnet18", args, rank, device)
    replica = make_replica(variant, fresh_module(args, "resnet18", device), batch, made)   # made: {name: transport}
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from dpkit.bench.ddp_step import PYTORCH_BEST, PYTORCH_DEFAULT_BUCKET_MB, Replica, sgd
from dpkit.bench.ddp_variants import Variant
from dpkit.comm import transport
from dpkit.engines import registry
from dpkit.engines.ddp import make_ddp
from dpkit.models import NUM_CLASSES, GPTConfig, build_model


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(args.gpt_vocab, args.gpt_seq_len, args.gpt_width, args.gpt_depth, args.gpt_heads)


def image_size(name: str, args: argparse.Namespace) -> int:
    return 32 if name == "cnn" else args.image_size  # the CNN's fc layer is sized for 32x32 inputs


def input_shape(name: str, args: argparse.Namespace) -> str:
    if name == "gpt":
        return f"{args.gpt_seq_len} tokens"
    size = image_size(name, args)
    return f"3x{size}x{size}"


def make_batch(name: str, args: argparse.Namespace, rank: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets): random, seeded per rank (ranks hold different data), made once."""
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    if name == "gpt":
        tokens = torch.randint(args.gpt_vocab, (args.batch_size, args.gpt_seq_len + 1), generator=generator)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T): predict the next token
    else:
        size = image_size(name, args)
        inputs = torch.randn(args.batch_size, 3, size, size, generator=generator)
        targets = torch.randint(NUM_CLASSES, (args.batch_size,), generator=generator)
    return inputs.to(device), targets.to(device)


def fresh_module(args: argparse.Namespace, name: str, device: torch.device) -> nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights for every variant, round and rank
    return build_model(name, gpt_config(args)).to(device).train()


def make_replica(variant: Variant, module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                 made: dict[str, transport.Transport]) -> Replica:
    if variant.engine is None:
        model = module
    elif variant.engine != "ddp":  # a registered engine, wrapped by the registry
        model = registry.wrap(variant.engine, variant.impl, module, made[variant.transport],
                              registry.Options(bucket_cap_mb=variant.bucket_mb))
    else:
        bucket_mb = PYTORCH_DEFAULT_BUCKET_MB if variant.bucket_mb is None else variant.bucket_mb
        options = PYTORCH_BEST if variant.option == "best" else {}
        # Every model here uses all its parameters: like both PyTorch rows (find_unused_parameters=False,
        # PyTorch's default), ours then needs no used-flags in its buckets.
        pytorch = variant.impl == "pytorch"
        # On a Torch transport ("torch", "torch:dpkit") PyTorch's DDP keeps its built-in communication, on its group.
        own = pytorch and isinstance(made[variant.transport], transport.Torch)
        wire = None if own else made[variant.transport]
        group = made[variant.transport].group if own else None
        # make_ddp's names: "pytorch", "ours", "ours naive", ... (PyTorch's best is options, not a name)
        name = "pytorch" if pytorch else " ".join(w for w in ("ours", variant.option) if w)
        model = make_ddp(name, module, bucket_mb, process_group=group, find_unused_parameters=False,
                         transport=wire, **options)
    return Replica(model, sgd(model), *batch, waits=[])


def model_facts(module: nn.Module) -> dict:
    """Parameters and gradient bytes of a model (its rows' ``params`` and ``grad_bytes``)."""
    params = list(module.parameters())  # a tied weight counts once
    trainable = [p for p in params if p.requires_grad]
    return {"params": sum(p.numel() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in trainable)}
