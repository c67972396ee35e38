"""Correctness checks (flashbench/run/check.py): infinities, NaN, tolerance edges, mismatch fraction,
and the order of shape / dtype / device / value checks in compare_outputs."""

import math

import pytest
import torch

from flashbench import Repo
from flashbench.model.definition import Tolerance
from flashbench.run import check
from flashbench.run.check import compare_outputs, output_error

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
    monkeypatch.setattr(check, "CHUNK_ELEMENTS", 3)
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


def host(tensors: dict, device: str = "cpu") -> dict:
    return {name: {"tensor": t.clone(), "device": device} for name, t in tensors.items()}


def test_compare_outputs_passes_identical_outputs_with_empty_requests(definition, expected):
    verdict = compare_outputs(definition, host(expected), expected, "cpu")
    assert verdict.passed, verdict.message
    assert set(verdict.errors) == {"output", "lse"}
    assert verdict.errors["lse"].max_abs_error == 0.0


def test_compare_outputs_shape(definition, expected):
    got = host(expected)
    got["output"]["tensor"] = got["output"]["tensor"][None]
    verdict = compare_outputs(definition, got, expected, "cpu")
    assert verdict.status == "INCORRECT_SHAPE" and "[1, 3, 16, 512]" in verdict.message


def test_compare_outputs_missing_output(definition, expected):
    got = host(expected)
    del got["lse"]
    assert compare_outputs(definition, got, expected, "cpu").status == "INCORRECT_SHAPE"


def test_compare_outputs_dtype(definition, expected):
    got = host(expected)
    got["output"]["tensor"] = got["output"]["tensor"].float()
    verdict = compare_outputs(definition, got, expected, "cpu")
    assert verdict.status == "INCORRECT_DTYPE" and "float32" in verdict.message


def test_compare_outputs_not_a_tensor(definition, expected):
    got = host(expected)
    got["lse"] = "not a torch.Tensor but numpy.ndarray"
    verdict = compare_outputs(definition, got, expected, "cpu")
    assert verdict.status == "INCORRECT_DTYPE" and "numpy" in verdict.message


def test_compare_outputs_wrong_device(definition, expected):
    verdict = compare_outputs(definition, host(expected, device="meta"), expected, "cpu")
    assert verdict.status == "RUNTIME_ERROR" and "meta" in verdict.message


def test_compare_outputs_finite_lse_for_an_empty_request_fails(definition, expected):
    got = host(expected)
    got["lse"]["tensor"][0] = -1e30
    verdict = compare_outputs(definition, got, expected, "cpu")
    assert verdict.status == "INCORRECT_NUMERICAL" and "lse" in verdict.message
    assert verdict.errors["lse"].max_abs_error == INF


def test_compare_outputs_poisoned_rows_fail(definition, expected):
    got = host(expected)
    got["output"]["tensor"][2] = NAN
    verdict = compare_outputs(definition, got, expected, "cpu")
    assert verdict.status == "INCORRECT_NUMERICAL" and "output output" in verdict.message
    assert verdict.errors["output"].mismatch_fraction == pytest.approx(1 / 3)
