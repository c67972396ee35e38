"""flashbench's Python API, the layer the `flashbench` command is built on (docs/python_api.md).

    import flashbench as fb

    registry = fb.load()                                # or fb.Registry(root): definitions, solutions, workloads
    frame = registry.results("mla_paged_decode", hardware="nvidia_h200")    # recorded results, a DataFrame
    report = fb.run("mla_paged_decode", solutions=["triton_splitkv"], device="cpu")   # a RunReport
    decode = fb.best("mla_paged_decode", device="cuda")  # the fastest passed solution here, else the reference

Names may be unique prefixes, as on the command line. Bad input raises FlashbenchError naming what
and where, in the words of the command's flags (`--device`), which the API's keywords spell without
dashes. `best` imports solution code into the calling process: the caller's explicit opt-in. The
harness never does: its judge runs solutions only in sandboxed workers.
"""

import inspect
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from pydantic import ValidationError

from .binding import bind_axes, output_shapes
from .build import CACHE_DIR_NAME, BuildError, load_entry_point
from .calibrate import load_calibration
from .dtypes import torch_dtype
from .environment import hardware_name
from .errors import FlashbenchError
from .model import REFERENCE, Definition, RunReport, Solution, Trace, Workload
from .model.loading import validation_error
from .model.run_report import HOST_CLOCK
from .registry import Repo, SolutionFolder, use_root
from .run import RunOptions, RunResult, Runner, default_device, parse_devices, select_solutions, select_workloads
from .run.judge.evaluators import reference_sampler
from .run.plan import solution_candidate
from .run.recipe import DEFAULT_FLUSH
from .traces import hardware_slug, read_traces, trace_file_name, trace_path
from .workloads import generate_inputs

if TYPE_CHECKING:
    import pandas as pd  # loaded with the leaderboard, by the methods that need it

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class Registry(Repo):
    """A flashbench repository: its definitions, workloads and solutions, and the results recorded
    under its traces/. Loads lazily; every error names its file."""

    def definitions(self) -> list[Definition]:
        return [self.definition(name) for name in self.names()]

    def solutions(self, definition: str) -> list[Solution]:
        """The solutions under solutions/<definition>/ (`solution_folders` has their paths)."""
        return [folder.solution for folder in self.solution_folders(definition)]

    def workloads(self, definition: str, selectors: Sequence[str] = (), device: str | None = None) -> list[Workload]:
        """By uuid (or its prefix), name or tag; without selectors all of them, or on device "cpu" the
        smoke ones, as a run picks them."""
        return select_workloads(self, self.resolve(definition), one_or_many(selectors), device)

    def inputs(self, definition: str, workload: str | Workload, seed: int = 0, device: str = "cpu") -> dict:
        """One workload's inputs (the Workload, or its uuid or name), drawn from `seed` on `device`, in the
        order of the definition's inputs: what its reference, and `best`, take."""
        name = self.resolve(definition)
        if not isinstance(workload, Workload):
            matched = self.workloads(name, [workload])
            if len(matched) != 1:
                raise FlashbenchError(f"{workload!r} matches {len(matched)} workloads; name one")
            workload = matched[0]
        spec = self.definition(name)
        made = generate_inputs(spec, workload, seed, device, self.definition_path(name).parent)
        return {input_name: made[input_name] for input_name in spec.inputs}

    def traces(self, definition: str, hardware: str | None = None, timing: str = "events",
               trace_dir: Path | None = None) -> list[Trace]:
        """The recorded traces of a definition timed one way: one hardware's (a name or its folder), or
        every hardware folder's."""
        name, root = self.resolve(definition), self.trace_root(trace_dir)
        paths = ([trace_path(root, hardware, name, timing)] if hardware
                 else sorted(root.glob(f"*/{trace_file_name(name, timing)}")))
        return [trace for path in paths for trace in read_traces(path)]

    def results(self, definition: str, hardware: str | None = None, *, timing: str = "events",
                trace_dir: Path | None = None, isolation: str | None = None, current: bool = True,
                hide_stale: bool = False) -> "pd.DataFrame":
        """Recorded results, one row each (the columns of leaderboard/results.py), `stale` marked against
        the solution folders as they are now. current: only the latest run of each solution's newest
        content hash per hardware (what a board ranks); else every trace. hide_stale: leave out results
        whose solution folder has changed since."""
        from .leaderboard.results import current_results, mark_stale, read_results, solution_hashes

        name = self.resolve(definition)
        frame = read_results(self.trace_root(trace_dir), name, hardware, timing, isolation)
        frame = mark_stale(frame, solution_hashes(self, name))
        if hide_stale:
            frame = frame[~frame["stale"]]
        return current_results(frame) if current else frame.reset_index(drop=True)

    def run(self, definition: str, solutions: Sequence[str | Path] = (), workloads: Sequence[str | Workload] = (),
            device: str | None = None, *, on_result: Callable[[Trace], None] | None = None, **options) -> RunReport:
        """Check and time solutions (names or folders; none: every one) and the reference on workloads
        (uuid, name, tag; none: all, on a CPU the smoke ones), recording traces as `flashbench run` does.
        `options` are run_options' (warmup, iters, seed, timeout, timing, resume, save, trace_dir,
        devices, backend, address, flush, checked_calls); on_result sees each trace as it is recorded."""
        name = self.resolve(definition)
        chosen_options = run_options(device, **options)
        folders = select_solutions(self, name, [str(s) for s in one_or_many(solutions)])
        chosen = select_workloads(self, name, [w.uuid if isinstance(w, Workload) else w for w in one_or_many(workloads)],
                                  chosen_options.device)
        runner = Runner(self, name, chosen_options, on_result=on_result or (lambda trace: None))
        result = runner.run(runner.candidates(folders), chosen)
        return run_report("run", self, name, chosen_options, result, interrupted=False)

    def best(self, definition: str, device: str | None = None, *, trace_dir: Path | None = None,
             timing: str = "events", include_smoke: bool = False) -> "Best":
        """The fastest solution of a definition on a device's hardware (cpu, cuda, cuda:N; None: this
        machine's default) or on a hardware named (e.g. "NVIDIA H200" or its folder nvidia_h200), loaded
        into this process and callable like the reference; the reference when none qualifies.

        It qualifies by the recorded traces, as the board of that hardware ranks them: results of the
        solution's folder as it is now (none stale), valid (PASSED, not under the speed-of-light floor)
        on every workload the board has, with the highest geomean speedup over the reference, above 1,
        on the timed workloads (include_smoke: the smoke ones too, all a CPU run has)."""
        name = self.resolve(definition)
        hardware = hardware_of(device)
        root = self.trace_root(trace_dir)
        if device is not None and not _DEVICE.fullmatch(device) and not (root / hardware).is_dir():
            known = sorted(path.name for path in root.iterdir() if path.is_dir()) if root.is_dir() else []
            raise FlashbenchError(f"no traces of hardware {device!r} here; known: {', '.join(known) or 'none'}", root)
        chosen = self._fastest(name, hardware, root, timing, include_smoke)
        if chosen is None:
            return Best(self.definition(name), REFERENCE, hardware, None, None, self._reference_callable(name), False)
        folder, speedup = chosen
        return Best(self.definition(name), folder.solution.name, hardware, speedup, folder.path,
                    self._entry_function(folder), folder.solution.destination_passing_style)

    def load_solution(self, definition: str, solution: str) -> Callable:
        """The entry function of a solution folder of a definition, staged with its shared files and built as
        a worker builds it, loaded into this process; called as its folder says (destination-passing or
        returning its outputs)."""
        name = self.resolve(definition)
        folders = {folder.solution.name: folder for folder in self.solution_folders(name)}
        if solution not in folders:
            known = ", ".join(sorted(folders)) or "none"
            raise FlashbenchError(f"no solution {solution!r} of {name}; there are: {known}",
                                  self.root / "solutions" / name)
        return self._entry_function(folders[solution])

    def _entry_function(self, folder: SolutionFolder) -> Callable:
        cache_dir = self.root / CACHE_DIR_NAME
        loaded = solution_candidate(folder, cache_dir)  # the folder, staged with its shared files, as a worker loads it
        try:
            # Built apart from the workers' build directories, which a worker writes: what this process
            # loads must come from the hashed files alone.
            return load_entry_point(loaded.folder, loaded.solution, cache_dir / "build-in-process" / loaded.hash)
        except BuildError as exc:
            raise FlashbenchError(f"cannot load solution {folder.solution.name}: {exc}", folder.path / "solution.yaml",
                                  "entry_point") from None

    def _reference_callable(self, name: str) -> Callable:
        """The reference, called as a solution: a sampling definition's returns distributions, so it samples them."""
        definition, reference = self.definition(name), self.reference(name)
        return reference_sampler(reference, definition) if definition.evaluator.kind == "sampling" else reference

    def _fastest(self, name: str, hardware: str, trace_dir: Path, timing: str,
                 include_smoke: bool) -> tuple[SolutionFolder, float] | None:
        from .leaderboard import leaderboards, solution_hashes

        workload_set = self.workload_set(name)
        boards = leaderboards(trace_dir, name, workload_set.workloads if workload_set else None, hardware,
                              timing=timing, include_smoke=include_smoke,
                              current_hashes=solution_hashes(self, name), hide_stale=True)
        if not boards:
            return None
        folders = {folder.solution.name: folder for folder in self.solution_folders(name)}
        ranking = boards[0].ranking
        qualified = ranking[ranking["solution"].isin(folders) & (ranking["passed"] == ranking["total"])
                            & (ranking["speedup_vs_reference"] > 1)]
        if qualified.empty:
            return None
        fastest = qualified.loc[qualified["speedup_vs_reference"].idxmax()]
        return folders[fastest["solution"]], float(fastest["speedup_vs_reference"])

    def trace_root(self, trace_dir: Path | None = None) -> Path:
        return Path(trace_dir) if trace_dir else self.root / "traces"


@dataclass(frozen=True)
class Best:
    """The solution `best` chose, called like the definition's reference: inputs in order or by name,
    the outputs returned (a tensor, or a tuple of them in order). Inputs are checked against the
    definition (dtypes, shapes, constraints) on every call; a destination-passing solution gets its
    outputs allocated on the device of the inputs."""

    definition: Definition = field(repr=False)
    name: str  # the solution's, or "reference"
    hardware: str  # the traces folder it was chosen from
    speedup: float | None  # geomean speedup over the reference there; None for the reference
    folder: Path | None
    function: Callable = field(repr=False)
    destination_passing: bool

    def __call__(self, *args, **kwargs):
        inputs = self._signature.bind(*args, **kwargs).arguments
        axes = bind_axes(self.definition, inputs)
        if not self.destination_passing:
            return self.function(*inputs.values())
        device = next(value.device for value in inputs.values() if isinstance(value, torch.Tensor))
        shapes = output_shapes(self.definition, axes)
        outputs = [torch.empty(shapes[name], dtype=torch_dtype(spec.dtype), device=device)
                   for name, spec in self.definition.outputs.items()]
        self.function(*inputs.values(), *outputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                  for name in self.definition.inputs])


def one_or_many(given) -> list:
    """Selectors as a list: one name, path or workload is a list of one (a string was read character by
    character: "47" selected every workload whose uuid starts with 4 or 7)."""
    return [given] if isinstance(given, (str, Path, Workload)) else list(given)


def load(root: Path | str | None = None) -> Registry:
    """The repository at root, which becomes this process's (registry.use_root: the FP8 quantize reference is
    found there); None: $FLASHBENCH_ROOT, else the nearest folder upwards holding definitions/."""
    if root is not None:
        use_root(Path(root))
    return Registry(root)


def run(definition: str, solutions: Sequence[str | Path] = (), workloads: Sequence[str | Workload] = (),
        device: str | None = None, *, root: Path | str | None = None, **options) -> RunReport:
    """Registry(root).run(...): check, time and record solutions of a definition."""
    return load(root).run(definition, solutions, workloads, device, **options)


def best(definition: str, device: str | None = None, *, root: Path | str | None = None, **options) -> Best:
    """Registry(root).best(...): the fastest recorded solution, loaded into this process, else the reference."""
    return load(root).best(definition, device, **options)


def hardware_of(device: str | None) -> str:
    """The traces folder of a device (cpu, cuda, cuda:N; None: this machine's default) or of a hardware name."""
    if device is None or _DEVICE.fullmatch(device):
        return hardware_slug(hardware_name(resolve_device(device)))
    return hardware_slug(device)


def resolve_device(name: str | None) -> str:
    """A device checked before any work starts: cpu, cuda or cuda:N of a visible GPU; None: cuda when a
    GPU is visible, else cpu."""
    if name is None:
        return default_device()
    kind, colon, index = name.partition(":")
    if name == "cpu":
        return name
    if kind != "cuda" or (colon and not index.isdigit()):
        raise FlashbenchError(f"--device {name!r} is not a device flashbench runs on; give cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise FlashbenchError(f"--device {name}: no CUDA device is visible; run with --device cpu, or on a machine with a GPU")
    count = torch.cuda.device_count()
    if colon and int(index) >= count:
        raise FlashbenchError(f"--device {name}: no GPU {index}, {count} visible; give cuda:0 to cuda:{count - 1}")
    return name


def run_options(device: str | None = None, warmup: int | None = None, iters: int | None = None,
                seed: int | None = None, timeout: float = 300.0, timing: str = "events", resume: bool = False,
                save: bool = True, trace_dir: Path | str | None = None, devices: str | None = None,
                backend: str = "local", address: str | None = None, flush: str = DEFAULT_FLUSH,
                checked_calls: int | None = None) -> RunOptions:
    """RunOptions with the defaults of the device: 1 warm-up call and 5 timed on a CPU, 10 and 100 on a
    GPU. devices: a pool (`parse_devices`), instead of one device."""
    pool = device_pool(device, devices, backend, address)
    device = pool[0] if pool else resolve_device(device)
    on_cpu = device == "cpu"
    try:
        return RunOptions(
            device=device, devices=pool, backend=backend, ray_address=address,
            warmup=warmup if warmup is not None else (1 if on_cpu else 10),
            iters=iters if iters is not None else (5 if on_cpu else 100), seed=seed, timeout=timeout,
            timing=timing, resume=resume, save=save, trace_dir=Path(trace_dir) if trace_dir else None, flush=flush,
            checked_calls=checked_calls,
        )
    except ValidationError as exc:
        raise validation_error(exc, None) from None


def device_pool(device: str | None, devices: str | None, backend: str, address: str | None) -> list[str] | None:
    if address and backend != "ray":
        raise FlashbenchError("--address is for --backend ray")
    if devices is None:
        return None
    if device:
        raise FlashbenchError("give --device or --devices, not both")
    if backend == "ray":
        raise FlashbenchError("--devices is for the local backend; Ray gives every job a device of its own")
    return parse_devices(devices)


def run_report(command: str, repo: Repo, definition_name: str, options: RunOptions, result: RunResult,
               interrupted: bool, submitted_to: str | None = None) -> RunReport:
    """The document of a run (or submit): its traces, the calibration's floors, how it was run."""
    hardware = hardware_name(options.device)
    calibration = load_calibration(options.trace_dir or repo.root / "traces", hardware)
    return RunReport.from_traces(
        result.traces, calibration, str(result.trace_file) if options.save else None,
        command=command, definition=definition_name, hardware=hardware, devices=options.devices or [options.device],
        backend=options.backend, timing_method=options.timing if options.on_gpu else HOST_CLOCK,
        isolation=result.isolation or None, interrupted=interrupted,
        skipped=len(result.skipped), skipped_failed=sum(t.status != "PASSED" for t in result.skipped),
        submitted_to=submitted_to,
    )
