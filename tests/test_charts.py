import io

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread
from trace_factory import CALIBRATION, make_trace, named

from flashbench.leaderboard import (board_colours, build_boards, latency_chart, roofline_chart, save_charts,
                                    solution_colours, traces_frame)
from flashbench.leaderboard import charts
from flashbench.leaderboard.charts import PALETTE

TRACES = [make_trace(solution, workload, latency, nbytes=nbytes, flops=flops)
          for workload, nbytes, flops in (("w1-aaaaaa", 1e9, 1e9), ("w2-aaaaaa", 1e8, 1e12))
          for solution, latency in (("reference", 8.0), ("fast", 2.0))]
TRACES.append(make_trace("broken", "w1-aaaaaa", status="RUNTIME_ERROR"))


def board(calibrated=True):
    return build_boards(traces_frame(TRACES), calibrations={"gpu_x": CALIBRATION} if calibrated else None)[0]


def picture(png: bytes):
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    pixels = imread(io.BytesIO(png))
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500
    assert pixels.std() > 0.05  # something is drawn, not a blank canvas
    return pixels


@pytest.mark.parametrize("calibrated", [True, False])
def test_latency_chart(calibrated):
    picture(latency_chart(board(calibrated)))


@pytest.mark.parametrize("calibrated", [True, False])
def test_roofline_chart(calibrated):
    picture(roofline_chart(board(calibrated)))


@pytest.mark.parametrize("chart", [latency_chart, roofline_chart])
def test_names_from_traces_are_drawn_as_text_not_tex(chart):
    """A solution named "$\\frac{$" ended every chart (and so every HTML board) with matplotlib's TeX parser."""
    traces = [make_trace("reference", workload, 8.0) for workload in ("w1-aaaaaa", "w2-aaaaaa")]
    traces += [named("$\\frac{$", workload, 2.0) for workload in ("w1-aaaaaa", "w2-aaaaaa")]
    picture(chart(build_boards(traces_frame(traces), calibrations={"gpu_x": CALIBRATION})[0]))


@pytest.mark.parametrize("chart", [latency_chart, roofline_chart])
def test_only_names_are_plain_text_the_log_axes_keep_their_powers_of_ten(chart, monkeypatch):
    """Turning TeX off for the whole figure showed every log axis's ticks as `$\\mathdefault{10^{3}}$`; a name of
    600 characters left the axes no room, and the other legend entries fell out."""
    figures = []
    monkeypatch.setattr(charts, "_png", lambda figure: figures.append(figure) or b"")
    long_name = "x" * 600
    traces = [make_trace("reference", workload, 8.0) for workload in ("w1-aaaaaa", "w2-aaaaaa")]
    traces += [named(long_name, workload, 2.0) for workload in ("w1-aaaaaa", "w2-aaaaaa")]
    chart(build_boards(traces_frame(traces), calibrations={"gpu_x": CALIBRATION})[0])
    (axes,) = figures[0].axes
    figures[0].canvas.draw()
    assert all(label.get_parse_math() for label in axes.get_yticklabels())
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert not any(text.get_parse_math() for text in axes.get_legend().get_texts())
    assert long_name[:10] in legend[-2 if chart is roofline_chart else 1] and max(map(len, legend)) <= 60
    assert "reference" in legend


def test_charts_without_any_valid_result():
    only_failures = build_boards(traces_frame([make_trace("broken", "w1-aaaaaa", status="TIMEOUT")]))[0]
    picture(latency_chart(only_failures))
    picture(roofline_chart(only_failures))


def test_save_charts(tmp_path):
    paths = save_charts(board(), tmp_path / "charts")
    assert [p.name for p in paths] == ["gpu_x-latency.png", "gpu_x-roofline.png"]
    for path in paths:
        picture(path.read_bytes())


def has_colour(png: bytes, colour: str) -> bool:
    pixels = imread(io.BytesIO(png))[..., :3]
    return bool((np.abs(pixels - np.array(to_rgb(colour))).max(axis=-1) < 1 / 255).any())


def test_one_colour_per_solution_in_every_chart_and_page():
    mine, other = board(), build_boards(traces_frame([make_trace(s, "w1-aaaaaa", 2.0) for s in ("zeta", "fast")]))[0]
    page = board_colours([mine, other])
    assert page["fast"] == board_colours([mine])["fast"] == board_colours([other])["fast"]
    for chart in (latency_chart, roofline_chart):
        assert has_colour(chart(mine, page), page["fast"]) and has_colour(chart(other, page), page["fast"])
        assert has_colour(chart(mine, page), page["reference"])


def test_colours_are_distinct_while_the_palette_lasts():
    names = ["reference", *(f"solution_{i}" for i in range(len(PALETTE)))]
    assert len(set(solution_colours(names).values())) == len(names)
    assert solution_colours(names) == solution_colours(reversed(names))  # the order they come in does not matter


def test_host_clock_timings_are_not_on_the_roofline():
    on_cpu = [make_trace("fast", "w1-aaaaaa", 2.0, timing={"method": "host clock", "l2_flush_bytes": 0}, device="cpu")]
    cpu_board = build_boards(traces_frame(on_cpu))[0]
    colour = board_colours([cpu_board])["fast"]
    assert has_colour(latency_chart(cpu_board), colour) and not has_colour(roofline_chart(cpu_board), colour)


def test_a_name_starting_with_an_underscore_is_in_the_legend(monkeypatch):
    """matplotlib leaves labels starting with '_' out of a legend it gathers itself: a solution named `_fast` had
    its bars drawn and no name beside them."""
    figures = []
    monkeypatch.setattr(charts, "_png", lambda figure: figures.append(figure) or b"")
    traces = [make_trace("reference", "w1-aaaaaa", 8.0), make_trace("_fast", "w1-aaaaaa", 2.0)]
    [board] = build_boards(traces_frame(traces), calibrations={"gpu_x": CALIBRATION})
    latency_chart(board)
    roofline_chart(board)
    seen = [[text.get_text() for text in figure.axes[0].get_legend().get_texts()] for figure in figures]
    assert all("_fast" in labels for labels in seen) and len(seen) == 2
