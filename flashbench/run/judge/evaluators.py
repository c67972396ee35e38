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

Sampling against a reference that samples (`reference: samples`, FlashInfer-Bench's sampling
definitions, whose references call torch.multinomial). The judge runs the reference k =
`reference_draws` times per checked call on the call's inputs, each draw under a fresh seed of its
own (reference_samples), so each sample x of the solution has k reference draws y_1..y_k of the same
element. Two checks, over every checked call of a job:

- support, from the inputs alone (sample_scores), as far as they say; never narrower than the
  reference's own (its draws are checked too: one outside is the definition's error):
  * every sample is a category: 0 <= id < categories, the last axis of the input that holds the
    element's probabilities or logits (a float input named *prob* or *logit*, of shape
    [*output shape, categories]); with no such input, only id >= 0;
  * probabilities: a sample's probability is positive; logits: its logit is not -inf;
  * top_k (an integer input named top_k, per element or one for all): where 0 < k < categories, the
    sample is among the k largest (all those tied with the k-th kept);
  * top_p (a float input named top_p, likewise): the probability mass of the categories strictly
    more likely than the sample, normalised or as given, is at most top_p (+1e-3 for rounding):
    the weakest of the usual nucleus rules (top-k first or jointly), so no honest sampler fails it.
  Other filters (min_p, ...) are not derived: their support is left to the fit.
- fit: a two-sample test of x against y_1..y_k, element by element. Under equal distributions the
  k + 1 values of an element are exchangeable, so x's rank among them is uniform, whatever the
  element's distribution. Categories are ranked by the input's probability or logit where there
  is such an input (most likely first), then by how often they occur among the k + 1 values, then
  by id (functions of the inputs and of the values as a set, which keep the exchangeability), and
  u = (values ranked before x + U * copies of x) / (k + 1), U uniform in [0, 1) from the judge's
  seeded generator, is exactly uniform and independent from element to element. A sampler that
  favours likely (or unlikely) categories moves the u towards 0 (or 1); the test is the same
  Kolmogorov-Smirnov / DKW bound as above, failing an honest sampler with probability at most alpha.
  Calls that share the reference's draws (the repeated call of an input set) count once.

Power: below that of the test against the probabilities themselves, and low with few samples:
k = 1 draw (a reference store that runs the reference once) sees little. With 8 draws per checked
call and the input's probabilities to rank by, a temperature-0.5, argmax or flattened sampler fails
on 512 samples of peaked distributions (tests/test_evaluators.py: 16 checked calls of 32 rows); a
smaller bias needs more checked calls (--checked-calls) or more draws. A job checks at least
MIN_CHECKED_SAMPLES (run/options.py) samples of each output, whatever --checked-calls asks. Without a probability or
logit input, categories are ranked by their counts alone, which tells little where an element's
k + 1 values are mostly distinct (flat distributions over a large vocabulary): there the support
check is what has teeth.
"""

import math
import random
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
# The key, after an output's name, of its scores (support and order) among a samples reference's outputs.
SCORES_KEY = "@scores"
TOP_P_SLACK = 1e-3  # rounding allowance of the top-p support: float32 cumulative sums over 200k categories
_secret = random.SystemRandom()


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
    """|got - expected| (matching same-sign infinities agree; NaN is infinitely wrong), where no tolerance
    may pass an element (a NaN, or an infinity where the reference is finite: an element a mismatch
    fraction allowed to be a little off must not be a NaN or an infinity in the next layer), and the
    relative error."""
    same_infinity = torch.isinf(got64) & torch.isinf(expected64) & (torch.sign(got64) == torch.sign(expected64))
    difference = torch.where(same_infinity, 0.0, (got64 - expected64).abs())
    nan = torch.isnan(difference)
    never = nan | (torch.isinf(got64) & torch.isfinite(expected64))
    difference = torch.where(nan, float("inf"), difference)
    relative = torch.nan_to_num(difference / expected64.abs().clamp_min(1e-6), nan=float("inf"), posinf=float("inf"))
    return difference, never, torch.where(same_infinity, 0.0, relative)


def bitwise_error(got: torch.Tensor, expected: torch.Tensor, device="cpu") -> tuple[OutputError, bool]:
    """Elements whose bits differ from the reference's converted to got's dtype; any NaN fails."""
    expected = _converted(expected, got.dtype)
    totals = error_totals(got, expected, _bitwise_chunk, device)
    outside, nevers, max_abs, max_rel = totals.tolist()
    mismatch = outside / max(got.numel(), 1)
    return OutputError(max_abs_error=max_abs, max_rel_error=max_rel, mismatch_fraction=mismatch), outside + nevers > 0


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
    difference, never, relative = differences(_unpacked(got).double(), _unpacked(expected).double())
    return torch.stack([differ.sum().double(), never.sum().double(), difference.max(), relative.max()])


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
    outside, nevers, max_abs, max_rel = totals.tolist()
    mismatch = outside / max(got.numel(), 1)
    error = OutputError(max_abs_error=max_abs, max_rel_error=max_rel, mismatch_fraction=mismatch)
    return error, mismatch > spec.max_mismatch_fraction or nevers > 0


def _quantized_chunk(got: torch.Tensor, expected: torch.Tensor, steps: float, dtype: torch.dtype) -> torch.Tensor:
    expected64 = expected.double()
    difference, never, relative = differences(got.double(), expected64)
    outside = ~(difference <= steps * quantization_step(expected64, dtype))
    return torch.stack([outside.sum().double(), never.sum().double(), difference.max(), relative.max()])


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
        problem = problem or _outside_support(label, ids, inside, "probability 0, or no such category")
    error, distance, bound, n = _uniformity(transforms, outside, total, definition.evaluator.false_failure_probability)
    alpha = definition.evaluator.false_failure_probability
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


def samples_reference(definition: Definition) -> bool:
    """Whether the definition's reference samples (evaluator sampling, reference: samples)."""
    return definition.evaluator.kind == "sampling" and definition.evaluator.reference == "samples"


def reference_sampler_source(definition: Definition) -> str:
    """Python source to append to a sampling definition's reference so that it samples: its run then
    draws one category per element from the distribution the reference returns, in the output's dtype.
    The reference runs as a candidate like any solution (timed, the speedups' denominator). Nothing
    for a reference that samples already (reference: samples)."""
    if samples_reference(definition):
        return ""
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
    if samples_reference(definition):
        return reference
    namespace = {"run": reference}
    exec(reference_sampler_source(definition), namespace)  # our own source, not a solution's
    return namespace["run"]


# --- sampling against a reference that samples (reference: samples) -------------------------------

def reference_samples(definition: Definition, reference: Callable, inputs: dict,
                      seeds: list[int] | None = None) -> dict[str, torch.Tensor]:
    """CPU copies of the reference's draws on `inputs` (by input name): per output, its
    `reference_draws` draws stacked, shape [draws, *output shape], each drawn after torch.manual_seed
    of a seed of its own (`seeds`, else fresh secret ones: never a worker's), torch's generators left
    as they were; and, under the output's name + SCORES_KEY, its scores (sample_scores)."""
    count = definition.evaluator.reference_draws
    seeds = seeds if seeds is not None else [_secret.getrandbits(63) for _ in range(count)]
    cuda = sorted({t.device.index or 0 for t in inputs.values() if isinstance(t, torch.Tensor) and t.is_cuda})
    arguments = [inputs[name] for name in definition.inputs]
    drawn: dict[str, list[torch.Tensor]] = {name: [] for name in definition.outputs}
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        for seed in seeds:
            torch.manual_seed(seed)
            returned = reference(*arguments)
            returned = returned if isinstance(returned, (tuple, list)) else (returned,)
            for name, tensor in zip(definition.outputs, returned):
                drawn[name].append(torch.as_tensor(tensor).detach().to("cpu"))
    found = {name: torch.stack(tensors).contiguous() for name, tensors in drawn.items()}
    for name, scores in sample_scores(definition, inputs).items():
        found[name + SCORES_KEY] = scores.to("cpu")
    return found


def _weights_input(definition: Definition, output: str) -> tuple[str, str] | None:
    """(name, "prob" or "logit") of the float input holding each element's probabilities or logits:
    named so, of shape [*output shape, categories]; None when there is none or several."""
    shape = definition.outputs[output].shape
    found = []
    for name, spec in definition.inputs.items():
        kind = "logit" if "logit" in name.lower() else "prob" if "prob" in name.lower() else None
        if (kind and spec.shape is not None and spec.dtype.startswith(("float", "bfloat"))
                and len(spec.shape) == len(shape) + 1 and spec.shape[:-1] == shape):
            found.append((name, kind))
    return found[0] if len(found) == 1 else None


def _parameter(definition: Definition, output: str, name: str, integer: bool) -> str | None:
    """The input `name` when it is a per-element (or single) parameter of the output's elements."""
    spec = definition.inputs.get(name)
    if spec is None or (spec.shape is not None and spec.shape != definition.outputs[output].shape and spec.shape):
        return None
    return name if (spec.dtype.startswith("int") if integer else spec.dtype.startswith(("float", "bfloat"))) else None


def sample_categories(definition: Definition, output: str) -> int | None:
    """The number of categories of an output's samples when the definition fixes it (a const axis)."""
    weights = _weights_input(definition, output)
    if weights is None:
        return None
    axis = definition.axes[definition.inputs[weights[0]].shape[-1]]
    return axis.value if axis.type == "const" else None


def sample_scores(definition: Definition, inputs: dict) -> dict[str, torch.Tensor]:
    """Per output whose probabilities or logits are an input: float32 [*output shape, categories],
    the input's value where a sample may lie (the support the module's docstring derives) and -inf
    where none may; on the inputs' device."""
    masks = {}
    for output in definition.outputs:
        weights = _weights_input(definition, output)
        if weights is None or not isinstance(inputs.get(weights[0]), torch.Tensor):
            continue
        values = inputs[weights[0]].double()
        values = values.reshape(-1, values.shape[-1])
        rows, categories = values.shape
        allowed = values > 0 if weights[1] == "prob" else values > -math.inf  # NaN is never allowed
        order = torch.where(allowed, values, -math.inf)
        top_k = _parameter(definition, output, "top_k", integer=True)
        if top_k is not None:
            k = torch.as_tensor(inputs[top_k], device=values.device).reshape(-1).long().expand(rows)
            filtered = (k > 0) & (k < categories)
            kth = order.sort(dim=1, descending=True).values.gather(1, k.clamp(1, categories)[:, None] - 1)
            allowed &= ~filtered[:, None] | (order >= kth)
        top_p = _parameter(definition, output, "top_p", integer=False)
        if top_p is not None:
            p = torch.as_tensor(inputs[top_p], device=values.device).double().reshape(-1).expand(rows)
            allowed &= _within_top_p(order, weights[1], p)
        scored = torch.where(allowed, order, -math.inf).float()
        masks[output] = torch.where(allowed, scored.clamp_min(torch.finfo(torch.float32).min), -math.inf)
        masks[output] = masks[output].reshape(inputs[weights[0]].shape)
    return masks


def _within_top_p(order: torch.Tensor, kind: str, p: torch.Tensor) -> torch.Tensor:
    """Categories whose more likely ones hold at most p of the mass (as given or normalised), rows a
    chunk at a time."""
    inside = []
    step = max(1, CHUNK_ELEMENTS // max(order.shape[1], 1))
    for start in range(0, order.shape[0], step):
        values = order[start:start + step]
        mass = torch.softmax(values, dim=1) if kind == "logit" else values.clamp_min(0)
        ordered, index = mass.sort(dim=1, descending=True)
        cumulative = ordered.cumsum(1)
        # the mass strictly before each sorted position's value (ties: before the first of them)
        before = cumulative - ordered
        first = torch.searchsorted(-ordered.contiguous(), -ordered.contiguous(), side="left")
        before = before.gather(1, first)
        totals = cumulative[:, -1:].clamp_min(1e-300)
        limit = p[start:start + step, None] + TOP_P_SLACK
        keep_sorted = (before <= limit) | (before / totals <= limit)
        inside.append(torch.zeros_like(keep_sorted).scatter(1, index, keep_sorted))
    return torch.cat(inside)


def check_reference_samples(definition: Definition, output: str,
                            calls: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]],
                            generator: torch.Generator, device="cpu") -> SampleCheck:
    """One output's samples over a job's checked calls, each (label, samples, the reference's draws
    [draws, *shape] or one draw [*shape], the scores of sample_scores or None): support, then the
    two-sample fit (the module's docstring). `generator` draws the ranks' uniforms, call by call."""
    categories = sample_categories(definition, output)
    ranks, outside, total, problem, seen, draws_per_sample = [], 0, 0, None, set(), 0
    for label, samples, draws, scores in calls:
        draws = _reference_draws(samples, draws)
        draws_per_sample = draws.shape[0]
        ids = samples.reshape(-1).to(torch.int64)
        drawn = draws.reshape(draws.shape[0], -1).to(torch.int64).T  # [samples, draws]
        limit = scores.shape[-1] if scores is not None else categories
        rows = None if scores is None else scores.reshape(-1, scores.shape[-1])
        if rows is not None and rows.shape[0] != ids.numel():
            raise ReferenceMismatch(f"the scores of shape {list(scores.shape)} do not fit samples of shape "
                                    f"{list(samples.shape)}")
        if not _in_support(drawn, rows, limit).all():
            raise ReferenceMismatch("the reference's own samples lie outside the support its inputs give (range, "
                                    "probability 0, top_k, top_p): its inputs are not what evaluator 'sampling' "
                                    "assumes of inputs so named; rename them, or use reference: distribution")
        inside = _in_support(ids[:, None], rows, limit)[:, 0]
        uniforms = torch.rand(ids.numel(), generator=generator, dtype=torch.float64)
        key = (draws.data_ptr(), tuple(draws.shape))  # the repeated call of an input set shares its draws
        if key not in seen:
            seen.add(key)
            ranks.append(on_device_or_host(lambda on: _ranks(ids, drawn, rows, uniforms, on), device)[inside])
        outside += int((~inside).sum())
        total += ids.numel()
        problem = problem or _outside_support(label, ids, inside, _support_words(limit, rows is not None))
    error, distance, bound, n = _uniformity(ranks, outside, total, definition.evaluator.false_failure_probability)
    alpha = definition.evaluator.false_failure_probability
    if problem is None and distance > bound:
        problem = (f"the {n} samples of {len(seen)} checked calls do not follow the reference's distribution: "
                   f"Kolmogorov-Smirnov distance {distance:.3g} of their ranks among the reference's "
                   f"{draws_per_sample} draws per sample from uniform, over the bound {bound:.3g} for a "
                   f"false-failure probability of {alpha:g}")
    return SampleCheck(error, problem)


def _outside_support(label: str, ids: torch.Tensor, inside: torch.Tensor, support: str) -> str | None:
    """The message for a call's samples outside the support, naming the first; None when all lie inside."""
    if inside.all():
        return None
    first = int((~inside).nonzero()[0])
    return (f"{label}: {int((~inside).sum())} of {ids.numel()} samples lie outside the support "
            f"({support}): element {first} is {int(ids[first])}")


def _uniformity(values: list[torch.Tensor], outside: int, total: int, alpha: float):
    """The KS distance of values that are uniform on [0, 1) for an honest sampler, the DKW bound it must
    stay under (false failure at most `alpha`), the error figures a trace records, and how many values."""
    distance = uniform_distance(torch.cat(values) if values else torch.empty(0, dtype=torch.float64))
    n = sum(v.numel() for v in values)
    bound = math.sqrt(math.log(2 / alpha) / (2 * n)) if n else math.inf
    error = OutputError(max_abs_error=distance, max_rel_error=distance / bound,
                        mismatch_fraction=outside / max(total, 1))
    return error, distance, bound, n


def _reference_draws(samples: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The reference's draws as [draws, *samples' shape]; ReferenceMismatch when they are no samples."""
    shape = list(samples.shape)
    if draws.is_floating_point() or draws.is_complex() or draws.dtype == torch.bool:
        raise ReferenceMismatch(f"the reference returns {dtype_name(draws.dtype)}; evaluator 'sampling' with "
                                "reference: samples needs sample ids (a reference that returns probabilities "
                                "needs reference: distribution)")
    if list(draws.shape) == shape:
        return draws[None]
    if list(draws.shape[1:]) != shape or not draws.shape[0]:
        raise ReferenceMismatch(f"the reference returns shape {list(draws.shape)}; evaluator 'sampling' with "
                                f"reference: samples needs samples of shape {shape}")
    return draws


def _in_support(ids: torch.Tensor, rows: torch.Tensor | None, categories: int | None) -> torch.Tensor:
    """ids [samples, m]: whether each is a category (below `categories` when known) its row of scores allows."""
    valid = ids >= 0
    if categories is not None:
        valid &= ids < categories
    if rows is not None:
        valid &= rows.gather(1, ids.clamp(0, rows.shape[1] - 1)) > -math.inf
    return valid


def _support_words(categories: int | None, masked: bool) -> str:
    if masked:
        return "no such category, or one the inputs exclude: probability 0, past top_k or top_p"
    return f"no such category: ids are 0 to {categories - 1}" if categories is not None else "a negative id"


def _ranks(ids: torch.Tensor, drawn: torch.Tensor, rows: torch.Tensor | None, uniforms: torch.Tensor,
           device) -> torch.Tensor:
    """Per sample, its randomised rank among itself and the reference's draws of its element, in
    [0, 1): categories ranked by their score in `rows` (highest first; none: all equal), then by their
    count among those values (most first), then by id."""
    ranks = []
    step = max(1, CHUNK_ELEMENTS // (drawn.shape[1] + 1) ** 2)
    for start in range(0, ids.numel(), step):
        x = ids[start:start + step].to(device)
        values = torch.cat([x[:, None], drawn[start:start + step].to(device)], dim=1)  # [n, k + 1]
        if rows is None:
            score = torch.zeros(values.shape, device=device)
        else:
            score = rows[start:start + step].to(device).gather(1, values.clamp(0, rows.shape[1] - 1))
        counts = (values[:, :, None] == values[:, None, :]).sum(2)  # each value's copies among the k + 1
        mine, my_score = counts[:, :1], score[:, :1]
        level = (score == my_score) & (counts == mine)
        before = ((score > my_score) | ((score == my_score) & (counts > mine)) | (level & (values < x[:, None]))).sum(1)
        u = (before + uniforms[start:start + step].to(device) * mine[:, 0]) / values.shape[1]
        ranks.append(u.double().clamp(0, 1).cpu())
    return torch.cat(ranks) if ranks else torch.empty(0, dtype=torch.float64)
