"""Correctness: a solution's outputs against the reference's, judged by the definition's evaluator.

Pure: tensors in, a verdict and the worst errors out. `check_job` judges all the checked calls of a
job together (a sampling evaluator needs every sample at once); `compare_outputs` judges one call.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ...errors import FlashbenchError
from ...model import Definition, OutputError
from . import evaluators


@dataclass
class Verdict:
    status: str = "PASSED"
    message: str = ""
    errors: dict[str, OutputError] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "PASSED"


@dataclass
class CheckedCall:
    label: str  # says which call, in a failure's message ("timed call 7 of 40")
    outputs: dict[str, torch.Tensor]  # read from the call's slot right after its batch
    expected: dict[str, torch.Tensor]  # the reference on the call's inputs


def check_job(definition: Definition, calls: list[CheckedCall], repeat: tuple[int, int] | None = None,
              compute_on="cpu", seed: int = 0) -> Verdict:
    """The verdict on a job's checked calls: the first failing call's, else a pass whose errors are the
    worst seen per output (a sampling evaluator: over all the calls' samples, `seed` drawing its
    randomisation; with reference: samples, `expected` holds what evaluators.reference_samples
    returns, the reference's draws and scores, or just one draw per output). `repeat` names two calls made on identical inputs: a deterministic evaluator also
    requires them to agree (else a race), while two samplings may differ."""
    if definition.evaluator.kind == "sampling":
        return _sampling_verdict(definition, calls, compute_on, seed)
    worst: dict[str, OutputError] = {}
    for call in calls:
        verdict = compare_outputs(definition, call.outputs, call.expected, compute_on)
        if not verdict.passed:
            verdict.message = f"{call.label}: {verdict.message}"
            return verdict
        for name, error in verdict.errors.items():
            worst[name] = _worse(worst.get(name), error)
    if repeat is not None:
        again = compare_outputs(definition, calls[repeat[1]].outputs, calls[repeat[0]].outputs, compute_on)
        if not again.passed:
            return Verdict("REJECTED", f"outputs change between identical calls: {again.message}")
    return Verdict(errors=worst)


def _worse(known: OutputError | None, error: OutputError) -> OutputError:
    """Each statistic at its worst over the checked calls."""
    if known is None:
        return error
    return OutputError(max_abs_error=max(known.max_abs_error, error.max_abs_error),
                       max_rel_error=max(known.max_rel_error, error.max_rel_error),
                       mismatch_fraction=max(known.mismatch_fraction, error.mismatch_fraction))


def compare_outputs(definition: Definition, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                    compute_on="cpu") -> Verdict:
    """One call's outputs against the reference's, element by element (any evaluator but sampling), the
    arithmetic on `compute_on`: an idle GPU compares gigabytes in milliseconds. `got` is what the judge
    read from the call's output slot, so its shape and dtype are the declared ones."""
    if definition.evaluator.kind == "sampling":  # its reference returns probabilities or other samples
        raise ValueError(f"{definition.name} samples its outputs: judge its calls together with check_job")
    verdict = Verdict()
    for name in definition.outputs:
        with _reference_errors(definition, name):
            error, bad, outside = _element_errors(definition, name, got[name], expected[name], compute_on)
        verdict.errors[name] = error
        if bad and verdict.passed:
            verdict.status = "INCORRECT_NUMERICAL"
            verdict.message = (
                f"output {name}: {error.mismatch_fraction:.2%} of elements {outside} "
                f"(max abs error {error.max_abs_error:.3g}, max rel error {error.max_rel_error:.3g})"
            )
    return verdict


def _element_errors(definition: Definition, name: str, got: torch.Tensor, expected: torch.Tensor,
                    compute_on) -> tuple[OutputError, bool, str]:
    """One output's errors, whether they fail, and what a failing element is, in words."""
    evaluator = definition.evaluator
    if evaluator.kind == "bitwise":
        return *evaluators.bitwise_error(got, expected, compute_on), "different from the reference's bits"
    if evaluator.kind == "quantized":
        steps = f"more than {evaluator.steps:g} step(s) of {definition.outputs[name].dtype} away"
        return *evaluators.quantized_error(got, expected, evaluator, compute_on), steps
    return *output_error(got, expected, definition.tolerance(name), compute_on), "outside atol/rtol"


@contextmanager
def _reference_errors(definition: Definition, output: str):
    """A reference whose outputs do not fit the evaluator is the definition's error: it names the definition."""
    try:
        yield
    except evaluators.ReferenceMismatch as exc:
        raise FlashbenchError(f"output {output}: {exc}", definition.name, "reference") from None


def _sampling_verdict(definition: Definition, calls: list[CheckedCall], compute_on, seed: int) -> Verdict:
    verdict = Verdict()
    generator = torch.Generator().manual_seed(seed)
    for name in definition.outputs:
        with _reference_errors(definition, name):
            if definition.evaluator.reference == "samples":  # the reference's draws (and the inputs' support)
                drawn = [(call.label, call.outputs[name], call.expected[name],
                          call.expected.get(name + evaluators.SCORES_KEY)) for call in calls]
                found = evaluators.check_reference_samples(definition, name, drawn, generator, compute_on)
            else:
                samples = [(call.label, call.outputs[name], call.expected[name]) for call in calls]
                found = evaluators.check_samples(definition, samples, generator, compute_on)
        verdict.errors[name] = found.error
        if found.problem and verdict.passed:
            verdict.status = "INCORRECT_NUMERICAL"
            verdict.message = f"output {name}: {found.problem}"
    return verdict


def output_error(got: torch.Tensor, expected: torch.Tensor, tolerance, device="cpu") -> tuple[OutputError, bool]:
    """Error statistics and whether they exceed the tolerance (allclose), computed in float64 on `device`
    chunk by chunk. Matching same-sign infinities agree (an lse of -inf for an empty request); a NaN, or an
    infinity where the reference is finite, never passes."""
    totals = evaluators.error_totals(got, expected, lambda g, e: _chunk_errors(g, e, tolerance), device)
    outside, nevers, max_abs, max_rel = totals.tolist()
    mismatch = outside / max(got.numel(), 1)
    error = OutputError(max_abs_error=max_abs, max_rel_error=max_rel, mismatch_fraction=mismatch)
    # max_mismatch_fraction allows elements slightly outside the tolerance, never a NaN (e.g. an unwritten, poisoned
    # element) nor an infinity the reference does not have
    return error, mismatch > tolerance.max_mismatch_fraction or nevers > 0


def _chunk_errors(got: torch.Tensor, expected: torch.Tensor, tolerance) -> torch.Tensor:
    """[elements outside the tolerance, elements no tolerance passes, max abs error, max rel error] of one chunk."""
    expected64 = expected.double()
    difference, never, relative = evaluators.differences(got.double(), expected64)
    magnitude = torch.where(torch.isfinite(expected64), expected64.abs(), 0.0)
    outside = ~(difference <= tolerance.atol + tolerance.rtol * magnitude)
    return torch.stack([outside.sum().double(), never.sum().double(), difference.max(), relative.max()])
