"""Correctness checks (flashbench/run/judge/check.py): infinities, NaN, tolerance edges, mismatch
fraction, and compare_outputs on the tensors the judge read back from a call's output slot. The
checks of what a solution returned (not a tensor, a subclass, a view of an input, device, shape,
dtype, in that order) happen in the worker before it copies the outputs into their slot
(flashbench/run/worker/handler.py): they are tested here too, on the worker's own code."""

import math

import pytest
import torch

from flashbench import Repo
from flashbench.model.definition import Tolerance
from flashbench.run.judge import check, evaluators
from flashbench.run.judge.check import compare_outputs, output_error
from flashbench.run.protocol import Call
from flashbench.run.worker import handler

INF = math.inf
NAN = math.nan
STRICT = Tolerance(atol=1e-2, rtol=1e-2)


def error(got, expected, tolerance=STRICT):
    return output_error(torch.tensor(got, dtype=torch.float32), torch.tensor(expected, dtype=torch.float32), tolerance)


def test_minus_inf_against_minus_inf_passes():
    stats, bad = error([-INF, 1.0], [-INF, 1.0])
    assert not bad
    assert stats.max_abs_error == 0.0 and stats.max_rel_error == 0.0 and stats.mismatch_fraction == 0.0


def test_plus_inf_against_plus_inf_passes():
    assert not error([INF], [INF])[1]


def test_minus_inf_against_finite_fails():
    stats, bad = error([-INF, 1.0], [0.5, 1.0])
    assert bad
    assert stats.max_abs_error == INF and stats.mismatch_fraction == 0.5


def test_finite_against_minus_inf_fails_and_reports_infinite_errors():
    stats, bad = error([-3.0], [-INF])
    assert bad
    assert stats.max_abs_error == INF
    assert stats.max_rel_error == INF  # not NaN, not 0


def test_plus_inf_against_minus_inf_fails():
    stats, bad = error([INF], [-INF])
    assert bad and stats.max_abs_error == INF


@pytest.mark.parametrize("got, expected", [([NAN], [1.0]), ([1.0], [NAN]), ([NAN], [NAN]), ([NAN], [-INF])])
def test_nan_fails(got, expected):
    stats, bad = error(got, expected)
    assert bad
    assert stats.max_abs_error == INF and stats.mismatch_fraction == 1.0


def test_nan_fails_even_where_a_mismatch_fraction_is_allowed():
    # One unwritten (NaN-poisoned) element in 1000 is within max_mismatch_fraction, but never passes.
    got = [1.0] * 1000
    got[17] = NAN
    lenient = Tolerance(atol=1e-2, rtol=1e-2, max_mismatch_fraction=0.01)
    stats, bad = error(got, [1.0] * 1000, lenient)
    assert stats.mismatch_fraction == pytest.approx(0.001)
    assert bad


@pytest.mark.parametrize("value", [INF, -INF])
def test_an_infinity_the_reference_lacks_fails_even_where_a_mismatch_fraction_is_allowed(value):
    # One element in 10,000 may be off on the FP8 sparse decode definitions: an infinity there passed, and
    # becomes NaN in every later layer. An infinity the reference has (an empty request's lse) still agrees.
    lenient = Tolerance(atol=1e-2, rtol=1e-2, max_mismatch_fraction=1e-3)
    got = [1.0] * 10_000
    got[17] = value
    stats, bad = error(got, [1.0] * 10_000, lenient)
    assert stats.mismatch_fraction == pytest.approx(1e-4) and bad
    got[17], expected = -INF, [1.0] * 10_000
    expected[17] = -INF
    assert not error(got, expected, lenient)[1]
    got[17] = 5.0  # merely far off: the fraction allows it
    assert not error(got, [1.0] * 10_000, lenient)[1]


def test_tolerance_edges():
    tolerance = Tolerance(atol=0.25, rtol=0.5)  # exact in binary: allowed = 0.25 + 0.5 * |ref|
    assert not error([1.0 + 0.75], [1.0], tolerance)[1]  # exactly on the edge: inside
    assert error([1.0 + 0.75 + 2 ** -20], [1.0], tolerance)[1]  # just beyond
    assert not error([-0.25], [0.0], tolerance)[1]  # atol alone at a zero reference
    assert error([-0.25 - 2 ** -20], [0.0], tolerance)[1]
    assert not error([4.0 - 2.25], [4.0], tolerance)[1]  # rtol scales with the reference's magnitude
    assert error([4.0 - 2.25 - 2 ** -18], [4.0], tolerance)[1]


def test_rtol_uses_the_reference_magnitude_not_the_output():
    tolerance = Tolerance(atol=0.0, rtol=0.1)
    assert error([1.0], [0.905], tolerance)[1]  # 0.095 > 0.1 * 0.905
    assert not error([0.905], [1.0], tolerance)[1]  # 0.095 <= 0.1 * 1.0


def test_mismatch_fraction():
    tolerance = Tolerance(atol=0.01, rtol=0.0, max_mismatch_fraction=0.25)
    expected = [0.0] * 8
    two_off = [1.0, 1.0] + [0.0] * 6
    three_off = [1.0, 1.0, 1.0] + [0.0] * 5
    stats, bad = error(two_off, expected, tolerance)
    assert stats.mismatch_fraction == 0.25 and not bad  # exactly the allowed share
    stats, bad = error(three_off, expected, tolerance)
    assert stats.mismatch_fraction == 0.375 and bad
    assert error(two_off, expected, STRICT)[1]  # the default allows none


def test_error_statistics():
    stats, _ = error([1.5, -2.0, 10.0], [1.0, -2.0, 8.0])
    assert stats.max_abs_error == pytest.approx(2.0)
    assert stats.max_rel_error == pytest.approx(0.5)
    assert stats.mismatch_fraction == pytest.approx(2 / 3)


def test_empty_tensors_pass():
    stats, bad = output_error(torch.empty(0, 4), torch.empty(0, 4), STRICT)
    assert not bad and stats.max_abs_error == 0.0 and stats.mismatch_fraction == 0.0


def test_bfloat16_against_float_reference():
    reference = torch.randn(64, generator=torch.Generator().manual_seed(0))
    assert not output_error(reference.to(torch.bfloat16), reference, Tolerance(atol=1e-2, rtol=2e-2))[1]


def test_chunked_comparison_counts_across_chunks(monkeypatch):
    # Seven chunks of three elements: the maxima, the mismatch count and a NaN in a late chunk
    # come out as they do in one pass.
    expected = torch.linspace(-4, 4, 20)
    got = expected.clone()
    got[1], got[8], got[19] = 9.0, -INF, 5.0
    whole, whole_bad = output_error(got, expected, STRICT)
    monkeypatch.setattr(evaluators, "CHUNK_ELEMENTS", 3)
    chunked, chunked_bad = output_error(got, expected, STRICT)
    assert chunked == whole and chunked_bad == whole_bad
    assert chunked.mismatch_fraction == pytest.approx(3 / 20) and chunked.max_abs_error == INF
    got[13] = NAN
    assert output_error(got, expected, Tolerance(atol=1e-2, rtol=1e-2, max_mismatch_fraction=0.5))[1]


def test_a_comparison_without_device_memory_is_done_on_the_host(monkeypatch):
    # The device stands in for a GPU whose memory a solution's worker holds.
    chunk_errors = check._chunk_errors

    def out_of_memory_off_the_host(got, expected, tolerance):
        if got.device.type != "cpu":
            raise torch.cuda.OutOfMemoryError("out of memory")
        return chunk_errors(got, expected, tolerance)

    monkeypatch.setattr(check, "_chunk_errors", out_of_memory_off_the_host)
    got, expected = torch.tensor([1.0, 2.0, 5.0]), torch.tensor([1.0, 2.0, 3.0])
    stats, bad = output_error(got, expected, STRICT, device="meta")
    assert bad and stats.max_abs_error == 2.0 and stats.mismatch_fraction == pytest.approx(1 / 3)


def test_comparison_keeps_the_shape_free_of_copies():
    # A [2, 3, 4] output is compared element for element, whatever its layout in chunks.
    expected = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    got = expected.clone()
    got[1, 2, 3] += 1
    stats, bad = output_error(got, expected, STRICT)
    assert bad and stats.mismatch_fraction == pytest.approx(1 / 24) and stats.max_abs_error == 1.0


# compare_outputs on the MLA decode definition: output [B, 16, 512] bf16, lse [B, 16] fp32.

@pytest.fixture(scope="module")
def definition(repo_copy):
    return Repo(repo_copy).definition("mla_paged_decode_h16_ckv512_kpe64_ps1")


@pytest.fixture
def expected():
    generator = torch.Generator().manual_seed(1)
    lse = torch.randn(3, 16, generator=generator)
    lse[0] = -INF  # an empty request
    output = torch.randn(3, 16, 512, generator=generator).to(torch.bfloat16)
    output[0] = 0
    return {"output": output, "lse": lse}


def copy(tensors: dict) -> dict:
    """What the judge reads back from a slot: tensors of the declared shapes and dtypes."""
    return {name: t.clone() for name, t in tensors.items()}


def test_compare_outputs_passes_identical_outputs_with_empty_requests(definition, expected):
    verdict = compare_outputs(definition, copy(expected), expected, "cpu")
    assert verdict.passed and verdict.status == "PASSED" and verdict.message == ""
    assert set(verdict.errors) == {"output", "lse"}
    assert verdict.errors["lse"].max_abs_error == 0.0


def test_compare_outputs_finite_lse_for_an_empty_request_fails(definition, expected):
    got = copy(expected)
    got["lse"][0] = -1e30
    verdict = compare_outputs(definition, got, expected, "cpu")
    assert verdict.status == "INCORRECT_NUMERICAL" and "output lse" in verdict.message
    assert verdict.errors["lse"].max_abs_error == INF


def test_compare_outputs_poisoned_rows_fail(definition, expected):
    got = copy(expected)
    got["output"][2] = NAN  # a row the solution left as the judge poisoned it
    verdict = compare_outputs(definition, got, expected, "cpu")
    assert verdict.status == "INCORRECT_NUMERICAL" and "output output" in verdict.message
    assert verdict.errors["output"].mismatch_fraction == pytest.approx(1 / 3)


def test_compare_outputs_names_the_first_failing_output_and_measures_all(definition, expected):
    got = copy(expected)
    got["output"][1] += 1.0
    got["lse"][1] += 1.0
    verdict = compare_outputs(definition, got, expected, "cpu")
    assert verdict.message.startswith("output output:") and "outside atol/rtol" in verdict.message
    assert verdict.errors["output"].max_abs_error == pytest.approx(1.0, abs=0.05)  # bf16 rounding
    assert verdict.errors["lse"].max_abs_error == pytest.approx(1.0, rel=1e-5)


def test_compare_outputs_off_the_host(definition, expected, monkeypatch):
    """compute_on names where the arithmetic runs; without memory there, it runs on the host."""
    chunk_errors = check._chunk_errors

    def out_of_memory_off_the_host(got, expected, tolerance):
        if got.device.type != "cpu":
            raise torch.cuda.OutOfMemoryError("out of memory")
        return chunk_errors(got, expected, tolerance)

    monkeypatch.setattr(check, "_chunk_errors", out_of_memory_off_the_host)
    got = copy(expected)
    got["output"][2] = NAN
    verdict = compare_outputs(definition, got, expected, "meta")
    assert verdict.status == "INCORRECT_NUMERICAL"
    assert verdict.errors["output"].mismatch_fraction == pytest.approx(1 / 3)


# What a solution returned, checked by the worker before it goes into the call's slot.

@pytest.fixture
def worker_job(definition, expected):
    """The worker's Job for one call, without an arena: a slot of the declared outputs and an input set."""
    job = object.__new__(handler.Job)
    job.definition = definition
    job.slots = [{name: torch.full_like(t, NAN) if t.is_floating_point() else torch.empty_like(t)
                  for name, t in expected.items()}]
    generator = torch.Generator().manual_seed(2)
    job.inputs = type("Sets", (), {})()
    job.inputs.sets = [{"q_nope": torch.randn(3, 16, 512, generator=generator).to(torch.bfloat16),
                        "kv_indptr": torch.tensor([0, 0, 2, 5], dtype=torch.int32)}]
    job.returned = None
    return job


def store(job, returned) -> None:
    job.returned = returned
    job.store(Call(set=0, slot=0))


def test_returned_outputs_go_into_the_slot(worker_job, expected):
    store(worker_job, (expected["output"].clone(), expected["lse"].clone()))
    assert all(torch.equal(worker_job.slots[0][name], expected[name]) for name in expected)
    assert worker_job.returned is None


def test_returned_output_count(worker_job, expected):
    with pytest.raises(handler.OutputProblem, match="returned 1 values; the definition has 2 outputs") as problem:
        store(worker_job, expected["output"].clone())
    assert problem.value.status == "INCORRECT_SHAPE"


@pytest.mark.parametrize("returned, words", [(None, "returned None"), ({}, "returned a dict")])
def test_returning_none_or_a_dict_says_what_to_return(worker_job, expected, returned, words):
    """A function that forgot its `return` (all NaN otherwise: 'max abs error inf'), or named its outputs."""
    with pytest.raises(handler.OutputProblem) as problem:
        store(worker_job, returned if returned is None else dict(expected))
    message = str(problem.value)
    assert problem.value.status == "INCORRECT_SHAPE"
    assert message.startswith(words) and "a tuple in the definition's order (output, lse)" in message


def test_a_destination_passing_call_leaves_its_slot_as_written(worker_job, expected):
    worker_job.slots[0]["lse"].copy_(expected["lse"])
    store(worker_job, handler.IN_SLOT)
    assert torch.equal(worker_job.slots[0]["lse"], expected["lse"]) and worker_job.returned is None


@pytest.mark.parametrize("change, status, words", [
    (lambda t: t[None], "INCORRECT_SHAPE", "has shape [1, 3, 16, 512], expected [3, 16, 512]"),
    (lambda t: t.float(), "INCORRECT_DTYPE", "is float32, expected bfloat16"),
    (lambda t: t.float().numpy(), "INCORRECT_DTYPE", "not a torch.Tensor but ndarray"),
    (lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), "RUNTIME_ERROR", "is on meta, expected cpu"),
    # The device is checked before the shape and dtype.
    (lambda t: torch.empty((1, *t.shape), dtype=torch.float32, device="meta"), "RUNTIME_ERROR", "on meta"),
    (lambda t: t.as_subclass(type("Lazy", (torch.Tensor,), {})), "REJECTED", "subclass Lazy"),
])
def test_returned_output_checks_in_order(worker_job, expected, change, status, words):
    with pytest.raises(handler.OutputProblem) as problem:
        store(worker_job, (change(expected["output"].clone()), expected["lse"].clone()))
    assert problem.value.status == status and words in str(problem.value)
    assert str(problem.value).startswith("output output")


def test_an_output_that_is_an_input_is_rejected(worker_job, expected):
    q_nope = worker_job.inputs.sets[0]["q_nope"]
    with pytest.raises(handler.OutputProblem, match="output output is a view of input q_nope") as problem:
        store(worker_job, (q_nope, expected["lse"].clone()))
    assert problem.value.status == "REJECTED"
    with pytest.raises(handler.OutputProblem, match="view of input kv_indptr"):  # any overlap of bytes counts
        store(worker_job, (expected["output"].clone(), worker_job.inputs.sets[0]["kv_indptr"].view(torch.float32)[:3]))


def test_an_expanded_output_beside_an_input_is_no_view_of_it():
    """An output of one value expanded (stride 0) covers one element's bytes, not numel x size of them: counted so,
    one stored just below the arena read as a view of an input. A strided view into an input still counts."""
    arena = torch.zeros(1000, dtype=torch.bfloat16)
    inputs = {"q": arena[100:200]}
    assert handler._aliased_input(arena[99:100].expand(500), inputs) is None
    assert handler._aliased_input(arena[0:99:2], inputs) is None
    assert handler._aliased_input(arena[98:300:50], inputs) == "q"
    assert handler._aliased_input(arena[150:151].expand(4, 4), inputs) == "q"
