"""`flashbench run`: every (solution, workload) pair through build, check and timing, into traces.

The runner process holds the reference outputs, the checker and the trace writer; solution
code only ever runs in a worker process (run/worker.py). A job is one (candidate, workload)
pair; the jobs run on a pool of devices (run/pool.py, one device by default) or as Ray tasks
(run/ray_backend.py), and the thread that called `Runner.run` alone records their traces.
"""

import hashlib
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..binding import BindingError, bind_axes
from ..build import CACHE_DIR_NAME, content_hash, missing_dependencies
from ..cost import evaluate_cost
from ..environment import describe_environment, hardware_name
from ..errors import FlashbenchError
from ..model import REFERENCE, Definition, Performance, Solution, Trace, Workload
from ..registry import Repo, SolutionFolder, load_solution_folder
from ..traces import append_trace, check_writable, read_traces, trace_path
from ..workloads import generate_inputs
from . import process, timing
from .check import Verdict, compare_outputs
from .process import DeviceUnusable, Outcome, WorkerProcess
from .references import reference_outputs
from ..calibrate import load_calibration

L2_FLUSH_BYTES = 256 * 1024 * 1024  # over 4x the H200's 60 MB L2
TRACE_FILE_CHANGED = "the trace file changed while this solution ran; it was restored"
BACKENDS = ("local", "ray")


@dataclass
class RunOptions:
    device: str = "cpu"  # names the hardware (and so the trace file); references run on its type
    devices: list[str] | None = None  # the pool the jobs are spread over; None: [device]
    backend: str = "local"  # local: the pool, in this process; ray: Ray tasks
    ray_address: str | None = None  # None: a Ray instance of this machine's own
    warmup: int = 5
    iters: int = 50
    seed: int = 0
    input_sets: int = 3
    timeout: float = 300.0
    timing: str = "events"
    resume: bool = False
    save: bool = True
    trace_dir: Path | None = None
    cache_dir: Path | None = None  # builds; told to workers
    reference_cache_dir: Path | None = None  # reference outputs; never told to workers
    # Reference outputs held in memory; past it the least recently used go (variant 0 is reloaded
    # from the disk cache, redrawn variants are computed again).
    reference_memory_bytes: int = 8 << 30
    memory_limit_bytes: int | None = field(default_factory=lambda: default_memory_limit())


@dataclass
class Candidate:
    folder: Path
    solution: Solution
    hash: str


@dataclass
class Job:
    """One (candidate, workload) pair: what a device times, one at a time."""

    index: int
    candidate: Candidate
    workload: Workload


@dataclass
class RunResult:
    traces: list[Trace] = field(default_factory=list)
    trace_file: Path | None = None
    skipped: int = 0


def default_memory_limit() -> int | None:
    """Three quarters of the machine's memory for a CPU worker's address space."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4)
    except (ValueError, OSError, AttributeError):
        return None


def default_reference_cache() -> Path:
    """Outside the repository, where solution folders live, and never passed to a worker."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flashbench" / "references"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def select_workloads(repo: Repo, definition: str, selectors: list[str], device: str) -> list[Workload]:
    """By uuid, uuid prefix, name or tag; with none given, all (only 'smoke' ones on a CPU)."""
    workload_set = repo.workload_set(definition)
    if workload_set is None:
        raise FlashbenchError(f"no workloads; add {repo.workloads_path(definition).relative_to(repo.root)}")
    workloads = workload_set.workloads
    if not selectors:
        return [w for w in workloads if "smoke" in w.tags] if device == "cpu" else workloads
    chosen = []
    for selector in selectors:
        matched = [w for w in workloads if w.uuid.startswith(selector) or w.name == selector or selector in w.tags]
        if not matched:
            known = ", ".join(sorted({w.name for w in workloads} | {t for w in workloads for t in w.tags}))
            raise FlashbenchError(f"no workload matches {selector!r}; names and tags: {known}")
        chosen += [w for w in matched if w not in chosen]
    return chosen


def select_solutions(repo: Repo, definition: str, selectors: list[str]) -> list[SolutionFolder]:
    """By name (a folder under solutions/<definition>/) or path; with none given, all of the definition.
    The name 'reference' selects nothing more: the reference runs with every selection."""
    if not selectors:
        return repo.solution_folders(definition)
    by_name = {f.solution.name: f for f in repo.solution_folders(definition)}
    chosen = []
    for selector in selectors:
        if selector == REFERENCE:
            continue
        if Path(selector).is_dir():
            chosen.append(load_solution_folder(Path(selector).resolve()))
        elif selector in by_name:
            chosen.append(by_name[selector])
        else:
            raise FlashbenchError(f"no solution {selector!r} for {definition}; known: {', '.join(by_name) or 'none'}")
    for folder in chosen:
        if folder.solution.definition != definition:
            raise FlashbenchError(f"solves {folder.solution.definition!r}, not {definition!r}", folder.path / "solution.yaml", "definition")
    return chosen


def reference_candidate(repo: Repo, definition: Definition, cache_dir: Path) -> Candidate:
    """The reference as a solution folder of its own, so it is timed exactly like the others."""
    entry = repo.definition_files[definition.name]
    source = (repo.root / definition.reference).read_text() if definition.reference_is_path else definition.reference
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = cache_dir / "reference-solutions" / definition.name / digest
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "reference.py").write_text(source)
    solution = Solution(
        name=REFERENCE, definition=definition.name, author="flashbench", language="python",
        description=f"the reference of {entry.path.name}", entry_point="reference.py::run",
        destination_passing_style=False, dependencies=["torch"], tags=[REFERENCE],
    )
    return Candidate(folder, solution, digest)


class Runner:
    def __init__(self, repo: Repo, definition_name: str, options: RunOptions,
                 on_result: Callable[[Trace], None] = lambda trace: None):
        self.repo = repo
        self.definition = repo.definition(definition_name)
        self.options = options
        self.on_result = on_result
        self.cache_dir = options.cache_dir or repo.root / CACHE_DIR_NAME
        self.on_gpu = torch.device(options.device).type == "cuda"
        if options.timing == "graph" and not self.on_gpu:
            raise FlashbenchError("--timing graph replays CUDA graphs: it needs a CUDA device")
        self.trace_file = trace_path(options.trace_dir or repo.root / "traces", hardware_name(options.device),
                                     self.definition.name, options.timing)
        self.reference = repo.reference(self.definition.name)
        self.reference_candidate = reference_candidate(repo, self.definition, self.cache_dir)
        self.reference_source = (self.reference_candidate.folder / "reference.py").read_text()
        self.base_dir = repo.definition_path(self.definition.name).parent
        self.environment = describe_environment(options.device, repo.root)
        self.reference_cache = options.reference_cache_dir or default_reference_cache()
        self.calibration = load_calibration(self.trace_file.parent.parent, self.environment["hardware"])
        self.devices = list(options.devices or [options.device])
        self.reference_latency: dict[str, float] = {}
        self._expected: OrderedDict[tuple[str, int, int], dict] = OrderedDict()
        self._verified: set[str] = set()
        self._costs: dict[str, tuple[float, float] | None] = {}
        self._trace_bytes = b""
        # Shared by the device threads: reference outputs under one lock (also one writer per
        # cache file), what each device is and which candidates cannot run, under another.
        self._reference_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._environments = {options.device: self.environment}
        self._failures: dict[tuple[str, str], Outcome] = {}
        self._tainted: set[int] = set()
        self._backend = None

    def candidates(self, folders: list[SolutionFolder]) -> list[Candidate]:
        return [self.reference_candidate] + [Candidate(f.path, f.solution, content_hash(f.path)) for f in folders]

    def run(self, candidates: list[Candidate], workloads: list[Workload], advance: Callable[[], None] = lambda: None) -> RunResult:
        """Every (candidate, workload) job. The reference's jobs run first (across the pool) and
        the others only once those are recorded, so every speedup has its reference latency."""
        result = RunResult(trace_file=self.trace_file)
        if self.options.save:
            check_writable(self.trace_file)
            self._trace_bytes = self.trace_file.read_bytes()
        jobs = self._pending_jobs(candidates, workloads, result, advance)
        first = [job for job in jobs if job.candidate.solution.name == REFERENCE]
        then = [job for job in jobs if job.candidate.solution.name != REFERENCE]
        with self._open_backend() as backend:
            for phase in (first, then):
                for job, trace in backend.run(phase):
                    advance()
                    self._record(job, trace, result, backend.running())
        return result

    def _pending_jobs(self, candidates, workloads, result: RunResult, advance) -> list[Job]:
        done = self._recorded() if self.options.resume else {}
        jobs = []
        for candidate in candidates:
            for workload in workloads:
                previous = done.get((candidate.hash, workload.uuid))
                if previous is not None:
                    result.skipped += 1
                    self._remember(previous)
                    advance()
                else:
                    jobs.append(Job(len(jobs), candidate, workload))
        return jobs

    def _open_backend(self):
        if self.options.backend == "ray":
            from .ray_backend import RayBackend
            self._backend = RayBackend(self)
        elif self.options.backend == "local":
            from .pool import DevicePool
            self._backend = DevicePool(self, self.devices)
        else:
            raise FlashbenchError(f"no backend {self.options.backend!r}; known: {', '.join(BACKENDS)}")
        return self._backend

    def _record(self, job: Job, trace: Trace, result: RunResult, running: set[int]) -> None:
        """Append a trace: only ever from the thread that called `run`."""
        if job.index in self._tainted:
            trace = _rejected(trace, TRACE_FILE_CHANGED)
        if self.options.save:
            guarded = self._guard_trace_file(trace)
            if guarded is not trace:  # any job running alongside may have written it: trust none
                self._tainted |= running - {job.index}
            trace = guarded
            append_trace(self.trace_file, trace)
            self._trace_bytes = self.trace_file.read_bytes()
        self._remember(trace)
        result.traces.append(trace)
        self.on_result(trace)

    def _guard_trace_file(self, trace: Trace) -> Trace:
        """Only the runner writes traces: a file changed since its last append is put back, and
        the solution that ran meanwhile is rejected."""
        if self.trace_file.read_bytes() == self._trace_bytes:
            return trace
        temporary = self.trace_file.with_suffix(".restore")
        temporary.write_bytes(self._trace_bytes)
        temporary.replace(self.trace_file)
        return _rejected(trace, TRACE_FILE_CHANGED)

    def _recorded(self) -> dict[tuple[str, str], Trace]:
        return {(t.solution_hash, t.workload): t for t in read_traces(self.trace_file)}

    def _remember(self, trace: Trace) -> None:
        if trace.solution == REFERENCE and trace.performance is not None:
            self.reference_latency[trace.workload] = trace.performance.latency_ms

    # One job on one device; called from the device threads (or, for Ray, with the task's answer).

    def known_failure(self, candidate: Candidate) -> Outcome | None:
        """Why `candidate` cannot run at all, once known: a missing dependency or a failed build."""
        key = (str(candidate.folder), candidate.hash)
        with self._state_lock:
            if key not in self._failures:
                missing = missing_dependencies(candidate.solution)
                if missing:
                    self._failures[key] = Outcome(status="MISSING_DEPENDENCY", message=f"not installed: {', '.join(missing)}")
                elif candidate.solution.language == "cuda" and not torch.cuda.is_available():
                    self._failures[key] = Outcome(status="MISSING_DEPENDENCY", message="a CUDA solution needs a CUDA device")
            return self._failures.get(key)

    def start_worker(self, candidate: Candidate, device: str) -> WorkerProcess | None:
        """A worker with `candidate` built on `device`, or None when the build failed (then
        known_failure says why). DeviceUnusable when the worker cannot use the device."""
        worker, failure = process.start_worker(self.worker_config(candidate, device), self.options.timeout)
        if failure is None:
            try:
                self.environment_of(device)  # a device of another kind has no place in this run
            except DeviceUnusable:
                worker.close()
                raise
            return worker
        worker.close()
        with self._state_lock:
            self._failures.setdefault((str(candidate.folder), candidate.hash), failure)
        return None

    def worker_config(self, candidate: Candidate, device: str) -> dict:
        return {
            "definition": self.definition.model_dump(mode="json"), "solution": candidate.solution.model_dump(mode="json"),
            "folder": str(candidate.folder), "device": device, "build_dir": str(self.cache_dir / "build"),
            "memory_limit_bytes": self.options.memory_limit_bytes,
        }

    def timing_method(self, candidate: Candidate) -> str:
        """The run's timing method, except that the reference is always timed with events: it copies
        index data to the host, which a CUDA graph cannot capture, and at milliseconds per call its
        launch overhead does not matter to the speedups it is the denominator of."""
        if candidate.solution.name == REFERENCE:
            return "events"
        return self.options.timing

    def job_request(self, job: Job) -> dict:
        return {
            "op": "job", "workload": job.workload.model_dump(mode="json"), "seeds": self.seeds(),
            "base_dir": str(self.base_dir),
            "timing": {"method": self.timing_method(job.candidate), "warmup": self.options.warmup,
                       "iters": self.options.iters, "flush_bytes": L2_FLUSH_BYTES},
        }

    def seeds(self) -> list[int]:
        return [self.options.seed + i for i in range(self.options.input_sets)]

    def settle_references(self, workload: Workload, device: str) -> None:
        """The reference outputs of the first calls, settled before the solution runs: nothing it
        writes can change them."""
        self.expected(workload, [(seed, 0) for seed in self.seeds()], device)

    def run_job(self, worker: WorkerProcess, job: Job, device: str) -> tuple[Trace, bool]:
        """The job's trace, and whether the worker ended (the next job needs a fresh one). The
        caller has settled the workload's references (settle_references) before the worker runs."""
        outcome = process.run_job(worker, self.job_request(job), self.options.timeout, self.on_gpu)
        return self.judge(job, outcome, device), outcome.ended

    def judge(self, job: Job, outcome: Outcome, device: str) -> Trace:
        """The trace of a job from what its worker answered; the verdict is always reached here."""
        candidate, workload = job.candidate, job.workload
        if outcome.reply is None:
            return self.trace(job, device, outcome.status, outcome.message, log=outcome.log)
        reply, seeds = outcome.reply, self.seeds()
        expected = self.expected(workload, [(seeds[check["set"]], check["variant"]) for check in reply["checked"]], device)
        verdict = self._verdict(reply, expected, device)
        performance = self._performance(reply, workload, candidate) if verdict.passed else None
        verdict, performance = self._judge_timing(verdict, performance)
        return self.trace(job, device, verdict.status, verdict.message, verdict.errors, performance, log=outcome.log)

    def environment_of(self, device: str) -> dict:
        """What a trace records about the device it ran on; DeviceUnusable for another kind of device."""
        with self._state_lock:
            if device not in self._environments:
                environment = describe_environment(device, self.repo.root)
                if environment["hardware"] != self.environment["hardware"]:
                    raise DeviceUnusable(f"it is {environment['hardware']}, not {self.environment['hardware']} like {self.options.device}")
                self._environments[device] = environment
            return self._environments[device]

    def expected(self, workload: Workload, keys: Iterable[tuple[int, int]], device: str) -> list[dict]:
        """Reference outputs for (seed, variant) pairs of a workload, computed once per run while
        they fit in the memory budget."""
        keys = [(workload.uuid, *key) for key in keys]
        with self._reference_lock:
            missing = list(dict.fromkeys(key for key in keys if key not in self._expected))
            if missing:
                try:
                    computed = self._backend.reference_outputs(workload, [key[1:] for key in missing], device)
                except (BindingError, ValueError) as exc:
                    raise FlashbenchError(f"workload {workload.label}: {exc}", self.repo.workloads_path(self.definition.name)) from None
                self._expected.update(zip(missing, computed))
            found = [self._expected[key] for key in keys]
            for key in keys:
                self._expected.move_to_end(key)
            self._evict_references(keep=set(keys))
            return found

    def _evict_references(self, keep: set) -> None:
        """Least recently used first, never what the current caller asked for."""
        held = sum(_nbytes(outputs) for outputs in self._expected.values())
        for key in list(self._expected):
            if held <= self.options.reference_memory_bytes:
                break
            if key not in keep:
                held -= _nbytes(self._expected.pop(key))

    def compute_references(self, workload: Workload, keys: list[tuple[int, int]], device: str) -> list[dict]:
        """In this process, on `device`. Variant 0 comes from the disk cache (one entry per
        workload recomputed each run to check it); redrawn variants are kept in memory only, so
        nothing a solution writes to disk can stand in for them."""
        computed = []
        for seed, variant in keys:
            cache = self.reference_cache if variant == 0 else None
            computed.append(reference_outputs(
                self.definition, self.reference, self.reference_source, workload, seed, device,
                self.base_dir, cache, variant, verify=workload.uuid not in self._verified,
            ))
            self._verified.add(workload.uuid)
        return computed

    def _verdict(self, reply: dict, expected: list[dict], device: str) -> Verdict:
        """The worker's checked outputs against `expected`, the reference outputs in the same order."""
        if reply["timer_tampered"]:
            return Verdict("REJECTED", f"the solution replaced timing functions: {', '.join(reply['timer_tampered'])}")
        if reply["inputs_mutated"]:
            return Verdict("REJECTED", f"the solution modified its inputs: {', '.join(sorted(set(reply['inputs_mutated'])))}")
        device_type = torch.device(self.options.device).type
        compute_on = self._comparison_device(device)
        first = None
        for i, (check, reference) in enumerate(zip(reply["checked"], expected)):
            verdict = compare_outputs(self.definition, check["outputs"], reference, device_type, compute_on)
            first = first or verdict
            if not verdict.passed:
                label = f"input set {check['set']}" if i < len(self.seeds()) else f"the timed calls on input set {check['set']}"
                verdict.message = f"{label}: {verdict.message}"
                return verdict
        first_call = {name: value["tensor"] for name, value in reply["checked"][0]["outputs"].items()}
        again = compare_outputs(self.definition, reply["rerun"]["outputs"], first_call, device_type, compute_on)
        if not again.passed:
            return Verdict("REJECTED", f"outputs change between identical calls: {again.message}")
        return first

    def _comparison_device(self, device: str) -> str:
        """The job's GPU, idle between its jobs, when this process holds it; else the CPU (a Ray
        driver never computes on a GPU)."""
        return device if self.on_gpu and self.options.backend == "local" else "cpu"

    def _judge_timing(self, verdict: Verdict, performance: Performance | None):
        """Reject timings that cannot be true: work outside the timed stream, or faster than physics."""
        if performance is None:
            return verdict, None
        # Judged only for CUDA events: on a CPU both clocks are the host's and load noise alone can
        # split them; a graph replay leaves out the launch overhead the wall clock includes.
        judged = self.on_gpu and performance.timing["method"] == "events"
        check = performance.crosscheck
        if judged and not check.get("agrees", True):
            message = (f"events and the wall-clock crosscheck disagree: work escaped the timed stream (events "
                       f"{performance.latency_ms * 1e3:.1f} µs, wall clock {check['wall_ms'] * 1e3:.1f} µs, host "
                       f"time inside the call {check['host_call_ms'] * 1e3:.1f} µs)")
            return Verdict("REJECTED", message, verdict.errors), None
        floor = self.calibration.floor_ms(performance.bytes, performance.flops) if self.calibration else None
        if floor and performance.latency_ms < floor:
            message = f"{performance.latency_ms * 1e3:.2f} µs is faster than the speed-of-light floor {floor * 1e3:.2f} µs"
            return Verdict("REJECTED", message, verdict.errors), None
        return verdict, performance

    def _performance(self, reply: dict, workload: Workload, candidate: Candidate) -> Performance | None:
        if "samples" not in reply:
            return None
        stats = timing.summarize(reply["samples"])
        check = timing.crosscheck(stats["latency_ms"], reply["wall_ms"], reply["host_call_ms"]) if "wall_ms" in reply else {}
        cost = self._cost(workload)
        reference_ms = stats["latency_ms"] if candidate.solution.name == REFERENCE else self.reference_latency.get(workload.uuid)
        return Performance(
            **stats,
            reference_latency_ms=reference_ms,
            speedup=reference_ms / stats["latency_ms"] if reference_ms and stats["latency_ms"] > 0 else None,
            bytes=cost[0] if cost else None,
            flops=cost[1] if cost else None,
            timing={
                "method": self.timing_method(candidate) if self.on_gpu else "host clock", "warmup": self.options.warmup,
                "iters": self.options.iters, "input_sets": self.options.input_sets, "seed": self.options.seed,
                "l2_flush_bytes": L2_FLUSH_BYTES if self.on_gpu else 0,
            },
            crosscheck=check,
        )

    def _cost(self, workload: Workload):
        """Bytes and FLOPs of a workload, evaluated once per run (its index structure is fixed)."""
        if workload.uuid not in self._costs:
            inputs = generate_inputs(self.definition, workload, self.options.seed, "meta", self.base_dir)
            self._costs[workload.uuid] = evaluate_cost(self.definition, bind_axes(self.definition, inputs), inputs)
        return self._costs[workload.uuid]

    def trace(self, job: Job, device: str, status: str, message: str = "", errors=None, performance=None,
              log: str = "") -> Trace:
        candidate, workload = job.candidate, job.workload
        return Trace(
            definition=self.definition.name, workload=workload.uuid, workload_name=workload.name,
            solution=candidate.solution.name, solution_hash=candidate.hash, solution_tags=candidate.solution.tags,
            author=candidate.solution.author,
            hardware=self.environment["hardware"], status=status, message=message, log=log[-2000:] if status != "PASSED" else "",
            correctness=errors or {}, performance=performance, environment=self.environment_of(device),
            timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )


def _nbytes(outputs: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in outputs.values())


def _rejected(trace: Trace, message: str) -> Trace:
    return trace.model_copy(update={"status": "REJECTED", "performance": None, "message": message})


def install_solution(repo: Repo, folder: Path) -> Path:
    """Copy a solution folder to solutions/<definition>/<name>/ (after it passed its checks)."""
    loaded = load_solution_folder(folder)
    target = repo.root / "solutions" / loaded.solution.definition / loaded.solution.name
    if target.resolve() == folder.resolve():
        return target
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target
