"""CPU checks of the MLA paged decode solutions against the reference.

The Triton solution runs under Triton's interpreter (TRITON_INTERPRET=1) in a child process, so the
variable never leaks into other tests; the PyTorch solution runs in-process. Cases are tiny: a few
requests, random non-contiguous page ids, unequal lengths, kv_len 1 and empty requests (output 0,
lse -inf). Besides the default entry point, the Triton kernel is run with small work units so that
chunks cross request boundaries and requests are merged from many partials, with chunks cut from
the mean request length or from the flattened tokens, and with several merge tilings.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from solution_checks import compare, load_module

ROOT = Path(__file__).resolve().parents[2]
DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
REFERENCE = ROOT / "references" / "mla_paged" / f"{DEFINITION}.py"
SOLUTIONS = ROOT / "solutions" / DEFINITION
TRITON_KERNEL = SOLUTIONS / "triton_splitkv" / "kernel.py"
TORCH_KERNEL = SOLUTIONS / "torch_vectorized" / "kernel.py"

# KV length of each request, per case
CASES = {
    "mixed": [5, 0, 1, 37, 12, 0],
    "single": [60],
    "all_empty": [0, 0],
}

# Triton launch settings besides the default entry point: None runs kernel.run as the harness does.
TRITON_CONFIGS = {
    "entry_point": None,
    "cross_request_chunks": dict(block_n=16, num_units=5, min_chunk=1),
    "many_partials": dict(block_n=16, num_units=40, min_chunk=1, merge="coarse"),
    "column_merge": dict(block_n=16, num_units=12, min_chunk=1, merge="columns"),
    "unaligned_chunks": dict(block_n=16, num_units=12, min_chunk=1, aligned=False),
}


def make_inputs(kv_lens, seed, num_pages=300):
    gen = torch.Generator().manual_seed(seed)
    batch, total_kv = len(kv_lens), sum(kv_lens)
    q_nope = torch.randn(batch, 16, 512, generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(batch, 16, 64, generator=gen).to(torch.bfloat16)
    ckv_cache = torch.randn(num_pages, 1, 512, generator=gen).to(torch.bfloat16)
    kpe_cache = torch.randn(num_pages, 1, 64, generator=gen).to(torch.bfloat16)
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    kv_indices = torch.randperm(num_pages, generator=gen)[:total_kv].to(torch.int32)
    sm_scale = 1.0 / math.sqrt(128 + 64)
    return q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale


def check_triton_cases():
    """Runs in the child process, under the interpreter: all cases and configs, one JSON line."""
    reference = load_module("decode_reference", REFERENCE)
    kernel = load_module("decode_triton_splitkv", TRITON_KERNEL, TRITON_KERNEL.parent)
    results = {}
    for seed, (name, kv_lens) in enumerate(CASES.items()):
        inputs = make_inputs(kv_lens, seed)
        ref_output, ref_lse = reference.run(*inputs)
        for config_name, config in TRITON_CONFIGS.items():
            output = torch.full_like(ref_output, float("nan"))  # poisoned: every row must be written
            lse = torch.full_like(ref_lse, float("nan"))
            if config is None:
                assert kernel.run(*inputs, output, lse) is None
            else:
                kernel.launch(*inputs, output, lse, **config)
            results[f"{name}/{config_name}"] = compare(output, lse, ref_output, ref_lse)
    print(json.dumps(results))


def test_triton_splitkv_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--triton-cases"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == {f"{c}/{k}" for c in CASES for k in TRITON_CONFIGS}
    failures = {name: problems for name, problems in results.items() if problems}
    assert not failures, failures


@pytest.mark.parametrize("name", list(CASES))
def test_torch_vectorized(name):
    reference = load_module("decode_reference", REFERENCE)
    kernel = load_module("decode_torch_vectorized", TORCH_KERNEL)
    inputs = make_inputs(CASES[name], seed=list(CASES).index(name))
    ref_output, ref_lse = reference.run(*inputs)
    output, lse = kernel.run(*inputs)
    assert output.dtype == torch.bfloat16 and lse.dtype == torch.float32
    problems = compare(output, lse, ref_output, ref_lse)
    assert not problems, problems


if __name__ == "__main__" and "--triton-cases" in sys.argv:
    check_triton_cases()
