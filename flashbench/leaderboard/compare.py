"""`compare A B`: per workload, is B faster, slower or the same as A within the timing noise?

The noise is the recorded 95% confidence interval of each median: B is faster when its interval
lies wholly below A's, slower when wholly above, the same when the two overlap.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import FlashbenchError
from ..model import Workload
from .board import HardwareResults, calibrations_for, geomean, split_by_hardware
from .results import read_results


@dataclass
class Comparison:
    """table: per workload, a_* and b_* (latency and its interval in µs), speedup (A / B) and the verdict."""

    hardware: str
    hardware_name: str
    a: str
    b: str
    table: pd.DataFrame
    summary: str


def compare_solutions(frame: pd.DataFrame, a: str, b: str, workloads: list[Workload] | None = None,
                      calibrations=None) -> list[Comparison]:
    """One comparison per hardware where both solutions have results."""
    return [compare_on(hw, a, b) for hw in split_by_hardware(frame, workloads, calibrations)
            if {a, b} <= set(hw.results["solution"])]


def compare(trace_dir: Path, definition: str, a: str, b: str, workloads: list[Workload] | None = None,
            hardware: str | None = None, timing: str = "events") -> list[Comparison]:
    frame = read_results(trace_dir, definition, hardware, timing)
    comparisons = compare_solutions(frame, a, b, workloads, calibrations_for(trace_dir, frame))
    if not comparisons:
        raise FlashbenchError(f"no hardware has results of both {a!r} and {b!r} for {definition}", trace_dir)
    return comparisons


def compare_on(hw: HardwareResults, a: str, b: str) -> Comparison:
    results = hw.results.set_index(["solution", "workload"])
    rows = []
    for uuid in hw.workloads:
        first, second = _result(results, a, uuid), _result(results, b, uuid)
        rows.append({
            "workload": hw.labels[uuid], **_side("a", first), **_side("b", second),
            "speedup": first["latency_ms"] / second["latency_ms"] if _valid(first) and _valid(second) else np.nan,
            "verdict": verdict(first, second, a, b),
        })
    table = pd.DataFrame(rows)
    return Comparison(hw.hardware, hw.hardware_name, a, b, table, summarize(table, a, b))


def verdict(first, second, a: str, b: str) -> str:
    """B against A: faster, slower, same, or why the two cannot be compared."""
    missing = [f"{name} {_failure(result)}" for name, result in ((a, first), (b, second)) if not _valid(result)]
    if missing:
        return ", ".join(missing)
    if second["ci_high_ms"] < first["ci_low_ms"]:
        return "faster"
    if second["ci_low_ms"] > first["ci_high_ms"]:
        return "slower"
    return "same"


def summarize(table: pd.DataFrame, a: str, b: str) -> str:
    """E.g. 'B is 1.23x faster than A (geomean of 8 workloads), 7 faster, 1 same, 0 slower'."""
    counts = table["verdict"].value_counts()
    tally = f"{counts.get('faster', 0)} faster, {counts.get('same', 0)} same, {counts.get('slower', 0)} slower"
    uncompared = len(table) - sum(counts.get(v, 0) for v in ("faster", "same", "slower"))
    if uncompared:
        tally += f", {uncompared} not compared (failed or missing)"
    speedups = table["speedup"].dropna()
    if speedups.empty:
        return f"no workload where both {a} and {b} passed; {tally}"
    ratio = float(geomean(speedups))
    direction = f"{ratio:.2f}x faster than" if ratio >= 1 else f"{1 / ratio:.2f}x slower than"
    workloads = f"{len(speedups)} workload" + ("s" if len(speedups) > 1 else "")
    return f"{b} is {direction} {a} (geomean of {workloads}), {tally}"


def _result(results: pd.DataFrame, solution: str, workload: str):
    key = (solution, workload)
    return results.loc[key] if key in results.index else None


def _valid(result) -> bool:
    return result is not None and bool(result["valid"])


def _failure(result) -> str:
    if result is None:
        return "missing"
    return "suspicious (faster than the floor)" if result["suspicious"] else result["status"]


def _side(prefix: str, result) -> dict:
    """Latency and its confidence interval in µs, NaN unless the result is valid."""
    return {f"{prefix}_{column}_us": result[f"{column}_ms"] * 1e3 if _valid(result) else np.nan
            for column in ("latency", "ci_low", "ci_high")}

