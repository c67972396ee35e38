"""Traces as pandas frames: one row per trace, then one result per (solution content, workload, hardware)."""

import sys
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

from ..build import FolderError, same_content
from ..model import Calibration, Performance, Trace
from ..model.trace import printable_line
from ..registry import Repo
from ..traces import hardware_slug, read_traces, trace_file_name, trace_path

COLUMNS = [
    "hardware", "hardware_name", "definition", "workload", "workload_name", "solution", "solution_hash",
    "solution_tags", "status", "message", "timestamp", "latency_ms", "ci_low_ms", "ci_high_ms", "p10_ms", "p90_ms",
    "spread_pct", "bytes", "flops", "timing_method", "l2_state", "device", "isolation", "host_bound",
]
RESULT_KEY = ["hardware", "solution", "solution_hash", "workload"]
HOST_CLOCK = "host clock"  # the runner's timing method on a CPU: no rate (GB/s, FLOP/s) means anything there
# A worker busy issuing its calls for this share of each timed batch or more (`worker_issue_share`) left the
# device waiting on the host: the judge's clock then read the host's time per call, not the device's. On the
# H200 (docs/measurement.md, v8 and v9) our kernels and FlashInfer read 0.38-0.90 on kernel workloads, the
# pairs whose ranked figure moved most between two runs 0.99.
HOST_BOUND_SHARE = 0.95
FUTURE_SLACK = pd.Timedelta(days=1)  # clocks disagree; a record dated later than this is no record of the past


def traces_frame(traces: Iterable[Trace]) -> pd.DataFrame:
    """One row per trace, in recorded order. `hardware` is the folder name, so GPUs never mix.
    `stale` and `in_repository` are False until mark_stale compares the hashes with the folders on disk."""
    rows = []
    for t in traces:
        perf = t.performance
        timing = perf.timing if perf else {}
        rows.append({
            "hardware": hardware_slug(t.hardware), "hardware_name": t.hardware, "definition": t.definition,
            "workload": t.workload, "workload_name": t.workload_name, "solution": t.solution,
            "solution_hash": t.solution_hash, "solution_tags": list(t.solution_tags), "status": t.status,
            "message": t.message, "timestamp": t.timestamp,
            **{column: _time(getattr(perf, column)) if perf else np.nan
               for column in ("latency_ms", "ci_low_ms", "ci_high_ms", "p10_ms", "p90_ms")},
            "spread_pct": spread_pct(perf) if perf else np.nan,
            "bytes": perf.bytes if perf and perf.bytes is not None else np.nan,
            "flops": perf.flops if perf and perf.flops is not None else np.nan,
            "timing_method": _text(timing.get("method")), "l2_state": l2_state(timing),
            "device": _text(t.environment.get("device")),
            "isolation": t.isolation, "host_bound": host_bound(timing),
        })
    frame = pd.DataFrame(rows, columns=COLUMNS)
    # A record's time that is no date (a trace file, or an imported dataset's, may say anything) is unknown: it
    # ended every board of every hardware with a traceback.
    # A time after the present is unknown too: unknown times count as the oldest (latest_results), so a forged
    # record dated 9999 or "not a date" is replaced by the next honest run, not kept as the newest for ever.
    frame["time"] = pd.to_datetime(frame["timestamp"], utc=True, format="ISO8601", errors="coerce")
    frame.loc[frame["time"] > pd.Timestamp.now(tz="UTC") + FUTURE_SLACK, "time"] = pd.NaT
    frame["order"] = range(len(frame))  # breaks ties between runs recorded in the same second
    frame["stale"] = False
    frame["in_repository"] = False
    return frame


def spread_pct(perf: Performance) -> float:
    """Half the width of the 95% confidence interval of the median, in % of the median. One sample
    (e.g. an imported latency) gives no interval: NaN, not a spread of 0."""
    if perf.samples < 2 or not perf.latency_ms > 0:
        return np.nan
    return (perf.ci_high_ms - perf.ci_low_ms) / 2 / perf.latency_ms * 100


def l2_state(timing: dict) -> str | None:
    """What the L2 cache held before each timed call: the runner's own words, else read from the flush size."""
    if timing.get("l2_flush"):
        return _text(timing["l2_flush"])
    if "l2_flush_bytes" not in timing:
        return None
    flushed = _number(timing["l2_flush_bytes"])
    if np.isnan(flushed):
        return None
    return f"flushed ({flushed / 2**20:.0f} MiB)" if flushed else "not flushed"


def _time(ms: float) -> float:
    """A recorded time, unless it is none a clock gives (negative or infinite: a trace file may say anything, and
    `compare` called -13 µs the fastest): then unknown, as a missing time is."""
    return ms if 0 <= ms < np.inf else np.nan


def host_bound(timing: dict) -> bool:
    """The worker issued calls for HOST_BOUND_SHARE or more of each timed batch: the time is the host's."""
    return _number(timing.get("worker_issue_share")) >= HOST_BOUND_SHARE


def _number(value) -> float:
    """A timing field as a number: 0 when absent, NaN when it is not one (a record's fields are free-form)."""
    if value is None:
        return 0.0
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # 10**400 is an int no float holds
        return np.nan


def _text(value) -> str | None:
    """A free-form field shown as words (a method, a device): a list or a mapping there ended every board, and an
    escape sequence or a newline in a device's name reached the terminal and `report` through the notes."""
    return printable_line(value) if isinstance(value, str) else None


def read_results(trace_dir: Path, definition: str, hardware: str | None = None, timing: str = "events",
                 isolation: str | None = None) -> pd.DataFrame:
    """Every trace of a definition timed one way under trace_dir: one hardware folder, or all of them;
    with `isolation`, only those whose worker ran at that level (traces from before levels were
    recorded have none)."""
    if hardware:
        paths = [trace_path(trace_dir, hardware, definition, timing)]
    else:
        paths = sorted(Path(trace_dir).glob(f"*/{trace_file_name(definition, timing)}"))
    frame = traces_frame(trace for path in paths for trace in belonging(path, definition))
    return frame[frame["isolation"] == isolation].reset_index(drop=True) if isolation else frame


def belonging(path: Path, definition: str) -> list[Trace]:
    """The records of a trace file that belong in it: of its definition, and of the hardware its folder
    is named after. A record copied or edited into another GPU's or definition's file stays off its boards."""
    traces = read_traces(path)
    kept = [t for t in traces if t.definition == definition and hardware_slug(t.hardware) == path.parent.name]
    if len(kept) < len(traces):
        print(f"{path}: {len(traces) - len(kept)} record(s) of another definition or hardware left out",
              file=sys.stderr)
    return kept


UNREADABLE = "unreadable"  # the current hash of a folder that cannot be read: not hex, so no record's


def solution_hashes(repo: Repo, definition: str) -> dict[str, str]:
    """The content hash of each solution folder of a definition as it is on disk now, by solution name; for a
    folder the judge would not read (build.walk_folder), a mark no recorded hash matches, so its results show
    as stale rather than the board ending (a `.gitignore` in one folder stopped every board)."""
    return {folder.solution.name: _current_hash(folder) for folder in repo.solution_folders(definition)}


def _current_hash(folder) -> str:
    try:
        return folder.content_hash()
    except FolderError:
        return UNREADABLE


def mark_stale(frame: pd.DataFrame, current_hashes: Mapping[str, str] | None) -> pd.DataFrame:
    """stale: the trace measured other content than the solution's folder holds now. Solutions without a
    folder here (the reference, removed or imported ones) are never stale: there is nothing to compare with.
    in_repository: the trace measured what the repository's folder of its name holds now, manifest and tags
    included (they are hashed): only such a result may be a board's baseline by its tag."""
    current = frame["solution"].map(current_hashes or {})
    same = pd.Series([isinstance(now, str) and same_content(recorded, now)
                      for recorded, now in zip(frame["solution_hash"], current)], index=frame.index, dtype=bool)
    return frame.assign(stale=current.notna() & ~same, in_repository=same)


def latest_results(frame: pd.DataFrame) -> pd.DataFrame:
    """The newest run of each (solution content hash, workload, hardware), with `runs`: how many were recorded."""
    ordered = frame.sort_values(["time", "order"], kind="stable", na_position="first")
    runs = ordered.groupby(RESULT_KEY).size().rename("runs").reset_index()
    latest = ordered.groupby(RESULT_KEY, as_index=False).tail(1)
    return latest.merge(runs, on=RESULT_KEY, how="left").sort_values("order", kind="stable").reset_index(drop=True)


def current_results(frame: pd.DataFrame) -> pd.DataFrame:
    """Latest results of the newest content hash of each solution per hardware; older hashes drop out."""
    latest = latest_results(frame)
    newest = latest.sort_values(["time", "order"], kind="stable", na_position="first").groupby(
        ["hardware", "solution"]).tail(1)
    return latest.merge(newest[["hardware", "solution", "solution_hash"]], on=["hardware", "solution", "solution_hash"])


def with_speed_of_light(results: pd.DataFrame, calibration: Calibration | None) -> pd.DataFrame:
    """Adds floor_ms, sol_pct (floor / latency, in %), suspicious (passed yet faster than the floor) and valid.

    The cost model does not depend on the solution, so a workload's bytes and FLOPs come from any
    result that recorded them. A result under the floor cannot be real: it is kept off every ranking.
    """
    results = results.copy()
    costs = results.groupby("workload")[["bytes", "flops"]].first()
    floors = {workload: _floor_ms(calibration, row["bytes"], row["flops"]) for workload, row in costs.iterrows()}
    results["floor_ms"] = results["workload"].map(floors).astype(float)
    passed = (results["status"] == "PASSED") & results["latency_ms"].notna()
    results["sol_pct"] = np.where(passed, results["floor_ms"] / results["latency_ms"] * 100, np.nan)
    results["suspicious"] = passed & (results["latency_ms"] < results["floor_ms"])
    results["valid"] = passed & ~results["suspicious"]
    return results


def _floor_ms(calibration: Calibration | None, nbytes: float, flops: float) -> float:
    if calibration is None:
        return np.nan
    floor = calibration.floor_ms(None if pd.isna(nbytes) else nbytes, None if pd.isna(flops) else flops)
    return np.nan if floor is None else floor
