"""The runner (flashbench/run/runner.py, worker.py, process.py) on a corpus of misbehaving solutions:
every failure gets its own status, ends at most its own worker, and the run goes on; workload
selection; resuming after the runner was killed; a Triton solution under the interpreter."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashbench import FlashbenchError, Repo
from flashbench.cli import main
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION
SMOKE = ["smoke_empty_short", "smoke_mixed"]


def run_solutions(repo_root, cache, tmp, paths, timeout=30.0, workloads=(), reference=False, **options):
    """Run solution folders through the Python API; the reference candidate only when asked for."""
    repo = Repo(repo_root)
    run_options = RunOptions(device="cpu", iters=2, warmup=0, timeout=timeout, trace_dir=tmp / "traces",
                             cache_dir=cache, **options)
    runner = Runner(repo, DEFINITION, run_options)
    candidates = runner.candidates(select_solutions(repo, DEFINITION, [str(p) for p in paths]))
    return runner.run(candidates if reference else candidates[1:], select_workloads(repo, DEFINITION, list(workloads), "cpu"))


# One run over most of the corpus; a correct solution comes last, after every failure.
CORPUS = {
    "wrong_shape": "INCORRECT_SHAPE",
    "crash_segfault": "CRASHED",
    "wrong_dtype": "INCORRECT_DTYPE",
    "exit_at_import": "CRASHED",
    "wrong_values": "INCORRECT_NUMERICAL",
    "partial_write": "INCORRECT_NUMERICAL",
    "raises": "RUNTIME_ERROR",
    "missing_dep": "MISSING_DEPENDENCY",
    "mutates_inputs": "REJECTED",
    "bad_entry": "INVALID_SOLUTION",
    "prints_fake_results": "INCORRECT_NUMERICAL",
    "correct_dps": "PASSED",
}


@pytest.fixture(scope="module")
def corpus_run(repo_copy, shared_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    result = run_solutions(repo_copy, shared_cache, tmp, [FIXTURES / name for name in CORPUS])
    return result, {(t.solution, t.workload_name): t for t in result.traces}


@pytest.mark.parametrize("name, status", CORPUS.items())
def test_status(corpus_run, name, status):
    _, traces = corpus_run
    for workload in SMOKE:
        trace = traces[(name, workload)]
        assert trace.status == status, f"{name} on {workload}: {trace.status} {trace.message}"
        if status != "PASSED":
            assert trace.performance is None and trace.message


def test_every_pair_is_recorded_in_order(corpus_run):
    result, _ = corpus_run
    assert [(t.solution, t.workload_name) for t in result.traces] == [(n, w) for n in CORPUS for w in SMOKE]
    lines = result.trace_file.read_text().splitlines()
    assert [json.loads(line)["status"] for line in lines] == [t.status for t in result.traces]


def test_segfault_is_named_and_the_worker_is_restarted_for_the_next_workload(corpus_run):
    _, traces = corpus_run
    for workload in SMOKE:  # the second workload ran in a fresh worker and crashed on its own
        assert "SIGSEGV" in traces[("crash_segfault", workload)].message


def test_exit_at_import_is_a_crash_during_build(corpus_run):
    _, traces = corpus_run
    for workload in SMOKE:
        trace = traces[("exit_at_import", workload)]
        assert trace.message == "build: the worker exited with code 3"


def test_failure_messages(corpus_run):
    _, traces = corpus_run
    pick = lambda name: traces[(name, "smoke_mixed")]  # noqa: E731
    assert "[1, 4, 16, 512]" in pick("wrong_shape").message
    assert "float32" in pick("wrong_dtype").message
    assert "deliberate failure in the fixture" in pick("raises").message
    assert "Traceback" in pick("raises").log
    assert pick("missing_dep").message == "not installed: package_that_does_not_exist_xyz"
    assert "q_nope" in pick("mutates_inputs").message
    assert "does_not_exist" in pick("bad_entry").message


def test_unwritten_rows_stay_poisoned_and_fail(corpus_run):
    _, traces = corpus_run
    trace = traces[("partial_write", "smoke_mixed")]
    assert trace.correctness["output"].max_abs_error == float("inf")
    assert trace.correctness["output"].mismatch_fraction == pytest.approx(0.5)  # 2 of 4 requests written


def test_printed_claims_are_only_logged(corpus_run):
    _, traces = corpus_run
    trace = traces[("prints_fake_results", "smoke_mixed")]
    assert "PASSED latency 0.001" in trace.log
    assert trace.status == "INCORRECT_NUMERICAL" and trace.performance is None


def test_correct_solution_after_the_failures_passes_and_is_timed(corpus_run):
    _, traces = corpus_run
    for workload in SMOKE:
        trace = traces[("correct_dps", workload)]
        assert trace.performance.samples == 2 and trace.performance.latency_ms > 0
        assert trace.performance.reference_latency_ms is None  # the reference was not part of this run
        assert trace.correctness["output"].mismatch_fraction == 0.0


def test_hang_times_out_and_the_run_goes_on(repo_copy, shared_cache, tmp_path):
    started = time.monotonic()
    result = run_solutions(repo_copy, shared_cache, tmp_path, [FIXTURES / "hang", FIXTURES / "correct_dps"],
                           timeout=10, workloads=["smoke_mixed"])
    hang, correct = result.traces
    assert (hang.solution, hang.status, hang.message) == ("hang", "TIMEOUT", "no answer within 10 s")
    assert (correct.solution, correct.status) == ("correct_dps", "PASSED")
    assert time.monotonic() - started < 60


def test_reference_outputs_past_the_memory_budget_are_dropped_and_computed_again(repo_copy, shared_cache, tmp_path):
    repo = Repo(repo_copy)
    options = RunOptions(device="cpu", iters=2, warmup=0, trace_dir=tmp_path / "traces", cache_dir=shared_cache,
                         reference_memory_bytes=0)
    runner = Runner(repo, DEFINITION, options)
    workloads = select_workloads(repo, DEFINITION, SMOKE, "cpu")
    result = runner.run(runner.candidates(select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps")])), workloads)
    assert [(t.solution, t.status) for t in result.traces] == [("reference", "PASSED")] * 2 + [("correct_dps", "PASSED")] * 2
    # Only the last job's reference outputs are still held.
    assert {uuid for uuid, _, _ in runner._expected} == {workloads[-1].uuid}


# Workload and solution selection (no workers).

@pytest.fixture(scope="module")
def repo(repo_copy):
    return Repo(repo_copy)


def names(workloads):
    return [w.name for w in workloads]


def test_cpu_default_is_smoke_only(repo):
    assert names(select_workloads(repo, DEFINITION, [], "cpu")) == SMOKE
    everything = select_workloads(repo, DEFINITION, [], "cuda")
    assert len(everything) > 2 and names(everything)[:2] == SMOKE


def test_select_by_name_tag_and_uuid_prefix(repo):
    assert names(select_workloads(repo, DEFINITION, ["b1_l1024"], "cpu")) == ["b1_l1024"]
    assert names(select_workloads(repo, DEFINITION, ["smoke"], "cuda")) == SMOKE
    assert names(select_workloads(repo, DEFINITION, ["bandwidth"], "cpu")) == ["b64_l4096"]
    assert names(select_workloads(repo, DEFINITION, ["810323f4"], "cpu")) == ["smoke_mixed"]
    assert names(select_workloads(repo, DEFINITION, ["810323f4-6465-4c15-a87f-4d0946faba69"], "cpu")) == ["smoke_mixed"]


def test_selectors_keep_order_without_duplicates(repo):
    chosen = select_workloads(repo, DEFINITION, ["smoke_mixed", "smoke", "926d5146"], "cpu")
    assert names(chosen) == ["smoke_mixed", "smoke_empty_short"]


def test_unknown_workload_lists_names_and_tags(repo):
    with pytest.raises(FlashbenchError, match="no workload matches 'nonexistent'") as info:
        select_workloads(repo, DEFINITION, ["nonexistent"], "cpu")
    for known in ("smoke_mixed", "b1_l1024", "smoke", "bandwidth"):
        assert known in str(info.value)


def test_reference_selects_no_solution_folder(repo):
    assert select_solutions(repo, DEFINITION, ["reference"]) == []
    named = select_solutions(repo, DEFINITION, ["reference", str(FIXTURES / "correct_dps")])
    assert [f.solution.name for f in named] == ["correct_dps"]


def test_unknown_solution_and_wrong_definition(repo):
    with pytest.raises(FlashbenchError, match="no solution 'nope'"):
        select_solutions(repo, DEFINITION, ["nope"])
    with pytest.raises(FlashbenchError, match="not 'mla_paged_prefill"):
        select_solutions(repo, "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1", [str(FIXTURES / "correct_dps")])


def test_graph_runs_time_the_reference_with_events(repo, tmp_path):
    """The reference copies index data to the host, which a CUDA graph cannot capture: under
    --timing graph it is timed with events, and only the solutions are replayed in graphs."""
    from dataclasses import replace

    from flashbench.run.runner import Job

    runner = Runner(repo, DEFINITION, RunOptions(trace_dir=tmp_path))
    runner.options = replace(runner.options, timing="graph")  # a GPU run's options, without the GPU
    reference, solution = runner.candidates(select_solutions(repo, DEFINITION, [str(FIXTURES / "correct_dps")]))
    workload = select_workloads(repo, DEFINITION, ["smoke_mixed"], "cpu")[0]
    methods = [runner.job_request(Job(0, c, workload))["timing"]["method"] for c in (reference, solution)]
    assert methods == ["events", "graph"]


# Resume after the runner was killed outright.

def cli_command(repo_root, trace_dir, *arguments):
    return [sys.executable, "-m", "flashbench", "--root", str(repo_root), "run", "--def", "mla_paged_decode",
            "--device", "cpu", "--trace-dir", str(trace_dir), "--iters", "2", "--warmup", "0", *arguments]


def trace_lines(trace_dir: Path) -> list[bytes]:
    files = list(trace_dir.glob(f"*/{DEFINITION}.jsonl"))
    return files[0].read_bytes().splitlines() if files else []


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def live_members(group: int) -> list[int]:
    """Processes of a process group that still run (zombies do not count)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(entry.name))
    return members


@pytest.fixture
def killed_run(tmp_path):
    """Starts a CLI run in a process group of its own; whatever the test leaves running is ended."""
    started = []

    def start(command, **kwargs):
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for pid in live_members(process.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_resume_after_kill(tmp_path, fresh_repo, killed_run):
    repo_root = fresh_repo
    trace_dir = tmp_path / "traces"
    correct, hang = FIXTURES / "correct_dps", FIXTURES / "hang"
    runner = killed_run(cli_command(repo_root, trace_dir, "--solution", str(correct), "--solution", str(hang),
                                    "--timeout", "120"))
    wait_for(lambda: len(trace_lines(trace_dir)) >= 1, 120, "the first trace")
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=10)

    before = trace_lines(trace_dir)
    records = [json.loads(line) for line in before]  # every line is whole, valid JSON
    recorded = {(r["solution"], r["workload_name"]) for r in records}
    assert len(recorded) == len(records) >= 1
    assert all(r["solution"] in ("reference", "correct_dps") for r in records)
    wait_for(lambda: not live_members(runner.pid), 20, "the killed run's workers to end")

    result = CliRunner().invoke(main, cli_command(repo_root, trace_dir, "--solution", str(correct), "--resume",
                                                  "--timeout", "60")[3:])
    assert result.exit_code == 0, result.output
    assert f"{len(records)} pair(s) already recorded were skipped (--resume)" in result.output

    after = trace_lines(trace_dir)
    assert after[:len(before)] == before  # old lines untouched
    added = [json.loads(line) for line in after[len(before):]]
    expected = {(s, w) for s in ("reference", "correct_dps") for w in SMOKE}
    assert {(r["solution"], r["workload_name"]) for r in added} == expected - recorded  # the rest, once each
    assert len(added) == len(expected - recorded)
    assert all(r["status"] == "PASSED" for r in records + added)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="relies on the parent-death signal")
def test_killed_runner_takes_a_hanging_worker_with_it(tmp_path, fresh_repo, killed_run):
    repo_root = fresh_repo
    worker_tmp = tmp_path / "tmp"  # where the worker's log (its stdout) goes
    worker_tmp.mkdir()
    runner = killed_run(cli_command(repo_root, tmp_path / "traces", "--solution", str(FIXTURES / "hang"),
                                    "--workload", "smoke_mixed", "--timeout", "120"),
                        env={**os.environ, "TMPDIR": str(worker_tmp)})

    def hanging():
        return any(b"looping forever" in log.read_bytes() for log in worker_tmp.glob("flashbench-worker-*.log"))

    wait_for(hanging, 120, "the solution to start looping")
    assert len(live_members(runner.pid)) >= 2  # the runner and its looping worker
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=10)
    wait_for(lambda: not live_members(runner.pid), 20, "the orphaned worker to end")


# A Triton kernel under Triton's interpreter.

TRITON_SOLUTION = ROOT / "solutions" / DEFINITION / "triton_splitkv"


@pytest.mark.skipif(not (TRITON_SOLUTION / "solution.yaml").is_file(), reason="no Triton solution in the repository")
def test_triton_solution_under_the_interpreter(repo_copy, shared_cache, tmp_path):
    pytest.importorskip("triton")
    result = run_solutions(repo_copy, shared_cache, tmp_path, [TRITON_SOLUTION], timeout=120)
    assert [(t.workload_name, t.status) for t in result.traces] == [(w, "PASSED") for w in SMOKE], \
        [t.message for t in result.traces]
    assert all(t.performance.timing["method"] == "host clock" for t in result.traces)
