"""The messages between the judge and a worker, and how they cross the pipe.

A frame is a 4-byte little-endian length and that many bytes of JSON, parsed into one of the
models below. No pickle, nothing that builds arbitrary objects: what a worker sends is
untrusted data, and anything malformed, oversized or unexpected is a ProtocolError that gives
that pair a verdict. Tensors never cross the pipe; they live in the job's arena (run/arena.py),
which the judge owns.
"""

import math
import os
import select
import struct
import time
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from ..model import Definition, Solution, Workload

VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # a reply is a status and a list of times; anything larger is not a reply
_LENGTH = struct.Struct("<I")

# What a worker may say went wrong. PASSED is not among them: only the judge reaches it.
FailureStatus = Literal["INCORRECT_SHAPE", "INCORRECT_DTYPE", "RUNTIME_ERROR", "COMPILE_ERROR", "INVALID_SOLUTION",
                        "REJECTED", "DEVICE_ERROR"]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class ArenaHandle(Message):
    """How a worker maps the arena: a file both processes map (CPU), or a CUDA IPC handle."""

    kind: Literal["file", "cuda_ipc"]
    path: str = ""
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
    flush: str  # an L2 flush method (run/flush.py)


class Call(Message):
    """One call: on input set `set`, into output slot `slot`, after redrawing the set's random
    inputs from `seed` (None: as they are)."""

    set: int = Field(ge=0)
    slot: int = Field(ge=0)
    seed: int | None = None


class Batch(Message):
    kind: Literal["batch"] = "batch"
    calls: list[Call]
    fresh_seed: int = 0  # the batch's fresh input data (run/recipe.py)
    graph: bool = False  # replay a captured CUDA graph of (flush, call) per input set


class Close(Message):
    kind: Literal["close"] = "close"


class Stop(Message):
    kind: Literal["stop"] = "stop"


Request = Annotated[Union[Setup, Probe, Build, Open, Batch, Close, Stop], Field(discriminator="kind")]


# Worker -> judge.

class Ready(Message):
    kind: Literal["ready"] = "ready"


class Opened(Message):
    kind: Literal["opened"] = "opened"
    arena: ArenaHandle


class Failed(Message):
    kind: Literal["failed"] = "failed"
    status: FailureStatus
    message: str = Field(max_length=2000)


class BatchDone(Message):
    """The worker's own per-call times (ms): advisory, never the ranked figure."""

    kind: Literal["batch_done"] = "batch_done"
    event_ms: list[float]

    @field_validator("event_ms")
    @classmethod
    def _finite(cls, values: list[float]) -> list[float]:
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError("times must be finite and not negative")
        return values


Reply = Annotated[Union[Ready, Opened, Failed, BatchDone], Field(discriminator="kind")]

_requests = TypeAdapter(Request)
_replies = TypeAdapter(Reply)


class ProtocolError(Exception):
    """The other side sent something that is not a valid frame or message."""


class ChannelTimeout(Exception):
    pass


class ChannelClosed(Exception):
    pass


class Channel:
    """Frames over a pair of pipe file descriptors."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd = read_fd
        self.write_fd = write_fd

    def send(self, message: Message) -> None:
        payload = message.model_dump_json().encode()
        data = _LENGTH.pack(len(payload)) + payload
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except (BrokenPipeError, OSError) as exc:
            raise ChannelClosed(str(exc)) from None

    def receive_json(self, timeout: float | None = None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size, deadline))
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"a frame of {length} bytes; at most {MAX_FRAME_BYTES} are accepted")
        return self._read(length, deadline)

    def _read(self, count: int, deadline: float | None) -> bytes:
        chunks, left = [], count
        while left:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([self.read_fd], [], [], remaining)[0]:
                    raise ChannelTimeout()
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


def parse_reply(payload: bytes) -> Ready | Opened | Failed | BatchDone:
    try:
        return _replies.validate_json(payload)
    except ValidationError as exc:
        raise ProtocolError(f"not a valid reply: {_first_error(exc)}") from None


def parse_request(payload: bytes):
    return _requests.validate_json(payload)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "message"
    return f"{where}: {error['msg']}"[:200]

