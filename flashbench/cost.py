"""The cost model: bytes and FLOPs a definition says any solution must move and do."""

import math
from typing import Any

import torch

from .expressions import COST_FUNCTIONS, parse
from .model import Definition


def evaluate_cost(definition: Definition, axes: dict[str, int], inputs: dict[str, Any]) -> tuple[float, float] | None:
    """(bytes, flops) for concrete inputs, or None when the definition has no cost model or it gives no finite
    number (the max of an empty tensor is -inf)."""
    if definition.cost is None:
        return None
    # Integer tensors in int64: index tensors are int32, and a product of two lengths (a causal prefill's
    # q_len * k_len) wrapped past 2^31 in their dtype (one sequence of 50,000 tokens gave negative FLOPs).
    env = {**{name: _widened(value) for name, value in inputs.items()}, **axes}
    names = definition.expression_names
    functions = frozenset(COST_FUNCTIONS)
    nbytes = parse(definition.cost.bytes, names, functions).evaluate(env)
    flops = parse(definition.cost.flops, names, functions).evaluate(env)
    nbytes, flops = float(nbytes), float(flops)
    return (nbytes, flops) if math.isfinite(nbytes) and math.isfinite(flops) else None


def _widened(value: Any) -> Any:
    """An integer tensor (not bool) as int64; anything else as it is."""
    if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
            and value.dtype not in (torch.bool, torch.int64):
        return value.to(torch.int64)
    return value
