from trace_factory import CALIBRATION, make_trace

from flashbench.leaderboard import benchmark_table
from flashbench.model import Workload

WORKLOADS = [Workload(uuid="aaaaaaaa-1", name="small"), Workload(uuid="bbbbbbbb-2", name="large")]


def test_table_has_floor_and_share_of_floor():
    traces = [make_trace("fast", "aaaaaaaa-1", 2.0), make_trace("slow", "aaaaaaaa-1", 4.0),
              make_trace("fast", "bbbbbbbb-2", status="INCORRECT_NUMERICAL")]
    table = benchmark_table(traces, WORKLOADS, "GPU X", CALIBRATION)
    small = table[table["workload"] == "small"].iloc[0]
    assert small["floor µs"] == 1000.0  # 1 GB at 1 TB/s
    assert small["fast"] == "2000.0 (50%, 500 GB/s)"  # memory-bound: the rate is GB/s
    assert small["slow"] == "4000.0 (25%, 250 GB/s)"
    assert table[table["workload"] == "large"].iloc[0]["fast"] == "INCORRECT_NUMERICAL"


def test_a_compute_bound_workload_shows_tflops():
    # 1 PFLOP at 1 PFLOP/s outweighs 1 GB at 1 TB/s: the floor is 1 s of arithmetic.
    table = benchmark_table([make_trace("s", "aaaaaaaa-1", 2000.0, flops=1e15)], WORKLOADS, "GPU X", CALIBRATION)
    assert table.iloc[0]["floor µs"] == 1e6
    assert table.iloc[0]["s"] == "2000000.0 (50%, 500 TFLOP/s)"


def test_latest_run_wins():
    traces = [make_trace("s", "aaaaaaaa-1", 2.0, timestamp="2026-01-02T00:00:00+00:00"),
              make_trace("s", "aaaaaaaa-1", 1.0, timestamp="2026-01-01T00:00:00+00:00")]
    assert benchmark_table(traces, WORKLOADS, "GPU X", None).iloc[0]["s"] == "2000.0 (500 GB/s)"


def test_under_the_floor_is_marked():
    table = benchmark_table([make_trace("cheat", "aaaaaaaa-1", 0.5)], WORKLOADS, "GPU X", CALIBRATION)
    assert table.iloc[0]["cheat"] == "500.0 (200%, 2000 GB/s) suspicious: under the floor"


def test_other_hardware_is_left_out():
    traces = [make_trace("fast", "aaaaaaaa-1", 2.0), make_trace("other", "aaaaaaaa-1", 0.5, hardware="GPU Y")]
    table = benchmark_table(traces, WORKLOADS, "gpu_x", None)
    assert "other" not in table.columns
    assert table.iloc[0]["fast"] == "2000.0 (500 GB/s)"


def test_columns_are_the_reference_then_the_ranking():
    traces = [make_trace(name, uuid, ms) for uuid in ("aaaaaaaa-1", "bbbbbbbb-2")
              for name, ms in (("slow", 4.0), ("reference", 8.0), ("fast", 2.0))]
    table = benchmark_table(traces, WORKLOADS, "GPU X", CALIBRATION)
    assert list(table.columns) == ["workload", "MB", "floor µs", "reference", "fast", "slow"]
