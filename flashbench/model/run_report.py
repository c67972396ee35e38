"""The document `flashbench run --json` and `flashbench submit --json` print on stdout, one per
command, for CI and scripts. A stable format: within a format_version fields may be added, never
renamed, removed or given another meaning."""

from typing import Literal

from pydantic import BaseModel, Field

from .calibration import Calibration
from .trace import OutputError, Status, Trace

RUN_REPORT_FORMAT = "flashbench.run/1"
HOST_CLOCK = "host clock"  # the runner's timing method on a CPU


class WorkloadRef(BaseModel):
    uuid: str
    name: str


class Timing(BaseModel):
    method: str = Field(description="events, graph (CUDA-graph replay) or host clock (a CPU run)")
    latency_ms: float = Field(description="median of the timed calls: the headline")
    p10_ms: float
    p90_ms: float
    ci_low_ms: float = Field(description="95% confidence interval of the median, low end")
    ci_high_ms: float
    samples: int = Field(description="timed batches the median is taken over")


class Peaks(BaseModel):
    """The calibration the floors come from (`flashbench calibrate`)."""

    memory_bytes_per_s: float
    matmul_flops_per_s: float
    timestamp: str


class PairResult(BaseModel):
    """One (solution, workload) pair: what its trace records, and the floor it is measured against."""

    solution: str
    solution_hash: str
    workload: WorkloadRef
    status: Status
    message: str
    errors: dict[str, OutputError] = Field(
        description="per output, the check the trace records: the failing one, else the first")
    timing: Timing | None = Field(description="PASSED only")
    speedup: float | None = Field(description="reference latency / latency")
    bytes: float | None = Field(description="cost model: bytes any solution must move")
    flops: float | None
    floor_ms: float | None = Field(description="speed-of-light time from the calibration; null without one")
    percent_of_floor: float | None = Field(description="100 * floor_ms / latency_ms")
    trace_file: str | None = Field(description="the JSONL file the trace was appended to; null when not saved")
    timestamp: str = Field(description="the trace's: with solution_hash and workload.uuid, finds it in trace_file")

    @classmethod
    def from_trace(cls, trace: Trace, calibration: Calibration | None, trace_file: str | None) -> "PairResult":
        perf = trace.performance
        timing = floor = None
        if perf:
            timing = Timing(method=perf.timing.get("method", ""), **perf.model_dump(
                include={"latency_ms", "p10_ms", "p90_ms", "ci_low_ms", "ci_high_ms", "samples"}))
            floor = calibration.floor_ms(perf.bytes, perf.flops) if calibration else None
        return cls(
            solution=trace.solution, solution_hash=trace.solution_hash,
            workload=WorkloadRef(uuid=trace.workload, name=trace.workload_name), status=trace.status,
            message=trace.message, errors=trace.correctness, timing=timing,
            speedup=perf.speedup if perf else None, bytes=perf.bytes if perf else None,
            flops=perf.flops if perf else None, floor_ms=floor,
            percent_of_floor=100 * floor / perf.latency_ms if floor and perf.latency_ms > 0 else None,
            trace_file=trace_file, timestamp=trace.timestamp,
        )


class RunReport(BaseModel):
    format_version: Literal["flashbench.run/1"] = RUN_REPORT_FORMAT
    command: Literal["run", "submit"]
    definition: str
    hardware: str = Field(description="what the traces name, e.g. 'NVIDIA H200' or 'CPU x86_64'")
    devices: list[str]
    backend: str = Field(description="local or ray")
    timing_method: str = Field(description="events, graph or host clock; under graph the reference is timed "
                                           "with events: each result's timing.method says")
    isolation: str | None = Field(description="how workers were contained: namespaces or process")
    trace_file: str | None = Field(description="null when traces were not saved (--no-save)")
    calibration: Peaks | None = Field(description="null when the hardware has no calibration: no floors")
    interrupted: bool = Field(description="Ctrl-C ended the run: results holds what finished before")
    passed: int
    failed: int = Field(description="pairs with any status but PASSED")
    skipped: int = Field(description="pairs already recorded, not run again (--resume); not in results")
    skipped_failed: int = Field(0, description="of the skipped pairs, those recorded with any status but PASSED: "
                                               "they make the exit code 1 like failures of this run")
    submitted_to: str | None = Field(None, description="submit: the folder the solution was copied to; "
                                                       "null when it was not (and for run)")
    results: list[PairResult]

    @classmethod
    def from_traces(cls, traces: list[Trace], calibration: Calibration | None, trace_file: str | None,
                    **metadata) -> "RunReport":
        results = [PairResult.from_trace(t, calibration, trace_file) for t in traces]
        passed = sum(r.status == "PASSED" for r in results)
        peaks = None
        if calibration:
            peaks = Peaks(**calibration.model_dump(include={"memory_bytes_per_s", "matmul_flops_per_s", "timestamp"}))
        return cls(results=results, passed=passed, failed=len(results) - passed, calibration=peaks,
                   trace_file=trace_file, **metadata)
