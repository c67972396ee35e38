"""`flashbench report`: a Markdown benchmark table, per workload the floor and every solution's latency and rate."""

from pathlib import Path
from typing import Mapping

import pandas as pd

from ..model import Calibration, Trace, Workload
from ..traces import hardware_slug
from .board import UNTIMED_TAGS, Board, build_board, measurement_note, split_by_hardware
from .formats import NOT_APPLICABLE, markdown_table, markdown_text, spread
from .results import HOST_BOUND_SHARE, HOST_CLOCK, mark_stale, traces_frame


def report_board(traces: list[Trace], workloads: list[Workload], hardware: str, calibration: Calibration | None,
                 current_hashes: Mapping[str, str] | None = None) -> Board | None:
    """The leaderboard of one hardware the report is read from (None without results of the workload set)."""
    slug = hardware_slug(hardware)
    frame = mark_stale(traces_frame(t for t in traces if hardware_slug(t.hardware) == slug), current_hashes)
    boards = [build_board(hw) for hw in split_by_hardware(frame, workloads, {slug: calibration}) if hw.hardware == slug]
    return boards[0] if boards else None


def benchmark_table(board: Board) -> pd.DataFrame:
    """Rows: workloads in set order. Columns: MB moved, floor, then each solution's µs (with its spread, % of floor
    and the achieved rate of the workload's bound): the reference first, then the leaderboard's order."""
    stale = set(board.ranking.loc[board.ranking["stale"], "solution"])
    rows = []
    for uuid in board.labels:
        mine = board.results[board.results["workload"] == uuid].set_index("solution")
        nbytes, floor = mine["bytes"].dropna(), mine["floor_ms"].iloc[0]
        row = {"workload": board.labels[uuid], "MB": _round(nbytes.iloc[0] / 1e6 if len(nbytes) else None, 1),
               "floor µs": _round(None if pd.isna(floor) else floor * 1e3, 1)}
        for solution in board.ranking["solution"]:
            header = f"{solution} (stale)" if solution in stale else solution
            row[header] = _cell(mine.loc[solution], board.calibration) if solution in mine.index else ""
        rows.append(row)
    return pd.DataFrame(rows)


def _cell(result, calibration: Calibration | None) -> str:
    if result["status"] != "PASSED" or pd.isna(result["latency_ms"]):
        return result["status"]
    share = "" if pd.isna(result["sol_pct"]) else f"{result['sol_pct'] / 100:.0%}"
    details = ", ".join(part for part in (share, _achieved(result, calibration)) if part)
    text = " ".join(part for part in (f"{result['latency_ms'] * 1e3:.1f}", spread(result["spread_pct"])) if part)
    text += f" ({details})"
    if result["suspicious"]:
        text += " suspicious: under the floor"
    if result["host_bound"]:
        text += " host-bound"
    return text


def _achieved(result, calibration: Calibration | None) -> str:
    """TFLOP/s where arithmetic sets the floor, else GB/s (without a calibration: GB/s when bytes are known);
    '—' without a cost model or from a CPU's host clock, where no rate means anything."""
    nbytes = result["bytes"] if result["bytes"] > 0 else None  # NaN > 0 is False: unknown
    flops = result["flops"] if result["flops"] > 0 else None
    if result["timing_method"] == HOST_CLOCK or (nbytes is None and flops is None):
        return NOT_APPLICABLE
    seconds = result["latency_ms"] / 1e3
    compute_bound = flops is not None and (nbytes is None or (
        calibration is not None and flops / calibration.matmul_flops_per_s > nbytes / calibration.memory_bytes_per_s))
    if compute_bound:
        return f"{_rate(flops / seconds / 1e12)} TFLOP/s"
    return f"{_rate(nbytes / seconds / 1e9)} GB/s"


def _rate(value: float) -> str:
    """Whole numbers from 10 up; two significant digits below, so a small rate never reads as 0."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _round(value, digits: int):
    return None if value is None else round(value, digits)


def markdown_report(title: str, board: Board, source: Path) -> str:
    calibration = board.calibration
    cells = (f"Cells: median latency in µs and ± half its 95% confidence interval, then the share of the floor "
             "(100% is the speed of light) and the achieved rate of the bound that sets the floor (TFLOP/s or GB/s; "
             f"{NOT_APPLICABLE} without a cost model or for host-clock timings on a CPU).")
    if calibration:
        lines = [f"Floor: the larger of bytes / {calibration.memory_bytes_per_s / 1e12:.2f} TB/s and FLOPs / "
                 f"{calibration.matmul_flops_per_s / 1e12:.0f} TFLOP/s, the peaks `flashbench calibrate` measured on "
                 f"this {calibration.hardware}. {cells}"]
    else:
        lines = [f"{cells} No calibration for this hardware, so no floor: run `flashbench calibrate`."]
    lines.append(f"Measured with {markdown_text(measurement_note(board.results))}.")  # free-form words of traces
    untimed = [label for uuid, label in board.labels.items() if uuid not in board.timed]
    if untimed:
        lines.append(f"Workloads tagged {' or '.join(sorted(UNTIMED_TAGS))} ({', '.join(untimed)}) check correctness: "
                     "their latencies are shown, but the leaderboard's figures leave them out.")
    if board.ranking["stale"].any():
        lines.append("(stale): the solution's folder now holds other content than these results measured.")
    if board.results["host_bound"].any():
        lines.append(f"host-bound: the worker reported issuing calls for {HOST_BOUND_SHARE:.0%} or more of each timed batch, "
                     "so the device waited on the host and the figure is the host's time per call (Python, launches, "
                     "waits on the device inside the call), which varies from run to run.")
    table = benchmark_table(board)
    return "\n".join([f"# {title}", "", *[line for text in lines for line in (text, "")],
                      f"Generated by `flashbench report` from `{source}`.", "", markdown_table(table), ""])
