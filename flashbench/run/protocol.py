"""The messages between the judge and a worker, and how they cross the pipe.

A frame is a 4-byte little-endian length and that many bytes of JSON, parsed into one of the
models below. No pickle, nothing that builds arbitrary objects: what a worker sends is
untrusted data, and anything malformed, oversized or unexpected is a ProtocolError that gives
that pair a verdict. Tensors never cross the pipe; they live in the job's arena (run/arena.py),
which the judge owns.

A CPU job's arena is a sealed memfd: its descriptor crosses a Unix socket of its own (SCM_RIGHTS),
one judge-to-worker message of ARENA_TAG per Open, sent just before the Open frame. The judge
never reads that socket (it shuts its receiving side at once, so the worker cannot send on it).
"""

import array
import errno
import math
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from ..errors import shortened
from ..model import Definition, Solution, Workload

VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # a reply is a status and a list of times; anything larger is not a reply
MAX_BATCH_CALLS = 1000  # the most calls a batch may have, so the most times a CallTimes carries
_LENGTH = struct.Struct("<I")

# What a worker may say went wrong. PASSED is not among them: only the judge reaches it.
FailureStatus = Literal["INCORRECT_SHAPE", "INCORRECT_DTYPE", "RUNTIME_ERROR", "COMPILE_ERROR", "INVALID_SOLUTION",
                        "REJECTED", "DEVICE_ERROR"]


class Message(BaseModel):
    # Infinities and NaN (a workload's attn_sink of mean -inf: no sink) travel as strings: JSON has no
    # number for them, and as null the worker refused its first request and exited.
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


# Judge -> worker.

class Setup(Message):
    kind: Literal["setup"] = "setup"
    version: int = VERSION
    definition: Definition
    solution: Solution
    folder: str
    device: str
    build_dir: str


class Probe(Message):
    """A small computation read back from the device, before any solution code is imported."""

    kind: Literal["probe"] = "probe"


class Build(Message):
    kind: Literal["build"] = "build"


class TensorSlot(Message):
    """One tensor in the arena: `nbytes` at `offset`."""

    offset: int = Field(ge=0)
    dtype: str
    shape: list[int]


class ArenaLayout(Message):
    """Where a job's tensors live: input sets (the solution's inputs) and output slots (one per call
    of a batch). Scalars travel by value."""

    nbytes: int = Field(ge=0)
    sets: list[dict[str, TensorSlot]]
    slots: list[dict[str, TensorSlot]]
    scalars: dict[str, float | int | bool] = {}
    # The bytes the L2 flush's keyed passes read, written by the judge (recipe.L2Flush); None: no keyed flush.
    flush: TensorSlot | None = None


class ArenaHandle(Message):
    """How a worker maps the arena: a sealed memfd whose descriptor comes over the descriptor socket
    right after the Open frame (CPU; no path anywhere), or a CUDA IPC handle the worker exports."""

    kind: Literal["memfd", "cuda_ipc"]
    ipc_handle: str = ""  # hex of the 64-byte cudaIpcMemHandle
    offset: int = 0  # of the arena within the exported allocation
    device_index: int = 0


class Open(Message):
    """A job: the workload (its random inputs are redrawn by seed), the arena's layout, and on a CPU
    the arena itself; on a GPU the worker allocates it and answers with Opened."""

    kind: Literal["open"] = "open"
    workload: Workload
    arena: ArenaHandle | None
    layout: ArenaLayout
    flush: str  # an L2 flush method (run/recipe.py), the judge's own
    flush_bytes: int = Field(ge=1, le=1 << 34)  # the size of the judge's flush buffers, which the worker's match

    @field_validator("arena")
    @classmethod
    def _judges_arena(cls, arena: ArenaHandle | None) -> ArenaHandle | None:
        if arena is not None and arena.kind != "memfd":
            raise ValueError("the judge hands over a memfd arena, or none")
        return arena


class Call(Message):
    """One call: on input set `set`, into output slot `slot`, after redrawing the set's random
    inputs from `seed` (None: as they are)."""

    set: int = Field(ge=0)
    slot: int = Field(ge=0)
    seed: int | None = None


class Batch(Message):
    kind: Literal["batch"] = "batch"
    calls: list[Call] = Field(max_length=MAX_BATCH_CALLS)
    fresh_seed: int = 0  # the batch's fresh input data (run/recipe.py)
    graph: bool = False  # replay a captured CUDA graph of (flush, call) per input set


class ReadTimes(Message):
    """After a batch's BatchDone, the worker's own times of its calls: read and sent outside the
    judge's clock, which stops at BatchDone."""

    kind: Literal["read_times"] = "read_times"


class Close(Message):
    kind: Literal["close"] = "close"


class Stop(Message):
    kind: Literal["stop"] = "stop"


Request = Annotated[Union[Setup, Probe, Build, Open, Batch, ReadTimes, Close, Stop], Field(discriminator="kind")]


# Worker -> judge.

class Ready(Message):
    kind: Literal["ready"] = "ready"


class Opened(Message):
    kind: Literal["opened"] = "opened"
    arena: ArenaHandle

    @field_validator("arena")
    @classmethod
    def _exported(cls, arena: ArenaHandle) -> ArenaHandle:
        if arena.kind != "cuda_ipc":
            raise ValueError("a worker exports a cuda_ipc arena only")
        return arena


class Failed(Message):
    kind: Literal["failed"] = "failed"
    status: FailureStatus
    message: str = Field(max_length=2000)


class BatchDone(Message):
    """The batch has run to its end on the device: the judge's clock for it stops here."""

    kind: Literal["batch_done"] = "batch_done"


MAX_CALL_MS = 1e7  # about three hours: past any run's timeout


class CallTimes(Message):
    """The worker's own times of the last batch's calls (ms): advisory, never the ranked figure."""

    kind: Literal["call_times"] = "call_times"
    event_ms: list[float]
    # How long the host took to issue the batch, to its last call (before waiting for the device): near
    # the judge's time for the batch, the host, not the device, bounded it. A diagnostic in traces only.
    issue_ms: float = Field(default=0.0, ge=0, le=MAX_CALL_MS, allow_inf_nan=False)
    # The link each call's redraw was rotated by (run/recipe.py output_link; 0 where none): the judge
    # replays the redraws with them and checks those of the calls it reads against their outputs.
    links: list[Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 63)]]
    # What the L2 flush before each call returned, the link its query signs were set from (recipe.L2Flush):
    # the judge replays the signs with them and recomputes those of the calls it reads.
    flushed: list[Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 63)]]

    @field_validator("event_ms")
    @classmethod
    def _finite(cls, values: list[float]) -> list[float]:
        if not all(math.isfinite(v) and 0 <= v <= MAX_CALL_MS for v in values):  # their sum must stay finite
            raise ValueError(f"times must be finite, not negative and at most {MAX_CALL_MS:g} ms")
        return values


Reply = Annotated[Union[Ready, Opened, Failed, BatchDone, CallTimes], Field(discriminator="kind")]

_requests = TypeAdapter(Request)
_replies = TypeAdapter(Reply)


class ProtocolError(Exception):
    """The other side sent something that is not a valid frame or message."""


class ChannelTimeout(Exception):
    pass


class ChannelClosed(Exception):
    pass


def frame(message: Message) -> bytes:
    """A message as it travels: its length, then its JSON."""
    payload = message.model_dump_json().encode()
    return _LENGTH.pack(len(payload)) + payload


class Channel:
    """Frames over a pair of pipe file descriptors."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd = read_fd
        self.write_fd = write_fd

    def send(self, message: Message | bytes, timeout: float | None = None) -> None:
        """`message`, or its frame made ahead (a timed request is encoded before its clock starts).
        ChannelTimeout when the other side takes too little of it within `timeout`: on a write end
        that is not blocking (the judge's), a reader that stops reading, with a pipe made small, cannot
        hold the sender."""
        data = memoryview(message if isinstance(message, bytes) else frame(message))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while data:
                try:
                    data = data[os.write(self.write_fd, data):]
                except BlockingIOError:  # the pipe is full: wait until the reader takes some
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if (remaining is not None and remaining <= 0) or \
                            not select.select([], [self.write_fd], [], remaining)[1]:
                        raise ChannelTimeout() from None
        except OSError as exc:  # BrokenPipeError included
            raise ChannelClosed(str(exc)) from None

    def pending(self) -> bool:
        """Something to read (a frame, or the end of the pipe) right now."""
        return bool(select.select([self.read_fd], [], [], 0)[0])

    def receive_json(self, timeout: float | None = None, on_arrival: Callable[[], None] = lambda: None,
                     max_bytes: int = MAX_FRAME_BYTES) -> bytes:
        """The next frame's payload. `on_arrival` runs once its first byte can be read (or the pipe's end),
        before any of it is: a sender that writes its frame slowly cannot stretch what comes after.
        `max_bytes`: the most the expected message can take (reply_limit), refused unread beyond it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait(deadline)
        on_arrival()
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size, deadline))
        limit = min(max_bytes, MAX_FRAME_BYTES)
        if length > limit:
            raise ProtocolError(f"a frame of {length} bytes; at most {limit} are accepted for this reply")
        return self._read(length, deadline)

    def _wait(self, deadline: float | None) -> None:
        """Until something can be read (or the pipe's end); ChannelTimeout past `deadline`."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if (remaining is not None and remaining <= 0) or not select.select([self.read_fd], [], [], remaining)[0]:
            raise ChannelTimeout()

    def _read(self, count: int, deadline: float | None) -> bytes:
        chunks, left = [], count
        while left:
            self._wait(deadline)
            chunk = os.read(self.read_fd, min(left, 1 << 16))
            if not chunk:
                raise ChannelClosed("the pipe was closed")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


ARENA_TAG = b"flashbench-arena"  # the payload of the one message that carries an arena's descriptor


def fd_socket_pair() -> tuple[socket.socket, socket.socket]:
    """(judge's end, worker's end) of the descriptor socket. The judge's end only sends, and never
    blocks: its receiving side is shut, so nothing the worker sends can queue up in the judge (a
    worker's send fails with EPIPE)."""
    judge, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    judge.shutdown(socket.SHUT_RD)
    judge.setblocking(False)
    return judge, worker


def send_fd(sock: socket.socket, fd: int) -> None:
    """The judge's side: one descriptor to the worker. (socket.send_fds would do, but in Python 3.11
    it drops its flags; the socket is non-blocking anyway.)"""
    try:
        sock.sendmsg([ARENA_TAG], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise ChannelClosed(str(exc)) from None
    except OSError as exc:  # EAGAIN: descriptors sent before were never taken; ETOOMANYREFS
        code = errno.errorcode.get(exc.errno, exc.errno)
        raise ProtocolError(f"the worker does not take the descriptors it is sent ({code})") from None


def receive_fd(sock: socket.socket) -> int:
    """The worker's side: the one descriptor the judge sent just before the Open frame it has read,
    so it is there already (a message that is not exactly ARENA_TAG and one descriptor is refused,
    every descriptor it carried closed). Close-on-exec: no process the solution starts inherits it."""
    fds = array.array("i")
    try:
        data, ancillary, flags, _ = sock.recvmsg(len(ARENA_TAG) + 1, socket.CMSG_SPACE(2 * fds.itemsize),
                                                 socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
    except BlockingIOError:
        raise ProtocolError("no arena descriptor came with the job") from None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if data == ARENA_TAG and len(fds) == 1 and not flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        return fds[0]
    for fd in fds:
        os.close(fd)
    raise ProtocolError(f"the arena's message holds {len(fds)} descriptor(s) and {len(data)} byte(s)")


# What any reply but CallTimes may take: a Failed's message of 2000 characters, each escaped (\\uXXXX), and its keys.
SMALL_REPLY_BYTES = 16 << 10
# Per call of a batch, what CallTimes may take: a float and two 64-bit integers written out, with their separators.
CALL_TIMES_BYTES_PER_CALL = 96


def reply_limit(request) -> int:
    """The largest frame an honest worker answers `request` with. The runner parses each reply holding the
    interpreter lock that every lane's judge shares: a reply padded to MAX_FRAME_BYTES (escaped duplicate keys
    are valid JSON) took 30-40 ms to parse on the 2-core machine, during which another lane's judge could not
    stop its clock. Bounded by what the reply can hold, the parse is as cheap as an honest one."""
    if isinstance(request, ReadTimes):
        return SMALL_REPLY_BYTES + CALL_TIMES_BYTES_PER_CALL * MAX_BATCH_CALLS
    return SMALL_REPLY_BYTES


def parse_reply(payload: bytes) -> Ready | Opened | Failed | BatchDone | CallTimes:
    try:
        return _replies.validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"not a valid reply: {_first_error(exc)}") from None


def parse_request(payload: bytes):
    return _requests.validate_json(payload)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "message"
    return shortened(f"{where}: {error['msg']}")

