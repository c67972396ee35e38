"""The worker process: the only place solution code runs.

It builds the solution, makes its own input sets (the same seeds give the same inputs the
runner's reference saw), calls the solution, times it, and sends back outputs and raw
samples over a private pipe. It never sees reference outputs, and its stdout/stderr go to a
log file that the runner only shows, never parses.
"""

import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from . import timing  # captures the clocks before any solution code is imported
from ..binding import bind_axes, output_shapes
from ..build import BuildError, load_entry_point
from ..dtypes import is_float, torch_dtype
from ..model import Definition, Solution, Workload
from ..workloads import generate_inputs, random_inputs, redraw_random_inputs


def worker_main(conn, log_path: str, config: dict) -> None:
    _die_with_parent()
    os.setsid()  # a group of its own: whatever the solution starts can be found and ended with it
    os.chdir(tempfile.mkdtemp(prefix="flashbench-worker-"))  # relative paths lead nowhere useful
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if config["device"] == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels run on CPU under the interpreter
        _limit_memory(config.get("memory_limit_bytes"))
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


def _limit_memory(limit: int | None) -> None:
    """On a CPU a runaway allocation fails in the worker instead of waking the OOM killer."""
    if limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class Worker:
    def __init__(self, config: dict):
        self.definition = Definition.model_validate(config["definition"])
        self.solution = Solution.model_validate(config["solution"])
        self.folder = Path(config["folder"])
        self.device = config["device"]
        self.build_dir = Path(config["build_dir"])
        self.entry = None

    def handle(self, request: dict) -> dict:
        try:
            if request["op"] == "probe":
                return self.probe()
            if request["op"] == "build":
                return self.build()
            return self.run_job(request)
        except SystemExit as exc:  # sys.exit() in solution code: an error, not the end of the worker
            return {"ok": False, "status": "RUNTIME_ERROR", "message": f"the solution called sys.exit({exc.code!r})"}
        except Exception as exc:  # the solution failed; report it, stay alive for the next job
            print(traceback.format_exc(), flush=True)
            return {"ok": False, "status": "RUNTIME_ERROR", "message": _summary(exc)}

    def probe(self) -> dict:
        """A small computation read back from the device, before any solution code is imported:
        failing it is the device's fault (or its name's), never the solution's."""
        try:
            value = (torch.arange(4, device=self.device) * 2).sum().item()
        except Exception as exc:
            return {"ok": False, "status": "DEVICE_ERROR", "message": _summary(exc)}
        if value != 12:
            return {"ok": False, "status": "DEVICE_ERROR", "message": f"0+2+4+6 gave {value}"}
        return {"ok": True}

    def build(self) -> dict:
        try:
            self.entry = load_entry_point(self.folder, self.solution, self.build_dir)
        except BuildError as exc:
            print(traceback.format_exc(), flush=True)
            status = "COMPILE_ERROR" if self.solution.language == "cuda" else "INVALID_SOLUTION"
            return {"ok": False, "status": status, "message": str(exc)}
        return {"ok": True}

    def run_job(self, request: dict) -> dict:
        """First calls on every input set (variant 0), a repeated call on set 0, then the timed
        calls, each on a fresh redraw of its set's random inputs. Every checked output comes back
        with the (set, variant) whose inputs produced it."""
        workload = Workload.model_validate(request["workload"])
        base_dir = Path(request["base_dir"])
        seeds = request["seeds"]
        sets = [generate_inputs(self.definition, workload, seed, self.device, base_dir) for seed in seeds]
        shapes = output_shapes(self.definition, bind_axes(self.definition, sets[0]))
        outputs = [self.allocate_outputs(shapes) for _ in sets]
        pristine = [_clone(s) for s in sets]
        redrawn = random_inputs(self.definition, workload)
        variants = [0] * len(sets)
        results: list = [None] * len(sets)

        def poison(i: int) -> None:
            for tensor in outputs[i].values():
                _poison(tensor)

        def fresh_inputs(i: int) -> None:
            variants[i] += 1
            redraw_random_inputs(self.definition, workload, sets[i], redrawn, seeds[i], variants[i])
            for name in redrawn:
                pristine[i][name].copy_(sets[i][name])
            poison(i)

        def call(i: int) -> None:
            results[i] = self.call(sets[i], outputs[i])

        def snapshot(i: int) -> dict:
            return {"set": i, "variant": variants[i], "outputs": _to_host(results[i], sets[i])}

        checked = []
        for i in range(len(sets)):
            poison(i)
            call(i)
            checked.append(snapshot(i))
        poison(0)
        call(0)
        reply = {"ok": True, "rerun": snapshot(0), "inputs_mutated": _mutated(sets, pristine)}
        if request.get("timing"):
            timed = lambda: [snapshot(i) for i in range(len(sets))]  # noqa: E731
            reply.update(self.measure(call, fresh_inputs, len(sets), request["timing"], timed))
            reply["inputs_mutated"] += _mutated(sets, pristine)
        reply["checked"] = checked + reply.pop("timed_outputs", [])
        reply["timer_tampered"] = timing.tampered()
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
        if self.device != "cpu":
            reply["wall_ms"], reply["host_call_ms"] = timer.wall_clock(call, prepare, sets, max(params["iters"] // 4, 5))
        return reply


def _poison(tensor: torch.Tensor) -> None:
    if is_float(str(tensor.dtype).removeprefix("torch.")):
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _to_host(outputs: dict, inputs: dict) -> dict:
    """Plain CPU copies for the runner; anything else (a tensor subclass, a view of an input) is
    described instead, without calling into it."""
    storages = {name: value.untyped_storage().data_ptr() for name, value in inputs.items()
                if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes()}
    host = {}
    for name, value in outputs.items():
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if not isinstance(value, torch.Tensor):
            host[name] = f"not a torch.Tensor but {kind}"
            continue
        if type(value) is not torch.Tensor:  # a subclass could compute, or change, on inspection
            host[name] = {"rejected": f"a torch.Tensor subclass {kind}; outputs must be plain tensors"}
            continue
        aliased = [k for k, ptr in storages.items() if value.untyped_storage().data_ptr() == ptr]
        if aliased:
            host[name] = {"rejected": f"a view of input {aliased[0]}"}
        else:
            host[name] = {"tensor": value.detach().to("cpu", copy=True).contiguous(), "device": value.device.type}
    return host


def _clone(inputs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _mutated(sets: list[dict], pristine: list[dict]) -> list[str]:
    return [k for s, p in zip(sets, pristine) for k, v in s.items()
            if isinstance(v, torch.Tensor) and not torch.equal(v, p[k])]


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]
