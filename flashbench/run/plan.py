"""What a run does: which solutions on which workloads, as jobs."""

import contextlib
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..build import (CACHE_DIR_NAME, HASH_LENGTH, FolderError, content_hash, is_documentation, open_below,
                     walk_folder, write_whole)
from ..errors import FlashbenchError
from ..model import REFERENCE, Definition, Solution, Workload
from ..model.solution import SHARED_FOLDER
from ..reference import reference_source
from ..registry import Repo, SolutionFolder, case_twin, check_name_is_its_own, load_solution_folder
from ..workloads import workload_problem
from .judge.evaluators import reference_sampler_source


@dataclass
class Candidate:
    folder: Path
    solution: Solution
    hash: str
    problem: str | None = None  # why its folder could not be read and staged: then it runs no job (INVALID_SOLUTION)
    sources: tuple[Path, ...] = ()  # the folders `folder` was staged from: hidden from its worker (notes and all)


@dataclass
class Job:
    """One (candidate, workload) pair: what a device times, one at a time."""

    index: int
    candidate: Candidate
    workload: Workload


def select_workloads(repo: Repo, definition: str, selectors: list[str], device: str) -> list[Workload]:
    """By uuid, uuid prefix, name or tag; with none given, all (only 'smoke' ones on a CPU)."""
    workload_set = repo.workload_set(definition)
    if workload_set is None:
        raise FlashbenchError(f"no workloads; add {repo.workloads_path(definition).relative_to(repo.root)}")
    workloads = workload_set.workloads
    if not selectors:
        chosen = [w for w in workloads if "smoke" in w.tags] if device == "cpu" else workloads
        if not chosen:  # a run of nothing would look like a run that passed
            raise FlashbenchError(f"no workload of {definition} is tagged smoke, the default on a CPU; name some "
                                  "with --workload (names, uuids or tags)" if workloads else f"{definition} has no workloads")
        return chosen
    chosen = []
    for selector in selectors:
        if not selector.strip():  # every uuid starts with "": an unset variable selected every workload
            raise FlashbenchError("an empty workload selector selects nothing; give a name, uuid (or its start) or tag")
        matched = [w for w in workloads if w.uuid.startswith(selector) or w.name == selector or selector in w.tags]
        if not matched:
            known = ", ".join(sorted({w.name for w in workloads} | {t for w in workloads for t in w.tags}))
            raise FlashbenchError(f"no workload matches {selector!r}; names and tags: {known}")
        chosen += [w for w in matched if w not in chosen]
    return chosen


def refuse_invalid_workloads(repo: Repo, definition: Definition, workloads: list[Workload], device: str) -> None:
    """A workload `validate` refuses, or one input set of which `device` cannot hold, is refused before any pair
    runs: its pairs would fail every solution, the reference's too, and the judge drawing a set past memory would be
    killed, the whole run lost. (Its index structure is made to check it: up to a second for the largest.)"""
    path = repo.workloads_path(definition.name)
    for workload in workloads:
        problem = workload_problem(definition, workload, path.parent, device)
        if problem:
            raise FlashbenchError(problem, path, f"workload {workload.label}")


def select_solutions(repo: Repo, definition: str, selectors: list[str], cache_dir: Path | None = None) -> list[SolutionFolder]:
    """By name (a folder under solutions/<definition>/), folder path, or the path of a FlashInfer-Bench
    solution JSON (made into a folder under the cache); with none given, all of the definition. The
    name 'reference' selects nothing more: the reference runs with every selection."""
    if not selectors:
        return repo.solution_folders(definition)
    by_name = {f.solution.name: f for f in repo.solution_folders(definition)}
    chosen = []
    for selector in selectors:
        if selector == REFERENCE:
            continue
        if Path(selector).is_dir():
            chosen.append(load_solution_folder(Path(selector).resolve()))
        elif selector.endswith(".json") and Path(selector).is_file():
            from ..interop import solution_from_fib_json
            made = solution_from_fib_json(Path(selector), (cache_dir or repo.root / CACHE_DIR_NAME) / "fib-solutions")
            chosen.append(load_solution_folder(made))
        elif selector in by_name:
            chosen.append(by_name[selector])
        else:
            raise FlashbenchError(f"no solution {selector!r} for {definition}; known: {', '.join(by_name) or 'none'}")
    chosen = list({folder.path.resolve(): folder for folder in chosen}.values())  # one folder named twice: run once
    taken = dict(by_name)  # the repository's folders, then each chosen one: two names alike are one board row
    for folder in chosen:
        manifest = folder.path / "solution.yaml"
        if folder.solution.definition != definition:
            raise FlashbenchError(f"solves {folder.solution.definition!r}, not {definition!r}", manifest, "definition")
        check_name_is_its_own(taken, folder)
        taken.setdefault(folder.solution.name, folder)
    return chosen


def candidates(repo: Repo, definition: Definition, folders: list[SolutionFolder], cache_dir: Path) -> list[Candidate]:
    """The reference first, then the folders, each keyed by the hash of its content. A cache that cannot be
    written (a full disk, a file where its folder should be) ends the run with one line."""
    try:
        return [reference_candidate(repo, definition, cache_dir)] + [_candidate(f, cache_dir) for f in folders]
    except OSError as exc:
        raise FlashbenchError(f"cannot write the cache: {exc.strerror}", exc.filename or cache_dir) from None


def _candidate(folder: SolutionFolder, cache_dir: Path) -> Candidate:
    """solution_candidate, or for a folder the judge will not read (build.walk_folder) a candidate that carries
    why: it gets INVALID_SOLUTION and the run goes on with the others. Its hash stands for the folder's name
    and problem, so --resume keeps its trace until either changes."""
    try:
        return solution_candidate(folder, cache_dir)
    except FolderError as exc:
        digest = hashlib.sha256(f"{folder.solution.name}\0{exc.message}".encode()).hexdigest()[:HASH_LENGTH]
        return Candidate(folder.path, folder.solution, digest, problem=exc.message)


def solution_candidate(folder: SolutionFolder, cache_dir: Path) -> Candidate:
    """A solution folder as its worker loads it: the folder stage_solution makes of exactly the files
    its content hash covers, so no code the hash leaves out (compiled bytecode, files posing as
    documentation) can run."""
    loaded = stage_solution(folder, cache_dir / "solutions")
    return Candidate(loaded, folder.solution, loaded.name, sources=folder.folders)  # staged under its content hash


def stage_solution(folder: SolutionFolder, into: Path) -> Path:
    """Copies every file of the solution, its shared folders' included, into one folder, into/<content
    hash>, and returns it: the sandbox lets the worker read that folder alone, and imports and #includes
    find the files side by side, at the paths they are hashed by. A folder staged before is used again
    while it holds the same files, byte for byte. FolderError for a folder the judge will not read;
    the staging folder is removed whatever happens."""
    into.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=into))
    try:
        staging.chmod(0o755)  # as any folder the runner makes, not mkdtemp's owner-only mode
        for source in folder.folders:
            _copy_into(source, staging)
        target = into / content_hash(staging)
        if _holds_the_same(target, staging):
            return target
        shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not _holds_the_same(target, staging):  # else another run staged the same content meanwhile
                raise
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once renamed


def _holds_the_same(target: Path, staging: Path) -> bool:
    """A folder staged before holds the same files, byte for byte, as the one staged now: its name, a hash,
    is not taken on trust (two folders made to share a hash would run each other's code)."""
    return target.is_dir() and _snapshot(target) == _snapshot(staging)


def _snapshot(folder: Path) -> dict[str, tuple[str, bytes | str]]:
    """Every file of a staged folder by relative path: its bytes, or where a link leads."""
    found = {}
    for root, directories, files in os.walk(folder):
        for name in files + [d for d in directories if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            found[relative] = ("link", os.readlink(path)) if os.path.islink(path) else ("file", Path(path).read_bytes())
    return found


def _copy_into(source: Path, staging: Path, documentation: bool = False) -> None:
    """The files of `source` that the content hash covers (no __pycache__, no documentation unless asked
    for), as build.walk_folder read them, within its limits. FolderError for a link walk_folder refuses:
    the folder is refused before anything of it is staged."""
    staging.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        top = open_below(None, [staging], held)  # opened once; what lies below it, by descriptor for each file
        for relative, data, problem in walk_folder(source):
            if is_documentation(relative) and not documentation:
                continue
            if problem:
                raise FolderError(problem)
            _write_new(top, staging, relative, data)


def _write_new(top: int, root: Path, relative: str, data: bytes) -> None:
    """`data` as a new file at `relative` under `root`, in folders made here: never through a link or over a
    file already there. Staging copies several folders into one (a solution's and its shared ones'); a link
    one of them brought, with a file of another under its name, let the runner write that file wherever the
    link led (a .pth in site-packages, run by every later interpreter). `root` is open as `top`."""
    *folders, name = PurePosixPath(relative).parts
    with contextlib.ExitStack() as held:
        try:
            folder = open_below(top, folders, held, made=[])
            descriptor = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=folder)
        except NotADirectoryError as exc:  # a link on the way too: O_NOFOLLOW with O_DIRECTORY
            raise FolderError(f"{relative}: {exc.filename} is a file in another of its folders; a path may be in "
                              "one of them only") from None
        except FileExistsError:
            raise FolderError(f"{relative} is in two of its folders; a path may be in one of them only") from None
        except OSError as exc:  # a full disk, say: named by its path, for the run's "cannot write the cache"
            exc.filename = str(root / relative)
            raise
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def reference_candidate(repo: Repo, definition: Definition, cache_dir: Path) -> Candidate:
    """The reference as a solution folder of its own, so it is timed exactly like the others."""
    entry = repo.definition_files[definition.name]
    source = reference_source(definition, repo.root)
    if definition.evaluator.kind == "sampling":  # its reference returns distributions: as a candidate it samples them
        source += reference_sampler_source(definition)
    digest = hashlib.sha256(source.encode()).hexdigest()[:HASH_LENGTH]
    folder = cache_dir / "reference-solutions" / definition.name / digest
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "reference.py"
    if not target.is_file() or target.read_text() != source:  # named by its digest: the same text once written
        write_whole(target, source.encode())  # another run may load it now
    solution = Solution(
        name=REFERENCE, definition=definition.name, author="flashbench", language="python",
        description=f"the reference of {entry.path.name}", entry_point="reference.py::run",
        destination_passing_style=False, dependencies=["torch"], tags=[REFERENCE],
    )
    return Candidate(folder, solution, digest)


def installed_path(repo: Repo, folder: SolutionFolder) -> Path:
    """Where `submit` installs a solution folder."""
    return repo.root / "solutions" / folder.solution.definition / folder.solution.name


def install_solution(repo: Repo, folder: Path, ran_hash: str | None = None) -> Path:
    """Copy a solution folder to solutions/<definition>/<name>/ (after it passed its checks), with
    the shared folders it names that the repository lacks. With `ran_hash`, the content hash of what
    ran: the copy must hold that content, or nothing is installed (the folder changed after it ran). A
    folder the repository holds already is never replaced: with the same code it is left as it is, notes
    included (the hash leaves notes out, so a copy of another author's code replaced their notes), and
    one with other code is refused."""
    loaded = load_solution_folder(folder)
    target = installed_path(repo, loaded)
    if target.resolve() == folder.resolve():
        return target
    _check_no_case_twin(target, loaded.path / "solution.yaml", "name")
    for source in loaded.folders:
        _check_no_refused_link(source, loaded.path / "solution.yaml")
    if target.exists():  # before anything is copied: nothing is installed beside a folder left as it is
        held, now = load_solution_folder(target).content_hash(), loaded.content_hash()
        if ran_hash is not None and now != ran_hash:
            raise FlashbenchError(_changed_after_it_ran(ran_hash, now), folder)
        if held != now:
            raise FlashbenchError(f"the name {loaded.solution.name!r} is taken by {target}, which holds other code; "
                                  "not submitted", loaded.path / "solution.yaml", "name")
        return target
    shared = _shared_to_install(repo, loaded)
    for source, shared_target in shared:
        _copy_into(source, shared_target, documentation=True)
    incoming = target.with_name(f".{target.name}.incoming")  # beside the target: its shared folders resolve alike
    if incoming.exists():
        shutil.rmtree(incoming)
    _copy_into(folder, incoming, documentation=True)
    installed_hash = load_solution_folder(incoming).content_hash()
    try:
        if ran_hash is not None and installed_hash != ran_hash:
            raise FlashbenchError(_changed_after_it_ran(ran_hash, installed_hash), folder)
        try:
            incoming.rename(target)  # fails where a folder of that name appeared meanwhile
        except OSError as exc:
            raise FlashbenchError(f"cannot install it as {target}: {exc.strerror}; not submitted", folder) from None
    except FlashbenchError:
        for path in [incoming, *(shared_target for _, shared_target in shared)]:  # nothing installed by halves
            shutil.rmtree(path)
        raise
    return target


def _changed_after_it_ran(ran_hash: str, now: str) -> str:
    return f"its files changed after they ran ({ran_hash} ran, {now} now): not submitted"


def _check_no_refused_link(folder: Path, manifest: Path) -> None:
    """Every file, documentation included, before anything is copied: documentation is never staged, so a link
    there leading out passed the run, and `submit` installed links to /etc/passwd and /root in solutions/."""
    for _, _, problem in walk_folder(folder):
        if problem:
            raise FlashbenchError(f"{problem}; not submitted", manifest)


def _shared_to_install(repo: Repo, loaded: SolutionFolder) -> list[tuple[Path, Path]]:
    """(shared folder, where it goes) for each one the repository lacks. One it has must hold the same
    content, or the installed solution would load other code than the one that passed; all are checked
    before anything is copied."""
    missing = []
    for shared in loaded.shared:
        target = repo.root / "solutions" / SHARED_FOLDER / shared.name
        _check_no_case_twin(target, loaded.path / "solution.yaml", "shared")
        if not target.exists():
            missing.append((shared, target))
        elif target.resolve() != shared.resolve() and content_hash(target) != content_hash(shared):
            raise FlashbenchError(f"{SHARED_FOLDER}/{shared.name} differs from {target}; give the changed copy a "
                                  "name of its own", loaded.path / "solution.yaml", "shared")
    return missing


def _check_no_case_twin(target: Path, manifest: Path, field: str) -> None:
    """Installing at `target` beside a folder whose name differs only in case would replace that folder on a
    case-insensitive file system (registry.case_twin)."""
    twin = case_twin(target)
    if twin is not None:
        raise FlashbenchError(f"{target.name!r} differs from {twin!r} in {target.parent} only in case, and on a "
                              "case-insensitive file system the two are one folder; give it a name of its own",
                              manifest, field)
