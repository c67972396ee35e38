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
