"""Finding definitions, workload sets and solution folders in a flashbench repository.

Layout:
    definitions/<op_type>/<name>.{yaml,yml,json}     a definition
    definitions/<op_type>/<name>.workloads.yaml      its workload set
    references/<op_type>/<name>.py                   its reference (named by the definition)
    solutions/<definition>/<solution>/solution.yaml  a solution folder
    solutions/_shared/<name>/                        files solution folders share (their `shared` field)
"""

import difflib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath

from .build import FolderError, files_hash, folder_files, read_file, walk_folder
from .errors import FlashbenchError
from .model import REFERENCE, Definition, Solution, WorkloadSet, load_model, parse_document, parse_model
from .model.solution import SHARED_FOLDER
from .reference import load_reference

DEFINITION_SUFFIXES = (".yaml", ".yml", ".json")
WORKLOADS_SUFFIX = ".workloads.yaml"
ROOT_VARIABLE = "FLASHBENCH_ROOT"


@dataclass(frozen=True)
class DefinitionFile:
    path: Path
    definition: Definition


@dataclass(frozen=True)
class SolutionFolder:
    path: Path
    solution: Solution
    shared: tuple[Path, ...] = ()  # the folders its `shared` field names, in that order

    @property
    def folders(self) -> tuple[Path, ...]:
        """Where its files come from: its own folder, then its shared folders."""
        return (self.path, *self.shared)

    @property
    def files(self) -> dict[str, bytes | None]:
        """Every file the solution has (its bytes: build.folder_files), by the path it has where the solution is
        loaded (one folder holding them all); no path is in two of its folders (load_solution_folder checks)."""
        return {name: data for folder in self.folders for name, data in folder_files(folder).items()}

    @property
    def entry_folder(self) -> Path | None:
        """The folder its entry file is in, its own or a shared one; None when there is none."""
        return next((folder for folder in self.folders if (folder / self.solution.entry_file).is_file()), None)

    def content_hash(self) -> str:
        """The hash its traces and builds are keyed by: every file it loads, shared ones included."""
        return files_hash(self.files)


def use_root(root: Path) -> None:
    """Makes `root` this process's repository for what finds it by itself (find_root: the FP8 quantize reference,
    loaded by path where the inputs are made), as `--root` asks; the run's workers are told it too."""
    os.environ[ROOT_VARIABLE] = str(Path(root).resolve())


def find_root(start: Path | None = None) -> Path:
    """The repository root: $FLASHBENCH_ROOT, else the nearest folder upwards holding definitions/."""
    if os.environ.get(ROOT_VARIABLE):
        return Path(os.environ[ROOT_VARIABLE]).resolve()
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "definitions").is_dir():
            return folder
    raise FlashbenchError(
        f"no definitions/ folder in {here} or above; run inside a flashbench repository or set FLASHBENCH_ROOT"
    )


def is_definition_file(path: Path) -> bool:
    return path.suffix in DEFINITION_SUFFIXES and not path.name.endswith(WORKLOADS_SUFFIX)


def load_definition_file(path: Path, root: Path) -> DefinitionFile:
    """Load and fully check one definition file, its placement and its reference."""
    definition = load_model(Definition, path)
    if path.stem != definition.name:
        raise FlashbenchError(f"name {definition.name!r} differs from the file name {path.stem!r}", path, "name")
    if path.parent.name != definition.op_type:
        raise FlashbenchError(
            f"op_type {definition.op_type!r} differs from its folder {path.parent.name!r}", path, "op_type"
        )
    load_reference(definition, root, path)
    return DefinitionFile(path, definition)


MAX_MANIFEST_BYTES = 64 << 10


def load_solution_folder(path: Path) -> SolutionFolder:
    manifest = path / "solution.yaml"
    if not os.path.lexists(manifest):
        raise FlashbenchError("no solution.yaml in this folder", path)
    solution = parse_model(Solution, parse_document(read_manifest(manifest), manifest, untrusted=True), manifest)
    if solution.name == REFERENCE:  # the runner times the definition's own reference under this name
        raise FlashbenchError(f"the name {REFERENCE!r} is the definition's reference's; a solution may not take it",
                              manifest, "name")
    loaded = SolutionFolder(path, solution, shared_folders(path, solution))
    if loaded.entry_folder is None:
        where = " (nor in its shared folders)" if solution.shared else ""
        raise FlashbenchError(f"entry file {solution.entry_file} does not exist{where}", manifest, "entry_point")
    return loaded


def read_manifest(manifest: Path) -> str:
    """A solution.yaml's text, read as the folder's other files are (build.read_file: a regular file, never
    through a link, never blocking), and at most MAX_MANIFEST_BYTES: it travels whole to the worker, whose
    messages are capped (so YAML aliases, which multiply it once parsed, are refused too)."""
    if manifest.is_symlink():
        raise FlashbenchError("solution.yaml is a link; the manifest must be a file of the folder", manifest)
    try:
        data = read_file(manifest.parent, manifest.name)
    except FolderError as exc:
        raise FlashbenchError(str(exc), manifest) from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise FlashbenchError(f"solution.yaml is {len(data)} bytes; a manifest may have {MAX_MANIFEST_BYTES >> 10} KiB",
                              manifest)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise FlashbenchError("solution.yaml is not UTF-8 text", manifest) from None


def shared_folders(path: Path, solution: Solution) -> tuple[Path, ...]:
    """The folders `solution.shared` names, in solutions/_shared/ beside the solution's definition folder
    (a solution folder sits at solutions/<definition>/<name>/). Checked like the solution's own folder, as
    their code runs as its own: inside solutions/_shared/, no link leading out, and no file at a path that
    the solution folder or another shared folder also has (one would hide the other)."""
    if not solution.shared:
        return ()
    manifest = path / "solution.yaml"
    shared_root = path.parent.parent / SHARED_FOLDER
    owners = {}  # every file's path and every folder's on the way to one: who has it
    _claim(owners, folder_files(path), "the solution folder", manifest)
    found = []
    for name in solution.shared:
        folder = shared_root / name
        _claim(owners, _shared_folder_files(folder, shared_root, manifest), f"{SHARED_FOLDER}/{name}", manifest)
        found.append(folder)
    return tuple(found)


def _claim(owners: dict[str, tuple[str, bool]], files, owner: str, manifest: Path) -> None:
    """Adds a folder's files, and the folders on their way, to `owners`. The folders are copied into one: a path
    that another has (as a file, or a file where the other has a folder) would hide one of the two."""
    mine = {}
    for relative in files:
        mine[relative] = (owner, True)
        for parent in PurePosixPath(relative).parents[:-1]:
            mine.setdefault(parent.as_posix(), (owner, False))
    for relative, (_, is_file) in mine.items():
        other = owners.get(relative)
        if other is not None and (is_file or other[1]):
            raise FlashbenchError(f"{relative} is in {owner} and in {other[0]}; a path may be in one of them only",
                                  manifest, "shared")
    for relative, claim in mine.items():
        owners.setdefault(relative, claim)


def _shared_folder_files(folder: Path, shared_root: Path, manifest: Path) -> list[str]:
    """Its files, once it is found to lie in solutions/_shared/ itself (no link on the way there), with no link
    in it leading out of it, nowhere, or to a folder, and within the limits of a solution folder: the
    same one bounded walk (build.walk_folder)."""
    name = f"{SHARED_FOLDER}/{folder.name}"
    if not folder.is_dir():
        raise FlashbenchError(f"no folder {folder.name!r} in {shared_root}", manifest, "shared")
    inside = Path(os.path.realpath(folder))
    if inside != Path(os.path.realpath(shared_root.parent)) / SHARED_FOLDER / folder.name:
        raise FlashbenchError(f"{name} leads to {inside} through a link; a shared folder must lie in "
                              f"{shared_root} itself", manifest, "shared")
    try:
        walked = list(walk_folder(folder))
    except FolderError as exc:
        raise FlashbenchError(f"{name}: {exc.message}", manifest, "shared") from None
    problem = next((problem for _, _, problem in walked if problem), None)
    if problem:
        raise FlashbenchError(f"{name}/{problem.replace('the solution folder', 'the shared folder')}", manifest,
                              "shared")
    return [relative for relative, _, _ in walked]


def case_twin(folder: Path) -> str | None:
    """The name of an entry beside `folder` that differs from its name only in case, if any: on a
    case-insensitive file system (macOS, Windows) the two are one folder, so a folder put there replaces
    that one, and a clone made there of a repository holding both loses one."""
    if not folder.parent.is_dir():
        return None
    return case_twin_among(folder.name, (entry.name for entry in folder.parent.iterdir()))


def case_twin_among(name: str, names: Iterable[str]) -> str | None:
    """The first of `names` that differs from `name` only in case (names are ASCII: model.definition.FOLDER_NAME)."""
    return next((other for other in names if other != name and other.lower() == name.lower()), None)


# What a board's reader takes for one another in the names' ASCII (`torch_vectorlzed` for `torch_vectorized`):
# characters as written (a capital I for an l; case apart, a lowercase i reads as itself), then letter pairs, then
# separators and their runs.
_LOOK_ALIKE_CHARACTERS = str.maketrans({"I": "l", "1": "l", "O": "o", "0": "o", "-": "_", ".": "_"})
_LOOK_ALIKE_PAIRS = (("rn", "m"), ("vv", "w"), ("cl", "d"))


def look_alike(name: str) -> str:
    """What `name` reads as: the same for two names a reader could take for one another."""
    shape = name.translate(_LOOK_ALIKE_CHARACTERS).lower()
    for pair, single in _LOOK_ALIKE_PAIRS:
        shape = shape.replace(pair, single)
    return re.sub("_+", "_", shape)


def look_alike_among(name: str, names: Iterable[str]) -> str | None:
    """The first of `names`, other than `name`, that a board's reader takes for it (look_alike)."""
    shape = look_alike(name)
    return next((other for other in names if other != name and look_alike(other) == shape), None)


def check_name_is_its_own(by_name: dict[str, SolutionFolder], folder: SolutionFolder) -> None:
    """Boards tell solutions apart by name: a folder from elsewhere that took the name of a repository
    folder or of another folder of the same run (`by_name`, of the same definition) holding other code
    would take that one's row, even with a failed run. A name differing from one of theirs only in case
    is refused too: `submit` would install it over that folder on a case-insensitive file system; and so is
    one a reader takes for one of theirs (look_alike)."""
    name, manifest = folder.solution.name, folder.path / "solution.yaml"
    known = by_name.get(name)
    if known is not None and known.path.resolve() == folder.path.resolve():  # selected by name: itself
        return
    twin = case_twin_among(name, by_name)
    if twin is not None:
        raise FlashbenchError(f"the name {name!r} differs from {twin!r} ({by_name[twin].path}) only in case, and "
                              "on a case-insensitive file system the two are one folder; a solution needs a name of "
                              "its own", manifest, "name")
    alike = look_alike_among(name, by_name)
    if alike is not None:
        raise FlashbenchError(f"the name {name!r} reads as {alike!r} ({by_name[alike].path}) on a board; a solution "
                              "needs a name of its own", manifest, "name")
    if known is not None and known.content_hash() != folder.content_hash():
        raise FlashbenchError(f"the name {name!r} is taken by {known.path}, which holds other code; a solution "
                              "from elsewhere needs a name of its own", manifest, "name")


class Repo:
    """A flashbench repository on disk. Loads lazily; every error names its file."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root).resolve() if root else find_root()

    @cached_property
    def definition_files(self) -> dict[str, DefinitionFile]:
        found: dict[str, DefinitionFile] = {}
        for path in sorted((self.root / "definitions").glob("*/*")):
            if not is_definition_file(path):
                continue
            loaded = load_definition_file(path, self.root)
            name = loaded.definition.name
            if name in found:
                raise FlashbenchError(f"definition {name!r} is also defined in {found[name].path}", path, "name")
            found[name] = loaded
        return found

    def names(self) -> list[str]:
        return sorted(self.definition_files)

    def resolve(self, name: str) -> str:
        """A definition name from an exact name or a unique prefix."""
        names = self.names()
        if name in names:
            return name
        candidates = [n for n in names if n.startswith(name)]
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise FlashbenchError(f"{name!r} is ambiguous; it matches: {', '.join(candidates)}")
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.3) or names
        raise FlashbenchError(f"no definition named {name!r}; known: {', '.join(close) or 'none'}")

    def definition(self, name: str) -> Definition:
        return self.definition_files[self.resolve(name)].definition

    def definition_path(self, name: str) -> Path:
        return self.definition_files[self.resolve(name)].path

    def reference(self, name: str):
        entry = self.definition_files[self.resolve(name)]
        return load_reference(entry.definition, self.root, entry.path)

    def workloads_path(self, name: str) -> Path:
        path = self.definition_path(name)
        return path.with_name(path.stem + WORKLOADS_SUFFIX)

    def workload_set(self, name: str) -> WorkloadSet | None:
        path = self.workloads_path(name)
        if not path.is_file():
            return None
        workload_set = load_model(WorkloadSet, path)
        if workload_set.definition != self.resolve(name):
            raise FlashbenchError(
                f"names {workload_set.definition!r} but sits next to {self.resolve(name)!r}", path, "definition"
            )
        return workload_set

    def solution_folders(self, name: str) -> list[SolutionFolder]:
        """The definition's valid solution folders. One that is not valid is left out, never the end of
        the others (invalid_solution_folders says why): one bad folder of a shared repository stopped every
        run of its definition."""
        return self._solution_folders(name)[0]

    def invalid_solution_folders(self, name: str) -> list[FlashbenchError]:
        """Why each folder under solutions/<definition>/ that solution_folders leaves out is not valid."""
        return self._solution_folders(name)[1]

    def _solution_folders(self, name: str) -> tuple[list[SolutionFolder], list[FlashbenchError]]:
        definition = self.resolve(name)
        found, problems = [], []
        for manifest in sorted((self.root / "solutions" / definition).glob("*/solution.yaml")):
            try:
                loaded = load_solution_folder(manifest.parent)
            except FlashbenchError as problem:
                problems.append(problem)
                continue
            if loaded.solution.definition != definition:
                problems.append(FlashbenchError(
                    f"names definition {loaded.solution.definition!r} but sits under solutions/{definition}/",
                    manifest, "definition"))
                continue
            found.append(loaded)
        return found, problems
