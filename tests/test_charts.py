import io

import pytest
from matplotlib.image import imread
from trace_factory import CALIBRATION, make_trace

from flashbench.leaderboard import build_boards, latency_chart, roofline_chart, save_charts, traces_frame

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


def test_charts_without_any_valid_result():
    only_failures = build_boards(traces_frame([make_trace("broken", "w1-aaaaaa", status="TIMEOUT")]))[0]
    picture(latency_chart(only_failures))
    picture(roofline_chart(only_failures))


def test_save_charts(tmp_path):
    paths = save_charts(board(), tmp_path / "charts")
    assert [p.name for p in paths] == ["gpu_x-latency.png", "gpu_x-roofline.png"]
    for path in paths:
        picture(path.read_bytes())
