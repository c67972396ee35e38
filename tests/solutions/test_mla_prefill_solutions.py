"""CPU checks of the causal MLA paged prefill solutions against the reference.

The Triton solution runs under Triton's interpreter (TRITON_INTERPRET=1) in a child process, so the
variable never leaks into other tests; the PyTorch solution runs in-process. Cases are tiny: a few
requests, random non-contiguous page ids, q_len == kv_len, q_len 1, an empty request, and requests
with more queries than keys (their first queries see nothing: output 0, lse -inf).
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
DEFINITION = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"
REFERENCE = ROOT / "references" / "mla_paged" / f"{DEFINITION}.py"
SOLUTIONS = ROOT / "solutions" / DEFINITION
TRITON_KERNEL = SOLUTIONS / "triton_causal" / "kernel.py"
TORCH_KERNEL = SOLUTIONS / "torch_vectorized" / "kernel.py"

# (q_lens, kv_lens) per case
CASES = {
    "mixed": ([5, 1, 12], [9, 30, 12]),
    "q_longer_than_kv": ([7, 3], [4, 40]),
    "self_attention": ([20, 1], [20, 1]),
    "empty_request": ([0, 6, 13], [5, 6, 37]),
    "zero_scale": ([5, 3], [5, 43]),
    "negative_scale": ([5, 3], [5, 43]),
}
# sm_scale per case, where not 1/sqrt(192): the definition allows any (a masked -inf times a scale <= 0
# made every output of triton_causal NaN)
SCALES = {"zero_scale": 0.0, "negative_scale": -0.5}


def make_inputs(q_lens, kv_lens, seed, sm_scale=1.0 / math.sqrt(128 + 64), num_pages=300):
    gen = torch.Generator().manual_seed(seed)
    total_q, total_kv = sum(q_lens), sum(kv_lens)
    q_nope = torch.randn(total_q, 16, 512, generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(total_q, 16, 64, generator=gen).to(torch.bfloat16)
    ckv_cache = torch.randn(num_pages, 1, 512, generator=gen).to(torch.bfloat16)
    kpe_cache = torch.randn(num_pages, 1, 64, generator=gen).to(torch.bfloat16)
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    kv_indices = torch.randperm(num_pages, generator=gen)[:total_kv].to(torch.int32)
    return q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale


def check_triton_cases():
    """Runs in the child process, under the interpreter: all cases, one JSON line of results."""
    reference = load_module("prefill_reference", REFERENCE)
    kernel = load_module("prefill_triton_causal", TRITON_KERNEL, TRITON_KERNEL.parent)
    results = {}
    for seed, (name, (q_lens, kv_lens)) in enumerate(CASES.items()):
        inputs = make_inputs(q_lens, kv_lens, seed, *[SCALES[name]] if name in SCALES else [])
        ref_output, ref_lse = reference.run(*inputs)
        output = torch.full_like(ref_output, float("nan"))  # poisoned: every row must be written
        lse = torch.full_like(ref_lse, float("nan"))
        kernel.run(*inputs, output, lse)
        results[name] = compare(output, lse, ref_output, ref_lse)
    print(json.dumps(results))


def test_triton_causal_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--triton-cases"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == set(CASES)
    failures = {name: problems for name, problems in results.items() if problems}
    assert not failures, failures


@pytest.mark.parametrize("logits_per_chunk", [1 << 28, 1])  # all query positions at once; one at a time
@pytest.mark.parametrize("name", list(CASES))
def test_torch_vectorized(name, logits_per_chunk, monkeypatch):
    """In chunks of query positions too: padded to the longest request of a skewed batch, all at once ran an
    H100 out of memory (26 GiB asked for 33 requests of at most 2624 queries)."""
    reference = load_module("prefill_reference", REFERENCE)
    kernel = load_module("prefill_torch_vectorized", TORCH_KERNEL)
    monkeypatch.setattr(kernel, "LOGITS_PER_CHUNK", logits_per_chunk)
    q_lens, kv_lens = CASES[name]
    inputs = make_inputs(q_lens, kv_lens, list(CASES).index(name), *[SCALES[name]] if name in SCALES else [])
    ref_output, ref_lse = reference.run(*inputs)
    output, lse = kernel.run(*inputs)
    assert output.dtype == torch.bfloat16 and lse.dtype == torch.float32
    problems = compare(output, lse, ref_output, ref_lse)
    assert not problems, problems


if __name__ == "__main__" and "--triton-cases" in sys.argv:
    check_triton_cases()
