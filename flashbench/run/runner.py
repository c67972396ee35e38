"""`flashbench run`: every (solution, workload) pair through build, check and timing, into traces.

The runner process holds the reference outputs, the checker and the trace writer; solution
code only ever runs in a worker process (run/worker.py).
"""

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from ..binding import BindingError, bind_axes
from ..build import CACHE_DIR_NAME, content_hash, missing_dependencies
from ..cost import evaluate_cost
from ..environment import describe_environment, hardware_name
from ..errors import FlashbenchError
from ..model import Definition, Performance, Solution, Trace, Workload
from ..registry import Repo, SolutionFolder, load_solution_folder
from ..traces import append_trace, check_writable, read_traces, trace_path
from ..workloads import generate_inputs
from . import timing
from .check import Verdict, compare_outputs
from .process import WorkerCrashed, WorkerProcess, WorkerTimeout
from .references import reference_outputs
from ..calibrate import load_calibration

REFERENCE = "reference"
L2_FLUSH_BYTES = 256 * 1024 * 1024  # over 4x the H200's 60 MB L2


@dataclass
class RunOptions:
    device: str = "cpu"
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
    memory_limit_bytes: int | None = field(default_factory=lambda: default_memory_limit())


@dataclass
class Candidate:
    folder: Path
    solution: Solution
    hash: str


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
    """By name (a folder under solutions/<definition>/) or path; with none given, all of the definition."""
    if not selectors:
        return repo.solution_folders(definition)
    by_name = {f.solution.name: f for f in repo.solution_folders(definition)}
    chosen = []
    for selector in selectors:
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
        self.trace_file = trace_path(options.trace_dir or repo.root / "traces", hardware_name(options.device), self.definition.name)
        self.reference = repo.reference(self.definition.name)
        self.reference_source = reference_candidate(repo, self.definition, self.cache_dir).folder.joinpath("reference.py").read_text()
        self.base_dir = repo.definition_path(self.definition.name).parent
        self.environment = describe_environment(options.device, repo.root)
        self.reference_cache = options.reference_cache_dir or default_reference_cache()
        self.calibration = load_calibration(self.trace_file.parent.parent, self.environment["hardware"])
        self.reference_latency: dict[str, float] = {}
        self._expected: dict[tuple[str, int, int], dict] = {}
        self._verified: set[str] = set()
        self._trace_bytes = b""

    def candidates(self, folders: list[SolutionFolder]) -> list[Candidate]:
        reference = reference_candidate(self.repo, self.definition, self.cache_dir)
        return [reference] + [Candidate(f.path, f.solution, content_hash(f.path)) for f in folders]

    def run(self, candidates: list[Candidate], workloads: list[Workload], advance: Callable[[], None] = lambda: None) -> RunResult:
        result = RunResult(trace_file=self.trace_file)
        if self.options.save:
            check_writable(self.trace_file)
            self._trace_bytes = self.trace_file.read_bytes()
        done = self._recorded() if self.options.resume else {}
        for candidate in candidates:
            pending = []
            for workload in workloads:
                previous = done.get((candidate.hash, workload.uuid))
                if previous is not None:
                    result.skipped += 1
                    self._remember(previous)
                    advance()
                else:
                    pending.append(workload)
            for trace in self._run_candidate(candidate, pending, advance):
                if self.options.save:
                    trace = self._guard_trace_file(trace)
                    append_trace(self.trace_file, trace)
                    self._trace_bytes = self.trace_file.read_bytes()
                self._remember(trace)
                result.traces.append(trace)
                self.on_result(trace)
        return result

    def _guard_trace_file(self, trace: Trace) -> Trace:
        """Only the runner writes traces: a file changed since its last append is put back, and
        the solution that ran meanwhile is rejected."""
        if self.trace_file.read_bytes() == self._trace_bytes:
            return trace
        temporary = self.trace_file.with_suffix(".restore")
        temporary.write_bytes(self._trace_bytes)
        temporary.replace(self.trace_file)
        return trace.model_copy(update={
            "status": "REJECTED", "performance": None,
            "message": "the trace file changed while this solution ran; it was restored",
        })

    def _recorded(self) -> dict[tuple[str, str], Trace]:
        return {(t.solution_hash, t.workload): t for t in read_traces(self.trace_file)}

    def _remember(self, trace: Trace) -> None:
        if trace.solution == REFERENCE and trace.performance is not None:
            self.reference_latency[trace.workload] = trace.performance.latency_ms

    def _run_candidate(self, candidate: Candidate, workloads: list[Workload], advance):
        if not workloads:
            return
        missing = missing_dependencies(candidate.solution)
        if missing:
            for workload in workloads:
                advance()
                yield self._trace(candidate, workload, "MISSING_DEPENDENCY", f"not installed: {', '.join(missing)}")
            return
        worker, failure = self._start_worker(candidate)
        try:
            for workload in workloads:
                if failure is not None:
                    status, message, log = failure
                    advance()
                    yield self._trace(candidate, workload, status, message, log=log)
                    continue
                trace, died = self._run_job(worker, candidate, workload)
                advance()
                yield trace
                if died:
                    worker.close()
                    worker, failure = self._start_worker(candidate)
        finally:
            worker.close()

    def _start_worker(self, candidate: Candidate):
        config = {
            "definition": self.definition.model_dump(mode="json"), "solution": candidate.solution.model_dump(mode="json"),
            "folder": str(candidate.folder), "device": self.options.device, "build_dir": str(self.cache_dir / "build"),
            "memory_limit_bytes": self.options.memory_limit_bytes,
        }
        worker = WorkerProcess(config)
        try:
            reply = worker.request({"op": "build"}, self.options.timeout)
        except WorkerTimeout as exc:
            return worker, ("TIMEOUT", f"build: {exc}", worker.log_tail())
        except WorkerCrashed as exc:
            return worker, ("CRASHED", f"build: {exc}", worker.log_tail())
        if not reply["ok"]:
            return worker, (reply["status"], reply["message"], worker.log_tail())
        return worker, None

    def _run_job(self, worker: WorkerProcess, candidate: Candidate, workload: Workload) -> tuple[Trace, bool]:
        seeds = [self.options.seed + i for i in range(self.options.input_sets)]
        for seed in seeds:  # settled before the solution runs: nothing it writes can change them
            self._expected_outputs(workload, seed, 0)
        request = {
            "op": "job", "workload": workload.model_dump(mode="json"), "seeds": seeds, "base_dir": str(self.base_dir),
            "timing": {"method": self.options.timing, "warmup": self.options.warmup, "iters": self.options.iters,
                       "flush_bytes": L2_FLUSH_BYTES},
        }
        try:
            reply = worker.request(request, self.options.timeout)
        except WorkerTimeout as exc:
            return self._trace(candidate, workload, "TIMEOUT", str(exc), log=worker.log_tail()), True
        except WorkerCrashed as exc:
            return self._trace(candidate, workload, "CRASHED", str(exc), log=worker.log_tail()), True
        leftovers = worker.end_leftover_processes()
        if leftovers:
            message = f"left {leftovers} process(es) running after the call; they were killed"
            return self._trace(candidate, workload, "REJECTED", message, log=worker.log_tail()), True
        if not reply["ok"]:
            # A CUDA error (an illegal address, say) poisons the worker's context: start afresh.
            on_gpu = torch.device(self.options.device).type == "cuda"
            return self._trace(candidate, workload, reply["status"], reply["message"], log=worker.log_tail()), on_gpu
        verdict = self._verdict(reply, workload, seeds)
        performance = self._performance(reply, workload, candidate) if verdict.passed else None
        verdict, performance = self._judge_timing(verdict, performance)
        return self._trace(candidate, workload, verdict.status, verdict.message, verdict.errors, performance,
                           log=worker.log_tail()), False

    def _expected_outputs(self, workload: Workload, seed: int, variant: int) -> dict:
        """Variant 0 comes from the disk cache (one entry per workload recomputed each run to
        check it); redrawn variants are computed here and kept in memory only, so nothing a
        solution writes to disk can stand in for them."""
        key = (workload.uuid, seed, variant)
        if key not in self._expected:
            cache = self.reference_cache if variant == 0 else None
            try:
                self._expected[key] = reference_outputs(
                    self.definition, self.reference, self.reference_source, workload, seed, self.options.device,
                    self.base_dir, cache, variant, verify=workload.uuid not in self._verified,
                )
            except (BindingError, ValueError) as exc:
                raise FlashbenchError(f"workload {workload.label}: {exc}", self.repo.workloads_path(self.definition.name)) from None
            self._verified.add(workload.uuid)
        return self._expected[key]

    def _verdict(self, reply: dict, workload: Workload, seeds: list[int]) -> Verdict:
        if reply["timer_tampered"]:
            return Verdict("REJECTED", f"the solution replaced timing functions: {', '.join(reply['timer_tampered'])}")
        if reply["inputs_mutated"]:
            return Verdict("REJECTED", f"the solution modified its inputs: {', '.join(sorted(set(reply['inputs_mutated'])))}")
        device_type = torch.device(self.options.device).type
        first = None
        for i, check in enumerate(reply["checked"]):
            expected = self._expected_outputs(workload, seeds[check["set"]], check["variant"])
            verdict = compare_outputs(self.definition, check["outputs"], expected, device_type)
            first = first or verdict
            if not verdict.passed:
                label = f"input set {check['set']}" if i < len(seeds) else f"the timed calls on input set {check['set']}"
                verdict.message = f"{label}: {verdict.message}"
                return verdict
        first_call = {name: value["tensor"] for name, value in reply["checked"][0]["outputs"].items()}
        again = compare_outputs(self.definition, reply["rerun"]["outputs"], first_call, device_type)
        if not again.passed:
            return Verdict("REJECTED", f"outputs change between identical calls: {again.message}")
        return first

    def _judge_timing(self, verdict: Verdict, performance: Performance | None):
        """Reject timings that cannot be true: work outside the timed stream, or faster than physics."""
        if performance is None:
            return verdict, None
        # Judged only for CUDA events: on a CPU both clocks are the host's and load noise alone can
        # split them; a graph replay leaves out the launch overhead the wall clock includes.
        judged = torch.device(self.options.device).type == "cuda" and self.options.timing == "events"
        if judged and not performance.crosscheck.get("agrees", True):
            return Verdict("REJECTED", "events and the wall-clock crosscheck disagree: work escaped the timed stream",
                           verdict.errors), None
        floor = self.calibration.floor_ms(performance.bytes, performance.flops) if self.calibration else None
        if floor and performance.latency_ms < floor:
            message = f"{performance.latency_ms * 1e3:.2f} µs is faster than the speed-of-light floor {floor * 1e3:.2f} µs"
            return Verdict("REJECTED", message, verdict.errors), None
        return verdict, performance

    def _performance(self, reply: dict, workload: Workload, candidate: Candidate) -> Performance | None:
        if "samples" not in reply:
            return None
        stats = timing.summarize(reply["samples"])
        check = timing.crosscheck(stats["latency_ms"], reply["wall_ms"]) if "wall_ms" in reply else {}
        cost = self._cost(workload)
        reference_ms = stats["latency_ms"] if candidate.solution.name == REFERENCE else self.reference_latency.get(workload.uuid)
        on_gpu = torch.device(self.options.device).type == "cuda"
        return Performance(
            **stats,
            reference_latency_ms=reference_ms,
            speedup=reference_ms / stats["latency_ms"] if reference_ms and stats["latency_ms"] > 0 else None,
            bytes=cost[0] if cost else None,
            flops=cost[1] if cost else None,
            timing={
                "method": self.options.timing if on_gpu else "host clock", "warmup": self.options.warmup,
                "iters": self.options.iters, "input_sets": self.options.input_sets, "seed": self.options.seed,
                "l2_flush_bytes": L2_FLUSH_BYTES if on_gpu else 0,
            },
            crosscheck=check,
        )

    def _cost(self, workload: Workload):
        inputs = generate_inputs(self.definition, workload, self.options.seed, "meta", self.base_dir)
        return evaluate_cost(self.definition, bind_axes(self.definition, inputs), inputs)

    def _trace(self, candidate: Candidate, workload: Workload, status: str, message: str = "",
               errors=None, performance=None, log: str = "") -> Trace:
        return Trace(
            definition=self.definition.name, workload=workload.uuid, workload_name=workload.name,
            solution=candidate.solution.name, solution_hash=candidate.hash, solution_tags=candidate.solution.tags,
            author=candidate.solution.author,
            hardware=self.environment["hardware"], status=status, message=message, log=log[-2000:] if status != "PASSED" else "",
            correctness=errors or {}, performance=performance, environment=self.environment,
            timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )


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
