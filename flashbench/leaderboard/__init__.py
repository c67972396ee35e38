"""Leaderboards, comparisons, charts and reports from recorded traces.

Which results count
    One board per hardware (the folder under traces/): results from different GPUs never mix.
    One result per (solution content hash, workload, hardware): the latest run, with `runs`, the
    number of runs recorded. Per solution only its newest content hash on that hardware is ranked;
    results of older hashes are left out. The reference is the solution named `reference`.
    Stale: given the content hashes of the solution folders now (`solution_hashes`), a result whose
    hash differs is marked `stale`; `hide_stale=True` (`--hide-stale`) leaves such results out.

Timed workloads
    Workloads tagged `smoke` (UNTIMED_TAGS, read from the workload set) check correctness: they
    count in passed and total, but their latencies stay out of the speedups, fast_p, win rate,
    sol_pct and spread, unless `include_smoke=True` (`--include-smoke`). Without a workload set no
    tags are known and every workload is timed.

Valid results and the speed-of-light floor
    A result is valid when it PASSED and is not faster than its speed-of-light floor, the larger
    of bytes / measured bandwidth and FLOPs / measured matmul rate (Calibration.floor_ms, from
    traces/<hardware>/calibration.json; no floor without one). A PASSED result under its floor
    cannot be real: it is flagged `suspicious`, noted, and counted as not passed. Failed, missing
    and suspicious results are never fast and never win.

Figures per solution
    total         the workloads of the definition's workload set that any solution (the reference
                  included) ran on that hardware (not the full set: a CPU run of the smoke workloads
                  is scored out of those; a workload a solution was never run on is missing)
    passed        valid results among them
    speedup_vs_reference, speedup_vs_baseline
                  geometric mean of other latency / own latency over the timed workloads where
                  both results are valid
    fast_p        for p = 1.0, 1.5, 2.0: the share of all timed workloads where the result is
                  valid and more than p times faster than the baseline's valid result there
    win_rate      of the timed workloads where both are valid, the share where it is faster
    sol_pct       mean over its valid timed results of floor / latency, in % (blank without a floor)
    spread_pct    median over its valid timed results of half the 95% confidence interval of the
                  median latency, in % of it (blank from single samples)

Baseline
    `baseline=` names it; otherwise the fastest non-reference solution tagged `baseline` (most
    workloads passed, then the highest geomean speedup over the reference) whose results are of
    the repository's folder of its name as it holds it now (same content hash, `current_hashes`):
    a manifest tags itself, so only the repository grants the role, and a folder run from
    elsewhere tagged so is passed over (the board's note says so); otherwise the reference.

Ranking
    The reference is the denominator, not a competitor: listed first, without a rank. The others
    by workloads passed (descending), then by the geomean speedup over the baseline on the timed
    workloads both passed (descending), then by name.

How it was measured
    Each board's notes name the timing method, the L2 state before each call and the device
    recorded in its traces (and the solutions measured otherwise). Rates (GB/s, TFLOP/s) are shown
    as "—" without a cost model or for host-clock timings of a CPU run.
"""

from .board import UNTIMED_TAGS, Board, build_board, build_boards, is_timed, leaderboards, split_by_hardware
from .charts import board_colours, latency_chart, roofline_chart, save_charts, solution_colours
from .compare import Comparison, compare, compare_solutions
from .formats import by_workload_display, comparison_display, ranking_display, results_display
from .html import html_page
from .report import benchmark_table, markdown_report, report_board
from .results import (belonging, current_results, latest_results, mark_stale, read_results, solution_hashes,
                      traces_frame, with_speed_of_light)

__all__ = [
    "UNTIMED_TAGS", "Board", "Comparison", "belonging", "benchmark_table", "board_colours", "build_board",
    "build_boards", "by_workload_display", "compare", "compare_solutions", "comparison_display", "current_results",
    "html_page", "is_timed", "latency_chart", "latest_results", "leaderboards", "mark_stale", "markdown_report",
    "ranking_display", "read_results", "report_board", "results_display", "roofline_chart", "save_charts",
    "solution_colours", "solution_hashes", "split_by_hardware", "traces_frame", "with_speed_of_light",
]
