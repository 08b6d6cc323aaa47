"""The CUDA paths, on a GPU: SyncBatchNorm, the engines, the homework's algorithms and the scripts.

    python -m pytest -m gpu      # every CUDA path where a GPU is visible; elsewhere each test is skipped, saying why

No machine this kit is developed on has a GPU: these tests are how one finds out whether its CUDA code
works. One GPU is enough: two processes share it over gloo, whose collectives take CUDA tensors (gloo
copies them through host memory) and whose point-to-point calls do not (the homework's algorithms then
stage through host memory: ``allreduce.staged``); one process runs over NCCL. A second GPU adds two
processes over NCCL, one GPU each. The oracles are the CPU tests': BatchNorm on the whole global batch
and one process training on it, computed here on the CPU in float64; and PyTorch's own
``torch.nn.SyncBatchNorm`` on the same GPU. The workers turn TF32 off, so float32 is float32.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import allreduce
from common import REPO, run_torchrun
from dpkit.comm import transport
from dpkit.comm.process_groups import launch
from dpkit.engines.ddp import DDP
from dpkit.engines.fsdp import FSDP
from dpkit.engines.zero import ShardedOptimizer
from syncbn import SyncBatchNorm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device is visible (torch.cuda.is_available() is False): "
                                        "the GPU tests run where one is")]

# (backend, processes) every distributed case runs on: two processes sharing GPU 0 over gloo, one over NCCL,
# and two over NCCL (one GPU each) where there are two GPUs.
LAYOUTS = [("gloo", 2), ("nccl", 1)] + ([("nccl", 2)] if torch.cuda.device_count() >= 2 else [])
LAYOUT_IDS = [f"{backend}-{n}" for backend, n in LAYOUTS]
TIMEOUT_S, PG_TIMEOUT_S = 240.0, 60.0
HALF = (torch.float16, torch.bfloat16)


def on_gpu(fn, layout, *args):
    """``fn(ctx, *args)`` on every rank of ``layout``, its tensors on CUDA; every rank's result."""
    backend, n = layout
    return launch(fn, n, *args, backend=backend, device="cuda", timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)


def _float32_is_float32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _rows(x: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """This rank's even share of the global batch (dimension 0)."""
    per = x.shape[0] // n
    return x[rank * per:(rank + 1) * per]


# --------------------------------------------------------------------------- SyncBatchNorm


def syncbn_cases() -> dict[str, tuple]:
    """name -> (global input, upstream gradient, dtype, channels_last), float32 on the CPU, seeded."""
    g = torch.Generator().manual_seed(0)
    flat, image = (torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)), \
                  (torch.randn(16, 8, 5, 5, generator=g), torch.randn(16, 8, 5, 5, generator=g))
    return {"1d float32": (*flat, torch.float32, False), "2d float32": (*image, torch.float32, False),
            "2d float32 channels_last": (*image, torch.float32, True), "1d float16": (*flat, torch.float16, False),
            "1d bfloat16": (*flat, torch.bfloat16, False), "2d float16 channels_last": (*image, torch.float16, True),
            "2d bfloat16": (*image, torch.bfloat16, False)}


def _placed(x: torch.Tensor, device, dtype, channels_last: bool) -> torch.Tensor:
    x = x.to(device, dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _syncbn_worker(ctx, cases: dict) -> dict:
    _float32_is_float32()
    out = {}
    for name, (x, dy, dtype, channels_last) in cases.items():
        out[name] = {}
        for label, layer in (("ours", SyncBatchNorm(x.shape[1])), ("torch", nn.SyncBatchNorm(x.shape[1]))):
            layer = layer.to(ctx.device)
            xs = _placed(_rows(x, ctx.rank, ctx.world_size), ctx.device, dtype, channels_last).requires_grad_()
            y = layer(xs)
            y.backward(_placed(_rows(dy, ctx.rank, ctx.world_size), ctx.device, dtype, channels_last))
            out[name][label] = {
                "device": y.device.type, "dtype": y.dtype, "y": y.detach().double().cpu(), "dx": xs.grad.double().cpu(),
                "dw": layer.weight.grad.double().cpu(), "db": layer.bias.grad.double().cpu(),
                "mean": layer.running_mean.double().cpu(), "var": layer.running_var.double().cpu(),
                "channels_last": y.is_contiguous(memory_format=torch.channels_last) if y.dim() == 4 else None}
    return out


@pytest.fixture(scope="module", params=LAYOUTS, ids=LAYOUT_IDS)
def syncbn(request):
    return request.param, on_gpu(_syncbn_worker, request.param, syncbn_cases())


def syncbn_oracle(x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype) -> dict:
    """BatchNorm1d/2d in float64 on the whole global batch, rounded to ``dtype`` first as the ranks' input is."""
    x, dy = x.to(dtype).double().requires_grad_(), dy.to(dtype).double()
    layer = (nn.BatchNorm1d if x.dim() == 2 else nn.BatchNorm2d)(x.shape[1]).double()
    y = layer(x)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad,
            "mean": layer.running_mean, "var": layer.running_var}


def tolerance(dtype: torch.dtype, reference: torch.Tensor) -> dict:
    """float32: GPU reductions in another order than float64's; half: one rounding to ``dtype`` (eps/2
    relative), allowed twice, and as much absolute at the tensor's scale."""
    if dtype in HALF:
        eps = torch.finfo(dtype).eps
        return dict(rtol=eps, atol=eps * float(reference.abs().max()))
    return dict(rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", list(syncbn_cases()))
def test_syncbatchnorm_on_cuda_equals_batchnorm_on_the_global_batch_and_torch_syncbatchnorm(syncbn, name):
    (backend, n), ranks = syncbn
    x, dy, dtype, channels_last = syncbn_cases()[name]
    want = syncbn_oracle(x, dy, dtype)
    for label in ("ours", "torch"):
        got = [rank[name][label] for rank in ranks]
        assert all(r["device"] == "cuda" and r["dtype"] == dtype for r in got), f"{label}: not on CUDA in {dtype}"
        for key in ("y", "dx"):
            torch.testing.assert_close(torch.cat([r[key] for r in got]), want[key], **tolerance(dtype, want[key]),
                                       msg=lambda m: f"{label} {key} on {backend} x{n}: {m}")
        for key in ("dw", "db"):  # each rank's are the local sums; DDP averages them
            torch.testing.assert_close(sum(r[key] for r in got), want[key], **tolerance(dtype, want[key]),
                                       msg=lambda m: f"{label} {key} on {backend} x{n}: {m}")
        for key in ("mean", "var"):
            for r in got:
                torch.testing.assert_close(r[key], want[key], rtol=1e-4, atol=1e-5)
        if channels_last:
            assert all(r["channels_last"] for r in got), f"{label} lost the channels_last layout"
    ours, theirs = ([rank[name][label]["y"] for rank in ranks] for label in ("ours", "torch"))
    torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), **tolerance(dtype, want["y"]))


# --------------------------------------------------------------------------- the engines


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))


def engine_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 12, 12, generator=g), torch.randn(3, 12, 5, generator=g)  # 3 steps of a global batch of 12


ENGINES = ("DDP + SGD", "DDP + ShardedOptimizer(AdamW)", "FSDP + SGD")
STEPS_OPTIMIZER = {"DDP + SGD": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                   "DDP + ShardedOptimizer(AdamW)": (torch.optim.AdamW, dict(lr=0.01)),
                   "FSDP + SGD": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}


def _train(ctx, engine: str) -> tuple[dict, str]:
    """Three steps of ``engine`` on this rank's share of each global batch: the full parameters and the
    transport the engine chose."""
    xs, ys = engine_data()
    cls, options = STEPS_OPTIMIZER[engine]
    net = make_net().to(ctx.device)
    if engine.startswith("FSDP"):
        model = FSDP(net)
        optimizer = cls(model.parameters(), **options)
    else:
        model = DDP(net)
        optimizer = (ShardedOptimizer(model.parameters(), cls, **options) if "Sharded" in engine
                     else cls(model.parameters(), **options))
    for x, y in zip(xs, ys):
        x, y = _rows(x, ctx.rank, ctx.world_size).to(ctx.device), _rows(y, ctx.rank, ctx.world_size).to(ctx.device)
        nn.functional.mse_loss(model(x), y).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    params = model.full_parameters() if engine.startswith("FSDP") else dict(net.named_parameters())
    return {k: v.detach().double().cpu() for k, v in params.items()}, model.transport.describe()


def _engines_worker(ctx) -> dict:
    _float32_is_float32()
    out = {engine: _train(ctx, engine) for engine in ENGINES}
    out["refusals"] = _refusals(ctx)
    return out


def _refusals(ctx) -> dict:
    """What the engines refuse on CUDA, each message as raised (None: not refused)."""
    def refused(call):
        try:
            call()
        except (ValueError, RuntimeError) as error:
            return str(error)
        return None

    out = {"shared_memory by name": refused(lambda: DDP(make_net().to(ctx.device), transport="shared_memory"))}
    if ctx.world_size > 1 and ctx.backend == "gloo":  # the shared-memory transport needs CPU collectives
        shm = transport.SharedMemory()
        out["a SharedMemory object"] = refused(lambda: DDP(make_net().to(ctx.device), transport=shm))
        device = ctx.device if ctx.rank == 0 else torch.device("cpu")
        out["mixed device types"] = refused(lambda: transport.resolve("auto", None, device))
        shm.close()
    return out


@pytest.fixture(scope="module", params=LAYOUTS, ids=LAYOUT_IDS)
def engines(request):
    return request.param, on_gpu(_engines_worker, request.param)


def oracle(engine: str) -> dict:
    """One process, the global batch, on the CPU in float64."""
    net = make_net().double()
    cls, options = STEPS_OPTIMIZER[engine]
    optimizer = cls(net.parameters(), **options)
    for x, y in zip(*engine_data()):
        nn.functional.mse_loss(net(x.double()), y.double()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in net.named_parameters()}


@pytest.mark.parametrize("engine", ENGINES)
def test_engines_on_cuda_train_like_one_process_on_the_global_batch(engines, engine):
    (backend, n), ranks = engines
    want = oracle(engine)
    for rank, result in enumerate(ranks):
        params, used = result[engine]
        assert used.startswith("torch"), (f"{engine} on CUDA chose {used!r}: auto must take torch.distributed "
                                          "(gloo or NCCL)")
        assert params.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(params[key], want[key], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{engine}, {key}, rank {rank} of {backend} x{n}: {m}")


def test_a_cpu_only_transport_is_refused_at_construction_and_mixed_devices_on_every_rank(engines):
    (backend, n), ranks = engines
    for rank, result in enumerate(ranks):
        refusals = result["refusals"]
        assert "takes CPU tensors" in (refusals["shared_memory by name"] or ""), refusals
        if n > 1 and backend == "gloo":
            assert "cannot serve tensors on cuda" in (refusals["a SharedMemory object"] or ""), refusals
            assert "different device types" in (refusals["mixed device types"] or ""), (rank, refusals)


# --------------------------------------------------------------------------- the homework's algorithms


SIZES = (1, 7, 1001)


def _algorithms_worker(ctx) -> dict:
    out = {}
    for algorithm in (*allreduce.SUMS, "auto"):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for numel in SIZES:
                x = _contribution(ctx.rank, numel, dtype).to(ctx.device)
                allreduce.allreduce(x, "sum", algorithm=algorithm, check=True)
                out[algorithm, dtype, numel] = (x.device.type, x.double().cpu())
    numel = 7 * ctx.world_size
    full = _contribution(ctx.rank, numel, torch.float32).to(ctx.device)
    shard = torch.empty(7, device=ctx.device)
    allreduce.reduce_scatter(shard, full, "sum")
    gathered = torch.empty(numel, device=ctx.device)
    allreduce.all_gather(gathered, shard)
    out["reduce_scatter"], out["all_gather"] = shard.double().cpu(), gathered.double().cpu()
    out["staged"] = allreduce.staged(full)
    out["auto picks"] = allreduce.auto_algorithm(full)
    return out


def _contribution(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers: every dtype sums them exactly, so any error is a bug, not rounding."""
    return ((torch.arange(numel) * (rank + 3)) % 17 - 8).to(dtype)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_point_to_point_algorithms_sum_cuda_tensors_exactly(layout):
    backend, n = layout
    ranks = on_gpu(_algorithms_worker, layout)
    for key, value in ranks[0].items():
        if not isinstance(key, tuple):
            continue
        algorithm, dtype, numel = key
        want = sum(_contribution(r, numel, dtype).double() for r in range(n))
        for rank in ranks:
            device, got = rank[key]
            assert device == "cuda", key
            assert torch.equal(got, want), f"{key} on {backend} x{n}: {got} != {want}"
    total = sum(_contribution(r, 7 * n, torch.float32).double() for r in range(n))
    for rank, result in enumerate(ranks):
        assert torch.equal(result["reduce_scatter"], total[7 * rank:7 * (rank + 1)])
        assert torch.equal(result["all_gather"], total)
        # gloo's send and recv take host memory: CUDA tensors are staged through it; NCCL sends them as they are
        assert result["staged"] == (backend == "gloo"), result["staged"]
        if n > 1:
            assert result["auto picks"] == "torch", "no crossover measured on cuda: auto takes torch.distributed"


# --------------------------------------------------------------------------- the scripts


ON_ONE_GPU = ("--device", "cuda", "--backend", "gloo")  # two processes share GPU 0


@pytest.mark.parametrize("impl", ("ours", "pytorch"))
@pytest.mark.parametrize("engine", ("ddp", "zero1", "fsdp"))
def test_training_script_runs_a_few_steps_on_cuda(tmp_path, impl, engine):
    metrics = tmp_path / "metrics.json"
    run_torchrun("ddp_cifar100.py", 2, *ON_ONE_GPU, "--impl", impl, "--engine", engine,
                 "--dataset", "synthetic", "--train-size", "256", "--val-size", "128", "--batch-size", "16",
                 "--num-epochs", "1", "--max-steps", "3", "--autocast", "bf16", "--metrics-json", str(metrics),
                 timeout_s=300)
    doc = json.loads(metrics.read_text())
    assert doc["env"]["device"] == "cuda" and doc["env"]["gpu_memory_bytes"] > 0, doc["env"]
    assert doc["env"]["cuda"] and doc["env"]["device_model"], doc["env"]


# script -> its --quick arguments, cut to a few iterations (the run proves the CUDA path, not a speed); each
# spawns its own workers, except ddp_benchmark's run, started under torchrun
BENCHMARKS = {
    "syncbn_benchmark.py": ("--quick", "--settings", "workers", "--dtypes", "float32", "--batch", "64", "--hidden",
                            "128", "--iters", "8", "--rounds", "2"),
    "ddp_benchmark.py": ("--quick", "--models", "cnn", "--variants", "ddp pytorch best", "ddp ours", "--iters", "6",
                         "--rounds", "2", "--warmup", "1", "--no-breakdown"),
    "collectives_benchmark.py": ("--quick", "--procs", "2", "--sizes", "4000", "1MB", "--iters", "4", "--warmup", "1"),
    "sharding_benchmark.py": ("--quick", "--procs", "2", "--iters", "4", "--rounds", "2", "--warmup", "1"),
    "allreduce.py": ("--quick", "--world-sizes", "1", "2", "--sizes", "1000", "100000", "--repeats", "4", "--warmup",
                     "1"),
}
UNDER_TORCHRUN = ("ddp_benchmark.py",)


@pytest.mark.parametrize("script", list(BENCHMARKS))
def test_each_benchmark_quick_run_on_one_gpu_writes_gpu_results(tmp_path, script):
    out = tmp_path / "out.json"
    args = (*BENCHMARKS[script], *ON_ONE_GPU, "--json", str(out))
    if script in UNDER_TORCHRUN:
        run_torchrun(script, 2, *args, timeout_s=600)
    else:
        done = subprocess.run([sys.executable, script, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{script}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert doc["env"]["device"] == "cuda" and doc["env"]["nccl"] is not None, doc["env"]
    assert doc["results"], f"{script} wrote no rows"
    if script == "syncbn_benchmark.py":
        impls = {row.get("impl") for row in doc["results"]}
        assert "torch.nn.SyncBatchNorm" in impls, f"no torch.nn.SyncBatchNorm column on CUDA: {sorted(map(str, impls))}"


def test_the_environment_header_records_the_gpu():
    from dpkit.bench.results import environment, format_environment

    env = environment("nccl", "cuda", 1)
    assert env["device"] == "cuda" and env["gpu_memory_bytes"] > 0 and env["cuda"] and env["gpu_capability"]
    assert torch.cuda.get_device_name(0) in format_environment(env)
