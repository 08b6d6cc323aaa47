"""The report's training section: our DDP and PyTorch's on the same loop (``results/train_ours.json`` and
``results/train_pytorch.json``, from ddp_cifar100.py), their curves, and the homework solution's runs beside them.

    from dpkit.report import page, training_section
    training_section.runs_and_curves(page.Page.open())
"""

from __future__ import annotations

from dpkit.report import findings, plots, summary
from dpkit.report.wording import count, our_engine

IMPLS = ("ours", "pytorch")
SEED_KEYS = {"ours": "selfmade"}  # seeds.json keeps the homework solution's own word for our implementation
RANK_COLUMNS = [("rank", "Rank", "d"), ("train_time_s", "Time (s)", ".1f"),
                ("step_time_median_s", "Step (s, median)", ".3f"),
                ("peak_memory_bytes", "Max memory allocated (bytes)", ",d")]


def runs(page) -> dict[str, dict]:
    return {impl: doc for impl in IMPLS if (doc := page.load(f"train_{impl}"))}


def largest_difference(runs: dict[str, dict]) -> float:
    """The largest difference between the two runs' per-epoch training loss, validation loss and accuracy."""
    epochs = {impl: [r for r in doc["results"] if r["kind"] == "epoch"] for impl, doc in runs.items()}
    return max(abs(a[k] - b[k]) for a, b in zip(epochs["ours"], epochs["pytorch"])
               for k in ("train_loss", "val_loss", "val_acc"))


def ratio(runs: dict[str, dict], key: str) -> float:
    """Ours / PyTorch's of one field of the final row."""
    return findings.final_row(runs["ours"])[key] / findings.final_row(runs["pytorch"])[key]


def run_text(impl: str, doc: dict) -> str:
    cfg, f = doc["config"], findings.final_row(doc)
    return (f"**{impl}**: engine {cfg['engine_used']} ({cfg['impl_used']}), transport {cfg['transport_used']}; "
            f"{cfg['dataset_used']} data ({cfg['train_size_used']} training / {cfg['val_size_used']} "
            f"validation images), {cfg['world_size_used']} processes, {count(f['epochs'], 'epoch')}, global batch "
            f"{cfg['global_batch']}, SyncBatchNorm: {cfg['sync_bn_used']}. Final validation loss {f['val_loss']:.4f}, "
            f"accuracy {f['val_acc']:.4f} (training loss {f['train_loss']:.4f}).")


def commentary_text(runs: dict[str, dict]) -> str:
    if differ := findings.training_differences(runs["ours"], runs["pytorch"]):
        return (f"*Commentary.* The two runs are not the same experiment ({'; '.join(differ)}, ours / PyTorch's): "
                "their curves, losses and times are not compared.")
    largest = largest_difference(runs)
    staged = {d["config"]["transport_used"] for d in runs.values()} == {"shared_memory"}
    return (f"*Commentary.* The largest difference between the two runs' per-epoch loss and accuracy is {largest:.3g}: "
            + (f"the curves are **identical**, as they should be: {our_engine(runs['ours']['config'])} divides each "
               "gradient by the world size before the sum, as PyTorch's DDP does, so both reach the same weights. "
               if largest == 0 else
               "the curves differ, which on a CPU with a fixed seed points to a difference in the gradient "
               "averaging. ")
            + _step_text(runs)
            + ("on shared memory ours is zero copy and PyTorch's DDP staged, so this ratio holds the path as well as "
               "the engine; " if staged else "")
            + "the DDP comparison with intervals is the DDP section below); peak memory, ours / PyTorch's: "
              f"{ratio(runs, 'peak_memory_max_bytes'):.2f}.")


def _step_text(runs: dict[str, dict]) -> str:
    if not findings.steps_timed(*runs.values()):
        return "No median time per optimizer step (a run too short to time one; "
    return (f"Median time per optimizer step, ours / PyTorch's: {ratio(runs, 'step_time_median_s'):.2f} (one run "
            "each, not interleaved, no interval; ")


def runs_and_curves(page) -> None:
    """Each run's settings and per-rank table, both curves in one figure, and what they show."""
    found = runs(page)
    for impl, doc in found.items():
        page.say(run_text(impl, doc))
        page.show([r for r in doc["results"] if r["kind"] == "rank"], RANK_COLUMNS)
    page.draw(plots.training_curves(found))
    page.say(commentary_text(found))


def seed_rows(runs: dict[str, dict], seed: dict) -> list[dict]:
    """The seed's run and ours, per implementation: time, memory, validation loss and accuracy."""
    training, rows = seed["training"], []
    for impl in IMPLS:
        s, f = training[SEED_KEYS.get(impl, impl)], findings.final_row(runs[impl])
        rows.append({"who": f"seed, {impl}", "time": max(r["time_s"] for r in s["ranks"]),
                     "mem": max(r["max_memory_allocated_bytes"] for r in s["ranks"]), "loss": s["val_loss"],
                     "acc": s["val_acc"], "epochs": training["epochs"], "data": training["dataset"]})
        rows.append({"who": f"ours, {impl}", "time": f["train_time_max_s"], "mem": f["peak_memory_max_bytes"],
                     "loss": f["val_loss"], "acc": f["val_acc"], "epochs": f["epochs"],
                     "data": runs[impl]["config"]["dataset_used"]})
    return rows


def bn_text(runs: dict[str, dict]) -> str:
    used = sorted({doc["config"]["sync_bn_used"] for doc in runs.values()})
    if len(used) == 1:
        return f"both with {'our' if used == ['ours'] else 'the same'} SyncBatchNorm ({used[0]})"
    return f"with different SyncBatchNorm layers ({', '.join(used)})"


def accuracy_text(runs: dict[str, dict], training: dict) -> str:
    data = runs["ours"]["config"]["dataset_used"]
    if data.lower().startswith("cifar"):
        return "**Accuracy: comparable**, same data set."
    return (f"**Accuracy: not comparable**: our committed run trains on {data} data for "
            f"{findings.final_row(runs['ours'])['epochs']} epochs, the seed on {training['dataset']} for "
            f"{training['epochs']}.")


def seed_text(runs: dict[str, dict], rows: list[dict], seed: dict, env: dict) -> str:
    return (f"Hardware: seed on {seed['hardware']}; ours on {summary.hardware(env)}. "
            f"**Time and memory, its implementation / PyTorch's: not the same measurement.** The seed: "
            f"{rows[0]['time'] / rows[2]['time']:.2f} (whole run, slowest rank) and "
            f"{rows[0]['mem'] / rows[2]['mem']:.2f}, "
            f"on GPUs, its PyTorch run with PyTorch's SyncBatchNorm. Ours: {_ours_text(runs)} "
            f"The seed's two runs ended {abs(rows[0]['acc'] - rows[2]['acc']):.4f} apart in accuracy with different "
            "SyncBatchNorm layers on GPUs, and it reports that runs are not reproducible. "
            + accuracy_text(runs, seed["training"]))


def _ours_text(runs: dict[str, dict]) -> str:
    """Our two runs' ratios and how far apart they ended, where they are the same experiment."""
    if differ := findings.training_differences(runs["ours"], runs["pytorch"]):
        return f"not compared, the two runs are not the same experiment ({'; '.join(differ)}, ours / PyTorch's)."
    one_bn = len({doc["config"]["sync_bn_used"] for doc in runs.values()}) == 1
    wires = sorted({doc["config"]["transport_used"] for doc in runs.values()})
    step = (f"{ratio(runs, 'step_time_median_s'):.2f} (median step)" if findings.steps_timed(*runs.values())
            else "no median step (too few steps)")
    return (f"{ratio(runs, 'train_time_max_s'):.2f} (whole training loop, slowest rank), {step} and "
            f"{ratio(runs, 'peak_memory_max_bytes'):.2f}, {bn_text(runs)}, on the {' and '.join(wires)} transport "
            "(ours zero copy where it is shared memory, PyTorch's DDP staged through `transport.ddp_comm_hook`). "
            f"**Reproducibility: not a ranking.** Our two runs differ by {largest_difference(runs):.3g}: they share "
            f"{'the SyncBatchNorm layer' if one_bn else 'the loop'} and ran on one CPU machine.")


def beside_seed(page) -> None:
    found, seed = runs(page), page.seeds["homework_solution"]
    rows = seed_rows(found, seed)
    page.show(rows, [("who", "run", "s"), ("data", "data", "s"), ("epochs", "epochs", "d"),
                     ("time", "time (s, slowest rank)", ".1f"), ("mem", "max memory (bytes)", ",d"),
                     ("loss", "val loss", ".4f"), ("acc", "val accuracy", ".4f")])
    page.say(seed_text(found, rows, seed, found["ours"]["env"]))
