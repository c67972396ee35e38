import math

import pandas as pd
import pytest
from trace_factory import CALIBRATION, make_trace

from flashbench.leaderboard import (current_results, latest_results, mark_stale, read_results, traces_frame,
                                   with_speed_of_light)
from flashbench.traces import append_trace, trace_path

DAY1, DAY2 = "2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00"


def test_latest_run_of_each_content_hash_wins_and_runs_are_counted():
    frame = traces_frame([make_trace("s", "w1-aaaaaa", 2.0, timestamp=DAY2),
                          make_trace("s", "w1-aaaaaa", 1.0, timestamp=DAY1),
                          make_trace("s", "w2-aaaaaa", 3.0, timestamp=DAY1)])
    latest = latest_results(frame).set_index("workload")
    assert latest.loc["w1-aaaaaa", "latency_ms"] == 2.0 and latest.loc["w1-aaaaaa", "runs"] == 2
    assert latest.loc["w2-aaaaaa", "runs"] == 1


def test_same_second_the_later_line_wins():
    frame = traces_frame([make_trace("s", "w1-aaaaaa", 1.0), make_trace("s", "w1-aaaaaa", 5.0)])
    assert list(latest_results(frame)["latency_ms"]) == [5.0]


def test_older_content_hashes_drop_out():
    frame = traces_frame([make_trace("s", "w1-aaaaaa", 1.0, solution_hash="old", timestamp=DAY1),
                          make_trace("s", "w2-aaaaaa", 1.0, solution_hash="old", timestamp=DAY1),
                          make_trace("s", "w1-aaaaaa", 3.0, solution_hash="new", timestamp=DAY2)])
    current = current_results(frame)
    assert list(current["solution_hash"]) == ["new"] and list(current["workload"]) == ["w1-aaaaaa"]


def test_newest_hash_is_chosen_per_hardware():
    frame = traces_frame([make_trace("s", "w1-aaaaaa", 1.0, solution_hash="old", timestamp=DAY1, hardware="GPU Y"),
                          make_trace("s", "w1-aaaaaa", 3.0, solution_hash="new", timestamp=DAY2)])
    current = current_results(frame).set_index("hardware")
    assert current.loc["gpu_y", "solution_hash"] == "old" and current.loc["gpu_x", "solution_hash"] == "new"


def test_floor_share_of_floor_and_suspicious():
    frame = traces_frame([make_trace("honest", "w1-aaaaaa", 2.0), make_trace("cheat", "w1-aaaaaa", 0.5),
                          make_trace("broken", "w1-aaaaaa", status="RUNTIME_ERROR")])
    results = with_speed_of_light(latest_results(frame), CALIBRATION).set_index("solution")
    assert (results["floor_ms"] == 1.0).all()  # 1 GB at 1 TB/s, for the failed result too
    assert results.loc["honest", "sol_pct"] == 50.0 and results.loc["honest", "valid"]
    assert results.loc["cheat", "suspicious"] and not results.loc["cheat", "valid"]
    assert not results.loc["broken", "valid"] and math.isnan(results.loc["broken", "sol_pct"])


def test_no_calibration_means_no_floor_and_nothing_suspicious():
    results = with_speed_of_light(latest_results(traces_frame([make_trace("s", "w1-aaaaaa", 1e-9)])), None)
    assert math.isnan(results["floor_ms"].iloc[0]) and results["valid"].all()


def test_reads_every_hardware_folder_or_one(tmp_path):
    for hardware in ("GPU X", "GPU Y"):
        append_trace(trace_path(tmp_path, hardware, "d"), make_trace("s", "w1-aaaaaa", 1.0, hardware=hardware))
    assert sorted(read_results(tmp_path, "d")["hardware"]) == ["gpu_x", "gpu_y"]
    assert list(read_results(tmp_path, "d", "gpu_y")["hardware_name"]) == ["GPU Y"]
    assert read_results(tmp_path, "other").empty


def test_records_of_another_hardware_or_definition_stay_off_the_folders_board(tmp_path, capsys):
    """A CPU record edited to say H200, in the H200's folder, or another definition's record there."""
    path = trace_path(tmp_path, "GPU X", "d")
    append_trace(path, make_trace("s", "w1", 1.0))
    append_trace(path, make_trace("forged", "w1", 0.1, hardware="GPU Y"))
    append_trace(path, make_trace("other", "w1", 0.1, definition="e"))
    assert list(read_results(tmp_path, "d", "gpu_x")["solution"]) == ["s"]
    assert "2 record(s) of another definition or hardware left out" in capsys.readouterr().err


def test_timings_of_another_method_are_read_only_when_asked(tmp_path):
    append_trace(trace_path(tmp_path, "GPU X", "d"), make_trace("s", "w1-aaaaaa", 2.0))
    append_trace(trace_path(tmp_path, "GPU X", "d", "graph"), make_trace("s", "w1-aaaaaa", 1.5))
    assert list(read_results(tmp_path, "d")["latency_ms"]) == [2.0]
    assert list(read_results(tmp_path, "d", timing="graph")["latency_ms"]) == [1.5]
    assert list(read_results(tmp_path, "d", "gpu_x", "graph")["latency_ms"]) == [1.5]


def test_how_each_result_was_measured():
    on_cpu = {"method": "host clock", "l2_flush_bytes": 0}
    named = {"method": "events", "l2_flush_bytes": 256 * 2**20, "l2_flush": "write+read 256 MiB v2"}
    frame = traces_frame([make_trace("gpu", "w1-aaaaaa", 2.0, ci=0.1),
                          make_trace("cpu", "w1-aaaaaa", 2.0, timing=on_cpu, device="cpu"),
                          make_trace("named", "w1-aaaaaa", 2.0, timing=named),
                          make_trace("one", "w1-aaaaaa", 2.0, samples=1),
                          make_trace("failed", "w1-aaaaaa", status="TIMEOUT")]).set_index("solution")
    assert frame.loc["gpu", ["timing_method", "l2_state", "device"]].tolist() == ["events", "flushed (256 MiB)", "cuda"]
    assert frame.loc["cpu", ["timing_method", "l2_state", "device"]].tolist() == ["host clock", "not flushed", "cpu"]
    assert frame.loc["named", "l2_state"] == "write+read 256 MiB v2"  # the runner's own words win
    assert frame.loc["gpu", "spread_pct"] == pytest.approx(5.0) and math.isnan(frame.loc["one", "spread_pct"])
    assert pd.isna(frame.loc["failed", "l2_state"]) and math.isnan(frame.loc["failed", "spread_pct"])


def test_stale_is_against_the_folders_now():
    frame = traces_frame([make_trace("s", "w1-aaaaaa", 1.0, solution_hash="old"), make_trace("t", "w1-aaaaaa", 1.0),
                          make_trace("reference", "w1-aaaaaa", 1.0)])
    assert not frame["stale"].any()  # nothing to compare with yet
    stale = mark_stale(frame, {"s": "new", "t": "t-hash"}).set_index("solution")["stale"]
    assert stale.to_dict() == {"s": True, "t": False, "reference": False}


def test_results_can_be_limited_to_one_isolation_level(tmp_path):
    from flashbench.leaderboard.results import read_results
    from flashbench.traces import append_trace, trace_path

    path = trace_path(tmp_path, "GPU X", "d")
    for solution, level in (("sandboxed", "namespaces"), ("grouped", "process"), ("older", None)):
        append_trace(path, make_trace(solution, "w1", latency_ms=1.0).model_copy(update={"isolation": level}))
    assert list(read_results(tmp_path, "d")["solution"]) == ["sandboxed", "grouped", "older"]
    assert list(read_results(tmp_path, "d", isolation="namespaces")["solution"]) == ["sandboxed"]


def test_a_folder_the_judge_would_not_read_makes_its_results_stale_not_the_board_end():
    """A reviewer: one folder holding a `.gitignore` (refused since version control's files are) ended `leaderboard`
    and `export-fib` for the whole definition with one line naming no folder."""
    from types import SimpleNamespace

    from flashbench.build import FolderError
    from flashbench.leaderboard.results import UNREADABLE, solution_hashes

    class Refused:
        solution = SimpleNamespace(name="mine")

        def content_hash(self):
            raise FolderError(".gitignore: version control's files have no place in a solution folder")

    hashes = solution_hashes(SimpleNamespace(solution_folders=lambda definition: [Refused()]), "d")
    assert hashes == {"mine": UNREADABLE}
    frame = mark_stale(pd.DataFrame({"solution": ["mine"], "solution_hash": ["0" * 32]}), hashes)
    assert frame["stale"].tolist() == [True] and frame["in_repository"].tolist() == [False]
