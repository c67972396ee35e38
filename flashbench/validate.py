"""`flashbench validate`: check definitions, workload sets and solution folders without running them."""

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .build import FolderError, folder_problem, read_file
from .errors import FlashbenchError
from .model import Solution, Workload, WorkloadSet, read_document
from .model.loading import parse_records
from .registry import (WORKLOADS_SUFFIX, Repo, check_name_is_its_own, is_definition_file, load_definition_file,
                       load_solution_folder)
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
    for target in targets:
        for path, kind in _discover(Path(target)):
            results.append(_check(repo, path, kind))
    return results


def _discover(target: Path):
    if not target.exists():
        raise FlashbenchError("no such file or folder", target)
    if target.is_dir() and (target / "solution.yaml").exists():  # a manifest that is no file is refused when read
        yield target, "solution"
        return
    if not target.is_dir():
        if target.name == "solution.yaml":
            yield target.parent, "solution"
        elif target.name.endswith(WORKLOADS_SUFFIX):
            yield target, "workloads"
        elif is_definition_file(target):
            yield target, "definition"
        return
    for child in sorted(target.iterdir()):
        if child.is_symlink() and child.is_dir():  # a link to a folder above it made the walk endless
            continue
        if child.is_dir() or child.name == "solution.yaml" or is_definition_file(child) or child.name.endswith(WORKLOADS_SUFFIX):
            yield from _discover(child)


def _check(repo: Repo, path: Path, kind: str) -> Checked:
    try:
        if kind == "workloads":
            return Checked(path, kind, tuple(map(str, _check_workloads(repo, path))))
        {"definition": _check_definition, "solution": _check_solution}[kind](repo, path)
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


def _check_solution(repo: Repo, path: Path) -> None:
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
    others = {f.solution.name: f for f in repo.solution_folders(definition.name) if f.path.resolve() != path.resolve()}
    check_name_is_its_own(others, folder)
    if solution.language != "cuda":
        expected = expected_parameters(definition, solution)
        check_signature_statically(folder.entry_path, solution.entry_function, expected, manifest)


def expected_parameters(definition, solution: Solution) -> list[str]:
    names = list(definition.inputs)
    return names + list(definition.outputs) if solution.destination_passing_style else names


def check_signature_statically(source: Path, function: str, expected: list[str], manifest: Path) -> None:
    """Find `def function(...)` at the top level of `source` without importing (it is untrusted code: read as
    the judge reads a folder's files, never through a link nor past the size limit, and a source the parser
    cannot hold, one of 100 KB of nested operators, say, is an error, not a crash)."""
    try:
        text = read_file(source)
    except FolderError as exc:
        raise FlashbenchError(exc.message, manifest, "entry_point") from None
    check_source_statically(text, source.name, function, expected, manifest, "entry_point")


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
