"""What a run does: which solutions on which workloads, as jobs."""

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..build import content_hash
from ..errors import FlashbenchError
from ..model import REFERENCE, Definition, Solution, Workload
from ..registry import Repo, SolutionFolder, load_solution_folder


@dataclass
class Candidate:
    folder: Path
    solution: Solution
    hash: str


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
        return [w for w in workloads if "smoke" in w.tags] if device == "cpu" else workloads
    chosen = []
    for selector in selectors:
        matched = [w for w in workloads if w.uuid.startswith(selector) or w.name == selector or selector in w.tags]
        if not matched:
            known = ", ".join(sorted({w.name for w in workloads} | {t for w in workloads for t in w.tags}))
            raise FlashbenchError(f"no workload matches {selector!r}; names and tags: {known}")
        chosen += [w for w in matched if w not in chosen]
    return chosen


def select_solutions(repo: Repo, definition: str, selectors: list[str]) -> list[SolutionFolder]:
    """By name (a folder under solutions/<definition>/) or path; with none given, all of the definition.
    The name 'reference' selects nothing more: the reference runs with every selection."""
    if not selectors:
        return repo.solution_folders(definition)
    by_name = {f.solution.name: f for f in repo.solution_folders(definition)}
    chosen = []
    for selector in selectors:
        if selector == REFERENCE:
            continue
        if Path(selector).is_dir():
            chosen.append(load_solution_folder(Path(selector).resolve()))
        elif selector in by_name:
            chosen.append(by_name[selector])
        else:
            raise FlashbenchError(f"no solution {selector!r} for {definition}; known: {', '.join(by_name) or 'none'}")
    for folder in chosen:
        if folder.solution.definition != definition:
            raise FlashbenchError(f"solves {folder.solution.definition!r}, not {definition!r}", folder.path / "solution.yaml", "definition")
    return chosen


def candidates(repo: Repo, definition: Definition, folders: list[SolutionFolder], cache_dir: Path) -> list[Candidate]:
    """The reference first, then the folders, each keyed by the hash of its content."""
    return [reference_candidate(repo, definition, cache_dir)] + [
        Candidate(f.path, f.solution, content_hash(f.path)) for f in folders]


def reference_candidate(repo: Repo, definition: Definition, cache_dir: Path) -> Candidate:
    """The reference as a solution folder of its own, so it is timed exactly like the others."""
    entry = repo.definition_files[definition.name]
    source = (repo.root / definition.reference).read_text() if definition.reference_is_path else definition.reference
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = cache_dir / "reference-solutions" / definition.name / digest
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "reference.py").write_text(source)
    solution = Solution(
        name=REFERENCE, definition=definition.name, author="flashbench", language="python",
        description=f"the reference of {entry.path.name}", entry_point="reference.py::run",
        destination_passing_style=False, dependencies=["torch"], tags=[REFERENCE],
    )
    return Candidate(folder, solution, digest)


def install_solution(repo: Repo, folder: Path) -> Path:
    """Copy a solution folder to solutions/<definition>/<name>/ (after it passed its checks)."""
    loaded = load_solution_folder(folder)
    target = repo.root / "solutions" / loaded.solution.definition / loaded.solution.name
    if target.resolve() == folder.resolve():
        return target
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target
