"""The definition: the contract every solution of an op is judged against."""

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..dtypes import DTypeName
from ..expressions import COST_FUNCTIONS, Expression, parse

_REFERENCE_PATH = re.compile(r"^[\w./-]+\.py$")
# A name that is also a folder (solutions/<definition>/<name>/, solutions/_shared/<name>/): no path,
# and never '.' or '..'. A workload's name is one too, or none. At most NAME_CHARS: `submit` stages a
# folder as `.<name>.incoming`, and a name of 600 characters ended it with the file system's ENAMETOOLONG
# after its run, and crowded every chart's legend out.
NAME_CHARS = 128
_NAME = rf"[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{NAME_CHARS - 1}}}"
FOLDER_NAME = rf"^{_NAME}$"
FOLDER_NAME_OR_NONE = rf"^({_NAME})?$"
SHARED_FOLDER = "_shared"  # solutions/_shared/<name>/: files that several solution folders use; no definition's name
# Constraints may reduce an index tensor to one value ("every request has at least one key").
CONSTRAINT_FUNCTIONS = frozenset({"min", "max"})


INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


class Strict(BaseModel):
    """Base for file models: unknown keys are an error, not silently dropped, and so is NaN, which no field
    means (a workload's NaN sm_scale failed every pair, the reference's included). An infinity may mean
    something (an attention sink of -inf is none). So is an integer past int64: numpy and torch take every
    integer as one (a const axis or a request length of 10^30 ended `validate` with a traceback)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _a_value(cls, value):
        if _holds(value, lambda x: isinstance(x, float) and math.isnan(x)):
            raise ValueError("NaN is no value")
        if _holds(value, lambda x: isinstance(x, int) and not INT64_MIN <= x <= INT64_MAX):
            raise ValueError("an integer past int64 is no value here")
        return value


def _holds(value, bad) -> bool:
    """Whether `value`, or any item of the lists and mappings in it, is `bad`."""
    if isinstance(value, (list, tuple)):
        return any(_holds(item, bad) for item in value)
    if isinstance(value, dict):
        return any(_holds(item, bad) for item in value.values())
    return bad(value)


class Axis(Strict):
    type: Literal["const", "var"]
    value: int | None = Field(None, ge=0, description="const: the size (a negative one made no tensor)")
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


class InputSpec(TensorSpec):
    constant: bool = Field(False, description="the same on every call of the system modelled (a model weight such as "
                                              "a per-head sink): a workload may capture it, calls do not redraw it, "
                                              "and a solution may keep what it derives from it; any other input that "
                                              "carries data changes from call to call")


class Tolerance(Strict):
    """allclose semantics: |out - ref| <= atol + rtol * |ref| for every element."""

    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)
    max_mismatch_fraction: float = Field(0.0, ge=0, le=1, description="share of elements allowed outside")


class AllClose(Strict):
    """Each output within its `tolerances` (allclose), call by call: the default."""

    kind: Literal["allclose"] = "allclose"


class Bitwise(Strict):
    """Each output equal, bit for bit, to the reference's as torch converts it to the output's dtype
    (from float64 to a float8 torch rounds twice, through float32: return the output's dtype where
    that matters): integer, packed and exactly rounded outputs. NaN never passes; -0.0 is not 0.0."""

    kind: Literal["bitwise"]


class Quantized(Strict):
    """Each output within `steps` quantisation steps of the reference: |out - ref| <= steps * q(ref), q(ref)
    the spacing of the output's dtype at |ref| (1 for integers). float4_e2m1 outputs are unpacked (low
    nibble first) and the reference returns them packed too."""

    kind: Literal["quantized"]
    steps: float = Field(1.0, ge=0, description="allowed distance, in steps of the output's dtype")
    max_mismatch_fraction: float = Field(0.0, ge=0, le=1, description="share of elements allowed outside")


class Sampling(Strict):
    """Every output holds samples: integer category ids drawn independently, one per element.

    reference: distribution (the default): the reference returns, per output, the distribution they
    are drawn from: float, shape [*output shape, categories], finite and non-negative, each row
    divided by its sum (zero outside the support, e.g. past top-k / top-p). Over the checked calls
    of a job, every sample must lie in the support, and all of them together must pass a
    goodness-of-fit test against those probabilities.

    reference: samples: the reference samples too, as FlashInfer-Bench's sampling references do
    (torch.multinomial), and the judge runs it `reference_draws` times per checked call, each draw
    seeded afresh. Every sample must be a category the inputs allow (as far as they say: see
    run/judge/evaluators.py), and all of them together must pass a two-sample test against the
    reference's draws on the same inputs.

    Either test fails an honest sampler with probability at most `false_failure_probability`."""

    kind: Literal["sampling"]
    false_failure_probability: float = Field(1e-6, gt=0, lt=1)
    reference: Literal["distribution", "samples"] = Field(
        "distribution", description="what the reference returns: the distribution of each sample, or samples")
    reference_draws: int = Field(8, ge=1, le=64, description="reference: samples only: the reference's draws "
                                                               "per checked call; more make the test stronger")


Evaluator = Annotated[AllClose | Bitwise | Quantized | Sampling, Field(discriminator="kind")]
INTEGER_DTYPES = frozenset({"int64", "int32", "int16", "int8"})


class CostModel(Strict):
    """What any solution must do at the least: bytes through device memory and FLOPs."""

    bytes: str
    flops: str


class Definition(Strict):
    name: str = Field(pattern=FOLDER_NAME)  # solutions/<name>/
    op_type: str
    description: str = ""
    tags: list[str] = []
    axes: dict[str, Axis]
    inputs: dict[str, InputSpec]
    outputs: dict[str, TensorSpec]
    constraints: list[str] = []
    reference: str = Field(description="a .py path under references/, or Python source with a top-level run")
    tolerances: dict[str, Tolerance] = {}
    cost: CostModel | None = None
    evaluator: Evaluator = Field(AllClose(), description="how outputs are judged: allclose, bitwise, quantized, "
                                                         "sampling, or a mapping with `kind` and its parameters")

    @field_validator("name")
    @classmethod
    def _not_the_shared_folder(cls, name: str) -> str:
        if name.lower() == SHARED_FOLDER:  # its solutions would be written into solutions/_shared/ (import-fib)
            raise ValueError(f"{SHARED_FOLDER!r} is the folder of shared files, no definition's name")
        return name

    @field_validator("evaluator", mode="before")
    @classmethod
    def _evaluator_by_name(cls, value):
        return {"kind": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _evaluator_fits(self):
        kind = self.evaluator.kind
        if kind != "allclose" and self.tolerances:
            raise ValueError(f"tolerances: apply to evaluator 'allclose' only, not {kind!r}")
        for name, spec in self.outputs.items():
            if kind == "sampling" and (spec.dtype not in INTEGER_DTYPES or spec.shape is None):
                raise ValueError(f"outputs.{name}: evaluator 'sampling' needs integer tensors of sample ids, "
                                 f"not {'a scalar' if spec.shape is None else spec.dtype}")
            if kind == "quantized" and spec.dtype == "bool":
                raise ValueError(f"outputs.{name}: evaluator 'quantized' has no steps for bool; use 'bitwise'")
        return self

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
