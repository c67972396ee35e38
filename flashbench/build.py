"""Building a solution folder into a callable: Python/Triton by import, CUDA through torch's extension builder;
and reading solution folders.

Importing a solution executes untrusted code: load_entry_point runs inside the worker process only. The rest
(walking, hashing and checking a folder, its dependencies and the CUDA toolchain) also runs in the judge, and
never imports or executes anything a solution names.
"""

import contextlib
import errno
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import stat
import sys
import tempfile
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Mapping, Sequence

from .errors import FlashbenchError, shortened
from .model import Solution
from .model.solution import dependency_name

CACHE_DIR_NAME = ".flashbench-cache"

# What the judge reads of one solution folder at most (the largest in solutions/ holds 4 files, 52 KB):
# a folder past them is refused, not read, so no folder can hang or fill the runner's disk.
MAX_ENTRIES = 5_000  # files, folders and links
MAX_FILE_BYTES = 32 << 20
MAX_TOTAL_BYTES = 128 << 20
# Paths within a folder: the judge copies a folder under its cache (a deeper, longer prefix) and walks copies
# with the standard library's recursive functions; 1,500 nested folders ended a run in a RecursionError, a path
# of 4,091 bytes in ENAMETOOLONG once under the cache.
MAX_DEPTH = 32  # names in one relative path
MAX_PATH_BYTES = 1024  # of one relative path


class BuildError(Exception):
    """The solution's sources failed to compile or import."""


class FolderError(FlashbenchError):
    """A solution folder the judge will not read: a name that is not printable UTF-8, something other than
    files, folders and links, or more than the limits above."""


def content_hash(folder: Path) -> str:
    """A hash of every file's path and bytes, documentation left out (*.md, and docs/ at the top of the folder):
    results and builds are keyed by it, so editing notes does not make a solution's results stale. A solution
    with shared folders is hashed over all its files (registry.SolutionFolder.content_hash); the folder its
    worker loads holds them all (and nothing else: run/plan.py stage_solution), so this hash of that folder is
    the same."""
    return files_hash(folder_files(folder))


def folder_files(folder: Path) -> dict[str, bytes | None]:
    """Every file under `folder` (__pycache__ left out) by its path relative to it: its bytes as walk_folder read
    them, or None for a link it refuses to follow."""
    return {relative: data for relative, data, _ in walk_folder(folder)}


# A folder opened without following a link at its name. Below the folder walked, every name is opened so, from its
# folder's descriptor: opened by path, a sub-folder swapped for a link to a root-only folder after the walk's lstat
# of it (renameat2 RENAME_EXCHANGE) was listed and its files read and staged for the worker (O_NOFOLLOW guards only
# a path's last name).
NO_LINK_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def walk_folder(folder: Path) -> Iterator[tuple[str, bytes | None, str | None]]:
    """(relative path, bytes, problem) for each file under `folder`, __pycache__ left out: the one walk of an
    untrusted folder, for its hash, its staged copy and its checks. It reads what it yields through descriptors
    only (each folder opened from its parent's, each file from its folder's), so what it yields lay inside `folder`
    whatever changes there meanwhile; callers use these bytes and open nothing again. A link leading to a file
    inside the folder is that file (_follow_link); any other link (leading out, to a folder, or nowhere) is never
    followed: it comes with no bytes and a problem saying why, is hashed as a link (files_hash) and refused before
    a worker starts (folder_problem). FolderError for anything else that is not a plain file or folder, a file
    with other names (a hard link), version control's files (VERSION_CONTROL_NAMES), a name that is not printable
    UTF-8, a folder past the limits, or one replaced while it was walked."""
    root = Path(os.path.realpath(folder))
    entries = total = 0

    def walk(directory: int, prefix: str) -> Iterator[tuple[str, bytes | None, str | None]]:
        nonlocal entries, total
        folders = []
        for name in sorted(os.listdir(directory)):
            entries += 1
            if entries > MAX_ENTRIES:
                raise FolderError(f"the solution folder holds more than {MAX_ENTRIES} files and folders")
            relative = prefix + name
            if not _printable(name):
                raise FolderError(f"{_shown(relative)}: a file name must be printable UTF-8")
            too_long = path_problem(relative)
            if too_long:
                raise FolderError(too_long)
            if name == "__pycache__":
                continue
            if is_version_control(name):
                raise FolderError(f"{relative}: version control's files have no place in a solution folder (git acts "
                                  "on them where the folder is installed; keep a solution's repository above it)")
            try:
                info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            except OSError as exc:  # gone since it was listed
                raise FolderError(f"{relative} cannot be read: {exc.strerror}") from None
            if stat.S_ISDIR(info.st_mode):
                folders.append((name, info))
                continue
            if stat.S_ISLNK(info.st_mode):
                data, problem = _follow_link(top, root, Path(folder, relative), relative)
                if problem:
                    yield relative, None, problem
                    continue
            elif stat.S_ISREG(info.st_mode):
                data = _read_at(directory, name, relative)
            else:  # a fifo, a socket, a device: reading could block or never end
                raise FolderError(f"{relative} is not a regular file")
            total += len(data)
            if total > MAX_TOTAL_BYTES:
                raise FolderError(f"the solution folder's files are over the {MAX_TOTAL_BYTES >> 20} MiB they may have")
            yield relative, data, None
        for name, info in reversed(folders):  # the last first, as the walk by a stack of paths went
            # listed, walked and closed one at a time: open descriptors never pass the depth of the folder
            with contextlib.ExitStack() as held:
                below = _open_folder(name, directory, info, Path(folder, prefix, name), held)
                yield from walk(below, f"{prefix}{name}/")

    with contextlib.ExitStack() as held:  # the root's path is the caller's: what lies below is not
        top = _open_folder(root, None, None, Path(folder), held)
        yield from walk(top, "")


def _open_folder(name: str | Path, directory: int | None, seen: os.stat_result | None, path: Path,
                 held: contextlib.ExitStack) -> int:
    """A descriptor (closed by `held`) of the folder `name` in the folder open as `directory`, opened without
    following a link; where the walk has lstat'ed it (`seen`), only while it is the folder seen."""
    try:
        descriptor = open_below(directory, [name], held)
    except OSError as exc:  # a link or a file now, too
        raise FolderError(f"{_shown(path)} cannot be listed: {exc.strerror}") from None
    info = os.fstat(descriptor)
    if seen is not None and (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino):
        raise FolderError(f"{_shown(path)} was replaced while the folder was read")
    return descriptor


def open_below(directory: int | None, names: Sequence[str | Path], held: contextlib.ExitStack,
               made: list[tuple[int, str]] | None = None) -> int:
    """A descriptor of the folder `names` lead to from the one open as `directory` (None: the working directory),
    each opened from the one before it without following a link. No names: `directory` itself. Where `made` is
    given, a missing folder is made and listed there as (its folder's descriptor, its name), for an undo: so every
    descriptor opened is closed by `held`, not here, even when one fails. An OSError's filename is the path of
    `names` up to the one refused, for the caller's message."""
    for depth, name in enumerate(names, 1):
        try:
            directory = _open_or_make(directory, name, made)
        except OSError as exc:
            exc.filename = os.path.join(*names[:depth])
            raise
        held.callback(os.close, directory)
    return directory


def _open_or_make(directory: int | None, name: str | Path, made: list[tuple[int, str]] | None) -> int:
    """The folder `name` in `directory` opened without following a link; missing: made where `made` is given."""
    try:
        return os.open(name, NO_LINK_FOLDER, dir_fd=directory)
    except FileNotFoundError:
        if made is None:
            raise
    os.mkdir(name, dir_fd=directory)
    made.append((directory, name))
    return os.open(name, NO_LINK_FOLDER, dir_fd=directory)


# A folder's own git repository (a `core.fsmonitor` in its config ran a command of the submitter's as whoever
# typed `git status` in the installed folder) and git's control files (a `.gitignore` kept the file that computed
# out of the commit, a `.gitattributes` hid the code from review diffs): refused at any depth, notes included.
VERSION_CONTROL_NAMES = frozenset({".git", ".gitmodules", ".gitignore", ".gitattributes", ".hg", ".hgignore"})


def path_problem(relative: str) -> str | None:
    """Why a path relative to a solution folder is too deep or too long for one (MAX_DEPTH, MAX_PATH_BYTES)."""
    depth, size = len(PurePosixPath(relative).parts), len(relative.encode())
    if depth > MAX_DEPTH:
        return f"{_shown(shortened(relative, 80))}: {depth} names deep; a path in a solution folder may have {MAX_DEPTH}"
    if size > MAX_PATH_BYTES:
        return f"{_shown(shortened(relative, 80))}: {size} bytes long; a path in a solution folder may have {MAX_PATH_BYTES}"
    return None


def is_version_control(name: str) -> bool:
    """Compared without case: on a case-insensitive file system `.GIT` is `.git`."""
    return name.lower() in VERSION_CONTROL_NAMES


def _follow_link(top: int, root: Path, link: Path, relative: str) -> tuple[bytes | None, str | None]:
    """(the bytes of the file a link leads to, None) when that is a file inside `root`, open as `top`; else (None,
    why it is refused). Where it leads is found by path, but the file is read name by name from `top` without
    following a link: whatever changed meanwhile, it lies inside the folder."""
    try:
        target = Path(os.path.realpath(link))  # as far as it resolves: a loop is left unresolved, inside
        if not target.is_relative_to(root):
            return None, f"{relative} is a link to {_shown(target)}, outside the solution folder"
        *folders, name = target.relative_to(root).parts or (".",)  # "." for the folder itself
        with contextlib.ExitStack() as held:
            directory = open_below(top, folders, held)
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):  # a loop realpath left unresolved
                return None, f"{relative} is a link that leads nowhere ({os.strerror(errno.ELOOP)})"
            if not stat.S_ISREG(info.st_mode):
                return None, f"{relative} is a link to {_shown(target)}, which is not a file"
            return _read_at(directory, name, relative), None
    except OSError as exc:  # a loop, or a link to nothing
        return None, f"{relative} is a link that leads nowhere ({exc.strerror})"


def _hard_link(shown: str, info: os.stat_result) -> str:
    return f"{shown} is a hard link ({info.st_nlink} names): a file of a solution folder may have no other name"


def _printable(name: str) -> bool:
    """Valid UTF-8 (Python decodes other bytes to lone surrogates) and no control characters: every name
    the judge hashes and shows in one-line messages."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return name.isprintable()


def _shown(path: object) -> str:
    text = str(path)
    return text if _printable(text) else ascii(text)


def read_file(folder: Path, relative: str) -> bytes:
    """The plain file at `relative` in `folder`: each name below `folder` opened from its parent's descriptor without
    following a link, so no folder swapped for a link leads the judge out. Unlike walk_folder, a link to a file
    inside the folder is refused, not followed."""
    parts = PurePosixPath(relative).parts
    if not parts or relative.startswith("/") or any(part in (".", "..") for part in parts):  # `..` is no link
        raise FolderError(f"{_shown(relative)} is no path inside the folder")
    *folders, name = parts
    try:  # `folder` is the caller's path, resolved as walk_folder resolves its root
        with contextlib.ExitStack() as held:
            return _read_at(open_below(None, [os.path.realpath(folder), *folders], held), name, relative)
    except OSError as exc:
        raise FolderError(f"{_shown(relative)} cannot be read: {exc.strerror}") from None


def _read_at(directory: int, name: str, shown: str) -> bytes:
    """The bytes of the regular file `name` in the folder open as `directory`, at most MAX_FILE_BYTES: opened without
    following a link or blocking, and checked on its descriptor (the folder may change after its walk), so no name
    can make the judge read a device, a fifo, /proc or, through a hard link, a file outside the folder."""
    try:
        descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
    except OSError as exc:
        raise FolderError(f"{_shown(shown)} cannot be read: {exc.strerror}") from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise FolderError(f"{_shown(shown)} is not a regular file")
        if info.st_nlink > 1:  # its other names may lie anywhere: the judge staged a hidden trace file's bytes
            raise FolderError(_hard_link(_shown(shown), info))
        if info.st_size > MAX_FILE_BYTES:  # refused before it is read
            raise FolderError(f"{_shown(shown)} is {info.st_size} bytes; a file may have {MAX_FILE_BYTES >> 20} MiB")
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:  # grown since
        raise FolderError(f"{_shown(shown)} is over the {MAX_FILE_BYTES >> 20} MiB a file may have")
    return data


# Hex digits of SHA-256 a content hash keeps: 128 bits, so that two folders with one hash cannot be made
# (64 bits, the earlier form, LEGACY_HASH_LENGTH, took minutes of two cores' time to collide).
HASH_LENGTH = 32
LEGACY_HASH_LENGTH = 16
_REFUSED_LINK = b"\0a link walk_folder refuses\0"  # what such a link counts as in the hash


def write_whole(path: Path, data: bytes, mode: int = 0o644) -> None:
    """`path` holding `data`, whole or not at all: written to a new file beside it (never through a link found
    at its name), then renamed over it, so that a reader sees the old bytes or the new ones."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def files_hash(files: Mapping[str, bytes | None]) -> str:
    """content_hash of the files a solution loads (their bytes: folder_files), by the relative path each has where
    it is loaded. A link walk_folder refuses to follow (None) is never read: it counts as a link, wherever it
    leads (its solution never runs; staging rewrites where it leads, and the hash must stay the same)."""
    entries = [(relative.encode(), _REFUSED_LINK if files[relative] is None else files[relative])
               for relative in sorted(files, key=lambda name: PurePosixPath(name).parts)
               if not is_documentation(relative)]
    digest = hashlib.sha256()
    if any(b"\0" in data for _, data in entries):
        # Data holding a NUL byte could pass for a separator: one file's data made to read as two files, and
        # two folders with one hash. Such folders hash every length too (a stream a path never begins, so
        # it is no other folder's); the others keep the plain form, and their recorded hashes.
        digest.update(b"\0lengths\0")
        for path, data in entries:
            digest.update(len(path).to_bytes(8, "little") + path + len(data).to_bytes(8, "little") + data)
    else:
        for path, data in entries:
            digest.update(path + b"\0" + data + b"\0")
    return digest.hexdigest()[:HASH_LENGTH]


def same_content(recorded: str, current: str) -> bool:
    """Whether a recorded content hash names the content whose hash is `current`: equal, or a record of the
    64-bit form whose hash is the start of the current one (the same SHA-256)."""
    return recorded == current or (len(recorded) == LEGACY_HASH_LENGTH and current.startswith(recorded))



def is_documentation(relative: str) -> bool:
    path = PurePosixPath(relative)
    return path.suffix == ".md" or path.parts[0] == "docs"


def folder_problem(folder: Path, solution: Solution, shared: Sequence[Path] = ()) -> str | None:
    """Why a folder (with the shared folders it loads from, where it is not staged with them) cannot be run
    as it is: everything loaded from it must lie inside it (no link leading out), so the content hash covers
    all the code that runs."""
    try:
        walked = [found for where in (folder, *shared) for found in walk_folder(where)]
    except FolderError as exc:
        return exc.message
    problem = next((problem for _, _, problem in walked if problem), None)
    if problem:
        return problem
    files = {relative for relative, _, _ in walked}
    for name in [solution.entry_file, *solution.sources]:
        if PurePosixPath(name).as_posix() not in files:
            return f"{name} does not exist in the solution folder"
    return None


def missing_dependencies(solution: Solution) -> list[str]:
    """Declared packages that are not installed here, found without importing anything: a dependency is a
    distribution or top-level module name (the Solution model refuses paths), looked up as an installed
    distribution or a top-level module in the folders of sys.path but the working directory, so a repository's
    own folders (solutions/, tests/) cannot answer for it."""
    places = _package_folders()
    missing = []
    for dependency in solution.dependencies:
        name = dependency_name(dependency)
        if name is None or not _installed(name, places):  # None: a model built without validation
            missing.append(dependency)
    return missing


def _package_folders() -> list[str]:
    """sys.path without '' and the working directory: the library folders, and those PYTHONPATH names."""
    here = Path.cwd().resolve()
    return [entry for entry in sys.path if entry and Path(entry).resolve() != here]


def _installed(name: str, places: list[str]) -> bool:
    """A distribution's metadata or a top-level module's file: finding either runs no code (a top-level spec is
    located, not loaded). A dotted name is a distribution's only: as a module it would import its parents."""
    if next(iter(importlib.metadata.distributions(name=name, path=places)), None) is not None:
        return True
    return "." not in name and importlib.machinery.PathFinder.find_spec(name.replace("-", "_"), places) is not None


def missing_toolchain() -> str | None:
    """What a CUDA build needs and this machine lacks (nvcc, ninja), found as torch's extension builder finds
    them: the judge's own check, so that only it, never a build failure a worker reports, can say a pair
    failed for the machine's sake (run/resume.py)."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is None or not os.access(Path(home) / "bin" / "nvcc", os.X_OK):
        return "nvcc (no CUDA toolkit found; set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja"
    return None


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
    sys.path.insert(0, str(folder))  # lets a solution import its sibling files by name
    # ... and relatively (`from .helper import f`, as FlashInfer-Bench's loader allows): the entry file is a module
    # of a package whose folder is the solution folder, its subfolders that package's own, named by their paths as
    # FlashInfer-Bench names them (importlib takes `flash-decode`, not `v1.2`: a dot would split the name).
    entry = PurePosixPath(solution.entry_file)
    parts = [*entry.parts[:-1], entry.stem]
    package = _solution_package(folder)
    in_package = all("." not in part for part in parts)
    name = ".".join([package, *parts]) if in_package else f"{package}_entry"
    try:
        module = _imported_by_its_packages(folder, solution.entry_file, name) if in_package else None
        return module or _exec_entry(folder, solution.entry_file, name)
    except SystemExit as exc:
        raise BuildError(f"{solution.entry_file} calls sys.exit({exc.code!r}) at import") from None
    except Exception as exc:
        raise BuildError(f"importing {solution.entry_file} failed: {exc!r}") from exc


def _imported_by_its_packages(folder: Path, entry_file: str, name: str):
    """Imports the entry module's packages first, as `import src.kernel` does: a subfolder's __init__.py runs
    before the entry file (relative imports from it need the package whole), and one that imports the entry
    back (`from .kernel import run`) gets it whole instead of half run. The entry file's module when that import
    ran it, by the package's name, its own top-level one (`from src.kernel import run`) or as the package itself
    (an entry src/__init__.py): a file runs once."""
    parent = name.rpartition(".")[0]
    importlib.import_module(parent)
    path = str(folder / entry_file)
    own = ".".join(PurePosixPath(entry_file).with_suffix("").parts)
    return next((module for module in map(sys.modules.get, (name, own, parent))
                 if module is not None and getattr(module, "__file__", None) == path), None)


def _exec_entry(folder: Path, entry_file: str, name: str):
    spec = importlib.util.spec_from_file_location(name, folder / entry_file)
    module = importlib.util.module_from_spec(spec)
    # A top-level entry file is also the module its own name imports (kernel.py: `import kernel`), as it is for
    # `python -c "import kernel"`: a sibling that imports it back (a circular import Python allows) gets this
    # module, half run, and not a second copy, whose own `from helper import f` found helper half run and failed.
    own = _own_module_name(folder, entry_file)
    if own in sys.modules and not sys.modules[own].__name__.startswith("flashbench_solution_"):
        own = None  # a module of that name is imported already (the standard library's, a package's)
    try:
        sys.modules[name] = module
        if own is not None:
            sys.modules[own] = module
        spec.loader.exec_module(module)
    except BaseException:
        for key in (name, own):  # as a failed import leaves them
            if key is not None and sys.modules.get(key) is module:
                del sys.modules[key]
        raise
    return module


def _solution_package(folder: Path) -> str:
    """A package (named by the folder's content) whose modules are the folder's files; nothing of it runs."""
    name = f"flashbench_solution_{content_hash(folder)}"
    if name not in sys.modules:
        spec = importlib.machinery.ModuleSpec(name, _namespace_loader(name, folder), is_package=True)
        spec.submodule_search_locations = [str(folder)]
        sys.modules[name] = importlib.util.module_from_spec(spec)
    return name


def _namespace_loader(name: str, folder: Path):
    """The loader the import system gives a namespace package (a folder without __init__.py), through which
    importlib.resources reads its files (`files(__package__)`); the one module_from_spec makes without it does not.
    Its path never changes with sys.path: the finder it is given finds nothing."""
    loader = getattr(importlib.machinery, "NamespaceLoader", None)  # public from Python 3.11
    if loader is None:
        from importlib import _bootstrap_external

        loader = _bootstrap_external._NamespaceLoader
    return loader(name, [str(folder)], lambda *_: None)


def _own_module_name(folder: Path, entry_file: str) -> str | None:
    """The name `import` finds a top-level entry file by (kernel.py: kernel); None for one in a subfolder (its
    package would have to be imported first), or where that name finds something else (a package kernel/, a
    built-in module, found before the folder)."""
    path = PurePosixPath(entry_file)
    if len(path.parts) != 1 or path.suffix != ".py" or not path.stem.isidentifier():
        return None
    if path.stem in sys.builtin_module_names:
        return None
    found = importlib.machinery.PathFinder.find_spec(path.stem, [str(folder)])
    if found is None or found.origin is None or Path(found.origin) != folder / path:
        return None
    return path.stem


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
