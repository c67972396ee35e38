"""One leaderboard per hardware: per-solution figures over the workloads, ranked, and a per-workload view."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import pandas as pd

from ..calibrate import load_calibration
from ..errors import FlashbenchError
from ..model import REFERENCE, Calibration, Workload
from .results import current_results, mark_stale, read_results, with_speed_of_light

BASELINE_TAG = "baseline"
FAST_P = (1.0, 1.5, 2.0)
# Workloads with any of these tags check correctness: too small for their latency to say how fast a kernel is.
UNTIMED_TAGS = frozenset({"smoke"})
MEASUREMENT = {"timing_method": "timing", "l2_state": "L2", "device": "device"}  # column -> label in the legend
VIEW_COLUMNS = ["workload", "floor_us", "best", "best_us", "best_sol_pct"]  # then one column per solution


@dataclass
class HardwareResults:
    """The ranked results of one hardware: current content hashes only, with speed-of-light columns."""

    hardware: str
    hardware_name: str
    results: pd.DataFrame
    workloads: list[str]  # uuids, in workload-set order: the denominator of passed
    timed: list[str]  # the workloads whose latencies count (speedups, fast_p, win rate, % SOL, spread)
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
    labels: dict[str, str]  # every workload of the board, uuid -> label, in workload-set order
    timed: list[str]  # the uuids whose latencies count in the figures
    calibration: Calibration | None
    notes: list[str] = field(default_factory=list)


def is_timed(workload: Workload, include_smoke: bool = False) -> bool:
    """Whether a workload's latencies count in a board's figures: the one place that decides it."""
    return include_smoke or not UNTIMED_TAGS & set(workload.tags)


def split_by_hardware(frame: pd.DataFrame, workloads: list[Workload] | None = None,
                      calibrations: Mapping[str, Calibration | None] | None = None,
                      include_smoke: bool = False) -> Iterator[HardwareResults]:
    """Current results per hardware folder. With a workload set, results of workloads outside it are dropped
    and its tags say which workloads are timed; without one, every workload is."""
    results = current_results(frame)
    if workloads is not None:
        results = results[results["workload"].isin([w.uuid for w in workloads])]
    for hardware, mine in results.groupby("hardware", sort=True):
        calibration = (calibrations or {}).get(hardware)
        ran = set(mine["workload"])
        if workloads is not None:
            order = [w.uuid for w in workloads if w.uuid in ran]
            timed = [w.uuid for w in workloads if w.uuid in ran and is_timed(w, include_smoke)]
            labels = {w.uuid: w.label for w in workloads}
        else:
            order = timed = list(dict.fromkeys(mine["workload"]))
            labels = {row.workload: row.workload_name or row.workload[:8] for row in mine.itertuples()}
        yield HardwareResults(hardware, mine["hardware_name"].iloc[-1], with_speed_of_light(mine, calibration),
                              order, timed, {uuid: labels[uuid] for uuid in order}, calibration)


def build_boards(frame: pd.DataFrame, workloads: list[Workload] | None = None, baseline: str | None = None,
                 calibrations: Mapping[str, Calibration | None] | None = None, *, include_smoke: bool = False,
                 current_hashes: Mapping[str, str] | None = None, hide_stale: bool = False) -> list[Board]:
    """current_hashes (solution name -> content hash of its folder now) marks stale results; hide_stale drops them."""
    frame = mark_stale(frame, current_hashes)
    if hide_stale:
        frame = frame[~frame["stale"]]
    return [build_board(hw, baseline) for hw in split_by_hardware(frame, workloads, calibrations, include_smoke)]


def leaderboards(trace_dir: Path, definition: str, workloads: list[Workload] | None = None,
                 hardware: str | None = None, baseline: str | None = None, timing: str = "events", *,
                 include_smoke: bool = False, current_hashes: Mapping[str, str] | None = None,
                 hide_stale: bool = False, isolation: str | None = None) -> list[Board]:
    """Boards from the traces of one timing method under traces/<hardware>/, each with that folder's
    calibration.json; with `isolation`, only results whose worker ran at that level."""
    frame = read_results(trace_dir, definition, hardware, timing, isolation)
    return build_boards(frame, workloads, baseline, calibrations_for(trace_dir, frame), include_smoke=include_smoke,
                        current_hashes=current_hashes, hide_stale=hide_stale)


def calibrations_for(trace_dir: Path, frame: pd.DataFrame) -> dict[str, Calibration | None]:
    return {hardware: load_calibration(trace_dir, hardware) for hardware in frame["hardware"].unique()}


def build_board(hw: HardwareResults, baseline: str | None = None) -> Board:
    latency = latency_matrix(hw)
    tags = hw.results.sort_values("order").groupby("solution")["solution_tags"].last().to_dict()
    chosen, reason = choose_baseline(latency, tags, baseline, hw)
    notes = [reason, f"measured with {measurement_note(hw.results)}"]
    ranking = rank(solution_figures(latency, chosen, hw))
    notes += legend(hw, ranking)
    for row in hw.results[hw.results["suspicious"]].itertuples():
        notes.append(f"{row.solution} on {hw.labels[row.workload]}: {row.latency_ms * 1e3:.1f} µs is under the "
                     f"speed-of-light floor of {row.floor_ms * 1e3:.1f} µs; counted as not passed")
    if hw.calibration is None:
        notes.append("no calibration for this hardware: floor and % of speed-of-light are blank "
                     "(run `flashbench calibrate` on it)")
    by_workload = workload_view(latency, hw, list(ranking["solution"]))
    return Board(hw.hardware, hw.hardware_name, chosen, ranking, by_workload, hw.results, hw.labels, hw.timed,
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
                    hw: HardwareResults) -> tuple[str, str]:
    """The baseline and a note on why it was chosen."""
    if requested:
        if requested not in latency.columns:
            raise FlashbenchError(f"no results of {requested!r} on {hw.hardware}; solutions: {', '.join(latency.columns)}",
                                  field="--baseline")
        return requested, f"baseline: {requested} (as asked)"
    tagged = [s for s in latency.columns if s != REFERENCE and BASELINE_TAG in tags.get(s, [])]
    # A tag is the manifest's own word: only the repository grants the role, to the content its folder holds
    # now. A folder run from elsewhere, or an older content, tagged so is passed over (and said so).
    granted = set(hw.results.loc[hw.results["in_repository"], "solution"])
    passed_over = [s for s in tagged if s not in granted]
    tagged = [s for s in tagged if s in granted]
    passed = latency[tagged].notna().sum()
    tagged = [s for s in tagged if passed[s] > 0]
    unless = (f"; tagged {BASELINE_TAG!r} but not the content of the repository's folder of that name: "
              f"{', '.join(passed_over)}") if passed_over else ""
    if not tagged:
        return REFERENCE, (f"baseline: {REFERENCE} (no repository solution tagged {BASELINE_TAG!r} passed a "
                           f"workload{unless})")
    # The fastest: most workloads passed, then the highest geomean speedup over the reference where timed.
    over_reference = geomean(speedups_over(latency.loc[hw.timed], REFERENCE)[tagged]).fillna(-np.inf)
    fastest = max(tagged, key=lambda s: (passed[s], over_reference[s], s))
    return fastest, f"baseline: {fastest} (the fastest solution tagged {BASELINE_TAG!r}{unless})"


def solution_figures(latency: pd.DataFrame, baseline: str, hw: HardwareResults) -> pd.DataFrame:
    """One row per solution: passed (of every workload); speedups, fast_p, win rate, % of speed-of-light and
    spread (of the timed ones); runs, suspicious, stale."""
    timed = latency.loc[hw.timed]
    over_baseline = speedups_over(timed, baseline)
    both = over_baseline.notna().sum()
    figures = pd.DataFrame({
        "passed": latency.notna().sum(),
        "total": len(latency.index),
        "speedup_vs_reference": geomean(speedups_over(timed, REFERENCE)),
        "speedup_vs_baseline": geomean(over_baseline),
        # Failed, missing and suspicious cells are NaN, and NaN > p is False: never fast.
        **{f"fast_{p}": (over_baseline > p).sum() / len(timed.index) if len(timed.index) else np.nan for p in FAST_P},
        "win_rate": ((over_baseline > 1).sum() / both).where(both > 0),
    })
    results = hw.results
    counted = results[results["valid"] & results["workload"].isin(hw.timed)].groupby("solution")
    figures["sol_pct"] = counted["sol_pct"].mean()
    figures["spread_pct"] = counted["spread_pct"].median()
    per_solution = results.groupby("solution")
    figures["suspicious"] = per_solution["suspicious"].sum()
    figures["runs"] = per_solution["runs"].sum()
    figures["hash"] = per_solution["solution_hash"].last()
    figures["tags"] = per_solution["solution_tags"].last().map(" ".join)
    figures["stale"] = per_solution["stale"].any()
    return figures.rename_axis("solution").reset_index()


def rank(figures: pd.DataFrame) -> pd.DataFrame:
    """The reference first, unranked: it is the denominator, not a competitor. Then the others by workloads
    passed (desc), then by geomean speedup over the baseline on the timed workloads both passed (desc)."""
    reference = figures[figures["solution"] == REFERENCE]
    others = figures[figures["solution"] != REFERENCE].sort_values(
        ["passed", "speedup_vs_baseline", "solution"], ascending=[False, False, True], na_position="last", kind="stable")
    ordered = pd.concat([reference, others], ignore_index=True)
    ordered.insert(0, "rank", pd.array([pd.NA] * len(reference) + list(range(1, len(others) + 1)), dtype="Int64"))
    columns = ["rank", "solution", "hash", "stale", "tags", "passed", "total", "speedup_vs_reference",
               "speedup_vs_baseline", *[f"fast_{p}" for p in FAST_P], "win_rate", "sol_pct", "spread_pct",
               "suspicious", "runs"]
    return ordered[columns]


def measurement_note(results: pd.DataFrame) -> str:
    """How the results were measured: each field's most common value, and the solutions measured otherwise
    (e.g. the reference under graph replay, which is timed with events)."""
    measured = results[results["latency_ms"].notna()]  # a failed run records no timing
    parts = []
    for column, label in MEASUREMENT.items():
        per_solution = measured.groupby("solution", sort=False)[column].agg(
            lambda values: "/".join(sorted(set(values.dropna()))) or "not recorded")
        common = per_solution.value_counts().index[0] if len(per_solution) else "not recorded"
        others = [f"{solution}: {value}" for solution, value in per_solution.items() if value != common]
        parts.append(f"{label} {common}" + (f" ({'; '.join(others)})" if others else ""))
    return ", ".join(parts)


def legend(hw: HardwareResults, ranking: pd.DataFrame) -> list[str]:
    """The rules a reader of this board needs, where they apply to it."""
    lines = []
    if REFERENCE in set(ranking["solution"]):
        lines.append(f"{REFERENCE}: the denominator of 'vs reference', listed first and not ranked")
    untimed = len(hw.workloads) - len(hw.timed)
    if untimed:
        tags = " or ".join(sorted(UNTIMED_TAGS))
        lines.append(f"{untimed} of {len(hw.workloads)} workloads tagged {tags} check correctness only: counted in "
                     "passed/total, left out of speedups, fast_p, win rate, % SOL and spread (--include-smoke "
                     "counts them)")
    lines.append("spread: half the 95% confidence interval of the median, in % of it; per solution the median over "
                 "its valid timed results")
    stale = list(ranking.loc[ranking["stale"], "solution"])
    if stale:
        lines.append(f"stale: {', '.join(stale)} (measured other content than the solution folder holds now: the "
                     "content hash differs; --hide-stale leaves such results out)")
    return lines


def workload_view(latency: pd.DataFrame, hw: HardwareResults, solutions: list[str]) -> pd.DataFrame:
    """Per workload: the floor, the best valid result of a competitor (not the reference), and every solution's
    latency (µs) or why there is none."""
    rows = []
    for uuid in hw.workloads:
        mine = hw.results[hw.results["workload"] == uuid].set_index("solution")
        times = latency.loc[uuid].drop(REFERENCE, errors="ignore").dropna()
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
