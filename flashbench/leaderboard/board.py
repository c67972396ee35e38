"""One leaderboard per hardware: per-solution figures over the workloads, ranked, and a per-workload view."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import pandas as pd

from ..calibrate import load_calibration
from ..errors import FlashbenchError
from ..model import REFERENCE, Calibration, Workload
from .results import current_results, read_results, with_speed_of_light

BASELINE_TAG = "baseline"
FAST_P = (1.0, 1.5, 2.0)
VIEW_COLUMNS = ["workload", "floor_us", "best", "best_us", "best_sol_pct"]  # then one column per solution


@dataclass
class HardwareResults:
    """The ranked results of one hardware: current content hashes only, with speed-of-light columns."""

    hardware: str
    hardware_name: str
    results: pd.DataFrame
    workloads: list[str]  # uuids, in workload-set order: the denominator of passed and fast_p
    labels: dict[str, str]
    calibration: Calibration | None


@dataclass
class Board:
    hardware: str
    hardware_name: str
    baseline: str
    ranking: pd.DataFrame
    by_workload: pd.DataFrame
    results: pd.DataFrame
    labels: dict[str, str]
    calibration: Calibration | None
    notes: list[str] = field(default_factory=list)


def split_by_hardware(frame: pd.DataFrame, workloads: list[Workload] | None = None,
                      calibrations: Mapping[str, Calibration | None] | None = None) -> Iterator[HardwareResults]:
    """Current results per hardware folder. With a workload set, results of workloads outside it are dropped."""
    results = current_results(frame)
    if workloads is not None:
        results = results[results["workload"].isin([w.uuid for w in workloads])]
    for hardware, mine in results.groupby("hardware", sort=True):
        calibration = (calibrations or {}).get(hardware)
        ran = set(mine["workload"])
        if workloads is not None:
            order = [w.uuid for w in workloads if w.uuid in ran]
            labels = {w.uuid: w.label for w in workloads}
        else:
            order = list(dict.fromkeys(mine["workload"]))
            labels = {row.workload: row.workload_name or row.workload[:8] for row in mine.itertuples()}
        yield HardwareResults(hardware, mine["hardware_name"].iloc[-1], with_speed_of_light(mine, calibration),
                              order, {uuid: labels[uuid] for uuid in order}, calibration)


def build_boards(frame: pd.DataFrame, workloads: list[Workload] | None = None, baseline: str | None = None,
                 calibrations: Mapping[str, Calibration | None] | None = None) -> list[Board]:
    return [build_board(hw, baseline) for hw in split_by_hardware(frame, workloads, calibrations)]


def leaderboards(trace_dir: Path, definition: str, workloads: list[Workload] | None = None,
                 hardware: str | None = None, baseline: str | None = None, timing: str = "events") -> list[Board]:
    """Boards from the traces of one timing method under traces/<hardware>/, each with that folder's calibration.json."""
    frame = read_results(trace_dir, definition, hardware, timing)
    return build_boards(frame, workloads, baseline, calibrations_for(trace_dir, frame))


def calibrations_for(trace_dir: Path, frame: pd.DataFrame) -> dict[str, Calibration | None]:
    return {hardware: load_calibration(trace_dir, hardware) for hardware in frame["hardware"].unique()}


def build_board(hw: HardwareResults, baseline: str | None = None) -> Board:
    latency = latency_matrix(hw)
    tags = hw.results.sort_values("order").groupby("solution")["solution_tags"].last().to_dict()
    chosen, reason = choose_baseline(latency, tags, baseline, hw.hardware)
    notes = [reason]
    ranking = rank(solution_figures(latency, chosen, hw))
    for row in hw.results[hw.results["suspicious"]].itertuples():
        notes.append(f"{row.solution} on {hw.labels[row.workload]}: {row.latency_ms * 1e3:.1f} µs is under the "
                     f"speed-of-light floor of {row.floor_ms * 1e3:.1f} µs; counted as not passed")
    if hw.calibration is None:
        notes.append("no calibration for this hardware: floor and % of speed-of-light are blank "
                     "(run `flashbench calibrate` on it)")
    by_workload = workload_view(latency, hw, list(ranking["solution"]))
    return Board(hw.hardware, hw.hardware_name, chosen, ranking, by_workload, hw.results, hw.labels,
                 hw.calibration, notes)


def latency_matrix(hw: HardwareResults) -> pd.DataFrame:
    """Rows: every workload of the board; columns: solutions; a cell is the latency of a valid result, else NaN."""
    valid = hw.results[hw.results["valid"]]
    solutions = list(dict.fromkeys(hw.results["solution"]))
    matrix = valid.pivot(index="workload", columns="solution", values="latency_ms")
    return matrix.reindex(index=hw.workloads, columns=solutions).astype(float)


def speedups_over(latency: pd.DataFrame, against: str) -> pd.DataFrame:
    """against's latency / each solution's latency, per workload; NaN unless both are valid."""
    if against not in latency.columns:
        return latency * np.nan
    return latency.rdiv(latency[against], axis=0)


def geomean(values: pd.DataFrame) -> pd.Series:
    """Geometric mean of the cells that are set, per column of a frame (NaN where none is)."""
    return np.exp(np.log(values).mean())


def choose_baseline(latency: pd.DataFrame, tags: dict[str, list[str]], requested: str | None,
                    hardware: str) -> tuple[str, str]:
    """The baseline and a note on why it was chosen."""
    if requested:
        if requested not in latency.columns:
            raise FlashbenchError(f"no results of {requested!r} on {hardware}; solutions: {', '.join(latency.columns)}",
                                  field="--baseline")
        return requested, f"baseline: {requested} (as asked)"
    tagged = [s for s in latency.columns if s != REFERENCE and BASELINE_TAG in tags.get(s, [])]
    passed = latency[tagged].notna().sum()
    tagged = [s for s in tagged if passed[s] > 0]
    if not tagged:
        return REFERENCE, f"baseline: {REFERENCE} (no solution tagged {BASELINE_TAG!r} passed a workload)"
    # The fastest: most workloads passed, then the highest geomean speedup over the reference.
    over_reference = geomean(speedups_over(latency, REFERENCE)[tagged]).fillna(-np.inf)
    fastest = max(tagged, key=lambda s: (passed[s], over_reference[s], s))
    return fastest, f"baseline: {fastest} (the fastest solution tagged {BASELINE_TAG!r})"


def solution_figures(latency: pd.DataFrame, baseline: str, hw: HardwareResults) -> pd.DataFrame:
    """One row per solution: passed, speedups, fast_p, win rate, % of speed-of-light, runs, suspicious."""
    total = len(latency.index)
    over_baseline = speedups_over(latency, baseline)
    both = over_baseline.notna().sum()
    figures = pd.DataFrame({
        "passed": latency.notna().sum(),
        "total": total,
        "speedup_vs_reference": geomean(speedups_over(latency, REFERENCE)),
        "speedup_vs_baseline": geomean(over_baseline),
        # Failed, missing and suspicious cells are NaN, and NaN > p is False: never fast.
        **{f"fast_{p}": (over_baseline > p).sum() / total if total else np.nan for p in FAST_P},
        "win_rate": ((over_baseline > 1).sum() / both).where(both > 0),
    })
    per_solution = hw.results.groupby("solution")
    figures["sol_pct"] = hw.results["sol_pct"].where(hw.results["valid"]).groupby(hw.results["solution"]).mean()
    figures["suspicious"] = per_solution["suspicious"].sum()
    figures["runs"] = per_solution["runs"].sum()
    figures["hash"] = per_solution["solution_hash"].last()
    figures["tags"] = per_solution["solution_tags"].last().map(" ".join)
    return figures.rename_axis("solution").reset_index()


def rank(figures: pd.DataFrame) -> pd.DataFrame:
    """Workloads passed (desc), then geomean speedup over the baseline on the workloads both passed (desc)."""
    ordered = figures.sort_values(["passed", "speedup_vs_baseline", "solution"], ascending=[False, False, True],
                                  na_position="last", kind="stable").reset_index(drop=True)
    ordered.insert(0, "rank", range(1, len(ordered) + 1))
    columns = ["rank", "solution", "hash", "tags", "passed", "total", "speedup_vs_reference", "speedup_vs_baseline",
               *[f"fast_{p}" for p in FAST_P], "win_rate", "sol_pct", "suspicious", "runs"]
    return ordered[columns]


def workload_view(latency: pd.DataFrame, hw: HardwareResults, solutions: list[str]) -> pd.DataFrame:
    """Per workload: the floor, the best valid result, and every solution's latency (µs) or why there is none."""
    rows = []
    for uuid in hw.workloads:
        mine = hw.results[hw.results["workload"] == uuid].set_index("solution")
        times = latency.loc[uuid].dropna()
        best = times.idxmin() if not times.empty else None
        floor = mine["floor_ms"].iloc[0]
        row = {"workload": hw.labels[uuid], "floor_us": floor * 1e3,
               "best": best, "best_us": times.min() * 1e3 if best else np.nan,
               "best_sol_pct": mine.loc[best, "sol_pct"] if best else np.nan}
        for solution in solutions:
            row[solution] = _workload_cell(mine.loc[solution] if solution in mine.index else None)
        rows.append(row)
    return pd.DataFrame(rows, columns=[*VIEW_COLUMNS, *solutions])


def _workload_cell(result):
    if result is None:
        return None
    if result["valid"]:
        return result["latency_ms"] * 1e3
    return "SUSPICIOUS" if result["suspicious"] else result["status"]
