"""The HTML page: self-contained, and it renders in a real headless Chromium."""

import io
import re
import shutil
import subprocess

import pytest
from matplotlib.image import imread
from trace_factory import CALIBRATION, make_trace, named

from flashbench.leaderboard import build_boards, html_page, traces_frame

TRACES = [(named if "<" in solution else make_trace)(solution, workload, latency, hardware=hardware, tags=tags)
          for hardware in ("GPU X", "GPU Y")
          for workload in ("w1-aaaaaa", "w2-aaaaaa")
          for solution, latency, tags in (("reference", 8.0, ["reference"]), ("base", 4.0, ["baseline"]),
                                          ("fast <b>", 2.0, []))]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    boards = build_boards(traces_frame(TRACES), calibrations={"gpu_x": CALIBRATION})
    path = tmp_path_factory.mktemp("html") / "leaderboard.html"
    path.write_text(html_page(boards, "d"))
    return path


def test_page_is_self_contained(page):
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text)  # nothing fetched from elsewhere
    assert "<link" not in text and text.count("data:image/png;base64,") == 4
    assert text.count('class="dataframe sortable"') == 6  # ranking, per workload, results; per hardware
    assert "fast &lt;b&gt;" in text and "fast <b>" not in text  # names are escaped


def test_page_states_the_rules(page):
    text = page.read_text()
    assert "not ranked" in text and "tagged smoke check correctness" in text and "stale" in text
    assert text.count("measured with timing events, L2 flushed (256 MiB), device cuda") == 2  # one per hardware


def chromium() -> str:
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if binary is None:
        pytest.skip("no chromium binary found (install Debian's chromium package)")
    return binary


def run_chromium(page, profile, *args) -> subprocess.CompletedProcess:
    command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_renders_in_headless_chromium(page, tmp_path):
    shot = tmp_path / "shot.png"
    result = run_chromium(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.is_file(), result.stderr[-2000:]
    pixels = imread(io.BytesIO(shot.read_bytes()))
    assert pixels.shape[:2] == (900, 1200)
    assert pixels.std() > 0.05 and shot.stat().st_size > 20_000  # text, tables and charts, not a blank page


def test_sorting_script_runs(page, tmp_path):
    result = run_chromium(page, tmp_path / "profile", "--dump-dom")
    assert result.stdout.count('data-sort-ready="yes"') == 6, result.stderr[-2000:]
