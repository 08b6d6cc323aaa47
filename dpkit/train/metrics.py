"""What a training run measures and reports: peak memory through its first optimizer steps, then the time of
each step (``StepMeter``); at the end every rank's time and memory gathered (a collective), the final row
beside the last epoch's metrics, and rank 0's closing lines.

    meter = StepMeter(device, probe_steps=4)     # before the model is wrapped: its buffers count
    meter.epoch_starts(); ...; meter.stepped()   # after each optimizer step
    final, ranks = summarize(history, epochs, steps, train_time, meter.step_times, meter.peak_bytes, device)
    if ctx.is_master:
        print_summary(final, ranks, dataset)
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from dpkit.bench.measure import PeakMemory, gather_rows
from dpkit.bench.results import markdown_table
from dpkit.comm.process_groups import synchronize


class StepMeter:
    """Peak tensor memory from construction through optimizer step ``probe_steps`` (``PeakMemory``), then the
    wall time of every later step: steps timed under the memory profiler are not representative.

    On CPU, gloo's buffers for an all_reduce in flight overlap backward's allocations by timing, so one
    step's peak varies by a gradient or two; the maximum over several steps is steadier. Call ``close``
    on every path out (it stops the profiler); it is idempotent."""

    def __init__(self, device: torch.device, probe_steps: int):
        self.device, self.probe_steps, self.steps = device, probe_steps, 0
        self.step_times: list[float] = []
        self.memory, self.probing = PeakMemory(device).__enter__(), True
        self.last = time.perf_counter()

    @property
    def peak_bytes(self) -> int:
        return self.memory.bytes

    def epoch_starts(self) -> None:
        self.last = time.perf_counter()  # the first step of an epoch is timed from here, not across validation

    def stepped(self) -> None:
        self.steps += 1
        synchronize(self.device)
        now = time.perf_counter()
        if not self.probing:
            self.step_times.append(now - self.last)
        elif self.steps >= self.probe_steps:
            self.close()
        self.last = now

    def close(self) -> None:
        if self.probing:
            self.memory.__exit__(None, None, None)
            self.probing = False


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def summarize(history: list[dict], epochs: int, steps: int, train_time: float, step_times: list[float],
              peak_bytes: int, device: torch.device) -> tuple[dict, list[dict]]:
    """Every rank's time and memory (collective), the final row and per-rank rows (None: not measured).

    Time: the training loop's wall time per rank (``train_time``), maximum over ranks; time per optimizer
    step: median over steps of the slowest rank (``step_times``, the same count on every rank). Memory:
    this rank's ``peak_bytes`` (``measure.PeakMemory``), on CUDA also ``torch.cuda.max_memory_allocated``."""
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan
    local_median = statistics.median(step_times) if step_times else math.nan
    per_rank = gather_rows([train_time, local_median, peak_bytes, cuda_peak])
    step_median = math.nan
    if step_times:  # every rank made the same number of steps
        step_median = statistics.median(gather_rows(step_times).max(dim=0).values.tolist())
    ranks = [{"kind": "rank", "rank": r, "train_time_s": t, "step_time_median_s": _number(s),
              "peak_memory_bytes": int(m), "cuda_max_memory_allocated_bytes": None if math.isnan(c) else int(c)}
             for r, (t, s, m, c) in enumerate(per_rank.tolist())]
    last = history[-1] if history else {}
    final = {"kind": "final", "epochs": epochs, "steps": steps, "train_loss": last.get("train_loss"),
             "val_loss": last.get("val_loss"), "val_acc": last.get("val_acc"), "val_count": last.get("val_count"),
             "train_time_max_s": max(r["train_time_s"] for r in ranks), "step_time_median_s": _number(step_median),
             "peak_memory_max_bytes": max(r["peak_memory_bytes"] for r in ranks)}
    return final, ranks


def print_summary(final: dict, ranks: list[dict], dataset: str) -> None:
    """Rank 0's closing lines: the final metrics and the per-rank table the homework solution printed."""
    step = "-" if final["step_time_median_s"] is None else f"{final['step_time_median_s']:.4f} s"
    print(f"final: val loss {final['val_loss']:.4f} | val acc {final['val_acc']:.4f} ({final['val_count']} images, "
          f"{dataset}) | {final['steps']} steps | train time {final['train_time_max_s']:.2f} s (max over ranks) | "
          f"step {step} (median)", flush=True)
    columns = [("rank", "rank", "d"), ("train_time_s", "train time (s)", ".3f"),
               ("step_time_median_s", "step time, median (s)", ".4f"),
               ("peak_memory_bytes", "peak memory (bytes)", "d")]
    if ranks[0]["cuda_max_memory_allocated_bytes"] is not None:
        columns.append(("cuda_max_memory_allocated_bytes", "max memory allocated (bytes)", "d"))
    print(markdown_table(ranks, columns), flush=True)
