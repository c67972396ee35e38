"""The Triton solutions of the sparse MLA and FP8 cache definitions, on the CPU under Triton's
interpreter, every one on each smoke workload of its definition. The smoke workloads carry rows with
no valid index, ids >= seq_len_kv and 2^31 - 1, interleaved invalid entries, entries past
topk_length, NaN tokens that only invalid entries point to, split-K with a combine, and FP8 scale
edge cases (exact 448 * 2^k tile maxima, all-zero tokens).

Two ways (solution_checks.py says why): one child process calls every solution's entry point, loaded
as the runner's worker loads it, once on each smoke workload of its definition, outputs poisoned and
judged by the definition's evaluator; and every kernel runs through the runner as `flashbench run`
would (in its worker process: build, poisoned outputs, a repeated call, timed calls, all checked), on
its definition's first smoke workload cut down to one request or query token (RUNNER_CUTS; the FP8
cache's single block is run as it is, and the direct calls leave it out). The h64 and h128
definitions share their kernels and smoke workloads: the runner runs each kernel for one of them.
"""

import json
import sys
from pathlib import Path

import pytest

from flashbench import Repo
from flashbench.registry import load_solution_folder
from flashbench.run import select_solutions, select_workloads
from solution_checks import SOLUTIONS as SOLUTIONS_DIR
from solution_checks import check_directly, cut_down, interpreted, kernel_of, run_through_runner

ROOT = Path(__file__).resolve().parents[2]

SOLUTIONS = [
    ("flashmla_sparse_prefill_h128_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_prefill_h128_ckv512_kpe64_topk2048", "triton_gather_pipelined"),
    ("flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_decode_fp8_h128_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_decode_fp8_h128_ckv512_kpe64_ps64_topk2048", "triton_fp8_pipelined"),
    ("flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_pipelined"),
    ("flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_pipelined"),
    ("flashmla_sparse_prefill_h64_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_prefill_sink_topklen_h128_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_prefill_h64_ckv512_kpe64_topk2048", "triton_gather_pipelined"),
    ("flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048", "triton_gather_pipelined"),
    ("flashmla_sparse_prefill_sink_topklen_h128_ckv512_kpe64_topk2048", "triton_gather_pipelined"),
    ("flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_decode_fp8_sink_h128_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64", "triton_bits"),
    ("flashmla_sparse_fp8_dequantize_ckv512_kpe64_ps64", "triton_bits"),
]

# Through the runner: one folder of each kernel (test_every_kernel_goes_through_the_runner), the
# definition with fewer heads where two share it (under the interpreter a program takes all heads).
# triton_gather and triton_gather_pipelined are one source, an entry point per form and per
# signature: each of the four goes through the runner; so do triton_fp8_splitk's four.
THROUGH_RUNNER = [
    ("flashmla_sparse_prefill_h64_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_prefill_h64_ckv512_kpe64_topk2048", "triton_gather_pipelined"),
    ("flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048", "triton_gather_pipelined"),
    ("flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_pipelined"),
    ("flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_pipelined"),
    ("flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64", "triton_bits"),
    ("flashmla_sparse_fp8_dequantize_ckv512_kpe64_ps64", "triton_bits"),
]

# The runner's workload, per generator: the first smoke workload with these fields. Prefill: one query
# token after a prefix of 3 (every index tile but the first invalid); decode: one request of 5 tokens
# whose index entries are scattered, so that both splits (under the interpreter) see some and their
# combine weighs two partials.
RUNNER_CUTS = {
    "sparse_prefill_indices": {"q_lens": [1], "prefix_lens": [3]},
    "sparse_decode_indices": {"kv_lens": [5], "scatter": True},
    "fp8_kv_cache": {},
}


def runner_workload(repo: Repo, definition: str):
    first = select_workloads(repo, definition, [], "cpu")[0]
    return cut_down(first, **RUNNER_CUTS[first.generate[0].generator])


def run_by_runner(repo: Repo) -> set[tuple[str, str, str]]:
    """(definition, solution, workload uuid) of the smoke workloads the runner runs as they are."""
    return {(d, s, runner_workload(repo, d).uuid) for d, s in THROUGH_RUNNER}


@pytest.fixture(scope="module")
def direct_results(tmp_path_factory):
    return interpreted(__file__, "--direct", tmp_path_factory.mktemp("direct") / "results.json")


def test_every_kernel_goes_through_the_runner():
    assert set(THROUGH_RUNNER) <= set(SOLUTIONS)
    kernels = {(d, s): kernel_of(load_solution_folder(SOLUTIONS_DIR / d / s)) for d, s in SOLUTIONS}
    through_runner = {kernels[pair] for pair in THROUGH_RUNNER}
    left_out = [pair for pair, kernel in kernels.items() if kernel not in through_runner]
    assert not left_out, left_out


@pytest.mark.parametrize("definition, solution", THROUGH_RUNNER)
def test_solution_passes_through_the_runner(definition, solution, tmp_path):
    repo = Repo(ROOT)
    workload = runner_workload(repo, definition)
    traces = run_through_runner(definition, select_solutions(repo, definition, [solution]), [workload], tmp_path)
    assert [(t.solution, t.workload_name) for t in traces] == [(solution, workload.name)]
    failed = {t.workload_name: f"{t.status}: {t.message} {t.log}" for t in traces if t.status != "PASSED"}
    assert not failed, failed


@pytest.mark.parametrize("definition, solution", SOLUTIONS)
def test_solution_passes_the_smoke_workloads(definition, solution, direct_results):
    repo = Repo(ROOT)
    workloads = select_workloads(repo, definition, [], "cpu")
    assert len(workloads) >= 2 and all("smoke" in w.tags for w in workloads)
    skipped = run_by_runner(repo)
    expected = {f"{definition}/{solution}/{w.name}" for w in workloads if (definition, solution, w.uuid) not in skipped}
    results = {key: value for key, value in direct_results.items() if key.startswith(f"{definition}/{solution}/")}
    assert set(results) == expected
    failed = {key: value["problems"] for key, value in results.items() if value["problems"]}
    assert not failed, failed


if __name__ == "__main__" and "--direct" in sys.argv:
    results = Path(sys.argv[-1])
    checked = check_directly(SOLUTIONS, results.parent / "staged", skip=run_by_runner(Repo(ROOT)))
    results.write_text(json.dumps(checked))
