"""FIB solution records <-> flashbench solution folders.

A FIB solution is one JSON with its sources embedded; ours is a folder with a solution.yaml, whose
files may partly live in shared folders (solutions/_shared/<name>/). A record that flashbench
exported carries the folder's solution.yaml verbatim, its empty files and which files came from
which shared folder, so the folders come back byte for byte and the solution keeps its content
hash; any other record gets a solution.yaml made from its spec.
"""

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml

from ..build import folder_files, is_version_control, path_problem
from ..errors import FlashbenchError
from ..model.definition import NAME_CHARS
from ..model import Definition, Solution, parse_model
from ..model.loading import parse_document
from ..registry import SolutionFolder, load_solution_folder
from ..validate import check_signature_statically, expected_parameters
from . import fib_model as fib

COMPILED_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
MANIFEST = Path("flashbench.manifest")  # how errors name a record's embedded solution.yaml
NAME_MAX = 255  # bytes of one file name on Linux and macOS file systems


def safe_name(name: str) -> str:
    """A name usable as a flashbench solution name and folder (FOLDER_NAME: none starts with '-' or '.'). One
    longer than NAME_CHARS keeps a digest of the whole name, so that two names alike in their first 128
    characters stay two names (cut alike, one's traces went to the other's row)."""
    safe = _UNSAFE.sub("_", name).lstrip("._-").rstrip("._") or "unnamed"
    if len(safe) <= NAME_CHARS:
        return safe
    return safe[:NAME_CHARS - 9].rstrip("._") + "-" + hashlib.sha256(name.encode()).hexdigest()[:8]


@dataclass
class FolderPlan:
    """What to write for a FIB solution record: the folder's name, solution.yaml and files, and the
    shared folders (name -> files) it names."""

    name: str
    manifest: str
    files: dict[str, str]  # every file, by its path where the solution is loaded
    shared: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def own_files(self) -> dict[str, str]:
        elsewhere = {path for paths in self.shared.values() for path in paths}
        return {path: text for path, text in self.files.items() if path not in elsewhere}

    def shared_files(self, name: str) -> dict[str, str]:
        return {path: self.files[path] for path in self.shared[name]}


def plan_folder(record: fib.FibSolution, inline_shared: bool = False) -> FolderPlan:
    """Raises ValueError saying why flashbench cannot express the record. `inline_shared`: put the
    files of shared folders into the solution's own folder (for running it where they do not exist)."""
    files = {s.path: s.content for s in record.sources}
    ext = record.flashbench
    notes = []
    if ext is not None:
        files |= {path: "" for path in ext.empty_files}
        mismatch = extension_mismatch(record, ext)
        if mismatch is None and not (inline_shared and ext.shared):
            return FolderPlan(ext.name, ext.manifest, files, ext.shared)
        if mismatch is None:
            return FolderPlan(ext.name, without_shared(ext.manifest), files)
        notes.append(f"flashbench.manifest not used ({mismatch}); solution.yaml made from the FIB spec")
    name = safe_name(record.name)
    if name != record.name:
        notes.append(f"name {record.name!r} is stored as {name!r}")
    manifest = manifest_from_spec(record, name)
    if manifest.get("binding") == "tvm-ffi":
        notes.append("binding tvm-ffi: imported, but flashbench builds CUDA as a torch extension only")
    return FolderPlan(name, yaml.safe_dump(manifest, sort_keys=False), files, notes=notes)


def extension_mismatch(record: fib.FibSolution, ext: fib.SolutionExtension) -> str | None:
    """Why the exported solution.yaml no longer describes the record (edited since), or None."""
    try:  # a dataset's text, as untrusted as a folder's solution.yaml: no aliases, bounded nesting
        ours = parse_model(Solution, parse_document(ext.manifest, MANIFEST, untrusted=True), MANIFEST)
    except FlashbenchError as exc:
        return str(exc).splitlines()[0]
    spec = record.spec
    theirs = {"definition": record.definition, "entry_point": spec.entry_point,
              "destination_passing_style": spec.destination_passing_style}
    for key, value in theirs.items():
        if getattr(ours, key) != value:
            return f"its {key} is {getattr(ours, key)!r}, the record's {value!r}"
    if ours.name != ext.name:
        return f"its name is {ours.name!r}, flashbench.name {ext.name!r}"
    if sorted(ours.shared) != sorted(ext.shared):
        return f"it names shared folders {ours.shared}, flashbench.shared {sorted(ext.shared)}"
    held = {s.path for s in record.sources} | set(ext.empty_files)
    for name, paths in ext.shared.items():
        stray = [path for path in paths if path not in held]
        if stray:  # a file of no source: the import stopped on it (KeyError), every later definition with it
            return f"flashbench.shared.{name} names {stray[0]!r}, which is none of the record's files"
    return None


def without_shared(manifest: str) -> str:
    data = parse_document(manifest, MANIFEST, untrusted=True)
    data.pop("shared", None)
    return yaml.safe_dump(data, sort_keys=False)


def manifest_from_spec(record: fib.FibSolution, name: str) -> dict:
    """solution.yaml for a FIB solution that flashbench did not export; ValueError if it cannot be built here."""
    spec = record.spec
    manifest = {
        "name": name, "definition": record.definition, "author": record.author,
        "description": record.description or "", "language": spec.language, "entry_point": spec.entry_point,
        "destination_passing_style": spec.destination_passing_style, "target_hardware": spec.target_hardware,
        "dependencies": spec.dependencies,
    }
    if spec.language in ("python", "triton"):
        return manifest
    if spec.language not in ("cpp", "cuda"):
        raise ValueError(f"language {spec.language!r} has no flashbench builder")
    compiled = [s.path for s in record.sources if PurePosixPath(s.path).suffix in COMPILED_SUFFIXES]
    if spec.entry_point.split("::")[0] not in compiled:
        raise ValueError(f"language {spec.language}: the entry point must be in a .cu/.cpp source to be built as CUDA")
    # FIB's C++/CUDA default binding is tvm-ffi.
    return manifest | {"language": "cuda", "binding": spec.binding or "tvm-ffi", "sources": compiled}


def write_folder(folder: Path, plan: FolderPlan) -> None:
    """The solution's own folder (which must not exist); ValueError for a path that would leave it."""
    write_files(folder, plan.own_files())
    _write(folder / "solution.yaml", plan.manifest)


def write_files(folder: Path, files: dict[str, str]) -> None:
    relatives = {PurePosixPath(path) for path in files}
    for path in files:
        relative = PurePosixPath(path)
        # "." (or "") names the folder itself, and a path another lies under names a folder: neither is a file.
        if (relative.is_absolute() or not relative.parts or ".." in relative.parts or str(relative) == "solution.yaml"
                or any(relative in other.parents for other in relatives)
                or any(len(part.encode()) > NAME_MAX or is_version_control(part) for part in relative.parts)):
            raise ValueError(f"sources: path {path!r} cannot be written inside a solution folder")
        too_long = path_problem(str(relative))
        if too_long:
            raise ValueError(f"sources: {too_long}")
    folder.mkdir(parents=True)
    for path, text in files.items():
        _write(folder / path, text)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())  # bytes: no newline translation, so the content hash holds


def holds_exactly(folder: Path, files: dict[str, str]) -> bool:
    """The folder holds these files and no other (byte for byte)."""
    present = folder_files(folder)
    return present.keys() == files.keys() and all(present[k] == v.encode() for k, v in files.items())


def same_files(folder: Path, plan: FolderPlan) -> bool:
    """The solution folder already holds exactly what the plan would write there."""
    return holds_exactly(folder, plan.own_files() | {"solution.yaml": plan.manifest})


def check_folder(folder: Path, definition: Definition) -> SolutionFolder:
    """The checks `flashbench validate` makes on a solution folder, against a definition in hand."""
    loaded = load_solution_folder(folder)
    manifest = folder / "solution.yaml"
    if loaded.solution.definition != definition.name:
        raise FlashbenchError(f"names definition {loaded.solution.definition!r}, not {definition.name!r}",
                              manifest, "definition")
    if loaded.solution.language != "cuda":
        expected = expected_parameters(definition, loaded.solution)
        check_signature_statically(loaded.entry_folder, loaded.solution.entry_file, loaded.solution.entry_function,
                                   expected, manifest)
    return loaded


def solution_from_fib_json(path: Path, into: Path) -> Path:
    """A FIB solution JSON as a self-contained solution folder under `into`, ready for
    `flashbench run --solution`.

    The folder is named by a hash of the JSON, so running the same file again reuses the folder (and
    its build and --resume records); errors name the file and the field."""
    path = Path(path)
    record = fib.read_json(fib.FibSolution, path)
    try:
        plan = plan_folder(record, inline_shared=True)
    except ValueError as exc:
        raise FlashbenchError(f"cannot run this solution here: {exc}", path) from None
    # 128 bits of the JSON's hash, and a folder made before is used again only while it holds what this JSON
    # makes, byte for byte: two JSONs made to share a name (64 bits collide in minutes) would run each other's code.
    folder = Path(into) / hashlib.sha256(path.read_bytes()).hexdigest()[:32] / plan.name
    if (folder / "solution.yaml").is_file():
        try:
            if same_files(folder, plan):
                return folder
        except FlashbenchError:  # a folder the judge will not read (build.walk_folder): made again
            pass
        shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
    try:
        write_folder(staging / plan.name, plan)
        os.replace(staging / plan.name, folder)  # whole or not at all, even with two runs at once
    except ValueError as exc:
        raise FlashbenchError(str(exc), path) from None
    except OSError:
        if not (folder / "solution.yaml").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# --- export ---------------------------------------------------------------------------------------

def folder_to_fib(folder: SolutionFolder, fib_name: str) -> tuple[fib.FibSolution, list[str]]:
    """The FIB record of a solution folder (its shared folders' files included: FIB has no sharing),
    and what it could not carry."""
    solution, notes = folder.solution, []
    sources, empty = [], []
    files = folder.files
    for relative, data in sorted(files.items()):
        if relative == "solution.yaml":
            continue
        if data is None:  # walk_folder reads a link into the folder as the file it leads to: this one leads out
            notes.append(f"{relative}: a link out of the solution's folder; not exported (nor what it names)")
            continue
        try:
            content = data.decode()
        except UnicodeDecodeError:
            notes.append(f"{relative}: not text; FIB embeds text sources only, not exported")
            continue
        if content:
            sources.append(fib.FibSourceFile(path=relative, content=content))
        else:
            empty.append(relative)  # FIB refuses empty sources
    exported = {s.path for s in sources} | set(empty)
    binding = solution.binding or ("torch" if solution.language == "cuda" else None)  # ours builds CUDA with torch
    spec = fib.FibBuildSpec(
        language=solution.language, target_hardware=solution.target_hardware or ["cuda"],
        entry_point=solution.entry_point, dependencies=solution.dependencies,
        destination_passing_style=solution.destination_passing_style, binding=binding,
    )
    ext = fib.SolutionExtension(
        name=solution.name, manifest=files["solution.yaml"].decode(),
        solution_hash=folder.content_hash(), empty_files=empty,
        shared={shared.name: sorted(set(folder_files(shared)) & exported) for shared in folder.shared})
    record = fib.FibSolution(name=fib_name, definition=solution.definition, author=solution.author,
                             description=solution.description, spec=spec, sources=sources, flashbench=ext)
    return record, notes
