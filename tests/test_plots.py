"""plots.py: every report figure draws from a small synthetic results document, with the artists the
style promises (a line or bar per series, log axes, units in the labels, intervals, oversubscription
marked, the legend outside the data). No processes are spawned."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from dpkit.bench import ddp_step  # noqa: E402
from dpkit.bench.results import RESULTS_SCHEMA  # noqa: E402
from dpkit.comm import transport  # noqa: E402
from dpkit.report import plots  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def doc(rows, cpus=2, world_size=2, config=None):
    env = {"device": "cpu", "cpus": cpus, "world_size": world_size, "device_model": "test cpu"}
    return {"schema": RESULTS_SCHEMA, "benchmark": "test", "env": env, "config": config or {}, "results": rows}


def legend_texts(figure):
    return [t.get_text() for legend in figure.legends for t in legend.get_texts()]


def data_lines(ax):
    """Lines that carry data (not the horizontal reference lines drawn with axhline)."""
    return [line for line in ax.get_lines()
            if len(line.get_xdata()) > 0 and line.get_label() and not line.get_label().startswith("_")]


# --------------------------------------------------------------------------- style


def test_sizes_are_written_in_binary_units():
    assert plots.format_bytes(65536) == "64 KiB"
    assert plots.format_bytes(10 * 2**20) == "10 MiB"
    assert plots.format_bytes(1.5 * 2**30) == "1.5 GiB"
    assert plots.format_bytes(100) == "100 B"


def test_one_colour_per_implementation_whatever_the_bucket_size_or_field():
    assert plots.colour("ddp ours 25M") == plots.colour("ddp ours 1000M") == plots.colour({"variant": "ddp ours"})
    assert plots.colour({"label": "ddp pytorch 25M", "variant": "ddp pytorch"}) == plots.colour("torch")
    best = {"label": "ddp pytorch 25M", "variant": "ddp pytorch", "ddp_options": {"gradient_as_bucket_view": True}}
    assert plots.kind(best) == "ddp pytorch best" and plots.colour(best) != plots.colour("ddp pytorch")
    fields = {"engine": "ddp", "impl": "pytorch", "option": "best", "bucket_cap_mb": 25.0, "transport": "torch"}
    assert plots.kind(fields) == "ddp pytorch best"
    assert plots.colour({**fields, "option": None}) == plots.colour("torch")
    assert len({plots.colour(k) for k in ("ddp ours", "ddp pytorch", "ddp pytorch best", "ddp ours overlap",
                                          "ddp ours flat", "ddp ours naive", "no ddp")}) == 7


def test_a_row_is_oversubscribed_by_its_own_flag_or_by_more_processes_than_cores():
    env = {"cpus": 2, "device": "cpu"}
    assert plots.oversubscribed({"world_size": 4}, env) and not plots.oversubscribed({"world_size": 2}, env)
    assert plots.oversubscribed({"world_size": 2, "oversubscribed": True}, {"cpus": 64})
    assert not plots.oversubscribed({"world_size": 8, "device": "cuda"}, env)


def test_intervals_come_from_the_rows_fields_or_a_bootstrap_over_its_rounds():
    assert plots.interval({"p50_s": 1.0, "p50_s_ci_low": 0.9, "p50_s_ci_high": 1.2}, "p50_s") == (0.9, 1.2)
    low, high = plots.interval({"p50_s": 1.0, "round_p50_s": [0.9, 1.0, 1.1, 1.3]}, "p50_s")
    assert 0.9 <= low <= 1.0 <= high <= 1.3
    assert plots.interval({"p50_s": 1.0}, "p50_s") is None
    # another statistic's rounds
    assert plots.interval({"p50_s": 1.0, "round_comm_wait_s": [0.1, 0.2]}, "p50_s") is None
    paired = plots.ratio({"round_p50_s": [2.0, 4.0, 2.2]}, {"round_p50_s": [2.0, 4.0, 2.0]})
    assert paired["median"] == pytest.approx(1.0) and paired["ci_high"] == pytest.approx(1.1)
    assert plots.ratio({"p50_s": 3.0}, {"p50_s": 2.0}) == {"median": 1.5, "ci_low": None, "ci_high": None,
                                                           "rounds": None}


# --------------------------------------------------------------------------- figures


def training_doc(loss_shift=0.0):
    epochs = [{"kind": "epoch", "epoch": e, "steps": 10 * e, "train_loss": 4.5 - 0.2 * e + loss_shift,
               "val_loss": 4.4 - 0.2 * e, "val_acc": 0.05 * e, "epoch_time_s": 5.0} for e in (1, 2, 3)]
    return doc(epochs + [{"kind": "final", "epochs": 3, "step_time_median_s": 0.5}])


def test_training_curves_show_loss_accuracy_and_time_per_step_for_each_run():
    figure = plots.training_curves({"ours": training_doc(), "pytorch": training_doc(0.01)})
    loss, accuracy, step = figure.axes[:3]
    # train + validation per run; validation per run
    assert len(loss.get_lines()) == 4 and len(accuracy.get_lines()) == 2
    assert "(nats)" in loss.get_ylabel() and "(%)" in accuracy.get_ylabel() and "(s)" in step.get_ylabel()
    assert all(ax.get_xlabel() == "epoch" for ax in (loss, accuracy, step))
    per_step = step.get_lines()[0].get_ydata()
    assert list(per_step) == pytest.approx([0.5, 0.5, 0.5])  # steps count from the start: 5 s over 10 steps each epoch
    assert accuracy.get_lines()[0].get_ydata()[-1] == pytest.approx(15.0)
    assert {"ours", "pytorch"} <= set(legend_texts(figure))


REFERENCE = plots.SYNCBN_REFERENCE


def syncbn_rows(with_rounds=True, transport="torch", ours=1.2e-3, reference=1e-3, impls=None):
    """Time rows of syncbn_benchmark.py for a 2 x 3 grid on one transport; ours / reference = ``ours / reference``
    in every round."""
    rows = []
    for batch in (32, 64):
        for hidden in (128, 256, 512):
            for impl, t in impls or (("ours", ours), (REFERENCE, reference), ("BatchNorm1d (local)", 2e-4)):
                row = {"kind": "time", "impl": impl, "batch": batch, "hidden": hidden, "workers": 2, "time_s": t,
                       "setting": "workers", "dtype": "float32",
                       "transport": None if impl == "BatchNorm1d (local)" else transport}  # local: sums nothing
                if with_rounds:
                    row["round_p50_s"] = [t * f for f in (0.9, 1.0, 1.1, 1.05)]
                rows.append(row)
    return rows


def panel_bars(figure):
    """(x, height) of the bars of the first panel, left to right."""
    ax = [ax for ax in figure.axes if ax.get_title()][0]
    return sorted((b.get_x(), b.get_height()) for b in ax.patches if isinstance(b, Rectangle))


def test_syncbn_grid_draws_a_bar_per_size_with_intervals_and_the_target():
    figure = plots.syncbn_grid(doc(syncbn_rows()), target=1.3)  # one transport: one bar per size
    panels = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["batch 32, 2 workers", "batch 64, 2 workers"]
    for ax in panels:
        bars = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert [b.get_height() for b in bars] == pytest.approx([1.2] * 3)
        assert any(isinstance(c, ErrorbarContainer) for c in ax.containers)
        assert any(list(line.get_ydata()) == [1.3, 1.3] for line in ax.get_lines())
        assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "256", "512"]
    assert "(x)" in panels[0].get_ylabel() and "target 1.3x" in legend_texts(figure)
    assert f"ours [torch] / ({REFERENCE}) [torch]" in legend_texts(figure)


# ours [torch] / reference [torch] = 1.2 and ours [shared_memory] / reference [shared_memory] = 1.8; a ratio across
# transports
# would read 0.9 (ours [shared_memory] / reference [torch]) or 2.4 (ours [torch] / reference [shared_memory]).
BOTH = (syncbn_rows(transport="torch", ours=1.2e-3, reference=1e-3)
        + syncbn_rows(transport="shared_memory", ours=0.9e-3, reference=0.5e-3))


def test_syncbn_ratios_pair_rows_on_one_transport():
    for on, expected in (("torch", 1.2), ("shared_memory", 1.8)):
        ratios = plots.syncbn_ratios(doc(BOTH), transport=on)
        assert len(ratios) == 6 and {r["transport"] for r in ratios} == {on}
        assert [r["median"] for r in ratios] == pytest.approx([expected] * 6)
    assert plots.syncbn_ratios(doc(BOTH), transport=None) == []  # only the local layer has no transport
    # its only transport
    one = plots.syncbn_ratios(doc(syncbn_rows(transport="shared_memory", ours=0.9e-3, reference=0.5e-3)))
    assert [r["median"] for r in one] == pytest.approx([1.8] * 6) and {r["transport"] for r in one} == {"shared_memory"}
    with pytest.raises(ValueError, match="transports"):  # two: the caller must choose, never a mix
        plots.syncbn_ratios(doc(BOTH))


def test_syncbn_grid_draws_a_bar_per_transport_each_against_the_reference_on_it():
    figure = plots.syncbn_grid(doc(BOTH), target=1.3)
    assert [h for _, h in panel_bars(figure)] == pytest.approx([1.8, 1.2] * 3)  # per size: shm, then torch
    texts = legend_texts(figure)
    assert {f"ours [shared_memory] / ({REFERENCE}) "
            "[shared_memory]", f"ours [torch] / ({REFERENCE}) [torch]"} <= set(texts)
    assert not any(t.startswith("floor") for t in texts)  # the file has no floor rows


def test_syncbn_grid_draws_the_floor_against_the_reference_on_shared_memory_only():
    """The floor (syncbn_benchmark.FLOOR) is drawn as floor [shared_memory] / reference [shared_memory], beside ours
    on each transport;
    a floor timed on torch is not drawn."""
    floors = [{**r, "impl": plots.SYNCBN_FLOOR, "time_s": r["time_s"] * 1.1,
               "round_p50_s": [t * 1.1 for t in r["round_p50_s"]]}
              for r in BOTH if r["impl"] == REFERENCE]  # floor [t] / reference [t] = 1.1 on both transports
    figure = plots.syncbn_grid(doc(BOTH + floors), target=1.3)
    # ours [shared_memory], ours [torch], floor [shared_memory]
    assert [h for _, h in panel_bars(figure)] == pytest.approx([1.8, 1.2, 1.1] * 3)
    texts = legend_texts(figure)
    assert f"floor [shared_memory] / ({REFERENCE}) [shared_memory]" in texts
    assert f"floor [torch] / ({REFERENCE}) [torch]" not in texts


def test_allreduce_chart_has_a_line_per_algorithm_log_axes_and_the_oversubscribed_worlds_shaded():
    rows = [{"world_size": w, "numel": n, "axis": "algorithm", "transport": "gloo", "algorithm": a, "time_s": 1e-3 * w,
             "memory_bytes": 0, "max_abs_error": 1e-7 * (w > 1)}
            for w in (1, 2, 4) for n in (1000, 10000) for a in ("torch", "ring", "butterfly", "halving_doubling")]
    figure = plots.allreduce_table(doc(rows, cpus=2))
    time_axes = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in time_axes] == ["1,000 float32 (3.9 KiB)", "10,000 float32 (39 KiB)"]
    for ax in time_axes:
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert len(data_lines(ax)) == 4
        assert {line.get_linestyle() for line in data_lines(ax)} == {"-"}
    assert [t.get_text() for t in figure.axes[2].get_xticklabels()] == ["1", "2", "4"]  # under the shared x axis
    assert "ms" in time_axes[0].get_ylabel()
    assert any(t.startswith("oversubscribed") for t in legend_texts(figure))
    assert {"torch", "ring", "butterfly", "halving-doubling"} <= set(legend_texts(figure))
    assert figure._suptitle.get_text() == "all-reduce algorithms, all over one backend"


def ddp_row(label, variant, cap, p50, world=2, **extra):
    """A ddp_benchmark.py row of the kind ``variant`` names ("no_ddp": the model alone)."""
    engine, impl, option = ddp_step.DDP_FIELDS.get(variant, (None, None, None))
    return {"model": "resnet18", "label": label, "engine": engine, "impl": impl, "option": option,
            "transport": None, "path": None, "bucket_cap_mb": cap, "world_size": world,
            "p50_s": p50, "p50_ex_per_s": 32 / p50, "round_p50_s": [p50 * f for f in (0.95, 1.0, 1.05, 1.0)],
            "comm_wait_s": None, **extra}


def ddp_rows():
    return [ddp_row("no ddp", "no_ddp", None, 0.10), ddp_row("ddp pytorch 1M", "ddp pytorch", 1.0, 0.16),
            ddp_row("ddp pytorch 25M", "ddp pytorch", 25.0, 0.15),
            ddp_row("ddp pytorch best 25M", "ddp pytorch best", 25.0, 0.14),
            ddp_row("ddp ours naive", "ddp ours naive", None, 0.25, comm_wait_s=0.1),
            ddp_row("ddp ours 1M", "ddp ours", 1.0, 0.15, comm_wait_s=0.01),
            ddp_row("ddp ours 25M", "ddp ours", 25.0, 0.14, comm_wait_s=0.02)]


def test_ddp_variants_compare_ours_with_pytorch_defaults_and_best_settings_with_intervals():
    figure = plots.ddp_variants(doc(ddp_rows()))
    sweep, bars = figure.axes[:2]
    assert sweep.get_xscale() == "log" and sweep.get_xlabel() == "bucket cap (MiB)" and "(s" in sweep.get_ylabel()
    series = [c for c in sweep.containers if isinstance(c, ErrorbarContainer)]
    assert [c.get_label() for c in series] == ["ddp pytorch", "ddp pytorch best", "ddp ours"]
    assert len({c.lines[0].get_color() for c in series}) == 3
    assert [t.get_text() for t in bars.get_yticklabels()] == [r["label"] for r in ddp_rows()]  # top to bottom
    assert sum(isinstance(c, ErrorbarContainer) for c in bars.containers) == len(ddp_rows())
    assert "exposed communication wait (ours)" in legend_texts(figure)
    assert "oversubscribed" not in legend_texts(figure)


def test_ddp_variants_draw_a_bucket_size_series_per_implementation_and_transport():
    rows = [ddp_row("no ddp", "no_ddp", None, 0.10)]
    for on, factor in (("torch", 1.0), ("shared_memory", 0.8)):
        staged, zero_copy = ("staged", "zero copy") if on == "shared_memory" else (None, None)  # as the rows recorded
        rows += [ddp_row(f"ddp pytorch best 25M [{on}]", "ddp pytorch best", 25.0, 0.14 * factor, transport=on,
                         path=staged),
                 ddp_row(f"ddp ours 1M [{on}]", "ddp ours", 1.0, 0.15 * factor, transport=on, path=zero_copy),
                 ddp_row(f"ddp ours 25M [{on}]", "ddp ours", 25.0, 0.14 * factor, transport=on, path=zero_copy)]
    figure = plots.ddp_variants(doc(rows))
    sweep, bars = figure.axes[:2]
    series = {c.get_label(): c.lines[0] for c in sweep.containers if isinstance(c, ErrorbarContainer)}
    # on shared memory each series names its path: PyTorch's DDP through the hook is staged, ours zero copy
    assert list(series) == ["ddp pytorch best [torch]", "ddp ours [torch]",
                            "ddp pytorch best [shared_memory, staged]", "ddp ours [shared_memory, zero copy]"]
    shm = series["ddp ours [shared_memory, zero copy]"]
    assert list(shm.get_ydata()) == pytest.approx([0.12, 0.112])  # 1M, then 25M: one transport
    assert list(series["ddp ours [torch]"].get_ydata()) == pytest.approx([0.15, 0.14])
    assert shm.get_color() == series["ddp ours [torch]"].get_color()  # the implementation's
    assert {series["ddp ours [torch]"].get_linestyle(), shm.get_linestyle()} == {"-", "--"}
    assert [t.get_text() for t in bars.get_yticklabels()] == [
        r["label"].replace("[shared_memory]", "[shared_memory, staged]" if r["option"] == "best"
                           else "[shared_memory, zero copy]")
        for r in rows]


def test_ddp_variants_mark_oversubscribed_rows():
    rows = [{**r, "oversubscribed": True} if r["label"] == "ddp ours naive" else r for r in ddp_rows()]
    figure = plots.ddp_variants(doc(rows))
    bars = figure.axes[1]
    hatched = [p for p in bars.patches if p.get_hatch()]
    assert len(hatched) >= 1 and "oversubscribed" in legend_texts(figure)


def test_ddp_sweep_plots_time_and_throughput_with_oversubscribed_worlds_marked():
    rows = [ddp_row(label, variant, 25.0 if variant != "no_ddp" else None, 0.1 * w + base, world=w)
            for w in (1, 2, 4)
            for label, variant, base in (("no ddp", "no_ddp", 0.0), ("ddp ours 25M", "ddp ours", 0.02))]
    figure = plots.ddp_sweep(doc(rows, cpus=2, world_size=[1, 2, 4]))
    time_ax, throughput_ax = figure.axes[:2]
    assert time_ax.get_xscale() == throughput_ax.get_xscale() == "log"
    assert "(s, p50)" in time_ax.get_ylabel() and "examples per second" in throughput_ax.get_ylabel()
    hollow = [line for line in time_ax.get_lines() if line.get_markerfacecolor() == "white"]
    assert [line.get_xdata()[0] for line in hollow] == [4, 4]
    assert any("oversubscribed" in t for t in legend_texts(figure))
    assert sum(isinstance(c, ErrorbarContainer) for c in time_ax.containers) == 2


def chrome_trace(buckets=((40, 20), (60, 30)), threads=(2, 3)):
    main = [("iteration 0", 0, 100), ("forward", 0, 30), ("backward", 30, 40), ("sync_gradients", 70, 20),
            ("optimizer_step", 90, 10)]
    events = [{"ph": "X", "name": n, "ts": 1000.0 * t, "dur": 1000.0 * d, "tid": 1, "pid": 1} for n, t, d in main]
    events += [{"ph": "X", "name": "gloo:all_reduce", "ts": 1000.0 * t, "dur": 1000.0 * d,
                "tid": threads[i % len(threads)], "pid": 1}
               for i, (t, d) in enumerate(buckets)]
    events += [{"ph": "X", "name": "aten::add", "ts": 5000.0, "dur": 1.0, "tid": 1, "pid": 1},
               {"ph": "M", "name": "process_name"}]
    return {"traceEvents": events}


def test_timeline_events_read_one_iteration_of_a_chrome_trace():
    t = plots.timeline_events(chrome_trace())
    assert t["length"] == 100
    assert [name for name, _, _ in t["phases"]] == ["forward", "backward", "sync_gradients", "optimizer_step"]
    assert t["comm"] == {"comm thread 1": [(40, 20)], "comm thread 2": [(60, 30)]}
    with pytest.raises(ValueError, match="--profile"):
        plots.timeline_events({"traceEvents": []})
    trimmed = plots.trim_trace(chrome_trace())
    assert plots.timeline_events(trimmed) == t and len(trimmed["traceEvents"]) == len(chrome_trace()["traceEvents"]) - 2


def test_timeline_events_read_our_shared_memory_sums_on_our_communication_thread():
    trace = chrome_trace()
    for e in trace["traceEvents"]:
        if e.get("name") == "gloo:all_reduce":
            e["name"] = transport.SHARED_MEMORY_RANGE.format("all_reduce")
    assert plots.timeline_events(trace)["comm"] == {"comm thread 1": [(40, 20)], "comm thread 2": [(60, 30)]}


SHM_ALL_REDUCE = transport.SHARED_MEMORY_RANGE.format("all_reduce")  # "shared_memory:all_reduce"


def test_timeline_events_put_sums_made_by_the_compute_thread_on_a_lane_of_their_own():
    """Shared memory sums inline, in the backward hook: its ranges are on the compute thread (tid 1), beside
    gloo's on its own thread; a compute-thread range that is no collective is not a sum."""
    trace = chrome_trace(buckets=((40, 20),), threads=(2,))
    trace["traceEvents"] += [{"ph": "X", "name": SHM_ALL_REDUCE, "ts": 1000.0 * t, "dur": 1000.0 * d, "tid": 1,
                              "pid": 1} for t, d in ((35, 5), (50, 10))]
    t = plots.timeline_events(trace)
    assert t["comm"] == {"comm thread 1": [(40, 20)], "sums in the compute thread": [(35, 5), (50, 10)]}
    assert list(t["comm"]) == ["comm thread 1", "sums in the compute thread"]  # the threads', then the inline lane
    assert [name for name, _, _ in t["phases"]] == ["forward", "backward", "sync_gradients", "optimizer_step"]
    only_inline = chrome_trace(buckets=())
    only_inline["traceEvents"].append({"ph": "X", "name": SHM_ALL_REDUCE, "ts": 45000.0, "dur": 5000.0, "tid": 1,
                                       "pid": 1})
    assert plots.timeline_events(only_inline)["comm"] == {"sums in the compute thread": [(45, 5)]}
    figure = plots.overlap_timeline({"ddp ours 25M [shared_memory]": only_inline})
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["compute", "sums in the compute thread"]


def test_trim_trace_keeps_the_shared_memory_ranges():
    trace = chrome_trace(buckets=((40, 20),), threads=(2,))
    sums = [{"ph": "X", "name": SHM_ALL_REDUCE, "ts": 1000.0 * t, "dur": 1000.0, "tid": tid, "pid": 1}
            for t, tid in ((35, 1), (60, 3))]
    trace["traceEvents"] += sums + [{"ph": "X", "name": "shared_memory_helper", "ts": 36000.0, "dur": 1.0, "tid": 1}]
    trimmed = plots.trim_trace(trace)
    names = [e["name"] for e in trimmed["traceEvents"]]
    assert names.count(SHM_ALL_REDUCE) == 2 and names.count("gloo:all_reduce") == 1
    assert "aten::add" not in names and "shared_memory_helper" not in names  # only "<collective range>:" names
    assert plots.timeline_events(trimmed) == plots.timeline_events(trace)
    assert plots.timeline_events(trimmed)["comm"] == {"comm thread 1": [(40, 20)], "comm thread 2": [(60, 1)],
                                                      "sums in the compute thread": [(35, 1)]}


def test_overlap_timeline_puts_compute_and_each_communication_thread_on_its_own_lane_per_variant():
    figure = plots.overlap_timeline({"ddp ours 25M": chrome_trace(),
                                     "ddp pytorch 25M": chrome_trace(buckets=((50, 45),))})
    ours, theirs = figure.axes[:2]
    assert [t.get_text() for t in ours.get_yticklabels()] == ["compute", "comm thread 1", "comm thread 2"]
    assert [t.get_text() for t in theirs.get_yticklabels()] == ["compute", "comm thread 1"]
    bars = [c for c in ours.collections if isinstance(c, PolyCollection)]
    assert len(bars) == 4 + 2  # four compute phases, two buckets
    title = ours.get_title(loc="left")
    assert title.startswith("ddp ours 25M") and "2 all-reduce calls" in title
    assert "(ms)" in theirs.get_xlabel()
    texts = legend_texts(figure)
    assert "all-reduce of a bucket (ddp ours)" in texts and "all-reduce of a bucket (ddp pytorch)" in texts


def test_load_traces_finds_rank_0_files_of_ddp_benchmark_by_variant(tmp_path):
    import json
    # A file of another model, or of before the names were unified ("bucketed", "[shm]"), is not found.
    for name in ("resnet18-2ranks-ddp-ours-25M-rank0.json", "resnet18-2ranks-ddp-ours-25M-rank1.json",
                 "cnn-2ranks-ddp-ours-overlap-rank0.json", "resnet18-2ranks-ddp-ours-naive-[shared_memory]-rank0.json",
                 "resnet18-2ranks-bucketed-25M-rank0.json", "resnet18-2ranks-naive-[shm]-rank0.json",
                 "resnet18-4ranks-ddp-ours-flat-[shared_memory]-rank0.json"):
        (tmp_path / name).write_text(json.dumps(chrome_trace()))
    found = plots.load_traces(str(tmp_path), "resnet18", ["ddp ours 25M", "ddp ours overlap",
                                                          "ddp ours naive [shared_memory]",
                                                          "ddp ours flat [shared_memory]"])
    assert list(found) == ["ddp ours 25M", "ddp ours naive [shared_memory]", "ddp ours flat [shared_memory]"]
    assert plots.load_traces(str(tmp_path / "missing"), "resnet18", ["ddp ours overlap"]) == {}


def test_beside_seed_draws_ours_and_the_seeds_with_the_hardware_in_the_titles():
    figure = plots.beside_seed({"torch, 2 processes": ([2**20, 2**30], [1.0, 2.0], "torch")},
                               {"torch, 2 processes": ([2**20, 2**30], [1.5, 3.0]),
                                "torch, 4 processes": ([2**20], [0.7])},
                               xlabel="message size", ylabel="algbw (GB/s)", ours_title="ours: test cpu",
                               seed_title="seed: 2x T4", xbytes=True)
    ours, seed = figure.axes[:2]
    assert (ours.get_title(), seed.get_title()) == ("ours: test cpu", "seed: 2x T4")
    assert len(ours.get_lines()) == 1 and len(seed.get_lines()) == 2
    assert ours.get_lines()[0].get_color() == plots.colour("torch")
    assert [t.get_text() for t in ours.get_xticklabels()] == ["1 MiB", "1 GiB"]
    assert seed.get_lines()[0].get_linestyle() != seed.get_lines()[1].get_linestyle()


def test_time_breakdown_stacks_each_profiled_variants_phases():
    breakdown = {"ranges": {"forward": 0.1, "backward": 0.2, "sync_gradients": 0.05, "optimizer_step": 0.01}, "ops": [],
                 "iters": 3}
    rows = [{**r, "breakdown": breakdown} if r["label"] in ("ddp pytorch 25M", "ddp ours 25M") else r
            for r in ddp_rows()]
    figure = plots.time_breakdown(doc(rows))
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ddp pytorch 25M", "ddp ours 25M"]
    segments = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(segments) == 8 and max(p.get_x() + p.get_width() for p in segments) == pytest.approx(360.0)
    assert "(ms)" in ax.get_xlabel()
    assert {"forward", "backward", "sync_gradients", "optimizer_step"} <= set(legend_texts(figure))


MIB = plots.MIB


def _sharding_row(engine, impl, world, mib, oversubscribed=False, option=None, transport="shared_memory",
                  path="zero copy"):
    parts = dict(params_bytes=4 * MIB, grads_bytes=4 * MIB, activation_bytes=mib * MIB,
                 state_bytes=8 * MIB // (world if engine == "zero1" else 1))
    name = f"{engine} {impl}{f' {option}' if option else ''} [{transport}]"
    return {"model": "gpt", "variant": name, "engine": engine, "impl": impl, "option": option,
            "transport": transport, "path": path if transport.startswith("shared_memory") else None,
            "world_size": world, **parts,
            "ideal_bytes": parts["params_bytes"] + parts["grads_bytes"] + parts["state_bytes"],
            "oversubscribed": oversubscribed}


def test_sharding_memory_stacks_what_each_rank_holds_for_our_variants_with_the_ideal():
    rows = [_sharding_row(e, i, w, 1, oversubscribed=w == 4) for e, i in (("ddp", "ours"), ("ddp", "pytorch"),
                                                                           ("zero1", "ours")) for w in (1, 2, 4)]
    rows.append({"target": "zero1 ours / ddp ours", "ratio": None})  # target rows are not drawn
    figure = plots.sharding_memory({"results": rows, "env": {"cpus": 2}})
    ax = figure.axes[0]
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == (
        ["ddp ours [shared_memory, zero copy]"] * 3 + ["zero1 ours [shared_memory, zero copy]"] * 3)
    assert len(ax.patches) == 6 * len(plots.MEMORY_PARTS) + 1  # four stacked parts per bar, and the legend's hatch
    tops = [p.get_y() + p.get_height() for p in ax.patches[:-1]]
    # 4+4+8+1; 4+4+2+1 at 4 ranks
    assert max(tops) == pytest.approx(17) and min(t for t in tops[3::4]) == pytest.approx(11)
    ideals = sorted({line.get_ydata()[0] for line in ax.lines})
    assert ideals == [10, 12, 16]


def test_our_variant_of_an_engine_is_read_from_the_fields_at_its_default_option_on_shared_memory_first():
    rows = [_sharding_row("zero1", "ours", 2, 1, option="in step"),
            _sharding_row("zero1", "ours", 2, 1, transport="torch"), _sharding_row("zero1", "ours", 2, 1),
            _sharding_row("ddp", "pytorch", 2, 1),
            _sharding_row("ddp", "ours", 2, 1, transport="torch")]
    assert plots.our_variant(rows, "zero1") == "zero1 ours [shared_memory]"
    assert plots.our_variant(rows, "ddp") == "ddp ours [torch]"
    assert plots.our_variant(rows, "fsdp") is None


def test_a_run_with_more_processes_than_cores_is_oversubscribed_whatever_its_flag_says():
    env = {"cpus": 2, "device": "cpu"}
    assert plots.oversubscribed({"world_size": 4, "oversubscribed": False}, env)  # a stale or missing flag
    assert not plots.oversubscribed({"world_size": 2, "oversubscribed": False}, env)
    assert plots.oversubscribed({"world_size": 4, "target": "zero1 ours / ddp ours"}, env)  # a target check, no flag
    assert not plots.oversubscribed({"world_size": 4, "oversubscribed": False}, {"cpus": 2, "device": "cuda"})


def test_below_five_rounds_the_interval_is_the_range_of_the_rounds_and_is_named_so():
    assert plots.interval({"p50_s": 1.0, "round_p50_s": [1.2, 0.9]}, "p50_s") == (0.9, 1.2)
    assert plots.interval({"p50_s": 1.0, "round_p50_s": [1.0, 0.8, 1.3, 1.1]}, "p50_s") == (0.8, 1.3)
    rounds = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 5.0]  # one outlier: a bootstrap interval of the median leaves it out
    low, high = plots.interval({"p50_s": 1.0, "round_p50_s": rounds}, "p50_s")
    assert 0.98 <= low <= 1.0 <= high < 5.0
    assert plots.interval({"p50_s": 1.0, "round_p50_s": [1.0]}, "p50_s") is None
    assert plots.interval_name(2) == "range of 2 rounds" and plots.interval_name(4) == "range of 4 rounds"
    assert plots.interval_name(plots.MIN_BOOTSTRAP_ROUNDS) == "95 % interval" == plots.interval_name(None)
