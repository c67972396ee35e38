"""flashbench/run/resume.py: which recorded results `--resume` skips. What the judge answers for is run again (a
missing dependency it found, a limit shorter than the run's, its rejection for a changed trace file); nothing a
worker reports is."""

import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from flashbench import Repo
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads
from flashbench.run.protocol import Failed, FailureStatus
from flashbench.run.recorder import TRACE_FILE_CHANGED, rejected_for_a_changed_file
from flashbench.run.resume import JUDGE_VERSION, TASK_DIED_KEY, settled
from trace_factory import EVENTS, make_trace

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION


def trace(status, message=""):
    """As the judge records it: a PASSED with its time."""
    latency = 1.0 if status == "PASSED" else None
    return make_trace("s", "w", latency_ms=latency, status=status).model_copy(update={"message": message})


@pytest.mark.parametrize("status", ["PASSED", "INCORRECT_NUMERICAL", "INCORRECT_SHAPE", "RUNTIME_ERROR", "TIMEOUT",
                                    "CRASHED", "REJECTED", "COMPILE_ERROR", "INVALID_SOLUTION"])
def test_outcomes_of_the_solution_are_settled(status):
    assert settled(trace(status, "anything, even: nvcc: not found"))


def test_a_pass_without_a_time_runs_again():
    """A red team appended a PASSED line with no performance for a pair that had failed: --resume kept it. The
    judge never writes a PASSED without a time."""
    assert not settled(trace("PASSED").model_copy(update={"performance": None}))
    assert settled(trace("RUNTIME_ERROR").model_copy(update={"performance": None}))


def test_a_timeout_under_a_shorter_limit_than_the_runs_runs_again():
    """`--timeout 0.01` timed out every pair, and a `--resume` with the default kept them all: the limit is the
    user's, not the solution's verdict. A timeout under a limit at least the run's stays; one of unknown limit
    (recorded before the limit was) runs again."""
    def timed_out(limit):
        record = trace("TIMEOUT")
        return record.model_copy(update={"environment": {**record.environment, "timeout_s": limit}})
    assert not settled(timed_out(0.01), timeout=300.0)
    assert settled(timed_out(300.0), timeout=300.0) and settled(timed_out(600.0), timeout=300.0)
    assert not settled(trace("TIMEOUT"), timeout=300.0)
    assert settled(timed_out(0.01))  # a settled() asked without a run's limit: as before


def test_the_judges_rejection_for_a_changed_trace_file_runs_again():
    """The pair during which someone else changed the trace file is rejected by the judge itself, not for
    anything the solution is known to have done, where its worker could not reach the trace file (level
    namespaces); at level process it could, and would buy itself another try."""
    rejected = rejected_for_a_changed_file(trace("PASSED"))
    assert not settled(rejected.model_copy(update={"isolation": "namespaces"}))
    assert settled(rejected.model_copy(update={"isolation": "process"}))
    # the message alone is words a worker can send (a solution raising it bought itself another try)
    assert settled(trace("REJECTED", TRACE_FILE_CHANGED).model_copy(update={"isolation": "namespaces"}))


def test_a_pair_whose_judges_ray_task_died_runs_again():
    """Ray's memory monitor may kill the judge's task for another task's worker: that CRASHED is no verdict on the
    solution. The mark is in the environment, which only the judge writes."""
    crashed = trace("CRASHED", "the judge's Ray task died: killed (2 times)")
    assert settled(crashed)
    assert not settled(crashed.model_copy(update={"environment": {**crashed.environment, TASK_DIED_KEY: True}}))


def test_a_missing_dependency_runs_again():
    assert not settled(trace("MISSING_DEPENDENCY", "not installed: flashinfer"))
    assert not settled(trace("MISSING_DEPENDENCY", "a CUDA solution needs nvcc (no CUDA toolkit found; set CUDA_HOME)"))


@pytest.mark.parametrize("message", [
    "building kernel.cu failed: CUDA_HOME environment variable is not set. Please set it to your CUDA install root.",
    "building kernel.cu failed: Error building extension 'x': [1/3] ...\n/bin/sh: 1: /usr/local/cuda/bin/nvcc: not found\n",
    "building kernel.cu failed: Ninja is required to load C++ extensions (pip install ninja to get it)",
    "importing kernel.py failed: AssertionError('Torch not compiled with CUDA enabled')",
])
@pytest.mark.parametrize("status", ["COMPILE_ERROR", "INVALID_SOLUTION"])
def test_a_toolchain_failure_a_worker_reports_is_settled(status, message):
    """The worker's words: the judge checks the toolchain itself before any worker starts (MISSING_DEPENDENCY)."""
    assert settled(trace(status, message))


@pytest.mark.parametrize("recorded, run, again", [("process", "namespaces", True), (None, "process", True),
                                                   ("namespaces", "process", False), ("process", "process", False)])
def test_a_record_made_less_isolated_than_the_run_runs_again(recorded, run, again):
    """A record made at level process was kept by a --resume at level namespaces, which said its workers were
    isolated at that level: a solution that cheats where it sees other processes would keep its result."""
    for status in ("PASSED", "INCORRECT_NUMERICAL"):
        made = trace(status).model_copy(update={"isolation": recorded})
        assert settled(made, run) is not again


def test_a_time_measured_otherwise_runs_again():
    """After another L2 flush, or on inputs whose seeds were public, a time measured something else."""
    measured = {"seeds": "secret", "l2_flush": "flushed: write+read v3"}
    passed = make_trace("s", "w", latency_ms=1.0, timing={**EVENTS, **measured})
    passed = passed.model_copy(update={"isolation": "namespaces"})
    assert settled(passed, "namespaces", measured)
    assert not settled(passed, "namespaces", {**measured, "l2_flush": "flushed: write+read v4"})
    assert not settled(passed, "namespaces", {**measured, "seeds": "public"})
    failed = trace("INCORRECT_NUMERICAL").model_copy(update={"isolation": "namespaces"})
    assert settled(failed, "namespaces", {**measured, "seeds": "public"})  # no time: nothing measured otherwise


def test_no_worker_can_report_the_status_that_runs_again():
    assert "MISSING_DEPENDENCY" not in typing.get_args(FailureStatus)
    with pytest.raises(ValidationError):
        Failed(status="MISSING_DEPENDENCY", message="not installed: torch")


def test_a_failure_reported_from_a_call_is_not_run_again(repo_copy, shared_cache, tmp_path):
    """A red team's solution said "nvcc: not found" from its call whenever it did not like a run; --resume ran
    the pair again, so it kept its best attempt."""
    repo = Repo(repo_copy)
    runner = Runner(repo, DEFINITION, RunOptions(device="cpu", iters=2, warmup=0, timeout=30.0, resume=True,
                                                 trace_dir=tmp_path / "traces", cache_dir=shared_cache))
    folders = select_solutions(repo, DEFINITION, [str(FIXTURES / "reports_missing_toolchain"),
                                                  str(FIXTURES / "missing_dep")])
    workloads = select_workloads(repo, DEFINITION, ["smoke_mixed"], "cpu")
    first = runner.run(runner.candidates(folders)[1:], workloads)
    # A build failure claimed in the middle of a job is refused as such (session.JOB_FAILURES).
    assert [(t.solution, t.status) for t in first.traces] == [("reports_missing_toolchain", "REJECTED"),
                                                              ("missing_dep", "MISSING_DEPENDENCY")]
    assert "reported COMPILE_ERROR in the middle of a job" in first.traces[0].message
    again = runner.run(runner.candidates(folders)[1:], workloads)
    assert [t.solution for t in again.skipped] == ["reports_missing_toolchain"]
    assert [(t.solution, t.status) for t in again.traces] == [("missing_dep", "MISSING_DEPENDENCY")]


def test_a_pass_under_looser_checks_runs_again(fresh_repo, shared_cache, tmp_path):
    """A red team: the lse tolerance was tightened (1e-2 -> 1e-3) to fail a lossy copy of the KV caches, but a
    --resume kept the PASSED the lossy solution had recorded under the old tolerance (keyed by its content hash
    and the workload only): the definition's checks, like the flush and the seeds, are part of what a time
    was measured as."""
    definition_file = fresh_repo / "definitions" / "mla_paged" / f"{DEFINITION}.yaml"
    strict = definition_file.read_text()
    assert "lse: {atol: 1.0e-3, rtol: 0.0}" in strict
    definition_file.write_text(strict.replace("lse: {atol: 1.0e-3, rtol: 0.0}", "lse: {atol: 1.0e-2, rtol: 1.0e-3}"))
    lossy = tmp_path / "lossy"
    lossy.mkdir()
    (lossy / "honest.py").write_text(
        (Path(__file__).parents[1] / "solutions" / DEFINITION / "torch_vectorized" / "kernel.py").read_text())
    (lossy / "kernel.py").write_text("from honest import run as _run\n\n\ndef run(*args):\n"
                                     "    output, lse = _run(*args)\n    return output, lse + 5e-3\n")
    (lossy / "solution.yaml").write_text(f"name: lossy\ndefinition: {DEFINITION}\nauthor: tests\nlanguage: python\n"
                                         "entry_point: kernel.py::run\ndestination_passing_style: false\n"
                                         "dependencies: [torch]\n")

    def run():
        repo = Repo(fresh_repo)
        runner = Runner(repo, DEFINITION, RunOptions(device="cpu", iters=2, warmup=0, timeout=30.0, resume=True,
                                                     trace_dir=tmp_path / "traces", cache_dir=shared_cache))
        folders = select_solutions(repo, DEFINITION, [str(lossy)])
        return runner.run(runner.candidates(folders)[1:], select_workloads(repo, DEFINITION, ["smoke_mixed"], "cpu"))

    assert [t.status for t in run().traces] == ["PASSED"]
    definition_file.write_text(strict)
    again = run()
    assert again.skipped == []
    assert [t.status for t in again.traces] == ["INCORRECT_NUMERICAL"]


@pytest.mark.parametrize("status", ["PASSED", "INCORRECT_NUMERICAL", "REJECTED"])
def test_a_record_of_another_judge_version_runs_again(status):
    """Red team: a PASSED recorded by an older flashbench (before a fix that would fail it) was kept by every later
    --resume: only the definition's checks were compared. So was a failure an older judge gave an honest solution
    (a reviewer: the sink solutions' INCORRECT_NUMERICAL before constant inputs were one weight). Only the judge
    writes the version, so a solution cannot use it to be run again."""
    latency = 1.0 if status == "PASSED" else None
    current = make_trace("s", "w", latency, status=status).model_copy(update={"isolation": "namespaces"})
    assert settled(current, "namespaces") is True
    for version in (JUDGE_VERSION - 1, None):
        environment = {**current.environment, "judge": version}
        assert not settled(current.model_copy(update={"environment": environment}), "namespaces")


def test_a_pass_timed_with_other_call_counts_runs_again():
    """Red team: a PASSED timed with --iters 1 or --warmup 0 was kept by a later --resume with the defaults."""
    measured = {"seeds": "secret", "warmup": 1, "iters": 50}
    passed = make_trace("s", "w", latency_ms=1.0, timing={**EVENTS, **measured})
    passed = passed.model_copy(update={"isolation": "namespaces"})
    assert settled(passed, "namespaces", measured)
    assert not settled(passed, "namespaces", {**measured, "iters": 500})
    assert not settled(passed, "namespaces", {**measured, "warmup": 0})


def test_a_pass_made_while_an_input_was_constant_runs_again_once_it_is_not(tmp_path):
    """`constant: true` decides how an input is drawn (from the definition's name, one weight in every set) and that
    no call redraws it: a solution keeping exp(attn_sink) passes only while it holds. A PASSED made so was kept by
    --resume after the definition dropped `constant` (the checks' digest left the flag out)."""
    import shutil

    name = "flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048"
    root = Path(__file__).resolve().parents[1]
    fresh_repo = tmp_path / "repo"
    for folder in ("definitions", "references"):
        shutil.copytree(root / folder / "flashmla_sparse", fresh_repo / folder / "flashmla_sparse")
    definition_file = fresh_repo / "definitions" / "flashmla_sparse" / f"{name}.yaml"

    def checks() -> str:
        return Runner(Repo(fresh_repo), name, RunOptions(device="cpu"))._measured_as()["checks"]

    constant = checks()
    text = definition_file.read_text()
    assert "dtype: float32, constant: true," in text
    definition_file.write_text(text.replace("dtype: float32, constant: true,", "dtype: float32,"))
    assert checks() != constant
