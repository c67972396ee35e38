"""The arithmetic of the evaluators a definition chooses (model/definition.py): element-wise errors
computed in float64 chunk by chunk, bit-for-bit and quantisation-step comparisons, and the test of
sampled outputs against the reference's probabilities.

Sampling, exactly. Each output holds independent samples; the reference returns, per output, weights
of shape [*output shape, categories] (finite, non-negative, not all zero; the distribution of an
element is its row divided by the row's sum). Two checks, over every checked call of a job:

- support: every sample is a category (0 <= id < categories) of positive probability. An honest
  sampler never fails it.
- fit: each sample x of a row p becomes u = P(ranked before x) + U * p(x), categories ranked by
  descending probability (ties by id) and U uniform in [0, 1) from the judge's seeded generator. For
  samples drawn from p, the u are independent and exactly uniform (the randomised probability
  integral transform), whatever the rows; a sampler that favours likely (or unlikely) categories
  moves them towards 0 (or 1). The test fails when the Kolmogorov-Smirnov distance D of the n values
  from uniform exceeds eps = sqrt(ln(2 / alpha) / (2 n)): by the Dvoretzky-Kiefer-Wolfowitz
  inequality (Massart's constant), an honest sampler fails with probability at most alpha, for every n.

Recorded per output (OutputError): mismatch_fraction, the share of samples outside the support;
max_abs_error, D; max_rel_error, D / eps (above 1 fails). The test sees a bias once it moves the
transforms' distribution by about eps: more checked calls (or rows) find smaller ones.

Where the reference runs in place of a solution (a run's reference candidate, `best` without one), it
samples the distributions it returns: reference_sampler_source.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...dtypes import dtype_name
from ...model import Definition, OutputError
from ...model.definition import Quantized

# Elements compared at a time: bounds the float64 temporaries of one comparison to a few hundred MB
# however large the output (a prefill's can be gigabytes).
CHUNK_ELEMENTS = 1 << 24

_FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)
# The 16 values of a float4_e2m1 nibble; torch packs two per byte, the first element in the low nibble.
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReferenceMismatch(ValueError):
    """The reference's outputs do not fit the definition's evaluator: a definition error, not a verdict."""


def on_device_or_host(compute: Callable, device):
    """compute(device), or compute("cpu") when the device has no memory left (a solution's worker may
    hold it all): the host is slower, never wrong."""
    try:
        return compute(device)
    except torch.cuda.OutOfMemoryError:
        return compute("cpu")


def error_totals(got: torch.Tensor, expected: torch.Tensor, chunk_errors: Callable, device="cpu") -> torch.Tensor:
    """[elements outside, NaNs, max abs error, max rel error] over flattened tensors, from
    chunk_errors(got chunk, expected chunk) on `device`, CHUNK_ELEMENTS at a time."""
    got, expected = got.reshape(-1), expected.reshape(-1)

    def compute(on) -> torch.Tensor:
        totals = torch.zeros(4, dtype=torch.float64, device=on)
        for start in range(0, got.numel(), CHUNK_ELEMENTS):
            chunk = slice(start, start + CHUNK_ELEMENTS)
            found = chunk_errors(got[chunk].to(on), expected[chunk].to(on))
            totals = torch.cat([totals[:2] + found[:2], torch.maximum(totals[2:], found[2:])])
        return totals

    return on_device_or_host(compute, device)


def differences(got64: torch.Tensor, expected64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|got - expected| (matching same-sign infinities agree; NaN is infinitely wrong), where a NaN
    was, and the relative error."""
    same_infinity = torch.isinf(got64) & torch.isinf(expected64) & (torch.sign(got64) == torch.sign(expected64))
    difference = torch.where(same_infinity, 0.0, (got64 - expected64).abs())
    nan = torch.isnan(difference)
    difference = torch.where(nan, float("inf"), difference)
    relative = torch.nan_to_num(difference / expected64.abs().clamp_min(1e-6), nan=float("inf"), posinf=float("inf"))
    return difference, nan, torch.where(same_infinity, 0.0, relative)


def bitwise_error(got: torch.Tensor, expected: torch.Tensor, device="cpu") -> tuple[OutputError, bool]:
    """Elements whose bits differ from the reference's converted to got's dtype; any NaN fails."""
    expected = _converted(expected, got.dtype)
    totals = error_totals(got, expected, _bitwise_chunk, device)
    outside, nans, max_abs, max_rel = totals.tolist()
    mismatch = outside / max(got.numel(), 1)
    return OutputError(max_abs_error=max_abs, max_rel_error=max_rel, mismatch_fraction=mismatch), outside + nans > 0


def _converted(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if expected.dtype == dtype:
        return expected
    try:
        return expected.to(dtype)
    except RuntimeError:  # torch converts nothing to packed float4
        raise ReferenceMismatch(f"the reference returns {dtype_name(expected.dtype)}, which torch cannot convert to "
                                f"{dtype_name(dtype)}; return {dtype_name(dtype)}") from None


def _bitwise_chunk(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    differ = _bits(got) != _bits(expected)
    difference, nan, relative = differences(_unpacked(got).double(), _unpacked(expected).double())
    return torch.stack([differ.sum().double(), nan.sum().double(), difference.max(), relative.max()])


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_SAME_WIDTH_INTEGER[tensor.element_size()])


def quantized_error(got: torch.Tensor, expected: torch.Tensor, spec: Quantized,
                    device="cpu") -> tuple[OutputError, bool]:
    """Elements more than spec.steps quantisation steps of got's dtype from the reference; any NaN fails."""
    dtype = got.dtype
    if (dtype == _FLOAT4) != (expected.dtype == _FLOAT4):
        raise ReferenceMismatch(f"the reference returns {dtype_name(expected.dtype)} for a {dtype_name(dtype)} output; "
                                "packed float4 is compared with packed float4 only")
    got, expected = _unpacked(got), _unpacked(expected)
    totals = error_totals(got, expected, lambda g, e: _quantized_chunk(g, e, spec.steps, dtype), device)
    outside, nans, max_abs, max_rel = totals.tolist()
    mismatch = outside / max(got.numel(), 1)
    error = OutputError(max_abs_error=max_abs, max_rel_error=max_rel, mismatch_fraction=mismatch)
    return error, mismatch > spec.max_mismatch_fraction or nans > 0


def _quantized_chunk(got: torch.Tensor, expected: torch.Tensor, steps: float, dtype: torch.dtype) -> torch.Tensor:
    expected64 = expected.double()
    difference, nan, relative = differences(got.double(), expected64)
    outside = ~(difference <= steps * quantization_step(expected64, dtype))
    return torch.stack([outside.sum().double(), nan.sum().double(), difference.max(), relative.max()])


def quantization_step(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s values at |values| (float64): eps * 2^floor(log2 |v|), no finer than at
    the smallest normal (subnormals are evenly spaced); 1 for integers."""
    if not dtype.is_floating_point:
        return torch.ones_like(values)
    info = None if dtype == _FLOAT4 else torch.finfo(dtype)  # torch has no finfo of packed float4
    eps, smallest_normal = (0.5, 1.0) if info is None else (info.eps, info.smallest_normal)
    _, exponent = torch.frexp(values.abs().clamp_min(smallest_normal))  # |v| = m * 2^exponent, m in [0.5, 1)
    return torch.ldexp(torch.full_like(values, eps), exponent - 1)


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    """Packed float4 as its values (twice as many, flattened); any other tensor as it is."""
    if tensor.dtype != _FLOAT4:
        return tensor
    packed = tensor.view(torch.uint8).reshape(-1).long()
    return _E2M1_VALUES.to(tensor.device)[torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)]


@dataclass
class SampleCheck:
    error: OutputError
    problem: str | None  # why the samples fail, in one line; None when they pass


def check_samples(definition: Definition, calls: list[tuple[str, torch.Tensor, torch.Tensor]],
                  generator: torch.Generator, device="cpu") -> SampleCheck:
    """One output's samples over a job's checked calls, each (label, samples, the reference's weights):
    support, then fit (the module's docstring). `generator` draws the transform's uniforms, call by call."""
    transforms, outside, total, problem = [], 0, 0, None
    for label, samples, weights in calls:
        rows = _rows(samples, weights)
        ids = samples.reshape(-1).to(torch.int64)
        uniforms = torch.rand(ids.numel(), generator=generator, dtype=torch.float64)
        inside, transform = on_device_or_host(lambda on: _transform(rows, ids, uniforms, on), device)
        transforms.append(transform[inside])
        outside += int((~inside).sum())
        total += ids.numel()
        if problem is None and not inside.all():
            first = int((~inside).nonzero()[0])
            problem = (f"{label}: {int((~inside).sum())} of {ids.numel()} samples lie outside the support "
                       f"(probability 0, or no such category): element {first} is {int(ids[first])}")
    distance = uniform_distance(torch.cat(transforms) if transforms else torch.empty(0, dtype=torch.float64))
    n = sum(t.numel() for t in transforms)
    alpha = definition.evaluator.false_failure_probability
    bound = math.sqrt(math.log(2 / alpha) / (2 * n)) if n else math.inf
    error = OutputError(max_abs_error=distance, max_rel_error=distance / bound,
                        mismatch_fraction=outside / max(total, 1))
    if problem is None and distance > bound:
        problem = (f"the {n} samples of {len(calls)} checked calls do not follow the reference's probabilities: "
                   f"Kolmogorov-Smirnov distance {distance:.3g} of their probability integral transforms from "
                   f"uniform, over the bound {bound:.3g} for a false-failure probability of {alpha:g}")
    return SampleCheck(error, problem)


def _rows(samples: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reference's weights as [samples, categories] (normalised a chunk at a time, by _transform);
    ReferenceMismatch when they are no distributions of the samples' shape."""
    if list(weights.shape[:-1]) != list(samples.shape) or weights.dim() != samples.dim() + 1 or not weights.shape[-1]:
        raise ReferenceMismatch(f"the reference returns shape {list(weights.shape)}; evaluator 'sampling' needs "
                                f"probabilities of shape {list(samples.shape) + ['categories']}")
    rows = weights.reshape(samples.numel(), weights.shape[-1])
    if not (torch.isfinite(rows).all() and (rows >= 0).all() and (rows > 0).any(1).all()):
        raise ReferenceMismatch("the reference returns weights that are negative, not finite, or all zero in a row; "
                                "evaluator 'sampling' needs probabilities")
    return rows


def _transform(rows: torch.Tensor, ids: torch.Tensor, uniforms: torch.Tensor,
               device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: whether it lies in the support, and its randomised probability integral transform
    (categories by descending probability, ties by id), rows a chunk at a time."""
    inside, transform = [], []
    step = max(1, CHUNK_ELEMENTS // max(rows.shape[1], 1))
    for start in range(0, rows.shape[0], step):
        p = rows[start:start + step].to(device).double()
        p = p / p.sum(1, keepdim=True)
        x = ids[start:start + step].to(device)
        category = torch.arange(p.shape[1], device=device)
        valid = (x >= 0) & (x < p.shape[1])
        px = p.gather(1, x.clamp(0, p.shape[1] - 1)[:, None])
        before = (p > px) | ((p == px) & (category[None, :] < x[:, None]))
        px = px.squeeze(1)
        inside.append((valid & (px > 0)).cpu())
        u = (p * before).sum(1) + uniforms[start:start + step].to(device) * px
        transform.append(u.clamp(0, 1).cpu())
    empty = torch.empty(0)
    return (torch.cat(inside) if inside else empty.bool()), (torch.cat(transform) if transform else empty.double())


def uniform_distance(values: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of the empirical distribution of `values` from uniform on [0, 1]."""
    n = values.numel()
    if not n:
        return 0.0
    ordered = values.double().sort().values
    rank = torch.arange(1, n + 1, dtype=torch.float64)
    return max((rank / n - ordered).max().item(), (ordered - (rank - 1) / n).max().item())


def reference_sampler_source(definition: Definition) -> str:
    """Python source to append to a sampling definition's reference so that it samples: its run then
    draws one category per element from the distribution the reference returns, in the output's dtype.
    The reference runs as a candidate like any solution (timed, the speedups' denominator)."""
    dtypes = [spec.dtype for spec in definition.outputs.values()]
    return f'''

import torch as _torch

_OUTPUT_DTYPES = {dtypes!r}
_distribution = run


def run(*inputs):
    returned = _distribution(*inputs)
    weights = returned if isinstance(returned, (tuple, list)) else (returned,)
    drawn = [_torch.multinomial(w.reshape(-1, w.shape[-1]).double(), 1).reshape(w.shape[:-1]).to(getattr(_torch, dtype))
             for w, dtype in zip(weights, _OUTPUT_DTYPES)]
    return drawn[0] if len(drawn) == 1 else tuple(drawn)
'''


def reference_sampler(reference: Callable, definition: Definition) -> Callable:
    """The reference of a sampling definition made a sampler in this process, by the same source."""
    namespace = {"run": reference}
    exec(reference_sampler_source(definition), namespace)  # our own source, not a solution's
    return namespace["run"]
