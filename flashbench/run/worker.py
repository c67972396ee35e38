"""The worker process: the only place solution code runs.

It builds the solution, makes its own input sets (the same seeds give the same inputs the
runner's reference saw), calls the solution, times it, and sends back outputs and raw
samples over a private pipe. It never sees reference outputs, and its stdout/stderr go to a
log file that the runner only shows, never parses.
"""

import os
import sys
import traceback
from pathlib import Path

import torch

from . import timing  # captures the clocks before any solution code is imported
from ..binding import bind_axes, output_shapes
from ..build import BuildError, load_entry_point
from ..dtypes import is_float, torch_dtype
from ..model import Definition, Solution, Workload
from ..workloads import generate_inputs


def worker_main(conn, log_path: str, config: dict) -> None:
    _die_with_parent()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if config["device"] == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels run on CPU under the interpreter
    worker = Worker(config)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request["op"] == "stop":
            return
        conn.send(worker.handle(request))


def _die_with_parent() -> None:
    """A runner killed outright (SIGKILL) cannot end its worker; on Linux the kernel does it, so
    a solution stuck in a loop does not keep running on its own."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import multiprocessing
    import signal

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the runner died before the line above
        os._exit(1)


class Worker:
    def __init__(self, config: dict):
        self.definition = Definition.model_validate(config["definition"])
        self.solution = Solution.model_validate(config["solution"])
        self.folder = Path(config["folder"])
        self.device = config["device"]
        self.cache_dir = Path(config["cache_dir"])
        self.entry = None

    def handle(self, request: dict) -> dict:
        try:
            if request["op"] == "build":
                return self.build()
            return self.run_job(request)
        except Exception as exc:  # the solution failed; report it, stay alive for the next job
            print(traceback.format_exc(), flush=True)
            return {"ok": False, "status": "RUNTIME_ERROR", "message": _summary(exc)}

    def build(self) -> dict:
        try:
            self.entry = load_entry_point(self.folder, self.solution, self.cache_dir)
        except BuildError as exc:
            print(traceback.format_exc(), flush=True)
            status = "COMPILE_ERROR" if self.solution.language == "cuda" else "INVALID_SOLUTION"
            return {"ok": False, "status": status, "message": str(exc)}
        return {"ok": True}

    def run_job(self, request: dict) -> dict:
        workload = Workload.model_validate(request["workload"])
        base_dir = Path(request["base_dir"])
        sets = [generate_inputs(self.definition, workload, seed, self.device, base_dir) for seed in request["seeds"]]
        shapes = output_shapes(self.definition, bind_axes(self.definition, sets[0]))
        outputs = [self.allocate_outputs(shapes) for _ in sets]
        pristine = [_clone(s) for s in sets]

        def prepare(i: int) -> None:
            for tensor in outputs[i].values():
                _poison(tensor)

        results: list = [None] * len(sets)

        def call(i: int) -> None:
            results[i] = self.call(sets[i], outputs[i])

        first = []
        for i in range(len(sets)):
            prepare(i)
            call(i)
            first.append(_to_host(results[i]))
        prepare(0)
        call(0)
        rerun = _to_host(results[0])
        reply = {"ok": True, "outputs": first, "rerun": rerun}
        if request.get("timing"):
            timed_outputs = lambda: [_to_host(r) for r in results]  # noqa: E731
            reply.update(self.measure(call, prepare, len(sets), request["timing"], timed_outputs))
        reply["inputs_mutated"] = [name for s, p in zip(sets, pristine) for name in _changed(s, p)]
        return reply

    def allocate_outputs(self, shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        if not self.solution.destination_passing_style:
            return {}
        return {
            name: torch.empty(shape, dtype=torch_dtype(self.definition.outputs[name].dtype), device=self.device)
            for name, shape in shapes.items()
        }

    def call(self, inputs: dict, outputs: dict[str, torch.Tensor]):
        args = [inputs[name] for name in self.definition.inputs]
        if self.solution.destination_passing_style:
            self.entry(*args, *outputs.values())
            return dict(outputs)
        returned = self.entry(*args)
        if not isinstance(returned, (tuple, list)):
            returned = (returned,)
        if len(returned) != len(self.definition.outputs):
            raise ValueError(f"returned {len(returned)} values; the definition has {len(self.definition.outputs)} outputs")
        return dict(zip(self.definition.outputs, returned))

    def measure(self, call, prepare, sets: int, params: dict, timed_outputs) -> dict:
        """Raw samples, plus the outputs of the last timed call on each set, taken before the
        crosscheck (whose preparation-only batch poisons the outputs again)."""
        if self.device == "cpu":
            timer = timing.HostTimer()
        else:
            timer = timing.CudaTimer(self.device, params["flush_bytes"])
        timer.warm_up(call, prepare, sets, params["warmup"])
        if params["method"] == "graph" and self.device != "cpu":
            samples = timer.graph(call, prepare, sets, params["iters"])
        else:
            samples = timer.events(call, prepare, sets, params["iters"])
        reply = {"samples": samples, "timed_outputs": timed_outputs()}
        reply["wall_ms"] = timer.wall_clock(call, prepare, sets, max(params["iters"] // 4, 5))
        return reply


def _poison(tensor: torch.Tensor) -> None:
    if is_float(str(tensor.dtype).removeprefix("torch.")):
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _to_host(outputs: dict) -> dict:
    """Plain CPU copies for the runner; anything that is not a plain tensor is described instead."""
    host = {}
    for name, value in outputs.items():
        if type(value) is not torch.Tensor:
            host[name] = f"not a plain torch.Tensor but {type(value).__module__}.{type(value).__qualname__}"
        else:
            host[name] = {"tensor": value.detach().to("cpu", copy=True).contiguous(), "device": value.device.type}
    return host


def _clone(inputs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _changed(inputs: dict, pristine: dict) -> list[str]:
    return [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and not torch.equal(v, pristine[k])]


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]
