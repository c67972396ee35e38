"""flashbench/model/run_report.py: the document `run --json` and `submit --json` print."""

import json
import math
import re
from pathlib import Path

from flashbench.model import OutputError, PairResult, RunReport
from trace_factory import CALIBRATION, make_trace

README = Path(__file__).resolve().parents[1] / "README.md"
METADATA = dict(command="run", definition="d", hardware="GPU X", devices=["cuda:0"], backend="local",
                timing_method="events", isolation="namespaces", interrupted=False, skipped=0)


def test_the_readme_example_is_a_valid_document():
    example = re.search(r"### Results as JSON.*?```json\n(.*?)```", README.read_text(), re.S).group(1)
    document = json.loads(example)
    assert set(document) == set(RunReport.model_fields)  # every field shown, none that does not exist
    assert set(document["results"][0]) == set(PairResult.model_fields)
    RunReport.model_validate(document)


def test_counts_floors_and_the_trace_file():
    traces = [make_trace("reference", "w1", latency_ms=4.0), make_trace("s", "w1", status="TIMEOUT"),
              make_trace("s", "w2", latency_ms=2.0, nbytes=None, flops=None)]
    report = RunReport.from_traces(traces, CALIBRATION, "traces/gpu_x/d.jsonl", **METADATA)
    assert (report.passed, report.failed) == (2, 1)
    timed, timeout, no_cost = report.results
    assert timed.floor_ms == 1.0 and timed.percent_of_floor == 25.0  # 1e9 bytes at 1e12 B/s
    assert timed.timing.method == "events" and timed.timing.latency_ms == 4.0
    assert timeout.timing is None and timeout.floor_ms is None and timeout.speedup is None
    assert no_cost.floor_ms is None and no_cost.percent_of_floor is None
    assert {r.trace_file for r in report.results} == {"traces/gpu_x/d.jsonl"}
    assert report.calibration.memory_bytes_per_s == 1e12


def test_without_a_calibration_there_is_no_floor():
    report = RunReport.from_traces([make_trace("s", "w", latency_ms=1.0)], None, None, **METADATA)
    assert report.calibration is None and report.results[0].floor_ms is None and report.trace_file is None


def test_infinite_errors_stay_valid_json():
    trace = make_trace("s", "w", status="INCORRECT_NUMERICAL").model_copy(update={"correctness": {
        "o": OutputError(max_abs_error=math.inf, max_rel_error=math.nan, mismatch_fraction=1.0)}})
    text = RunReport.from_traces([trace], None, None, **METADATA).model_dump_json()
    errors = json.loads(text)["results"][0]["errors"]["o"]
    assert errors["max_abs_error"] == "Infinity" and errors["max_rel_error"] == "NaN"
    assert math.isinf(RunReport.model_validate_json(text).results[0].errors["o"].max_abs_error)
