"""Correctness: a solution's outputs against the reference's, with the definition's tolerances."""

from dataclasses import dataclass, field

import torch

from ...model import Definition, OutputError


@dataclass
class Verdict:
    status: str = "PASSED"
    message: str = ""
    errors: dict[str, OutputError] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "PASSED"


def compare_outputs(definition: Definition, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                    compute_on="cpu") -> Verdict:
    """Every output's values against the reference's, within the definition's tolerances (the
    arithmetic on `compute_on`: an idle GPU compares gigabytes in milliseconds). `got` is what the
    judge read from the call's output slot, so its shape and dtype are the declared ones."""
    verdict = Verdict()
    for name in definition.outputs:
        error, bad = output_error(got[name], expected[name], definition.tolerance(name), compute_on)
        verdict.errors[name] = error
        if bad and verdict.passed:
            verdict.status = "INCORRECT_NUMERICAL"
            verdict.message = (
                f"output {name}: {error.mismatch_fraction:.2%} of elements outside atol/rtol "
                f"(max abs error {error.max_abs_error:.3g}, max rel error {error.max_rel_error:.3g})"
            )
    return verdict


# Elements compared at a time: bounds the float64 temporaries of one comparison to a few hundred MB
# however large the output (a prefill's can be gigabytes).
CHUNK_ELEMENTS = 1 << 24


def output_error(got: torch.Tensor, expected: torch.Tensor, tolerance, device="cpu") -> tuple[OutputError, bool]:
    """Error statistics and whether they exceed the tolerance, computed in float64 on `device`
    chunk by chunk. Matching same-sign infinities agree (an lse of -inf for an empty request);
    NaN never passes."""
    got, expected = got.reshape(-1), expected.reshape(-1)
    try:
        totals = _error_totals(got, expected, tolerance, device)
    except torch.cuda.OutOfMemoryError:  # a solution's worker may hold the GPU's memory: the host is slower, never wrong
        totals = _error_totals(got, expected, tolerance, "cpu")
    max_abs, max_rel, outside, nans = totals.tolist()
    mismatch = outside / max(got.numel(), 1)
    error = OutputError(max_abs_error=max_abs, max_rel_error=max_rel, mismatch_fraction=mismatch)
    # max_mismatch_fraction allows elements slightly outside the tolerance, never a NaN (e.g. an unwritten, poisoned element)
    return error, mismatch > tolerance.max_mismatch_fraction or nans > 0


def _error_totals(got: torch.Tensor, expected: torch.Tensor, tolerance, device) -> torch.Tensor:
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # max abs, max rel, outside, NaNs
    for start in range(0, got.numel(), CHUNK_ELEMENTS):
        chunk = slice(start, start + CHUNK_ELEMENTS)
        totals = _combine(totals, _chunk_errors(got[chunk].to(device), expected[chunk].to(device), tolerance))
    return totals


def _combine(totals: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.maximum(totals[0], chunk[0]), torch.maximum(totals[1], chunk[1]),
                        totals[2] + chunk[2], totals[3] + chunk[3]])


def _chunk_errors(got: torch.Tensor, expected: torch.Tensor, tolerance) -> torch.Tensor:
    """[max abs error, max rel error, elements outside the tolerance, NaN differences] of one chunk."""
    got64, expected64 = got.double(), expected.double()
    same_infinity = torch.isinf(got64) & torch.isinf(expected64) & (torch.sign(got64) == torch.sign(expected64))
    difference = torch.where(same_infinity, 0.0, (got64 - expected64).abs())
    nan = torch.isnan(difference)
    difference = torch.where(nan, float("inf"), difference)  # NaN anywhere is infinitely wrong; inf stays inf
    magnitude = torch.where(torch.isfinite(expected64), expected64.abs(), 0.0)
    outside = ~(difference <= tolerance.atol + tolerance.rtol * magnitude)
    relative = torch.nan_to_num(difference / expected64.abs().clamp_min(1e-6), nan=float("inf"), posinf=float("inf"))
    relative = torch.where(same_infinity, 0.0, relative)
    return torch.stack([difference.max(), relative.max(), outside.sum().double(), nan.sum().double()])
