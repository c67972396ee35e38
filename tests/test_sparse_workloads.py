"""The sparse-attention generators (flashbench/workloads/generators.py: sparse_prefill_indices,
sparse_decode_indices, fp8_kv_cache) and the flashmla_sparse workload sets and cost models."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from flashbench import Repo
from flashbench.binding import bind_axes
from flashbench.cost import evaluate_cost
from flashbench.model import Lengths
from flashbench.model.workload import FP8KVCache, KVCacheValues, SparseDecodeIndices, SparsePrefillIndices
from flashbench.workloads import generate_inputs
from flashbench.workloads.generators import GENERATORS, random_subsets

ROOT = Path(__file__).resolve().parents[1]
INT32_MAX = 2**31 - 1


def lengths(*values):
    return Lengths(distribution="list", values=list(values))


def prefill(seed=0, **fields):
    spec = SparsePrefillIndices(generator="sparse_prefill_indices", **{"topk": 32, **fields})
    return GENERATORS["sparse_prefill_indices"](spec, np.random.default_rng(seed))


def decode(seed=0, **fields):
    spec = SparseDecodeIndices(generator="sparse_decode_indices", **{"topk": 16, **fields})
    return GENERATORS["sparse_decode_indices"](spec, np.random.default_rng(seed))


def test_random_subsets_are_distinct_visible_positions_then_minus_one():
    visible = np.array([0, 1, 7, 16, 17, 40, 64, 65, 1000, 5000])
    out = random_subsets(np.random.default_rng(0), visible, 16)
    for v, row in zip(visible, out):
        chosen = row[: min(16, v)]
        assert len(set(chosen.tolist())) == len(chosen) and (chosen >= 0).all() and (chosen < v).all()
        assert (row[min(16, v):] == -1).all()


def test_prefill_indices_are_causal_per_request():
    tensors, axes = prefill(q_lens=lengths(5, 40), prefix_lens=lengths(0, 10))
    assert axes == {"seq_len_q": 45, "seq_len_kv": 55}
    indices = tensors["indices"]
    assert indices.shape == (45, 1, 32) and indices.dtype == torch.int32 and "topk_length" not in tensors
    for row in range(45):
        first_key, visible = (0, row + 1) if row < 5 else (5, 10 + row - 5 + 1)
        ids = indices[row, 0]
        count = min(32, visible)
        assert ((ids[:count] >= first_key) & (ids[:count] < first_key + visible)).all()
        assert len(set(ids[:count].tolist())) == count and (ids[count:] == -1).all()


def test_prefill_invalid_mix_scatter_empty_rows_and_topk_length():
    tensors, axes = prefill(q_lens=lengths(3, 30), prefix_lens=lengths(2, 40), invalid="mixed", scatter=True,
                            empty_queries=2, topk_length=True)
    indices, length = tensors["indices"][:, 0].long(), tensors["topk_length"].long()
    seq_len_kv = axes["seq_len_kv"]
    valid = (indices >= 0) & (indices < seq_len_kv)
    counted = valid & (torch.arange(32)[None, :] < length[:, None])
    visible = torch.tensor([3, 4, 5] + [41 + i for i in range(30)])
    assert (length == 0).sum() == 2  # the empty query tokens
    expected = torch.where(length == 0, 0, torch.clamp(visible, max=32))
    assert torch.equal(counted.sum(1), expected)
    assert valid[length < 32].any()  # past topk_length: real ids that must be ignored
    invalid = indices[~valid & (torch.arange(32)[None, :] < length[:, None])]
    assert {-1, INT32_MAX} <= set(invalid.tolist()) and (invalid >= seq_len_kv).any()


def test_decode_indices_point_into_each_requests_blocks_and_nan_tokens_are_never_valid():
    tensors, axes = decode(kv_lens=lengths(0, 1, 70, 130), seq_len_q=2, block_size=64, block_pool=8,
                           fp8_cache=KVCacheValues(zero_tokens=0.1))
    assert axes == {"batch_size": 4, "seq_len_q": 2, "num_blocks": 8}
    indices, cache = tensors["indices"].long(), tensors["k_cache"]
    assert indices.shape == (4, 2, 16) and cache.shape == (8, 64, 1, 656) and cache.dtype == torch.int8
    counts = (indices != -1).sum(-1)
    assert counts.tolist() == [[0, 0], [0, 1], [16, 16], [16, 16]]  # a token sees positions 0..kv_len - s_q + s
    blocks_of = [set((row[row >= 0] // 64).tolist()) for row in indices.reshape(4, -1)]
    assert all(not (a & b) for i, a in enumerate(blocks_of) for b in blocks_of[i + 1:])  # requests own their blocks
    tokens = cache.view(-1, 656)
    nan_token = (tokens[:, :512] == 0x7F).all(1)
    assert nan_token.sum() == 8 * 64 - (1 + 70 + 130) and not nan_token[indices[indices >= 0]].any()
    scales = tokens[~nan_token, 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two


def test_packed_fp8_cache_is_the_quantize_reference_of_the_bfloat16_one():
    spec = dict(generator="fp8_kv_cache", num_blocks=3, values=KVCacheValues(spread=12, boundary_tiles=0.2, zero_tokens=0.1))
    (plain, _), (packed, axes) = (GENERATORS["fp8_kv_cache"](FP8KVCache(**spec, packed=p), np.random.default_rng(7))
                                  for p in (False, True))
    path = ROOT / "references" / "flashmla_sparse" / "flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64.py"
    module_spec = importlib.util.spec_from_file_location("quantize_reference", path)
    quantize = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(quantize)
    assert axes == {"num_blocks": 3} and torch.equal(quantize.run(plain["kv_cache"]), packed["kv_cache_fp8"])
    tiles = plain["kv_cache"][..., :512].float().reshape(-1, 4, 128).abs().amax(-1)
    assert (tiles == 0).any() and ((tiles / 448) == torch.exp2(torch.log2(tiles / 448).round())).any()  # zero and 448 * 2^k tiles


def sparse_definitions():
    return [n for n in Repo(ROOT).names() if n.startswith("flashmla_sparse_")]


@pytest.mark.parametrize("name", sparse_definitions())
def test_smoke_workloads_are_tiny_and_the_cost_counts_valid_entries(name):
    repo = Repo(ROOT)
    definition = repo.definition(name)
    smoke = [w for w in repo.workload_set(name).workloads if "smoke" in w.tags]
    assert len(smoke) >= 2
    for workload in smoke:
        inputs = generate_inputs(definition, workload, seed=0, device="cpu", base_dir=repo.definition_path(name).parent)
        axes = bind_axes(definition, inputs)
        nbytes, flops = evaluate_cost(definition, axes, inputs)
        assert nbytes > 0 and flops > 0
        if "indices" not in inputs:
            continue
        indices = inputs["indices"].long()
        assert indices.shape[-1] == 2048 and indices.numel() <= 16 * 2048
        if "topk_length" in inputs:
            counted = int(inputs["topk_length"].sum())
        elif "seq_len_kv" in axes:
            counted = int(((indices >= 0) & (indices < axes["seq_len_kv"])).sum())
        else:
            counted = int((indices != -1).sum())
        assert counted > 0
        assert flops == 2 * axes["num_heads_q"] * (576 + 512) * counted
