"""Building a solution folder into a callable: Python/Triton by import, CUDA through torch's extension builder.

Runs inside the worker process only: importing a solution executes untrusted code.
"""

import hashlib
import importlib.util
import sys
from pathlib import Path, PurePosixPath
from typing import Callable, Mapping

from .model import Solution

CACHE_DIR_NAME = ".flashbench-cache"


class BuildError(Exception):
    """The solution's sources failed to compile or import."""


def content_hash(folder: Path) -> str:
    """A hash of every file's path and bytes, documentation left out (*.md, and docs/ at the top of the folder):
    results and builds are keyed by it, so editing notes does not make a solution's results stale. A solution
    with shared folders is hashed over all its files (registry.SolutionFolder.content_hash); the folder its
    worker loads holds them all (and nothing else: run/plan.py stage_solution), so this hash of that folder is
    the same."""
    return files_hash(folder_files(folder))


def folder_files(folder: Path) -> dict[str, Path]:
    """Every file under `folder` (links followed, __pycache__ left out), by its path relative to it."""
    found = {}
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if path.is_file() and "__pycache__" not in relative.parts:
            found[relative.as_posix()] = path
    return found


def files_hash(files: Mapping[str, Path]) -> str:
    """content_hash of the files a solution loads, by the relative path each has where it is loaded."""
    digest = hashlib.sha256()
    for relative in sorted(files, key=lambda name: PurePosixPath(name).parts):
        if not is_documentation(relative):
            digest.update(relative.encode() + b"\0" + files[relative].read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def is_documentation(relative: str) -> bool:
    path = PurePosixPath(relative)
    return path.suffix == ".md" or path.parts[0] == "docs"


def folder_problem(folder: Path, solution: Solution) -> str | None:
    """Why a folder cannot be run as it is: everything loaded from it must lie inside it (no link
    leading out), so the content hash covers all the code that runs."""
    root = folder.resolve()
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() and not path.resolve().is_relative_to(root):
            return f"{path.relative_to(folder)} is a link to {path.resolve()}, outside the solution folder"
    for name in [solution.entry_file, *solution.sources]:
        if not (folder / name).resolve().is_relative_to(root):
            return f"{name} resolves outside the solution folder"
        if not (folder / name).is_file():
            return f"{name} does not exist in the solution folder"
    return None


def missing_dependencies(solution: Solution) -> list[str]:
    """Declared packages that cannot be imported here (found without importing them)."""
    missing = []
    for dependency in solution.dependencies:
        name = dependency.split("==")[0].split(">=")[0].strip().replace("-", "_")
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(dependency)
        except (ImportError, ValueError):
            missing.append(dependency)
    return missing


def load_entry_point(folder: Path, solution: Solution, cache_dir: Path) -> Callable:
    if solution.language == "cuda":
        module = _build_cuda(folder, solution, cache_dir)
    else:
        module = _import_python(folder, solution)
    function = getattr(module, solution.entry_function, None)
    if not callable(function):
        raise BuildError(f"{solution.entry_file} has no function {solution.entry_function!r}")
    return function


def _import_python(folder: Path, solution: Solution):
    sys.path.insert(0, str(folder))  # lets a solution import its sibling files
    name = f"flashbench_solution_{content_hash(folder)}"
    spec = importlib.util.spec_from_file_location(name, folder / solution.entry_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        raise BuildError(f"{solution.entry_file} calls sys.exit({exc.code!r}) at import") from None
    except Exception as exc:
        raise BuildError(f"importing {solution.entry_file} failed: {exc!r}") from exc
    return module


def _build_cuda(folder: Path, solution: Solution, cache_dir: Path):
    from torch.utils.cpp_extension import load

    sources = [folder / s for s in solution.sources] or sorted(
        p for p in folder.iterdir() if p.suffix in (".cu", ".cpp", ".cc")
    )
    name = f"flashbench_cuda_{content_hash(folder)}"
    build_dir = cache_dir / "build" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return load(
            name=name, sources=[str(s) for s in sources], build_directory=str(build_dir),
            extra_cuda_cflags=list(solution.compile_flags), verbose=True,
        )
    except Exception as exc:
        raise BuildError(f"building {', '.join(s.name for s in sources)} failed: {exc}") from exc
