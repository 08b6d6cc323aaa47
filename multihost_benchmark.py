"""Data parallelism beyond one host, on a simulated multi-host job, beside a two-link model of a real cluster.

    python multihost_benchmark.py --quick --json results/multihost.json   # 4 processes as 2 hosts of 2 ranks
    python multihost_benchmark.py --hosts 2 2 2                            # 6 processes as 3 hosts
    DPKIT_HOSTS=2,2 torchrun --standalone --nproc_per_node 4 multihost_benchmark.py

The job: ``--hosts`` ranks per host, simulated on this machine (``dpkit.comm.hosts``: shared memory only
inside a host, gloo's TCP between hosts). Measured, interleaved in rounds, slowest rank per iteration:
the two link classes alone (an all-reduce inside every host through its shared memory, and among the
ranks of one local index across hosts through gloo, all at once, as the hierarchical all-reduce runs
them), the flat all-reduce over every rank (gloo) and the hierarchical one, and one training step of a
small GPT under DDP [torch] and [hierarchical], ZeRO stages 1 and 2, FSDP [torch] and hybrid sharding
(shard inside a host, replicate across), beside the step without communication.

The model (``dpkit.bench.cluster``): each link class fitted to its measured all-reduce (alpha per message,
beta per byte) predicts the same job's collectives and steps, printed beside the measurements; then, with
this machine's memory link inside a host and a stated network between hosts (``--network-gbps``,
``--network-latency-us``, ``--ranks-per-host``), the communication per step of each engine for resnet18
and GPT-2 small from 2 to 64 hosts. With more processes than cores the measurements are oversubscribed:
they test the model's shape, not a cluster's speed, and carry no headline.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpkit.bench import harness
from dpkit.bench.cluster import Cluster, Link, communication_seconds, engines, flat_ring, hierarchical
from dpkit.bench.collectives import format_size, parse_size
from dpkit.bench.measure import oversubscribed, paired_ratio, percentile, round_p50s, time_interleaved
from dpkit.bench.results import markdown_table, read_results
from dpkit.comm import transport
from dpkit.comm.hierarchical import Plan, host_subgroups
from dpkit.comm.hosts import HOSTS_ENV, host_indices, layout_value, ranks_by_host
from dpkit.comm.process_groups import add_common_args, parse_checked
from dpkit.engines import registry
from dpkit.engines.ddp import DDP
from dpkit.engines.fsdp import FSDP
from dpkit.engines.zero import ShardedOptimizer
from dpkit.models import GPTConfig, build_model

QUICK = dict(sizes=["64KB", "1MB", "8MB"], iters=12, rounds=6, warmup=2)
NORMAL = dict(sizes=["64KB", "1MB", "8MB", "64MB"], iters=40, rounds=10, warmup=3)
SMALL_GPT = GPTConfig(vocab=2048, seq_len=32, width=128, depth=2, heads=4)  # the simulated job's model
CLUSTER_MODELS = {"resnet18": dict(name="resnet18"), "GPT-2 small": dict(name="gpt", gpt=GPTConfig())}
# The simulated job's steps: label -> (the engine of the model, the collectives' layout in the model)
STEPS = {"DDP [torch]": "ddp flat", "DDP [hierarchical]": "ddp", "ZeRO-1 [hierarchical]": "zero1",
         "ZeRO-2 [hierarchical]": "zero2", "FSDP [torch]": "fsdp flat", "HSDP": "hsdp"}
NO_COMMUNICATION = "compute only"
LR = 1e-4
BUCKET_BYTES = 25 * 2 ** 20  # DDP's and ShardedOptimizer's default bucket_cap_mb
FSDP_UNITS = (torch.nn.Linear, torch.nn.Embedding)  # our FSDP's default shard_types


# --------------------------------------------------------------------------- measured, on every rank


def worker(ctx, args: argparse.Namespace) -> list[dict]:
    hosts = ranks_by_host(host_indices())
    if len(hosts) < 2 or len({len(h) for h in hosts}) > 1:
        raise ValueError(f"{HOSTS_ENV} must give at least two hosts with the same number of ranks, got "
                         f"{[len(h) for h in hosts]} ranks per host")
    inside, between = _link_transports(hosts, ctx.timeout_s)
    placed = {"hosts": [len(h) for h in hosts], "oversubscribed": oversubscribed(ctx.world_size, ctx.device)}
    rows = [row | placed for row in _collectives(ctx, args, inside, between)]
    harness.keep(ctx, rows)
    rows += [row | placed for row in _steps(ctx, args)]
    for t in (inside, between):
        t.close()
    return rows


def _link_transports(hosts: list[list[int]], timeout_s: float):
    """This rank's host's shared memory, and gloo among the ranks of its local index on every host."""
    plan, me = Plan(hosts, range(dist.get_world_size())), dist.get_rank()
    made = host_subgroups(plan, None, timeout_s)
    return transport.SharedMemory(made[plan.host_of[me]]), transport.Torch(made[len(hosts) + plan.local_of[me]])


def _collectives(ctx, args, inside, between) -> list[dict]:
    flat, hier = transport.Torch(), transport.resolve("hierarchical")
    rows = []
    for size in args.sizes:
        numel = max(1, parse_size(size) // 4)
        buffers = {name: t.allocate((numel,), dtype=torch.float32) for name, t in
                   (("inside", inside), ("between", between), ("flat", flat), ("hierarchical", hier))}
        for b in buffers.values():
            b.fill_(1.0)
        calls = {"inside [shared_memory]": lambda: inside.all_reduce(buffers["inside"], "avg"),
                 "between [torch]": lambda: between.all_reduce(buffers["between"], "avg"),
                 "flat [torch]": lambda: flat.all_reduce(buffers["flat"], "avg"),
                 "hierarchical": lambda: hier.all_reduce(buffers["hierarchical"], "avg")}
        timings = time_interleaved(calls, args.iters, args.warmup, args.rounds)
        rows += [_timed_row("collective", name, timing, args, bytes=numel * 4) for name, timing in timings.items()]
    return rows


def _timed_row(kind: str, name: str, timing, args: argparse.Namespace, **extra) -> dict:
    return {"kind": kind, "label": name, **extra, "p50_s": percentile(timing.samples, 50),
            "round_p50_s": round_p50s(timing.samples, args.iters, args.rounds)}


def _steps(ctx, args) -> list[dict]:
    data = torch.randint(0, SMALL_GPT.vocab, (args.batch_size, SMALL_GPT.seq_len + 1),
                         generator=torch.Generator().manual_seed(ctx.rank))
    steps = {NO_COMMUNICATION: _trainer(None)} | {label: _trainer(label) for label in STEPS}
    timings = time_interleaved({k: (lambda s=s: s(data)) for k, s in steps.items()}, args.iters, args.warmup,
                               args.rounds)
    model = build_model("gpt", SMALL_GPT)
    params, pieces = sum(p.numel() * 4 for p in model.parameters()), pieces_of(model, FSDP_UNITS)
    return [_timed_row("step", name, timing, args, param_bytes=params, pieces=pieces)
            for name, timing in timings.items()]


def _trainer(label: str | None):
    """A closure doing one step of ``label``'s engine on a fresh copy of the small GPT (the same weights)."""
    torch.manual_seed(0)
    net = build_model("gpt", SMALL_GPT)
    if label is None:
        model, optimizer, finish = net, torch.optim.AdamW(net.parameters(), lr=LR), lambda: None
    elif label.startswith("DDP") or label.startswith("ZeRO-1"):
        model = DDP(net, transport="torch" if "[torch]" in label else "auto")
        optimizer = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR) if label.startswith("ZeRO")
                     else torch.optim.AdamW(model.parameters(), lr=LR))
        finish = model.finish_gradient_synchronization
    elif label.startswith("ZeRO-2"):
        model, finish = net, lambda: None
        optimizer = ShardedOptimizer(net.parameters(), torch.optim.AdamW, stage=2, lr=LR)
    else:
        model = FSDP(net, transport="torch") if label.startswith("FSDP") else FSDP(net, shard="host")
        optimizer, finish = torch.optim.AdamW(model.parameters(), lr=LR), model.finish_gradient_synchronization

    def step(tokens: torch.Tensor) -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        finish()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


# --------------------------------------------------------------------------- the model, in the launcher


def complete(rows: list[dict], env: dict, args: argparse.Namespace) -> list[dict]:
    """The measured rows, the fitted links, the model's predictions for the simulated job beside them, and the
    model of a cluster (``--ranks-per-host`` ranks per host, the stated network)."""
    per_host = rows[0]["hosts"]
    inside, between = (_fit(rows, "inside [shared_memory]", per_host[0]), _fit(rows, "between [torch]", len(per_host)))
    simulated = Cluster(len(per_host), per_host[0], inside, between)
    out = [row | _predicted(row, simulated, rows) for row in rows]
    out += [{"kind": "link", "label": name, "alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte,
             "gbps": link.gbps()} for name, link in (("inside [shared_memory]", inside), ("between [torch]", between))]
    out += _ratios(rows, "hierarchical", "flat [torch]", "hierarchical / flat [torch]")
    memory, source = memory_link(args.memory_link, inside)
    out.append({"kind": "link", "label": "memory (the model's inside a host)", "alpha_s": memory.alpha_s,
                "beta_s_per_byte": memory.beta_s_per_byte, "gbps": memory.gbps(), "source": source})
    network = Link.from_network(args.network_gbps, args.network_latency_us * 1e-6)
    return out + cluster_rows(memory, network, args.ranks_per_host, args.cluster_hosts)


def memory_link(path: str, simulated: Link) -> tuple[Link, str]:
    """The link inside a host for the cluster model: this machine's shared-memory all-reduce between two
    processes on their own cores (``path``: a collectives_benchmark results file, its zero-copy rows), or,
    without that file, the simulated job's (oversubscribed) fit, saying so."""
    if os.path.exists(path):
        rows = [r for r in read_results(path)["results"] if r.get("label") == "shared_memory"
                and r.get("world_size") == 2 and r.get("collective", "allreduce") == "allreduce"]
        if len(rows) >= 2:
            return Link.fit([r["bytes"] for r in rows], [r["p50_s"] for r in rows], 2), f"{path}, 2 processes"
    return simulated, "the simulated job's inside [shared_memory] fit (oversubscribed)"


def _fit(rows: list[dict], label: str, ranks: int) -> Link:
    mine = [r for r in rows if r["kind"] == "collective" and r["label"] == label]
    return Link.fit([r["bytes"] for r in mine], [r["p50_s"] for r in mine], ranks)


def _predicted(row: dict, c: Cluster, rows: list[dict]) -> dict:
    if row["kind"] == "collective":
        one_host = Cluster(1, c.ranks_per_host, c.inside, c.between)
        across = Cluster(c.hosts, 1, c.inside, c.between)
        model = {"inside [shared_memory]": flat_ring(one_host, row["bytes"]),
                 "between [torch]": flat_ring(across, row["bytes"]),
                 "flat [torch]": flat_ring(c, row["bytes"]), "hierarchical": hierarchical(c, row["bytes"])}
        return {"predicted_s": model[row["label"]]}
    if row["kind"] == "step" and row["label"] in STEPS:
        compute = next(r["p50_s"] for r in rows if r["kind"] == "step" and r["label"] == NO_COMMUNICATION)
        return {"predicted_s": compute + step_communication(STEPS[row["label"]], c, row["param_bytes"], row["pieces"])}
    return {}


def step_communication(engine: str, c: Cluster, param_bytes: float, pieces: dict[str, int]) -> float:
    """``cluster.communication_seconds``, with "ddp flat" and "fsdp flat": the same over one ring of all ranks.
    ``pieces``: the collectives each kind of engine cuts its bytes into ("buckets", "units")."""
    sharded = engine == "fsdp flat" or (engine != "ddp flat" and registry.get(engine).shards == 3)
    count = pieces["units"] if sharded else pieces["buckets"]
    if engine == "ddp flat":
        return count * flat_ring(c, param_bytes / count, 2)
    if engine == "fsdp flat":
        return count * 3 * flat_ring(c, param_bytes / count, 1)
    return communication_seconds(engine, c, param_bytes, count)


def pieces_of(model: torch.nn.Module, unit_types: tuple[type, ...]) -> dict[str, int]:
    """How many collectives of each kind a step makes: DDP's and ZeRO's 25 MiB buckets, FSDP's units (the
    modules of ``unit_types`` that hold parameters)."""
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    units = sum(1 for m in model.modules() if isinstance(m, unit_types) and any(True for _ in m.parameters(False)))
    return {"buckets": max(1, math.ceil(param_bytes / BUCKET_BYTES)), "units": max(1, units)}


def _ratios(rows: list[dict], ours: str, theirs: str, name: str) -> list[dict]:
    out = []
    for size in sorted({r["bytes"] for r in rows if r["kind"] == "collective"}):
        pick = {r["label"]: r for r in rows if r["kind"] == "collective" and r["bytes"] == size}
        ratio = paired_ratio(pick[ours]["round_p50_s"], pick[theirs]["round_p50_s"])
        out.append({"kind": "ratio", "label": name, "bytes": size, **{k: ratio[k] for k in
                    ("median", "ci_low", "ci_high", "rounds")}, "oversubscribed": pick[ours]["oversubscribed"]})
    return out


def cluster_rows(inside: Link, network: Link, ranks_per_host: int, hosts: list[int]) -> list[dict]:
    """Communication per step of every engine (and DDP on one flat ring) for the cluster models' sizes."""
    rows = []
    for model, spec in CLUSTER_MODELS.items():
        with torch.device("meta"):
            net = build_model(**spec)
        param_bytes, pieces = sum(p.numel() * 4 for p in net.parameters()), pieces_of(net, (torch.nn.Module,))
        for h in hosts:
            c = Cluster(h, ranks_per_host, inside, network)
            for engine in ("ddp flat", *engines()):
                rows.append({"kind": "cluster", "model": model, "param_bytes": param_bytes, "hosts": h,
                             "ranks_per_host": ranks_per_host, "engine": engine, **pieces,
                             "communication_s": step_communication(engine, c, param_bytes, pieces)})
    return rows


# --------------------------------------------------------------------------- the report


def report(rows: list[dict]) -> str:
    out = ["", "Links (fitted to the measured all-reduces): " + "; ".join(
        f"{r['label']} alpha {r['alpha_s'] * 1e6:.0f} us, {r['gbps'] or 0:.2f} GB/s" for r in rows
        if r["kind"] == "link")]
    label = " [oversubscribed]" if any(r.get("oversubscribed") for r in rows) else ""
    measured = [{"what": r["label"], "size": format_size(r["bytes"]) if "bytes" in r else "one step",
                 "measured_ms": r["p50_s"] * 1e3, "model_ms": r["predicted_s"] * 1e3 if "predicted_s" in r else None}
                for r in rows if r["kind"] in ("collective", "step")]
    out += ["", f"Simulated job{label}: measured p50 and the model's prediction", markdown_table(
        measured, [("what", "what", "s"), ("size", "size", "s"), ("measured_ms", "measured ms", ".2f"),
                   ("model_ms", "model ms", ".2f")])]
    out += ["", f"Hierarchical / flat [torch] all-reduce{label}: " + ", ".join(
        f"{format_size(r['bytes'])} {r['median']:.2f}x [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"
        for r in rows if r["kind"] == "ratio")]
    cluster = [r for r in rows if r["kind"] == "cluster"]
    if cluster:
        engines = list(dict.fromkeys(r["engine"] for r in cluster))
        table = {}
        for r in cluster:
            table.setdefault((r["model"], r["hosts"]), {"model": r["model"], "hosts": r["hosts"]})[r["engine"]] = \
                r["communication_s"] * 1e3
        out += ["", f"Model of a cluster ({cluster[0]['ranks_per_host']} ranks per host): communication ms per step, "
                "nothing overlapped",
                markdown_table(list(table.values()), [("model", "model", "s"), ("hosts", "hosts", "d"),
                                                     *((e, e, ".1f") for e in engines)])]
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 2],
                        help="ranks on each simulated host (ignored under torchrun: DPKIT_HOSTS says) "
                             "(default: %(default)s)")
    parser.add_argument("--sizes", nargs="+", default=None, help=f"all-reduce sizes (default: {NORMAL['sizes']})")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=None, help=f"timed calls of each (default: {NORMAL['iters']})")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default: {NORMAL['rounds']})")
    parser.add_argument("--warmup", type=int, default=None, help=f"untimed calls first (default: {NORMAL['warmup']})")
    parser.add_argument("--network-gbps", type=float, default=100.0,
                        help="the model's network between hosts, Gbit/s per host (default: %(default)s)")
    parser.add_argument("--network-latency-us", type=float, default=10.0,
                        help="the model's latency of one message between hosts (default: %(default)s)")
    parser.add_argument("--ranks-per-host", type=int, default=8,
                        help="the model's ranks per host (default: %(default)s)")
    parser.add_argument("--cluster-hosts", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64],
                        help="host counts the model predicts (default: %(default)s)")
    parser.add_argument("--memory-link", metavar="PATH", default=os.path.join("results", "collectives.json"),
                        help="the model's link inside a host: the shared-memory all-reduce between 2 processes in "
                             "this collectives_benchmark results file (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"small and fast: {QUICK} (explicit flags win)")
    add_common_args(parser)
    args = parse_checked(parser, argv)
    for key, value in (QUICK if args.quick else NORMAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if len(args.hosts) < 2 or len(set(args.hosts)) > 1 or args.hosts[0] < 1:
        parser.error(f"--hosts needs two or more hosts with the same number of ranks, got {args.hosts}")
    if args.rounds > args.iters or args.warmup < 0 or args.batch_size < 1:
        parser.error("--rounds must not exceed --iters; --warmup must be at least 0, --batch-size at least 1")
    if args.device == "cuda":
        parser.error("--device cuda: the simulated hosts meet in shared memory, which takes CPU tensors")
    return args


BENCHMARK = harness.Benchmark(
    "multihost_benchmark", worker, world_sizes=lambda args: [sum(args.hosts)], report=report, complete=complete,
    describe=lambda args: f"hosts {args.hosts} (simulated), sizes {args.sizes}, {args.iters} iterations in "
                          f"{args.rounds} rounds; model: {args.ranks_per_host} ranks per host, "
                          f"{args.network_gbps:g} Gb/s and {args.network_latency_us:g} us between hosts",
    timeout_s=lambda args, world_size: 1800.0)


def main(args: argparse.Namespace) -> list[dict]:
    if "RANK" not in os.environ:  # the workers the harness spawns inherit the layout
        os.environ[HOSTS_ENV] = layout_value(args.hosts, sum(args.hosts))
    return harness.run(BENCHMARK, args)


if __name__ == "__main__":
    main(parse_args())
