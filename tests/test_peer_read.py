"""dpkit.bench.peer_read: a process reads what another has just written, both ways, each read checked, and the
rows say which way is faster."""

import multiprocessing

import pytest

from dpkit.bench import peer_read
from dpkit.bench.results import read_results


def test_each_way_reads_the_writer_s_fresh_data_and_the_rows_pair_them(tmp_path, capsys):
    path = tmp_path / "peer_read.json"
    peer_read.main(["--bytes", "4096", "65536", "--reads", "8", "--json", str(path)])
    rows = read_results(str(path))["results"]
    assert [(row["bytes"], row["way"]) for row in rows] == [(n, way) for n in (4096, 65536) for way in peer_read.WAYS]
    for row in rows:
        assert row["p50_s"] > 0 and row["reads"] == 8
        assert row["vs_copy_ci_low"] <= row["vs_copy"] <= row["vs_copy_ci_high"]
    assert "process_vm_readv / copy out of shared memory" in capsys.readouterr().out


def test_a_read_of_the_wrong_turn_is_caught(monkeypatch):
    """The check is real: a writer that writes nothing leaves the reader looking at stale data."""
    monkeypatch.setattr(peer_read.torch.Tensor, "fill_", lambda self, value: self)
    with pytest.raises(RuntimeError, match="turn 1: read 0.0, 0.0, not 1"):
        peer_read.measure(4096, 2)


def test_refused_sizes_and_counts_are_named():
    for argv in (["--bytes", "6"], ["--reads", "0"]):
        with pytest.raises(SystemExit):
            peer_read.parse_args(argv)


def test_no_writer_outlives_a_failed_probe(monkeypatch):
    monkeypatch.setattr(peer_read.torch.Tensor, "fill_", lambda self, value: self)
    with pytest.raises(RuntimeError):
        peer_read.measure(4096, 2)
    assert multiprocessing.active_children() == []
