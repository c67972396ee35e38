"""The only writer of traces.

Before every append the trace file must hold exactly what this recorder last wrote: otherwise
something else wrote it while solutions ran; it is put back (what was found there kept aside, `*.untrusted`)
and every job that could have done it is rejected. The other files boards read under the trace directory
(trace files and calibrations, at any depth) are watched too: one that appears or whose content changes during
the run without this recorder writing it is renamed out of the boards' way (`*.untrusted`) and reported; one
whose metadata alone changed stays, and so does any other file (a report, notes). So a run holds its trace
directory (traces.sole_writer) and a second run there waits: each would set the other's records aside.
"""

import contextlib
import hashlib
import os
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..build import write_whole
from ..errors import FlashbenchError
from ..model import Trace
from ..calibrate import CALIBRATION_FILE
from ..traces import append_trace, check_writable, read_trace_bytes, sole_writer

TRACE_FILE_CHANGED = "the trace file changed while this solution ran; it was restored"
CHANGED_FILE_KEY = "trace_file_changed"  # in a rejected trace's environment, which only the judge writes
UNTRUSTED_SUFFIX = ".untrusted"


@dataclass(frozen=True)
class _Stamp:
    size: int
    mtime_ns: int
    inode: int


class TraceRecorder:
    def __init__(self, trace_file: Path, trace_dir: Path, save: bool):
        self.trace_file = trace_file
        self.trace_dir = trace_dir
        self.save = save
        self._written = b""
        self._stamps: dict[Path, _Stamp] = {}
        self._digests: dict[Path, str | None] = {}  # the content each file had when last seen (by stamp)
        self.untrusted: list[Path] = []
        self._writing = contextlib.ExitStack()

    def __enter__(self) -> "TraceRecorder":
        """Wait for any other run writing the trace directory; fail before any work if the trace file cannot be
        written; remember the directory as it is."""
        if self.save:
            with contextlib.ExitStack() as writing:  # released here should what follows fail
                writing.enter_context(sole_writer(self.trace_dir))
                check_writable(self.trace_file, self.trace_dir)
                self._written = read_trace_bytes(self.trace_file)
                self._stamps = _stamps(self.trace_dir)
                self._digests = {path: _digest(path) for path in self._stamps}
                self._writing = writing.pop_all()
        return self

    def __exit__(self, *exc_info) -> None:
        self._writing.close()

    def record(self, trace: Trace) -> tuple[Trace, bool]:
        """Append `trace`; also whether the trace file had been changed by someone else (then it is
        restored and `trace` rejected)."""
        if not self.save:
            return trace, False
        found = read_trace_bytes(self.trace_file)
        tampered = found != self._written
        if tampered:
            aside = _aside(self.trace_file)
            try:
                _write_new(aside, found)  # not lost: someone's records, or the forgery, for whoever looks
                write_whole(self.trace_file, self._written)
            except OSError as exc:
                raise FlashbenchError(f"cannot restore the trace file: {exc.strerror}", self.trace_file) from None
            print(f"warning: {self.trace_file} changed during the run without flashbench writing it; restored, and "
                  f"what was found there kept as {aside.name}", file=sys.stderr)
            self.untrusted.append(aside)
            trace = rejected_for_a_changed_file(trace)
        self.set_aside_foreign_files()
        append_trace(self.trace_file, trace)
        self._written = read_trace_bytes(self.trace_file)
        self._stamps[self.trace_file] = _stamp(self.trace_file)
        return trace, tampered

    def set_aside_foreign_files(self) -> list[Path]:
        """Files under the trace directory that appeared or changed since the last look, other than the
        trace file (handled by `record`), renamed so no board reads them."""
        if not self.save:
            return []
        found = []
        for path, stamp in _stamps(self.trace_dir).items():
            if path == self.trace_file or self._stamps.get(path) == stamp:
                continue
            if self._digests.get(path) is not None and _digest(path) == self._digests[path]:
                # Only its metadata changed (a worker at level process may touch, chmod or set xattrs on the runner's
                # files: Landlock has no rights for them): its content is what it was, and it stays where it is.
                continue
            aside = _aside(path)
            try:
                path.replace(aside)
            except FileNotFoundError:  # gone since it was seen
                continue
            found.append(aside)
            print(f"warning: {path} appeared or changed during the run without flashbench writing it; "
                  f"moved to {aside.name}", file=sys.stderr)
        self.untrusted += found
        self._stamps = _stamps(self.trace_dir)
        for path in self._stamps.keys() - self._digests.keys():  # new files only: the others' bytes are known
            self._digests[path] = _digest(path)
        return found


def rejected_for_a_changed_file(trace: Trace) -> Trace:
    """The judge's own rejection, marked where no worker's words reach (its message alone a worker can send:
    `--resume` would have run its pair again whenever it liked)."""
    return trace.model_copy(update={"status": "REJECTED", "performance": None, "message": TRACE_FILE_CHANGED,
                                    "environment": {**trace.environment, CHANGED_FILE_KEY: True}})


def _aside(path: Path) -> Path:
    return path.with_name(f"{path.name}.{time.time_ns()}{UNTRUSTED_SUFFIX}")


def _write_new(path: Path, data: bytes) -> None:
    """A file made here and now, never one found in its place (a link planted at the name was written through)."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "wb") as f:
        f.write(data)


def read_by_boards(path: Path) -> bool:
    """What a board reads: trace files and calibrations (read_results, calibrate.calibration_path)."""
    return path.name.endswith(".jsonl") or path.name == CALIBRATION_FILE


def _stamps(folder: Path) -> dict[Path, _Stamp]:
    stamps = {}
    for path in folder.rglob("*"):
        # every link, whatever its name: boards follow one to a folder (traces/<hardware> leading elsewhere)
        if not path.is_symlink() and (path.is_dir() or not read_by_boards(path)):
            continue
        with contextlib.suppress(FileNotFoundError):  # gone since it was listed (an editor's swap file)
            stamps[path] = _stamp(path)
    return stamps


def _digest(path: Path) -> str | None:
    """A file's content (a link's target), to tell a changed file from one whose metadata alone changed; None
    for what is neither a link nor a plain file (a pipe would block the read) or cannot be read."""
    try:
        if path.is_symlink():
            return hashlib.sha256(f"link:{path.readlink()}".encode()).hexdigest()
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _stamp(path: Path) -> _Stamp:
    stat = path.lstat()  # a link is judged as a link: where it points may be anywhere
    return _Stamp(stat.st_size, stat.st_mtime_ns, stat.st_ino)
