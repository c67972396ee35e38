import json

import pytest
from markdown_it import MarkdownIt
from pydantic import ValidationError
from trace_factory import CALIBRATION, make_trace

from flashbench.leaderboard import build_boards, by_workload_display, ranking_display, results_display, traces_frame
from flashbench.leaderboard.board import VIEW_COLUMNS
from flashbench.leaderboard.formats import csv, json_text, markdown, markdown_text
from flashbench.model import Solution
from flashbench.model.solution import BOARD_COLUMNS

TRACES = [make_trace("reference", "w1-aaaaaa", 8.0), make_trace("fast", "w1-aaaaaa", 2.0, ci=0.25),
          make_trace("fast", "w1-aaaaaa", 2.0), make_trace("reference", "w2-aaaaaa", 8.0),
          make_trace("fast", "w2-aaaaaa", status="TIMEOUT")]
BOARDS = build_boards(traces_frame(TRACES), calibrations={"gpu_x": CALIBRATION})


def test_ranking_for_people():
    shown = ranking_display(BOARDS[0])
    assert list(shown["solution"]) == ["reference", "fast"] and list(shown["rank"]) == ["—", "1"]
    fast = shown.iloc[1]
    assert (fast["solution"], fast["passed"], fast["vs baseline (reference)"]) == ("fast", "1/2", "4x")
    assert (fast["fast_1.0"], fast["win rate"], fast["% SOL"], fast["runs"]) == ("50%", "100%", "50.0%", "3")
    assert fast["spread"] == "±0.0%"  # its latest run on w1 has no width


def test_stale_hashes_are_marked():
    [board] = build_boards(traces_frame(TRACES), current_hashes={"fast": "rebuilt"})
    assert list(ranking_display(board)["hash"]) == ["referenc", "fast-has stale"]
    assert set(results_display(board).query("solution == 'fast'")["hash"]) == {"fast-has stale"}


def test_per_workload_and_results_for_people():
    view = by_workload_display(BOARDS[0])
    assert list(view["fast"]) == ["2000.0", "TIMEOUT"] and list(view["floor µs"]) == ["1000.0", "1000.0"]
    results = results_display(BOARDS[0]).set_index(["solution", "workload"])
    assert results.loc[("fast", "w1"), "ci µs"] == "2000.0–2000.0"  # the latest of the two runs
    assert results.loc[("fast", "w1"), "p10–p90 µs"] == "2000.0–2000.0"
    assert (results.loc[("fast", "w1"), "timing"], results.loc[("fast", "w1"), "L2"]) == ("events", "flushed (256 MiB)")
    assert results.loc[("fast", "w1"), "runs"] == "2" and results.loc[("fast", "w2"), "µs"] == ""


def test_machine_formats_keep_numbers():
    [document] = json.loads(json_text(BOARDS))
    assert document["ranking"][1]["speedup_vs_baseline"] == 4.0 and document["calibration"]["hardware"] == "GPU X"
    assert document["ranking"][0]["rank"] is None  # the reference is not ranked
    assert {r["workload_label"] for r in document["results"]} == {"w1", "w2"}
    assert {r["l2_state"] for r in document["results"]} == {"flushed (256 MiB)", None}  # None: w2 timed out
    assert csv(BOARDS).splitlines()[1].startswith(",reference,reference-hash,False,")
    assert csv(BOARDS).splitlines()[2] == "1,fast,fast-hash,False,,1,2,4.0,4.0,0.5,0.5,0.5,1.0,50.0,0.0,0,3,gpu_x,reference"
    assert markdown(BOARDS).startswith("## GPU X (gpu_x)\n\n- baseline: reference")
    assert "- measured with timing events, L2 flushed (256 MiB), device cuda" in markdown(BOARDS)


def test_a_backslash_cannot_undo_the_markdown_escapes():
    """Red team: a device or timing method written `\\[text\\](https://...)` in a trace (or an imported dataset's) came
    out `\\\\[text\\\\](...)`: an escaped backslash, then a live link, on the board and in `report`."""
    rendered = MarkdownIt("commonmark").enable("table").render(
        "| a |\n|---|\n| " + markdown_text("\\[click\\](https://evil.example/x) \\|x") + " |\n")
    assert "<a " not in rendered and "evil.example" in rendered


def test_bare_links_are_no_links():
    """Red team: a solution named www.evil-example.com (a valid name), a device `https://evil.example/x` or an
    address are live links in GitHub's Markdown, whose autolinks look for `www.`, `http://`, `https://`,
    `ftp://` and `a@b.c` in the source; escaped, the characters still read as themselves."""
    for text in ("www.evil-example.com", "fast_WWW.x", "https://evil.example/x", "HTTP://x.y", "ftp://x.y",
                 "me@evil.example"):
        source = markdown_text(text)
        assert not any(found in source.lower() for found in ("www.", "http:", "https:", "ftp:"))
        assert "@" not in source.replace("\\@", "")
        assert text in MarkdownIt("commonmark").render(source)


def test_no_solution_may_take_the_name_of_a_board_column():
    """Red team: a solution run by path as `best` or `workload` overwrote those columns of the board by workload and
    of `report`, and ended the JSON, HTML and by-workload boards of its hardware with a traceback."""
    assert set(VIEW_COLUMNS) | {"MB", "hardware", "baseline"} <= BOARD_COLUMNS  # the boards' own columns, all reserved
    for name in BOARD_COLUMNS:
        with pytest.raises(ValidationError):
            make_trace(name, "w1-aaaaaa", 1.0)
        with pytest.raises(ValidationError):
            Solution(name=name, definition="d", author="a", language="python", entry_point="k.py::run")
