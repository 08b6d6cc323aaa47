"""How the report writes a ratio, a verdict and a range of values in its sentences and tables.

    from dpkit.report import wording
    wording.ratio_text(row)      # the median ratio [its 95 % interval], the interval's name below five rounds
    wording.span(values)         # "lowest to highest", or the one value
    wording.wire("torch:dpkit")  # how a sentence names a transport: any registered one has a name
"""

from __future__ import annotations

from dpkit.bench.measure import format_ratio, verdict
from dpkit.report import findings

# How a sentence names the built-in transports; one registered elsewhere is named by its registry name.
WIRES = {"torch": "torch.distributed (gloo)", "torch:dpkit": 'torch.distributed on a "dpkit" group',
         "shared_memory": "shared memory", "shared_memory:thread": "shared memory on a communication thread",
         "shared_memory:staged": "shared memory, staged"}


def wire(transport: str) -> str:
    """The words for ``transport`` (a registry name) in a sentence."""
    return WIRES.get(transport, f"the transport {transport}")


def ratio_text(r: dict | None) -> str:
    """The median ratio and its interval; "(range of 2 rounds)" after it below five rounds; the plain ratio when
    the file has no rounds to bootstrap."""
    if r is None:
        return "n/a"
    if r.get("ci_low") is None:
        return f"{r['median']:.2f}x (no interval: the file has no per-round values)"
    few = r.get("rounds") and 1 < r["rounds"] < findings.MIN_BOOTSTRAP_ROUNDS
    return format_ratio(r) + (f" ({findings.interval_name(r['rounds'])})" if few else "")


def verdict_text(r: dict | None, target: float) -> str:
    return "n/a" if r is None or r.get("ci_low") is None else verdict(r, target)


def span(values, fmt: str = ".2f") -> str:
    """"a to b" over ``values``, or the one value when they are all equal."""
    values = sorted(values)
    return f"{values[0]:{fmt}}" if values[0] == values[-1] else f"{values[0]:{fmt}} to {values[-1]:{fmt}}"


def interval_text(ci) -> str:
    """"[low, high]" of a time interval (``plots.interval``), "-" without one."""
    return "-" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def our_engine(config: dict) -> str:
    """How a training run's engine is named beside PyTorch's DDP: "our DDP", or "our engine toy" for another."""
    engine = config.get("engine_used", "ddp")
    return "our DDP" if engine == "ddp" else f"our engine {engine}"


def count(n: int, noun: str) -> str:
    """"1 epoch", "3 epochs"."""
    return f"{n} {noun}{'s' * (n != 1)}"

