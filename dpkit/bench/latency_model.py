"""The latency-bandwidth model of the point-to-point all-reduces: T = steps x alpha + bytes x beta, fitted per
(backend, world size, algorithm) to measured p50s.

    from dpkit.bench.latency_model import fit_model, predict
    fits = fit_model(allreduce_rows(read_results("results/collectives.json")["results"]))
    predict(fits[0], 1 << 20)                 # seconds the fitted model gives for one 1 MiB call

collectives_benchmark.py prints and draws the fits; the report compares the algorithms with them (where the model
says recursive doubling and the ring cross, beside auto's table).
"""

from __future__ import annotations

import math

import numpy as np

from dpkit.bench.collectives import bus_factor
from dpkit.comm.message_passing import CUSTOM, SEGMENT_BYTES, TREE_SEGMENT_BYTES


def model_terms(algorithm: str, n: int, nbytes: int) -> tuple[float, float]:
    """(dependent steps, bytes one rank moves on the critical path) of one all-reduce of ``nbytes`` on n ranks.

    The model is T = steps x alpha + bytes x beta: alpha the cost of one dependent message
    (software and wake-up latency), beta the seconds per byte (copying, adding, the transport).
    p is the largest power of two <= n; a world that is not one folds in with two extra steps
    of the whole tensor. Pipelined algorithms add one step per extra segment.
    """
    p = 1 << (n.bit_length() - 1)
    fold = 0 if n == p else 2
    log_p = p.bit_length() - 1
    if algorithm in ("ring", "torch"):  # gloo's all_reduce is a ring too
        segments = max(1, math.ceil(nbytes / n / SEGMENT_BYTES)) if algorithm == "ring" else 1
        return 2 * (n - 1) + segments - 1, bus_factor(n) * nbytes
    if algorithm == "butterfly":  # n - 1 messages out and n - 1 back per phase, all posted at once
        return 2 * (n - 1), bus_factor(n) * nbytes
    if algorithm == "halving_doubling":
        return 2 * log_p + fold, (bus_factor(p) + fold) * nbytes
    if algorithm == "recursive_doubling":
        return log_p + fold, (log_p + fold) * nbytes
    if algorithm == "tree":  # up and down a heap of height h in k segments; an inner rank takes two per step
        height, k = n.bit_length() - 1, max(1, math.ceil(nbytes / TREE_SEGMENT_BYTES))
        return 2 * (height + k - 1), 2 * (height + k - 1) / k * min(2, n - 1) * nbytes
    raise ValueError(f"no model for {algorithm!r}")


def fit_model(rows: list[dict]) -> list[dict]:
    """Least-squares alpha and beta (both >= 0) per (backend, world size, algorithm) from the measured p50s."""
    fits = []
    rows = [r for r in rows if r.get("axis", "algorithm") == "algorithm"]  # the model is of algorithms on one wire
    groups = sorted({(r["backend"], r["world_size"], r["algorithm"]) for r in rows
                     if r["algorithm"] in ("torch", *CUSTOM)})  # auto is a mix of them: no model of its own
    for backend, n, name in groups:
        points = [r for r in rows if (r["backend"], r["world_size"], r["algorithm"]) == (backend, n, name)]
        if n < 2 or len(points) < 2:
            continue
        terms = np.array([model_terms(name, n, r["bytes"]) for r in points])
        times = np.array([r["p50_s"] for r in points])
        # Relative least squares (each row divided by its time): small sizes weigh as much as large ones.
        alpha, beta = _nonnegative_lstsq(terms / times[:, None], np.ones(len(times)))
        predicted = terms @ np.array([alpha, beta])
        fit = {"backend": backend, "world_size": n, "algorithm": name, "alpha_s": alpha, "beta_s_per_byte": beta,
               "gbps": 1e-9 / beta if beta > 0 else None,
               "max_rel_error": float(np.max(np.abs(predicted - times) / times))}
        sizes = np.geomspace(min(r["bytes"] for r in points), max(r["bytes"] for r in points), 50)
        fits.append(fit | {"curve": [(float(s), predict(fit, s)) for s in sizes]})  # what a chart of the model draws
    return fits


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """min |a x - b| over x >= 0 for two unknowns: the free solution, or the better one-term fit."""
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    if np.all(x >= 0):
        return float(x[0]), float(x[1])
    candidates = []
    for column in (0, 1):
        value = max(0.0, float(a[:, column] @ b / (a[:, column] @ a[:, column])))
        solution = [0.0, 0.0]
        solution[column] = value
        candidates.append((float(np.sum((a @ np.array(solution) - b) ** 2)), solution))
    return tuple(min(candidates)[1])


def predict(fit: dict, nbytes: int) -> float:
    steps, moved = model_terms(fit["algorithm"], fit["world_size"], nbytes)
    return steps * fit["alpha_s"] + moved * fit["beta_s_per_byte"]
