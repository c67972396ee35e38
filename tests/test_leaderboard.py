"""Boards checked against figures worked out by hand, the CLI, and one real run end to end."""

import json
import math
import shutil

import pytest
from click.testing import CliRunner
from trace_factory import CALIBRATION, DECODE, REPO, decode_workloads, make_trace

from flashbench.calibrate import save_calibration
from flashbench.cli import main
from flashbench.errors import FlashbenchError
from flashbench.leaderboard import build_boards, traces_frame
from flashbench.model import Workload
from flashbench.traces import append_trace, trace_path

W1, W2, W3, W4 = "w1-aaaaaa", "w2-aaaaaa", "w3-aaaaaa", "w4-aaaaaa"

# Latencies in ms; every floor is 1 ms (1 GB at 1 TB/s).
EXAMPLE = [
    *[make_trace("reference", w, 8.0, tags=["reference"]) for w in (W1, W2, W3, W4)],
    make_trace("base", W1, 4.0, tags=["baseline"]), make_trace("base", W2, 4.0, tags=["baseline"]),
    make_trace("base", W3, 4.0, tags=["baseline"]), make_trace("base", W4, status="INCORRECT_NUMERICAL", tags=["baseline"]),
    make_trace("base2", W1, 6.0, tags=["baseline"]), make_trace("base2", W2, 6.0, tags=["baseline"]),
    make_trace("base2", W3, 6.0, tags=["baseline"]), make_trace("base2", W4, status="TIMEOUT", tags=["baseline"]),
    make_trace("fast", W1, 2.0), make_trace("fast", W2, 8.0), make_trace("fast", W3, 1.6), make_trace("fast", W4, 2.0),
    # a failed result that still carries a (fast) latency must never count as fast
    make_trace("broken", W1, 3.0), make_trace("broken", W2, 1.5, status="INCORRECT_NUMERICAL"),
    make_trace("broken", W3, status="RUNTIME_ERROR"),  # and W4 was never run
]


def board_of(traces, **kwargs):
    boards = build_boards(traces_frame(traces), calibrations={"gpu_x": CALIBRATION}, **kwargs)
    assert len(boards) == 1
    return boards[0]


def row(board, solution):
    return board.ranking.set_index("solution").loc[solution]


def test_baseline_is_the_fastest_solution_tagged_baseline():
    board = board_of(EXAMPLE)
    assert board.baseline == "base"  # base2 passes as many workloads but is slower
    assert board.notes[0] == "baseline: base (the fastest solution tagged 'baseline')"


def test_figures_match_the_hand_computed_ones():
    fast = row(board_of(EXAMPLE), "fast")
    assert (fast["passed"], fast["total"]) == (4, 4)
    # against base: 4/2, 4/8, 4/1.6 (base failed W4): geomean of 2, 0.5, 2.5
    assert fast["speedup_vs_baseline"] == pytest.approx(2.5 ** (1 / 3))
    assert fast["speedup_vs_reference"] == pytest.approx((4 * 1 * 5 * 4) ** (1 / 4))
    # fast_p: share of all 4 workloads; W1's 2.0x is not *more* than 2x; W4 has no baseline to beat
    assert (fast["fast_1.0"], fast["fast_1.5"], fast["fast_2.0"]) == (0.5, 0.5, 0.25)
    assert fast["win_rate"] == pytest.approx(2 / 3)  # W1 and W3 of the three both passed
    assert fast["sol_pct"] == pytest.approx((50 + 12.5 + 62.5 + 50) / 4)


def test_failed_and_missing_workloads_are_not_passed_and_never_fast():
    broken = row(board_of(EXAMPLE), "broken")
    assert (broken["passed"], broken["total"]) == (1, 4)
    assert broken["speedup_vs_baseline"] == pytest.approx(4 / 3)
    assert (broken["fast_1.0"], broken["fast_1.5"], broken["fast_2.0"]) == (0.25, 0, 0)
    assert broken["win_rate"] == 1.0


def test_ranking_is_passed_then_speedup_over_the_baseline():
    board = board_of(EXAMPLE)
    assert list(board.ranking["solution"]) == ["fast", "reference", "base", "base2", "broken"]
    assert list(board.ranking["rank"]) == [1, 2, 3, 4, 5]
    assert row(board, "base")["speedup_vs_baseline"] == 1.0


def test_per_workload_view():
    view = board_of(EXAMPLE).by_workload.set_index("workload")
    assert view.loc["w1", "best"] == "fast" and view.loc["w1", "best_us"] == 2000.0
    assert view.loc["w1", "best_sol_pct"] == 50.0 and view.loc["w1", "floor_us"] == 1000.0
    assert view.loc["w2", "best"] == "base" and view.loc["w2", "reference"] == 8000.0
    assert view.loc["w2", "broken"] == "INCORRECT_NUMERICAL" and view.loc["w4", "broken"] is None


def test_a_result_under_the_floor_is_flagged_and_not_ranked():
    board = board_of(EXAMPLE + [make_trace("cheat", W1, 0.5), make_trace("cheat", W2, 2.0)])
    cheat = row(board, "cheat")
    assert (cheat["passed"], cheat["suspicious"]) == (1, 1)
    assert cheat["fast_1.0"] == 0.25  # W2 only: 4 / 2; W1's impossible 8x is not counted
    assert any(note.startswith("cheat on w1: 500.0 µs is under the speed-of-light floor of 1000.0 µs") for note in board.notes)
    assert board.by_workload.set_index("workload").loc["w1", "cheat"] == "SUSPICIOUS"


def test_hardware_is_never_mixed():
    other = [make_trace("reference", W1, 1.0, hardware="GPU Y"), make_trace("fast", W1, 0.1, hardware="GPU Y")]
    boards = build_boards(traces_frame(EXAMPLE + other))
    assert [b.hardware for b in boards] == ["gpu_x", "gpu_y"]
    assert row(boards[1], "fast")["speedup_vs_reference"] == pytest.approx(10)
    assert row(boards[1], "fast")["total"] == 1
    assert row(boards[0], "fast")["speedup_vs_reference"] == pytest.approx(80 ** (1 / 4))


def test_older_hashes_are_not_ranked_and_runs_are_counted():
    older = [make_trace("fast", w, 0.1, solution_hash="old", timestamp="2025-01-01T00:00:00+00:00") for w in (W1, W2)]
    again = make_trace("fast", W1, 2.0, timestamp="2025-06-01T00:00:00+00:00")
    board = board_of(older + [again] + EXAMPLE)
    assert row(board, "fast")["hash"] == "fast-hash" and row(board, "fast")["runs"] == 5  # W1 twice
    assert row(board, "fast")["speedup_vs_baseline"] == pytest.approx(2.5 ** (1 / 3))


def test_reference_is_the_baseline_when_none_is_tagged_or_one_is_named():
    untagged = [t.model_copy(update={"solution_tags": []}) for t in EXAMPLE]
    assert board_of(untagged).baseline == "reference"
    assert row(board_of(untagged), "fast")["speedup_vs_baseline"] == pytest.approx(80 ** (1 / 4))
    assert board_of(EXAMPLE, baseline="base2").baseline == "base2"
    with pytest.raises(FlashbenchError, match="no results of 'nope' on gpu_x"):
        board_of(EXAMPLE, baseline="nope")


def test_total_is_the_workloads_of_the_set_that_were_run():
    workloads = [Workload(uuid=w, name=w[:2]) for w in (W4, W3, W2, W1, "w5-aaaaaa")]  # W5: run by no one
    board = board_of(EXAMPLE + [make_trace("fast", "stale-workload", 1.0)], workloads=workloads)
    assert row(board, "fast")["total"] == 4
    assert list(board.by_workload["workload"]) == ["w4", "w3", "w2", "w1"]  # set order


# ---- the command ----------------------------------------------------------------------------

def invoke(*args):
    return CliRunner().invoke(main, ["--root", str(REPO), *args])


@pytest.fixture
def recorded(tmp_path):
    """EXAMPLE's pattern on two real workloads of the decode definition, on two GPUs, one calibrated."""
    uuids = [w.uuid for w in decode_workloads()[:2]]
    for hardware in ("GPU X", "GPU Y"):
        for solution, latencies, tags in (("reference", (8.0, 8.0), ["reference"]), ("base", (4.0, 4.0), ["baseline"]),
                                          ("fast", (2.0, 8.0), [])):
            for uuid, latency in zip(uuids, latencies):
                trace = make_trace(solution, uuid, latency, hardware=hardware, tags=tags, definition=DECODE)
                append_trace(trace_path(tmp_path, hardware, DECODE), trace)
    save_calibration(CALIBRATION, tmp_path)
    return tmp_path


def test_cli_table_shows_one_board_per_hardware(recorded):
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded))
    assert result.exit_code == 0, result.output
    assert "GPU X (gpu_x)" in result.output and "GPU Y (gpu_y)" in result.output
    assert "baseline: base (the fastest solution tagged 'baseline')" in result.output


def test_cli_json_and_csv(recorded, tmp_path):
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--hardware", "gpu_x",
                    "--format", "json")
    assert result.exit_code == 0, result.output
    [board] = json.loads(result.output)
    fast = next(r for r in board["ranking"] if r["solution"] == "fast")
    assert fast["speedup_vs_baseline"] == 1.0 and fast["win_rate"] == 0.5 and fast["sol_pct"] == 31.25
    out = tmp_path / "board.csv"
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--format", "csv",
                    "--by-workload", "--out", str(out))
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert lines[0].startswith("workload,floor_us,best,best_us") and len(lines) == 1 + 2 * 2


def test_cli_markdown_html_and_charts(recorded, tmp_path):
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--format", "markdown")
    assert result.exit_code == 0 and "## GPU X (gpu_x)" in result.output and "| fast " in result.output
    page, charts = tmp_path / "board.html", tmp_path / "charts"
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--format", "html",
                    "--out", str(page), "--charts", str(charts))
    assert result.exit_code == 0, result.output
    assert page.read_text().count("data:image/png;base64,") == 4  # two charts per hardware
    assert sorted(p.name for p in charts.iterdir()) == ["gpu_x-latency.png", "gpu_x-roofline.png",
                                                        "gpu_y-latency.png", "gpu_y-roofline.png"]


def test_cli_errors_are_one_line_and_exit_2(recorded, tmp_path):
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(tmp_path / "empty"))
    assert result.exit_code == 2 and "no traces recorded here" in result.output
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--baseline", "nope")
    assert result.exit_code == 2 and "--baseline: no results of 'nope'" in result.output


def test_report_command_still_works(recorded):
    result = invoke("report", "--def", "mla_paged_decode", "--hardware", "GPU X", "--trace-dir", str(recorded))
    assert result.exit_code == 0, result.output
    assert "2000.0 (50%, 500 GB/s)" in result.output  # fast on the first workload: 1 GB in 2 ms against a 1 ms floor


def test_graph_timings_are_shown_only_with_timing_graph(recorded):
    uuid = decode_workloads()[0].uuid
    append_trace(trace_path(recorded, "GPU X", DECODE, "graph"), make_trace("fast", uuid, 1.5, hardware="GPU X", definition=DECODE))
    events = invoke("report", "--def", "mla_paged_decode", "--hardware", "GPU X", "--trace-dir", str(recorded))
    graph = invoke("report", "--def", "mla_paged_decode", "--hardware", "GPU X", "--trace-dir", str(recorded), "--timing", "graph")
    assert graph.exit_code == 0, graph.output
    assert "1500.0 (67%" in graph.output and "CUDA-graph replay" in graph.output and "2000.0" not in graph.output
    assert "1500.0" not in events.output
    board = invoke("leaderboard", "--def", "mla_paged_decode", "--hardware", "GPU X", "--trace-dir", str(recorded),
                   "--timing", "graph", "--format", "csv")
    assert board.exit_code == 0, board.output
    ranked = [line.split(",")[1] for line in board.output.splitlines()[1:]]
    assert ranked == ["fast"]  # only what was timed by graph replay


# ---- end to end ------------------------------------------------------------------------------

def test_a_real_cpu_run_makes_a_leaderboard(fresh_repo, tmp_path):
    shutil.copytree(REPO / "solutions" / DECODE / "torch_vectorized", fresh_repo / "solutions" / DECODE / "torch_vectorized",
                    ignore=shutil.ignore_patterns("__pycache__"))
    traces = tmp_path / "traces"
    run = CliRunner().invoke(main, ["--root", str(fresh_repo), "run", "--def", "mla_paged_decode", "--solution",
                                    "torch_vectorized", "--device", "cpu", "--iters", "2", "--warmup", "0",
                                    "--trace-dir", str(traces)])
    assert run.exit_code == 0, run.output
    result = CliRunner().invoke(main, ["--root", str(fresh_repo), "leaderboard", "--def", "mla_paged_decode",
                                       "--trace-dir", str(traces), "--format", "json"])
    assert result.exit_code == 0, result.output
    [board] = json.loads(result.output)
    assert board["baseline"] == "torch_vectorized"  # its tag travelled through the trace
    smoke = sum("smoke" in w.tags for w in decode_workloads())
    for solution in board["ranking"]:
        assert (solution["passed"], solution["total"]) == (smoke, smoke)
        assert solution["speedup_vs_reference"] > 0 and not math.isnan(solution["speedup_vs_baseline"])
    compared = CliRunner().invoke(main, ["--root", str(fresh_repo), "compare", "reference", "torch_vectorized",
                                         "--def", "mla_paged_decode", "--trace-dir", str(traces)])
    assert compared.exit_code == 0, compared.output
    assert "torch_vectorized is" in compared.output and f"(geomean of {smoke} workloads)" in compared.output
