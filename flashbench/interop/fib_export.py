"""`flashbench export-fib`: a flashbench repository written in FlashInfer-Bench's dataset layout.

Everything FIB can express is written. What it cannot is dropped with a warning (tolerances, cost
models, random-input parameters, compile flags; statuses FIB lacks become its nearest one) or, for
timing, reduced to FIB's single latency (our median). Structured generators are materialised: their
index tensors (seed 0; they depend on the workload alone) become safetensors blobs, as FIB's
captured workloads are.
"""

import math
import re
import shutil
from pathlib import Path, PurePosixPath

from safetensors.torch import save_file

from ..binding import BindingError, bind_axes
from ..model import REFERENCE, Definition, Trace, Workload
from ..model.workload import SafetensorsInput, ScalarInput
from ..registry import Repo, SolutionFolder
from ..traces import read_traces
from ..workloads import generate_inputs, structured_inputs
from ..workloads.tensors import DEFAULT_RANDOM
from . import fib_model as fib
from .fib_import import ALL_OUTPUTS
from .summary import Summary

LIBS = ("torch", "triton", "cuda", "flashbench", "python")  # environment entries FIB lists under libs
# flashbench statuses FIB has no word for, and the nearest FIB status.
STATUS_TO_FIB = {"CRASHED": "RUNTIME_ERROR", "REJECTED": "RUNTIME_ERROR",
                 "INVALID_SOLUTION": "COMPILE_ERROR", "MISSING_DEPENDENCY": "COMPILE_ERROR"}
_PATH_PART = re.compile(r"[^A-Za-z0-9_.-]+")


def export_fib(root: Path, out: Path) -> Summary:
    return Exporter(Repo(root), Path(out).resolve()).run()


class Exporter:
    def __init__(self, repo: Repo, out: Path):
        self.repo, self.out = repo, out
        self.summary = Summary()
        self.workloads: dict[str, dict[str, fib.FibWorkload]] = {}  # definition -> uuid -> FIB workload

    def run(self) -> Summary:
        dropped = 0
        for name in self.repo.names():
            definition = self.repo.definition(name)
            dropped += bool(definition.tolerances or definition.cost)
            fib.write_json(fib.definition_path(self.out, definition.op_type, name), self.definition(definition))
            self.summary.counts["definitions"] += 1
            self.export_workloads(definition)
            for folder in self.repo.solution_folders(name):
                self.export_solution(definition, folder)
        if dropped:
            self.summary.warn(self.repo.root / "definitions",
                              f"tolerances and cost models of {dropped} definition(s) have no FIB field; not exported")
        self.export_traces()
        return self.summary

    def definition(self, definition: Definition) -> fib.FibDefinition:
        if definition.reference_is_path:
            reference = (self.repo.root / definition.reference).read_text()
        else:
            reference = definition.reference
        return definition_to_fib(definition, reference)

    # --- workloads ------------------------------------------------------------------------------

    def export_workloads(self, definition: Definition) -> None:
        workload_set = self.repo.workload_set(definition.name)
        if workload_set is None:
            return
        base = self.repo.workloads_path(definition.name).parent
        exported = {}
        for workload in workload_set.workloads:
            try:
                exported[workload.uuid] = self.workload(definition, workload, base)
            except (BindingError, ValueError) as exc:
                self.summary.warn(self.repo.workloads_path(definition.name),
                                  f"workload {workload.label} not exported: {exc}")
        self.workloads[definition.name] = exported
        lines = [fib.workload_line(definition.name, w) for w in exported.values()]
        fib.write_jsonl(fib.workloads_path(self.out, definition.op_type, definition.name), lines)
        self.summary.counts["workloads"] += len(lines)

    def workload(self, definition: Definition, workload: Workload, base: Path) -> fib.FibWorkload:
        # Shapes and constraints on "meta": no large random tensors are made.
        axes = bind_axes(definition, generate_inputs(definition, workload, seed=0, device="meta", base_dir=base))
        generated, _ = structured_inputs(workload, "cpu")
        inputs: dict[str, object] = {}
        if generated:
            blob = fib.blob_path(definition.op_type, definition.name, workload.uuid)
            target = self.out / fib.normalise_blob_path(blob)
            target.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in generated.items()}, str(target))
            self.summary.counts["blobs"] += 1
            inputs |= {k: fib.FibSafetensorsInput(type="safetensors", path=blob, tensor_key=k) for k in generated}
        for name in definition.inputs:
            if name not in inputs:
                inputs[name] = self.descriptor(definition, workload, name, base)
        return fib.FibWorkload(uuid=workload.uuid, axes={a: axes[a] for a in definition.var_axes if a in axes},
                               inputs={k: inputs[k] for k in definition.inputs})

    def descriptor(self, definition: Definition, workload: Workload, name: str, base: Path):
        descriptor = workload.inputs.get(name, DEFAULT_RANDOM)
        if isinstance(descriptor, ScalarInput):
            return fib.FibScalarInput(type="scalar", value=descriptor.value)
        if isinstance(descriptor, SafetensorsInput):
            return self.copy_blob(definition, descriptor, base)
        if descriptor != DEFAULT_RANDOM:
            self.summary.warn(self.repo.workloads_path(definition.name),
                              f"workload {workload.label}: inputs.{name}: FIB random inputs take no parameters; "
                              "written as plain random")
        return fib.FibRandomInput(type="random")

    def copy_blob(self, definition: Definition, descriptor: SafetensorsInput, base: Path) -> fib.FibSafetensorsInput:
        """Blobs already under blob/ keep their path (a round trip writes them back where they came from)."""
        source = (base / descriptor.path).resolve()
        relative = fib.normalise_blob_path(descriptor.path)
        if relative is None or relative.parts[0] != "blob":
            relative = PurePosixPath("blob", "workloads", definition.op_type, definition.name, source.name)
        target = self.out / relative
        if not (target.is_file() and target.read_bytes() == source.read_bytes()):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            self.summary.counts["blobs"] += 1
        return fib.FibSafetensorsInput(type="safetensors", path=f"./{relative}", tensor_key=descriptor.tensor_key)

    # --- solutions ------------------------------------------------------------------------------

    def export_solution(self, definition: Definition, folder: SolutionFolder) -> None:
        solution = folder.solution
        manifest = folder.path / "solution.yaml"
        if solution.compile_flags:
            self.summary.warn(manifest, "compile_flags have no FIB field; not exported")
        sources = []
        for path in sorted(p for p in folder.path.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            if path == manifest:
                continue
            try:
                sources.append(fib.FibSourceFile(path=path.relative_to(folder.path).as_posix(), content=path.read_text()))
            except UnicodeDecodeError:
                self.summary.warn(path, "not text; FIB embeds text sources only, not exported")
        record = solution_to_fib(solution, sources)
        target = fib.solution_path(self.out, path_part(solution.author), definition.op_type, definition.name,
                                   solution.name)
        fib.write_json(target, record)
        self.summary.counts["solutions"] += 1

    # --- traces ---------------------------------------------------------------------------------

    def export_traces(self) -> None:
        files: dict[Path, list[str]] = {}
        for path in sorted((self.repo.root / "traces").glob("*/*.jsonl")):
            if path.stem not in self.repo.definition_files:
                self.summary.warn(path, f"definition {path.stem!r} is not in the repository; not exported")
                continue
            definition = self.repo.definition(path.stem)
            for trace in read_traces(path):
                record = self.trace(trace, path)
                if record is not None:
                    target = fib.traces_path(self.out, path_part(trace.author), definition.op_type, definition.name)
                    files.setdefault(target, []).append(fib.trace_line(record))
        for target, lines in files.items():
            fib.write_jsonl(target, lines)
            self.summary.counts["traces"] += len(lines)

    def trace(self, trace: Trace, path: Path) -> fib.FibTrace | None:
        if trace.solution == REFERENCE:
            return None  # FIB keeps the reference's latency inside each solution's trace
        workload = self.workloads.get(trace.definition, {}).get(trace.workload)
        if workload is None:
            self.summary.warn(path, f"trace of {trace.solution} on workload {trace.workload}: "
                                    "workload not exported; trace skipped")
            return None
        if trace.status == "PASSED" and trace.performance is None:
            self.summary.warn(path, f"trace of {trace.solution} on {trace.workload}: PASSED without timing; skipped")
            return None
        if trace.status in STATUS_TO_FIB:
            self.summary.warn(path, f"status {trace.status} has no FIB equivalent; written as {STATUS_TO_FIB[trace.status]}")
        return fib.FibTrace(definition=trace.definition, workload=workload, solution=trace.solution,
                            evaluation=evaluation_to_fib(trace))


# --- conversions (pure functions) ---------------------------------------------------------------

def path_part(name: str) -> str:
    return _PATH_PART.sub("_", name).strip("._") or "unknown"


def definition_to_fib(definition: Definition, reference: str) -> fib.FibDefinition:
    def tensor(spec) -> fib.FibTensorSpec:
        return fib.FibTensorSpec(shape=spec.shape, dtype=spec.dtype, description=spec.description or None)

    return fib.FibDefinition(
        name=definition.name, op_type=definition.op_type, description=definition.description or None,
        tags=definition.tags or None,
        axes={k: fib.FibAxis(type=a.type, value=a.value, description=a.description or None)
              for k, a in definition.axes.items()},
        inputs={k: tensor(s) for k, s in definition.inputs.items()},
        outputs={k: tensor(s) for k, s in definition.outputs.items()},
        constraints=definition.constraints or None, reference=reference,
    )


def solution_to_fib(solution, sources: list[fib.FibSourceFile]) -> fib.FibSolution:
    binding = solution.binding or ("torch" if solution.language == "cuda" else None)  # ours builds CUDA with torch
    spec = fib.FibBuildSpec(
        language=solution.language, target_hardware=solution.target_hardware or ["cuda"],
        entry_point=solution.entry_point, dependencies=solution.dependencies,
        destination_passing_style=solution.destination_passing_style, binding=binding,
    )
    return fib.FibSolution(name=solution.name, definition=solution.definition, author=solution.author,
                           description=solution.description, spec=spec, sources=sources)


def evaluation_to_fib(trace: Trace) -> fib.FibEvaluation:
    status = STATUS_TO_FIB.get(trace.status, trace.status)
    log = "\n".join(filter(None, [f"flashbench status {trace.status}: {trace.message}" if status != trace.status
                                  else trace.message, trace.log]))
    correctness = correctness_to_fib(trace) if status in ("PASSED", "INCORRECT_NUMERICAL") else None
    performance = None
    if status == "PASSED":
        perf = trace.performance
        performance = fib.FibPerformance(latency_ms=perf.latency_ms, reference_latency_ms=perf.reference_latency_ms or 0.0,
                                         speedup_factor=perf.speedup or 0.0)
    return fib.FibEvaluation(status=status, log=log, correctness=correctness, performance=performance,
                             environment=environment_to_fib(trace), timestamp=trace.timestamp)


def correctness_to_fib(trace: Trace) -> fib.FibCorrectness:
    """FIB's single error: the worst over all outputs (NaN when none was recorded)."""
    errors = list(trace.correctness.values())
    if ALL_OUTPUTS in trace.correctness:
        errors = [trace.correctness[ALL_OUTPUTS]]
    if not errors:
        return fib.FibCorrectness(max_relative_error=math.nan, max_absolute_error=math.nan)
    return fib.FibCorrectness(max_relative_error=max(e.max_rel_error for e in errors),
                              max_absolute_error=max(e.max_abs_error for e in errors))


def environment_to_fib(trace: Trace) -> fib.FibEnvironment:
    environment = trace.environment
    if environment.get("source") == "FlashInfer-Bench":
        libs = environment.get("libs", {})
    else:
        libs = {k: str(environment[k]) for k in LIBS if environment.get(k)}
    return fib.FibEnvironment(hardware=trace.hardware, libs=libs)
