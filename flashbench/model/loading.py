"""Reading YAML/JSON files into models, with errors that name the file, field and line."""

import json
import re
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import FlashbenchError

M = TypeVar("M", bound=BaseModel)

# libyaml's parser when PyYAML was built with it: the same documents and errors, several times faster.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w\[\]]*(?:\.[\w\[\]]+)*): (.*)$", re.S)


def read_document(path: Path) -> object:
    """Parse a .yaml/.yml/.json file; syntax errors name the line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise FlashbenchError(f"cannot read: {exc.strerror}", path) from None
    return parse_document(text, path)


def parse_document(text: str, path: Path, aliases: bool = True) -> object:
    """Parse the text of a .yaml/.yml/.json file (`path` names it in errors). aliases=False refuses YAML
    aliases: each repeats a node, so a few bytes can stand for megabytes once parsed."""
    if not aliases and Path(path).suffix != ".json":
        _refuse_aliases(text, path)
    if Path(path).suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise FlashbenchError(f"line {exc.lineno}: invalid JSON: {exc.msg}", path) from None
    try:
        return yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise FlashbenchError(f"{where}invalid YAML: {problem}", path) from None


def _refuse_aliases(text: str, path: Path) -> None:
    try:
        for event in yaml.parse(text, Loader=_YAML_LOADER):
            if isinstance(event, yaml.AliasEvent):
                line = f"line {event.start_mark.line + 1}: " if event.start_mark else ""
                raise FlashbenchError(f"{line}a YAML alias; write the value out instead", path)
    except yaml.YAMLError:
        return  # the parse that follows names the syntax error


def parse_model(cls: type[M], data: object, path: Path) -> M:
    """Validate `data` as `cls`; the first error becomes a FlashbenchError naming the field."""
    if not isinstance(data, dict):
        raise FlashbenchError(f"expected a mapping of keys, found {type(data).__name__}", path)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, path) from None


def load_model(cls: type[M], path: Path) -> M:
    return parse_model(cls, read_document(path), path)


def validation_error(exc: ValidationError, path: Path) -> FlashbenchError:
    error = exc.errors()[0]
    field = ".".join(str(part) for part in error["loc"]) or None
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "literal_error" and "input" in error:
        message = f"{error['input']!r} is not allowed; {message.lower()}"
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    lifted = _FIELD_PREFIX.match(message) if error["type"] == "value_error" else None
    if lifted:  # a model-level check names its field as "field: message"
        field = ".".join(part for part in (field, lifted[1]) if part)
        message = lifted[2]
    more = len(exc.errors()) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return FlashbenchError(message, path, field)
