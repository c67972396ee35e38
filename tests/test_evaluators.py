"""Evaluators chosen by the definition (model/definition.py `evaluator`, run/judge/evaluators.py,
check.py check_job): how the field loads and what it refuses; bitwise and quantized comparisons of
low-bit and packed outputs; sampled outputs against the reference's probabilities (support and
goodness of fit). Honest outputs pass and wrong ones fail, every draw seeded."""

from pathlib import Path

import pytest
import torch

from flashbench import FlashbenchError, Repo, validate
from flashbench.model import Definition, parse_model
from flashbench.model.definition import Quantized
from flashbench.run.judge import evaluators
from flashbench.run.judge.check import CheckedCall, check_job, compare_outputs
from flashbench.workloads import generate_inputs

ROOT = Path(__file__).resolve().parents[1]
SAMPLING_REPO = Path(__file__).parent / "fixtures" / "sampling_repo"
QUANTIZE = "flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64"


def definition(evaluator=None, outputs=None, **fields) -> Definition:
    data = {"name": "op", "op_type": "test", "axes": {"n": {"type": "var"}},
            "inputs": {"x": {"shape": ["n"], "dtype": "float32"}},
            "outputs": outputs or {"y": {"shape": ["n"], "dtype": "int8"}}, "reference": "def run(x): return x",
            **fields}
    if evaluator is not None:
        data["evaluator"] = evaluator
    return parse_model(Definition, data, Path("op.yaml"))


# The field.

def test_the_default_evaluator_is_allclose():
    assert definition().evaluator.kind == "allclose"


def test_an_evaluator_by_name_or_with_parameters():
    assert definition("bitwise").evaluator.kind == "bitwise"
    quantized = definition({"kind": "quantized", "steps": 2, "max_mismatch_fraction": 0.01}).evaluator
    assert (quantized.steps, quantized.max_mismatch_fraction) == (2.0, 0.01)
    assert definition("sampling").evaluator.false_failure_probability == 1e-6


def test_the_evaluator_survives_the_trip_to_the_worker():
    # The worker's Setup message carries the definition as JSON.
    sampling = definition({"kind": "sampling", "false_failure_probability": 1e-3},
                          {"y": {"shape": ["n"], "dtype": "int64"}})
    assert Definition.model_validate_json(sampling.model_dump_json()).evaluator == sampling.evaluator


@pytest.mark.parametrize("evaluator, outputs, fields, message", [
    ("nearly", None, {}, "op.yaml: evaluator: Input tag 'nearly' found using 'kind' does not match any of the expected "
                         "tags: 'allclose', 'bitwise', 'quantized', 'sampling'"),
    ({"kind": "quantized", "steps": -1}, None, {},
     "op.yaml: evaluator.quantized.steps: Input should be greater than or equal to 0"),
    ({"kind": "sampling", "seed": 3}, None, {}, "op.yaml: evaluator.sampling.seed: unknown key"),
    ({"kind": "sampling", "false_failure_probability": 0}, None, {}, "evaluator.sampling.false_failure_probability"),
    ("sampling", {"y": {"shape": ["n"], "dtype": "float32"}}, {},
     "op.yaml: outputs.y: evaluator 'sampling' needs integer tensors of sample ids, not float32"),
    ("sampling", {"y": {"shape": None, "dtype": "int64"}}, {}, "outputs.y: evaluator 'sampling' needs integer tensors "
                                                                "of sample ids, not a scalar"),
    ("quantized", {"y": {"shape": ["n"], "dtype": "bool"}}, {}, "outputs.y: evaluator 'quantized' has no steps for bool"),
    ("bitwise", None, {"tolerances": {"y": {"atol": 0, "rtol": 0}}},
     "op.yaml: tolerances: apply to evaluator 'allclose' only, not 'bitwise'"),
])
def test_an_evaluator_that_does_not_fit_names_file_and_field(evaluator, outputs, fields, message):
    with pytest.raises(FlashbenchError) as error:
        definition(evaluator, outputs, **fields)
    assert message in str(error.value) and "\n" not in str(error.value)


# bitwise: packed bytes (the FP8 cache format), and a float8 output against a wider reference.

@pytest.fixture(scope="module")
def quantize():
    """The FP8 cache quantisation, judged bit for bit, and its reference's bytes on a smoke workload."""
    repo = Repo(ROOT)
    source = repo.definition(QUANTIZE)
    bitwise = Definition.model_validate({**source.model_dump(exclude={"tolerances"}), "evaluator": "bitwise"})
    workload = repo.workload_set(QUANTIZE).workloads[0]
    inputs = generate_inputs(source, workload, 7, "cpu", repo.definition_path(QUANTIZE).parent)
    return bitwise, {"kv_cache_fp8": repo.reference(QUANTIZE)(*inputs.values())}


def test_bitwise_passes_the_same_bytes(quantize):
    bitwise, expected = quantize
    verdict = compare_outputs(bitwise, {"kv_cache_fp8": expected["kv_cache_fp8"].clone()}, expected)
    assert verdict.passed and verdict.errors["kv_cache_fp8"].mismatch_fraction == 0.0


def test_bitwise_fails_one_bit_of_one_packed_byte(quantize):
    bitwise, expected = quantize
    got = expected["kv_cache_fp8"].clone()
    got.view(-1)[1000] ^= 1  # the last bit of one e4m3 byte: one step of that value
    verdict = compare_outputs(bitwise, {"kv_cache_fp8": got}, expected)
    assert verdict.status == "INCORRECT_NUMERICAL"
    assert verdict.errors["kv_cache_fp8"].mismatch_fraction == pytest.approx(1 / got.numel())
    assert verdict.message.startswith("output kv_cache_fp8: 0.00% of elements different from the reference's bits")


def e4m3_values() -> torch.Tensor:
    """Float64 values e4m3 holds exactly, below its largest: normal, negative, subnormal, zero."""
    return torch.tensor([1.0, 1.125, -3.5, 0.3125, 2.0 ** -9, 0.0], dtype=torch.float64)


def next_up(tensor: torch.Tensor, steps: int = 1) -> torch.Tensor:
    """The value `steps` codes further from zero (same sign): one ulp per code."""
    return (tensor.view(torch.uint8) + steps).view(tensor.dtype)


def test_bitwise_converts_a_wider_reference_to_the_output_dtype():
    reference = e4m3_values()
    got = reference.to(torch.float8_e4m3fn)
    assert not bitwise_bad(got, reference)
    got[2:3] = next_up(got[2:3])
    error, bad = evaluators.bitwise_error(got, reference)
    assert bad and error.mismatch_fraction == pytest.approx(1 / 6) and error.max_abs_error == 0.25


def bitwise_bad(got, expected) -> bool:
    return evaluators.bitwise_error(got, expected)[1]


def test_bitwise_tells_minus_zero_from_zero_and_never_passes_nan():
    assert bitwise_bad(torch.tensor([-0.0]), torch.tensor([0.0]))
    assert bitwise_bad(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not bitwise_bad(torch.tensor([float("inf")]), torch.tensor([float("inf")]))


def float4(codes: list[int]) -> torch.Tensor:
    """Packed float4_e2m1, two codes per byte, the first in the low nibble."""
    pairs = torch.tensor(codes, dtype=torch.uint8).reshape(-1, 2)
    return (pairs[:, 0] | pairs[:, 1] << 4).view(torch.float4_e2m1fn_x2)


def test_bitwise_on_packed_float4():
    codes = [0, 1, 2, 3, 4, 5, 6, 7, 9, 15]  # 0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6
    assert not bitwise_bad(float4(codes), float4(codes))
    assert bitwise_bad(float4(codes[:-1] + [14]), float4(codes))  # -4 for -6: one step in the last nibble
    with pytest.raises(evaluators.ReferenceMismatch, match="return float4_e2m1"):
        evaluators.bitwise_error(float4(codes), torch.zeros(5))


def test_a_reference_that_does_not_fit_the_evaluator_names_the_definition():
    packed = definition("bitwise", {"y": {"shape": ["n"], "dtype": "float4_e2m1"}})
    with pytest.raises(FlashbenchError) as error:
        compare_outputs(packed, {"y": float4([0, 1])}, {"y": torch.zeros(1)})
    assert str(error.value).startswith("op: reference: output y: the reference returns float32")


# quantized: a tolerance in steps of the output's dtype.

def steps(count: float, mismatch: float = 0.0) -> Quantized:
    return Quantized(kind="quantized", steps=count, max_mismatch_fraction=mismatch)


def test_the_quantisation_step_of_each_dtype():
    values = torch.tensor([1.0, 1.9, 2.0, 448.0, 2.0 ** -9, 0.0], dtype=torch.float64)
    assert evaluators.quantization_step(values, torch.float8_e4m3fn).tolist() == [
        2.0 ** -3, 2.0 ** -3, 2.0 ** -2, 32.0, 2.0 ** -9, 2.0 ** -9]  # subnormals: the smallest normal's spacing
    assert evaluators.quantization_step(values, torch.bfloat16)[:3].tolist() == [2.0 ** -7, 2.0 ** -7, 2.0 ** -6]
    assert evaluators.quantization_step(torch.tensor([0.0, 1.5, 4.0, 6.0], dtype=torch.float64),
                                        torch.float4_e2m1fn_x2).tolist() == [0.5, 0.5, 2.0, 2.0]
    assert evaluators.quantization_step(values, torch.int8).tolist() == [1.0] * 6


def test_quantized_counts_steps_of_the_output_dtype():
    reference = e4m3_values()
    exact = reference.to(torch.float8_e4m3fn)
    assert not evaluators.quantized_error(exact, reference, steps(0))[1]
    assert not evaluators.quantized_error(next_up(exact), reference, steps(1))[1]
    error, bad = evaluators.quantized_error(next_up(exact), reference, steps(0.5))
    assert bad and error.mismatch_fraction == 1.0
    assert evaluators.quantized_error(next_up(exact, 2), reference, steps(1))[1]


def test_round_to_nearest_is_within_half_a_step():
    # float32 values: torch converts float64 to float8 through float32, rounding twice
    reference = torch.linspace(-400, 400, 1001).double()
    assert not evaluators.quantized_error(reference.to(torch.float8_e4m3fn), reference, steps(0.5))[1]
    assert not evaluators.quantized_error(reference.to(torch.bfloat16), reference, steps(0.5))[1]


def test_quantized_integers_and_the_mismatch_allowance():
    reference = torch.arange(-50, 50, dtype=torch.int8)
    off_by_one = reference + torch.tensor([1] + [0] * 99, dtype=torch.int8)
    assert not evaluators.quantized_error(off_by_one, reference, steps(1))[1]
    assert evaluators.quantized_error(off_by_one, reference, steps(0))[1]
    assert not evaluators.quantized_error(off_by_one, reference, steps(0, mismatch=0.01))[1]


def test_quantized_packed_float4_and_nan():
    codes = [1, 2, 4, 6]  # 0.5, 1, 2, 4
    assert not evaluators.quantized_error(float4([1, 3, 4, 6]), float4(codes), steps(1))[1]  # 1 -> 1.5: one step
    assert evaluators.quantized_error(float4([1, 4, 4, 6]), float4(codes), steps(1))[1]  # 1 -> 2: two steps
    with pytest.raises(evaluators.ReferenceMismatch, match="packed float4 is compared with packed float4 only"):
        evaluators.quantized_error(float4(codes), torch.ones(4), steps(1))
    assert evaluators.quantized_error(torch.tensor([float("nan")]), torch.tensor([1.0]), steps(1e9))[1]


def test_a_one_step_error_in_a_job_names_its_call():
    quantized = definition({"kind": "quantized", "steps": 0.5}, {"y": {"shape": ["n"], "dtype": "float8_e4m3fn"}})
    reference = e4m3_values()
    good = CheckedCall("input set 0", {"y": reference.to(torch.float8_e4m3fn)}, {"y": reference})
    bad = CheckedCall("timed call 3 of 8", {"y": next_up(reference.to(torch.float8_e4m3fn))}, {"y": reference})
    slightly = CheckedCall("input set 1", {"y": reference.to(torch.float8_e4m3fn)}, {"y": reference + 2.0 ** -12})
    passed = check_job(quantized, [good, slightly, good])
    assert passed.passed and passed.errors["y"].max_abs_error == 2.0 ** -12  # the worst call's
    verdict = check_job(quantized, [good, bad])
    assert verdict.status == "INCORRECT_NUMERICAL"
    assert verdict.message.startswith("timed call 3 of 8: output y: 100.00% of elements more than 0.5 step(s) of "
                                      "float8_e4m3fn away")


def test_identical_calls_that_disagree_are_rejected():
    exact = definition("bitwise")
    first = CheckedCall("input set 0", {"y": torch.tensor([1, 2], dtype=torch.int8)}, {"y": torch.tensor([1, 2])})
    again = CheckedCall("the repeated call", {"y": torch.tensor([1, 3], dtype=torch.int8)}, {"y": torch.tensor([1, 3])})
    assert check_job(exact, [first, again]).passed  # each matches its own reference
    verdict = check_job(exact, [first, again], repeat=(0, 1))
    assert verdict.status == "REJECTED" and verdict.message.startswith("outputs change between identical calls")


# sampling: the fixture's top-k sampling definition and its reference, on peaked distributions as
# language models give (a flat one hardly tells a biased sampler from an honest one).

@pytest.fixture(scope="module")
def top_k():
    repo = Repo(SAMPLING_REPO)
    name = repo.names()[0]
    return repo.definition(name), repo.reference(name)


def test_the_example_sampling_definition_is_valid():
    assert [(checked.kind, checked.error) for checked in validate(Repo(SAMPLING_REPO))] == [
        ("workloads", None), ("definition", None)]


def top_k_inputs(generator: torch.Generator, rows: int = 32) -> tuple:
    """probs (peaked rows) and top_k (1 to 32) of one call."""
    return (torch.softmax(2 * torch.randn(rows, 64, generator=generator), dim=1),
            torch.randint(1, 33, (rows,), generator=generator, dtype=torch.int32))


def sampled_calls(top_k, sampler, seed: int, calls: int = 16, rows: int = 32) -> list[CheckedCall]:
    """`calls` checked calls, each on fresh inputs, sampled by sampler(probabilities, generator)."""
    _, reference = top_k
    generator = torch.Generator().manual_seed(seed)
    found = []
    for call in range(calls):
        probabilities = reference(*top_k_inputs(generator, rows))
        found.append(CheckedCall(f"timed call {call + 1} of {calls}", {"samples": sampler(probabilities, generator)},
                                 {"samples": probabilities}))
    return found


def honest(probabilities, generator):
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(1)


def sharpened(probabilities, generator):
    """Too greedy: draws from p^2 (temperature 1/2), inside the top k."""
    return torch.multinomial(probabilities ** 2, 1, generator=generator).squeeze(1)


def flattened(probabilities, generator):
    """Uniform over the top k: the right support, the wrong weights."""
    return torch.multinomial((probabilities > 0).double(), 1, generator=generator).squeeze(1)


@pytest.mark.parametrize("seed", range(5))
def test_an_honest_sampler_passes(top_k, seed):
    verdict = check_job(top_k[0], sampled_calls(top_k, honest, seed), seed=seed)
    assert verdict.passed, verdict.message
    assert verdict.errors["samples"].mismatch_fraction == 0.0 and verdict.errors["samples"].max_rel_error < 1


@pytest.mark.parametrize("sampler", [sharpened, flattened])
@pytest.mark.parametrize("seed", range(3))
def test_a_biased_sampler_fails_the_fit(top_k, sampler, seed):
    verdict = check_job(top_k[0], sampled_calls(top_k, sampler, seed), seed=seed)
    assert verdict.status == "INCORRECT_NUMERICAL"
    assert verdict.message.startswith("output samples: the 512 samples of 16 checked calls do not follow the "
                                      "reference's probabilities: Kolmogorov-Smirnov distance")
    assert "for a false-failure probability of 1e-06" in verdict.message
    assert verdict.errors["samples"].max_rel_error > 1 and verdict.errors["samples"].mismatch_fraction == 0.0


def test_the_bound_is_the_dkw_bound_of_the_stated_probability(top_k):
    verdict = check_job(top_k[0], sampled_calls(top_k, sharpened, 0), seed=0)
    error = verdict.errors["samples"]
    bound = (torch.log(torch.tensor(2 / 1e-6, dtype=torch.float64)) / (2 * 512)).sqrt().item()
    assert error.max_abs_error / error.max_rel_error == pytest.approx(bound)
    assert f"over the bound {bound:.3g}" in verdict.message


def test_a_sample_outside_the_top_k_fails_however_well_the_rest_fit(top_k):
    calls = sampled_calls(top_k, honest, 0)
    probabilities = calls[5].expected["samples"]
    row = int((probabilities == 0).any(1).nonzero()[0])  # a row whose top k leaves some category out
    calls[5].outputs["samples"][row] = int((probabilities[row] == 0).nonzero()[0])
    verdict = check_job(top_k[0], calls, seed=0)
    assert verdict.status == "INCORRECT_NUMERICAL"
    assert verdict.message == (f"output samples: timed call 6 of 16: 1 of 32 samples lie outside the support "
                               f"(probability 0, or no such category): element {row} is "
                               f"{int(calls[5].outputs['samples'][row])}")
    assert verdict.errors["samples"].mismatch_fraction == pytest.approx(1 / 512)


@pytest.mark.parametrize("value", [64, -1, torch.iinfo(torch.int64).min])  # past the categories; the judge's poison
def test_a_sample_that_is_no_category_fails(top_k, value):
    calls = sampled_calls(top_k, honest, 1, calls=2)
    calls[1].outputs["samples"][31] = value
    verdict = check_job(top_k[0], calls, seed=1)
    assert verdict.status == "INCORRECT_NUMERICAL" and f"element 31 is {value}" in verdict.message


def test_two_samplings_of_identical_inputs_may_differ(top_k):
    calls = sampled_calls(top_k, honest, 2, calls=2)
    again = honest(calls[0].expected["samples"], torch.Generator().manual_seed(9))
    repeated = CheckedCall("the repeated call", {"samples": again}, calls[0].expected)
    assert not torch.equal(repeated.outputs["samples"], calls[0].outputs["samples"])
    assert check_job(top_k[0], [*calls, repeated], repeat=(0, 2), seed=2).passed


def test_the_verdict_is_a_function_of_the_seed(top_k):
    calls = sampled_calls(top_k, honest, 3)
    first, again = check_job(top_k[0], calls, seed=11), check_job(top_k[0], calls, seed=11)
    assert first.errors == again.errors
    assert check_job(top_k[0], calls, seed=12).errors != first.errors  # the transform's uniforms come from the seed


def test_a_reference_that_returns_no_probabilities_is_the_definitions_error(top_k):
    calls = sampled_calls(top_k, honest, 4, calls=1)
    calls[0].expected["samples"] = calls[0].expected["samples"][:, :1].squeeze(1)  # one value per row
    with pytest.raises(FlashbenchError) as error:
        check_job(top_k[0], calls)
    assert str(error.value) == ("top_k_sampling_from_probs_v64: reference: output samples: the reference returns shape "
                                "[32]; evaluator 'sampling' needs probabilities of shape [32, 'categories']")
    calls[0].expected["samples"] = -torch.ones(32, 64)
    with pytest.raises(FlashbenchError, match="negative, not finite, or all zero in a row"):
        check_job(top_k[0], calls)


def test_the_reference_made_a_sampler_passes(top_k):
    # As the run's reference candidate: the reference's source with reference_sampler_source appended.
    sampling, reference = top_k
    source = (SAMPLING_REPO / sampling.reference).read_text() + evaluators.reference_sampler_source(sampling)
    namespace = {}
    exec(compile(source, "reference candidate", "exec"), namespace)
    assert_samples_fit(top_k, namespace["run"])


def test_the_reference_made_a_sampler_in_this_process_passes(top_k):
    assert_samples_fit(top_k, evaluators.reference_sampler(top_k[1], top_k[0]))


def assert_samples_fit(top_k, sampler):
    sampling, reference = top_k
    generator, calls = torch.Generator().manual_seed(5), []
    with torch.random.fork_rng():
        torch.manual_seed(5)  # the candidate draws from torch's global generator, as a worker's would
        for call in range(16):
            inputs = top_k_inputs(generator)
            calls.append(CheckedCall(f"call {call}", {"samples": sampler(*inputs)},
                                     {"samples": reference(*inputs)}))
    assert all(call.outputs["samples"].dtype == torch.int64 for call in calls)
    assert check_job(sampling, calls, seed=5).passed


def test_one_call_of_a_sampling_definition_is_not_compared_alone(top_k):
    with pytest.raises(ValueError, match="judge its calls together with check_job"):
        compare_outputs(top_k[0], {"samples": torch.zeros(32, dtype=torch.int64)}, {"samples": torch.ones(32, 64)})


def test_the_transform_ranks_categories_by_probability_then_id():
    # One row, four samples, U = 1/2: category 1 (0.5) spans [0, 0.5), 0 and 2 (0.25, tied) follow by id.
    rows = torch.tensor([[0.25, 0.5, 0.25, 0.0]]).repeat(4, 1)
    inside, transform = evaluators._transform(rows, torch.tensor([1, 0, 2, 3]), torch.full((4,), 0.5), "cpu")
    assert inside.tolist() == [True, True, True, False]
    assert transform[:3].tolist() == [0.25, 0.625, 0.875]


def test_the_uniform_distance():
    assert evaluators.uniform_distance(torch.tensor([0.5])) == 0.5
    assert evaluators.uniform_distance((torch.arange(100, dtype=torch.float64) + 0.5) / 100) == pytest.approx(0.005)
    assert evaluators.uniform_distance(torch.full((100,), 0.1)) == pytest.approx(0.9)


# sampling against a reference that samples (reference: samples, FlashInfer-Bench's sampling
# references): the fixture's top-k definition with a reference that draws, and its draws.

def test_the_reference_mode_of_the_sampling_evaluator():
    int64 = {"y": {"shape": ["n"], "dtype": "int64"}}
    assert (definition("sampling", int64).evaluator.reference, definition("sampling", int64).evaluator.reference_draws) \
        == ("distribution", 8)
    samples = definition({"kind": "sampling", "reference": "samples", "reference_draws": 16}, int64)
    assert (samples.evaluator.reference, samples.evaluator.reference_draws) == ("samples", 16)
    assert Definition.model_validate_json(samples.model_dump_json()).evaluator == samples.evaluator
    with pytest.raises(FlashbenchError, match="evaluator.sampling.reference"):
        definition({"kind": "sampling", "reference": "weights"}, int64)
    with pytest.raises(FlashbenchError, match="evaluator.sampling.reference_draws"):
        definition({"kind": "sampling", "reference": "samples", "reference_draws": 0}, int64)


@pytest.fixture(scope="module")
def drawn(top_k):
    """The top-k definition judged with reference: samples, and its reference made one that draws."""
    sampling, distribution = top_k
    data = sampling.model_dump() | {"evaluator": {"kind": "sampling", "reference": "samples"}}
    return Definition.model_validate(data), evaluators.reference_sampler(distribution, sampling)


def drawn_calls(top_k, drawn, sampler, seed: int, calls: int = 16, rows: int = 32) -> list[CheckedCall]:
    """Checked calls as the judge makes them: the solution's samples, and the reference's draws on the same inputs."""
    samples_definition, reference = drawn
    generator, found = torch.Generator().manual_seed(seed), []
    for call in range(calls):
        probs, k = top_k_inputs(generator, rows)
        expected = evaluators.reference_samples(samples_definition, reference, {"probs": probs, "top_k": k},
                                                seeds=[seed * 10_000 + call * 100 + d for d in range(8)])
        found.append(CheckedCall(f"timed call {call + 1} of {calls}",
                                 {"samples": sampler(top_k[1](probs, k), generator)}, expected))
    return found


def argmax(probabilities, generator):
    return probabilities.argmax(1)


@pytest.mark.parametrize("seed", range(5))
def test_an_honest_sampler_passes_against_the_references_draws(top_k, drawn, seed):
    verdict = check_job(drawn[0], drawn_calls(top_k, drawn, honest, seed), seed=seed)
    assert verdict.passed, verdict.message
    assert verdict.errors["samples"].mismatch_fraction == 0.0 and verdict.errors["samples"].max_rel_error < 1


@pytest.mark.parametrize("sampler", [sharpened, argmax, flattened])
@pytest.mark.parametrize("seed", range(3))
def test_a_biased_sampler_fails_against_the_references_draws(top_k, drawn, sampler, seed):
    verdict = check_job(drawn[0], drawn_calls(top_k, drawn, sampler, seed), seed=seed)
    assert verdict.status == "INCORRECT_NUMERICAL"
    assert verdict.message.startswith("output samples: the 512 samples of 16 checked calls do not follow the "
                                      "reference's distribution: Kolmogorov-Smirnov distance")
    assert "ranks among the reference's 8 draws per sample" in verdict.message
    assert verdict.errors["samples"].max_rel_error > 1 and verdict.errors["samples"].mismatch_fraction == 0.0


@pytest.mark.parametrize("value", [64, -1, torch.iinfo(torch.int64).min])
def test_a_sample_that_is_no_category_fails_against_the_references_draws(top_k, drawn, value):
    calls = drawn_calls(top_k, drawn, honest, 1, calls=2)
    calls[1].outputs["samples"][31] = value
    verdict = check_job(drawn[0], calls, seed=1)
    assert verdict.status == "INCORRECT_NUMERICAL"
    assert verdict.message == ("output samples: timed call 2 of 2: 1 of 32 samples lie outside the support (no such "
                               "category, or one the inputs exclude: probability 0, past top_k or top_p): element 31 "
                               f"is {value}")
    assert verdict.errors["samples"].mismatch_fraction == pytest.approx(1 / 64)


def test_a_sample_past_the_top_k_fails_against_the_references_draws(top_k, drawn):
    calls = drawn_calls(top_k, drawn, honest, 0)
    scores = calls[5].expected["samples" + evaluators.SCORES_KEY]
    row = int((scores == -torch.inf).any(1).nonzero()[0])
    calls[5].outputs["samples"][row] = int((scores[row] == -torch.inf).nonzero()[0])
    verdict = check_job(drawn[0], calls, seed=0)
    assert verdict.status == "INCORRECT_NUMERICAL" and verdict.message.startswith(
        "output samples: timed call 6 of 16: 1 of 32 samples lie outside the support")


def test_with_one_reference_draw_and_no_scores_only_the_range_is_known(top_k, drawn):
    # What a reference store that runs the reference once gives: a sample per element, no scores.
    calls = drawn_calls(top_k, drawn, honest, 2, calls=4)
    for call in calls:
        call.expected = {"samples": call.expected["samples"][0]}
    assert check_job(drawn[0], calls, seed=2).passed
    calls[0].outputs["samples"][0] = 64
    verdict = check_job(drawn[0], calls, seed=2)
    assert verdict.message.endswith("lie outside the support (no such category: ids are 0 to 63): element 0 is 64")


def test_calls_that_share_the_references_draws_count_once(top_k, drawn):
    calls = drawn_calls(top_k, drawn, honest, 3, calls=2)
    repeated = CheckedCall("the repeated call", {"samples": calls[0].outputs["samples"].clone()}, calls[0].expected)
    verdict = check_job(drawn[0], [*calls, repeated], repeat=(0, 2), seed=3)
    assert verdict.passed and verdict.errors == check_job(drawn[0], calls, seed=3).errors


def test_a_reference_that_returns_no_samples_is_the_definitions_error(top_k, drawn):
    calls = drawn_calls(top_k, drawn, honest, 4, calls=1)
    calls[0].expected["samples"] = top_k[1](*top_k_inputs(torch.Generator().manual_seed(0)))
    with pytest.raises(FlashbenchError, match="reference: output samples: the reference returns float64; evaluator "
                                              "'sampling' with reference: samples needs sample ids"):
        check_job(drawn[0], calls)
    calls[0].expected["samples"] = torch.zeros(3, 31, dtype=torch.int64)
    with pytest.raises(FlashbenchError, match=r"the reference returns shape \[3, 31\]"):
        check_job(drawn[0], calls)


def test_reference_draws_outside_the_derived_support_are_the_definitions_error(top_k, drawn):
    calls = drawn_calls(top_k, drawn, honest, 5, calls=1)
    scores = calls[0].expected["samples" + evaluators.SCORES_KEY]
    calls[0].expected["samples"][3, 0] = int((scores[0] == -torch.inf).nonzero()[0])
    with pytest.raises(FlashbenchError, match="the reference's own samples lie outside the support its inputs give"):
        check_job(drawn[0], calls)


def test_the_draws_are_seeded_apart_and_leave_torchs_generator_alone(drawn):
    samples_definition, reference = drawn
    inputs = dict(zip(("probs", "top_k"), top_k_inputs(torch.Generator().manual_seed(0))))
    state = torch.get_rng_state()
    first = evaluators.reference_samples(samples_definition, reference, inputs, seeds=list(range(8)))
    assert torch.equal(torch.get_rng_state(), state)
    assert first["samples"].shape == (8, 32) and first["samples" + evaluators.SCORES_KEY].shape == (32, 64)
    assert torch.equal(first["samples"], evaluators.reference_samples(samples_definition, reference, inputs,
                                                                      seeds=list(range(8)))["samples"])
    assert not torch.equal(first["samples"][0], first["samples"][1])
    fresh = evaluators.reference_samples(samples_definition, reference, inputs)["samples"]
    assert not torch.equal(fresh, first["samples"])


def support_of(inputs: dict) -> torch.Tensor:
    specs = {name: {"shape": ["n", "v"][:t.dim()], "dtype": str(t.dtype).removeprefix("torch.")}
             for name, t in inputs.items()}
    sampling = parse_model(Definition, {
        "name": "op", "op_type": "sampling", "axes": {"n": {"type": "var"}, "v": {"type": "const", "value": 4}},
        "inputs": specs, "outputs": {"s": {"shape": ["n"], "dtype": "int64"}}, "reference": "def run(*a): pass",
        "evaluator": {"kind": "sampling", "reference": "samples"}}, Path("op.yaml"))
    return evaluators.sample_scores(sampling, inputs)["s"] > -torch.inf


def test_the_support_the_inputs_give():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.0, 0.3, 0.6], [0.25, 0.25, 0.25, 0.25]])
    assert support_of({"probs": probs}).tolist() == [[True] * 4, [True, False, True, True], [True] * 4]
    k = torch.tensor([2, 0, 3], dtype=torch.int32)  # 0: no restriction; ties with the k-th are kept
    assert support_of({"probs": probs, "top_k": k}).tolist() == [
        [True, True, False, False], [True, False, True, True], [True] * 4]
    p = torch.tensor([0.5, 0.0, 0.6])  # the mass strictly more likely than a category is at most p
    assert support_of({"probs": probs, "top_p": p}).tolist() == [
        [True, True, False, False], [False, False, False, True], [True] * 4]
    logits = torch.tensor([[0.0, -torch.inf, 1.0, 2.0]])
    assert support_of({"logits": logits}).tolist() == [[True, False, True, True]]
    assert support_of({"logits": logits, "top_k": torch.tensor([1], dtype=torch.int32)}).tolist() == [
        [False, False, False, True]]


def test_a_samples_reference_is_its_own_candidate(drawn):
    assert evaluators.reference_sampler_source(drawn[0]) == ""
    assert evaluators.reference_sampler(drawn[1], drawn[0]) is drawn[1]
