"""FlashInfer-Bench's dataset ("flashinfer-trace") format: its file models and its folder layout.

The single source of truth for that format in flashbench, checked against flashinfer-bench 0.1.2's
own models (`flashinfer_bench.data`). Reading is lenient where FIB versions differ (missing optional
keys, `null` for "not given", unknown keys kept aside); writing follows FIB's conventions (a
scalar's `shape` is always written, as null; workload lines carry `"solution": null,
"evaluation": null`; NaN errors are written as strings).

Layout, as FIB 0.1.2 writes it (`TraceSet.add_traces`, `add_workload_traces`):
    definitions/<op_type>/<name>.json
    workloads/<op_type>/<definition>.jsonl                      one workload-only trace per line
    solutions/<author>/<op_type>/<definition>/<solution>.json   sources embedded
    traces/<op_type>/<definition>.jsonl                         (older datasets: traces/<author>/<op_type>/...)
    blob/workloads/...                                          safetensors named by workloads
FIB's loader (`TraceSet.from_path`) reads every *.json under definitions/ and solutions/ and every
*.jsonl under workloads/ and traces/ at any depth, and refuses two solutions of one name anywhere
in the dataset. Nothing else under the root is read by FIB.

flashbench's own fields ride along under the key `flashbench` of a record (FIB 0.1.2's models
ignore unknown keys); see the *Extension models below. What belongs to no FIB record lives in
side files outside FIB's folders: `flashbench.json` and `flashbench/`.
"""

import json
from pathlib import Path, PurePosixPath
from typing import Annotated, Iterator, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from ..errors import FlashbenchError
from ..model import loading
from ..model.definition import AllClose, CostModel, Evaluator, Strict, Tolerance
from ..model.loading import bounded_lines, read_bounded, validation_error
from ..model.workload import GeneratorSpec, InputDescriptor

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
EXTENSION = "flashbench"  # the key of flashbench's fields inside FIB records


# --- flashbench's extensions ---------------------------------------------------------------------

class DefinitionExtension(Strict):
    """What a flashbench definition has and FIB's lacks."""

    tolerances: dict[str, Tolerance] = {}
    evaluator: Evaluator = AllClose()
    cost: CostModel | None = None
    workloads_version: int | None = Field(None, ge=1, description="the version of the definition's workload set")
    constant_inputs: list[str] = Field([], description="inputs the same on every call (InputSpec.constant)")


class WorkloadExtension(Strict):
    """The flashbench workload as written (less its uuid): names, tags, random-input parameters and
    structured generators, which FIB cannot express. Its safetensors paths are not used on import:
    the FIB record says where the blobs are."""

    name: str = ""
    tags: list[str] = []
    axes: dict[str, int] = {}
    inputs: dict[str, InputDescriptor] = {}
    generate: list[GeneratorSpec] = []


class SolutionExtension(Strict):
    """Enough to rebuild the solution folder byte for byte, so its content hash (and thus its
    traces) survive the round trip."""

    name: str = Field(description="the flashbench name; the FIB name may carry a suffix that keeps it unique")
    manifest: str = Field(description="solution.yaml, verbatim")
    solution_hash: str = Field(description="the folder's content hash when exported")
    empty_files: list[str] = Field([], description="files of no content, which FIB's sources cannot hold")
    shared: dict[str, list[str]] = Field({}, description="shared folder -> the files of the record that come from it")


# --- FIB's records -------------------------------------------------------------------------------

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
    flashbench: DefinitionExtension | None = None


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
    flashbench: WorkloadExtension | None = None


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
    flashbench: SolutionExtension | None = None


class FibCorrectness(FibModel):
    max_relative_error: float = 0.0
    max_absolute_error: float = 0.0
    extra: dict | None = None  # FIB's own field for further metrics


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
    """A line of a traces/ or workloads/ JSONL file; workload lines have no solution or evaluation.

    `flashbench`: the flashbench trace (model: flashbench.model.Trace) less the fields this record
    holds as they are: definition, workload, timestamp and log."""

    definition: str
    workload: FibWorkload
    solution: str | None = None
    evaluation: FibEvaluation | None = None
    flashbench: dict | None = None

    @property
    def is_workload_only(self) -> bool:
        return self.solution is None or self.evaluation is None


# --- statuses ------------------------------------------------------------------------------------

# flashbench statuses FIB has no word for, and the nearest FIB status. REJECTED (the harness caught
# the solution cheating or its result could not be trusted) is a wrong result, not a crash: FIB's
# INCORRECT_NUMERICAL, whose errors are then NaN unless recorded, so no FIB filter ever passes it.
STATUS_TO_FIB = {"CRASHED": "RUNTIME_ERROR", "REJECTED": "INCORRECT_NUMERICAL",
                 "INVALID_SOLUTION": "COMPILE_ERROR", "MISSING_DEPENDENCY": "COMPILE_ERROR"}


def log_header(status: str, message: str) -> str:
    """What an export puts before a trace's log in FIB's `log`, so FIB's users read flashbench's exact
    status and message; an import takes it off again."""
    if status not in STATUS_TO_FIB and not message:
        return ""
    return f"flashbench {status}: {message}\n" if message else f"flashbench {status}\n"


# --- side files ----------------------------------------------------------------------------------

SIDE_FILE = "flashbench.json"
SIDE_FOLDER = "flashbench"  # reference traces: flashbench/reference_traces/<definition>.jsonl
EXPORT_FORMAT = "flashbench.fib/1"


class SolutionName(Strict):
    definition: str
    name: str


class SideFile(Strict):
    """flashbench.json at the dataset root: what an export holds beyond FIB's records."""

    format_version: Literal["flashbench.fib/1"] = EXPORT_FORMAT
    timing: str = Field(description="the timing method of every exported trace (events or graph)")
    solutions: dict[str, SolutionName] = Field(description="FIB solution name -> flashbench definition and name")


def reference_traces_folder(dataset: Path) -> Path:
    """FIB keeps the reference's latency inside each trace; flashbench's reference traces go here."""
    return dataset / SIDE_FOLDER / "reference_traces"


def reference_traces_path(dataset: Path, definition: str) -> Path:
    return reference_traces_folder(dataset) / f"{definition}.jsonl"


# --- layout -------------------------------------------------------------------------------------

def definition_path(dataset: Path, op_type: str, name: str) -> Path:
    return dataset / "definitions" / op_type / f"{name}.json"


def workloads_path(dataset: Path, op_type: str, definition: str) -> Path:
    return dataset / "workloads" / op_type / f"{definition}.jsonl"


def solution_path(dataset: Path, author: str, op_type: str, definition: str, name: str) -> Path:
    return dataset / "solutions" / author / op_type / definition / f"{name}.json"


def traces_path(dataset: Path, op_type: str, definition: str) -> Path:
    return dataset / "traces" / op_type / f"{definition}.jsonl"


def blob_path(op_type: str, definition: str, uuid: str) -> str:
    """Where a workload's materialised tensors go: relative to the dataset root, as FIB writes it."""
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
        return cls.model_validate_json(read_bounded(path))
    except ValidationError as exc:
        raise _json_error(exc, path) from None


def parse_line(cls: type[M], line: bytes | str, path: Path, number: int) -> M:
    """One JSONL record as `cls`; errors name the file, the line and the field."""
    try:
        return cls.model_validate_json(line)
    except ValidationError as exc:
        error = _json_error(exc, path)
        raise FlashbenchError(error.message, path, ", ".join(filter(None, [f"line {number}", error.field]))) from None


def read_jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for every non-blank line, one at a time: files are never read whole, nor a line
    longer than a record may be (FlashbenchError)."""
    with open(path, "rb") as handle:
        for number, line in bounded_lines(handle):
            if line is None:
                raise FlashbenchError(f"longer than {loading.MAX_RECORD_BYTES >> 20} MiB, the most a record may hold",
                                      path, f"line {number}")
            if line.strip():
                yield number, line


def _json_error(exc: ValidationError, path: Path) -> FlashbenchError:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return FlashbenchError(f"invalid JSON: {first['msg']}", path)
    return validation_error(exc, path)


def json_text(model: BaseModel) -> str:
    return model.model_dump_json(indent=2, exclude_none=True) + "\n"


def record_line(model: BaseModel) -> str:
    return model.model_dump_json(exclude_none=True) + "\n"


def workload_line(definition: str, workload: FibWorkload) -> str:
    """A workloads/ line: FIB's trace record with an explicit null solution and evaluation."""
    record = {"definition": definition, "workload": workload.model_dump(mode="json", exclude_none=True),
              "solution": None, "evaluation": None}
    return json.dumps(record) + "\n"
