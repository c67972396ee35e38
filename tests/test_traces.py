"""Trace files (flashbench/traces.py): what a recorded trace holds, torn lines, odd characters, and
refusing an unwritable trace directory before any work starts."""

import fcntl
import json
import math
import os
from pathlib import Path

import pytest

from flashbench import FlashbenchError, Repo
from flashbench.build import HASH_LENGTH
from flashbench.model import OutputError, Trace
from flashbench.model.trace import printable_line, printable_lines
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads
from flashbench.model import loading
from flashbench import traces
from flashbench.traces import append_trace, check_writable, hardware_slug, read_traces, sole_writer, trace_path

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION

TRACE_KEYS = {"definition", "workload", "solution", "solution_hash", "author", "hardware", "status", "message",
              "log", "correctness", "performance", "environment", "timestamp"}
PERFORMANCE_KEYS = {"latency_ms", "mean_ms", "std_ms", "min_ms", "p10_ms", "p90_ms", "samples", "ci_low_ms",
                    "ci_high_ms", "reference_latency_ms", "speedup", "timing"}


@pytest.fixture(scope="module")
def recorded(repo_copy, shared_cache, tmp_path_factory):
    """The reference, a correct and a wrong solution on one smoke workload, saved to a trace file."""
    repo = Repo(repo_copy)
    options = RunOptions(device="cpu", iters=2, warmup=0, timeout=30, trace_dir=tmp_path_factory.mktemp("traces"),
                         cache_dir=shared_cache)
    runner = Runner(repo, DEFINITION, options)
    folders = select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps"), str(FIXTURES / "wrong_values")])
    result = runner.run(runner.candidates(folders), select_workloads(repo, DEFINITION, ["smoke_mixed"], "cpu"))
    lines = result.trace_file.read_text().splitlines()
    return result, [json.loads(line) for line in lines]


def test_one_line_per_pair_in_the_hardware_folder(recorded, repo_copy):
    result, records = recorded
    assert [(r["solution"], r["status"]) for r in records] == [
        ("reference", "PASSED"), ("correct_dps", "PASSED"), ("wrong_values", "INCORRECT_NUMERICAL")]
    assert result.trace_file.name == f"{DEFINITION}.jsonl"
    assert result.trace_file.parent.name == hardware_slug(records[0]["hardware"])
    assert not (repo_copy / "traces").exists() and not (repo_copy / ".flashbench-cache").exists()


def test_trace_keys(recorded):
    _, records = recorded
    for record in records:
        assert TRACE_KEYS <= set(record), TRACE_KEYS - set(record)
        assert record["definition"] == DEFINITION
        assert record["workload"] == "810323f4-6465-4c15-a87f-4d0946faba69" and record["workload_name"] == "smoke_mixed"
        assert len(record["solution_hash"]) == HASH_LENGTH
        assert record["hardware"] == record["environment"]["hardware"]
        assert record["environment"]["device"] == "cpu" and record["environment"]["torch"]
        assert record["timestamp"].endswith("+00:00")
    reference, correct, wrong = records
    assert reference["author"] == "flashbench" and correct["author"] == "tests" and wrong["author"] == "tests"


def test_correctness_per_output(recorded):
    _, records = recorded
    for record in records:
        assert set(record["correctness"]) == {"output", "lse"}
        for stats in record["correctness"].values():
            assert set(stats) == {"max_abs_error", "max_rel_error", "mismatch_fraction"}
    correct, wrong = records[1], records[2]
    assert correct["correctness"]["output"]["mismatch_fraction"] == 0.0
    assert wrong["correctness"]["output"]["mismatch_fraction"] == 1.0
    assert wrong["correctness"]["output"]["max_abs_error"] == pytest.approx(0.5, abs=0.02)
    assert "output output" in wrong["message"] and wrong["log"] is not None


def test_performance(recorded):
    _, records = recorded
    reference, correct, wrong = records
    for record in (reference, correct):
        perf = record["performance"]
        assert PERFORMANCE_KEYS <= set(perf), PERFORMANCE_KEYS - set(perf)
        assert perf["samples"] >= 2  # batches of the judge's clock, or calls of the worker's: whichever is ranked
        # The judge's per-call figure of a batch (its time less the harness's steps) can be 0 on a
        # loaded host; the ranked median is the larger clock's and never 0.
        assert 0 <= perf["min_ms"] <= perf["p10_ms"] <= perf["latency_ms"] <= perf["p90_ms"]
        assert perf["latency_ms"] > 0
        assert perf["ci_low_ms"] <= perf["latency_ms"] <= perf["ci_high_ms"]
        assert perf["timing"]["method"] == "host clock" and perf["timing"]["iters"] == 2
        assert perf["timing"]["warmup"] == 0 and perf["timing"]["input_sets"] == 3
        assert perf["bytes"] > 0 and perf["flops"] > 0
        assert perf["reference_latency_ms"] == reference["performance"]["latency_ms"]
        assert perf["speedup"] == pytest.approx(perf["reference_latency_ms"] / perf["latency_ms"])
        assert record["log"] == ""
    assert reference["performance"]["speedup"] == 1.0
    assert wrong["performance"] is None  # a wrong solution is never timed


def test_recorded_traces_read_back(recorded):
    result, records = recorded
    traces = read_traces(result.trace_file)
    assert [t.solution for t in traces] == [r["solution"] for r in records]
    assert traces[2].correctness["output"].mismatch_fraction == 1.0


def make_trace(i: int, **fields) -> Trace:
    values = dict(definition=DEFINITION, workload=f"w{i}", solution="s", solution_hash="0" * 16, author="tests",
                  hardware="CPU x86_64", status="PASSED", timestamp="2025-01-01T00:00:00+00:00")
    values.update(fields)
    return Trace(**values)


@pytest.mark.parametrize("field, value", [
    ("solution_tags", ["x|y"]), ("author", "a\nb"), ("hardware", "NVIDIA H200 | fake"), ("workload_name", "x|\n## y"),
    # a name no manifest can give: an escape sequence reached the terminal through a board's notes, HTML and a
    # heading `report`'s Markdown; a zero-width space or a Cyrillic 'о' made a row look like another solution's
    ("solution", "x\x1b]0;title\x1b\\"), ("solution", "x<img src=x onerror=alert(1)>\n# y"),
    ("solution", "torch_vectorized\u200b"), ("solution", "t\u043erch_vectorized"), ("definition", "d\x1b[2J"),
    # format characters reverse, hide or isolate what follows; a GPU's name in other letters is another's look-alike
    ("author", "flashbench\u202e"), ("author", "flash\u2066bench"), ("hardware", "NVIDIA H200\u200b"),
    ("hardware", "NVIDIA \u041d200")])
def test_a_record_whose_labels_carry_markup_is_not_a_trace(tmp_path, capsys, field, value):
    """Imported or hand-written trace files reach boards too: such a line is skipped with a warning."""
    path = trace_path(tmp_path, "CPU x86_64", DEFINITION)
    append_trace(path, make_trace(0))
    with open(path, "a") as handle:
        handle.write(json.dumps(make_trace(1).model_dump() | {field: value}) + "\n")
    assert [t.workload for t in read_traces(path)] == ["w0"]
    assert "line 2 is not a valid trace" in capsys.readouterr().err


def test_torn_last_line_is_skipped_and_the_next_append_starts_a_fresh_line(tmp_path, capsys):
    path = trace_path(tmp_path, "CPU x86_64", DEFINITION)
    for i in range(3):
        append_trace(path, make_trace(i))
    whole = make_trace(3).model_dump_json().encode()
    with open(path, "ab") as handle:
        handle.write(whole[: len(whole) // 2])  # a record cut off mid-write
    assert [t.workload for t in read_traces(path)] == ["w0", "w1", "w2"]
    assert "line 4 is not a valid trace" in capsys.readouterr().err
    append_trace(path, make_trace(4))
    lines = path.read_bytes().split(b"\n")
    assert lines[3] == whole[: len(whole) // 2] and lines[-1] == b""
    assert json.loads(lines[4])["workload"] == "w4"
    assert [t.workload for t in read_traces(path)] == ["w0", "w1", "w2", "w4"]


def test_a_line_longer_than_a_record_may_be_is_skipped_unread(tmp_path, capsys, monkeypatch):
    """Trace files may be imported from anyone: one line of gigabytes was read whole."""
    monkeypatch.setattr(loading, "MAX_RECORD_BYTES", 4096)
    path = trace_path(tmp_path, "CPU x86_64", DEFINITION)
    append_trace(path, make_trace(0))
    append_trace(path, make_trace(1, status="RUNTIME_ERROR", log="x" * 10000))
    append_trace(path, make_trace(2))
    assert [t.workload for t in read_traces(path)] == ["w0", "w2"]
    assert "line 2 is not a valid trace" in capsys.readouterr().err


def test_torn_line_inside_a_multibyte_character(tmp_path):
    path = tmp_path / "t.jsonl"
    append_trace(path, make_trace(0))
    whole = make_trace(1, message="latency 3.0 µs").model_dump_json().encode()
    cut = whole.index("µ".encode()) + 1  # between the two bytes of µ
    with open(path, "ab") as handle:
        handle.write(whole[:cut])
    assert [t.workload for t in read_traces(path)] == ["w0"]


@pytest.mark.parametrize("text", ["a\u2028b", "a\u2029b", "a\x85b", "a\x0cb\x0bc\x1cd", "a\rb", "µs → ✓"])
def test_unusual_characters_in_a_log_round_trip(tmp_path, text):
    """Logs are whatever a solution printed: they must never split or spoil a record."""
    path = tmp_path / "t.jsonl"
    append_trace(path, make_trace(0, status="RUNTIME_ERROR", message=text, log=text * 3))
    append_trace(path, make_trace(1))
    traces = read_traces(path)
    assert [t.workload for t in traces] == ["w0", "w1"]
    assert traces[0].log == printable_lines(text * 3)  # printable lines (below)
    assert traces[0].message == printable_line(text)  # the message is one printable line (below)


def test_infinite_and_nan_errors_round_trip(tmp_path):
    path = tmp_path / "t.jsonl"
    errors = {"output": OutputError(max_abs_error=math.inf, max_rel_error=math.nan, mismatch_fraction=0.5)}
    append_trace(path, make_trace(0, status="INCORRECT_NUMERICAL", correctness=errors))
    json.loads(path.read_text())  # still valid JSON
    (trace,) = read_traces(path)
    assert trace.correctness["output"].max_abs_error == math.inf and math.isnan(trace.correctness["output"].max_rel_error)


def test_read_traces_of_a_missing_file(tmp_path):
    assert read_traces(tmp_path / "none.jsonl") == []


def test_reading_reads_no_link_no_fifo_no_folder_that_is_a_link_and_no_huge_file(tmp_path, capsys):
    """Every board read a trace directory's files as they came: a link to /proc/kmsg blocked them for ever, one to
    /proc/self/pagemap read 256 GiB, and so would a hardware folder that is a link, or a sparse file. Each is one
    line on stderr, and no records; a plain file beside them reads as before."""
    folder = tmp_path / "traces" / "cpu"
    folder.mkdir(parents=True)
    honest = folder / "honest.jsonl"
    append_trace(honest, make_trace(0))
    (folder / "pagemap.jsonl").symlink_to("/proc/self/pagemap")
    os.mkfifo(folder / "fifo.jsonl")
    with open(folder / "sparse.jsonl", "wb") as sparse:
        sparse.truncate(traces.MAX_TRACE_FILE_BYTES + 1)
    (tmp_path / "traces" / "linked").symlink_to(folder)
    for path, why in ((folder / "pagemap.jsonl", "it is a link"), (folder / "fifo.jsonl", "it is not a plain file"),
                      (folder / "sparse.jsonl", "over the 1 GiB a trace file may hold"),
                      (tmp_path / "traces" / "linked" / "honest.jsonl", "its folder is a link")):
        assert read_traces(path) == []
        (line,) = capsys.readouterr().err.splitlines()
        assert why in line and str(path) in line
    assert len(read_traces(honest)) == 1


def test_check_writable_creates_the_folder(tmp_path):
    path = tmp_path / "a" / "b" / "x.jsonl"
    check_writable(path, tmp_path)
    assert path.parent.is_dir()


def test_a_trace_file_that_is_a_link_a_fifo_or_under_a_link_out_is_refused_at_once(tmp_path):
    """A committed link as a trace file led every run's records into a file of the user's (and one to /dev/zero
    read memory without end); a FIFO hung the run while it held the trace directory's lock; a hardware folder
    that is a link out of the trace directory was written through."""
    victim = tmp_path / "notes.txt"
    victim.write_text("important line\n")
    traces = tmp_path / "traces"
    (traces / "cpu").mkdir(parents=True)
    (traces / "cpu" / "x.jsonl").symlink_to(victim)
    os.mkfifo(traces / "cpu" / "y.jsonl")
    (traces / "elsewhere").symlink_to(tmp_path)
    (traces / "inside").symlink_to(traces / "cpu")  # read_traces reads nothing there: no record is written there
    for name, why in (("cpu/x.jsonl", "it is a link"), ("cpu/y.jsonl", "not a plain file"),
                      ("elsewhere/z.jsonl", "leads out of"), ("inside/z.jsonl", "its folder is a link")):
        with pytest.raises(FlashbenchError, match=why) as refused:
            check_writable(traces / name, traces)
        assert "\n" not in str(refused.value)
    with pytest.raises(FlashbenchError, match="it is a link"):
        append_trace(traces / "cpu" / "x.jsonl", make_trace(0))
    assert victim.read_text() == "important line\n"
    (tmp_path / "committed").symlink_to(traces)  # a repository's `traces` committed as a link: records left it
    with pytest.raises(FlashbenchError, match="the trace directory is a link"):
        check_writable(tmp_path / "committed" / "cpu" / "w.jsonl", tmp_path / "committed")


def test_check_writable_refuses_an_unwritable_directory(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: make the folder impossible instead
        blocker = tmp_path / "a_file"
        blocker.write_text("")
        path = blocker / "cpu" / "x.jsonl"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        path = locked / "cpu" / "x.jsonl"
    try:
        with pytest.raises(FlashbenchError, match="cannot write traces") as info:
            check_writable(path, tmp_path)
        assert str(path) in str(info.value)
    finally:
        if os.geteuid() != 0:
            (tmp_path / "locked").chmod(0o700)


def test_runner_refuses_an_unwritable_trace_dir_before_any_work(repo_copy, shared_cache, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    repo = Repo(repo_copy)
    options = RunOptions(device="cpu", iters=2, warmup=0, timeout=30, trace_dir=blocker, cache_dir=shared_cache)
    runner = Runner(repo, DEFINITION, options)
    seen = []
    runner.on_result = seen.append
    with pytest.raises(FlashbenchError, match="cannot write traces"):
        runner.run(runner.candidates([]), select_workloads(repo, DEFINITION, [], "cpu"))
    assert seen == []


def test_each_timing_method_has_its_own_file(tmp_path):
    assert trace_path(tmp_path, "GPU X", "d") == tmp_path / "gpu_x" / "d.jsonl"
    assert trace_path(tmp_path, "GPU X", "d", "graph") == tmp_path / "gpu_x" / "d.graph.jsonl"
    with pytest.raises(FlashbenchError, match="no timing method 'wall'"):
        trace_path(tmp_path, "GPU X", "d", "wall")


def test_graph_timing_on_a_cpu_is_refused_before_any_work(repo_copy, shared_cache, tmp_path):
    options = RunOptions(device="cpu", timing="graph", trace_dir=tmp_path, cache_dir=shared_cache)
    with pytest.raises(FlashbenchError, match="needs a CUDA device"):
        Runner(Repo(repo_copy), DEFINITION, options)
    assert not any(tmp_path.iterdir())


def test_a_trace_message_is_one_printable_line():
    """A solution's exception text reaches the message: escape sequences (window title, clipboard, erased
    lines) must not reach the operator's terminal, nor the published trace."""
    trace = make_trace(0, status="RUNTIME_ERROR")
    forged = Trace.model_validate({**trace.model_dump(), "message": "Error\x1b]52;c;ZXZpbA==\x07\x1b[2K\nnext\tline"})
    assert forged.message == "Error?]52;c;ZXZpbA==??[2K next line" and forged.message.isprintable()
    assert Trace.model_validate({**trace.model_dump(), "message": "µs — ok"}).message == "µs — ok"


def test_a_trace_log_keeps_its_lines_but_no_control_character():
    """The log is the worker's output: kept as lines (a traceback stays readable), but a published trace printed
    raw (`jq -r .log`, FlashInfer-Bench's evaluation log) must not set a terminal's title or clipboard."""
    trace = make_trace(0, status="RUNTIME_ERROR")
    log = "Traceback:\r\n\tline 1\n\x1b]52;c;ZXZpbA==\x07\x1b]0;pwned\x07\rreference PASSED\u202e"
    forged = Trace.model_validate({**trace.model_dump(), "log": log})
    assert forged.log == "Traceback:\n\tline 1\n?]52;c;ZXZpbA==??]0;pwned?\nreference PASSED?"
    assert Trace.model_validate({**trace.model_dump(), "log": "µs — ok\n\tx"}).log == "µs — ok\n\tx"


def test_a_record_the_disk_cannot_take_leaves_the_file_as_it_was_and_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    append_trace(path, make_trace(0))
    before = path.read_bytes()
    write = os.write

    def full_disk(fd, data):  # a part goes in, then the disk is full
        if len(data) > 8:
            return write(fd, data[:8])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("flashbench.traces.os.write", full_disk)
    with pytest.raises(FlashbenchError) as failed:
        append_trace(path, make_trace(1))
    assert "No space left on device" in str(failed.value) and "\n" not in str(failed.value)
    assert path.read_bytes() == before


def test_a_lock_held_on_a_trace_folder_stalls_no_run(tmp_path):
    """A red team's worker, which may read the folders above a trace directory, took `flock` on one for its whole life,
    and every run writing under it waited. The runs' locks are on files of their own, where no worker reaches."""
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    held = [os.open(folder, os.O_RDONLY | os.O_DIRECTORY) for folder in (tmp_path, trace_dir)]
    try:
        for descriptor in held:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with sole_writer(trace_dir):  # would wait forever on the folders' own locks
            assert oct(traces.LOCK_DIR.stat().st_mode & 0o777) == "0o700"
    finally:
        for descriptor in held:
            os.close(descriptor)
