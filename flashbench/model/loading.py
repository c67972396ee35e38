"""Reading YAML/JSON files into models, with errors that name the file, field and line."""

import errno
import json
import os
import re
import reprlib
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import FlashbenchError, shortened

M = TypeVar("M", bound=BaseModel)

# libyaml's parser when PyYAML was built with it: the same documents and errors, several times faster.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# What one document (a definition, workload or manifest file, a FIB JSON file) or one JSONL record (a trace)
# may hold: files may come from anyone (an imported dataset), and each was read whole, so one huge file took
# the memory of every command that read it.
MAX_DOCUMENT_BYTES = 64 << 20
MAX_RECORD_BYTES = 16 << 20
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w\[\]]*(?:\.[\w\[\]]+)*): (.*)$", re.S)


def read_document(path: Path) -> object:
    """Parse a .yaml/.yml/.json file; syntax errors name the line. Checked as untrusted (no alias, no deep
    nesting): a definition or workload file may come from anyone too (a 735-byte workload file of nested
    aliases took every byte of memory `validate` could have)."""
    data = read_bounded(path)
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise FlashbenchError(f"not UTF-8 text (byte {exc.start})", path) from None
    return parse_document(text, path, untrusted=True)


def open_plain(path: Path) -> BinaryIO:
    """A plain file opened to read, never through a link (at its last name) and never blocking: a link to
    /proc/kmsg in a trace directory blocked every board and `run` for ever, one to /proc/self/pagemap had
    them read 256 GiB, a FIFO never answers. FileNotFoundError as it comes; a FlashbenchError for the rest."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = {errno.ELOOP: "it is a link", errno.ENXIO: "it is not a plain file"}.get(exc.errno, exc.strerror)
        raise FlashbenchError(f"cannot read: {why}", path) from None
    handle = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        handle.close()
        raise FlashbenchError("cannot read: it is not a plain file", path)
    return handle


def read_bounded(path: Path) -> bytes:
    """The bytes of a plain file (open_plain) of at most MAX_DOCUMENT_BYTES; a larger one is refused without
    being read."""
    limit = MAX_DOCUMENT_BYTES
    try:
        with open_plain(path) as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise FlashbenchError(f"cannot read: {exc.strerror}", path) from None
    if len(data) > limit:
        raise FlashbenchError(f"larger than {limit >> 20} MiB, the most a file of this kind may hold", path)
    return data


def bounded_lines(handle: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) for every line split at b"\n" only, read one at a time; None for a line longer
    than MAX_RECORD_BYTES, which is skipped without being held."""
    number, limit = 0, MAX_RECORD_BYTES
    while True:
        line = handle.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) <= limit or line.endswith(b"\n"):
            yield number, line
            continue
        while line and not line.endswith(b"\n"):  # the rest of the long line
            line = handle.readline(1 << 20)
        yield number, None


# How deep an untrusted document may nest. libyaml's composer recurses once per level in C: a manifest
# of 32,000 nested brackets (64 KB) overflowed the stack and killed the runner (SIGSEGV).
MAX_UNTRUSTED_DEPTH = 32


def parse_document(text: str, path: Path, untrusted: bool = False) -> object:
    """Parse the text of a .yaml/.yml/.json file (`path` names it in errors). An untrusted document (a
    solution's manifest) may not use YAML aliases (each repeats a node, so a few bytes can stand for
    megabytes once parsed) nor nest deeper than MAX_UNTRUSTED_DEPTH."""
    if Path(path).suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise FlashbenchError(f"line {exc.lineno}: invalid JSON: {exc.msg}", path) from None
        except RecursionError:
            raise FlashbenchError("nested too deeply", path) from None
        except ValueError as exc:  # an integer past Python's digit limit
            raise FlashbenchError(f"invalid JSON value: {exc}", path) from None
    if untrusted:
        _check_untrusted_yaml(text, path)
    try:
        return yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise FlashbenchError(f"{where}invalid YAML: {problem}", path) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # Raised while a scalar is built (a date such as 2001-13-45, an integer past Python's digit
        # limit), not as a YAMLError: one such manifest stopped every run of its definition.
        raise FlashbenchError(f"invalid YAML value: {shortened(str(exc))}", path) from None


def _check_untrusted_yaml(text: str, path: Path) -> None:
    """The document's events, before anything is built from them: no alias, no nesting past the limit
    (the parser keeps its own stack; the composer would recurse)."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_YAML_LOADER):
            line = f"line {event.start_mark.line + 1}: " if event.start_mark else ""
            if isinstance(event, yaml.AliasEvent):
                raise FlashbenchError(f"{line}a YAML alias; write the value out instead", path)
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_UNTRUSTED_DEPTH:
                    raise FlashbenchError(f"{line}nested deeper than {MAX_UNTRUSTED_DEPTH} levels", path)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        return  # the parse that follows names the syntax error


def parse_model(cls: type[M], data: object, path: Path) -> M:
    """Validate `data` as `cls`; the first error becomes a FlashbenchError naming the field."""
    _check_mapping(data, path)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, path) from None


def parse_records(cls: type[M], data: object, path: Path, key: str) -> tuple[M | None, dict[int, FlashbenchError]]:
    """parse_model for a file of records, the list field `key`: when only records are invalid, no model and
    each invalid record's first error by index, its field named within the record (one fixing the file sees
    every bad record at once). Any other problem raises as in parse_model."""
    _check_mapping(data, path)
    try:
        return cls.model_validate(data), {}
    except ValidationError as exc:
        by_record: dict[int, list] = {}
        for error in exc.errors():
            loc = error["loc"]
            if len(loc) < 2 or loc[0] != key or not isinstance(loc[1], int):
                raise validation_error(exc, path) from None
            by_record.setdefault(loc[1], []).append({**error, "loc": loc[2:]})
        return None, {i: _first_error(errors, path) for i, errors in sorted(by_record.items())}


def _check_mapping(data: object, path: Path) -> None:
    if not isinstance(data, dict):
        raise FlashbenchError(f"expected a mapping of keys, found {type(data).__name__}", path)


def load_model(cls: type[M], path: Path) -> M:
    return parse_model(cls, read_document(path), path)


def validation_error(exc: ValidationError, path: Path) -> FlashbenchError:
    return _first_error(exc.errors(), path)


# What a message quotes of a value: bounded while it is written, not cut after (the repr of a list of a
# million items, which a few bytes of YAML aliases stand for, took minutes and gigabytes).
_QUOTED = reprlib.Repr()
_QUOTED.maxstring, _QUOTED.maxother, _QUOTED.maxlong = 200, 200, 60


def _first_error(errors: list[dict], path: Path) -> FlashbenchError:
    error = errors[0]
    field = ".".join(str(part) for part in error["loc"]) or None
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "literal_error" and "input" in error:
        message = f"{shortened(_QUOTED.repr(error['input']))} is not allowed; {message.lower()}"
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    lifted = _FIELD_PREFIX.match(message) if error["type"] == "value_error" else None
    if lifted:  # a model-level check names its field as "field: message"
        field = ".".join(part for part in (field, lifted[1]) if part)
        message = lifted[2]
    more = len(errors) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return FlashbenchError(message, path, field)
