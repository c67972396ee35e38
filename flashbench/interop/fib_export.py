"""`flashbench export-fib`: a flashbench repository in FlashInfer-Bench's dataset layout (0.1.2).

The result loads with FIB's own loader (`flashinfer_bench.data.TraceSet.from_path`). What FIB can
express goes in FIB's fields; what it cannot rides along in `flashbench` extension fields, which
FIB 0.1.2's models ignore (tolerances and cost models; workload names, tags, random-input
parameters and generators; solution manifests and content hashes; exact statuses, messages and
every timing statistic), or in side files FIB never reads: flashbench.json (which FIB solution name
is which of ours) and flashbench/reference_traces/. Importing an export gives the repository back:
solution folders byte for byte (so their content hashes and traces still match), traces field by field.

Where FIB differs:
- solution names are unique across a FIB dataset: a name two definitions share gets a short hash of
  its definition (the same in every export);
- statuses FIB lacks become its nearest one (fib_model.STATUS_TO_FIB); the exact one is in the
  extension and heads the log;
- FIB has one latency: our median, with the reference's latency and the speedup;
- FIB's traces do not say how they were timed, so an export holds one timing method (events, or graph);
- inputs made by a structured generator (index tensors, generated caches) are written as FIB random
  inputs, with the generator in the extension, so flashbench remakes them exactly and the export
  stays about the size of its traces. FIB cannot make index tensors itself, so its runner cannot use
  such a workload meaningfully; `index_blobs=True` writes the index tensors (16-bit or wider
  integers) as safetensors blobs, as FIB's captured workloads are (hundreds of MB for this
  repository). Generated values (caches, FP8 bytes) stay random either way: FIB draws values itself.

Written into a folder beside OUT_DIR and renamed into place once complete; streamed: one
definition's workloads and one trace at a time are in memory.
"""

import filecmp
import hashlib
import math
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path, PurePosixPath

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from ..binding import BindingError, bind_axes
from ..build import FolderError
from ..errors import FlashbenchError
from ..model import REFERENCE, Definition, Trace, Workload
from ..model.workload import SafetensorsInput, ScalarInput
from ..reference import reference_source
from ..registry import Repo, SolutionFolder
from ..traces import TIMING_METHODS, read_traces, trace_file_name
from ..workloads import generate_inputs, generated_data
from ..workloads.tensors import DEFAULT_RANDOM
from . import fib_model as fib
from .fib_import import ALL_OUTPUTS, FIB_SOURCE, IMPORTED
from .fib_solution import folder_to_fib, safe_name
from .summary import Summary

LIBS = ("torch", "triton", "cuda", "flashbench", "python")  # environment entries FIB lists under libs
INDEX_DTYPES = ("int16", "int32", "int64")  # generated tensors of these dtypes are index structure: blobs
FIB_HELD = {"definition", "workload", "timestamp", "log"}  # trace fields a FIB record holds as they are


def export_fib(root: Path, out: Path, timing: str = "events", index_blobs: bool = False) -> Summary:
    """`index_blobs`: write generated index tensors as safetensors blobs, so that FIB's own runner can
    use the workloads (the export then takes hundreds of MB instead of about the size of its traces)."""
    trace_file_name("x", timing)  # an unknown method fails here, before any work
    repo, out = Repo(root), Path(out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FlashbenchError("exists and is not an empty folder; export into a new one", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        summary = Exporter(repo, staging, timing, index_blobs).run()
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


class Exporter:
    def __init__(self, repo: Repo, out: Path, timing: str, index_blobs: bool):
        self.repo, self.out, self.timing, self.index_blobs = repo, out, timing, index_blobs
        self.summary = Summary()
        self.trace_files = self.find_trace_files()
        self.names = fib_names(self.solution_pairs())  # (definition, our name) -> FIB name

    def run(self) -> Summary:
        for name in self.repo.names():
            DefinitionExport(self, self.repo.definition(name)).run()
        solutions = {fib_name: fib.SolutionName(definition=d, name=n) for (d, n), fib_name in sorted(self.names.items())}
        side = fib.SideFile(timing=self.timing, solutions=solutions)
        (self.out / fib.SIDE_FILE).write_text(side.model_dump_json(indent=2) + "\n")
        return self.summary

    def find_trace_files(self) -> dict[str, list[Path]]:
        """Our traces (traces/<hardware>/) and imported ones (traces/imported/<source>/<hardware>/), by
        definition, of this export's timing method; files of definitions not here are noted."""
        traces, found = self.repo.root / "traces", defaultdict(list)
        for path in sorted(traces.glob("*/*.jsonl")) + sorted(traces.glob(f"{IMPORTED}/*/*/*.jsonl")):
            definition, timing = trace_file_definition(path)
            if timing != self.timing:
                continue
            if definition in self.repo.definition_files:
                found[definition].append(path)
            else:
                self.summary.add("", "file", "ignored", f"{path}: definition {definition!r} is not in the repository")
        return found

    def solution_pairs(self) -> set[tuple[str, str]]:
        """(definition, solution) of every folder and every solution with traces, the reference left out."""
        pairs = set()
        for name in self.repo.names():
            pairs |= {(name, f.solution.name) for f in self.repo.solution_folders(name)}
            for path in self.trace_files.get(name, []):
                # Records alone, of this definition: a line `{"solution": ["x"]}` ended the export in a TypeError,
                # and lines of no record named solutions that clashed and stopped it
                pairs |= {(name, trace.solution) for trace in read_traces(path) if trace.definition == name}
        return {(d, s) for d, s in pairs if s != REFERENCE}


class DefinitionExport:
    def __init__(self, exporter: Exporter, definition: Definition):
        self.exporter, self.definition = exporter, definition
        self.repo, self.out = exporter.repo, exporter.out
        self.workloads: dict[str, fib.FibWorkload] = {}  # by uuid, to embed in traces
        self.copied: set[PurePosixPath] = set()  # blobs this definition's workloads put in the export

    def add(self, kind, outcome, why: str = "", count: int = 1) -> None:
        self.exporter.summary.add(self.definition.name, kind, outcome, why, count)

    def run(self) -> None:
        d = self.definition
        path = fib.definition_path(self.out, d.op_type, d.name)
        write_text(path, fib.json_text(definition_to_fib(d, self.reference(), self.workload_version())))
        self.add("definition", "exported", "tolerances and cost model in the flashbench extension"
                 if d.tolerances or d.cost else "")
        self.export_workloads()
        for folder in self.repo.solution_folders(d.name):
            self.export_solution(folder)
        self.export_traces()

    def reference(self) -> str:
        return reference_source(self.definition, self.repo.root)

    def workload_version(self) -> int | None:
        workload_set = self.repo.workload_set(self.definition.name)
        return workload_set.version if workload_set else None

    # --- workloads ------------------------------------------------------------------------------

    def export_workloads(self) -> None:
        workload_set = self.repo.workload_set(self.definition.name)
        if workload_set is None:
            return
        source = self.repo.workloads_path(self.definition.name)
        target = fib.workloads_path(self.out, self.definition.op_type, self.definition.name)
        with LazyFile(target) as lines:
            for workload in workload_set.workloads:
                notes: list[str] = []
                try:
                    record = self.workload(workload, source.parent, notes)
                except (BindingError, ValueError) as exc:
                    self.add("workload", "skipped", f"{source}: workload {workload.label} not exported: {exc}")
                    continue
                self.workloads[workload.uuid] = record
                lines.write(fib.workload_line(self.definition.name, record))
                self.add("workload", "exported", "; ".join(notes))

    def workload(self, workload: Workload, base: Path, notes: list[str]) -> fib.FibWorkload:
        d = self.definition
        # Shapes and constraints on "meta": no random tensor is drawn. Generators' index tensors stay on the CPU
        # there; the data they make (an FP8 cache) is shapes only, on "meta" like the random inputs.
        made = generate_inputs(d, workload, seed=0, device="meta", base_dir=base)
        axes = bind_axes(d, made)
        data = set(generated_data(workload))
        generated = {n: t for n, t in made.items() if n not in workload.inputs and isinstance(t, torch.Tensor)
                     and (t.device.type == "cpu" or n in data)}
        blob = {n: t.contiguous() for n, t in generated.items()
                if self.exporter.index_blobs and d.inputs[n].dtype in INDEX_DTYPES}
        notes += generated_notes(d, sorted(set(generated) - set(blob)))
        path = fib.blob_path(d.op_type, d.name, workload.uuid)
        inputs = {}
        for name in d.inputs:
            if name in blob:
                inputs[name] = fib.FibSafetensorsInput(type="safetensors", path=path, tensor_key=name)
            elif name in generated:
                inputs[name] = fib.FibRandomInput(type="random")
            else:
                inputs[name] = self.descriptor(workload, name, base, notes)
        if blob:  # last: a workload that fails above leaves no blob behind
            target = self.out / fib.normalise_blob_path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            save_file(blob, str(target))
            self.add("blob", "exported")
        record = fib.FibWorkload(uuid=workload.uuid, axes={a: axes[a] for a in d.var_axes if a in axes}, inputs=inputs)
        return record.model_copy(update={"flashbench": workload_extension(workload, record)})

    def descriptor(self, workload: Workload, name: str, base: Path, notes: list[str]):
        descriptor = workload.inputs.get(name, DEFAULT_RANDOM)
        if isinstance(descriptor, ScalarInput):
            return fib.FibScalarInput(type="scalar", value=descriptor.value)
        if isinstance(descriptor, SafetensorsInput):
            return self.copy_blob(descriptor, base)
        if descriptor != DEFAULT_RANDOM:
            notes.append(f"inputs.{name}: FIB random inputs take no parameters; written as plain random, the "
                         "parameters are in the flashbench extension")
        return fib.FibRandomInput(type="random")

    def copy_blob(self, descriptor: SafetensorsInput, base: Path) -> fib.FibSafetensorsInput:
        """Blobs already under blob/ keep their path (a round trip writes them back where they came from)."""
        source = (base / descriptor.path).resolve()
        relative = fib.normalise_blob_path(descriptor.path)
        if relative is None or relative.parts[0] != "blob":
            relative = PurePosixPath("blob", "workloads", self.definition.op_type, self.definition.name, source.name)
        if relative not in self.copied:  # two inputs of a workload often share one file
            target = self.out / relative
            if target.exists() and not filecmp.cmp(source, target, shallow=False):
                raise ValueError(f"{descriptor.path}: another blob is already exported as {relative}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)  # streamed: never read whole into memory
            self.copied.add(relative)
            self.add("blob", "exported")
        return fib.FibSafetensorsInput(type="safetensors", path=f"./{relative}", tensor_key=descriptor.tensor_key)

    # --- solutions ------------------------------------------------------------------------------

    def export_solution(self, folder: SolutionFolder) -> None:
        solution = folder.solution
        fib_name = self.exporter.names[(self.definition.name, solution.name)]
        try:
            record, notes = folder_to_fib(folder, fib_name)
        except FolderError as exc:  # one folder the judge would not run stops no export
            self.add("solution", "skipped", f"{folder.path}: {exc.message}")
            return
        if fib_name != solution.name:
            notes.append(f"named {fib_name} in FIB: another definition has a solution {solution.name}")
        path = fib.solution_path(self.out, safe_name(solution.author), self.definition.op_type, self.definition.name,
                                 fib_name)
        write_text(path, fib.json_text(record))
        self.add("solution", "exported", "; ".join(f"{solution.name}: {note}" for note in notes))

    # --- traces ---------------------------------------------------------------------------------

    def export_traces(self) -> None:
        d = self.definition
        written: set[tuple[str, str, str, str]] = set()  # a result imported back from an export of ours is here twice
        with LazyFile(fib.traces_path(self.out, d.op_type, d.name)) as traces, \
                LazyFile(fib.reference_traces_path(self.out, d.name)) as references:
            for path in self.exporter.trace_files.get(d.name, []):
                for number, line in fib.read_jsonl_lines(path):
                    try:
                        trace = Trace.model_validate_json(line)
                    except ValidationError:
                        self.add("trace", "skipped", f"{path}: line {number} is not a valid trace")
                        continue
                    if trace.definition != d.name:  # its solution has no FIB name: the export stopped (KeyError)
                        self.add("trace", "skipped", f"{path}: line {number} is a trace of {trace.definition}")
                        continue
                    key = (trace.solution, trace.workload, trace.hardware, trace.timestamp)
                    if key in written:
                        self.add("trace", "skipped", f"{path}: the same result is in an earlier file; written once")
                        continue
                    written.add(key)
                    if trace.solution == REFERENCE:
                        references.write(line.decode().rstrip("\n") + "\n")
                        self.add("trace", "exported", "the reference's, to flashbench/reference_traces/ (FIB has "
                                                      "no reference traces)")
                        continue
                    record = self.trace(trace, path)
                    if record is not None:
                        traces.write(fib.record_line(record))
                        self.add("trace", "exported", status_note(trace.status))

    def trace(self, trace: Trace, path: Path) -> fib.FibTrace | None:
        workload = self.workloads.get(trace.workload)
        if workload is None:
            self.add("trace", "skipped", f"{path}: traces on workload {trace.workload}, which is not exported")
            return None
        if trace.status == "PASSED" and trace.performance is None:
            self.add("trace", "skipped", f"{path}: a PASSED trace of {trace.solution} without timing")
            return None
        ext = None if measured_by_fib(trace) else trace.model_dump(mode="json", exclude=FIB_HELD)
        return fib.FibTrace(definition=trace.definition, workload=workload,
                            solution=self.exporter.names[(trace.definition, trace.solution)],
                            evaluation=evaluation_to_fib(trace), flashbench=ext)


class LazyFile:
    """A text file created on the first write, so definitions without traces get no empty file."""

    def __init__(self, path: Path):
        self.path, self.handle = path, None

    def write(self, text: str) -> None:
        if self.handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = open(self.path, "w", encoding="utf-8")
        self.handle.write(text)

    def __enter__(self) -> "LazyFile":
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.close()


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- conversions (pure functions) ---------------------------------------------------------------

def trace_file_definition(path: Path) -> tuple[str, str]:
    """traces/<hardware>/<definition>[.<method>].jsonl -> (definition, timing method)."""
    stem = path.name.removesuffix(".jsonl")
    for method in TIMING_METHODS:
        if method != "events" and stem.endswith(f".{method}"):
            return stem.removesuffix(f".{method}"), method
    return stem, "events"


def generated_notes(definition: Definition, drawn: list[str]) -> list[str]:
    """What an export says of generated inputs it writes as FIB random inputs."""
    values = [n for n in drawn if definition.inputs[n].dtype not in INDEX_DTYPES]
    indices = [n for n in drawn if definition.inputs[n].dtype in INDEX_DTYPES]
    notes = []
    if values:
        notes.append(f"generated input(s) {', '.join(values)} written as FIB random inputs (FIB draws values "
                     "itself); the generator is in the flashbench extension")
    if indices:
        notes.append(f"generated index tensor(s) {', '.join(indices)} written as FIB random inputs: FIB's runner "
                     "cannot use this workload (--index-blobs writes them as blobs); flashbench remakes them")
    return notes


def status_note(status: str) -> str:
    if status not in fib.STATUS_TO_FIB:
        return ""
    return (f"status {status} written as {fib.STATUS_TO_FIB[status]} (the exact status heads the log and is in "
            "the flashbench extension)")


def fib_names(pairs: set[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """FIB names solutions dataset-wide: a name two definitions share gets a short hash of its
    definition, the same in every export."""
    definitions = defaultdict(set)
    for definition, name in pairs:
        definitions[name].add(definition)
    names = {(d, n): n if len(definitions[n]) == 1 else f"{n}_{hashlib.sha256(d.encode()).hexdigest()[:8]}"
             for d, n in pairs}
    taken: dict[str, tuple[str, str]] = {}
    for pair, name in sorted(names.items()):
        if name in taken:
            raise FlashbenchError(f"solutions {taken[name][1]} of {taken[name][0]} and {pair[1]} of {pair[0]} "
                                  f"would both be named {name} in FIB; rename one")
        taken[name] = pair
    return names


def definition_to_fib(definition: Definition, reference: str, workloads_version: int | None = None) -> fib.FibDefinition:
    def tensor(spec) -> fib.FibTensorSpec:
        return fib.FibTensorSpec(shape=spec.shape, dtype=spec.dtype, description=spec.description or None)

    ext = fib.DefinitionExtension(tolerances=definition.tolerances, evaluator=definition.evaluator,
                                  cost=definition.cost, workloads_version=workloads_version,
                                  constant_inputs=[name for name, spec in definition.inputs.items() if spec.constant])
    return fib.FibDefinition(
        name=definition.name, op_type=definition.op_type, description=definition.description or None,
        tags=definition.tags or None,
        axes={k: fib.FibAxis(type=a.type, value=a.value, description=a.description or None)
              for k, a in definition.axes.items()},
        inputs={k: tensor(s) for k, s in definition.inputs.items()},
        outputs={k: tensor(s) for k, s in definition.outputs.items()},
        constraints=definition.constraints or None, reference=reference,
        flashbench=ext if ext != fib.DefinitionExtension(workloads_version=1) else None,
    )


def workload_extension(workload: Workload, record: fib.FibWorkload) -> fib.WorkloadExtension | None:
    """None when the FIB record says all there is (a workload that came from FIB, say)."""
    plain = (not workload.name and not workload.tags and not workload.generate and workload.axes == record.axes
             and all(isinstance(d, (ScalarInput, SafetensorsInput)) or d == DEFAULT_RANDOM
                     for d in workload.inputs.values()))
    if plain:
        return None
    return fib.WorkloadExtension(name=workload.name, tags=workload.tags, axes=workload.axes,
                                 inputs=workload.inputs, generate=workload.generate)


def measured_by_fib(trace: Trace) -> bool:
    """A trace imported from FIB itself: its FIB record is all there is, and it is written back as it came."""
    return trace.environment.get("source") == FIB_SOURCE


def evaluation_to_fib(trace: Trace) -> fib.FibEvaluation:
    status = fib.STATUS_TO_FIB.get(trace.status, trace.status)
    correctness = correctness_to_fib(trace) if status in ("PASSED", "INCORRECT_NUMERICAL") else None
    performance = None
    if status == "PASSED":
        perf = trace.performance
        performance = fib.FibPerformance(latency_ms=perf.latency_ms, reference_latency_ms=perf.reference_latency_ms or 0.0,
                                         speedup_factor=perf.speedup or 0.0)
    return fib.FibEvaluation(status=status, log=fib.log_header(trace.status, trace.message) + trace.log,
                             correctness=correctness, performance=performance,
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
    if measured_by_fib(trace):
        libs = environment.get("libs", {})
    else:
        libs = {k: str(environment[k]) for k in LIBS if environment.get(k)}
    return fib.FibEnvironment(hardware=trace.hardware, libs=libs)
