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
    names, functions = definition.expression_names, frozenset(COST_FUNCTIONS)
    expressions = [parse(source, names, functions) for source in (definition.cost.bytes, definition.cost.flops)]
    # Narrow integer tensors in int64: index tensors are int32, and a product of two lengths (a causal prefill's
    # q_len * k_len) wrapped past 2^31 in their dtype (one sequence of 50,000 tokens gave negative FLOPs). Only
    # those the costs read are copied (an index of 10^8 entries the costs never read is 800 MB more as int64).
    read = set().union(*(expression.names for expression in expressions))
    env = {**{name: _widened(value) if name in read else value for name, value in inputs.items()}, **axes}
    nbytes, flops = (float(expression.evaluate(env)) for expression in expressions)
    return (nbytes, flops) if math.isfinite(nbytes) and math.isfinite(flops) else None


def _widened(value: Any) -> Any:
    """A signed integer tensor narrower than int64 as int64 (bool and uint8 ones index as masks: kept)."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.int8, torch.int16, torch.int32):
        return value.to(torch.int64)
    return value
