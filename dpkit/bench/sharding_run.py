"""Measuring one model's sharding variants on every rank, as ``sharding_benchmark.py`` runs them: each built once
(same seed) on a transport of its own, warmed up, timed in rounds that interleave the variants, then one untimed
iteration counting what each rank holds; a row per variant (its identity as fields: engine, impl, option,
transport), then the target rows.

    rows = benchmark_model(ctx, args, "gpt", select(["ddp ours", "zero1 ours"]))   # every rank: the same rows
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dpkit.bench import row_identity, transport_choice
from dpkit.bench.measure import (PeakMemory, gather_rows, oversubscribed, percentile, round_p50s, saved_tensor_bytes,
                                 time_interleaved)
from dpkit.bench.sharding_memory import full_sizes, held_bytes, ideal_bytes, local, storage_bytes
from dpkit.bench.sharding_setups import Setup
from dpkit.bench.sharding_targets import target_rows
from dpkit.bench.sharding_variants import VARIANTS, runnable
from dpkit.comm import transport
from dpkit.engines.ddp import sync_gradients
from dpkit.models import NUM_CLASSES, GPTConfig, build_model


def gpt_config(args) -> GPTConfig:
    return GPTConfig(args.gpt_vocab, args.gpt_seq_len, args.gpt_width, args.gpt_depth, args.gpt_heads)


def make_batch(name: str, args, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets): random, different on every rank, made once."""
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    if name == "gpt":
        tokens = torch.randint(args.gpt_vocab, (args.batch_size, args.gpt_seq_len + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T): predict the next token
    else:
        inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
        targets = torch.randint(NUM_CLASSES, (args.batch_size,), generator=generator)
    return inputs.contiguous().to(device), targets.contiguous().to(device)


def fresh_module(name: str, args, device: torch.device) -> nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights for every variant and rank
    return build_model(name, gpt_config(args)).to(device).train()


@dataclass
class Run:
    """A built variant with its batch and transport; ``step()`` is one iteration, ``exposed`` its exposed
    communication."""

    setup: Setup
    transport: transport.Transport
    inputs: torch.Tensor
    targets: torch.Tensor
    exposed: list[float] = field(default_factory=list)

    def forward(self) -> torch.Tensor:
        logits = self.setup.model(self.inputs)
        return F.cross_entropy(logits.flatten(0, -2), self.targets.flatten())

    def finish(self, loss: torch.Tensor) -> None:
        loss.backward()
        sync_gradients(self.setup.model)
        self.setup.optimizer.step()
        self.setup.optimizer.zero_grad(set_to_none=True)
        wait = self.setup.exposed_s()
        self.exposed.append(float("nan") if wait is None else wait)

    def step(self) -> None:
        self.finish(self.forward())

    def counts(self) -> dict:
        """One untimed iteration, counting what this rank holds (with what its transport holds for it, see
        ``held_bytes``); ends with the optimizer stepped and the gradients freed."""
        model, optimizer = self.setup.model, self.setup.optimizer
        params = list(model.parameters())
        box = []
        activations = saved_tensor_bytes(lambda: box.append(self.forward()), exclude=[local(p) for p in params])
        box[0].backward()
        sync_gradients(model)
        grads = self.setup.grad_tensors()
        # Model state and what holds it, with the gradients in: the engine's buffers and its transport's memory.
        held = held_bytes([*params, *grads, *self.setup.state_tensors(), *self.setup.kept()], self.transport)
        counts = {"params_bytes": storage_bytes(params), "grads_bytes": storage_bytes(grads)}
        del grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts.update(state_bytes=storage_bytes(self.setup.state_tensors()), activation_bytes=activations,
                      model_state_bytes=held)
        return counts

    def memory(self, device: torch.device) -> tuple[dict, str | None]:
        """``counts()``, then one iteration under PeakMemory; with the path these two iterations took (``path``)."""
        if hasattr(self.transport, "release_staging"):
            self.transport.release_staging()  # a staging block left by construction's calls is not an iteration's
        counts = self.counts()
        kept = held_bytes([*self.setup.model.parameters(), *self.setup.state_tensors(), *self.setup.kept()],
                          self.transport)
        before = self.transport.held_bytes()
        with PeakMemory(device) as peak:
            self.step()
            # Nothing may still run when the profiler stops: a gloo collective launched under it and finished
            # after it (ZeRO's all-gathers on [torch]) leaves a worker process crashing later (SIGSEGV in
            # the profiler's ThreadLocalSubqueue destructor, when the collective's handle is freed).
            self.setup.settle()
        # PeakMemory sees torch's allocator only. An arena keeps its pages: the blocks the iteration took in
        # /dev/shm lie in what ``kept`` counted already, or grew it.
        counts["peak_bytes"] = kept + peak.bytes + self.transport.held_bytes() - before
        counts["shared_peak_bytes"] = self.transport.held_bytes()
        return counts, row_identity.recorded_path(self.transport)


def benchmark_model(ctx, args, name: str, names: list[str]) -> list[dict]:
    """Build every variant, time them in interleaved rounds, count their memory; rows for this model, then its
    target rows."""
    names = runnable(names, ctx.world_size, ctx.device)
    batch = make_batch(name, args, ctx.rank, ctx.device)
    full = full_sizes(fresh_module(name, args, ctx.device))
    # A transport per variant (made in the variants' order on every rank): what one holds (a shared-memory
    # arena's pages, its staging block) is then its variant's alone, counted with it.
    made: dict[str, transport.Transport] = {}
    try:
        runs = {}
        for v in names:
            made[v] = transport_choice.new(VARIANTS[v].transport, ctx.device)
            runs[v] = Run(VARIANTS[v].build(fresh_module(name, args, ctx.device), made[v]), made[v], *batch)
        timings = time_interleaved({v: runs[v].step for v in names}, args.iters, args.warmup, rounds=args.rounds,
                                   device=ctx.device)
        rows = [_row(ctx, args, name, v, runs[v], timings[v].samples, full) for v in names]
        del runs
    finally:
        for t in made.values():
            t.close()
    return rows + target_rows(rows, args, {v: VARIANTS[v].targets for v in names})


def _row(ctx, args, name: str, v: str, run: Run, samples: list[float], full: dict) -> dict:
    """One variant's row: its identity as fields, its times (the largest rank's exposed communication) and the
    largest rank's byte counts, with each rank's optimizer state and gradients."""
    counts, path = run.memory(ctx.device)
    per_rank = gather_rows(list(counts.values()))  # (world, counts)
    worst = per_rank.max(0).values.tolist()  # each count's maximum over ranks
    exposed = gather_rows(run.exposed[-args.iters:]).max(0).values.tolist()
    row = {"model": name, "world_size": ctx.world_size, "variant": v, **VARIANTS[v].fields(), "path": path,
           "transport_detail": run.transport.describe(),
           "p50_s": percentile(samples, 50), "p95_s": percentile(samples, 95),
           "round_p50_s": round_p50s(samples, args.iters, args.rounds),
           "exposed_comm_s": None if any(e != e for e in exposed) else percentile(exposed, 50),
           **{key: int(value) for key, value in zip(counts, worst)},
           "state_bytes_per_rank": [int(b) for b in per_rank[:, list(counts).index("state_bytes")]],
           "grads_bytes_per_rank": [int(b) for b in per_rank[:, list(counts).index("grads_bytes")]],
           "ideal_bytes": ideal_bytes(VARIANTS[v].engine, full, ctx.world_size),
           "oversubscribed": oversubscribed(ctx.world_size, ctx.device)}
    row["state_vs_ideal"] = row["model_state_bytes"] / row["ideal_bytes"]
    return row
