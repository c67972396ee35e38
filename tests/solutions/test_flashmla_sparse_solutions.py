"""The Triton solutions of the sparse MLA and FP8 cache definitions, run through the runner on the
CPU (Triton's interpreter, in the worker process) on each definition's smoke workloads: every trace
must pass. The smoke workloads carry rows with no valid index, ids >= seq_len_kv and 2^31 - 1,
interleaved invalid entries, entries past topk_length, NaN tokens that only invalid entries point to,
split-K with a combine, and FP8 scale edge cases (exact 448 * 2^k tile maxima, all-zero tokens)."""

from pathlib import Path

import pytest

from flashbench import Repo
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads

ROOT = Path(__file__).resolve().parents[2]

SOLUTIONS = [
    ("flashmla_sparse_prefill_h128_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_prefill_h128_ckv512_kpe64_topk2048", "triton_gather_pipelined"),
    ("flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_decode_fp8_h128_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_decode_fp8_h128_ckv512_kpe64_ps64_topk2048", "triton_fp8_pipelined"),
    ("flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_prefill_h64_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_prefill_sink_topklen_h128_ckv512_kpe64_topk2048", "triton_gather"),
    ("flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_decode_fp8_sink_h128_ckv512_kpe64_ps64_topk2048", "triton_fp8_splitk"),
    ("flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64", "triton_bits"),
    ("flashmla_sparse_fp8_dequantize_ckv512_kpe64_ps64", "triton_bits"),
]


@pytest.mark.parametrize("definition, solution", SOLUTIONS)
def test_solution_passes_the_smoke_workloads(definition, solution, tmp_path):
    repo = Repo(ROOT)
    options = RunOptions(device="cpu", iters=1, warmup=0, timeout=120, trace_dir=tmp_path, cache_dir=tmp_path, save=False)
    runner = Runner(repo, definition, options)
    workloads = select_workloads(repo, definition, [], "cpu")
    assert len(workloads) >= 2 and all("smoke" in w.tags for w in workloads)
    candidates = runner.candidates(select_solutions(repo, definition, [solution]))
    result = runner.run(candidates[1:], workloads)  # the reference's outputs are computed all the same
    assert [(t.solution, t.workload_name) for t in result.traces] == [(solution, w.name) for w in workloads]
    failed = {t.workload_name: f"{t.status}: {t.message} {t.log}" for t in result.traces if t.status != "PASSED"}
    assert not failed, failed
