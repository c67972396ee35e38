"""Append-only JSONL traces under traces/<hardware>/<definition>.jsonl (CUDA events, the default) or
<definition>.graph.jsonl (CUDA-graph replay): a file holds one timing method, so numbers measured
with and without launch overhead never meet in one table.

Each record is written with one os.write on a file opened O_APPEND, so a crash or kill
leaves whole lines; a torn last line (power loss) is skipped on reading and fenced off with
a newline before the next append.
"""

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import sys
from pathlib import Path

from pydantic import ValidationError

from .errors import FlashbenchError
from .model import Trace
from .model.loading import bounded_lines, open_plain


def hardware_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200': the folder a GPU's traces live in."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


TIMING_METHODS = ("events", "graph")


def trace_file_name(definition: str, timing: str = "events") -> str:
    if timing not in TIMING_METHODS:
        raise FlashbenchError(f"no timing method {timing!r}; known: {', '.join(TIMING_METHODS)}")
    return f"{definition}.jsonl" if timing == "events" else f"{definition}.{timing}.jsonl"


def trace_path(trace_dir: Path, hardware: str, definition: str, timing: str = "events") -> Path:
    return Path(trace_dir) / hardware_slug(hardware) / trace_file_name(definition, timing)


def check_writable(path: Path, trace_dir: Path) -> None:
    """Fail before any work starts if the trace file cannot be appended to, or is no plain file of `trace_dir`
    (a committed link led every run's records into a file of the user's, a FIFO hung the run holding the lock)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        inside = path.parent.resolve().is_relative_to(Path(trace_dir).resolve())
    except OSError as exc:
        raise FlashbenchError(f"cannot write traces: {exc.strerror}", path) from None
    if not inside:
        raise FlashbenchError(f"cannot write traces: its folder leads out of {trace_dir} through a link", path)
    if path.parent.is_symlink():  # read_traces reads no file there: records written through it would be lost
        raise FlashbenchError("cannot write traces: its folder is a link", path)
    if Path(trace_dir).is_symlink():  # a committed `traces` link led a run's records out of the repository
        raise FlashbenchError("cannot write traces: the trace directory is a link; give its real path", trace_dir)
    os.close(_open_for_append(path))


def _open_for_append(path: Path) -> int:
    """The trace file opened to append, never through a link and never blocking; a FlashbenchError for what is no
    plain file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        why = {errno.ELOOP: "it is a link", errno.ENXIO: "it is not a plain file"}.get(exc.errno, exc.strerror)
        raise FlashbenchError(f"cannot write traces: {why}", path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FlashbenchError("cannot write traces: it is not a plain file", path)
    return fd


# The most a trace file may hold to be read: a sparse file of 256 GiB kept every board busy for minutes.
MAX_TRACE_FILE_BYTES = 1 << 30


def read_trace_bytes(path: Path) -> bytes:
    """A trace file's bytes as the recorder compares them: never through a link, never blocking (open_plain), and
    no more than read_traces reads of one (MAX_TRACE_FILE_BYTES)."""
    try:
        with open_plain(path) as handle:
            data = handle.read(MAX_TRACE_FILE_BYTES + 1)
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise FlashbenchError(f"cannot read traces: {exc.strerror}", path) from None
    if len(data) > MAX_TRACE_FILE_BYTES:
        raise FlashbenchError(f"cannot read traces: over the {MAX_TRACE_FILE_BYTES >> 30} GiB a trace file may hold",
                              path)
    return data


@contextlib.contextmanager
def sole_writer(trace_dir: Path):
    """Held while a run writes under `trace_dir`, so that a second run there waits for it: a run takes any file
    it did not write under its trace directory for a forgery and sets it aside, so two runs side by side would
    set aside each other's records. The directory is locked for this writer alone and each folder above it for
    writers below it (a run into traces/ watches traces/imported/x/ too); released when the holder ends, however
    it ends (this machine's own locks, on files of LOCK_DIR that stand for the folders)."""
    try:
        trace_dir.mkdir(parents=True, exist_ok=True)
        folder = trace_dir.resolve()
    except OSError as exc:
        raise FlashbenchError(f"cannot write traces: {exc.strerror}", trace_dir) from None
    try:
        _make_lock_dir()
    except OSError as exc:
        raise FlashbenchError(f"cannot write traces: the lock for {folder}: {exc.strerror}", trace_dir) from None
    with contextlib.ExitStack() as held:
        for above in reversed(folder.parents):  # from the root down: every writer takes them in one order
            _lock(held, above, fcntl.LOCK_SH, trace_dir, required=False)
        _lock(held, folder, fcntl.LOCK_EX, trace_dir, required=True)
        yield


# The locks are taken on files of a folder of this user's under /tmp, one per folder locked, not on the folders: a
# worker, which can read the folders, held a lock on a trace directory's parent for its whole life and made every
# other run wait (a red team); at level namespaces a worker's /tmp is its own.
LOCK_DIR = Path("/tmp") / f"flashbench-trace-locks-{os.getuid()}"


def _lock(held: contextlib.ExitStack, folder: Path, kind: int, trace_dir: Path, required: bool) -> None:
    try:
        descriptor = os.open(_lock_file(folder), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if not required:
            return
        raise FlashbenchError(f"cannot write traces: the lock for {folder}: {exc.strerror}", trace_dir) from None
    held.callback(os.close, descriptor)
    try:
        fcntl.flock(descriptor, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"waiting for another flashbench run writing traces under {folder} to end "
              f"(with another --trace-dir, not inside it, they run side by side)", file=sys.stderr, flush=True)
        fcntl.flock(descriptor, kind)


def _make_lock_dir() -> None:
    """LOCK_DIR, made for this user alone (a folder of that name another user made, or a link, is refused): once
    per writer, before the locks of every folder from the root down are taken in it."""
    try:
        os.mkdir(LOCK_DIR, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(LOCK_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(errno.EPERM, f"{LOCK_DIR} is not a folder of this user's alone")


def _lock_file(folder: Path) -> Path:
    """The file in LOCK_DIR that stands for `folder`'s lock."""
    return LOCK_DIR / hashlib.sha256(os.fsencode(folder)).hexdigest()[:32]


def append_trace(path: Path, trace: Trace) -> None:
    """Append one record whole, or nothing: a write that fails (a full disk) leaves the file as it was and is a
    FlashbenchError, one line."""
    line = (trace.model_dump_json() + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FlashbenchError(f"cannot write traces: {exc.strerror}", path) from None
    fd = _open_for_append(path)
    size = os.fstat(fd).st_size
    try:
        if size and not _ends_with_newline(path):
            line = b"\n" + line
        while line:
            line = line[os.write(fd, line):]
        os.fsync(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise FlashbenchError(f"cannot write traces: {exc.strerror}; the file is as it was before this record",
                              path) from None
    finally:
        os.close(fd)


def refuse_linked_folder(path: Path) -> None:
    """A file boards read lies in a folder that is no link: a hardware folder linked out led them anywhere."""
    if path.parent.is_symlink():
        raise FlashbenchError("cannot read: its folder is a link", path)


def read_traces(path: Path) -> list[Trace]:
    """Every valid record; torn or invalid lines are reported on stderr and skipped. A trace file is read only as
    a plain file of at most MAX_TRACE_FILE_BYTES in a folder that is no link (a trace directory may come from
    anyone): anything else is one line on stderr, and no records."""
    path = Path(path)
    try:
        refuse_linked_folder(path)
        handle = open_plain(path)
    except FileNotFoundError:
        return []
    except FlashbenchError as exc:
        print(f"warning: {exc}; skipped", file=sys.stderr)
        return []
    traces = []
    # Records are split on b"\n" only: JSON leaves U+2028, U+0085 and the like unescaped, which
    # str.splitlines would cut at; a torn line may also end inside a multi-byte character.
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size > MAX_TRACE_FILE_BYTES:
            print(f"warning: {path}: {size} bytes, over the {MAX_TRACE_FILE_BYTES >> 30} GiB a trace file may hold; "
                  "skipped", file=sys.stderr)
            return []
        for number, line in bounded_lines(handle):
            if line is not None and not line.strip():
                continue
            trace = _parsed(line)
            if trace is None:
                print(f"warning: {path}: line {number} is not a valid trace; skipped", file=sys.stderr)
            else:
                traces.append(trace)
    return traces


def _parsed(line: bytes | None) -> Trace | None:
    """The trace a line holds; None for a line that holds none, or is too long to read (None)."""
    if line is None:
        return None
    try:
        return Trace.model_validate_json(line.decode("utf-8"))
    except (ValidationError, UnicodeDecodeError):
        return None


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"
