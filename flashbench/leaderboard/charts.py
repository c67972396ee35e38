"""PNG charts of a board: latency per workload per solution, and a roofline.

Figures are drawn with matplotlib's Agg canvas directly (no pyplot), so nothing needs a display
and no global plotting state is touched.
"""

import hashlib
import io
from pathlib import Path
from typing import Iterable

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from ..model import REFERENCE
from .board import Board
from .results import HOST_CLOCK

REFERENCE_COLOUR = "#7f7f7f"
# tab20 without its two greys, which are the reference's
PALETTE = [to_hex(c) for c in colormaps["tab20"].colors if to_hex(c) not in (REFERENCE_COLOUR, "#c7c7c7")]


def solution_colours(names: Iterable[str]) -> dict[str, str]:
    """One colour per solution for every chart drawn with this mapping. A name's hash picks its palette slot, so a
    solution keeps its colour on every page; where two names of one mapping want the same slot, the later in
    sorted order takes the next free one (colours repeat only past the palette's 18)."""
    colours = {REFERENCE: REFERENCE_COLOUR}
    taken = set()
    for name in sorted(set(names) - {REFERENCE}):
        slot = int(hashlib.sha256(name.encode()).hexdigest(), 16) % len(PALETTE)
        while PALETTE[slot] in taken and len(taken) < len(PALETTE):
            slot = (slot + 1) % len(PALETTE)
        taken.add(PALETTE[slot])
        colours[name] = PALETTE[slot]
    return colours


def board_colours(boards: Iterable[Board]) -> dict[str, str]:
    """The colours of every solution of these boards: one mapping for all the charts of a page."""
    return solution_colours(name for board in boards for name in board.ranking["solution"])


LEGEND_LABEL_CHARS = 40  # a longer name left no room for the axes: the chart collapsed and other entries fell out


def _plain(*texts) -> None:
    """Names, workloads and devices come from trace files: text, never TeX (a solution named "$\\frac{$" ended
    every chart with matplotlib's parse error). Only those texts: the log axes' tick labels are matplotlib's TeX."""
    for text in texts:
        text.set_parse_math(False)


def _legend(axes, entries: list) -> None:
    """A legend of (artist, label) pairs given explicitly: matplotlib leaves out of a legend it gathers itself every
    label that starts with '_', and a solution may be named so (`_fast`): its bars were drawn, unnamed."""
    if entries:
        labels = [label if len(label) <= LEGEND_LABEL_CHARS else label[:LEGEND_LABEL_CHARS - 1] + "…"
                  for _, label in entries]
        _plain(*axes.legend([artist for artist, _ in entries], labels, fontsize="small").get_texts())


def latency_chart(board: Board, colours: dict[str, str] | None = None) -> bytes:
    """Grouped bars: one group per workload, one bar per solution (valid results only), log scale."""
    view = board.by_workload
    solutions = list(board.ranking["solution"])
    colours = colours or board_colours([board])
    figure, axes = _figure(max(6.0, 2 + 0.3 * len(view) * len(solutions)))
    width = 0.8 / max(1, len(solutions))
    positions = np.arange(len(view))
    legend = []
    for i, solution in enumerate(solutions):
        heights = [v if isinstance(v, float) else np.nan for v in view[solution]]
        legend.append((axes.bar(positions + (i - (len(solutions) - 1) / 2) * width, heights, width,
                                color=colours[solution]), solution))
    if view["floor_us"].notna().any():
        legend.append((axes.scatter(positions, view["floor_us"], marker="_", s=400, color="black", zorder=3), "floor"))
    axes.set_yscale("log")
    axes.set_xticks(positions, view["workload"], rotation=30, ha="right")
    axes.set_ylabel("median latency (µs, log scale)")
    _plain(*axes.get_xticklabels(), axes.set_title(f"Latency per workload on {board.hardware_name}"))
    axes.set_xlabel("workload (no bar: failed, suspicious or not run)")
    _legend(axes, legend)
    return _png(figure)


def roofline_chart(board: Board, colours: dict[str, str] | None = None) -> bytes:
    """Achieved FLOP/s against arithmetic intensity (FLOPs / bytes), under the calibrated roofs. Host-clock
    timings of a CPU run are left out: no rate means anything there."""
    figure, axes = _figure(7.0)
    colours = colours or board_colours([board])
    results = board.results
    points = results[results["valid"] & (results["bytes"] > 0) & (results["flops"] > 0)
                     & (results["timing_method"] != HOST_CLOCK)]
    legend = []
    for solution, mine in points.groupby("solution", sort=False):
        legend.append((axes.scatter(mine["flops"] / mine["bytes"], mine["flops"] / (mine["latency_ms"] / 1e3),
                                    color=colours[solution]), solution))
    calibration = board.calibration
    if calibration is not None:
        ridge = calibration.matmul_flops_per_s / calibration.memory_bytes_per_s
        intensities = points["flops"] / points["bytes"]
        low = min([ridge / 100, *intensities]) / 2
        high = max([ridge * 10, *intensities]) * 2
        x = np.geomspace(low, high, 200)
        [roof] = axes.plot(x, np.minimum(calibration.matmul_flops_per_s, x * calibration.memory_bytes_per_s),
                           color="black")
        legend.append((roof, f"roofs: {calibration.memory_bytes_per_s / 1e9:.0f} GB/s, "
                             f"{calibration.matmul_flops_per_s / 1e12:.1f} TFLOP/s"))
    if points.empty and calibration is None:
        axes.text(0.5, 0.5, "no valid results with a cost model and a device timing", ha="center",
                  transform=axes.transAxes)
    else:
        axes.set_xscale("log")
        axes.set_yscale("log")
        _legend(axes, legend)
    roofs = "" if calibration else " (no calibration: roofs unknown)"
    _plain(axes.set_title(f"Roofline on {board.hardware_name}{roofs}"))
    axes.set_xlabel("arithmetic intensity (FLOPs / byte)")
    axes.set_ylabel("achieved FLOP/s")
    return _png(figure)


def save_charts(board: Board, folder: Path, colours: dict[str, str] | None = None) -> list[Path]:
    """<hardware>-latency.png and <hardware>-roofline.png in folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("latency", latency_chart), ("roofline", roofline_chart)):
        path = folder / f"{board.hardware}-{name}.png"
        path.write_bytes(draw(board, colours))
        written.append(path)
    return written


def _figure(width: float):
    figure = Figure(figsize=(min(width, 16.0), 5.0), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
