import json

from trace_factory import CALIBRATION, make_trace

from flashbench.leaderboard import build_boards, by_workload_display, ranking_display, results_display, traces_frame
from flashbench.leaderboard.formats import csv, json_text, markdown

TRACES = [make_trace("reference", "w1-aaaaaa", 8.0), make_trace("fast", "w1-aaaaaa", 2.0, ci=0.25),
          make_trace("fast", "w1-aaaaaa", 2.0), make_trace("reference", "w2-aaaaaa", 8.0),
          make_trace("fast", "w2-aaaaaa", status="TIMEOUT")]
BOARDS = build_boards(traces_frame(TRACES), calibrations={"gpu_x": CALIBRATION})


def test_ranking_for_people():
    shown = ranking_display(BOARDS[0])
    assert list(shown["solution"]) == ["reference", "fast"]  # 2 passed before 1
    fast = shown.iloc[1]
    assert (fast["solution"], fast["passed"], fast["vs baseline (reference)"]) == ("fast", "1/2", "4x")
    assert (fast["fast_1.0"], fast["win rate"], fast["% SOL"], fast["runs"]) == ("50%", "100%", "50.0%", "3")


def test_per_workload_and_results_for_people():
    view = by_workload_display(BOARDS[0])
    assert list(view["fast"]) == ["2000.0", "TIMEOUT"] and list(view["floor µs"]) == ["1000.0", "1000.0"]
    results = results_display(BOARDS[0]).set_index(["solution", "workload"])
    assert results.loc[("fast", "w1"), "ci µs"] == "2000.0–2000.0"  # the latest of the two runs
    assert results.loc[("fast", "w1"), "runs"] == "2" and results.loc[("fast", "w2"), "µs"] == ""


def test_machine_formats_keep_numbers():
    [document] = json.loads(json_text(BOARDS))
    assert document["ranking"][1]["speedup_vs_baseline"] == 4.0 and document["calibration"]["hardware"] == "GPU X"
    assert {r["workload_label"] for r in document["results"]} == {"w1", "w2"}
    assert csv(BOARDS).splitlines()[2] == "2,fast,fast-hash,,1,2,4.0,4.0,0.5,0.5,0.5,1.0,50.0,0,3,gpu_x,reference"
    assert markdown(BOARDS).startswith("## GPU X (gpu_x)\n\n- baseline: reference")
