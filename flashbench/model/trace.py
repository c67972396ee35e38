"""A trace: one JSONL record per (solution, workload) run, appended under traces/<hardware>/."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .definition import FOLDER_NAME, FOLDER_NAME_OR_NONE
from .solution import TAG, HardwareName, Label, SolutionName

Status = Literal[
    "PASSED", "INCORRECT_SHAPE", "INCORRECT_DTYPE", "INCORRECT_NUMERICAL", "RUNTIME_ERROR",
    "COMPILE_ERROR", "TIMEOUT", "CRASHED", "INVALID_SOLUTION", "MISSING_DEPENDENCY", "REJECTED",
]


REFERENCE = "reference"  # the solution name the reference's own results are recorded under


class OutputError(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")  # an infinite error stays readable JSON

    max_abs_error: float
    max_rel_error: float
    mismatch_fraction: float


class Performance(BaseModel):
    model_config = ConfigDict(extra="allow")

    latency_ms: float = Field(description="median of the timed calls: the headline")
    mean_ms: float
    std_ms: float
    min_ms: float
    p10_ms: float
    p90_ms: float
    samples: int
    ci_low_ms: float = Field(description="95% confidence interval of the median, low end")
    ci_high_ms: float
    reference_latency_ms: float | None = None
    speedup: float | None = Field(None, description="reference latency / latency")
    bytes: float | None = Field(None, description="cost model: bytes any solution must move")
    flops: float | None = None
    timing: dict = Field(description="method and parameters of the measurement")
    crosscheck: dict = Field({}, description="an independent measurement and whether it agrees")


def printable_line(text: str) -> str:
    """`text` as one line of printable characters: white space becomes a space, any other control
    character (an escape sequence's ESC, say) a '?'."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else " " if c.isspace() else "?" for c in text)


def printable_lines(text: str) -> str:
    """`text` as lines of printable characters and tabs: a carriage return ends a line (a progress bar's redraws
    become lines), any other control character (one that could move the cursor or set a terminal's clipboard)
    becomes a '?'."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line if line.isprintable() else "".join(c if c.isprintable() or c == "\t" else "?" for c in line)
                     for line in lines)


class Trace(BaseModel):
    model_config = ConfigDict(extra="allow")

    # Names as a manifest gives them: a line with any other (an escape sequence, HTML, U+200B or a Cyrillic letter
    # making a row look like another solution's) is no trace.
    definition: str = Field(pattern=FOLDER_NAME)
    workload: str = Field(description="workload uuid")
    workload_name: str = Field("", pattern=FOLDER_NAME_OR_NONE)
    solution: SolutionName
    solution_hash: str
    solution_tags: list[Annotated[str, Field(pattern=TAG)]] = Field([], description="the solution's tags, e.g. baseline")
    author: Label
    hardware: HardwareName
    status: Status
    message: str = Field("", description="one line, printable: what a solution wrote into it cannot drive a terminal")
    log: str = Field("", description="the worker's output, last part; printable lines, as message")
    correctness: dict[str, OutputError] = {}
    performance: Performance | None = None
    environment: dict = {}
    isolation: str | None = Field(None, description="how the solution's worker was contained: namespaces or process")
    imported_from: str | None = Field(None, description="the board source it was imported from (traces/imported/<source>/); "
                                                        "None for this project's own runs")
    timestamp: str

    @field_validator("message")
    @classmethod
    def _one_printable_line(cls, message: str) -> str:
        return printable_line(message)

    @field_validator("log")
    @classmethod
    def _printable_lines(cls, log: str) -> str:
        return printable_lines(log)
