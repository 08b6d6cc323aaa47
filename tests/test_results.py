"""Results: the shared JSON layout and tables."""

import pytest

import results
from results import markdown_table


def test_results_round_trip_in_the_shared_layout(tmp_path):
    env = results.environment("gloo", "cpu", 2)
    assert {"torch", "backend", "device", "device_model", "threads", "world_size", "command"} <= env.keys()
    path = tmp_path / "r.json"
    results.write_results(str(path), "demo", env, {"iters": 3}, [{"size": 1, "time_s": 0.5}])
    doc = results.read_results(str(path))
    assert doc["benchmark"] == "demo" and doc["config"] == {"iters": 3} and doc["results"] == [{"size": 1, "time_s": 0.5}]
    path.write_text('{"schema": "other"}')
    with pytest.raises(ValueError, match="not a results file"):
        results.read_results(str(path))


def test_markdown_table_formats_and_marks_missing_values():
    table = markdown_table([{"n": 2, "t": 0.5}, {"n": 4}], [("n", "world", "d"), ("t", "time (s)", ".3f")])
    assert table.splitlines() == ["| world | time (s) |", "|-------|----------|", "| 2 | 0.500 |", "| 4 | - |"]
