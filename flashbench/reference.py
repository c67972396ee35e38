"""Loading a definition's reference implementation and checking its `run` signature."""

import importlib.util
import inspect
import sys
import types
from pathlib import Path
from typing import Callable

from .errors import FlashbenchError
from .model import Definition


def reference_source(definition: Definition, root: Path) -> str:
    """The reference's Python source: the file it names under `root`, or the text the definition embeds."""
    return reference_file(definition, root, definition.name).read_text() if definition.reference_is_path \
        else definition.reference


# The folder of the repository that holds reference files: trusted code, which the judge imports in its own process.
REFERENCES_DIR = "references"


def reference_file(definition: Definition, root: Path, where: object) -> Path:
    """The file a definition's reference names, inside `root`'s references/ folder after every link is followed: an
    absolute path, `..` or a link out of the repository was imported as it was (a red team's imported dataset ran a
    file of its own choosing, again on every later command), and a path to a file elsewhere in the repository named
    one a sandboxed worker may rewrite (its build folder in the cache lasts between runs), which every later
    command then ran in the runner."""
    path = (root / definition.reference).resolve()
    if Path(definition.reference).is_absolute() or not path.is_relative_to(Path(root).resolve()):
        raise FlashbenchError(f"the reference file {definition.reference} is outside the repository", where,
                              "reference")
    if not path.is_relative_to((Path(root) / REFERENCES_DIR).resolve()):
        raise FlashbenchError(f"the reference file {definition.reference} is outside the repository's "
                              f"{REFERENCES_DIR}/ folder, the only one whose files are run as references", where,
                              "reference")
    return path


def load_reference(definition: Definition, root: Path, definition_file: Path | None = None) -> Callable:
    """The reference's `run`, checked against the definition's inputs."""
    where = definition_file or definition.name
    if definition.reference_is_path:
        module = _import_file(reference_file(definition, root, where), where)
    else:
        module = _exec_source(definition.reference, definition.name, where)
    run = getattr(module, "run", None)
    if not callable(run):
        raise FlashbenchError("the reference defines no function 'run'", where, "reference")
    check_signature(run, list(definition.inputs), where, "reference")
    return run


def check_signature(func: Callable, expected: list[str], where: object, field: str) -> None:
    """`func` must take exactly the parameters `expected`, in order."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return  # compiled callables may not expose a signature
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return
    names = [p.name for p in params]
    if names != expected:
        raise FlashbenchError(
            f"run takes ({', '.join(names)}) but the inputs are ({', '.join(expected)})", where, field
        )


def _import_file(path: Path, where: object) -> types.ModuleType:
    if not path.is_file():
        raise FlashbenchError(f"reference file {path} does not exist", where, "reference")
    name = f"flashbench_reference_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a broken reference is a definition error, not a crash
        raise FlashbenchError(f"reference {path} fails to import: {exc!r}", where, "reference") from None
    sys.modules[name] = module
    return module


def _exec_source(source: str, name: str, where: object) -> types.ModuleType:
    module = types.ModuleType(f"flashbench_reference_{name}")
    try:
        exec(compile(source, f"<reference of {name}>", "exec"), module.__dict__)
    except (Exception, SystemExit) as exc:
        raise FlashbenchError(f"embedded reference fails to load: {exc!r}", where, "reference") from None
    return module
