"""`flashbench import-fib`: a FlashInfer-Bench dataset into a flashbench repository.

All or nothing per definition: its definition, workload set, blobs, solution folders and traces are
prepared in a staging folder and moved into the repository only once all of them are ready (and put
back as they were if a move fails). A record that breaks FIB's format fails its definition, and the
summary names file, line and field. Valid FIB content that flashbench cannot express or check (an
unknown language, a workload whose index tensors break the definition's constraints, ...) is
skipped with the reason; nothing is guessed. A file that holds no FIB record (a graph JSON among
the definitions, say) is ignored with a note.

Imported traces are a board source of their own, traces/imported/<source>/<hardware>/<definition>.jsonl,
each marked `imported_from: <source>`: boards read traces/<hardware>/ and never see them unless asked.
Importing twice adds nothing: workloads merge by uuid, traces by (solution, workload, timestamp).
"""

import contextlib
import filecmp
import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml
from pydantic import ValidationError

from ..binding import BindingError
from ..build import CACHE_DIR_NAME
from ..errors import FlashbenchError
from ..model import (REFERENCE, Definition, OutputError, Performance, Trace, Workload, WorkloadSet, load_model,
                     parse_model)
from ..model.definition import INTEGER_DTYPES
from ..model.loading import read_bounded, validation_error
from ..model.solution import SHARED_FOLDER
from ..model.workload import naming_clash
from ..reference import reference_file
from ..registry import WORKLOADS_SUFFIX, Repo, case_twin, load_solution_folder, look_alike_among
from ..traces import hardware_slug, read_trace_bytes, read_traces, sole_writer, trace_file_name
from ..validate import check_source_statically
from ..workloads import workload_problem
from . import fib_model as fib
from .fib_solution import (FolderPlan, check_folder, holds_exactly, plan_folder, safe_name, same_files, write_files,
                           write_folder)
from .staging import Staging
from .summary import Summary

ALL_OUTPUTS = "*"  # FIB records one error over all outputs; flashbench keys errors by output name
IMPORTED_TIMING = "imported from FlashInfer-Bench"
IMPORTED = "imported"  # traces/imported/<source>/: results from elsewhere, a board source of their own
FIB_SOURCE = "FlashInfer-Bench"  # environment.source of a trace FIB measured
_FOLDER_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# FIB's sampling references draw with torch.multinomial: their outputs are samples, judged as such.
SAMPLES_EVALUATOR = {"kind": "sampling", "reference": "samples"}
SAMPLING_NOTE = ("op_type sampling: its reference draws samples, so the outputs are judged by evaluator sampling "
                 "(reference: samples): support and a two-sample test against the reference's draws")


def import_fib(dataset: Path, root: Path, source: str | None = None) -> Summary:
    """`source` names the board source the traces go to (default: the dataset folder's name)."""
    dataset, root = Path(dataset).resolve(), Path(root).resolve()
    if not (dataset / "definitions").is_dir():
        raise FlashbenchError("not a FlashInfer-Bench dataset: it has no definitions/ folder", dataset)
    if not (root / "definitions").is_dir():
        raise FlashbenchError("not a flashbench repository: it has no definitions/ folder", root)
    return Importer(dataset, root, safe_name(source or dataset.name)).run()


def imported_trace_dir(root: Path, source: str) -> Path:
    """The trace folder of one imported source: the same layout as traces/ (<hardware>/<definition>.jsonl)."""
    return Path(root) / "traces" / IMPORTED / source


# --- finding what the dataset holds ----------------------------------------------------------------

@dataclass
class SolutionFile:
    path: Path
    definition: str
    author: str


@dataclass
class Dataset:
    """Which file holds what, found by one pass that keeps no record bodies in memory."""

    root: Path
    definitions: dict[str, Path] = field(default_factory=dict)
    solutions: dict[str, SolutionFile] = field(default_factory=dict)  # by FIB name: unique dataset-wide
    workload_files: dict[str, list[Path]] = field(default_factory=lambda: defaultdict(list))
    trace_files: dict[str, list[Path]] = field(default_factory=lambda: defaultdict(list))
    # flashbench's reference traces of an export (FIB has no place for them), by definition
    references: dict[str, Path] = field(default_factory=dict)
    timing: str = "events"  # how its traces were timed: an export of graph timings says so in flashbench.json

    def names(self) -> set[str]:
        return (set(self.definitions) | set(self.workload_files) | set(self.trace_files)
                | {s.definition for s in self.solutions.values()} | set(self.references))


DATASET_DEPTH = 16  # folders below a pattern's `**`; FlashInfer-Bench's own layout uses three


def dataset_files(root: Path, pattern: str, summary: Summary) -> list[Path]:
    """The files under `root` that `pattern` (`name`, `folder/*.ext` or `folder/**/*.ext`) matches and that are
    files of the dataset: a link out of it (to /etc/passwd, to a file of the user's) is not read, nor a FIFO or
    a device (a link to /dev/zero is one endless line), which hung the import; each is ignored with a note."""
    found = []
    for path in sorted(_matching(root, pattern, summary)):
        if inside(root, path):
            found.append(path)
        elif not path.is_dir() or path.is_symlink():
            summary.add("", "file", "ignored", f"{path}: a link out of the dataset or not a regular file; not read")
    return found


def _matching(root: Path, pattern: str, summary: Summary) -> Iterator[Path]:
    """What `pattern` matches under `root`, walked without recursion and at most DATASET_DEPTH folders deep
    below a `**` (pathlib's `**` recursed: 1,200 nested folders ended the import in a RecursionError); links
    to folders are not walked into."""
    folder, _, name = pattern.rpartition("/")
    deep = folder == "**" or folder.endswith("/**")
    pending = [(root / folder.removesuffix("**").rstrip("/"), 0)]
    while pending:
        directory, depth = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError:
            continue  # no such folder, or not one
        for entry in entries:
            if fnmatch.fnmatchcase(entry.name, name):
                yield Path(entry.path)
            if deep and entry.is_dir(follow_symlinks=False):
                if depth < DATASET_DEPTH:
                    pending.append((Path(entry.path), depth + 1))
                else:
                    summary.add("", "file", "ignored", f"{entry.path}: more than {DATASET_DEPTH} folders deep; "
                                                       "not read")


def inside(root: Path, path: Path) -> bool:
    """A regular file of the dataset at `root` (resolved), not reached through a link out of it."""
    return path.resolve().is_relative_to(root) and path.is_file()


def scan(root: Path, summary: Summary) -> Dataset:
    found = Dataset(root)
    for path in dataset_files(root, fib.SIDE_FILE, summary):
        side = _read_or_note(fib.SideFile, path, "flashbench side file", summary)
        found.timing = side.timing if side else found.timing
    references = fib.reference_traces_folder(root).relative_to(root).as_posix()
    found.references = {p.stem: p for p in dataset_files(root, f"{references}/*.jsonl", summary)}
    for path in dataset_files(root, "definitions/**/*.json", summary):
        record = _read_or_note(fib.FibDefinition, path, "definition", summary)
        if record is None:
            continue
        if record.name in found.definitions:
            summary.add(record.name, "file", "ignored", f"{path}: a second definition {record.name}; "
                                                         f"the first is {found.definitions[record.name]}")
        else:
            found.definitions[record.name] = path
    for path in dataset_files(root, "solutions/**/*.json", summary):
        record = _read_or_note(fib.FibSolution, path, "solution", summary)
        if record is None:
            continue
        first = found.solutions.get(record.name)
        if first:
            summary.add(record.definition, "solution", "skipped", f"{path}: a second solution named {record.name} "
                                                                  f"(FIB names are unique); the first is {first.path}")
        else:
            found.solutions[record.name] = SolutionFile(path, record.definition, record.author)
    for folder, files in (("workloads", found.workload_files), ("traces", found.trace_files)):
        for path in dataset_files(root, f"{folder}/**/*.jsonl", summary):
            for name in record_definitions(path, set(found.definitions), summary):
                files[name].append(path)
    return found


def _read_or_note(cls, path: Path, kind: str, summary: Summary):
    try:
        return fib.read_json(cls, path)
    except FlashbenchError as exc:
        summary.add("", "file", "ignored", f"not a {kind}: {exc}")
        return None


def record_definitions(path: Path, known: set[str], summary: Summary) -> set[str]:
    """The definitions a JSONL file has records of. A line naming none belongs to the definition the
    file is named after (FIB's layout), whose import it fails; with no such definition it is ignored."""
    names, stray = set(), []
    for number, line in fib.read_jsonl_lines(path):
        name = definition_of(line)
        if name is None:
            stray.append(number)
        else:
            names.add(name)
    if stray and path.stem in known:
        names.add(path.stem)
    elif stray:
        summary.add("", "file", "ignored", f"{path}: line(s) {', '.join(map(str, stray[:5]))}: not a FIB record")
    return names


def definition_of(line: bytes) -> str | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # 16 MiB of '[' is a line too: no record, not a crash of the import
        return None
    name = record.get("definition") if isinstance(record, dict) else None
    return name if isinstance(name, str) else None


# --- the import ------------------------------------------------------------------------------------

class Importer:
    def __init__(self, dataset: Path, root: Path, source: str):
        self.root, self.source = root, source
        self.summary = Summary()
        self.dataset = scan(dataset, self.summary)
        self.repo = Repo(root)

    def run(self) -> Summary:
        for name in sorted(self.dataset.names()):
            if name not in self.dataset.definitions and name not in self.repo.definition_files:
                self.summary.add(name, "definition", "skipped",
                                 "records name a definition that is neither in the dataset nor in the repository")
                continue
            self.summary.extend(self.import_definition(name))
        return self.summary

    def import_definition(self, name: str) -> Summary:
        staging = Staging(self.root, Path(CACHE_DIR_NAME, "import-staging"))
        try:
            summary = DefinitionImport(self, name, staging).run()
            traces = self.root / "traces"  # a run writing there would set the imported traces aside
            with sole_writer(traces) if traces.is_dir() else contextlib.nullcontext():
                staging.commit()
            return summary
        except (FlashbenchError, BindingError, ValueError, OSError) as exc:
            failed = Summary()
            failed.add(name, "definition", "failed", f"nothing of it imported: {exc}")
            return failed
        finally:
            staging.discard()


@dataclass
class SolutionRef:
    """What a trace of a FIB solution records about it here."""

    name: str
    author: str
    digest: str


class DefinitionImport:
    """One definition and everything of it, into a staging folder."""

    def __init__(self, importer: Importer, name: str, staging: Staging):
        self.dataset, self.root, self.repo, self.source = importer.dataset, importer.root, importer.repo, importer.source
        self.name, self.staging = name, staging
        self.summary = Summary()
        self.solutions: dict[str, SolutionRef] = {}  # by FIB name
        self.rejected: set[str] = set()  # workload uuids skipped (and said so) already

    def run(self) -> Summary:
        definition, self.workloads_file, ext = self.stage_definition()
        self.workload_set = self.load_workload_set(definition, ext)
        self.existing_uuids = {w.uuid for w in self.workload_set.workloads}
        self.workload_names = {w.uuid: w.name for w in self.workload_set.workloads}  # and those added
        self.workload_axes = {w.uuid: w.axes for w in self.workload_set.workloads}
        self.conflicting: set[str] = set()  # uuids the dataset uses for another workload than the one here
        self.stage_solutions(definition)
        for path in self.dataset.workload_files.get(self.name, []):
            for number, record in self.records(path):
                self.add_workload(definition, record.workload, f"{path}: line {number}")
        self.stage_traces(definition)
        self.stage_workload_set()
        return self.summary

    def add(self, kind, outcome, why: str = "", count: int = 1) -> None:
        self.summary.add(self.name, kind, outcome, why, count)

    # --- definition ------------------------------------------------------------------------------

    def stage_definition(self) -> tuple[Definition, Path, fib.DefinitionExtension | None]:
        """Ours, the repository path of its workload set, and flashbench's extension of the FIB record."""
        existing = self.repo.definition_files.get(self.name)
        path = self.dataset.definitions.get(self.name)
        if path is None:
            return existing.definition, self.repo.workloads_path(self.name), None
        record = fib.read_json(fib.FibDefinition, path)
        self.note_extra(path, record)
        data = definition_to_ours(record)
        definition = parse_model(Definition, data, path)
        check_reference(definition, self.root, path)
        if not _FOLDER_NAME.fullmatch(definition.op_type) or definition.op_type in (".", ".."):
            raise FlashbenchError(f"{definition.op_type!r} cannot be a folder name", path, "op_type")
        target = self.root / "definitions" / definition.op_type / f"{definition.name}.json"
        text = json.dumps(data, indent=2) + "\n"
        note = SAMPLING_NOTE if data.get("evaluator") == SAMPLES_EVALUATOR else ""
        if existing and existing.path == target and target.read_bytes() == text.encode():
            self.add("definition", "unchanged", note)
        elif existing:
            # Never replaced, wherever it is (an earlier import's JSON included): a second dataset swapped the
            # reference, the dtypes and the tolerances of a definition the repository's solutions are judged by.
            difference = interface_difference(existing.definition, definition)
            if difference:
                raise FlashbenchError(f"differs from {existing.path}: {difference}", path)
            self.add("definition", "unchanged", f"the repository's {existing.path} has the same interface; kept it "
                                                "(its reference, tolerances and evaluator too)")
            return existing.definition, self.repo.workloads_path(self.name), record.flashbench
        else:
            self.staging.write_text(target.relative_to(self.root), text)
            self.add("definition", "imported", note)
        return definition, target.with_name(definition.name + WORKLOADS_SUFFIX), record.flashbench

    def note_extra(self, path: Path, record: fib.FibModel) -> None:
        if record.model_extra:
            self.add("file", "ignored", f"{path}: field(s) {', '.join(record.model_extra)} have no flashbench "
                                        "equivalent; dropped")

    # --- workloads -------------------------------------------------------------------------------

    def load_workload_set(self, definition: Definition, ext: fib.DefinitionExtension | None) -> WorkloadSet:
        """The repository's workload set, else a new one."""
        if self.workloads_file.is_file():
            return load_model(WorkloadSet, self.workloads_file)
        version = ext.workloads_version if ext and ext.workloads_version else 1
        return WorkloadSet(definition=definition.name, version=version, workloads=[])

    def records(self, path: Path):
        """(line number, record) of this definition in a JSONL file, one line at a time."""
        for number, line in fib.read_jsonl_lines(path):
            name = definition_of(line)
            if name == self.name or (name is None and path.stem == self.name):
                yield number, fib.parse_line(fib.FibTrace, line, path, number)

    def add_workload(self, definition: Definition, record: fib.FibWorkload, where: str) -> None:
        uuid = record.uuid
        if uuid in self.workload_names and uuid not in self.conflicting:
            axes = record.flashbench.axes if record.flashbench else record.axes
            if axes != self.workload_axes[uuid]:  # its traces were measured on other shapes than this uuid's here
                self.conflicting.add(uuid)
                self.add("workload", "skipped", f"{where}: workload {uuid} has axes {axes} there, "
                                                f"{self.workload_axes[uuid]} here; neither it nor its traces imported")
        if uuid in self.rejected or uuid in self.workload_names:
            return
        try:
            workload, blobs = workload_to_ours(record, self.dataset.root, where)
            clash = naming_clash(set(self.workload_names.values()), set(self.workload_names), workload)
            if clash:
                raise ValueError(clash)
            problem = workload_problem(definition, workload, self.dataset.root)  # as validate and run refuse
            if problem:
                raise ValueError(problem)
            new_blobs = [blob for blob in blobs if self.blob_needed(blob)]
        except (FlashbenchError, BindingError, ValueError) as exc:
            self.rejected.add(uuid)
            return self.add("workload", "skipped", f"{where}: workload {uuid} not imported: {reason(exc)}")
        for blob in new_blobs:
            self.staging.copy(self.dataset.root / blob, self.blob_path(blob))
            self.add("blob", "imported")
        self.workload_set.workloads.append(workload)
        self.workload_names[uuid] = workload.name
        self.workload_axes[uuid] = workload.axes
        self.add("workload", "imported")

    def blob_path(self, blob: PurePosixPath) -> Path:
        """Blob paths are relative to the dataset root there and to the workload file here."""
        return (self.workloads_file.parent / blob).relative_to(self.root)

    def blob_needed(self, blob: PurePosixPath) -> bool:
        """Whether to copy a blob: not when it is here already; ValueError when another file has its path."""
        relative = self.blob_path(blob)
        target = self.root / relative
        if target.is_file():
            if not filecmp.cmp(self.dataset.root / blob, target, shallow=False):
                raise ValueError(f"{target} exists with other content; not replaced")
            return False
        return not self.staging.path(relative).is_file()

    def stage_workload_set(self) -> None:
        added = [w for w in self.workload_set.workloads if w.uuid not in self.existing_uuids]
        if not added:
            return
        existing = self.workloads_file.read_text() if self.workloads_file.is_file() else None
        self.staging.write_text(self.workloads_file.relative_to(self.root),
                                workload_set_text(existing, self.workload_set, added))

    # --- solutions -------------------------------------------------------------------------------

    def stage_solutions(self, definition: Definition) -> None:
        taken: list[str] = []  # the names of this import's solutions imported (or found unchanged) so far
        here = self.names_here()
        for fib_name, found in sorted(self.dataset.solutions.items()):
            if found.definition != self.name:
                continue
            record = fib.read_json(fib.FibSolution, found.path)
            self.note_extra(found.path, record)
            self.solutions[fib_name] = self.stage_solution(definition, record, found.path, taken, here)

    def names_here(self) -> set[str]:
        """The names the repository's folders of the definition go by: each folder's and its manifest's."""
        present = self.root / "solutions" / self.name
        names = set()
        for entry in sorted(present.iterdir()) if present.is_dir() else []:
            names.add(entry.name)
            with contextlib.suppress(FlashbenchError):
                names.add(load_solution_folder(entry).solution.name)
        return names

    def stage_solution(self, definition: Definition, record: fib.FibSolution, path: Path, taken: list[str],
                       here: set[str]) -> SolutionRef:
        unimported = SolutionRef(safe_name(record.name), record.author, record_digest(record))
        try:
            plan = plan_folder(record)
        except ValueError as exc:
            self.add("solution", "skipped", f"{path}: solution {record.name} not imported: {exc}")
            return unimported
        if any(name.lower() == plan.name.lower() for name in taken):  # one folder on a case-insensitive file system
            self.add("solution", "skipped",
                     f"{path}: a solution named {plan.name} (case aside) was already imported; skipped")
            return unimported
        others = [name for name in [*taken, *sorted(here)] if name.lower() != plan.name.lower()]  # case: below
        alike = look_alike_among(plan.name, others)
        if alike is not None:  # two board rows a reader takes for one (registry.look_alike)
            self.add("solution", "skipped", f"{path}: the name {plan.name} reads as {alike} on a board; not imported")
            return unimported
        shared, conflict = self.stage_shared(plan)
        if conflict:
            for folder in shared:
                self.staging.drop(folder)
            shared, plan = [], plan_folder(record, inline_shared=True)
            plan.notes.append(f"{conflict}; its files are put in the solution's folder, so its content hash is "
                              "not its traces' any more")
        relative = Path("solutions", self.name, plan.name)
        existing = self.root / relative
        twin = case_twin(existing)
        if twin is not None:  # on a case-insensitive file system it is `existing`, holding other files
            self.add("solution", "skipped", f"{path}: {plan.name} differs from {existing.parent / twin} only in "
                                            "case; not imported (one folder on a case-insensitive file system)")
            return unimported
        if existing.exists():
            # Never replaced: an author is a name anyone can write into a dataset, so it proves no right to
            # a folder here (a dataset naming the repository's own author replaced its solutions).
            if not same_files(existing, plan):
                self.add("solution", "skipped", f"{path}: {existing} holds other files; not replaced (remove it "
                                                "to import this version)")
                return unimported
            self.add("solution", "unchanged")
            taken.append(plan.name)
            return SolutionRef(plan.name, record.author, load_solution_folder(existing).content_hash())
        digest = self.stage_folder(definition, plan, relative, path)
        if digest is None:
            for folder in shared:  # staged for this solution alone
                self.staging.drop(folder)
            return unimported
        self.add("solution", "imported", "; ".join(f"{record.name}: {note}" for note in plan.notes))
        taken.append(plan.name)
        return SolutionRef(plan.name, record.author, digest)

    def stage_shared(self, plan: FolderPlan) -> tuple[list[Path], str | None]:
        """Stage the shared folders the plan names where the repository lacks them (and say which), or
        say why not: one exists here with other files. The repository's own are copied beside the
        staged solution folder, which finds its shared folders there when it is checked."""
        staged_now = []
        for name in plan.shared:
            relative = Path("solutions", SHARED_FOLDER, name)
            files, existing, staged = plan.shared_files(name), self.root / relative, self.staging.path(relative)
            for folder in (existing, staged):
                if folder.is_dir() and not holds_exactly(folder, files):
                    return staged_now, f"shared folder {name} holds other files than the record's here"
            if staged.exists():
                continue
            if existing.is_dir():
                shutil.copytree(existing, staged)  # for the checks only: not moved into the repository
                continue
            try:
                write_files(staged, files)
            except (ValueError, OSError) as exc:  # the solution's folder then says why it cannot be written
                shutil.rmtree(staged, ignore_errors=True)
                return staged_now, f"shared folder {name} cannot be written: {exc}"
            self.staging.add(relative)
            staged_now.append(relative)
        return staged_now, None

    def stage_folder(self, definition: Definition, plan: FolderPlan, relative: Path, path: Path) -> str | None:
        """The staged folder's content hash, or None (and why) if flashbench cannot use it."""
        staged = self.staging.path(relative)
        try:
            write_folder(staged, plan)
            loaded = check_folder(staged, definition)
        except (FlashbenchError, ValueError, OSError) as exc:  # OSError: a path too long here, say: this solution's
            # problem, not its definition's
            shutil.rmtree(staged, ignore_errors=True)
            self.add("solution", "skipped", f"{path}: solution not imported: {reason(exc)}")
            return None
        self.staging.add(relative)
        return loaded.content_hash()

    # --- traces ----------------------------------------------------------------------------------

    def stage_traces(self, definition: Definition) -> None:
        writer = TraceWriter(self)
        for path in self.dataset.trace_files.get(self.name, []):
            for number, record in self.records(path):
                self.add_workload(definition, record.workload, f"{path}: line {number}")
                if record.workload.uuid in self.conflicting:
                    continue
                if not record.is_workload_only:
                    try:
                        trace, why = self.trace_to_ours(record, path, number)
                    except ValidationError as exc:  # one record (an author flashbench refuses): that line alone
                        problem = validation_error(exc, path)
                        self.add("trace", "skipped", f"{path}: line {number}: not imported: "
                                                     f"{': '.join(filter(None, (problem.field, problem.message)))}")
                        continue
                    if trace.solution == REFERENCE:  # the reference's own come only from the export's side file
                        self.add("trace", "skipped", f"{path}: line {number}: a solution record may not be the "
                                                     f"definition's {REFERENCE!r}")
                        continue
                    writer.add(trace, why)
        reference = self.dataset.references.get(self.name)
        if reference:
            for number, line in fib.read_jsonl_lines(reference):
                trace = parse_trace(line, reference, number)
                # The file's name says whose reference it holds: any other line (another definition's, whose file
                # this import does not own, or a solution's, with an author and a latency of the dataset's choosing)
                # is no reference trace.
                if (trace.definition, trace.solution) != (self.name, REFERENCE):
                    self.add("trace", "skipped", f"{reference}: line {number}: not a trace of {self.name}'s "
                                                 f"{REFERENCE!r} (it names {trace.solution} of {trace.definition})")
                    continue
                writer.add(trace)
        writer.stage()

    def trace_to_ours(self, record: fib.FibTrace, path: Path, number: int) -> tuple[Trace, str]:
        """The trace, and what the summary should say of it."""
        if record.flashbench is not None:
            return trace_from_extension(record, path, number), ""
        solution, why = self.solutions.get(record.solution), ""
        if solution is None:
            digest = hashlib.sha256(record.solution.encode()).hexdigest()[:16]
            solution = SolutionRef(safe_name(record.solution), "unknown", digest)
            why = f"solution {record.solution} has no record in the dataset: author 'unknown'"
        return trace_from_fib(record, solution, self.workload_names), why


class TraceWriter:
    """A definition's imported traces, one file per hardware (and timing method) under the import's
    source; what is already there is kept and not added twice."""

    def __init__(self, importer: DefinitionImport):
        self.importer = importer
        self.base = imported_trace_dir(importer.root, importer.source).relative_to(importer.root)
        self.timing = importer.dataset.timing
        self.seen: dict[Path, set[tuple[str, str, str]]] = {}

    def add(self, trace: Trace, why: str = "") -> None:
        relative = self.base / hardware_slug(trace.hardware) / trace_file_name(trace.definition, self.timing)
        seen = self.seen.get(relative)
        if seen is None:
            seen = self.seen[relative] = self.open(relative)
        key = (trace.solution, trace.workload, trace.timestamp)
        if key in seen:
            return
        seen.add(key)
        trace = trace.model_copy(update={"imported_from": self.importer.source})
        with open(self.importer.staging.path(relative), "ab") as handle:
            handle.write((trace.model_dump_json() + "\n").encode())
        self.importer.add("trace", "imported", why)

    def open(self, relative: Path) -> set[tuple[str, str, str]]:
        """Start the staged file as a copy of the repository's; the keys it holds."""
        existing, staged = self.importer.root / relative, self.importer.staging.path(relative)
        # Read as a run reads its trace files (never through a link, nor blocking), from a folder the commit would
        # write into (no link on the way): a committed link to /proc/self/environ put the runner's environment into
        # the trace file committed.
        self.importer.staging.check(relative)
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_bytes(read_trace_bytes(existing))
        # Every record the file holds; a line that is no trace (a list, a field of the wrong type: the file
        # is on disk for anyone to edit) is skipped with a warning, as every board skips it.
        return {(trace.solution, trace.workload, trace.timestamp) for trace in read_traces(existing)}

    def stage(self) -> None:
        for relative, seen in self.seen.items():
            self.importer.staging.add(relative)


# --- conversions (pure functions) ---------------------------------------------------------------

def definition_to_ours(record: fib.FibDefinition) -> dict:
    """FIB's definition as flashbench's JSON: same keys, no nulls, dtype spellings normalised,
    flashbench's own fields back from the extension."""
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
    for name in (record.flashbench.constant_inputs if record.flashbench else []):
        if name in data["inputs"]:
            data["inputs"][name]["constant"] = True
    data["outputs"] = {k: tensor(t) for k, t in record.outputs.items()}
    if record.constraints:
        data["constraints"] = record.constraints
    data["reference"] = record.reference
    if samples_definition(record):
        data["evaluator"] = dict(SAMPLES_EVALUATOR)
    ext = record.flashbench
    if ext and ext.evaluator.kind != "allclose":
        data["evaluator"] = ext.evaluator.model_dump()
    if ext and ext.tolerances:
        data["tolerances"] = {k: t.model_dump() for k, t in ext.tolerances.items()}
    if ext and ext.cost:
        data["cost"] = ext.cost.model_dump()
    return data


def check_reference(definition: Definition, root: Path, path: Path) -> None:
    """The reference's `run` and its parameters, read without running it: the dataset's code (an import
    that loaded the reference ran whatever a downloaded dataset put at its top level)."""
    if definition.reference_is_path:
        source = reference_file(definition, root, path)
        if not source.is_file():
            raise FlashbenchError(f"reference file {source} does not exist", path, "reference")
        text, label = read_bounded(source), source.name
    else:
        text, label = definition.reference, f"<reference of {definition.name}>"
    check_source_statically(text, label, "run", list(definition.inputs), path, "reference")


def samples_definition(record: fib.FibDefinition) -> bool:
    """Whether FIB's definition samples: op_type sampling (FIB's sampling references call
    torch.multinomial) with integer tensor outputs (sample ids), and no flashbench extension (an
    export of flashbench's, whose reference may return distributions: its evaluator is not known)."""
    return (record.op_type == "sampling" and record.flashbench is None and bool(record.outputs)
            and all(t.shape is not None and fib.DTYPE_ALIASES.get(t.dtype, t.dtype) in INTEGER_DTYPES
                    for t in record.outputs.values()))


def interface_difference(ours: Definition, theirs: Definition) -> str | None:
    """The first difference in what a solution sees (axes, inputs, outputs), or None. Inputs and
    outputs are passed by position, so their order counts; axes are looked up by name, so theirs
    does not (FIB's mla_paged_prefill_causal_h16_ckv512_kpe64_ps1 lists ours in another order)."""
    for kind in ("axes", "inputs", "outputs"):
        mine, other = getattr(ours, kind), getattr(theirs, kind)
        same = set(mine) == set(other) if kind == "axes" else list(mine) == list(other)
        if not same:
            return f"{kind}: {', '.join(mine)} here, {', '.join(other)} there"
        for key, spec in mine.items():
            fields = ("type", "value") if kind == "axes" else ("shape", "dtype")
            for name in fields:
                if getattr(spec, name) != getattr(other[key], name):
                    return f"{kind}.{key}.{name}: {getattr(spec, name)!r} here, {getattr(other[key], name)!r} there"
    return None


def reason(exc: Exception) -> str:
    """Why a record was skipped, its field first where the error names one; the file (a staging folder's, or the
    record's `where` said before it) left out. Without the field, "an integer past int64" named no value."""
    return exc.detail if isinstance(exc, FlashbenchError) else str(exc)


def workload_to_ours(record: fib.FibWorkload, dataset: Path, where: str) -> tuple[Workload, list[PurePosixPath]]:
    """Our workload (blob paths relative to the dataset root, which is also where they land relative
    to the workload file) and the blobs it needs. With flashbench's extension, the workload as it
    was written; the FIB record then only says where its captured tensors are."""
    ext = record.flashbench
    captured, blobs = {}, {}
    for name, descriptor in record.inputs.items():
        if isinstance(descriptor, fib.FibSafetensorsInput):
            blob = fib.normalise_blob_path(descriptor.path)
            if blob is None:
                raise ValueError(f"inputs.{name}: safetensors file {descriptor.path} is not inside the dataset")
            if (dataset / blob).exists() and not inside(dataset, dataset / blob):
                raise ValueError(f"inputs.{name}: safetensors file {descriptor.path} is a link out of the dataset "
                                 "or not a regular file")
            if not (dataset / blob).is_file():  # FIB's git copy has no blob/: its blobs are published apart
                raise ValueError(f"inputs.{name}: safetensors file {descriptor.path} is missing from the dataset")
            captured[name] = {"type": "safetensors", "path": str(blob), "tensor_key": descriptor.tensor_key}
            blobs[name] = blob
    if ext is None:
        inputs = {name: captured.get(name) or d.model_dump(exclude_none=True) for name, d in record.inputs.items()}
        data = {"uuid": record.uuid, "axes": record.axes, "inputs": inputs}
    else:
        inputs = {name: captured.get(name) if d.type == "safetensors" else d.model_dump(exclude_defaults=True)
                  for name, d in ext.inputs.items()}
        missing = [name for name, d in inputs.items() if d is None]
        if missing:
            raise ValueError(f"inputs.{missing[0]}: flashbench's workload captures it, the FIB record has no blob for it")
        blobs = {name: blobs[name] for name in inputs if name in blobs}  # generated inputs need no blob here
        data = {"uuid": record.uuid, "name": ext.name, "tags": ext.tags, "axes": ext.axes, "inputs": inputs,
                "generate": [g.model_dump(exclude_defaults=True) for g in ext.generate]}
    return parse_model(Workload, data, where), sorted(set(blobs.values()))


def workload_set_text(existing: str | None, workload_set: WorkloadSet, added: list[Workload]) -> str:
    """The new workloads appended to the existing file (keeping its comments) when that reads back
    right; otherwise the whole set."""
    items = yaml.safe_dump([w.model_dump(exclude_defaults=True) for w in added], sort_keys=False)
    if existing is not None:
        text = existing.rstrip("\n") + "\n" + items
        if _reads_as(text, workload_set):
            return text
    header = f"# Workloads for {workload_set.definition}, imported from FlashInfer-Bench. uuids are stable.\n"
    body = {"definition": workload_set.definition, "version": workload_set.version,
            "workloads": [w.model_dump(exclude_defaults=True) for w in workload_set.workloads]}
    return header + yaml.safe_dump(body, sort_keys=False)


def _reads_as(text: str, workload_set: WorkloadSet) -> bool:
    try:
        return WorkloadSet.model_validate(yaml.safe_load(text)) == workload_set
    except (yaml.YAMLError, ValueError):
        return False


def record_digest(record: fib.FibSolution) -> str:
    """A content hash for a solution that has no folder here: its record, as FIB would hash it."""
    return hashlib.sha256(record.model_dump_json(exclude={"flashbench"}).encode()).hexdigest()[:16]


def parse_trace(line: bytes, path: Path, number: int) -> Trace:
    return fib.parse_line(Trace, line, path, number)


def trace_from_extension(record: fib.FibTrace, path: Path, number: int) -> Trace:
    """The flashbench trace an export wrote: its extension plus what the FIB record holds as it was."""
    ext, evaluation = record.flashbench, record.evaluation
    header = fib.log_header(str(ext.get("status", "")), str(ext.get("message", "")))
    data = ext | {"definition": record.definition, "workload": record.workload.uuid,
                  "log": evaluation.log.removeprefix(header), "timestamp": evaluation.timestamp}
    return parse_model(Trace, data, f"{path}: line {number}: flashbench")


def trace_from_fib(record: fib.FibTrace, solution: SolutionRef, names: dict[str, str]) -> Trace:
    evaluation = record.evaluation
    return Trace(
        definition=record.definition, workload=record.workload.uuid, workload_name=names.get(record.workload.uuid, ""),
        solution=solution.name, solution_hash=solution.digest, author=solution.author,
        hardware=evaluation.environment.hardware, status=evaluation.status, log=evaluation.log,
        correctness=correctness_to_ours(evaluation),
        performance=performance_to_ours(evaluation.performance) if evaluation.performance else None,
        environment={"hardware": evaluation.environment.hardware, "libs": evaluation.environment.libs,
                     "source": FIB_SOURCE},
        timestamp=evaluation.timestamp,
    )


def correctness_to_ours(evaluation: fib.FibEvaluation) -> dict[str, OutputError]:
    if evaluation.correctness is None:
        return {}
    c = evaluation.correctness
    # FIB's relative error is against the largest |reference| value, and it records no share of
    # elements outside tolerance: NaN says "not recorded".
    return {ALL_OUTPUTS: OutputError(max_abs_error=c.max_absolute_error, max_rel_error=c.max_relative_error,
                                     mismatch_fraction=math.nan)}


def performance_to_ours(performance: fib.FibPerformance) -> Performance:
    """FIB records one latency and no spread: every statistic is that latency, from one sample. Its
    reference latency and speedup (measured in the same evaluation) are kept as they are."""
    latency = performance.latency_ms
    return Performance(
        latency_ms=latency, mean_ms=latency, std_ms=0.0, min_ms=latency, p10_ms=latency, p90_ms=latency,
        samples=1, ci_low_ms=latency, ci_high_ms=latency,
        reference_latency_ms=performance.reference_latency_ms or None, speedup=performance.speedup_factor or None,
        timing={"method": IMPORTED_TIMING,
                "note": "FlashInfer-Bench's latency is a mean of per-trial medians; its spread is not recorded"},
    )
