"""`flashbench validate`: check definitions, workload sets and solution folders without running them."""

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .build import FolderError, folder_problem, read_file
from .errors import FlashbenchError
from .model import Solution, Workload, WorkloadSet, read_document
from .model.loading import parse_records
from .registry import (WORKLOADS_SUFFIX, Repo, SolutionFolder, check_name_is_its_own, is_definition_file,
                       load_definition_file, load_solution_folder)
from .workloads import workload_problem


@dataclass(frozen=True)
class Checked:
    path: Path
    kind: str  # definition | workloads | solution
    errors: tuple[str, ...] = ()  # a line each: a workload set has one per invalid workload

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def error(self) -> str | None:
        """Every problem, a line each; None when valid."""
        return "\n".join(self.errors) or None


def validate(repo: Repo, paths: list[Path] | None = None) -> list[Checked]:
    """Check each path (a file or a folder, searched recursively); the whole repo when none is given."""
    targets = paths or [p for p in (repo.root / "definitions", repo.root / "solutions") if p.is_dir()]
    results = []
    folders = _DefinitionFolders(repo)
    for target in targets:
        for path, kind in _discover(Path(target)):
            results.append(_check(repo, path, kind, folders))
    return results


def _discover(target: Path) -> Iterator[tuple[Path, str]]:
    """What lies under `target`, depth first in name order, without recursion (1,500 nested folders under
    solutions/_shared/ ended `validate` in a RecursionError); a folder that cannot be listed is one line."""
    if not target.exists():
        raise FlashbenchError("no such file or folder", target)
    pending = [target]
    while pending:
        path = pending.pop()
        try:
            if path.is_dir() and (path / "solution.yaml").exists():  # a manifest that is no file is refused when read
                yield path, "solution"
            elif not path.is_dir():
                found = _kind_of_file(path)
                if found:
                    yield found
            else:
                # a link to a folder above it made the walk endless
                children = [child for child in sorted(path.iterdir()) if not (child.is_symlink() and child.is_dir())]
                pending.extend(reversed([child for child in children if child.is_dir() or _kind_of_file(child)]))
        except OSError as exc:
            raise FlashbenchError(f"cannot be read: {exc.strerror}", path) from None


def _kind_of_file(path: Path) -> tuple[Path, str] | None:
    if path.name == "solution.yaml":
        return path.parent, "solution"
    if path.name.endswith(WORKLOADS_SUFFIX):
        return path, "workloads"
    if is_definition_file(path):
        return path, "definition"
    return None


class _DefinitionFolders:
    """A definition's solution folders by their real paths, loaded once for a whole `validate` (once per folder
    made validating a repository quadratic in its folders)."""

    def __init__(self, repo: Repo):
        self.repo = repo
        self.loaded: dict[str, dict[Path, SolutionFolder]] = {}

    def others(self, definition: str, path: Path) -> dict[str, SolutionFolder]:
        """The definition's folders but the one at `path`, by solution name."""
        if definition not in self.loaded:
            self.loaded[definition] = {f.path.resolve(): f for f in self.repo.solution_folders(definition)}
        itself = path.resolve()
        return {f.solution.name: f for where, f in self.loaded[definition].items() if where != itself}


def _check(repo: Repo, path: Path, kind: str, folders: _DefinitionFolders) -> Checked:
    try:
        if kind == "workloads":
            return Checked(path, kind, tuple(map(str, _check_workloads(repo, path))))
        if kind == "solution":
            _check_solution(repo, path, folders)
        else:
            _check_definition(repo, path)
    except FlashbenchError as exc:
        return Checked(path, kind, (str(exc),))
    return Checked(path, kind)


def _check_definition(repo: Repo, path: Path) -> None:
    load_definition_file(path, repo.root)


def _check_workloads(repo: Repo, path: Path) -> list[FlashbenchError]:
    """Every invalid workload of the file, each named (one fixing the file sees them all at once); a problem
    of the file itself raises. Every valid workload's inputs are generated (shapes only, indices for real)
    and bound to the definition."""
    data = read_document(path)
    workload_set, invalid = parse_records(WorkloadSet, data, path, "workloads")
    expected = path.name.removesuffix(WORKLOADS_SUFFIX)
    named = data["definition"]  # valid: only records can be invalid here
    if named != expected:
        raise FlashbenchError(f"names {named!r} but sits next to {expected!r}", path, "definition")
    definition = repo.definition(expected)
    problems = []
    for i, record in enumerate(data["workloads"]):
        if i in invalid:
            problems.append(FlashbenchError(invalid[i].message, path, ": ".join(
                part for part in (f"workloads[{i}]", invalid[i].field) if part)))
            continue
        workload = workload_set.workloads[i] if workload_set else Workload.model_validate(record)
        problem = workload_problem(definition, workload, path.parent)
        if problem:
            problems.append(FlashbenchError(problem, path, f"workloads[{i}] ({workload.label})"))
    return problems


def _check_solution(repo: Repo, path: Path, folders: _DefinitionFolders) -> None:
    folder = load_solution_folder(path)
    solution = folder.solution
    manifest = path / "solution.yaml"
    # what run refuses before a worker starts, and submit before it installs (a link out of a document too)
    problem = folder_problem(path, solution, folder.shared)
    if problem:
        raise FlashbenchError(problem, path)
    try:
        definition = repo.definition(solution.definition)
    except FlashbenchError as exc:
        raise FlashbenchError(exc.message, manifest, "definition") from None
    if definition.name != solution.definition:
        raise FlashbenchError(f"use the full name {definition.name!r}", manifest, "definition")
    if path.parent.parent == repo.root / "solutions" and path.parent.name != definition.name:
        raise FlashbenchError(
            f"names definition {definition.name!r} but sits under solutions/{path.parent.name}/", manifest, "definition"
        )
    # a name a run refuses: the definition's other folders' (their names, or what a board's reader takes for them)
    check_name_is_its_own(folders.others(definition.name, path), folder)
    if solution.language != "cuda":
        expected = expected_parameters(definition, solution)
        check_signature_statically(folder.entry_folder, solution.entry_file, solution.entry_function, expected,
                                   manifest)


def expected_parameters(definition, solution: Solution) -> list[str]:
    names = list(definition.inputs)
    return names + list(definition.outputs) if solution.destination_passing_style else names


def check_signature_statically(folder: Path, source: str, function: str, expected: list[str], manifest: Path) -> None:
    """Find `def function(...)` at the top level of `source` (a path in `folder`) without importing (it is untrusted
    code: read as the judge reads a folder's files, never through a link nor past the size limit, and a source the
    parser cannot hold, one of 100 KB of nested operators, say, is an error, not a crash)."""
    try:
        text = read_file(folder, source)
    except FolderError as exc:
        raise FlashbenchError(exc.message, manifest, "entry_point") from None
    check_source_statically(text, PurePosixPath(source).name, function, expected, manifest, "entry_point")


def check_source_statically(text: str | bytes, label: str, function: str, expected: list[str], where: object,
                            field: str) -> None:
    """check_signature_statically on a source in hand (`label` names it in errors): an imported definition's
    reference is checked this way, never run."""
    try:
        tree = ast.parse(text, filename=label)
    except SyntaxError as exc:
        raise FlashbenchError(f"{label} line {exc.lineno}: {exc.msg}", where, field) from None
    except (ValueError, MemoryError, RecursionError) as exc:
        raise FlashbenchError(f"{label} cannot be parsed: {type(exc).__name__}", where, field) from None
    rebound = False
    for node in _module_level(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            # `from impl import *` may bind it too: which names it binds, only the import can tell
            rebound |= any((alias.asname or alias.name.split(".")[0]) in (function, "*") for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            # a name, or one unpacked from a tuple (`run, run_sink = make()`)
            rebound |= any(isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store) and t.id == function
                           for target in targets for t in ast.walk(target))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            args = node.args
            if args.vararg or args.kwarg:
                return
            names = [a.arg for a in args.posonlyargs + args.args]
            # Called by position: the names guard the order; more parameters are fine where they have defaults.
            required = len(names) - len(args.defaults)
            if names[:len(expected)] != expected or required > len(expected) or None in args.kw_defaults:
                raise FlashbenchError(
                    f"{function} takes ({', '.join(names)}) but must take ({', '.join(expected)}), in that order "
                    f"(more parameters only with defaults)", where, field,
                )
            return
    if rebound:  # `from impl import run`, `run = torch.compile(f)`: a callable the import alone can tell
        return
    raise FlashbenchError(f"{label} defines no top-level function {function!r}", where, field)


def _module_level(body: list) -> Iterator:
    """The statements that run at import, the bodies of top-level if / try / with blocks included (a `def run`
    chosen by an optional import is as top-level as any)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            yield from _module_level(node.body)
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)
            for extra in ("orelse", "finalbody"):
                yield from _module_level(getattr(node, extra, []))
