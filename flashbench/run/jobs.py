"""Running one job on one device: what every backend does, in the runner's process or in a Ray task.

`JobJudge` is built from plain values (`JudgeConfig`), so a Ray task can build its own; it starts
sandboxed workers, never imports solution code, and returns a `JobOutcome` (a pydantic model, so
it crosses to the Ray driver as JSON).
"""

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..build import CACHE_DIR_NAME, folder_problem, missing_dependencies, missing_toolchain
from ..environment import describe_environment
from ..errors import FlashbenchError, shortened
from ..model import REFERENCE, Definition, Workload
from ..reference import load_reference
from ..workloads import generate_inputs
from ..workloads.generators import FP8_QUANTIZE_REFERENCE
from . import sandbox
from .judge.clock import Baseline, CleanSteps
from .judge.inputs import JobInputs, fresh_seed
from .judge.references import ReferenceStore
from .options import GPU_CHECKED_CALLS, MIN_BATCHES, SLOT_BUDGET_BYTES, TARGET_BATCH_MS, TIMED_BUDGET_MS, RunOptions
from .plan import Candidate, Job
from .protocol import Build, Failed, Probe, Setup
from .recipe import L2Flush, release_cached_memory
from .session import JobOutcome, Session, SessionSettings
from .supervisor import BUILD_DIR_LIMIT_BYTES, BUILD_DIR_LIMIT_FILES, WorkerGone, WorkerProcess

# An idle worker holding more of its GPU than this is ended before the next job: on the H200 peers'
# plan caches kept earlier jobs' arenas alive, 93-106 of 141 GB, and the next jobs ran out of memory.
HELD_SHARE = 0.5
DEVICE_CHECK_TIMEOUT_S = 120.0  # the worker's start and its device check; no solution code runs yet
PHASES = ("build", "reference", "check", "time")  # what a job is doing, in order, for progress displays


class DeviceUnusable(Exception):
    """A worker could not use its device: the check it makes before any solution code runs failed."""


@contextlib.contextmanager
def _machine_setting():
    """The sandbox module's refusals of this machine's settings (FLASHBENCH_ISOLATION, FLASHBENCH_WORKER_UID) as
    one line: it runs as a script in the worker too, and raises errors of its own."""
    try:
        yield
    except (ValueError, sandbox.SandboxError) as exc:
        raise FlashbenchError(str(exc)) from None


@dataclass
class JudgeConfig:
    definition: Definition
    root: Path
    definition_file: Path
    options: RunOptions
    set_seeds: list[int]
    isolation: str
    hardware: str = ""  # the run's device model: a device of another model has no place in it
    cache_dir: Path = field(default=Path(CACHE_DIR_NAME))
    sources: tuple[Path, ...] = ()  # the folders every candidate of the run was staged from

    @classmethod
    def for_run(cls, definition: Definition, root: Path, definition_file: Path, options: RunOptions,
                hardware: str, sources: tuple[Path, ...] = ()) -> "JudgeConfig":
        sets = options.input_sets
        seeds = [fresh_seed() for _ in range(sets)] if options.seed is None else [options.seed + i for i in range(sets)]
        with _machine_setting():
            isolation = options.isolation or sandbox.available_isolation()
        return cls(definition, root, definition_file, options, seeds, isolation, hardware,
                   options.cache_dir or root / CACHE_DIR_NAME, sources)

    @property
    def trace_dir(self) -> Path:
        return self.options.trace_dir or self.root / "traces"

    def worker_account(self) -> sandbox.WorkerAccount:
        """Who this machine's workers run as (decided once per machine: a run over Ray asks on each)."""
        with _machine_setting():
            return sandbox.worker_account(self.isolation, (str(self.cache_dir),))

    def hidden_from(self, candidate: Candidate) -> tuple[Path, ...]:
        """What a worker has no business reading, empty to it at the namespaces level: the whole repository
        and the checkout flashbench runs from (solutions, git history, notes), the folders every candidate
        of the run was staged from (their notes are outside their hashes), the trace directory, the cache
        (other solutions' staged copies and builds, other workers' directories) and the runner's home. Its
        staged folder, its build directory, the flashbench package and `shown` are bound back."""
        sources = dict.fromkeys((*candidate.sources, *self.sources))
        # solutions/ and .git named too: a repository at / is never covered whole, and solutions/ may be a link
        named = (self.root / "solutions", self.root / ".git")
        return (*self._trees(), *named, *sources, self.trace_dir, self.cache_dir, *_runner_home())

    def shown(self) -> tuple[Path, ...]:
        """What a worker reads of the hidden trees: the folder of the FP8 cache format's quantize reference,
        which a worker's redraws run, loaded by path (generators.fp8_quantize)."""
        folders = (tree / FP8_QUANTIZE_REFERENCE.parent for tree in self._trees())
        return tuple(folder for folder in folders if folder.is_dir())

    def _trees(self) -> tuple[Path, ...]:
        """The repository, and the checkout flashbench runs from where it is another one."""
        checkout = sandbox.source_checkout()
        if checkout is None or Path(checkout).resolve() == self.root.resolve():
            return (self.root,)
        return (self.root, Path(checkout))


class JobJudge:
    def __init__(self, config: JudgeConfig, on_phase: Callable[[Job, str], None] = lambda job, phase: None):
        self.config = config
        self.on_phase = on_phase  # told, from the device's thread, when a job enters one of PHASES
        self.definition = config.definition
        self.options = config.options
        self._references: ReferenceStore | None = None
        self._flushes: dict[str, L2Flush] = {}
        self._environments: dict[str, dict] = {}
        self._failures: dict[tuple[str, str], JobOutcome] = {}
        self.clean_steps = CleanSteps()  # measured in the reference's jobs, which run first, or alone
        self._lock = threading.Lock()

    @property
    def references(self) -> ReferenceStore:
        with self._lock:
            if self._references is None:
                run = load_reference(self.definition, self.config.root, self.config.definition_file)
                self._references = ReferenceStore(self.definition, run, self.options.reference_memory_bytes)
            return self._references

    def known_failure(self, candidate: Candidate) -> JobOutcome | None:
        """Why `candidate` cannot run at all, once known: a bad folder, a missing dependency, a failed build."""
        key = (str(candidate.folder), candidate.hash)
        with self._lock:
            if key not in self._failures:
                failure = _failure_before_start(candidate)
                if failure is not None:
                    self._failures[key] = failure
            return self._failures.get(key)

    def start_worker(self, candidate: Candidate, device: str,
                     cpus: tuple[int, ...] | None = None) -> WorkerProcess | None:
        """A worker with `candidate` built on `device` (on `cpus` alone, if given), or None when the build failed
        (then known_failure says why). DeviceUnusable when the worker cannot use the device."""
        self.environment_of(device)
        # Absolute: the worker's working directory may lie in a directory hidden from it.
        setup = Setup(definition=self.definition, solution=candidate.solution, folder=str(candidate.folder.absolute()),
                      device=device, build_dir=str((self.config.cache_dir / "build" / candidate.hash).absolute()))
        memory_limit = None if device.startswith("cuda") else self.options.memory_limit_bytes
        account = self.config.worker_account()
        try:
            worker = WorkerProcess.start(setup, self.config.isolation, self.config.cache_dir / "workers", memory_limit,
                                         self.config.hidden_from(candidate), self.config.shown(), account,
                                         account.task_limit(len(self.options.devices or [device])), cpus,
                                         self.config.root)
        except OSError as exc:
            raise DeviceUnusable(f"its worker could not start: {exc}") from None
        except WorkerGone as gone:  # the candidate's doing (its setup), not the device's
            with self._lock:
                self._failures.setdefault((str(candidate.folder), candidate.hash), JobOutcome(
                    status=gone.status, message=f"start: {gone.message}", log=gone.log, worker_usable=False))
            return None
        try:
            probe = worker.ask(Probe(), DEVICE_CHECK_TIMEOUT_S)
        except WorkerGone as gone:
            raise DeviceUnusable(f"the device check failed: {gone.message}") from None
        if isinstance(probe, Failed):
            worker.close()
            raise DeviceUnusable(f"the device check failed: {probe.message}")
        failure = self._build(worker, candidate)
        if failure is None:
            return worker
        worker.close()
        with self._lock:
            self._failures.setdefault((str(candidate.folder), candidate.hash), failure)
        return None

    def _build(self, worker: WorkerProcess, candidate: Candidate) -> JobOutcome | None:
        try:
            built = worker.ask(Build(), self.options.timeout)
        except WorkerGone as gone:
            return JobOutcome(status=gone.status, message=f"build: {gone.message}", log=gone.log, worker_usable=False)
        if isinstance(built, Failed):
            # What the worker's handler answers a failed import or CUDA build, or an exception: a status of
            # another phase is a claim the worker has no business making (a DEVICE_ERROR is no trace status).
            failed_build = "COMPILE_ERROR" if candidate.solution.language == "cuda" else "INVALID_SOLUTION"
            if built.status not in (failed_build, "RUNTIME_ERROR"):
                claim = f"its build reported {built.status}, which no build gives: {built.message}"
                return JobOutcome(status="REJECTED", message=shortened(claim, 2000), log=worker.log_tail(),
                                  worker_usable=False)
            return JobOutcome(status=built.status, message=built.message, log=worker.log_tail(), worker_usable=False)
        if worker.leftovers():
            return JobOutcome(status="REJECTED", message="left processes running after its import; they were killed",
                              log=worker.log_tail(), worker_usable=False)
        return None

    def run(self, worker: WorkerProcess, job: Job, device: str) -> JobOutcome:
        session = Session(self.settings(job.candidate, device), self.references, self.flush(device), device,
                          on_phase=lambda phase: self.on_phase(job, phase), clean_steps=self.clean_steps,
                          trusted=job.candidate.solution.name == REFERENCE)
        release_cached_memory(device)  # the references and the last job's arena: the worker's now
        outcome = session.run(worker, job.workload, job.candidate.solution.destination_passing_style)
        held = worker.build_dir_overfull()
        if held:  # emptied as the worker ends
            return JobOutcome(status="REJECTED", log=outcome.log, worker_usable=False, message=(
                f"its build directory holds {held}, more than the {BUILD_DIR_LIMIT_BYTES / 2**30:g} GiB or "
                f"{BUILD_DIR_LIMIT_FILES} files a solution may keep there between runs; it was emptied"))
        return outcome

    def settings(self, candidate: Candidate, device: str) -> SessionSettings:
        kind = torch.device(device).type
        options = self.options
        return SessionSettings(
            base_dir=self.config.definition_file.parent, set_seeds=self.config.set_seeds, warmup=options.warmup,
            iters=options.iters, graph=self.timing_method(candidate) == "graph", flush=options.flush,
            timeout=options.timeout, target_batch_ms=TARGET_BATCH_MS[kind], min_batches=MIN_BATCHES[kind],
            checked_calls=options.checked_calls if options.checked_calls is not None or kind == "cpu" else GPU_CHECKED_CALLS,
            slot_budget_bytes=SLOT_BUDGET_BYTES[kind], timed_budget_ms=TIMED_BUDGET_MS[kind],
        )

    def timing_method(self, candidate: Candidate) -> str:
        """The run's timing method, except that the reference is always timed with events: it copies
        index data to the host, which a CUDA graph cannot capture, and at milliseconds per call its
        launch overhead does not matter to the speedups it is the denominator of."""
        if candidate.solution.name == "reference" or not self.options.on_gpu:
            return "events"
        return self.options.timing

    def flush(self, device: str) -> L2Flush:
        """The judge's own flush (for its baseline batches); a CPU has no L2 of the device's to flush."""
        with self._lock:
            if device not in self._flushes:
                self._flushes[device] = L2Flush(self.options.flush if device.startswith("cuda") else "none", device)
            return self._flushes[device]

    def environment_of(self, device: str) -> dict:
        """What a trace records about the device it ran on; DeviceUnusable for another kind of device."""
        with self._lock:
            if device not in self._environments:
                try:
                    environment = describe_environment(device, self.config.root)
                except (RuntimeError, AssertionError, ValueError) as exc:  # no such device, or a failing one
                    raise DeviceUnusable(f"it cannot be described: {exc}") from None
                if self.config.hardware and environment["hardware"] != self.config.hardware:
                    raise DeviceUnusable(f"it is {environment['hardware']}, not {self.config.hardware} like the run's device")
                self._environments[device] = environment
            return self._environments[device]

    def device_held_by_others(self, device: str) -> bool:
        """Whether more than HELD_SHARE of a GPU's memory is held outside this process: asked while the
        lane's worker is idle between jobs, so what it holds is what its earlier jobs left."""
        if not device.startswith("cuda"):
            return False
        release_cached_memory(device)
        free, total = torch.cuda.mem_get_info(device)
        return total - free - torch.cuda.memory_reserved(device) > HELD_SHARE * total

    def lacks_clean_steps(self, job: Job, device: str) -> bool:
        """A job of a solution whose workload's steps were not measured clean (the reference's jobs did not
        run before it: a resumed run, or a run on Ray, where each task has its own judge). On a CPU too: a red
        team's resumed CPU run had no cap on what the judge subtracts (threat_model class 8)."""
        return job.candidate.solution.name != REFERENCE and self.clean_steps.get(job.workload.uuid, device) is None

    def measure_clean_steps(self, workload: Workload, device: str) -> None:
        """The harness's steps' cost per call on `workload`, measured by the judge alone. The caller
        sees to it that no solution's worker is alive on the device, so none can have left work there. The
        steps are those of the reference's jobs, which measure the same cap in a run that is not resumed: the
        reference returns its outputs, so they include the copy into the call's slot."""
        inputs = JobInputs(self.definition, workload, self.config.set_seeds[:1], device, self.config.definition_file.parent)
        baseline = Baseline(inputs, self.flush(device), copies_outputs=True,
                            max_calls=CleanSteps.CALLS[torch.device(device).type])
        self.clean_steps.measure(baseline, workload.uuid, device)

    def references_for(self, workload: Workload, device: str) -> None:
        """The reference outputs of a workload's input sets, computed before any solution runs on it."""
        base_dir = self.config.definition_file.parent
        for seed in self.config.set_seeds:
            self.references.kept((workload.uuid, seed),
                                 lambda: generate_inputs(self.definition, workload, seed, device, base_dir))


def _runner_home() -> tuple[Path, ...]:
    """The runner's home (credentials, tools' settings), unless it is unknown or the root."""
    home = Path(os.path.expanduser("~"))
    return (home,) if home.is_absolute() and home != Path(home.anchor) else ()


def _failure_before_start(candidate: Candidate) -> JobOutcome | None:
    """The judge's own checks, before any worker starts. MISSING_DEPENDENCY comes only from here (no worker can
    report it: protocol.FailureStatus), so --resume may run such a pair again (run/resume.py)."""
    problem = candidate.problem or folder_problem(candidate.folder, candidate.solution)
    if problem:
        return JobOutcome(status="INVALID_SOLUTION", message=problem)
    missing = missing_dependencies(candidate.solution)
    if missing:
        return JobOutcome(status="MISSING_DEPENDENCY", message=f"not installed: {', '.join(missing)}")
    if candidate.solution.language == "cuda":
        if not torch.cuda.is_available():
            return JobOutcome(status="MISSING_DEPENDENCY", message="a CUDA solution needs a CUDA device")
        lacking = missing_toolchain()
        if lacking:
            return JobOutcome(status="MISSING_DEPENDENCY", message=f"a CUDA solution needs {lacking}")
    return None
