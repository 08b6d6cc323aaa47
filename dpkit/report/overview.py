"""The report's first and last sections: what ran and on what, and the summary, which is README's headline
block itself (``summary.render``), so README and report.ipynb state the same sentences from the same functions.

    from dpkit.report import overview, page
    overview.what_ran(page.Page.open())
"""

from __future__ import annotations

from dpkit.report import plots, summary

# Every file of the run, in the order the report reads them.
NAMES = ("syncbn", "train_ours", "train_pytorch", "allreduce", "collectives", "reduce_scatter", "all_gather",
         "ddp_benchmark", "ddp_headline", "ddp_sweep", "sharding", "sharding_resnet18", "sharding_gpt", "multihost")


def environment_rows(envs: list[dict], manifest: dict | None) -> list[dict]:
    """The environment of the files of ``envs``: each item once, every value the files hold where they differ
    (files of one run may come from parts run on different machines and commits: the table below names each
    file's machine)."""
    items = [("torch", "torch"), ("CUDA", "cuda"), ("device", "device"), ("device model", "device_model"),
             ("CPU cores", "cpus"), ("threads per process", "threads"), ("backend", "backend"), ("python", "python"),
             ("git commit", "git_commit")]
    def value(env: dict, key: str) -> str:
        return str((env[key] or "none (CPU)") if key == "cuda" else env[key])
    rows = [{"item": item, "value": "; ".join(dict.fromkeys(value(env, key) for env in envs))} for item, key in items]
    return rows + [{"item": "settings", "value": "quick" if manifest and manifest["config"]["quick"] else "full"}]


def worlds(doc: dict) -> list[int]:
    """The process counts a file ran (its config's list, else its rows')."""
    world = doc["env"]["world_size"]
    if isinstance(world, list):
        return world
    return sorted({r.get("world_size", world) for r in doc["results"]} - {None}) or [world]


def experiment_rows(docs: dict[str, dict | None]) -> list[dict]:
    """One row per file: its machine, its process counts, which of them ran on fewer cores than processes."""
    rows = []
    for name, doc in docs.items():
        if doc:
            over = [w for w in worlds(doc) if plots.oversubscribed({"world_size": w}, doc["env"])]
            rows.append({"experiment": name, "machine": summary.hardware(doc["env"]),
                         "processes": ", ".join(map(str, worlds(doc))),
                         "oversubscribed": ", ".join(map(str, over)) + " processes" if over else "no"})
    return rows


def what_ran(page) -> None:
    """The environment, the manifest's experiments with their times, and each file's machine and processes."""
    manifest = page.load("manifest")
    docs = {name: page.load(name) for name in NAMES}
    page.show(environment_rows([doc["env"] for doc in docs.values() if doc], manifest),
              [("item", "", "s"), ("value", "", "s")])
    if manifest:
        page.show([{**r, "command": r["command"].split("/bin/")[-1]} for r in manifest["results"]],
                  [("experiment", "experiment", "s"), ("status", "status", "s"), ("seconds", "seconds", ".0f"),
                   ("command", "command", "s")], label=False)
    page.show(experiment_rows(docs), [("experiment", "experiment", "s"),
                                      ("machine", "machine (its file's environment)", "s"),
                                      ("processes", "processes", "s"),
                                      ("oversubscribed", "oversubscribed (more processes than its machine's cores)",
                                       "s")])


def headline(page) -> None:
    """README's generated block, rendered by the same function from this page's results (or why it cannot be)."""
    producers = {name: f"python run_experiments.py --only {name}" for name in (*NAMES, "manifest")}
    try:
        block = summary.render(page.results, producers)
    except summary.MissingResults as missing:
        page.say(f"*{missing}*")
        return
    page.say("\n".join(line for line in block.splitlines() if line not in (summary.BEGIN, summary.END)).strip())
