"""`flashbench run`: every (solution, workload) pair through build, check and timing, into traces.

The runner plans the jobs, hands them to a backend (run/pool.py: one or several local devices;
run/ray_backend.py: Ray tasks), turns each job's outcome into a trace and records it. Solution
code runs only in sandboxed worker processes; the judging (run/session.py, run/judge/) happens
outside them.
"""

import functools
import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from ..binding import bind_axes
from ..build import CACHE_DIR_NAME
from ..calibrate import load_calibration
from ..cost import evaluate_cost
from ..environment import hardware_name
from ..errors import FlashbenchError
from ..model import REFERENCE, Performance, Trace, Workload
from ..reference import reference_source
from ..registry import Repo, SolutionFolder
from ..traces import read_traces, trace_path
from ..workloads import generate_inputs
from .jobs import JobJudge, JudgeConfig
from .options import RunOptions
from .plan import Candidate, Job, candidates, refuse_invalid_workloads
from .recorder import TraceRecorder, rejected_for_a_changed_file
from .recipe import FLUSH_BYTES, flush_label
from .resume import JUDGE_VERSION, TIMEOUT_KEY, settled
from .session import JobOutcome

BACKENDS = ("local", "ray")


@dataclass
class RunResult:
    traces: list[Trace] = field(default_factory=list)
    trace_file: Path | None = None
    skipped: list[Trace] = field(default_factory=list)  # recorded before and not run again (--resume)
    isolation: str = ""
    workers_as: str = ""  # who the workers ran as (sandbox.WorkerAccount.describe)
    untrusted_files: list[Path] = field(default_factory=list)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Runner:
    def __init__(self, repo: Repo, definition_name: str, options: RunOptions,
                 on_result: Callable[[Trace], None] = lambda trace: None):
        self.repo = repo
        self.definition = repo.definition(definition_name)
        self.options = options
        self.on_result = on_result
        self.cache_dir = options.cache_dir or repo.root / CACHE_DIR_NAME
        if options.timing == "graph" and not options.on_gpu:
            raise FlashbenchError("--timing graph replays CUDA graphs: it needs a CUDA device")
        if options.backend not in BACKENDS:
            raise FlashbenchError(f"no backend {options.backend!r}; known: {', '.join(BACKENDS)}")
        self.trace_dir = options.trace_dir or repo.root / "traces"
        self.hardware = hardware_name(options.device)
        self.trace_file = trace_path(self.trace_dir, self.hardware, self.definition.name, options.timing)
        self.reference_latency: dict[str, float] = {}
        self._costs: dict[str, tuple[float, float] | None] = {}

    def candidates(self, folders: list[SolutionFolder]) -> list[Candidate]:
        return candidates(self.repo, self.definition, folders, self.cache_dir)

    def run(self, chosen: list[Candidate], workloads: list[Workload], advance: Callable[[], None] = lambda: None,
            on_phase: Callable[[Job, str], None] = lambda job, phase: None) -> RunResult:
        """Every (candidate, workload) job. The reference's jobs run first (across the pool) and
        the others only once those are recorded, so every speedup has its reference latency.
        `advance` is called as each pair ends, `on_phase` as a job enters a phase (jobs.PHASES)."""
        refuse_invalid_workloads(self.repo, self.definition, workloads, self.options.device)
        sources = tuple(path for candidate in chosen for path in candidate.sources)
        config = JudgeConfig.for_run(self.definition, self.repo.root, self.repo.definition_path(self.definition.name),
                                     self.options, self.hardware, sources)
        judge = JobJudge(config, on_phase)
        with TraceRecorder(self.trace_file, self.trace_dir, self.options.save) as recorder:
            return self._run(judge, config, recorder, chosen, workloads, advance)

    def _run(self, judge: JobJudge, config: JudgeConfig, recorder: TraceRecorder, chosen: list[Candidate],
             workloads: list[Workload], advance: Callable[[], None]) -> RunResult:
        calibration = load_calibration(self.trace_dir, self.hardware)
        result = RunResult(trace_file=self.trace_file, isolation=config.isolation,
                           workers_as=config.worker_account().describe())
        jobs = self._pending_jobs(chosen, workloads, result, advance, config.isolation)
        tainted: set[int] = set()
        with self._backend(judge, config) as backend:
            for phase in ([j for j in jobs if j.candidate.solution.name == REFERENCE],
                          [j for j in jobs if j.candidate.solution.name != REFERENCE]):
                for job, outcome, environment in backend.run(phase):
                    advance()
                    trace = self.trace(job, outcome, environment, config.isolation, calibration)
                    if job.index in tainted:
                        trace = rejected_for_a_changed_file(trace)
                    trace, tampered = recorder.record(trace)
                    if tampered:  # any job running alongside may have written it: trust none
                        tainted |= backend.running() - {job.index}
                    self._remember(trace)
                    result.traces.append(trace)
                    self.on_result(trace)
        recorder.set_aside_foreign_files()
        result.untrusted_files = recorder.untrusted
        return result

    def _backend(self, judge: JobJudge, config: JudgeConfig):
        if self.options.backend == "ray":
            from .ray_backend import RayBackend
            return RayBackend(config, judge)
        from .pool import DevicePool
        return DevicePool(judge, list(self.options.devices or [self.options.device]))

    def _pending_jobs(self, chosen, workloads, result: RunResult, advance, isolation: str) -> list[Job]:
        done = self._recorded() if self.options.resume else {}
        measured = self._measured_as()
        jobs = []
        for candidate in chosen:
            for workload in workloads:
                previous = done.get((candidate.hash, workload.uuid))
                if previous is not None and settled(previous, isolation, measured, self.options.timeout):
                    result.skipped.append(previous)
                    self._remember(previous)
                    advance()
                else:
                    jobs.append(Job(len(jobs), candidate, workload))
        return jobs

    def _recorded(self) -> dict[tuple[str, str], Trace]:
        return {(t.solution_hash, t.workload): t for t in read_traces(self.trace_file)}

    def _remember(self, trace: Trace) -> None:
        if trace.solution == REFERENCE and trace.performance is not None:
            self.reference_latency[trace.workload] = trace.performance.latency_ms

    def trace(self, job: Job, outcome: JobOutcome, environment: dict, isolation: str, calibration) -> Trace:
        candidate, workload = job.candidate, job.workload
        status, message = outcome.status, outcome.message
        performance = self._performance(outcome, job) if outcome.timing and status == "PASSED" else None
        floor = calibration.floor_ms(performance.bytes, performance.flops) if calibration and performance else None
        if floor and performance.latency_ms < floor:
            status = "REJECTED"
            message = f"{performance.latency_ms * 1e3:.2f} µs is faster than the speed-of-light floor {floor * 1e3:.2f} µs"
            performance = None
        return Trace(
            definition=self.definition.name, workload=workload.uuid, workload_name=workload.name,
            solution=candidate.solution.name, solution_hash=candidate.hash, solution_tags=candidate.solution.tags,
            author=candidate.solution.author, hardware=self.hardware, status=status, message=message,
            log=outcome.log[-2000:] if status != "PASSED" else "", correctness=outcome.errors,
            performance=performance, isolation=isolation,
            environment={**environment, "judge": JUDGE_VERSION, TIMEOUT_KEY: self.options.timeout},
            timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )

    def _performance(self, outcome: JobOutcome, job: Job) -> Performance:
        timing = dict(outcome.timing)
        clock, clocks = timing.pop("clock"), timing.pop("clocks")
        cost = self._cost(job.workload)
        reference = REFERENCE == job.candidate.solution.name
        reference_ms = timing["latency_ms"] if reference else self.reference_latency.get(job.workload.uuid)
        on_gpu = self.options.on_gpu
        method = ("events" if reference or self.options.timing == "events" else "graph") if on_gpu else "host clock"
        return Performance(
            **timing,
            reference_latency_ms=reference_ms,
            speedup=reference_ms / timing["latency_ms"] if reference_ms and timing["latency_ms"] > 0 else None,
            bytes=cost[0] if cost else None,
            flops=cost[1] if cost else None,
            timing={
                "method": method, "warmup": self.options.warmup, "iters": self.options.iters,
                "input_sets": self.options.input_sets, **self._measured_as(),
                "l2_flush_bytes": FLUSH_BYTES if on_gpu and self.options.flush != "none" else 0,
                **clock,
            },
            crosscheck={"method": "the judge's clock per batch and the worker's per call; the larger median is ranked",
                        **clocks},
        )

    def _measured_as(self) -> dict:
        """What a timed result records of how this run measured it, and `--resume` asks of a record it keeps:
        whether the seeds were public, on a GPU the L2 flush, and what judged its outputs (the definition's
        checks and its reference, and how many timed calls were checked): a pass under a looser tolerance, or
        with no timed call checked, is no pass now."""
        return {"seeds": "public" if self.options.seed is not None else "secret",
                **({"l2_flush": flush_label(self.options.flush)} if self.options.on_gpu else {}),
                "checks": self._checks_digest, "checked_calls_asked": self.options.checked_calls,
                "warmup": self.options.warmup, "iters": self.options.iters}

    @functools.cached_property
    def _checks_digest(self) -> str:
        """A hash of what decides whether a solution's outputs pass: the definition but for its words (description,
        tags) and cost model, and its reference's source. Which inputs are constant counts: a constant input is
        neither redrawn by any call nor drawn from the set's seed (a solution may keep what it derives from it)."""
        definition = self.definition.model_dump_json(exclude={"description": True, "tags": True, "cost": True})
        reference = reference_source(self.definition, self.repo.root)
        return hashlib.sha256(f"{definition}\0{reference}".encode()).hexdigest()[:16]

    def _cost(self, workload: Workload):
        """Bytes and FLOPs of a workload, evaluated once per run (its index structure is fixed)."""
        if workload.uuid not in self._costs:
            base_dir = self.repo.definition_path(self.definition.name).parent
            try:
                inputs = generate_inputs(self.definition, workload, 0, "meta", base_dir)
                cost = evaluate_cost(self.definition, bind_axes(self.definition, inputs), inputs)
            except Exception:  # noqa: BLE001 - a cost that reads a random input's values has none to read here
                cost = None  # the result stands; it has no floor nor rate
            self._costs[workload.uuid] = cost
        return self._costs[workload.uuid]
