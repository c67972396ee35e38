"""The adversarial corpus's groups "outputs" and "later" (wrong, partial and forged outputs, forged replies,
caches across calls), run and checked as tests/test_adversarial.py runs and checks its other groups: in a
module of their own, which pytest-xdist runs beside that one. Their entries start no process that outlives
its call and leave no file on the host: the other module looks for those.
"""

import pytest
from test_adversarial import (SMOKE, adversarial_run, only_trace, pytest_generate_tests, pytestmark,  # noqa: F401
                              test_every_pair_is_recorded_in_order, test_every_trace_records_its_isolation_level,
                              test_foreign_files_in_the_trace_directory_are_set_aside, test_no_worker_files_are_left,
                              test_the_control_after_the_failures_passes_and_is_timed,
                              test_the_control_runs_last_in_every_group,
                              test_the_trace_files_hold_only_what_the_runner_wrote, test_verdict)


def test_a_wrong_shape_is_named(adversarial_run):
    assert "[1, 4, 16, 512]" in only_trace(adversarial_run, "wrong_shape", "smoke_mixed").message  # 4 requests


def test_unwritten_rows_stay_poisoned_and_fail(adversarial_run):
    trace = only_trace(adversarial_run, "partial_write", "smoke_mixed")
    assert trace.correctness["output"].max_abs_error == float("inf")
    assert trace.correctness["output"].mismatch_fraction == pytest.approx(0.5)  # 2 of 4 requests written


def test_printed_claims_are_only_logged(adversarial_run):
    trace = only_trace(adversarial_run, "prints_fake_results", "smoke_mixed")
    assert "PASSED latency 0.001" in trace.log
    assert trace.status == "INCORRECT_NUMERICAL" and trace.performance is None


def test_a_pickled_reply_runs_no_code_in_the_runner(adversarial_run):
    assert adversarial_run.traces[("pickle_reply", SMOKE[0])]  # it did run
    assert not adversarial_run.evidence.exists(), "the runner loaded pickle_reply's pickle"
