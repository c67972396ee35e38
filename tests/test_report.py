from trace_factory import CALIBRATION, make_trace

from flashbench.leaderboard import benchmark_table, markdown_report, report_board
from flashbench.model import Workload

WORKLOADS = [Workload(uuid="aaaaaaaa-1", name="small"), Workload(uuid="bbbbbbbb-2", name="large")]
HOST_CLOCK = {"method": "host clock", "l2_flush_bytes": 0}


def table_of(traces, hardware="GPU X", calibration=CALIBRATION, workloads=WORKLOADS, **kwargs):
    return benchmark_table(report_board(traces, workloads, hardware, calibration, **kwargs))


def test_table_has_floor_share_of_floor_and_spread():
    traces = [make_trace("fast", "aaaaaaaa-1", 2.0, ci=0.01), make_trace("slow", "aaaaaaaa-1", 4.0),
              make_trace("fast", "bbbbbbbb-2", status="INCORRECT_NUMERICAL")]
    table = table_of(traces)
    small = table[table["workload"] == "small"].iloc[0]
    assert small["floor µs"] == 1000.0  # 1 GB at 1 TB/s
    assert small["fast"] == "2000.0 ±0.5% (50%, 500 GB/s)"  # memory-bound: the rate is GB/s
    assert small["slow"] == "4000.0 ±0.0% (25%, 250 GB/s)"
    assert table[table["workload"] == "large"].iloc[0]["fast"] == "INCORRECT_NUMERICAL"


def test_a_compute_bound_workload_shows_tflops():
    # 1 PFLOP at 1 PFLOP/s outweighs 1 GB at 1 TB/s: the floor is 1 s of arithmetic.
    table = table_of([make_trace("s", "aaaaaaaa-1", 2000.0, flops=1e15)])
    assert table.iloc[0]["floor µs"] == 1e6
    assert table.iloc[0]["s"] == "2000000.0 ±0.0% (50%, 500 TFLOP/s)"


def test_no_rate_where_none_means_anything():
    traces = [make_trace("no_cost", "aaaaaaaa-1", 2.0, nbytes=None, flops=None, samples=1),
              make_trace("on_cpu", "bbbbbbbb-2", 2.0, timing=HOST_CLOCK, device="cpu"),
              make_trace("tiny", "bbbbbbbb-2", 5.0, nbytes=1e6)]
    table = table_of(traces, calibration=None).set_index("workload")
    assert table.loc["small", "no_cost"] == "2000.0 (—)"  # one sample: no interval either
    assert table.loc["large", "on_cpu"] == "2000.0 ±0.0% (—)"
    assert table.loc["large", "tiny"] == "5000.0 ±0.0% (0.2 GB/s)"  # small, not 0


def test_latest_run_wins():
    traces = [make_trace("s", "aaaaaaaa-1", 2.0, timestamp="2026-01-02T00:00:00+00:00"),
              make_trace("s", "aaaaaaaa-1", 1.0, timestamp="2026-01-01T00:00:00+00:00")]
    assert table_of(traces, calibration=None).iloc[0]["s"] == "2000.0 ±0.0% (500 GB/s)"


def test_under_the_floor_is_marked():
    table = table_of([make_trace("cheat", "aaaaaaaa-1", 0.5)])
    assert table.iloc[0]["cheat"] == "500.0 ±0.0% (200%, 2000 GB/s) suspicious: under the floor"


def test_other_hardware_is_left_out():
    traces = [make_trace("fast", "aaaaaaaa-1", 2.0), make_trace("other", "aaaaaaaa-1", 0.5, hardware="GPU Y")]
    table = table_of(traces, "gpu_x", None)
    assert "other" not in table.columns
    assert table.iloc[0]["fast"] == "2000.0 ±0.0% (500 GB/s)"


def test_columns_are_the_reference_then_the_ranking_and_stale_ones_say_so():
    traces = [make_trace(name, uuid, ms) for uuid in ("aaaaaaaa-1", "bbbbbbbb-2")
              for name, ms in (("slow", 4.0), ("reference", 8.0), ("fast", 2.0))]
    table = table_of(traces, current_hashes={"slow": "rebuilt", "fast": "fast-hash"})
    assert list(table.columns) == ["workload", "MB", "floor µs", "reference", "fast", "slow (stale)"]


def test_the_legend_says_how_it_was_measured_and_what_was_not_timed(tmp_path):
    workloads = [WORKLOADS[0], Workload(uuid="bbbbbbbb-2", name="smoke_tiny", tags=["smoke"])]
    traces = [make_trace("fast", "aaaaaaaa-1", 2.0), make_trace("fast", "bbbbbbbb-2", 2.0)]
    board = report_board(traces, workloads, "GPU X", CALIBRATION, {"fast": "rebuilt"})
    text = markdown_report("d on GPU X", board, tmp_path / "d.jsonl")
    assert "Measured with timing events, L2 flushed (256 MiB), device cuda." in text
    assert "Workloads tagged smoke (smoke_tiny) check correctness" in text
    assert "(stale): the solution's folder now holds other content" in text and "| fast (stale)" in text


def test_a_pair_whose_worker_issued_for_nearly_the_whole_batch_is_marked_host_bound(tmp_path):
    issued = lambda share: {**make_trace("x", "aaaaaaaa-1", 1.0).performance.timing, "worker_issue_share": share}
    traces = [make_trace("busy_host", "aaaaaaaa-1", 2.0, timing=issued(0.99)),
              make_trace("device_bound", "aaaaaaaa-1", 2.0, timing=issued(0.7)),
              make_trace("unknown", "aaaaaaaa-1", 2.0)]  # no share recorded (before the judge): not marked
    row = table_of(traces).iloc[0]
    assert row["busy_host"].endswith(" host-bound")
    assert not row["device_bound"].endswith("host-bound") and not row["unknown"].endswith("host-bound")
    board = report_board(traces, WORKLOADS, "GPU X", CALIBRATION)
    assert "host-bound: the worker reported issuing calls for 95% or more" in markdown_report("d", board, tmp_path / "d.jsonl")
    assert "host-bound:" not in markdown_report("d", report_board(traces[1:], WORKLOADS, "GPU X", CALIBRATION),
                                                tmp_path / "d.jsonl")


def test_what_a_trace_says_of_its_device_stays_text(tmp_path):
    """The legend names each solution's device as its trace says: HTML, a heading or a link there was Markdown."""
    traces = [make_trace("fast", "aaaaaaaa-1", 2.0), make_trace("odd", "aaaaaaaa-1", 2.0,
                                                                device="<img src=x>\n# Hijacked [x](javascript:y)")]
    text = markdown_report("d", report_board(traces, WORKLOADS, "GPU X", CALIBRATION), tmp_path / "d.jsonl")
    assert "<img" not in text and "\n# Hijacked" not in text and "[x](javascript" not in text
    assert "device cuda (odd: &lt;img src=x&gt; # Hijacked \\[x\\](javascript:y))." in text
