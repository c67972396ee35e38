"""FlashInfer-Bench's dataset ("flashinfer-trace") format: its file models and its folder layout.

The single source of truth for that format in flashbench. Reading is lenient where FIB versions
differ (missing optional keys, `null` for "not given", unknown keys kept aside); writing follows
FIB's own conventions (a scalar's `shape` is always written, as null; workload lines carry
`"solution": null, "evaluation": null`; NaN errors are written as strings).

Layout of a dataset:
    definitions/<op_type>/<name>.json
    workloads/<op_type>/<definition>.jsonl                      one workload-only trace per line
    solutions/<author>/<op_type>/<definition>/<solution>.json   sources embedded
    traces/<author>/<op_type>/<definition>.jsonl
    blob/workloads/...                                          safetensors named by workloads
"""

from pathlib import Path, PurePosixPath
from typing import Annotated, Iterator, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from ..errors import FlashbenchError
from ..model.loading import validation_error

DType = Literal[
    "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3", "float8_e5m2", "float4_e2m1",
    "int64", "int32", "int16", "int8", "bool",
]
# Older FIB versions spell e4m3 without "fn"; flashbench (and torch) only know the "fn" name.
DTYPE_ALIASES = {"float8_e4m3": "float8_e4m3fn"}

Language = Literal["python", "triton", "cpp", "cuda", "tilelang"]
Binding = Literal["tvm-ffi", "torch"]
Status = Literal[
    "PASSED", "INCORRECT_SHAPE", "INCORRECT_NUMERICAL", "INCORRECT_DTYPE", "RUNTIME_ERROR",
    "COMPILE_ERROR", "TIMEOUT",
]


class FibModel(BaseModel):
    """Unknown keys are kept in model_extra so the importer can say what it drops."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings")


class FibAxis(FibModel):
    type: Literal["const", "var"]
    value: int | None = None
    description: str | None = None


class FibTensorSpec(FibModel):
    shape: list[str] | None
    dtype: DType
    description: str | None = None

    @model_serializer(mode="wrap")
    def _always_write_shape(self, handler):
        data = handler(self)
        data.setdefault("shape", self.shape)  # null means a Python scalar: never leave it out
        return data


class FibDefinition(FibModel):
    name: str
    op_type: str
    description: str | None = None
    tags: list[str] | None = None
    axes: dict[str, FibAxis]
    inputs: dict[str, FibTensorSpec]
    outputs: dict[str, FibTensorSpec]
    constraints: list[str] | None = None
    reference: str = Field(description="Python source with a top-level run")


class FibRandomInput(FibModel):
    type: Literal["random"]


class FibScalarInput(FibModel):
    type: Literal["scalar"]
    value: bool | int | float


class FibSafetensorsInput(FibModel):
    type: Literal["safetensors"]
    path: str = Field(description="relative to the dataset root, e.g. ./blob/workloads/...")
    tensor_key: str


FibInput = Annotated[Union[FibRandomInput, FibScalarInput, FibSafetensorsInput], Field(discriminator="type")]


class FibWorkload(FibModel):
    uuid: str
    axes: dict[str, int] = {}
    inputs: dict[str, FibInput] = {}


class FibSourceFile(FibModel):
    path: str
    content: str


class FibBuildSpec(FibModel):
    language: Language
    target_hardware: list[str] = []
    entry_point: str
    dependencies: list[str] = []
    destination_passing_style: bool = True
    binding: Binding | None = None


class FibSolution(FibModel):
    name: str
    definition: str
    author: str
    description: str | None = ""
    spec: FibBuildSpec
    sources: list[FibSourceFile]


class FibCorrectness(FibModel):
    max_relative_error: float = 0.0
    max_absolute_error: float = 0.0


class FibPerformance(FibModel):
    latency_ms: float = 0.0
    reference_latency_ms: float = 0.0
    speedup_factor: float = 0.0


class FibEnvironment(FibModel):
    hardware: str
    libs: dict[str, str] = {}


class FibEvaluation(FibModel):
    status: Status
    log: str = ""
    correctness: FibCorrectness | None = None
    performance: FibPerformance | None = None
    environment: FibEnvironment
    timestamp: str


class FibTrace(FibModel):
    """A line of a traces/ or workloads/ JSONL file; workload lines have no solution or evaluation."""

    definition: str
    workload: FibWorkload
    solution: str | None = None
    evaluation: FibEvaluation | None = None

    @property
    def is_workload_only(self) -> bool:
        return self.solution is None or self.evaluation is None


# --- layout -------------------------------------------------------------------------------------

def definition_path(dataset: Path, op_type: str, name: str) -> Path:
    return dataset / "definitions" / op_type / f"{name}.json"


def workloads_path(dataset: Path, op_type: str, definition: str) -> Path:
    return dataset / "workloads" / op_type / f"{definition}.jsonl"


def solution_path(dataset: Path, author: str, op_type: str, definition: str, name: str) -> Path:
    return dataset / "solutions" / author / op_type / definition / f"{name}.json"


def traces_path(dataset: Path, author: str, op_type: str, definition: str) -> Path:
    return dataset / "traces" / author / op_type / f"{definition}.jsonl"


def blob_path(op_type: str, definition: str, uuid: str) -> str:
    """Where a workload's materialised tensors go, as FIB writes it: relative to the dataset root."""
    return f"./blob/workloads/{op_type}/{definition}/{uuid}.safetensors"


def normalise_blob_path(path: str) -> PurePosixPath | None:
    """'./blob/x.safetensors' -> 'blob/x.safetensors'; None if it is absolute or leaves the dataset."""
    parts = [p for p in PurePosixPath(path).parts if p != "."]
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        return None
    return PurePosixPath(*parts)


# --- reading and writing ------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def read_json(cls: type[M], path: Path) -> M:
    """One FIB JSON file as `cls`; errors name the file and the field."""
    try:
        return cls.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise _json_error(exc, path) from None


def read_jsonl(cls: type[M], path: Path) -> Iterator[tuple[int, M]]:
    """(line number, record) for every non-blank line; errors name the file, line and field."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, cls.model_validate_json(line)
        except ValidationError as exc:
            error = _json_error(exc, path)
            raise FlashbenchError(error.message, path, ", ".join(filter(None, [f"line {number}", error.field]))) from None


def _json_error(exc: ValidationError, path: Path) -> FlashbenchError:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return FlashbenchError(f"invalid JSON: {first['msg']}", path)
    return validation_error(exc, path)


def write_json(path: Path, model: BaseModel) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.model_dump_json(indent=2, exclude_none=True) + "\n")


def write_jsonl(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))


def trace_line(trace: FibTrace) -> str:
    return trace.model_dump_json(exclude_none=True)


def workload_line(definition: str, workload: FibWorkload) -> str:
    """A workloads/ line: FIB's trace record with an explicit null solution and evaluation."""
    return FibTrace(definition=definition, workload=workload).model_dump_json()
