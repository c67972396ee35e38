from flashbench.model import Calibration, Performance, Trace, Workload
from flashbench.report import benchmark_table, latest_per_solution, traces_frame

WORKLOADS = [Workload(uuid="aaaaaaaa-1", name="small"), Workload(uuid="bbbbbbbb-2", name="large")]
CALIBRATION = Calibration(hardware="GPU X", memory_bytes_per_s=1e12, matmul_flops_per_s=1e15,
                          method={}, environment={}, timestamp="2026-01-01T00:00:00+00:00")


def trace(solution, workload, latency_ms=None, status="PASSED", timestamp="2026-01-01T00:00:00+00:00",
          hardware="GPU X", nbytes=1e9):
    performance = None
    if latency_ms is not None:
        performance = Performance(latency_ms=latency_ms, mean_ms=latency_ms, std_ms=0, min_ms=latency_ms,
                                  p10_ms=latency_ms, p90_ms=latency_ms, samples=1, ci_low_ms=latency_ms,
                                  ci_high_ms=latency_ms, bytes=nbytes, flops=1e9, timing={})
    return Trace(definition="d", workload=workload, workload_name="", solution=solution, solution_hash=solution,
                 author="a", hardware=hardware, status=status, timestamp=timestamp, performance=performance)


def test_latest_result_wins():
    frame = traces_frame([trace("s", "aaaaaaaa-1", 2.0, timestamp="2026-01-02T00:00:00+00:00"),
                          trace("s", "aaaaaaaa-1", 1.0, timestamp="2026-01-01T00:00:00+00:00")])
    assert list(latest_per_solution(frame)["latency_ms"]) == [2.0]


def test_table_has_floor_and_share_of_floor():
    traces = [trace("fast", "aaaaaaaa-1", 2.0), trace("slow", "aaaaaaaa-1", 4.0),
              trace("fast", "bbbbbbbb-2", status="INCORRECT_NUMERICAL")]
    table = benchmark_table(traces, WORKLOADS, "GPU X", CALIBRATION)
    small = table[table["workload"] == "small"].iloc[0]
    assert small["floor µs"] == 1000.0  # 1 GB at 1 TB/s
    assert small["fast"] == "2000.0 (50%)"
    assert small["slow"] == "4000.0 (25%)"
    assert table[table["workload"] == "large"].iloc[0]["fast"] == "INCORRECT_NUMERICAL"


def test_other_hardware_is_left_out():
    traces = [trace("fast", "aaaaaaaa-1", 2.0), trace("other", "aaaaaaaa-1", 0.5, hardware="GPU Y")]
    table = benchmark_table(traces, WORKLOADS, "gpu_x", None)
    assert "other" not in table.columns
    assert table.iloc[0]["fast"] == "2000.0"
