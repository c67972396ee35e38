"""Boards checked against figures worked out by hand, the CLI, and one real run end to end."""

import json
import math
import shutil

import pandas as pd
import pytest
from click.testing import CliRunner
from trace_factory import CALIBRATION, DECODE, EVENTS, REPO, decode_workloads, make_trace, named

from flashbench.build import content_hash
from flashbench.calibrate import save_calibration
from flashbench.cli import main
from flashbench.errors import FlashbenchError
from flashbench.leaderboard import build_boards, traces_frame
from flashbench.leaderboard.formats import markdown
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


# The repository's folders as they are now: base and base2 hold the content that ran.
IN_REPOSITORY = {"base": "base-hash", "base2": "base2-hash"}


def board_of(traces, **kwargs):
    kwargs.setdefault("current_hashes", IN_REPOSITORY)
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
    assert list(board.ranking["solution"]) == ["reference", "fast", "base", "base2", "broken"]
    assert list(board.ranking["rank"].fillna(0)) == [0, 1, 2, 3, 4]  # 0: no rank
    assert row(board, "base")["speedup_vs_baseline"] == 1.0


def test_the_reference_is_the_denominator_never_a_competitor():
    # As on a graph-replay board: the reference ran one workload, where it is the fastest of all.
    traces = [make_trace("reference", W1, 0.5, nbytes=1e6), make_trace("a", W1, 1.0, nbytes=1e6),
              make_trace("a", W2, 1.0, nbytes=1e6), make_trace("b", W1, 2.0, nbytes=1e6)]
    board = board_of(traces)
    assert pd.isna(row(board, "reference")["rank"]) and list(board.ranking["rank"].dropna()) == [1, 2]
    assert row(board, "a")["speedup_vs_reference"] == 0.5
    assert board.by_workload.set_index("workload").loc["w1", "best"] == "a"
    assert "reference: the denominator of 'vs reference', listed first and not ranked" in board.notes


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


def test_only_the_repository_grants_the_baseline_role():
    """A manifest tags itself: a solution tagged baseline whose results are not of the repository's folder of
    its name as it is now (a folder run from elsewhere, another content) is passed over, and said to be;
    --baseline may still name it."""
    outsider = board_of(EXAMPLE, current_hashes={"base2": "base2-hash"})  # base: no folder in the repository
    assert outsider.baseline == "base2"
    assert outsider.notes[0] == ("baseline: base2 (the fastest solution tagged 'baseline'; tagged 'baseline' but not "
                                 "the content of the repository's folder of that name: base)")
    changed = board_of(EXAMPLE, current_hashes={"base": "other", "base2": "other"})
    assert changed.baseline == "reference" and changed.notes[0].startswith(
        "baseline: reference (no repository solution tagged 'baseline' passed a workload; ")
    assert changed.notes[0].endswith(": base, base2)")
    assert build_boards(traces_frame(EXAMPLE))[0].baseline == "reference"  # no repository known: none granted
    assert board_of(EXAMPLE, current_hashes={}, baseline="base").baseline == "base"  # as asked


def test_smoke_workloads_count_in_passed_but_their_latencies_do_not():
    workloads = [Workload(uuid=w, name=w[:2], tags=["smoke"] if w == W3 else []) for w in (W1, W2, W3, W4)]
    fast = row(board_of(EXAMPLE, workloads=workloads), "fast")
    assert (fast["passed"], fast["total"]) == (4, 4)
    assert fast["speedup_vs_baseline"] == pytest.approx(1.0)  # W1 and W2 only: 4/2, 4/8
    assert fast["speedup_vs_reference"] == pytest.approx((4 * 1 * 4) ** (1 / 3))
    assert (fast["fast_1.0"], fast["fast_2.0"]) == (pytest.approx(1 / 3), 0)  # out of the 3 timed workloads
    assert fast["win_rate"] == 0.5 and fast["sol_pct"] == pytest.approx((50 + 12.5 + 50) / 3)
    assert any(note.startswith("1 of 4 workloads tagged smoke check correctness only")
               for note in board_of(EXAMPLE, workloads=workloads).notes)
    included = row(board_of(EXAMPLE, workloads=workloads, include_smoke=True), "fast")
    assert included["speedup_vs_baseline"] == pytest.approx(2.5 ** (1 / 3))  # as without tags


def test_notes_say_how_it_was_measured():
    graph = {**EVENTS, "method": "graph"}
    traces = [make_trace("reference", W1, 8.0), make_trace("a", W1, 2.0, timing=graph, ci=0.02),
              make_trace("a", W2, 2.0, timing=graph, ci=0.06), make_trace("b", W1, 4.0, timing=graph)]
    board = board_of(traces)
    assert "measured with timing graph (reference: events), L2 flushed (256 MiB), device cuda" in board.notes
    assert row(board, "a")["spread_pct"] == pytest.approx(2.0)  # the median of ±1% and ±3%
    on_cpu = board_of([make_trace("a", W1, 2.0, timing={"method": "host clock", "l2_flush_bytes": 0}, device="cpu",
                                  samples=1)])
    assert "measured with timing host clock, L2 not flushed, device cpu" in on_cpu.notes
    assert pd.isna(row(on_cpu, "a")["spread_pct"])  # one sample has no interval


def test_stale_results_are_marked_and_can_be_hidden():
    current = {"fast": "fast-hash", "base": "rebuilt", "base2": "base2-hash"}  # base's folder changed since its runs
    board = board_of(EXAMPLE, current_hashes=current)
    assert list(board.ranking.loc[board.ranking["stale"], "solution"]) == ["base"]
    assert any(note.startswith("stale: base (measured other content") for note in board.notes)
    hidden = board_of(EXAMPLE, current_hashes=current, hide_stale=True)
    assert "base" not in set(hidden.ranking["solution"]) and hidden.baseline == "base2"
    assert "reference" in set(hidden.ranking["solution"])  # no folder: never stale


def test_documentation_does_not_change_the_content_hash(tmp_path):
    (tmp_path / "kernel.py").write_text("def run(): pass\n")
    before = content_hash(tmp_path)
    (tmp_path / "NOTES.md").write_text("what the H200 showed\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "profile.txt").write_text("counters\n")
    assert content_hash(tmp_path) == before
    (tmp_path / "kernel.py").write_text("def run(): return 1\n")
    assert content_hash(tmp_path) != before


def test_total_is_the_workloads_of_the_set_that_were_run():
    workloads = [Workload(uuid=w, name=w[:2]) for w in (W4, W3, W2, W1, "w5-aaaaaa")]  # W5: run by no one
    board = board_of(EXAMPLE + [make_trace("fast", "stale-workload", 1.0)], workloads=workloads)
    assert row(board, "fast")["total"] == 4
    assert list(board.by_workload["workload"]) == ["w4", "w3", "w2", "w1"]  # set order


# ---- the command ----------------------------------------------------------------------------

def invoke(*args):
    return CliRunner().invoke(main, ["--root", str(REPO), *args])


def timed_and_smoke():
    """Two timed workloads of the decode definition, then a smoke one."""
    workloads = decode_workloads()
    return [w.uuid for w in workloads if "smoke" not in w.tags][:2] + [next(w.uuid for w in workloads if "smoke" in w.tags)]


@pytest.fixture
def recorded(tmp_path):
    """EXAMPLE's pattern on two timed workloads of the decode definition and a smoke one where fast is 4x faster
    than base, on two GPUs, one calibrated."""
    for hardware in ("GPU X", "GPU Y"):
        for solution, latencies, tags in (("reference", (8.0, 8.0, 8.0), ["reference"]),
                                          ("base", (4.0, 4.0, 4.0), ["baseline"]), ("fast", (2.0, 8.0, 1.0), [])):
            for uuid, latency in zip(timed_and_smoke(), latencies):
                trace = make_trace(solution, uuid, latency, hardware=hardware, tags=tags, definition=DECODE)
                append_trace(trace_path(tmp_path, hardware, DECODE), trace)
    save_calibration(CALIBRATION, tmp_path)
    return tmp_path


def test_cli_table_shows_one_board_per_hardware(recorded):
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded))
    assert result.exit_code == 0, result.output
    assert "GPU X (gpu_x)" in result.output and "GPU Y (gpu_y)" in result.output
    # The traces' base is no folder of the repository: its tag does not make it the baseline.
    assert "baseline: reference (no repository solution tagged 'baseline' passed a workload;" in result.output


def test_cli_json_and_csv(recorded, tmp_path):
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--hardware", "gpu_x",
                    "--format", "json", "--baseline", "base")
    assert result.exit_code == 0, result.output
    [board] = json.loads(result.output)
    fast = next(r for r in board["ranking"] if r["solution"] == "fast")
    assert fast["speedup_vs_baseline"] == 1.0 and fast["win_rate"] == 0.5 and fast["sol_pct"] == 31.25
    out = tmp_path / "board.csv"
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--format", "csv",
                    "--by-workload", "--out", str(out))
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert lines[0].startswith("workload,floor_us,best,best_us") and len(lines) == 1 + 2 * 3


def test_out_never_replaces_a_trace_file_and_keeps_what_it_writes_to(recorded, tmp_path):
    """`report --out` onto the trace file it read replaced every record with Markdown; a bad folder ended in a
    traceback; a pipe or a link given as --out was replaced by a plain file, and a file lost its mode."""
    trace_file = next(recorded.glob("*/*.jsonl"))
    before = trace_file.read_bytes()
    linked = tmp_path / "board.md"
    linked.symlink_to(trace_file)
    for out in (trace_file, linked):
        result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--out", str(out))
        assert result.exit_code == 2 and "may not name a trace file" in result.output
    assert trace_file.read_bytes() == before
    result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded),
                    "--out", str(tmp_path / "missing" / "x.md"))
    assert result.exit_code == 2 and "cannot write: No such file or directory" in result.output
    private = tmp_path / "private.md"
    private.write_text("")
    private.chmod(0o600)
    target = tmp_path / "site.md"
    (tmp_path / "site-link.md").symlink_to(target)
    for out in (private, tmp_path / "site-link.md"):
        result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--format",
                        "markdown", "--out", str(out))
        assert result.exit_code == 0, result.output
    assert private.stat().st_mode & 0o777 == 0o600 and private.read_text().startswith("# ")
    assert (tmp_path / "site-link.md").is_symlink() and target.read_text().startswith("# ")
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_cli_include_smoke_counts_the_smoke_latencies(recorded):
    def fast(*extra):
        result = invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--hardware", "gpu_x",
                        "--format", "json", "--baseline", "base", *extra)
        assert result.exit_code == 0, result.output
        [board] = json.loads(result.output)
        return next(r for r in board["ranking"] if r["solution"] == "fast"), board["notes"]

    (default, notes), (included, _) = fast(), fast("--include-smoke")
    assert (default["passed"], default["total"], included["passed"]) == (3, 3, 3)
    assert default["speedup_vs_baseline"] == 1.0 and included["speedup_vs_baseline"] == pytest.approx(4 ** (1 / 3))
    assert any("1 of 3 workloads tagged smoke check correctness only" in note for note in notes)
    assert next(r for r in json.loads(invoke("leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded),
                                             "--hardware", "gpu_x", "--format", "json").output)[0]["ranking"]
                if r["solution"] == "reference")["rank"] is None


def test_cli_marks_stale_results_and_hides_them(recorded):
    folder = REPO / "solutions" / DECODE / "torch_vectorized"
    uuid = timed_and_smoke()[0]
    for solution_hash in ("0123456789abcdef", content_hash(folder)):  # an older content, then the current one
        append_trace(trace_path(recorded, "GPU X", DECODE), make_trace("torch_vectorized", uuid, 3.0, hardware="GPU X",
                                                                       definition=DECODE, solution_hash=solution_hash))
    append_trace(trace_path(recorded, "GPU X", DECODE), make_trace("triton_splitkv", uuid, 3.0, hardware="GPU X",
                                                                   definition=DECODE, solution_hash="0123456789abcdef"))
    args = ["leaderboard", "--def", "mla_paged_decode", "--trace-dir", str(recorded), "--hardware", "gpu_x",
            "--format", "markdown"]
    shown = invoke(*args)
    assert shown.exit_code == 0, shown.output
    assert "| 01234567 stale |" in shown.output and "stale: triton_splitkv (measured other content" in shown.output
    assert f"| {content_hash(folder)[:8]} " in shown.output
    hidden = invoke(*args, "--hide-stale")
    assert "triton_splitkv" not in hidden.output and "torch_vectorized" in hidden.output


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
    assert "2000.0 ±0.0% (50%, 500 GB/s)" in result.output  # fast on the first workload: 1 GB in 2 ms, 1 ms floor
    assert "Measured with timing events, L2 flushed (256 MiB), device cuda." in result.output


def test_report_needs_no_hardware_where_one_has_traces(recorded, tmp_path):
    """leaderboard and compare need no --hardware; report asked for it even where one folder holds traces."""
    both = invoke("report", "--def", "mla_paged_decode", "--trace-dir", str(recorded))
    assert both.exit_code == 2 and "for 2 hardware here (gpu_x, gpu_y): pick one with --hardware" in both.output
    one = tmp_path / "one"
    shutil.copytree(recorded / "gpu_x", one / "gpu_x")
    alone = invoke("report", "--def", "mla_paged_decode", "--trace-dir", str(one))
    assert alone.exit_code == 0 and alone.output.startswith("# mla_paged_decode_h16_ckv512_kpe64_ps1 on GPU X\n")


def test_what_traces_say_of_their_device_reaches_no_terminal_and_no_report_as_markup(recorded):
    """A record's device is free-form: named in the notes, its escape sequences reached the terminal, its HTML and
    headings `report`'s Markdown. A record of another GPU first in the file named the report's title."""
    path = trace_path(recorded, "GPU X", DECODE)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(make_trace("s", "w", 1.0, hardware="NVIDIA H200", definition=DECODE).model_dump_json() + "\n"
                    + "".join(lines))
    append_trace(path, make_trace("odd", timed_and_smoke()[0], 3.0, hardware="GPU X", definition=DECODE,
                                  device="cuda<img src=x>\n# Hijacked \x1b]0;title\x1b\\"))
    board = invoke("leaderboard", "--def", "mla_paged_decode", "--hardware", "gpu_x", "--trace-dir", str(recorded))
    assert board.exit_code == 0, board.output
    assert "\x1b" not in board.output and "odd: cuda<img src=x> # Hijacked ?]0;title?\\" in board.output
    report = invoke("report", "--def", "mla_paged_decode", "--hardware", "gpu_x", "--trace-dir", str(recorded))
    assert report.exit_code == 0, report.output
    assert report.output.startswith("# mla_paged_decode_h16_ckv512_kpe64_ps1 on GPU X\n")
    assert "<img" not in report.output and "\n# Hijacked" not in report.output and "\x1b" not in report.output
    # the device's last backslash is shown as one (escaped): unescaped, it had escaped the ")" after it
    assert "odd: cuda&lt;img src=x&gt; # Hijacked ?\\]0;title?\\\\)" in report.output


def test_report_leaves_out_a_record_of_another_definition(recorded):
    path = trace_path(recorded, "GPU X", DECODE)
    append_trace(path, make_trace("intruder", timed_and_smoke()[0], 0.5, hardware="GPU X",
                                  definition="mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"))
    report = invoke("report", "--def", "mla_paged_decode", "--hardware", "gpu_x", "--trace-dir", str(recorded))
    assert report.exit_code == 0, report.output
    assert "intruder" not in report.output and "fast" in report.output


def test_graph_timings_are_shown_only_with_timing_graph(recorded):
    uuid = decode_workloads()[0].uuid
    append_trace(trace_path(recorded, "GPU X", DECODE, "graph"), make_trace("fast", uuid, 1.5, hardware="GPU X", definition=DECODE))
    events = invoke("report", "--def", "mla_paged_decode", "--hardware", "GPU X", "--trace-dir", str(recorded))
    graph = invoke("report", "--def", "mla_paged_decode", "--hardware", "GPU X", "--trace-dir", str(recorded), "--timing", "graph")
    assert graph.exit_code == 0, graph.output
    assert "1500.0 ±0.0% (67%" in graph.output and "CUDA-graph replay" in graph.output and "2000.0" not in graph.output
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
    for solution in board["ranking"]:  # a CPU run is of smoke workloads only: nothing timed to rank by
        assert (solution["passed"], solution["total"]) == (smoke, smoke)
        assert solution["speedup_vs_reference"] is None and solution["fast_1.0"] is None
    assert "measured with timing host clock, L2 not flushed, device cpu" in board["notes"]
    result = CliRunner().invoke(main, ["--root", str(fresh_repo), "leaderboard", "--def", "mla_paged_decode",
                                       "--trace-dir", str(traces), "--format", "json", "--include-smoke"])
    for solution in json.loads(result.output)[0]["ranking"]:
        assert solution["speedup_vs_reference"] > 0 and not math.isnan(solution["speedup_vs_baseline"])
    report = CliRunner().invoke(main, ["--root", str(fresh_repo), "report", "--def", "mla_paged_decode",
                                       "--hardware", board["hardware"], "--trace-dir", str(traces)])
    assert report.exit_code == 0, report.output
    assert "GB/s" not in report.output.split("| workload")[1] and "—)" in report.output  # no rate from a host clock
    compared = CliRunner().invoke(main, ["--root", str(fresh_repo), "compare", "reference", "torch_vectorized",
                                         "--def", "mla_paged_decode", "--trace-dir", str(traces)])
    assert compared.exit_code == 0, compared.output
    assert "torch_vectorized is" in compared.output and f"(geomean of {smoke} workloads)" in compared.output


def test_text_from_traces_stays_text_in_markdown():
    """A trace file, or an imported dataset's, may name a solution or a device anything: no HTML, heading or
    terminal escape of theirs reaches a Markdown board, and no name breaks its table."""
    hostile = "<img src=x onerror=alert(1)>|x\n## Injected \x1b]52;c;AAAA\x07"
    traces = [named(hostile, "W1-1", 1.0, hardware="gpu x"), make_trace("plain", "W1-1", 2.0, hardware="gpu x",
                                                                       device="<script>cuda</script>")]
    text = markdown([board_of(traces)])
    assert "<img" not in text and "<script>" not in text and "\x1b" not in text and "\n## Injected" not in text
    assert "&lt;img src=x onerror=alert(1)&gt;\\|x ## Injected" in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len({line.count("|") - line.count("\\|") for line in table}) == 1  # every row has the header's cells
    by_workload = markdown([board_of(traces + [named("[click](javascript:x)", "W1-1", 3.0, hardware="gpu x")])],
                           by_workload=True)  # a column per solution, named as its traces say
    header = next(line for line in by_workload.splitlines() if line.startswith("| workload"))
    assert "<img" not in header and "&lt;img" in header and "\\[click\\](javascript:x)" in header


def test_text_from_traces_is_never_rich_markup_nor_an_escape_in_the_terminal():
    """Printed as rich markup, a solution named "[/x]" ended the command and "[link=...]" hid a link."""
    from rich.console import Console

    from flashbench.cli.leaderboard import rich_table
    frame = pd.DataFrame({"solution [bold]": ["[/x]", "[link=https://evil.example/]ref[/link]", "\x1b]0;title\x07"]})
    console = Console(record=True, width=200, color_system=None)
    console.print(rich_table(frame))
    shown = console.export_text()
    assert "[/x]" in shown and "[link=https://evil.example/]ref[/link]" in shown and "solution [bold]" in shown
    assert "\x1b" not in shown and "?]0;title?" in shown


def test_a_record_with_a_date_or_timing_fields_of_the_wrong_kind_does_not_end_the_board():
    """A trace file may say anything in the fields the schema leaves free: one such record ended every board."""
    odd = make_trace("odd", "W1-1", 1.0, hardware="gpu x", timestamp="not-a-date",
                     timing={**EVENTS, "worker_issue_share": "high", "l2_flush_bytes": "lots"})
    frame = traces_frame([odd, make_trace("plain", "W1-1", 2.0, hardware="gpu x")])
    assert frame["time"].isna().tolist() == [True, False]
    assert pd.isna(frame["l2_state"].tolist()[0]) and not frame["host_bound"].tolist()[0]
    assert row(board_of([odd, make_trace("plain", "W1-1", 2.0, hardware="gpu x")]), "odd")["passed"] == 1


@pytest.mark.parametrize("forged_time", ["9999-12-31T00:00:00+00:00", "not a date"])
def test_a_record_of_no_past_time_is_replaced_by_the_next_honest_run(forged_time):
    """A forged record 100x faster dated 9999 (or no date at all) counted as the newest run for ever: honest runs
    recorded after it never replaced it on the board."""
    forged = make_trace("mine", "W1-1", 0.01, hardware="gpu x", timestamp=forged_time)
    honest = make_trace("mine", "W1-1", 1.0, hardware="gpu x", timestamp="2026-06-01T00:00:00+00:00")
    for recorded in ([forged, honest], [honest, forged]):
        results = board_of(recorded).results
        assert results.loc[results["solution"] == "mine", "latency_ms"].tolist() == [1.0]


def test_timing_fields_of_any_kind_or_size_do_not_end_the_board():
    """A list or a mapping as the timing method, the flush or the device, or a flush of 10**400 bytes, ended every
    board with a traceback (unhashable type; OverflowError)."""
    odd = [make_trace("odd", "W1-1", 1.0, hardware="gpu x", device=["cuda"],
                      timing={**EVENTS, "method": {"x": 1}, "l2_flush": ["write"], "l2_flush_bytes": 10**400}),
           make_trace("plain", "W1-1", 2.0, hardware="gpu x")]
    board = board_of(odd)
    assert row(board, "odd")["passed"] == 1 and markdown([board])


@pytest.mark.parametrize("latency_ms", [-0.013, -math.inf, math.inf])
def test_a_time_no_clock_gives_is_unknown_and_never_the_fastest(latency_ms):
    traces = [make_trace("impossible", "W1-1", latency_ms, hardware="gpu x"),
              make_trace("plain", "W1-1", 2.0, hardware="gpu x")]
    assert traces_frame(traces)["latency_ms"].isna().tolist() == [True, False]
    board = board_of(traces)
    assert row(board, "plain")["rank"] < row(board, "impossible")["rank"]
