"""The cost model (flashbench/cost.py): bytes and FLOPs from a definition's expressions."""

from pathlib import Path

import torch

from flashbench import Repo
from flashbench.cost import evaluate_cost

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"


def definition_with(**cost):
    definition = Repo(Path(__file__).resolve().parents[1]).definition(DEFINITION)
    return definition.model_copy(update={"cost": definition.cost.model_copy(update=cost)})


def test_a_cost_is_bytes_and_flops_of_the_given_inputs():
    definition = definition_with(bytes="num_kv_indices * 4", flops="max(kv_indices) * 2")
    assert evaluate_cost(definition, {"num_kv_indices": 3}, {"kv_indices": torch.tensor([1, 5, 2])}) == (12.0, 10.0)


def test_a_cost_that_is_no_finite_number_is_none():
    """The max of no index is -inf (a batch without requests): no floor rather than a negative one."""
    definition = definition_with(bytes="num_kv_indices * 4", flops="max(kv_indices) * 2")
    assert evaluate_cost(definition, {"num_kv_indices": 0}, {"kv_indices": torch.zeros(0, dtype=torch.int32)}) is None


def test_products_of_int32_lengths_do_not_wrap():
    """A causal prefill's FLOPs multiply two lengths of int32 offsets: one sequence of 50,000 tokens made
    q_len * k_len 2.5e9, past int32, and the cost came out negative."""
    definition = definition_with(bytes="num_kv_indices * 4",
                                 flops="sum((kv_indptr[1:] - kv_indptr[:-1]) * (kv_indptr[1:] - kv_indptr[:-1]))")
    indptr = torch.tensor([0, 50_000], dtype=torch.int32)
    assert evaluate_cost(definition, {"num_kv_indices": 50_000}, {"kv_indptr": indptr}) == (200_000.0, 2.5e9)


def test_the_mla_prefill_counts_the_pairs_its_causal_mask_shows_when_a_request_has_fewer_keys_than_queries():
    """The definition lets a request hold fewer keys than queries (its first queries see none, output 0, lse -inf):
    q_len * kv_len - q_len * (q_len - 1) / 2 counted negative pairs there (4 queries over 1 key: -2)."""
    definition = Repo(Path(__file__).resolve().parents[1]).definition("mla_paged_prefill_causal_h16_ckv512_kpe64_ps1")
    q_lens, kv_lens = [4, 5, 3, 2, 0, 7], [1, 2, 0, 6, 3, 7]
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    pairs = sum(max(0, min(k, k - q + i + 1)) for q, k in zip(q_lens, kv_lens) for i in range(q))
    axes = {"total_q": sum(q_lens), "num_kv_indices": sum(kv_lens), "len_indptr": len(q_lens) + 1,
            **definition.const_axes}
    _, flops = evaluate_cost(definition, axes, {"qo_indptr": qo, "kv_indptr": kv})
    assert flops == 2 * 16 * (512 + 64 + 512) * pairs
