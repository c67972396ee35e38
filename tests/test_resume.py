"""flashbench/run/resume.py: which recorded results `--resume` skips. Only a failure the judge itself
established before starting a worker (MISSING_DEPENDENCY) is run again; nothing a worker reports is."""

import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from flashbench import Repo
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads
from flashbench.run.protocol import Failed, FailureStatus
from flashbench.run.resume import settled
from trace_factory import make_trace

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION


def trace(status, message=""):
    return make_trace("s", "w", status=status).model_copy(update={"message": message})


@pytest.mark.parametrize("status", ["PASSED", "INCORRECT_NUMERICAL", "INCORRECT_SHAPE", "RUNTIME_ERROR", "TIMEOUT",
                                    "CRASHED", "REJECTED", "COMPILE_ERROR", "INVALID_SOLUTION"])
def test_outcomes_of_the_solution_are_settled(status):
    assert settled(trace(status, "anything, even: nvcc: not found"))


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
