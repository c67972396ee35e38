"""The definition: the contract every solution of an op is judged against."""

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..dtypes import DTypeName
from ..expressions import COST_FUNCTIONS, Expression, parse

_REFERENCE_PATH = re.compile(r"^[\w./-]+\.py$")
# Constraints may reduce an index tensor to one value ("every request has at least one key").
CONSTRAINT_FUNCTIONS = frozenset({"min", "max"})


class Strict(BaseModel):
    """Base for file models: unknown keys are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


class Axis(Strict):
    type: Literal["const", "var"]
    value: int | None = None
    description: str = ""

    @model_validator(mode="after")
    def _const_has_value(self):
        if self.type == "const" and self.value is None:
            raise ValueError("a const axis needs a 'value'")
        return self


class TensorSpec(Strict):
    shape: list[str] | None = Field(description="axis names; null for a Python scalar")
    dtype: DTypeName
    description: str = ""


class Tolerance(Strict):
    """allclose semantics: |out - ref| <= atol + rtol * |ref| for every element."""

    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)
    max_mismatch_fraction: float = Field(0.0, ge=0, le=1, description="share of elements allowed outside")


class CostModel(Strict):
    """What any solution must do at the least: bytes through device memory and FLOPs."""

    bytes: str
    flops: str


class Definition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    op_type: str
    description: str = ""
    tags: list[str] = []
    axes: dict[str, Axis]
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    constraints: list[str] = []
    reference: str = Field(description="a .py path under references/, or Python source with a top-level run")
    tolerances: dict[str, Tolerance] = {}
    cost: CostModel | None = None

    @model_validator(mode="after")
    def _consistent(self):
        clash = sorted(set(self.inputs) & set(self.outputs))
        if clash:
            raise ValueError(f"outputs.{clash[0]}: {', '.join(clash)} is both an input and an output")
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            for tensor, spec in specs.items():
                unknown = [a for a in spec.shape or [] if a not in self.axes]
                if unknown:
                    raise ValueError(
                        f"{kind}.{tensor}.shape: axis {unknown[0]!r} is not defined "
                        f"(axes: {', '.join(self.axes)})"
                    )
        for key in self.tolerances:
            if key not in self.outputs:
                raise ValueError(f"tolerances.{key}: not an output (outputs: {', '.join(self.outputs)})")
        self._parse_all()
        return self

    def _parse_all(self) -> None:
        names = self.expression_names
        for i, source in enumerate(self.constraints):
            try:
                parse(source, names, CONSTRAINT_FUNCTIONS)
            except ValueError as exc:
                raise ValueError(f"constraints[{i}]: {exc}") from None
        if self.cost is not None:
            for field in ("bytes", "flops"):
                try:
                    parse(getattr(self.cost, field), names, frozenset(COST_FUNCTIONS))
                except ValueError as exc:
                    raise ValueError(f"cost.{field}: {exc}") from None

    @property
    def expression_names(self) -> set[str]:
        return set(self.axes) | set(self.inputs)

    @property
    def constraint_expressions(self) -> list[Expression]:
        return [parse(c, self.expression_names, CONSTRAINT_FUNCTIONS) for c in self.constraints]

    @property
    def const_axes(self) -> dict[str, int]:
        return {k: a.value for k, a in self.axes.items() if a.type == "const"}

    @property
    def var_axes(self) -> list[str]:
        return [k for k, a in self.axes.items() if a.type == "var"]

    @property
    def reference_is_path(self) -> bool:
        return bool(_REFERENCE_PATH.match(self.reference))

    def tolerance(self, output: str) -> Tolerance:
        return self.tolerances.get(output, DEFAULT_TOLERANCE)


DEFAULT_TOLERANCE = Tolerance(atol=1e-2, rtol=1e-2)
