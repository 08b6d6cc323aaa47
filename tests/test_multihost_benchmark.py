"""multihost_benchmark.py: the model beside the simulated job, the model of a cluster, and its command line.

The launcher side (fitting links, predicting, the cluster rows, the report) runs here on rows made from a
known link, so the fitted model must give them back; the real 4-process job is the slow test.
"""

import json

import pytest

import multihost_benchmark as bench
from common import REPO
from dpkit.bench import cluster
from dpkit.bench.cluster import Cluster, Link

INSIDE, BETWEEN = Link(1e-4, 2e-10), Link(5e-4, 1e-9)
HOSTS = [2, 2]
SIZES = (65536, 1 << 20, 8 << 20)
PIECES = {"buckets": 1, "units": 7}
PARAM_BYTES = 4_000_000


def measured_rows(compute_s: float = 0.05) -> list[dict]:
    """What the workers would return if the job behaved exactly as the model of INSIDE and BETWEEN says."""
    c = Cluster(2, 2, INSIDE, BETWEEN)
    model = {"inside [shared_memory]": lambda b: cluster.flat_ring(Cluster(1, 2, INSIDE, BETWEEN), b),
             "between [torch]": lambda b: cluster.flat_ring(Cluster(2, 1, INSIDE, BETWEEN), b),
             "flat [torch]": lambda b: cluster.flat_ring(c, b), "hierarchical": lambda b: cluster.hierarchical(c, b)}
    rows = [{"kind": "collective", "label": label, "bytes": size, "p50_s": f(size), "round_p50_s": [f(size)] * 3}
            for size in SIZES for label, f in model.items()]
    rows.append({"kind": "step", "label": bench.NO_COMMUNICATION, "p50_s": compute_s, "round_p50_s": [compute_s] * 3,
                 "param_bytes": PARAM_BYTES, "pieces": PIECES})
    rows += [{"kind": "step", "label": label, "p50_s": 0.1, "round_p50_s": [0.1] * 3, "param_bytes": PARAM_BYTES,
              "pieces": PIECES} for label in bench.STEPS]
    return [row | {"hosts": HOSTS, "oversubscribed": True} for row in rows]


@pytest.fixture(scope="module")
def completed(tmp_path_factory):
    args = bench.parse_args(["--quick", "--memory-link", str(tmp_path_factory.mktemp("none") / "missing.json"),
                             "--cluster-hosts", "2", "8"])
    return bench.complete(measured_rows(), {}, args), args


def test_each_link_class_is_fitted_back_from_its_measurements(completed):
    rows, _ = completed
    links = {r["label"]: r for r in rows if r["kind"] == "link"}
    assert links["inside [shared_memory]"]["alpha_s"] == pytest.approx(INSIDE.alpha_s, rel=1e-6)
    assert links["inside [shared_memory]"]["beta_s_per_byte"] == pytest.approx(INSIDE.beta_s_per_byte, rel=1e-6)
    assert links["between [torch]"]["beta_s_per_byte"] == pytest.approx(BETWEEN.beta_s_per_byte, rel=1e-6)
    assert "simulated job" in links["memory (the model's inside a host)"]["source"], "no file: the job's own fit, said"


def test_the_model_predicts_the_simulated_jobs_collectives_and_steps(completed):
    rows, _ = completed
    for row in rows:
        if row["kind"] == "collective":
            assert row["predicted_s"] == pytest.approx(row["p50_s"], rel=1e-6), row["label"]
    steps = {r["label"]: r for r in rows if r["kind"] == "step"}
    c = Cluster(2, 2, INSIDE, BETWEEN)
    hsdp = cluster.communication_seconds("hsdp", c, PARAM_BYTES, 7)
    assert steps["HSDP"]["predicted_s"] == pytest.approx(0.05 + hsdp)
    assert steps["DDP [torch]"]["predicted_s"] == pytest.approx(0.05 + cluster.flat_ring(c, PARAM_BYTES))
    assert "predicted_s" not in steps[bench.NO_COMMUNICATION]


def test_the_cluster_rows_cover_every_model_host_count_and_engine_with_the_stated_network(completed):
    rows, args = completed
    got = [r for r in rows if r["kind"] == "cluster"]
    assert {(r["model"], r["hosts"], r["engine"]) for r in got} == {
        (m, h, e) for m in bench.CLUSTER_MODELS for h in (2, 8) for e in ("ddp flat", *cluster.engines())}
    assert all(r["ranks_per_host"] == args.ranks_per_host == 8 for r in got)
    resnet = next(r for r in got if r["model"] == "resnet18")
    assert resnet["param_bytes"] == 4 * 11_227_812  # torchvision's resnet18 with a 100-class head (dpkit.models)
    ratios = [r for r in rows if r["kind"] == "ratio"]
    assert [r["bytes"] for r in ratios] == list(SIZES) and all(r["oversubscribed"] for r in ratios)


def test_the_report_labels_an_oversubscribed_job_and_states_the_cluster(completed):
    rows, _ = completed
    text = bench.report(rows)
    assert "Simulated job [oversubscribed]" in text and "Model of a cluster (8 ranks per host)" in text
    assert "hierarchical" in text and "GPT-2 small" in text


@pytest.mark.parametrize("argv, message", [(["--hosts", "2", "1"], "same number of ranks"),
                                           (["--hosts", "4"], "two or more hosts"),
                                           (["--device", "cpu", "--backend", "nccl"], "--backend nccl")])
def test_a_layout_the_simulation_cannot_run_is_a_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_the_quick_run_on_two_simulated_hosts_writes_every_kind_of_row(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "multihost.json"
    done = subprocess.run([sys.executable, "multihost_benchmark.py", "--quick", "--sizes", "64KB", "1MB", "--iters",
                           "4", "--rounds", "2", "--warmup", "1", "--json", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    kinds = {r["kind"] for r in doc["results"]}
    assert kinds == {"collective", "step", "link", "ratio", "cluster"}
    assert {r["label"] for r in doc["results"] if r["kind"] == "step"} == {bench.NO_COMMUNICATION, *bench.STEPS}
    assert "oversubscribed" in done.stdout
