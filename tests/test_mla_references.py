"""The two MLA references against independent float64 computations.

Decode is checked against explicit per-(request, head) loops; prefill against one dense masked
attention of every query over every KV token in the batch. Unused cache pages are filled with
large values, so reading a wrong page shows up as a large error.
"""

import math
from pathlib import Path

import pytest
import torch

import flashbench
from flashbench import generate_inputs
from causal_mask import causal_visibility

REPO = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
PREFILL = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"
HEADS, CKV, KPE = 16, 512, 64
LN2 = math.log(2.0)
POISON = 50.0


@pytest.fixture(scope="module")
def repo():
    return flashbench.Repo(REPO)


def indptr(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def caches(num_pages, used_pages, generator):
    ckv = torch.randn(num_pages, 1, CKV, generator=generator)
    kpe = torch.randn(num_pages, 1, KPE, generator=generator)
    unused = torch.ones(num_pages, dtype=torch.bool)
    unused[used_pages.long()] = False
    ckv[unused] = POISON
    kpe[unused] = POISON
    return ckv.bfloat16(), kpe.bfloat16()


def decode_case(kv_lens, num_pages, sm_scale, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(kv_lens)
    pages = torch.randperm(num_pages, generator=g)[:total].to(torch.int32)
    ckv, kpe = caches(num_pages, pages, g)
    return {
        "q_nope": torch.randn(len(kv_lens), HEADS, CKV, generator=g).bfloat16(),
        "q_pe": torch.randn(len(kv_lens), HEADS, KPE, generator=g).bfloat16(),
        "ckv_cache": ckv, "kpe_cache": kpe,
        "kv_indptr": indptr(kv_lens), "kv_indices": pages, "sm_scale": sm_scale,
    }


def prefill_case(q_lens, kv_lens, num_pages, sm_scale, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(kv_lens)
    pages = torch.randperm(num_pages, generator=g)[:total].to(torch.int32)
    ckv, kpe = caches(num_pages, pages, g)
    return {
        "q_nope": torch.randn(sum(q_lens), HEADS, CKV, generator=g).bfloat16(),
        "q_pe": torch.randn(sum(q_lens), HEADS, KPE, generator=g).bfloat16(),
        "ckv_cache": ckv, "kpe_cache": kpe,
        "qo_indptr": indptr(q_lens), "kv_indptr": indptr(kv_lens), "kv_indices": pages, "sm_scale": sm_scale,
    }


def decode_float64(inputs):
    """One request and one head at a time, max-subtracted softmax written out by hand."""
    q_nope, q_pe = inputs["q_nope"].double(), inputs["q_pe"].double()
    ckv, kpe = inputs["ckv_cache"].double()[:, 0], inputs["kpe_cache"].double()[:, 0]
    bounds, page_ids = inputs["kv_indptr"].tolist(), inputs["kv_indices"].tolist()
    batch = q_nope.shape[0]
    output = torch.zeros(batch, HEADS, CKV, dtype=torch.float64)
    lse = torch.full((batch, HEADS), -math.inf, dtype=torch.float64)
    for b in range(batch):
        pages = page_ids[bounds[b]:bounds[b + 1]]
        if not pages:
            continue
        keys = torch.stack([torch.cat([ckv[p], kpe[p]]) for p in pages])  # [kv_len, 576]
        values = torch.stack([ckv[p] for p in pages])
        for h in range(HEADS):
            query = torch.cat([q_nope[b, h], q_pe[b, h]])
            logits = (keys @ query) * inputs["sm_scale"]
            peak = logits.max()
            weights = torch.exp(logits - peak)
            total = weights.sum()
            output[b, h] = (weights[:, None] * values).sum(dim=0) / total
            lse[b, h] = (peak + torch.log(total)) / LN2
    return output, lse


def prefill_float64(inputs):
    """Every query against every KV token of the batch, with a mask for request and causality."""
    q = torch.cat([inputs["q_nope"].double(), inputs["q_pe"].double()], dim=-1)  # [total_q, H, 576]
    page_ids = inputs["kv_indices"].long()
    ckv, kpe = inputs["ckv_cache"].double()[:, 0], inputs["kpe_cache"].double()[:, 0]
    keys = torch.cat([ckv[page_ids], kpe[page_ids]], dim=-1)  # [num_kv, 576]
    values = ckv[page_ids]
    visible = causal_visibility(inputs["qo_indptr"].tolist(), inputs["kv_indptr"].tolist())
    logits = torch.einsum("thd,nd->thn", q, keys) * inputs["sm_scale"]
    logits = logits.masked_fill(~visible[:, None, :], -math.inf)
    lse_natural = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse_natural[..., None]).nan_to_num(0.0)  # rows that see nothing: 0
    output = torch.einsum("thn,nd->thd", probs, values)
    return output, lse_natural / LN2, visible


def assert_matches(output, lse, expected_output, expected_lse, shape):
    assert output.dtype == torch.bfloat16 and tuple(output.shape) == shape
    assert lse.dtype == torch.float32 and tuple(lse.shape) == shape[:2]
    empty = torch.isneginf(expected_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse is -inf exactly where no key is visible"
    assert not torch.isnan(lse).any() and not torch.isnan(output.float()).any()
    assert torch.all(output[empty] == 0)
    # output is float64 truth rounded once to bfloat16 (relative error <= 2**-9), plus float32 noise
    error = (output.double() - expected_output).abs()
    assert torch.all(error <= 1e-2 * expected_output.abs() + 1e-4), f"max error {error.max().item()}"
    # lse in base 2: compare against the natural log-sum-exp divided by ln 2
    torch.testing.assert_close(lse.double()[~empty], expected_lse[~empty], rtol=1e-5, atol=1e-4)


def run_unchanged(run, inputs):
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    result = run(**inputs)
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(inputs[name], value), f"the reference modified {name}"
    return result


@pytest.mark.parametrize("kv_lens, num_pages, sm_scale", [
    ([0, 1, 7, 33, 2, 0], 80, 1 / math.sqrt(576)),
    ([1], 5, 1 / math.sqrt(576)),
    ([19, 3, 64], 120, 0.5),  # peaky softmax: logits in the tens
    ([0, 0], 3, 0.1),
])
def test_decode_reference(repo, kv_lens, num_pages, sm_scale):
    inputs = decode_case(kv_lens, num_pages, sm_scale, seed=sum(kv_lens) + num_pages)
    output, lse = run_unchanged(repo.reference(DECODE), inputs)
    expected_output, expected_lse = decode_float64(inputs)
    assert_matches(output, lse, expected_output, expected_lse, (len(kv_lens), HEADS, CKV))
    for b, length in enumerate(kv_lens):
        assert torch.isneginf(lse[b]).all() == (length == 0)


def test_decode_single_key_returns_that_value(repo):
    inputs = decode_case([1], 4, 0.3, seed=7)
    output, lse = repo.reference(DECODE)(**inputs)
    page = inputs["kv_indices"][0].item()
    expected = inputs["ckv_cache"][page, 0].expand(HEADS, CKV)
    assert torch.equal(output[0], expected)  # softmax over one key is exactly 1
    logits = (inputs["q_nope"][0].double() @ inputs["ckv_cache"][page, 0].double()
              + inputs["q_pe"][0].double() @ inputs["kpe_cache"][page, 0].double()) * 0.3
    torch.testing.assert_close(lse[0].double(), logits / LN2, rtol=1e-5, atol=1e-4)


PREFILL_CASES = [
    # (q_lens, kv_lens): prefix + queries, square, q_len 1, q_len > kv_len, no KV, no queries
    ([1, 3, 4, 5, 2, 0, 6], [1, 3, 10, 2, 0, 4, 6]),
    ([7], [7]),
    ([2, 9], [12, 9]),
]


@pytest.mark.parametrize("q_lens, kv_lens", PREFILL_CASES)
@pytest.mark.parametrize("sm_scale", [1 / math.sqrt(576), 0.4])
def test_prefill_reference(repo, q_lens, kv_lens, sm_scale):
    inputs = prefill_case(q_lens, kv_lens, num_pages=sum(kv_lens) + 17, sm_scale=sm_scale, seed=len(q_lens))
    output, lse = run_unchanged(repo.reference(PREFILL), inputs)
    expected_output, expected_lse, _ = prefill_float64(inputs)
    assert_matches(output, lse, expected_output, expected_lse, (sum(q_lens), HEADS, CKV))


def test_prefill_queries_that_see_no_key(repo):
    # q_len 5 over kv_len 2: query i sees keys j <= 2 - 5 + i, so queries 0..2 see nothing.
    inputs = prefill_case([5], [2], num_pages=6, sm_scale=0.2, seed=3)
    output, lse = repo.reference(PREFILL)(**inputs)
    assert torch.isneginf(lse[:3]).all() and torch.all(output[:3] == 0)
    assert torch.isfinite(lse[3:]).all()
    page = inputs["kv_indices"][0].item()
    assert torch.equal(output[3], inputs["ckv_cache"][page, 0].expand(HEADS, CKV))  # exactly one key
    _, _, visible = prefill_float64(inputs)
    assert visible.sum(dim=1).tolist() == [0, 0, 0, 1, 2]


def test_prefill_is_causal(repo):
    # Changing the last key must not change any query that cannot see it.
    inputs = prefill_case([4], [6], num_pages=10, sm_scale=0.2, seed=5)
    run = repo.reference(PREFILL)
    output, lse = run(**inputs)
    last_page = inputs["kv_indices"][-1].item()
    changed = dict(inputs, ckv_cache=inputs["ckv_cache"].clone(), kpe_cache=inputs["kpe_cache"].clone())
    changed["ckv_cache"][last_page] += 1
    changed["kpe_cache"][last_page] += 1
    output2, lse2 = run(**changed)
    assert torch.equal(output[:3], output2[:3]) and torch.equal(lse[:3], lse2[:3])
    assert not torch.equal(output[3], output2[3])


@pytest.mark.parametrize("name, oracle", [(DECODE, decode_float64), (PREFILL, prefill_float64)])
def test_references_on_smoke_workloads(repo, name, oracle):
    definition = repo.definition(name)
    run = repo.reference(name)
    workloads = [w for w in repo.workload_set(name).workloads if "smoke" in w.tags]
    assert workloads
    for workload in workloads:
        inputs = generate_inputs(definition, workload, seed=1)
        output, lse = run(**inputs)
        expected_output, expected_lse = oracle(inputs)[:2]
        assert_matches(output, lse, expected_output, expected_lse, tuple(output.shape))
