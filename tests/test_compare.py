import pytest
from click.testing import CliRunner
from trace_factory import CALIBRATION, DECODE, REPO, decode_workloads, make_trace

from flashbench.cli import main
from flashbench.leaderboard import comparison_display, compare_solutions, traces_frame
from flashbench.leaderboard.compare import summarize
from flashbench.traces import append_trace, trace_path

W1, W2, W3, W4, W5 = (f"w{i}-aaaaaa" for i in range(1, 6))
PAIRS = [  # (workload, A, B): latency ± half the 95% interval, in ms
    (W1, (10, 1), (5, 1)),      # B's interval wholly below A's: faster
    (W2, (10, 1), (10.5, 1)),   # overlapping: the same within noise
    (W3, (10, 1), (12, 0.5)),   # wholly above: slower
    (W4, (10, 1), (9, 0)),      # touching at 9 ms still overlaps: same
]


def pair_traces(hardware="GPU X"):
    traces = []
    for workload, (a, a_ci), (b, b_ci) in PAIRS:
        traces += [make_trace("A", workload, a, ci=a_ci, hardware=hardware),
                   make_trace("B", workload, b, ci=b_ci, hardware=hardware)]
    return traces + [make_trace("A", W5, 10.0, hardware=hardware),
                     make_trace("B", W5, status="INCORRECT_NUMERICAL", hardware=hardware)]


def test_verdicts_from_the_confidence_intervals():
    [comparison] = compare_solutions(traces_frame(pair_traces()), "A", "B")
    assert list(comparison.table["verdict"]) == ["faster", "same", "slower", "same", "B INCORRECT_NUMERICAL"]
    assert comparison.table["speedup"].iloc[0] == 2.0


def test_summary_line():
    [comparison] = compare_solutions(traces_frame(pair_traces()), "A", "B")
    ratio = (2 * 10 / 10.5 * 10 / 12 * 10 / 9) ** (1 / 4)
    assert comparison.summary == (f"B is {ratio:.2f}x faster than A (geomean of 4 workloads), "
                                  "1 faster, 2 same, 1 slower, 1 not compared (failed or missing)")


def test_slower_overall_reads_as_slower():
    [comparison] = compare_solutions(traces_frame(pair_traces()), "B", "A")
    assert comparison.summary.startswith("A is 1.") and "x slower than B" in comparison.summary
    assert list(comparison.table["verdict"])[:3] == ["slower", "same", "faster"]


def test_nothing_in_common():
    [comparison] = compare_solutions(traces_frame([make_trace("A", W1, 1.0), make_trace("B", W1, status="TIMEOUT")]),
                                     "A", "B")
    assert comparison.summary == "no workload where both A and B passed; 0 faster, 0 same, 0 slower, " \
                                 "1 not compared (failed or missing)"


def test_under_the_floor_is_not_compared():
    traces = [make_trace("A", W1, 2.0), make_trace("B", W1, 0.5)]  # the floor is 1 ms
    [comparison] = compare_solutions(traces_frame(traces), "A", "B", calibrations={"gpu_x": CALIBRATION})
    assert comparison.table["verdict"].iloc[0] == "B suspicious (faster than the floor)"


def test_one_comparison_per_hardware_with_both():
    frame = traces_frame(pair_traces() + pair_traces("GPU Y") + [make_trace("A", W1, 1.0, hardware="GPU Z")])
    assert [c.hardware for c in compare_solutions(frame, "A", "B")] == ["gpu_x", "gpu_y"]


def test_display_names_the_solutions():
    [comparison] = compare_solutions(traces_frame(pair_traces()), "A", "B")
    shown = comparison_display(comparison)
    assert list(shown.columns) == ["workload", "A µs", "A 95% ci", "B µs", "B 95% ci", "speedup", "verdict"]
    assert shown.iloc[0]["B 95% ci"] == "4000.0–6000.0" and shown.iloc[0]["speedup"] == "2x"


def test_summarize_counts_missing_workloads():
    assert summarize(compare_solutions(traces_frame(pair_traces()[:2]), "A", "B")[0].table, "A", "B") == \
        "B is 2.00x faster than A (geomean of 1 workload), 1 faster, 0 same, 0 slower"


@pytest.mark.parametrize("solutions, code", [(("reference", "fast"), 0), (("reference", "nope"), 2)])
def test_cli(tmp_path, solutions, code):
    for uuid, (reference, fast) in zip([w.uuid for w in decode_workloads()[:2]], ((8.0, 4.0), (8.0, 8.0))):
        for solution, latency in (("reference", reference), ("fast", fast)):
            append_trace(trace_path(tmp_path, "GPU X", DECODE), make_trace(solution, uuid, latency, definition=DECODE))
    result = CliRunner().invoke(main, ["--root", str(REPO), "compare", *solutions, "--def", "mla_paged_decode",
                                       "--trace-dir", str(tmp_path)])
    assert result.exit_code == code, result.output
    if code == 0:
        assert "fast is 1.41x faster than reference (geomean of 2 workloads), 1 faster, 1 same, 0 slower" in result.output
    else:
        assert "no hardware has results of both 'reference' and 'nope'" in result.output
