"""README's results of the backend "dpkit" are rendered from the committed files, never typed: the block in README
is the function's output, and each sentence says what its numbers decide."""

from __future__ import annotations

import json

from common import REPO
from dpkit.bench.measure import format_ratio
from dpkit.report import backend_lines, summary


def test_the_readme_block_is_exactly_what_the_committed_results_render():
    rendered = backend_lines.render(REPO / "results")
    block = summary.readme_block((REPO / "README.md").read_text(), (backend_lines.BEGIN, backend_lines.END))
    assert block == rendered, "README.md's backend block differs from results/: run `python run_experiments.py " \
                              "--summary`"


def row(label, nbytes, p50, ratio=None, anchor=None):
    out = {"collective": "allreduce", "axis": "backend", "label": label, "bytes": nbytes, "p50_s": p50,
           "rounds": 40, "oversubscribed": False, "world_size": 2}
    if anchor:
        low, median, high = ratio
        out |= {"anchor": anchor, "backend_vs_anchor": median, "backend_vs_anchor_ci_low": low,
                "backend_vs_anchor_ci_high": high}
    return out


def test_ahead_and_behind_are_said_only_where_the_whole_interval_lies_on_one_side_of_one():
    rows = []
    for nbytes, ratio in ((8, (1.1, 1.5, 2.0)), (4096, (0.9, 1.0, 1.2)), (1 << 20, (0.5, 0.6, 0.8))):
        rows += [row("Open MPI (mpi4py)", nbytes, 1e-5, ratio, "openmpi"), row("gloo", nbytes, 1e-3),
                 row(backend_lines.BACKEND, nbytes, 2e-5)]
    lines = backend_lines.anchors({"results": rows})
    assert lines[2] == ("| 8B | 10 us | 1.0 ms | 20 us | " + format_ratio({"median": 1.5, "ci_low": 1.1,
                                                                           "ci_high": 2.0, "rounds": 40}) + " |")
    assert lines[-1].endswith('against Open MPI (mpi4py), "dpkit" is ahead at 1MiB, behind at 8B, neither at 4KiB.')


def test_every_other_collective_is_a_table_over_open_mpi_only_from_calls_that_first_wrote_what_they_send():
    def other(collective, nbytes, ratio, written=True):
        return row("Open MPI (mpi4py)", nbytes, 1e-5, ratio, "openmpi") | {"collective": collective,
                                                                          "input_written_first": written}
    rows = [other("broadcast", 8, (1.1, 1.5, 2.0)), other("broadcast", 4096, (0.5, 0.6, 0.8)),
            other("all_to_all", 8, (0.9, 1.0, 1.2)), row("Open MPI (mpi4py)", 8, 1e-5, (0.1, 0.2, 0.3), "openmpi")]
    lines = backend_lines.other_collectives({"results": rows})  # the all-reduce's row is the other table's
    assert lines[2:4] == ["| collective | 8B | 4KiB |", "|---|---|---|"]
    assert lines[4] == f"| broadcast | {format_ratio(_r(1.1, 1.5, 2.0))} | {format_ratio(_r(0.5, 0.6, 0.8))} |"
    assert lines[5] == f"| all-to-all | {format_ratio(_r(0.9, 1.0, 1.2))} |  |"
    assert lines[-1] == "By the intervals: ahead in 1 of 3, behind in 1 (broadcast at 8B)."
    rows[0]["input_written_first"] = False  # a file made before the calls wrote what they send: no table
    assert backend_lines.other_collectives({"results": rows}) == []


def _r(low, median, high):
    return {"median": median, "ci_low": low, "ci_high": high, "rounds": 40}


def test_the_landing_sentences_are_the_files_stored_ratios_and_verdict():
    docs = {name: json.loads((REPO / "results" / f"{name}.json").read_text()) for name in backend_lines.FILES}
    ddp = backend_lines.ddp_landing(docs["ddp_backend"])
    (check,) = [t for t in docs["ddp_backend"]["targets"] if t["axis"] == "transport"]
    assert f"takes {format_ratio(check['ratio'])} of one on gloo" in ddp and f"(<= {check['limit']}x)" in ddp
    syncbn = backend_lines.syncbn_landing(docs["syncbn_backend"], docs["backend_anchors"])
    ours = backend_lines.comparison(docs["syncbn_backend"], backend_lines.OURS)
    assert f"ours {format_ratio(ours)}" in syncbn


def check(collective, nbytes, ratio, verdict):
    low, median, high = ratio
    return {"axis": "backend", "collective": collective, "bytes": nbytes, "limit": 0.25, "verdict": verdict,
            "ratio": {"median": median, "ci_low": low, "ci_high": high, "rounds": 40}}


def test_every_collective_against_gloo_counts_the_stored_verdicts_and_names_each_one_not_met():
    targets = [check("allreduce", 4096, (0.01, 0.02, 0.03), "met"),
               check("broadcast", 1 << 20, (0.28, 0.33, 0.37), "missed"),
               check("all_to_all", 1 << 20, (0.2, 0.23, 0.31), "inconclusive"),
               {"axis": "transport", "verdict": "missed"}]  # another axis: not the backend's
    text = backend_lines.against_gloo({"targets": targets})
    assert "from 4KiB to 1MiB (same file; target <= 0.25x): 1 of 3 met; not met: " in text
    assert text.endswith(f"broadcast at 1MiB, {format_ratio(targets[1]['ratio'])} missed; all-to-all at 1MiB, "
                         f"{format_ratio(targets[2]['ratio'])} inconclusive.")
    assert backend_lines.against_gloo({"targets": targets[:1]}).endswith(": 1 of 1 met.")


def test_how_much_of_a_small_all_reduce_is_torch_s_own_is_the_files_latency_floor_rows_at_4_kib():
    cases = {backend_lines.CALL: 6e-6, backend_lines.ALONE: 4.2e-6, backend_lines.DISPATCHER: 1.7e-6,
             backend_lines.BACKEND_ALONE: 1.1e-6, "wait (exchange of no data)": 3.3e-6}
    rows = [{"kind": "latency floor", "bytes": nbytes, "case": case, "seconds_per_call": seconds * nbytes / 4096}
            for nbytes in (4096, 65536) for case, seconds in cases.items()]
    text = backend_lines.floor({"results": rows})
    assert '(the same file\'s latency-floor rows, 4KiB, calls back to back, slowest rank)' in text
    assert '`dist.all_reduce` on "dpkit" takes 6.0 us a call, and 4.2 us on a group of one rank, which' in text
    assert text.endswith("Taken apart on that group (differences of medians, no interval): `dist.all_reduce`'s "
                         "Python 2.5 us, torch's dispatcher op (`ProcessGroup.allreduce`) 0.6 us, the backend itself "
                         "called through its Python binding 1.1 us.")


def test_the_memory_s_bound_is_a_sentence_of_its_own_from_16_mib_up_with_the_verdict_at_the_largest_size():
    rows = []
    for nbytes, ratio in ((4096, (3.0, 4.0, 5.0)), (16 << 20, (1.1, 1.2, 1.4)), (100 << 20, (1.5, 1.7, 1.8))):
        rows += [row("gloo", nbytes, 1e-3), row(backend_lines.BACKEND, nbytes, 2e-5),
                 row("Open MPI (mpi4py)", nbytes, 1e-5, (0.5, 0.6, 0.8), "openmpi"),
                 row("a + b -> c (one core)", nbytes, 1e-5, ratio, backend_lines.MEMORY)]
    doc = {"results": rows}
    table = backend_lines.anchors(doc)
    assert "a + b -> c" not in "\n".join(table) and "Open MPI (mpi4py)" in table[0]
    text = backend_lines.memory_bound(doc)
    ratios = [format_ratio({"median": m, "ci_low": lo, "ci_high": hi, "rounds": 40})
              for lo, m, hi in ((1.1, 1.2, 1.4), (1.5, 1.7, 1.8))]
    assert f"takes {ratios[0]} at 16MiB and {ratios[1]} at 100MiB; at 100MiB against the target (<= 1.3x) missed." \
        in text
    assert backend_lines.memory_bound({"results": rows[:3]}).startswith("*not in this results file")


def test_the_single_copy_sentences_say_where_the_read_costs_more_or_less_than_two_copies_by_the_interval():
    def read(nbytes, low, median, high):
        return {"way": backend_lines.SINGLE_COPY, "bytes": nbytes, "reads": 200, "vs_copy": median,
                "vs_copy_ci_low": low, "vs_copy_ci_high": high}
    doc = {"env": {"git_commit": "abc1234", "device_model": "AMD EPYC"},
           "results": [read(65536, 3.1, 3.2, 3.3), read(1 << 20, 1.9, 2.4, 2.6),
                       {"way": "copy out of shared memory", "bytes": 65536}]}
    text = backend_lines.single_copy(doc)
    assert "takes 3.20x [3.10, 3.30] at 64KiB and 2.40x [1.90, 2.60] at 1MiB the time" in text
    assert text.endswith(": more than two such copies at 64KiB; an interval that holds two at 1MiB.")
    doc["results"][1]["vs_copy_ci_low"] = 2.1
    assert backend_lines.single_copy(doc).endswith(": more than two such copies at every size measured.")
    doc["results"][0] |= {"vs_copy_ci_low": 1.4, "vs_copy": 1.5, "vs_copy_ci_high": 1.6}
    assert backend_lines.single_copy(doc).endswith(": more than two such copies at 1MiB; fewer than two at 64KiB.")
    doc["results"][1] |= {"vs_copy_ci_low": 1.4, "vs_copy": 1.5, "vs_copy_ci_high": 1.9}
    doc["env"]["device_model"] = "Intel(R) Xeon(R) Processor"
    other = backend_lines.single_copy_other_cpu(doc)
    assert other.startswith("The same read on the other CPU (`results/peer_read_xeon.json`, at abc1234, Intel(R)")
    assert other.endswith(": fewer than two at every size measured.")
