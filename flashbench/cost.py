"""The cost model: bytes and FLOPs a definition says any solution must move and do."""

import math
from typing import Any

from .expressions import COST_FUNCTIONS, parse
from .model import Definition


def evaluate_cost(definition: Definition, axes: dict[str, int], inputs: dict[str, Any]) -> tuple[float, float] | None:
    """(bytes, flops) for concrete inputs, or None when the definition has no cost model or it gives no finite
    number (the max of an empty tensor is -inf)."""
    if definition.cost is None:
        return None
    env = {**inputs, **axes}
    names = definition.expression_names
    functions = frozenset(COST_FUNCTIONS)
    nbytes = parse(definition.cost.bytes, names, functions).evaluate(env)
    flops = parse(definition.cost.flops, names, functions).evaluate(env)
    nbytes, flops = float(nbytes), float(flops)
    return (nbytes, flops) if math.isfinite(nbytes) and math.isfinite(flops) else None
