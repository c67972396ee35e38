"""The FlashMLA-form decode and varlen MHA prefill solutions, run through the runner on the CPU.

Every solution folder of the four definitions (a Triton kernel, under Triton's interpreter in the
worker process, and a plain PyTorch baseline) runs on its definition's smoke workloads exactly as
`flashbench run` would: inputs generated from the workload, outputs poisoned before each call,
checked against the reference with the definition's tolerances, a repeated call and a timed call
checked too. The smoke workloads cover split and unsplit decode, one and two draft tokens, table
slots of -1, and prefill tiles after a prefix, on the diagonal, and a sequence without queries.
Generated caches hold finite values everywhere, so the decode solutions are also run directly on a
cache whose slots past each request's length are NaN (the definition says they may hold anything).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashbench import Repo
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads
from solution_checks import load_module, solution_file

ROOT = Path(__file__).resolve().parents[2]
DEFINITIONS = {
    "flashmla_decode_causal_h128_ckv512_kpe64_ps64": {"triton_splitkv", "triton_balanced", "torch_vectorized"},
    "flashmla_decode_causal_h16_ckv512_kpe64_ps64": {"triton_splitkv", "triton_balanced", "torch_vectorized"},
    "mha_varlen_prefill_causal_h128_dqk128_dv128": {"triton_fa2", "torch_vectorized"},
    "mha_varlen_prefill_causal_h128_dqk192_dv128": {"triton_fa2", "torch_vectorized"},
}
PEER_BASELINES = {"flashmla", "flashinfer_fa3"}


@pytest.mark.parametrize("definition", list(DEFINITIONS))
def test_solutions_pass_smoke_workloads(definition, tmp_path):
    repo = Repo(ROOT)
    options = RunOptions(device="cpu", iters=1, warmup=0, input_sets=1, timeout=120, trace_dir=tmp_path,
                         cache_dir=tmp_path, save=False)
    runner = Runner(repo, definition, options)
    # CUDA solutions need a GPU; tests/solutions/test_cuda_solutions.py compiles them. The peer
    # libraries' wrappers (FlashMLA, FlashInfer) run on a GPU only: tests/solutions/test_peer_baselines.py.
    folders = [f for f in select_solutions(repo, definition, [])
               if f.solution.language != "cuda" and f.solution.name not in PEER_BASELINES]
    assert {f.solution.name for f in folders} == DEFINITIONS[definition]
    workloads = select_workloads(repo, definition, [], "cpu")
    assert workloads and all("smoke" in w.tags for w in workloads)
    # The reference itself is checked against float64 in tests/test_flashmla_references.py.
    result = runner.run(runner.candidates(folders)[1:], workloads)
    assert len(result.traces) == len(folders) * len(workloads)
    failed = {(t.solution, t.workload_name): f"{t.status}: {t.message} {t.log[-600:]}"
              for t in result.traces if t.status != "PASSED"}
    assert not failed, failed


DECODE_H16 = "flashmla_decode_causal_h16_ckv512_kpe64_ps64"



def nan_tail_case(seed=0):
    """Three requests with two draft tokens; block tails past each length are NaN, unused table slots -1."""
    gen = torch.Generator().manual_seed(seed)
    lengths, pool = [2, 70, 129], 12
    ids = torch.randperm(pool, generator=gen).to(torch.int32)
    table = torch.full((3, 4), -1, dtype=torch.int32)
    k_cache = torch.randn(pool, 64, 1, 576, generator=gen)
    used = 0
    for b, length in enumerate(lengths):
        blocks = (length + 63) // 64
        table[b, :blocks] = ids[used:used + blocks]
        used += blocks
        k_cache[table[b, blocks - 1].item(), length - (blocks - 1) * 64:] = float("nan")
    q = torch.randn(3, 2, 16, 576, generator=gen).bfloat16()
    return q, k_cache.bfloat16(), table, torch.tensor(lengths, dtype=torch.int32), 0.1352


def check_decode_on_nan_tails():
    """Runs in a child process under the interpreter: both Triton kernels, with and without splits
    (triton_balanced with one unit in all, and with units cut to 64 keys so every request splits)."""
    reference = load_module("decode_reference", ROOT / Repo(ROOT).definition(DECODE_H16).reference)
    splitkv = load_module("decode_triton", solution_file(DECODE_H16, "triton_splitkv"))
    balanced = load_module("decode_balanced", solution_file(DECODE_H16, "triton_balanced"))
    variants = {"splitkv 1": (splitkv, {"num_splits": 1}), "splitkv 3": (splitkv, {"num_splits": 3}),
                "balanced 1": (balanced, {"target_units": 1}), "balanced 64-key units": (balanced, {"target_units": 8, "min_chunk": 64})}
    inputs = nan_tail_case()
    ref_out, ref_lse = reference.run(*inputs)
    errors = {}
    for name, (kernel, options) in variants.items():
        out = torch.full_like(ref_out, float("nan"))
        lse = torch.full_like(ref_lse, float("nan"))
        kernel.launch(*inputs, out, lse, **options)
        errors[name] = [(out.float() - ref_out.float()).abs().max().item(), (lse - ref_lse).abs().max().item()]
    print(json.dumps(errors))


def test_triton_decode_ignores_block_tails():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--nan-tails"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == 4
    for variant, (out_error, lse_error) in errors.items():
        assert out_error <= 2e-2 and lse_error <= 1e-3, (variant, out_error, lse_error)  # NaN fails too


def test_torch_decode_ignores_block_tails():
    reference = load_module("decode_reference", ROOT / Repo(ROOT).definition(DECODE_H16).reference)
    kernel = load_module("decode_torch", solution_file(DECODE_H16, "torch_vectorized"))
    inputs = nan_tail_case()
    ref_out, ref_lse = reference.run(*inputs)
    out, lse = kernel.run(*inputs)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


if __name__ == "__main__" and "--nan-tails" in sys.argv:
    check_decode_on_nan_tails()
