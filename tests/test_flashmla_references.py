"""The FlashMLA-form decode and varlen MHA prefill references against independent float64 computations.

Decode is checked against a token-by-token walk of the block table (key t of request b is
k_cache[block_table[b, t // 64], t % 64]) with a hand-written max-subtracted softmax; prefill against
one dense masked attention of every query over every key of the batch. Cache blocks no request uses
are filled with large values, so reading a wrong block shows up as a large error. Also checked: the
causal rule for draft tokens and for queries after a prefix, the constraints that reject batches
where a query would see no key, and the block_table / varlen generators.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import flashbench
from flashbench import generate_inputs
from flashbench.binding import BindingError, bind_axes
from flashbench.model.workload import BlockTable, Lengths, Varlen
from flashbench.workloads import GENERATORS
from causal_mask import causal_visibility

REPO = Path(__file__).resolve().parents[1]
DECODE = {128: "flashmla_decode_causal_h128_ckv512_kpe64_ps64", 16: "flashmla_decode_causal_h16_ckv512_kpe64_ps64"}
PREFILL = {192: "mha_varlen_prefill_causal_h128_dqk192_dv128", 128: "mha_varlen_prefill_causal_h128_dqk128_dv128"}
D, DV, BLOCK = 576, 512, 64
HEADS_MHA, DV_MHA = 128, 128
POISON = 50.0


@pytest.fixture(scope="module")
def repo():
    return flashbench.Repo(REPO)


def indptr(lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


# ---------------------------------------------------------------- decode


def decode_case(heads, seqlens, s_q, scale, seed, spare_blocks=3, extra_slots=1):
    g = torch.Generator().manual_seed(seed)
    blocks = [(n + BLOCK - 1) // BLOCK for n in seqlens]
    pool = sum(blocks) + spare_blocks
    ids = torch.randperm(pool, generator=g).to(torch.int32)
    table = torch.full((len(seqlens), max(blocks) + extra_slots), -1, dtype=torch.int32)
    start = 0
    for b, count in enumerate(blocks):
        table[b, :count] = ids[start:start + count]
        start += count
    k_cache = torch.randn(pool, BLOCK, 1, D, generator=g)
    unused = torch.ones(pool, dtype=torch.bool)
    unused[ids[:start].long()] = False
    k_cache[unused] = POISON
    return {
        "q": torch.randn(len(seqlens), s_q, heads, D, generator=g).bfloat16(),
        "k_cache": k_cache.bfloat16(), "block_table": table,
        "cache_seqlens": torch.tensor(seqlens, dtype=torch.int32), "softmax_scale": scale,
    }


def decode_float64(inputs):
    """Token-by-token block-table walk, one request and draft token at a time, all heads together."""
    q, cache = inputs["q"].double(), inputs["k_cache"].double()
    table, lengths = inputs["block_table"].tolist(), inputs["cache_seqlens"].tolist()
    batch, s_q, heads, _ = q.shape
    out = torch.zeros(batch, s_q, heads, DV, dtype=torch.float64)
    lse = torch.zeros(batch, heads, s_q, dtype=torch.float64)
    for b in range(batch):
        keys = torch.stack([cache[table[b][t // BLOCK], t % BLOCK, 0] for t in range(lengths[b])])
        for i in range(s_q):
            seen = keys[: lengths[b] - s_q + i + 1]  # FlashMLA: token i sees keys j <= L - s_q + i
            logits = (q[b, i] @ seen.T) * inputs["softmax_scale"]  # [heads, n]
            peak = logits.max(dim=1, keepdim=True).values
            weights = torch.exp(logits - peak)
            total = weights.sum(dim=1, keepdim=True)
            out[b, i] = (weights @ seen[:, :DV]) / total
            lse[b, :, i] = (peak + torch.log(total))[:, 0]
    return out, lse


def assert_close_to_truth(out, lse, truth_out, truth_lse):
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == truth_out.shape and lse.shape == truth_lse.shape
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    # out is float64 truth rounded once to bfloat16 (relative error <= 2**-9), plus float32 noise
    error = (out.double() - truth_out).abs()
    assert torch.all(error <= 1e-2 * truth_out.abs() + 1e-4), f"max error {error.max().item()}"
    torch.testing.assert_close(lse.double(), truth_lse, rtol=1e-5, atol=1e-4)  # natural log


def run_unchanged(run, inputs):
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    result = run(**inputs)
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(inputs[name], value), f"the reference modified {name}"
    return result


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("seqlens, s_q, scale", [
    ([1, 64, 65, 130], 1, 1 / 24),  # one key, exactly one block, one past a block boundary
    ([2, 64, 129, 5], 2, 0.1352),  # L == s_q: the first draft token sees exactly one key
    ([200, 3], 2, 0.5),  # peaky softmax: logits in the tens
])
def test_decode_reference(repo, heads, seqlens, s_q, scale):
    inputs = decode_case(heads, seqlens, s_q, scale, seed=sum(seqlens) + heads)
    assert bind_axes(repo.definition(DECODE[heads]), inputs)["seq_len_q"] == s_q
    out, lse = run_unchanged(repo.reference(DECODE[heads]), inputs)
    assert_close_to_truth(out, lse, *decode_float64(inputs))


def test_decode_first_draft_token_of_a_full_cache_sees_one_key(repo):
    # L == s_q == 2: token 0 sees key 0 only (softmax over one key is exactly 1), token 1 sees both.
    inputs = decode_case(16, [2], 2, 0.3, seed=11)
    out, lse = repo.reference(DECODE[16])(**inputs)
    block = inputs["block_table"][0, 0].item()
    key0 = inputs["k_cache"][block, 0, 0]
    assert torch.equal(out[0, 0], key0[:DV].expand(16, DV))
    logits = (inputs["q"][0, 0].double() @ key0.double()) * 0.3
    torch.testing.assert_close(lse[0, :, 0].double(), logits, rtol=1e-5, atol=1e-4)
    assert not torch.equal(out[0, 1], out[0, 0])


def test_decode_is_causal_over_draft_tokens(repo):
    # Changing the newest key changes only the last draft token.
    inputs = decode_case(16, [70], 2, 0.2, seed=5)
    run = repo.reference(DECODE[16])
    out, lse = run(**inputs)
    changed = dict(inputs, k_cache=inputs["k_cache"].clone())
    last = 69
    changed["k_cache"][inputs["block_table"][0, last // BLOCK].item(), last % BLOCK] += 1
    out2, lse2 = run(**changed)
    assert torch.equal(out[:, 0], out2[:, 0]) and torch.equal(lse[..., 0], lse2[..., 0])
    assert not torch.equal(out[:, 1], out2[:, 1])


def test_decode_single_token_is_full_attention(repo):
    inputs = decode_case(16, [3, 90], 1, 0.2, seed=2)
    out, lse = repo.reference(DECODE[16])(**inputs)
    q, cache, table = inputs["q"].double(), inputs["k_cache"].double(), inputs["block_table"]
    keys = torch.cat([cache[table[1, 0]], cache[table[1, 1]]])[:90, 0]  # request 1: all 90 keys
    logits = (q[1, 0] @ keys.T) * 0.2
    torch.testing.assert_close(lse[1, :, 0].double(), torch.logsumexp(logits, dim=-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seqlens, s_q, message", [
    ([5, 1], 2, "min(cache_seqlens) >= seq_len_q"),  # a draft token would see no key
    ([0, 4], 1, "min(cache_seqlens) >= seq_len_q"),  # an empty request
    ([65, 3], 1, "max(cache_seqlens) <= max_blocks_per_seq * page_block_size"),
])
def test_decode_constraints_reject(repo, seqlens, s_q, message):
    inputs = decode_case(16, [max(n, s_q) for n in seqlens], s_q, 0.1, seed=1, extra_slots=0)
    inputs["cache_seqlens"] = torch.tensor(seqlens, dtype=torch.int32)
    if seqlens[0] == 65:  # one block of table for a request that needs two
        inputs["block_table"] = inputs["block_table"][:, :1].contiguous()
    with pytest.raises(BindingError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        bind_axes(repo.definition(DECODE[16]), inputs)


def test_decode_constraints_reject_block_ids_outside_the_pool(repo):
    inputs = decode_case(16, [10], 1, 0.1, seed=1)
    inputs["block_table"][0, 0] = inputs["k_cache"].shape[0]
    with pytest.raises(BindingError, match="max.block_table. < num_blocks"):
        bind_axes(repo.definition(DECODE[16]), inputs)


# ---------------------------------------------------------------- prefill


def prefill_case(dqk, q_lens, k_lens, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(sum(q_lens), HEADS_MHA, dqk, generator=g).bfloat16(),
        "k": torch.randn(sum(k_lens), HEADS_MHA, dqk, generator=g).bfloat16(),
        "v": torch.randn(sum(k_lens), HEADS_MHA, DV_MHA, generator=g).bfloat16(),
        "cu_seqlens_q": indptr(q_lens), "cu_seqlens_k": indptr(k_lens), "softmax_scale": scale,
    }


def prefill_float64(inputs):
    """Every query against every key of the batch, masked to its own sequence and the causal rule."""
    q, k, v = inputs["q"].double(), inputs["k"].double(), inputs["v"].double()
    visible = causal_visibility(inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist())
    logits = torch.einsum("thd,nhd->thn", q, k) * inputs["softmax_scale"]
    logits = logits.masked_fill(~visible[:, None, :], -math.inf)
    peak = logits.max(dim=-1, keepdim=True).values
    weights = torch.exp(logits - peak)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("thn,nhd->thd", weights / total, v)
    return out, (peak + torch.log(total))[..., 0]


PREFILL_CASES = [
    # (q_lens, k_lens): prefix + queries, square, q_len 1 over a prefix, no queries, one key
    ([1, 3, 4, 0, 2, 1], [1, 9, 4, 5, 2, 20]),
    ([7], [7]),
    ([2, 9], [12, 9]),
]


@pytest.mark.parametrize("dqk", [192, 128])
@pytest.mark.parametrize("q_lens, k_lens", PREFILL_CASES)
def test_prefill_reference(repo, dqk, q_lens, k_lens):
    scale = 1 / math.sqrt(dqk)
    inputs = prefill_case(dqk, q_lens, k_lens, scale, seed=len(q_lens) + dqk)
    bind_axes(repo.definition(PREFILL[dqk]), inputs)
    out, lse = run_unchanged(repo.reference(PREFILL[dqk]), inputs)
    assert_close_to_truth(out, lse, *prefill_float64(inputs))


def test_prefill_reference_in_query_chunks(repo, monkeypatch):
    # A long sequence is processed in chunks of queries; force tiny chunks and compare.
    inputs = prefill_case(128, [13, 5], [20, 5], 0.3, seed=9)
    run = repo.reference(PREFILL[128])
    monkeypatch.setitem(run.__globals__, "MAX_LOGITS", HEADS_MHA * 20 * 3)  # 3 queries per chunk
    out, lse = run(**inputs)
    assert_close_to_truth(out, lse, *prefill_float64(inputs))


def test_prefill_is_bottom_right_causal(repo):
    # q_len 3 over k_len 6: query i sees keys j <= 3 + i. Changing key 4 changes queries 1 and 2 only.
    inputs = prefill_case(128, [3], [6], 0.2, seed=4)
    run = repo.reference(PREFILL[128])
    out, lse = run(**inputs)
    changed = dict(inputs, k=inputs["k"].clone(), v=inputs["v"].clone())
    changed["k"][4] += 1
    changed["v"][4] += 1
    out2, lse2 = run(**changed)
    assert torch.equal(out[0], out2[0]) and torch.equal(lse[0], lse2[0])
    assert not torch.equal(out[1], out2[1]) and not torch.equal(out[2], out2[2])


def test_prefill_single_key_returns_its_value(repo):
    inputs = prefill_case(192, [1], [1], 0.3, seed=6)
    out, lse = repo.reference(PREFILL[192])(**inputs)
    assert torch.equal(out[0], inputs["v"][0])
    logits = (inputs["q"][0].double() * inputs["k"][0].double()).sum(-1) * 0.3
    torch.testing.assert_close(lse[0].double(), logits, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dqk", [192, 128])
def test_prefill_constraint_rejects_more_queries_than_keys(repo, dqk):
    inputs = prefill_case(dqk, [2, 5], [4, 3], 0.1, seed=1)  # sequence 1: 5 queries, 3 keys
    with pytest.raises(BindingError, match=r"min\(\(cu_seqlens_k"):
        bind_axes(repo.definition(PREFILL[dqk]), inputs)


# ---------------------------------------------------------------- generators and workloads


def test_block_table_generator():
    spec = BlockTable(generator="block_table", seqlens=Lengths(distribution="list", values=[1, 64, 65, 200]),
                      block_pool=40, max_blocks_per_seq=6)
    tensors, axes = GENERATORS["block_table"](spec, np.random.default_rng(0))
    table, lengths = tensors["block_table"], tensors["cache_seqlens"]
    assert axes == {"batch_size": 4, "num_blocks": 40, "max_blocks_per_seq": 6, "page_block_size": 64}
    assert table.dtype == torch.int32 and lengths.dtype == torch.int32 and lengths.tolist() == [1, 64, 65, 200]
    used = [table[b, :n].tolist() for b, n in enumerate([1, 1, 2, 4])]
    for b, n in enumerate([1, 1, 2, 4]):
        assert (table[b, n:] == -1).all()
    flat = sum(used, [])
    assert len(set(flat)) == len(flat) == 8 and all(0 <= i < 40 for i in flat)
    assert flat != sorted(flat)  # a random permutation, not contiguous blocks


@pytest.mark.parametrize("changes, message", [
    (dict(block_pool=2), "smaller than the 3 blocks"),
    (dict(max_blocks_per_seq=1), "smaller than the longest"),
    (dict(unused=0), "is a real block id"),
])
def test_block_table_generator_rejects(changes, message):
    spec = BlockTable(generator="block_table", seqlens=Lengths(distribution="list", values=[10, 100]), **changes)
    with pytest.raises(ValueError, match=message):
        GENERATORS["block_table"](spec, np.random.default_rng(0))


def test_varlen_generator():
    spec = Varlen(generator="varlen", q_lens=Lengths(distribution="list", values=[3, 0, 5]),
                  prefix_lens=Lengths(distribution="list", values=[4, 2, 0]))
    tensors, axes = GENERATORS["varlen"](spec, np.random.default_rng(0))
    assert tensors["cu_seqlens_q"].tolist() == [0, 3, 3, 8] and tensors["cu_seqlens_k"].tolist() == [0, 7, 9, 14]
    assert tensors["cu_seqlens_q"].dtype == torch.int32 and axes == {"total_q": 8, "total_k": 14}
    with pytest.raises(ValueError, match="prefix_lens gives 1"):
        GENERATORS["varlen"](spec.model_copy(update={"prefix_lens": Lengths(distribution="list", values=[1])}),
                             np.random.default_rng(0))


@pytest.mark.parametrize("name, oracle", [
    *((n, decode_float64) for n in DECODE.values()), *((n, prefill_float64) for n in PREFILL.values()),
])
def test_references_on_smoke_workloads(repo, name, oracle):
    definition = repo.definition(name)
    run = repo.reference(name)
    workloads = [w for w in repo.workload_set(name).workloads if "smoke" in w.tags]
    assert workloads
    for workload in workloads:
        inputs = generate_inputs(definition, workload, seed=1)
        if "block_table" in inputs:  # unused table slots hold -1, as the definition says
            table, lengths = inputs["block_table"], inputs["cache_seqlens"]
            blocks = (lengths + BLOCK - 1) // BLOCK
            slots = torch.arange(table.shape[1])[None, :]
            assert (table[slots >= blocks[:, None]] == -1).all() and (table[slots < blocks[:, None]] >= 0).all()
        out, lse = run(**inputs)
        assert_close_to_truth(out, lse, *oracle(inputs))
