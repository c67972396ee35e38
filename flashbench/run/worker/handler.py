"""What a worker does with each request: probe the device, build the solution, open a job's
arena, run batches of calls."""

import ctypes
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from ...build import BuildError, load_entry_point
from ...dtypes import torch_dtype
from ...errors import shortened
from ...workloads import random_inputs
from ..arena import export_cuda, open_memfd_arena, views
from ..protocol import (Batch, BatchDone, Build, CallTimes, Close, Failed, Open, Opened, Probe, ReadTimes, Ready, Setup,
                        receive_fd)
from ..recipe import CallClock, InputSets, L2Flush, link_values, release_cached_memory, run_batch


# What a destination-passing call leaves in Job.returned: its outputs are in their slot already.
IN_SLOT = object()


class OutputProblem(Exception):
    """What the solution returned cannot be an output; carries the status it earns."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def failed(status: str, make: Callable[..., str], *parts: object, limit: int = 2000) -> Failed:
    """A Failed with the message `make(*parts)`, fitting its frame whatever the solution raised: cut to `limit`
    (Failed.message's max_length), lone surrogates escaped (a frame is UTF-8: pydantic refuses them), and a
    message that cannot even be made (an exception whose __str__ or an exit code whose __repr__ raises, whatever
    it raises: SystemExit and KeyboardInterrupt too) named as such. Any of these raised inside the handler's
    except clauses, and the worker died: CRASHED instead of the solution's error. Anything of the solution's that
    the message reads (an exit code, a type's name) is read inside `make`."""
    try:
        text = printable(make(*parts))
    except BaseException as exc:  # noqa: BLE001 - solution code's __str__ / __repr__ / __format__ / __name__
        text = f"(its message could not be made: {type_name(exc)})"
    return Failed(status=status, message=shortened(text, limit))


def printable(text: str) -> str:
    """`text` as UTF-8 can hold it (lone surrogates escaped), by str's own methods, not a subclass's override."""
    return str.encode(text, "utf-8", "backslashreplace").decode("utf-8")


def type_name(value: object) -> str:
    """The name of value's type, by type's own descriptor: a metaclass's __name__ property is solution code."""
    return printable(type.__dict__["__name__"].__get__(type(value)))


def described(exc: BaseException) -> str:
    return f"{type_name(exc)}: {exc}"


def log_traceback() -> None:
    """The exception being handled, into the worker's log (its stdout), whatever it holds: a lone surrogate (the
    log's UTF-8 refuses it) or a stdout the solution closed raised here, inside an except clause, and the worker
    died: CRASHED instead of the solution's error. The log is a diagnostic: what cannot be written is left out."""
    try:
        print(printable(traceback.format_exc()), flush=True)
    except BaseException:  # noqa: BLE001, S110
        pass


class Worker:
    def __init__(self, setup: Setup, fd_socket: socket.socket | None = None):
        self.setup = setup
        self.fd_socket = fd_socket  # where a CPU job's arena descriptor comes, right after its Open
        self.definition = setup.definition
        self.device = setup.device
        self.entry = None
        self.job: Job | None = None

    def handle(self, request):
        try:
            if isinstance(request, Probe):
                return self.probe()
            if isinstance(request, Build):
                return self.build()
            if isinstance(request, Open):
                self.job = None
                # Taken before anything can fail, so that no descriptor is left for the next job.
                arena_fd = None if request.arena is None else receive_fd(self.fd_socket)
                self.job = Job(self, request, arena_fd)
                return self.job.opened
            if isinstance(request, Batch):
                return self.job.batch(request)
            if isinstance(request, ReadTimes):
                return CallTimes(event_ms=self.job.clock.times_ms(), issue_ms=self.job.clock.issue_ms,
                                 links=link_values(self.job.links), flushed=link_values(self.job.flushed))
            if isinstance(request, Close):
                self.job = None
                release_cached_memory(self.device)  # the arena: the judge counts what an idle worker holds
                return Ready()
        except OutputProblem as exc:
            return failed(exc.status, str, exc)
        except SystemExit as exc:  # sys.exit() in solution code: an error, not the end of the worker
            return failed("RUNTIME_ERROR", lambda e: f"the solution called sys.exit({e.code!r})", exc)
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, GeneratorExit, a BaseException of its own
            log_traceback()
            return failed("RUNTIME_ERROR", described, exc)
        return Failed(status="RUNTIME_ERROR", message=f"unexpected request {type(request).__name__}")

    def probe(self):
        try:
            value = (torch.arange(4, device=self.device) * 2).sum().item()
        except Exception as exc:
            return failed("DEVICE_ERROR", described, exc, limit=500)
        if value != 12:
            return Failed(status="DEVICE_ERROR", message=f"0+2+4+6 gave {value}")
        return Ready()

    def build(self):
        solution = self.setup.solution
        if torch.device(self.device).type == "cpu":
            keep_freed_memory()
        try:
            self.entry = load_entry_point(Path(self.setup.folder), solution, Path(self.setup.build_dir))
        except BuildError as exc:
            log_traceback()
            status = "COMPILE_ERROR" if solution.language == "cuda" else "INVALID_SOLUTION"
            return failed(status, str, exc)
        return Ready()


# glibc's mallopt parameters
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
# Chunks under this come from the heap and stay there once freed; larger ones are still mapped and given back
# (with no mapped chunk at all, freed multi-GB tensors left holes the heap never returned, and a CPU worker under
# its address-space limit ran out of memory: a reviewer).
MAPPED_FROM_BYTES = 32 << 20


def keep_freed_memory() -> None:
    """The allocator keeps what is freed, set before any solution code runs. A CPU batch's steps allocate fresh
    tensors whose pages glibc by default maps and hands back, so each batch faulted them in anew, and the judge,
    which subtracts its own warm run of the steps, charged that to the solution: one that set such options itself
    at import ranked 1.6-1.9x faster than the same code without (a red team)."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):  # glibc
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(M_TOP_PAD, 64 << 20)
        libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM_BYTES)


class Job:
    """One workload's arena: input sets and output slots, viewed as tensors."""

    def __init__(self, worker: Worker, request: Open, arena_fd: int | None = None):
        self.worker = worker
        self.definition = worker.definition
        self.device = worker.device
        if arena_fd is None:  # a GPU: the arena is this process's memory, the judge maps it
            memory = torch.empty(max(request.layout.nbytes, 1), dtype=torch.uint8, device=self.device)
            self.opened = Opened(arena=export_cuda(memory))
        else:  # a CPU: the judge's sealed memfd (closed once mapped)
            memory = open_memfd_arena(arena_fd, request.layout.nbytes)
            self.opened = Ready()
        self.memory = memory
        self.scalars = request.layout.scalars
        sets = [views(memory, slots) for slots in request.layout.sets]
        self.slots = [views(memory, slots) for slots in request.layout.slots]
        self.inputs = InputSets(self.definition, request.workload, sets, random_inputs(self.definition, request.workload))
        flush_buffer = None if request.layout.flush is None else views(memory, {"flush": request.layout.flush})["flush"]
        self.flush = L2Flush(request.flush, self.device, request.flush_bytes, flush_buffer)
        self.clock = CallClock(self.device, len(self.slots))  # a batch has at most one call per slot
        self.returned = None  # what the last call returned, IN_SLOT for a destination-passing one
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.links: list = []  # the last batch's, one per call (run_batch)
        self.flushed: list = []

    def batch(self, request: Batch):
        invoke, after = (self.replay, self.copy_replayed) if request.graph else (self.call, self.store)
        self.links, self.flushed = run_batch(request, self.inputs, self.flush, invoke, after, self.clock,
                               lambda call: list(self.slots[call.slot].values()))
        return BatchDone()

    def arguments(self, call) -> list:
        tensors = self.inputs.sets[call.set]
        return [tensors[name] if name in tensors else self.scalars[name] for name in self.definition.inputs]

    def call(self, call) -> None:
        arguments = self.arguments(call)
        if self.worker.setup.solution.destination_passing_style:
            self.worker.entry(*arguments, *self.slots[call.slot].values())
            self.returned = IN_SLOT
        else:
            self.returned = self.worker.entry(*arguments)

    def store(self, call) -> None:
        """Returned outputs go into the call's slot, where the judge reads them."""
        returned, self.returned = self.returned, None
        if returned is IN_SLOT:
            return
        names = list(self.definition.outputs)
        if returned is None or isinstance(returned, dict):
            raise OutputProblem("INCORRECT_SHAPE", f"returned {'None' if returned is None else 'a dict'}; with "
                                f"destination_passing_style: false the function returns its outputs, a tuple in the "
                                f"definition's order ({', '.join(names)})")
        outputs = returned if isinstance(returned, (tuple, list)) else (returned,)
        if len(outputs) != len(names):
            raise OutputProblem("INCORRECT_SHAPE", f"returned {len(outputs)} values; the definition has {len(names)} outputs")
        for name, value in zip(names, outputs):
            self.check_output(name, value, self.slots[call.slot][name], self.inputs.sets[call.set])
        torch._foreach_copy_([self.slots[call.slot][name] for name in names], list(outputs))

    def check_output(self, name: str, value, slot: torch.Tensor, inputs: dict) -> None:
        if not isinstance(value, torch.Tensor):
            raise OutputProblem("INCORRECT_DTYPE", f"output {name} is not a torch.Tensor but {type(value).__qualname__}")
        if type(value) is not torch.Tensor:  # a subclass could compute, or change, on inspection
            raise OutputProblem("REJECTED", f"output {name} is a torch.Tensor subclass {type(value).__qualname__}; "
                                            "outputs must be plain tensors")
        aliased = _aliased_input(value, inputs)
        if aliased:
            raise OutputProblem("REJECTED", f"output {name} is a view of input {aliased}")
        if value.device.type != slot.device.type:
            raise OutputProblem("RUNTIME_ERROR", f"output {name} is on {value.device.type}, expected {slot.device.type}")
        if list(value.shape) != list(slot.shape):
            raise OutputProblem("INCORRECT_SHAPE", f"output {name} has shape {list(value.shape)}, expected {list(slot.shape)}")
        if value.dtype != torch_dtype(self.definition.outputs[name].dtype):
            raise OutputProblem("INCORRECT_DTYPE", f"output {name} is {str(value.dtype).removeprefix('torch.')}, "
                                                   f"expected {self.definition.outputs[name].dtype}")

    def replay(self, call) -> None:
        """Graph timing: the call captured once per input set (writing the slot numbered like the set),
        then replayed."""
        graph = self.graphs.get(call.set)
        if graph is None:
            graph = self.graphs[call.set] = self.capture(call.model_copy(update={"slot": call.set}))
        graph.replay()

    def copy_replayed(self, call) -> None:
        """A replay's outputs into the call's own slot (not timed), where the judge may check them."""
        if call.slot != call.set:  # one launch for all outputs: the judge's baseline does the same
            torch._foreach_copy_(list(self.slots[call.slot].values()), list(self.slots[call.set].values()))

    def capture(self, call) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.call(call)  # a warm-up outside the capture: lazy initialisation must not be captured
            self.store(call)
            try:
                with torch.cuda.graph(graph, stream=stream):
                    self.call(call)
                    self.store(call)
            except RuntimeError as exc:
                raise RuntimeError(f"the call cannot be captured in a CUDA graph, which --timing graph needs "
                                   f"(time it with --timing events): {exc}") from exc
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph


def _aliased_input(value: torch.Tensor, inputs: dict) -> str | None:
    """The input whose bytes `value` shares, if any (inputs are views of one arena, so their
    storages are one: compare byte ranges)."""
    start, end = _byte_span(value)
    for name, tensor in inputs.items():
        begin, stop = _byte_span(tensor)
        if value.device == tensor.device and start < stop and begin < end:
            return name
    return None


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses from a tensor's first byte to past its last, by its strides: numel x size overstated an
    expanded output's (stride 0), which could reach into the arena beside it and read as a view of an input."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), tensor.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()
