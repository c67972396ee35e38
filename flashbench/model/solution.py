"""solution.yaml: a solution folder's manifest (FlashInfer-Bench's solution spec, flattened)."""

import re
import unicodedata
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from .definition import FOLDER_NAME, SHARED_FOLDER, Strict

# Boards name columns after solutions beside columns of their own (leaderboard/board.py VIEW_COLUMNS, report.py,
# the CSV's hardware and baseline): a solution of one of these names overwrote that column and ended the JSON,
# HTML and by-workload boards of its hardware with a traceback.
BOARD_COLUMNS = frozenset({"workload", "floor_us", "best", "best_us", "best_sol_pct", "MB", "hardware", "baseline"})


def not_a_board_column(name: str) -> str:
    if name in BOARD_COLUMNS:
        raise ValueError(f"{name!r} names a column of the boards; a solution needs a name of its own")
    return name


SolutionName = Annotated[str, Field(pattern=FOLDER_NAME), AfterValidator(not_a_board_column)]
# Tags, authors and hardware names reach boards (Markdown, HTML, charts, the terminal): a tag is a
# word, a label one printable line; neither can open a table cell, a link, markup or an escape sequence.
TAG = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$"
LABEL = r"^[^\x00-\x1f\x7f-\x9f|<>`\[\]\\$]{1,200}$"
_SHARED_NAME = re.compile(FOLDER_NAME)
# A dependency: a distribution name as packaging writes it ('zope.interface' included) or a top-level module name,
# optionally with version clauses (recorded, not checked). No path: the judge looks it up without importing.
_VERSION_CLAUSE = r"(?:==|!=|<=|>=|~=|<|>)\s*[A-Za-z0-9.*+!]+"
_PACKAGE = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
_DEPENDENCY = re.compile(rf"({_PACKAGE})\s*(?:{_VERSION_CLAUSE}(?:\s*,\s*{_VERSION_CLAUSE})*)?")


# Unicode categories a name may not hold: controls, format characters (U+202E reverses the text after it, U+200B
# is invisible, U+2066 isolates: names that look alike), line and paragraph separators, unassigned and private.
_UNSHOWN = {"Cc", "Cf", "Zl", "Zp", "Cn", "Co", "Cs"}
_JOINERS = "\u200c\u200d"  # format characters that Persian and Indic names need


# Letters, marks and symbols drawn as a blank or as nothing: 'flashbench' + U+3164 (a Hangul filler, a letter) read
# as the repository's own author on a board. The Hangul fillers, the Braille blank, the combining grapheme joiner,
# the Khmer inherent vowels, the Mongolian and the other variation selectors.
_BLANK = frozenset("\u115f\u1160\u3164\uffa0\u2800\u034f\u17b4\u17b5\u180b\u180c\u180d\u180f"
                   + "".join(map(chr, range(0xFE00, 0xFE10))) + "".join(map(chr, range(0xE0100, 0xE01F0))))


def _shown_as_written(text: str) -> str:
    """LABEL's pattern refuses ASCII and C1 control characters; this, the other characters not shown as they are,
    and spaces that make two labels look alike (other than one ASCII space between words)."""
    if any(unicodedata.category(ch) in _UNSHOWN and ch not in _JOINERS for ch in text):
        raise ValueError("may not hold a control or format character (such as U+202E or U+200B) nor a line separator")
    if any(ch in _BLANK or (unicodedata.category(ch) == "Zs" and ch != " ") for ch in text):
        raise ValueError("may not hold a character shown as a blank or as nothing (such as U+3164 or U+00A0)")
    if text != text.strip() or "  " in text:
        raise ValueError("may not begin or end with a space nor hold two in a row")
    return text


def _ascii(text: str) -> str:
    """A hardware's traces live in a folder named after its ASCII letters and digits (traces.hardware_slug): any
    other letter, a Cyrillic 'Н' for an 'H', only dressed one GPU's board as another's."""
    if not text.isascii():
        raise ValueError("must be ASCII, as a GPU's name is")
    return text


Label = Annotated[str, Field(pattern=LABEL), AfterValidator(_shown_as_written)]  # an author
HardwareName = Annotated[str, Field(pattern=LABEL), AfterValidator(_ascii)]


def dependency_name(dependency: str) -> str | None:
    """The package name of a dependency ('torch>=2.4' -> 'torch'); None for one the Solution model refuses."""
    match = _DEPENDENCY.fullmatch(dependency)
    return match[1] if match else None


class Solution(Strict):
    name: SolutionName
    definition: str = Field(pattern=FOLDER_NAME)
    author: Label
    description: str = ""
    language: Literal["python", "triton", "cuda"]
    entry_point: str = Field(pattern=r"^[^:]+::[A-Za-z_]\w*$", description="file::function")
    destination_passing_style: bool = Field(
        True, description="true: outputs are pre-allocated and passed last; false: returned"
    )
    target_hardware: list[str] = []
    dependencies: list[str] = Field([], description=(
        "installed packages the solution needs: distribution or top-level module names (no path), "
        "each optionally with a version, e.g. 'torch>=2.4'"))
    binding: Literal["torch", "tvm-ffi"] | None = Field(
        None, description="CUDA only: how the module is bound (tvm-ffi is recorded, not built yet)"
    )
    compile_flags: list[str] = Field([], description="CUDA only: extra nvcc flags")
    sources: list[str] = Field([], description="CUDA only: files to compile (default: every .cu/.cpp)")
    tags: list[Annotated[str, Field(pattern=TAG)]] = Field(
        [], description="e.g. 'baseline' for solutions others are compared with")
    shared: list[str] = Field([], description=(
        f"names of folders in solutions/{SHARED_FOLDER}/ whose files join the solution's own, each at its path "
        "in that folder (entry_point and sources may name them); the content hash covers them"))

    @model_validator(mode="after")
    def _cuda_fields_only_for_cuda(self):
        if self.language != "cuda" and (self.binding or self.compile_flags or self.sources):
            raise ValueError("binding, compile_flags and sources apply to language 'cuda' only")
        return self

    @model_validator(mode="after")
    def _python_entry_is_source(self):
        if self.language != "cuda" and not self.entry_file.endswith(".py"):  # `.pyc` would run what no one can read
            raise ValueError(f"entry_point: {self.entry_file!r} must be a Python source file (.py) for language "
                             f"{self.language!r}")
        return self

    @model_validator(mode="after")
    def _paths_inside_the_folder(self):
        for field, path in [("entry_point", self.entry_file)] + [("sources", source) for source in self.sources]:
            if path.startswith(("/", "\\")) or ".." in path.replace("\\", "/").split("/"):
                raise ValueError(f"{field}: {path!r} must be a path inside the solution folder (no absolute path, no '..')")
        return self

    @model_validator(mode="after")
    def _dependencies_are_package_names(self):
        for dependency in self.dependencies:
            if not _DEPENDENCY.fullmatch(dependency):
                raise ValueError(f"dependencies: {dependency!r} must be the name of an installed package (letters, "
                                 "digits, '_', '-', '.' inside; no path), optionally with a version such as '>=2.4'")
        return self

    @model_validator(mode="after")
    def _shared_are_folder_names(self):
        for name in self.shared:
            if not _SHARED_NAME.fullmatch(name):
                raise ValueError(f"shared: {name!r} must be the name of a folder in solutions/{SHARED_FOLDER}/ "
                                 "(letters, digits, '_', '.', '-'; no path, no '..')")
        repeated = sorted({name for name in self.shared if self.shared.count(name) > 1})
        if repeated:
            raise ValueError(f"shared: {', '.join(map(repr, repeated))} named more than once")
        return self

    @property
    def entry_file(self) -> str:
        return self.entry_point.split("::")[0]

    @property
    def entry_function(self) -> str:
        return self.entry_point.split("::")[1]
