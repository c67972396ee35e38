"""`flashbench import-fib`: a FlashInfer-Bench dataset into a flashbench repository.

A dataset that breaks FIB's own format is an error (one line naming file and field). Content that
is valid FIB but that flashbench cannot express or check (an unknown language, a workload whose
index tensors break the definition's constraints, ...) is skipped with a warning; nothing is
guessed. Importing twice adds nothing new: workloads are merged by uuid and traces by
(solution, workload, timestamp).
"""

import hashlib
import json
import math
import re
import shutil
from pathlib import Path, PurePosixPath

import yaml

from ..binding import BindingError
from ..build import content_hash
from ..errors import FlashbenchError
from ..model import Definition, OutputError, Performance, Solution, Trace, Workload, WorkloadSet, parse_model
from ..reference import load_reference
from ..registry import Repo
from ..traces import append_trace, read_traces, trace_path
from ..validate import validate
from ..workloads import generate_inputs
from . import fib_model as fib
from .summary import Summary

ALL_OUTPUTS = "*"  # FIB records one error over all outputs; flashbench keys errors by output name
IMPORTED_TIMING = "imported from FlashInfer-Bench"
COMPILED_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
_FOLDER_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def import_fib(dataset: Path, root: Path) -> Summary:
    dataset, root = Path(dataset).resolve(), Path(root).resolve()
    if not (dataset / "definitions").is_dir():
        raise FlashbenchError("not a FlashInfer-Bench dataset: it has no definitions/ folder", dataset)
    if not (root / "definitions").is_dir():
        raise FlashbenchError("not a flashbench repository: it has no definitions/ folder", root)
    return Importer(dataset, root).run()


def safe_name(name: str) -> str:
    """A name usable as a flashbench solution name and folder."""
    return _SAFE_NAME.sub("_", name).strip("._") or "unnamed"


class Importer:
    def __init__(self, dataset: Path, root: Path):
        self.dataset, self.root = dataset, root
        self.summary = Summary()
        self.repo = Repo(root)
        self.workload_sets: dict[str, WorkloadSet] = {}
        self.new_workloads: dict[str, list[Workload]] = {}
        self.solutions: dict[tuple[str, str], tuple[Path, str]] = {}  # (definition, FIB name) -> (folder, author)
        self.unknown: set[tuple[str, str]] = set()  # (file, definition) already warned about
        self.rejected: set[str] = set()  # workload uuids already warned about

    def run(self) -> Summary:
        for path in sorted(self.dataset.glob("definitions/*/*.json")):
            self.add_definition(path, fib.read_json(fib.FibDefinition, path))
        self.repo = Repo(self.root)  # sees the definitions just written
        for path in sorted(self.dataset.glob("workloads/**/*.jsonl")):
            for number, record in fib.read_jsonl(fib.FibTrace, path):
                self.add_workload(record.definition, record.workload, path, f"line {number}")
        for path in sorted(self.dataset.glob("solutions/**/*.json")):
            self.add_solution(path, fib.read_json(fib.FibSolution, path))
        for path in sorted(self.dataset.glob("traces/**/*.jsonl")):
            self.add_traces(path)
        self.write_workload_sets()
        return self.summary

    # --- definitions ----------------------------------------------------------------------------

    def add_definition(self, path: Path, record: fib.FibDefinition) -> None:
        self._warn_extra(path, record)
        data = definition_to_ours(record)
        try:
            definition = parse_model(Definition, data, path)
            load_reference(definition, self.root, path)
        except FlashbenchError as exc:
            self.summary.warn(exc, "definition not imported")
            return
        if not _FOLDER_NAME.fullmatch(definition.op_type) or definition.op_type in (".", ".."):
            return self.summary.warn(path, f"op_type: {definition.op_type!r} cannot be a folder name; not imported")
        target = self.root / "definitions" / definition.op_type / f"{definition.name}.json"
        existing = self.repo.definition_files.get(definition.name)
        if existing and existing.path != target:
            return self.summary.warn(path, f"{definition.name} is already defined in {existing.path}; kept that one")
        text = json.dumps(data, indent=2) + "\n"
        if target.is_file() and target.read_text() == text:
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        self.summary.counts["definitions"] += 1

    def _warn_extra(self, path: Path, record: fib.FibModel) -> None:
        if record.model_extra:
            self.summary.warn(path, f"field(s) {', '.join(record.model_extra)} have no flashbench equivalent; dropped")

    # --- workloads ------------------------------------------------------------------------------

    def known_definition(self, name: str, path: Path) -> Definition | None:
        if name in self.repo.definition_files:
            return self.repo.definition(name)
        if (str(path), name) not in self.unknown:
            self.unknown.add((str(path), name))
            self.summary.warn(path, f"definition {name!r} is not in the repository; its records are skipped")
        return None

    def workload_set(self, name: str) -> WorkloadSet:
        if name not in self.workload_sets:
            self.workload_sets[name] = self.repo.workload_set(name) or WorkloadSet(definition=name, version=1, workloads=[])
        return self.workload_sets[name]

    def add_workload(self, name: str, record: fib.FibWorkload, path: Path, where: str) -> None:
        definition = self.known_definition(name, path)
        if definition is None or record.uuid in self.rejected:
            return
        if any(w.uuid == record.uuid for w in self.workload_set(name).workloads):
            return
        try:
            workload, blobs = self.convert_workload(record, path, where)
            check_workload(definition, workload, self.dataset)
        except (FlashbenchError, BindingError, ValueError) as exc:
            self.rejected.add(record.uuid)
            reason = getattr(exc, "message", exc)
            return self.summary.warn(f"{path}: {where}", f"workload {record.uuid} not imported: {reason}")
        base = self.repo.workloads_path(name).parent
        for blob in blobs:
            self.copy_blob(self.dataset / blob, base / blob)
        self.workload_set(name).workloads.append(workload)
        self.new_workloads.setdefault(name, []).append(workload)
        self.summary.counts["workloads"] += 1

    def convert_workload(self, record: fib.FibWorkload, path: Path, where: str) -> tuple[Workload, list[PurePosixPath]]:
        """Our workload (blob paths relative to the dataset root, which is also where they land
        relative to the workload file) and the blobs it needs."""
        inputs, blobs = {}, []
        for name, descriptor in record.inputs.items():
            if isinstance(descriptor, fib.FibSafetensorsInput):
                blob = fib.normalise_blob_path(descriptor.path)
                if blob is None or not (self.dataset / blob).is_file():
                    raise ValueError(f"inputs.{name}: safetensors file {descriptor.path} is not inside the dataset")
                blobs.append(blob)
                inputs[name] = {"type": "safetensors", "path": str(blob), "tensor_key": descriptor.tensor_key}
            else:
                inputs[name] = descriptor.model_dump(exclude_none=True)
        data = {"uuid": record.uuid, "axes": record.axes, "inputs": inputs}
        return parse_model(Workload, data, f"{path}: {where}"), blobs

    def copy_blob(self, source: Path, target: Path) -> None:
        if target.is_file() and target.read_bytes() == source.read_bytes():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        self.summary.counts["blobs"] += 1

    def write_workload_sets(self) -> None:
        for name, added in self.new_workloads.items():
            write_workload_set(self.repo.workloads_path(name), self.workload_sets[name], added)

    # --- solutions ------------------------------------------------------------------------------

    def add_solution(self, path: Path, record: fib.FibSolution) -> None:
        self._warn_extra(path, record)
        self._warn_extra(path, record.spec)
        definition = self.known_definition(record.definition, path)
        if definition is None:
            return
        name = safe_name(record.name)
        folder = self.root / "solutions" / record.definition / name
        if any(folder == imported for imported, _ in self.solutions.values()):
            return self.summary.warn(path, f"a solution named {name} was already imported; skipped")
        if name != record.name:
            self.summary.warn(path, f"name {record.name!r} is stored as {name!r}")
        manifest, reason = solution_to_ours(record, name)
        if manifest is None:
            return self.summary.warn(path, f"solution not imported: {reason}")
        if folder.exists():
            owner = folder_author(folder)
            if owner != record.author:
                return self.summary.warn(path, f"{folder} holds a solution by {owner!r}; not replaced")
            if same_sources(folder, record.sources):  # already here: keep its solution.yaml (tags, flags)
                self.solutions[(record.definition, record.name)] = (folder, owner)
                return
            shutil.rmtree(folder)
        try:
            parse_model(Solution, manifest, path)
            write_solution_folder(folder, manifest, record.sources)
        except (FlashbenchError, ValueError) as exc:
            shutil.rmtree(folder, ignore_errors=True)
            return self.summary.warn(path, f"solution not imported: {getattr(exc, 'message', exc)}")
        problems = [c.error for c in validate(self.repo, [folder]) if not c.ok]
        if problems:
            shutil.rmtree(folder)
            return self.summary.warn(path, f"solution not imported: {problems[0]}")
        if manifest.get("binding") == "tvm-ffi":
            self.summary.warn(path, "binding tvm-ffi: imported, but flashbench builds CUDA as a torch extension only")
        self.solutions[(record.definition, record.name)] = (folder, record.author)
        self.summary.counts["solutions"] += 1

    # --- traces ---------------------------------------------------------------------------------

    def add_traces(self, path: Path) -> None:
        parts = path.relative_to(self.dataset / "traces").parts
        author = parts[0] if len(parts) > 1 else None  # traces/<author>/<op_type>/<definition>.jsonl
        by_file: dict[Path, list[Trace]] = {}
        for number, record in fib.read_jsonl(fib.FibTrace, path):
            self.add_workload(record.definition, record.workload, path, f"line {number}")
            if record.is_workload_only or self.known_definition(record.definition, path) is None:
                continue
            trace = self.trace_to_ours(record, author)
            by_file.setdefault(trace_path(self.root / "traces", trace.hardware, trace.definition), []).append(trace)
        for target, traces in by_file.items():
            seen = {(t.solution, t.workload, t.timestamp) for t in read_traces(target)}
            for trace in traces:
                if (trace.solution, trace.workload, trace.timestamp) not in seen:
                    append_trace(target, trace)
                    seen.add((trace.solution, trace.workload, trace.timestamp))
                    self.summary.counts["traces"] += 1

    def trace_to_ours(self, record: fib.FibTrace, path_author: str | None) -> Trace:
        evaluation = record.evaluation
        imported = self.solutions.get((record.definition, record.solution))
        if imported:
            folder, author = imported
            name, digest = folder.name, content_hash(folder)
        else:
            name, author = record.solution, path_author or "unknown"
            digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        names = {w.uuid: w.name for w in self.workload_set(record.definition).workloads}
        return Trace(
            definition=record.definition, workload=record.workload.uuid, workload_name=names.get(record.workload.uuid, ""),
            solution=name, solution_hash=digest, author=author, hardware=evaluation.environment.hardware,
            status=evaluation.status, log=evaluation.log, correctness=correctness_to_ours(evaluation),
            performance=performance_to_ours(evaluation.performance) if evaluation.performance else None,
            environment={"hardware": evaluation.environment.hardware, "libs": evaluation.environment.libs,
                         "source": "FlashInfer-Bench"},
            timestamp=evaluation.timestamp,
        )


# --- conversions (pure functions) ---------------------------------------------------------------

def definition_to_ours(record: fib.FibDefinition) -> dict:
    """FIB's definition as flashbench's JSON: same keys, no nulls, dtype spellings normalised."""
    def axis(a: fib.FibAxis) -> dict:
        return {k: v for k, v in (("type", a.type), ("value", a.value), ("description", a.description)) if v is not None}

    def tensor(t: fib.FibTensorSpec) -> dict:
        data = {"shape": t.shape, "dtype": fib.DTYPE_ALIASES.get(t.dtype, t.dtype)}
        return data | ({"description": t.description} if t.description else {})

    data = {"name": record.name, "op_type": record.op_type}
    if record.description:
        data["description"] = record.description
    if record.tags:
        data["tags"] = record.tags
    data["axes"] = {k: axis(a) for k, a in record.axes.items()}
    data["inputs"] = {k: tensor(t) for k, t in record.inputs.items()}
    data["outputs"] = {k: tensor(t) for k, t in record.outputs.items()}
    if record.constraints:
        data["constraints"] = record.constraints
    data["reference"] = record.reference
    return data


def check_workload(definition: Definition, workload: Workload, base_dir: Path) -> None:
    """The checks `flashbench validate` makes, for one workload before it is written."""
    for axis in workload.axes:
        if axis not in definition.var_axes:
            raise ValueError(f"axes.{axis}: not a var axis of {definition.name}")
    for name in workload.inputs:
        if name not in definition.inputs:
            raise ValueError(f"inputs.{name}: not an input of {definition.name}")
    generate_inputs(definition, workload, seed=0, device="meta", base_dir=base_dir)


def write_workload_set(path: Path, workload_set: WorkloadSet, added: list[Workload]) -> None:
    """Append the new workloads to an existing file (keeping its comments) when that reads back
    right; otherwise write the whole set."""
    items = yaml.safe_dump([w.model_dump(exclude_defaults=True) for w in added], sort_keys=False)
    if path.is_file():
        text = path.read_text().rstrip("\n") + "\n" + items
        if _reads_as(text, workload_set):
            path.write_text(text)
            return
    header = f"# Workloads for {workload_set.definition}, imported from FlashInfer-Bench. uuids are stable.\n"
    body = {"definition": workload_set.definition, "version": workload_set.version,
            "workloads": [w.model_dump(exclude_defaults=True) for w in workload_set.workloads]}
    path.write_text(header + yaml.safe_dump(body, sort_keys=False))


def _reads_as(text: str, workload_set: WorkloadSet) -> bool:
    try:
        return WorkloadSet.model_validate(yaml.safe_load(text)) == workload_set
    except (yaml.YAMLError, ValueError):
        return False


def solution_to_ours(record: fib.FibSolution, name: str) -> tuple[dict | None, str]:
    """The solution.yaml for a FIB solution, or None and why flashbench cannot express it."""
    spec = record.spec
    manifest = {
        "name": name, "definition": record.definition, "author": record.author,
        "description": record.description or "", "language": spec.language, "entry_point": spec.entry_point,
        "destination_passing_style": spec.destination_passing_style, "target_hardware": spec.target_hardware,
        "dependencies": spec.dependencies,
    }
    if spec.language in ("python", "triton"):
        return manifest, ""
    if spec.language not in ("cpp", "cuda"):
        return None, f"language {spec.language!r} has no flashbench builder"
    compiled = [s.path for s in record.sources if PurePosixPath(s.path).suffix in COMPILED_SUFFIXES]
    if spec.entry_point.split("::")[0] not in compiled:
        return None, f"language {spec.language}: the entry point must be in a .cu/.cpp source to be built as CUDA"
    # FIB's C++/CUDA default binding is tvm-ffi.
    return manifest | {"language": "cuda", "binding": spec.binding or "tvm-ffi", "sources": compiled}, ""


def write_solution_folder(folder: Path, manifest: dict, sources: list[fib.FibSourceFile]) -> None:
    for source in sources:
        relative = PurePosixPath(source.path)
        if relative.is_absolute() or ".." in relative.parts or str(relative) == "solution.yaml":
            raise ValueError(f"sources: path {source.path!r} cannot be written inside a solution folder")
    folder.mkdir(parents=True)
    for source in sources:
        target = folder / source.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.content)
    (folder / "solution.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))


def folder_author(folder: Path) -> str | None:
    manifest = folder / "solution.yaml"
    return (yaml.safe_load(manifest.read_text()) or {}).get("author") if manifest.is_file() else None


def same_sources(folder: Path, sources: list[fib.FibSourceFile]) -> bool:
    """The folder holds exactly these sources (besides its solution.yaml)."""
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*")
               if p.is_file() and p.name != "solution.yaml" and "__pycache__" not in p.parts}
    return present == {s.path for s in sources} and all((folder / s.path).read_text() == s.content for s in sources)


def correctness_to_ours(evaluation: fib.FibEvaluation) -> dict[str, OutputError]:
    if evaluation.correctness is None:
        return {}
    c = evaluation.correctness
    # FIB's relative error is against the largest |reference| value, and it records no share of
    # elements outside tolerance: NaN says "not recorded".
    return {ALL_OUTPUTS: OutputError(max_abs_error=c.max_absolute_error, max_rel_error=c.max_relative_error,
                                     mismatch_fraction=math.nan)}


def performance_to_ours(performance: fib.FibPerformance) -> Performance:
    """FIB records one latency and no spread: every statistic is that latency, from one sample."""
    latency = performance.latency_ms
    return Performance(
        latency_ms=latency, mean_ms=latency, std_ms=0.0, min_ms=latency, p10_ms=latency, p90_ms=latency,
        samples=1, ci_low_ms=latency, ci_high_ms=latency,
        reference_latency_ms=performance.reference_latency_ms or None, speedup=performance.speedup_factor or None,
        timing={"method": IMPORTED_TIMING,
                "note": "FlashInfer-Bench's latency is a mean of per-trial medians; its spread is not recorded"},
    )
