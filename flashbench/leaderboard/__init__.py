"""Leaderboards, comparisons, charts and reports from recorded traces.

Which results count
    One board per hardware (the folder under traces/): results from different GPUs never mix.
    One result per (solution content hash, workload, hardware): the latest run, with `runs`, the
    number of runs recorded. Per solution only its newest content hash on that hardware is ranked;
    results of older hashes are left out. The reference is the solution named `reference`.

Valid results and the speed-of-light floor
    A result is valid when it PASSED and is not faster than its speed-of-light floor, the larger
    of bytes / measured bandwidth and FLOPs / measured matmul rate (Calibration.floor_ms, from
    traces/<hardware>/calibration.json; no floor without one). A PASSED result under its floor
    cannot be real: it is flagged `suspicious`, noted, and counted as not passed. Failed, missing
    and suspicious results are never fast and never win.

Figures per solution
    total         the workloads of the definition's workload set that any ranked solution ran
                  on that hardware (not the full set: a CPU run of the smoke workloads is scored
                  out of those)
    passed        valid results among them
    speedup_vs_reference, speedup_vs_baseline
                  geometric mean of other latency / own latency over the workloads where both
                  results are valid
    fast_p        for p = 1.0, 1.5, 2.0: the share of all `total` workloads where the result is
                  valid and more than p times faster than the baseline's valid result there
    win_rate      of the workloads where both are valid, the share where it is faster
    sol_pct       mean over its valid results of floor / latency, in % (blank without a floor)

Baseline
    `baseline=` names it; otherwise the fastest non-reference solution tagged `baseline` (most
    workloads passed, then the highest geomean speedup over the reference); otherwise the reference.

Ranking
    By workloads passed (descending), then by the geomean speedup over the baseline on the
    workloads both passed (descending), then by name.
"""

from .board import Board, build_board, build_boards, leaderboards, split_by_hardware
from .charts import latency_chart, roofline_chart, save_charts
from .compare import Comparison, compare, compare_solutions
from .formats import by_workload_display, comparison_display, ranking_display, results_display
from .html import html_page
from .report import benchmark_table, markdown_report
from .results import current_results, latest_results, read_results, traces_frame, with_speed_of_light

__all__ = [
    "Board", "Comparison", "benchmark_table", "build_board", "build_boards", "by_workload_display", "compare",
    "compare_solutions", "comparison_display", "current_results", "html_page", "latency_chart", "latest_results",
    "leaderboards", "markdown_report", "ranking_display", "read_results", "results_display", "roofline_chart",
    "save_charts", "split_by_hardware", "traces_frame", "with_speed_of_light",
]
