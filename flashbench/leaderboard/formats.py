"""Boards as text: display tables (formatted strings) for people, CSV and JSON (raw numbers) for programs."""

import json
import math
import re

import pandas as pd

from ..model.trace import printable_line
from .board import FAST_P, VIEW_COLUMNS, Board
from .compare import Comparison

NOT_APPLICABLE = "—"  # where a figure means nothing (the reference's rank, a rate from a host clock): never a 0


def board_title(board: Board) -> str:
    return f"{board.hardware_name} ({board.hardware})"


def ranking_display(board: Board) -> pd.DataFrame:
    """The ranking with speedups as '1.23x', shares as '50%', passed as '3/4', spreads as '±0.5%' and hashes cut
    to 8 digits (marked stale where the folder holds other content now); the reference has no rank."""
    r = board.ranking
    shown = pd.DataFrame({
        "rank": r["rank"].map(lambda n: NOT_APPLICABLE if pd.isna(n) else str(n)), "solution": r["solution"],
        "hash": _hashes(r["hash"], r["stale"]), "tags": r["tags"],
        "passed": r["passed"].astype(str) + "/" + r["total"].astype(str),
        "vs reference": r["speedup_vs_reference"].map(_times),
        f"vs baseline ({board.baseline})": r["speedup_vs_baseline"].map(_times),
        **{f"fast_{p}": r[f"fast_{p}"].map(_share) for p in FAST_P},
        "win rate": r["win_rate"].map(_share),
        "% SOL": r["sol_pct"].map(_percent),
        "spread": r["spread_pct"].map(spread),
        "suspicious": r["suspicious"].map(lambda n: str(n) if n else ""),
        "runs": r["runs"].astype(str),
    })
    return shown


def by_workload_display(board: Board) -> pd.DataFrame:
    """Per workload: floor, best solution, then each solution's µs or status."""
    view = board.by_workload
    shown = pd.DataFrame({
        "workload": view["workload"], "floor µs": view["floor_us"].map(_micro),
        "best": view["best"].fillna(""), "best µs": view["best_us"].map(_micro),
        "best % SOL": view["best_sol_pct"].map(_percent),
    })
    for solution in view.columns[len(VIEW_COLUMNS):]:
        shown[solution] = view[solution].map(lambda v: _micro(v) if isinstance(v, float) else (v or ""))
    return shown


def results_display(board: Board) -> pd.DataFrame:
    """Every ranked result: latency, confidence interval, p10-p90, floor, % of speed-of-light, how it was
    measured, flags and runs."""
    r = board.results.sort_values(["solution", "order"])
    return pd.DataFrame({
        "solution": r["solution"], "hash": _hashes(r["solution_hash"], r["stale"]),
        "workload": r["workload"].map(board.labels),
        "status": r["status"], "µs": r["latency_ms"].map(lambda v: _micro(v * 1e3)),
        "ci µs": _ranges(r["ci_low_ms"], r["ci_high_ms"]), "p10–p90 µs": _ranges(r["p10_ms"], r["p90_ms"]),
        "floor µs": r["floor_ms"].map(lambda v: _micro(v * 1e3)), "% SOL": r["sol_pct"].map(_percent),
        "timing": r["timing_method"].fillna(""), "L2": r["l2_state"].fillna(""), "device": r["device"].fillna(""),
        "suspicious": r["suspicious"].map(lambda s: "under the floor" if s else ""),
        "runs": r["runs"].astype(str), "latest run": r["timestamp"],
    })


def comparison_display(comparison: Comparison) -> pd.DataFrame:
    t = comparison.table
    shown = pd.DataFrame({"workload": t["workload"]})
    for side, name in (("a", comparison.a), ("b", comparison.b)):
        shown[f"{name} µs"] = t[f"{side}_latency_us"].map(_micro)
        shown[f"{name} 95% ci"] = [f"{_micro(lo)}–{_micro(hi)}" if not math.isnan(lo) else ""
                                   for lo, hi in zip(t[f"{side}_ci_low_us"], t[f"{side}_ci_high_us"])]
    shown["speedup"] = t["speedup"].map(_times)
    shown["verdict"] = t["verdict"]
    return shown


def markdown(boards: list[Board], by_workload: bool = False) -> str:
    parts = []
    for board in boards:
        table = by_workload_display(board) if by_workload else ranking_display(board)
        parts += [f"## {markdown_text(board_title(board))}", "", *[f"- {markdown_text(note)}" for note in board.notes],
                  "", markdown_table(table), ""]
    return "\n".join(parts)


def markdown_table(table: pd.DataFrame) -> str:
    """`table` as Markdown, every text cell and column name as text (markdown_text): a board by workload has
    a column per solution, named as its traces say."""
    shown = table.map(lambda cell: markdown_text(cell) if isinstance(cell, str) else cell)
    return shown.rename(columns=lambda name: markdown_text(str(name))).to_markdown(index=False)


def markdown_text(text: str) -> str:
    """Text from a trace (a solution's name, a device's, a message) shown as text in Markdown: one line of
    printable characters, no HTML and no cell break. A trace file, or an imported dataset's, may hold any
    string there: `<img onerror=...>`, a newline and a heading, a terminal's escape sequences, a link's
    `[text](javascript:...)` got through. A backslash is escaped first: one written before a `|` or `[`
    cancelled the escape added after it (`\\[text\\](https://...)` became a live link again)."""
    escaped = printable_line(text).replace("\\", "\\\\")
    escaped = escaped.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    escaped = escaped.replace("|", "\\|").replace("[", "\\[").replace("]", "\\]")
    # GitHub's Markdown makes links of bare `www.`, `http://`, `https://`, `ftp://` and `a@b.c` text (a solution
    # named www.example.com, a device https://...); an escaped dot, colon or at sign is no longer what it looks for
    escaped = re.sub(r"(?i)(www)\.", r"\1\\.", escaped)
    escaped = re.sub(r"(?i)(https?|ftp):", r"\1\\:", escaped)
    return escaped.replace("@", "\\@")


def csv(boards: list[Board], by_workload: bool = False) -> str:
    """One CSV for all boards, told apart by the hardware column."""
    frames = [(b.by_workload if by_workload else b.ranking).assign(hardware=b.hardware, baseline=b.baseline)
              for b in boards]
    return pd.concat(frames, ignore_index=True).to_csv(index=False)


def json_text(boards: list[Board]) -> str:
    """Everything of every board: ranking, per-workload view, results and notes."""
    documents = [{
        "hardware": b.hardware, "hardware_name": b.hardware_name, "baseline": b.baseline, "notes": b.notes,
        "calibration": b.calibration.model_dump(mode="json") if b.calibration else None,
        "ranking": _records(b.ranking), "by_workload": _records(b.by_workload),
        "results": _records(b.results.drop(columns=["time", "order"]).assign(workload_label=b.results["workload"].map(b.labels))),
    } for b in boards]
    return json.dumps(documents, indent=2) + "\n"


def _records(frame: pd.DataFrame) -> list[dict]:
    # pandas writes NaN as null and keeps lists (tags) as lists
    return json.loads(frame.to_json(orient="records"))


def spread(value) -> str:
    return "" if pd.isna(value) else f"±{value:.1f}%"


def _hashes(hashes: pd.Series, stale: pd.Series) -> pd.Series:
    return hashes.str[:8] + stale.map({True: " stale", False: ""})


def _ranges(lows: pd.Series, highs: pd.Series) -> list[str]:
    """'low–high' in µs from bounds in ms; blank without a latency."""
    return [f"{_micro(lo * 1e3)}–{_micro(hi * 1e3)}" if not math.isnan(lo) else "" for lo, hi in zip(lows, highs)]


def _times(value) -> str:
    return "" if pd.isna(value) else f"{value:.3g}x"


def _share(value) -> str:
    return "" if pd.isna(value) else f"{value:.0%}"


def _percent(value) -> str:
    return "" if pd.isna(value) else f"{value:.1f}%"


def _micro(value) -> str:
    if value is None or pd.isna(value):
        return ""
    return f"{value:.1f}" if value >= 1 else f"{value:.3f}"  # plain digits: sortable, no exponents
