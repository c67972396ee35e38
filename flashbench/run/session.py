"""One job (a solution on a workload) on one device, judged from outside its worker.

The recipe, as a sentence: allocate the job's arena and write its input sets; call every set once
and one set twice, and check those outputs and that the two identical calls agree; warm up on
fresh inputs; then timed batches, each call on inputs redrawn from a seed of its own, timed by the
judge's clock and less the harness's own steps; after every batch read back the outputs of the
calls picked (after the fact) for checking, and see that the inputs were left as they were drawn;
finally check the picked outputs against the reference on the same inputs.
"""

import math
import random
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel

from ..dtypes import has_nan
from ..model import OutputError, Status
from ..workloads.tensors import job_memory_budget
from . import sandbox
from .arena import Arena, plan_layout, views
from .judge.check import CheckedCall, Verdict, check_job
from .judge.clock import (Baseline, CleanSteps, disagreement, harness_per_call_ms, judge_per_call_ms, skipped_steps,
                          summarize)
from .judge.inputs import JobInputs, fresh_seed
from .judge.references import ReferenceStore
from .options import MIN_CHECKED_SAMPLES
from .protocol import MAX_BATCH_CALLS, Batch, BatchDone, Call, CallTimes, Close, Failed, Open, Opened, ReadTimes
from .recipe import L2Flush, link_values, linked_calls, output_link, raw_words
from .supervisor import WorkerGone, WorkerProcess

_secret = random.SystemRandom()


class JobOutcome(BaseModel):
    """What the judge found; the runner turns it into a trace."""

    status: Status
    message: str = ""
    log: str = ""
    errors: dict[str, OutputError] = {}
    timing: dict | None = None  # summary statistics and the clocks' details, when timed
    worker_usable: bool = True  # False: the next job needs a fresh worker


@dataclass
class SessionSettings:
    """How a run checks and times its jobs (one value for every job of the run)."""

    base_dir: Path
    set_seeds: list[int]
    warmup: int
    iters: int
    graph: bool
    flush: str
    timeout: float
    checked_calls: int | None  # timed calls checked per job; None: every one
    target_batch_ms: float  # a batch at least this long, so the handshake around it is negligible
    min_batches: int
    slot_budget_bytes: int
    max_batch: int = MAX_BATCH_CALLS
    timed_budget_ms: float = math.inf  # past min_batches, no more timed batches than fit in this much time


@dataclass
class _Read:
    """A picked call's outputs, read from its slot right after its batch (a copy on the host); its reference
    comes later."""

    label: str
    batch: int  # the batch's place in the job's history
    call: int  # the call's place in its batch
    outputs: dict[str, torch.Tensor]


@dataclass
class _Times:
    batch_ms: list[float] = field(default_factory=list)  # the judge's clock, per timed batch
    baseline_ms: list[float] = field(default_factory=list)  # the same batch's harness steps, run by the judge
    batch_sizes: list[int] = field(default_factory=list)
    worker_ms: list[float] = field(default_factory=list)  # per call, every call
    issue_ms: list[float] = field(default_factory=list)  # the worker's time to issue each timed batch
    clean_step_ms: float | None = None  # the steps' cost per call where no solution could touch the device

    @property
    def judge_ms(self) -> list[float]:
        """Per call, one value per batch."""
        return judge_per_call_ms(self.batch_ms, self.baseline_ms, self.batch_sizes, self.clean_step_ms)


class Session:
    def __init__(self, settings: SessionSettings, references: ReferenceStore, flush: L2Flush, device: str,
                 on_phase: Callable[[str], None] = lambda phase: None, clean_steps: CleanSteps | None = None,
                 trusted: bool = False):
        self.settings = settings
        self.clean_steps = clean_steps
        self.trusted = trusted  # the definition's reference: its worker runs no solution code
        self.on_phase = on_phase
        self.references = references
        self.flush = flush
        self.device = device
        self.definition = references.definition

    def run(self, worker: WorkerProcess, workload, destination_passing: bool) -> JobOutcome:
        try:
            return self._run(worker, workload, destination_passing)
        except WorkerGone as gone:
            return JobOutcome(status=gone.status, message=gone.message, log=gone.log, worker_usable=False)
        except _Stop as stop:
            return stop.outcome
        except (MemoryError, RuntimeError) as exc:  # the judge's own: a large workload, or a worker holding the device
            if not _out_of_memory(exc):
                raise
            return JobOutcome(status="RUNTIME_ERROR", worker_usable=False,
                              message="the device had no memory left for the judge's own work on the job: "
                                      "the workload's input sets, the judge's copies of them and what the "
                                      "worker holds did not fit together")

    def _run(self, worker, workload, destination_passing) -> JobOutcome:
        settings = self.settings
        deadline = _Deadline(settings.timeout)
        inputs = JobInputs(self.definition, workload, settings.set_seeds, self.device, settings.base_dir,
                           budget_bytes=job_memory_budget(self.device))
        sets = len(inputs.sets)
        slots = max(sets + 1, min(settings.max_batch, settings.slot_budget_bytes // max(inputs.output_bytes, 1)))
        layout = plan_layout(inputs.tensors, inputs.scalars, inputs.outputs, sets, slots, self.flush.read_buffer)
        arena = self._open_arena(worker, workload, layout, deadline)
        try:
            arena_sets = [views(arena.memory, s) for s in layout.sets]
            arena_slots = [views(arena.memory, s) for s in layout.slots]
            for arena_set, made in zip(arena_sets, inputs.current):  # no call made yet: the sets as drawn
                for name, tensor in arena_set.items():
                    tensor.copy_(made[name])
            if layout.flush is not None:  # the bytes only the judge drew: the worker cannot make them again
                views(arena.memory, {"flush": layout.flush})["flush"].copy_(self.flush.read_buffer)
            job = _Job(self, worker, inputs, arena_sets, arena_slots, deadline)
            # The worker copies outputs into the call's slot after the call when the solution returns them,
            # and after every graph replay (from the slot the graph was captured with): so does the baseline.
            copies = not destination_passing or self.settings.graph
            outcome = job.judge(Baseline(inputs, self.flush, copies_outputs=copies, max_calls=len(arena_slots)))
            if worker.alive() and not closed(worker, deadline):
                outcome.worker_usable = False  # the verdict stands; the next job gets a fresh worker
            return outcome
        finally:
            arena.close()

    def _open_arena(self, worker: WorkerProcess, workload, layout, deadline: "_Deadline") -> Arena:
        """A CPU job's arena is a sealed memfd the judge makes and sends; a GPU job's, memory the worker exports."""
        on_gpu = torch.device(self.device).type == "cuda"
        arena = None if on_gpu else Arena.create_memfd(layout.nbytes)
        open_job = Open(workload=workload, arena=arena and arena.handle, layout=layout, flush=self.flush.method,
                        flush_bytes=self.flush.nbytes)
        try:
            reply = deadline.ask(worker, open_job, fd=arena and arena.fd)
        except WorkerGone:
            if arena:
                arena.close()
            raise
        if isinstance(reply, Failed):
            if arena:
                arena.close()
            raise reported_failure(reply, worker.log_tail(), worker_usable=not on_gpu)
        if not on_gpu:
            return arena
        if not isinstance(reply, Opened):
            raise _Stop(JobOutcome(status="REJECTED", message="the worker answered the job with no arena",
                                   log=worker.log_tail(), worker_usable=False))
        try:
            return Arena.import_cuda(reply.arena, layout.nbytes, self.device)
        except (ValueError, RuntimeError) as exc:
            raise _Stop(JobOutcome(status="REJECTED", message=f"the worker's arena cannot be used: {exc}",
                                   log=worker.log_tail(), worker_usable=False)) from None


# What a worker may report of its own failure once a job is open: its call failed, or its outputs are
# malformed. Anything else (a build or device failure) is a claim it has no business making there.
JOB_FAILURES = frozenset({"INCORRECT_SHAPE", "INCORRECT_DTYPE", "RUNTIME_ERROR", "REJECTED"})
PAUSE_ATTEMPTS = 3  # tries at stopping the sandbox for one batch's steps before the pair is REJECTED
# How long a job's worker may take to close it (release its arena) once the verdict is in, within the workload's
# timeout: a worker that never answered held its lane for the rest of that timeout on every job (a red team's
# 40 s a job under `--timeout 40`), at no cost to its verdict. A worker releases an arena in well under a second.
CLOSE_TIMEOUT_S = 10.0


def _out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says the device ran out of memory: CUDA's error, Python's, or torch's CPU allocator, which
    raises a plain RuntimeError (a GPU-sized workload on a CPU ended a run with a traceback so)."""
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "DefaultCPUAllocator" in str(exc)


def closed(worker: WorkerProcess, deadline: "_Deadline") -> bool:
    """Whether the worker closed its job (released its arena) within CLOSE_TIMEOUT_S and the workload's timeout."""
    try:
        worker.ask(Close(), min(CLOSE_TIMEOUT_S, max(deadline.end - time.monotonic(), 1e-3)))
        return True
    except WorkerGone:
        return False


def reported_failure(reply: Failed, log: str, worker_usable: bool) -> "_Stop":
    if reply.status not in JOB_FAILURES:
        return _Stop(JobOutcome(status="REJECTED", log=log, worker_usable=False,
                                message=f"the worker reported {reply.status} in the middle of a job"))
    return _Stop(JobOutcome(status=reply.status, message=reply.message, log=log, worker_usable=worker_usable))


class _Stop(Exception):
    def __init__(self, outcome: JobOutcome):
        self.outcome = outcome


class _Deadline:
    """A workload's timeout, for all of its job's requests together (Open, every batch and its times,
    Close): given to each request afresh, it let a worker that answered every untimed request a little
    under it hold its lane for a timeout per request (8 s per ReadTimes: 53 s under a 10 s timeout)
    and still PASS."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def ask(self, worker: WorkerProcess, request, fd: int | None = None):
        return self.timed_ask(worker, request, fd)[0]

    def timed_ask(self, worker: WorkerProcess, request, fd: int | None = None, on_receipt=lambda: None):
        try:
            return worker.timed_ask(request, max(self.end - time.monotonic(), 1e-3), fd, on_receipt)
        except WorkerGone as gone:
            if gone.status == "TIMEOUT":
                raise WorkerGone("TIMEOUT", f"no answer within the workload's {self.seconds:g} s (its timeout, for "
                                            "all its requests)", gone.log) from None
            raise


class _Job:
    """The batches of one job and what the judge read after each."""

    def __init__(self, session: Session, worker: WorkerProcess, inputs: JobInputs, arena_sets, arena_slots,
                 deadline: _Deadline):
        self.session = session
        self.deadline = deadline
        self.settings = session.settings
        self.definition = session.definition
        self.worker = worker
        self.inputs = inputs
        self.arena_sets = arena_sets
        self.arena_slots = arena_slots
        # every batch sent, in order, with the links its calls' redraws used and what their flushes returned:
        # replayed for the references
        self.history: list[tuple[Batch, list[int | None], list[int]]] = []
        self.reads: list[_Read] = []
        self.times = _Times()

    def judge(self, baseline: Baseline) -> JobOutcome:
        sets = len(self.arena_sets)
        first = [Call(set=i, slot=i) for i in range(sets)] + [Call(set=0, slot=sets)]
        self.session.on_phase("check")
        self.batch(first, timed=False, graph=False,
                   picked={k: f"input set {c.set}" if c.slot < sets else "the repeated call" for k, c in enumerate(first)})
        self.session.on_phase("time")
        clean = self.session.clean_steps
        if clean is not None and not self.session.trusted:
            self.times.clean_step_ms = clean.get(self.inputs.workload.uuid, self.session.device)
        self.timed_batches(baseline, self.warm_up())
        if clean is not None and self.session.trusted:
            clean.measure(baseline, self.inputs.workload.uuid, self.session.device)
        verdict = self.check_outputs()
        if not verdict.passed:
            return self.outcome(verdict)
        return self.outcome(verdict, self.timing())

    def warm_up(self) -> float:
        """The judge's time per call of a batch, its steps included (ms); the graphs are captured here
        in graph timing. In batches of at most one call per slot, as every batch: the judge reads a slot
        when its batch ends, so a second call into it would leave the first call's link unverifiable
        (large outputs leave fewer slots than warm-up calls)."""
        sets = len(self.arena_sets)
        count = max(self.settings.warmup, 1, sets if self.settings.graph else 0)
        per_batch = len(self.call_slots())
        return sum(self.batch([self.fresh_call(k) for k in range(start, min(start + per_batch, count))], timed=False,
                              graph=self.settings.graph, picked={})[0]
                   for start in range(0, count, per_batch)) / count

    def timed_batches(self, baseline: Baseline, step_ms: float) -> None:
        """Batches long enough that the handshake around each is negligible, and at least `iters` calls,
        unless they would take longer than the budget: a slow call (a PyTorch reference at 100-200 ms)
        runs min_batches batches or what fits in the budget, whichever is more."""
        settings = self.settings
        size = self.batch_size(step_ms)
        if size > 1:
            # The warm-up's few calls carry the batch's fixed cost (the round trip, about 1 ms on the
            # H200), which made its step look long and the timed batches short (20-60 ms, not 100): an
            # untimed batch of about the target's length measures the step again.
            sizing_ms = self.batch([self.fresh_call(k) for k in range(size)], timed=False, graph=settings.graph,
                                   picked={})[0]
            step_ms = sizing_ms / size
            size = self.batch_size(step_ms)
        affordable = settings.timed_budget_ms / max(size * step_ms, 1e-3)
        batches = max(settings.min_batches, math.ceil(min(settings.iters / size, affordable)),
                      math.ceil(self.calls_for_samples() / size))
        picked = self.pick_checks(batches, size)
        for b in range(batches):
            calls = [self.fresh_call(k) for k in range(size)]
            labels = {k: f"timed call {b * size + k + 1} of {batches * size}" for k in picked.get(b, [])}
            batch_ms, batch = self.batch(calls, timed=True, graph=settings.graph, picked=labels)
            self.times.batch_ms.append(batch_ms)
            _, links, flushed = self.history[-1]
            self.times.baseline_ms.append(self.steps_ms(baseline, batch, links))
            self.reject_unflushed(baseline, batch, flushed, b)
            self.times.batch_sizes.append(size)

    def reject_unflushed(self, baseline: Baseline, batch: Batch, reported: list[int], b: int) -> None:
        """Every timed call's L2 flush must have returned what the judge's own returns for the same link and
        keys: with keyed read passes (recipe.L2Flush) another number means the passes were skipped, shortened
        or run on other data, and the call's queries were not the judge's. The judge's run of the batch's
        steps (steps_ms) keyed each flush by the links the worker reported (checked against its outputs:
        reject_unfinished_outputs), so it has the judge's number for every call, not only the picked ones. A
        flush without read passes returns the link it was given, and must have reported that."""
        for k, (call, mine, theirs) in enumerate(zip(batch.calls, baseline.flushed, reported)):
            if call.seed is not None and mine != theirs:
                raise _Stop(self.rejected(f"the L2 flush before call {k + 1} of timed batch {b + 1} did not return "
                                          "what the judge's own gives (its keyed reads, or the link it was given): "
                                          "the flush was skipped, shortened or run on other data, or misreported"))

    def steps_ms(self, baseline: Baseline, batch: Batch, links: list[int | None] | None = None) -> float:
        """The judge's own time for the batch's steps, taken while the worker's sandbox is stopped: a process
        of it left running then would make the steps look dearer and the solution's calls, with them
        subtracted, cheaper. A sandbox that did not stay stopped throughout is tried again, then REJECTED."""
        for _ in range(PAUSE_ATTEMPTS):
            with self.worker.paused() as pause:
                reading = baseline.time_ms(batch, links)
            if pause.held:
                return reading
        raise _Stop(self.rejected("its sandbox could not be stopped while the judge timed its own steps: a "
                                  "process of it kept running (forking, held in the kernel, or resumed)"))

    def batch_size(self, step_ms: float) -> int:
        """Calls in a batch that lasts the target, given the time of one call with its steps."""
        size = math.ceil(self.settings.target_batch_ms / max(step_ms, 1e-3))
        return max(1, min(size, len(self.call_slots()), self.settings.max_batch))

    def call_slots(self) -> range:
        """The output slots calls are given, one per call of a batch. Under graph replay the first
        slots (one per input set) are where the graphs were captured and write: each replay's outputs
        are then copied into its call's own slot, so every call can be checked, as with events."""
        return range(len(self.arena_sets) if self.settings.graph else 0, len(self.arena_slots))

    def fresh_call(self, k: int) -> Call:
        slots = self.call_slots()
        return Call(set=k % len(self.arena_sets), slot=slots[k % len(slots)], seed=fresh_seed())

    def pick_checks(self, batches: int, size: int) -> dict[int, list[int]]:
        """Which timed calls are checked, drawn in the judge where the worker cannot see: every call
        can be one, and every batch has one, so no batch can be known to go unchecked (a solution
        wrong on a share of its calls fails each batch with that chance)."""
        per_batch = list(range(size))
        candidates = [(b, k) for b in range(batches) for k in per_batch]
        wanted = len(candidates) if self.settings.checked_calls is None else self.settings.checked_calls
        wanted = max(wanted, self.calls_for_samples())
        chosen = {(b, _secret.choice(per_batch)) for b in range(batches)}
        rest = [c for c in candidates if c not in chosen]
        chosen |= set(_secret.sample(rest, max(0, min(wanted - len(chosen), len(rest)))))
        picked: dict[int, list[int]] = {}
        for b, k in sorted(chosen):
            picked.setdefault(b, []).append(k)
        return picked

    def calls_for_samples(self) -> int:
        """Timed calls to check so that a sampling definition's test has MIN_CHECKED_SAMPLES samples of each
        output (the first batch's checked calls aside); 0 for other evaluators. Drawn among the timed calls
        like any check, so a solution cannot tell them from the calls that go unchecked."""
        if self.definition.evaluator.kind != "sampling":
            return 0
        per_call = min(tensor.numel() for tensor in self.arena_slots[0].values())
        return math.ceil(MIN_CHECKED_SAMPLES / max(per_call, 1))

    def batch(self, calls: list[Call], timed: bool, graph: bool, picked: dict[int, str]) -> tuple[float, Batch]:
        """Run one batch; the judge's time for it (ms). The outputs are poisoned; after the batch the picked
        calls' outputs are read, leftovers looked for, the batch's redraws replayed on the judge's copies
        (with the links and flush results the worker reports), and changes to the inputs and unfinished
        outputs looked for (reject_changed_inputs, reject_unfinished_outputs; every call's flush is checked
        when the judge runs the batch's steps itself, reject_unflushed). Nothing the judge does between
        batches depends on which calls are picked: the references wait for the end of the job
        (`check_outputs`), so the worker cannot tell from the judge's pauses which batches are checked."""
        batch = Batch(calls=calls, graph=graph, fresh_seed=fresh_seed())
        for slot in self.arena_slots[:max(c.slot for c in calls) + 1]:
            for tensor in slot.values():
                _poison(tensor)
        _synchronize(self.session.device)
        linked = linked_calls(calls)
        read, expected_links, sampled_inputs = {}, {}, []

        def observe() -> None:
            # Copies taken the moment the reply's first byte is there (before it is read), nothing written later
            # counts: the picked calls' outputs, on the host (they wait there for the job's end and are compared
            # one call at a time; on the device, a job checking 8 calls of 2 GB outputs held 16 GB more, and the
            # largest MHA varlen workloads did not fit an 80 GB H100); and every linked call's link, from the
            # outputs the call before it left in its slot (each call of a batch has a slot of its own): checked
            # for every call alike, not only the picked ones.
            for k in picked:
                read[k] = {name: tensor.to("cpu", copy=True) for name, tensor in self.arena_slots[calls[k].slot].items()}
            expected_links.update(zip(linked, link_values(
                [output_link(list(self.arena_slots[calls[k - 1].slot].values())) for k in linked])))
            sampled_inputs.extend({name: sample_words(tensor) for name, tensor in arena_set.items()}
                                  for arena_set in self.arena_sets)

        reply, elapsed_ms = self.deadline.timed_ask(self.worker, batch, on_receipt=observe)
        if not isinstance(self.unless_failed(reply), BatchDone):
            raise _Stop(self.rejected("the worker's reply does not match the batch it was sent"))
        self.reject_leftovers()
        times = self.unless_failed(self.deadline.ask(self.worker, ReadTimes()))
        if not isinstance(times, CallTimes) or {len(times.event_ms), len(times.links), len(times.flushed)} != {len(calls)}:
            raise _Stop(self.rejected("the worker's times do not match the batch it was sent"))
        links = [times.links[k] if k in expected_links else None for k in range(len(calls))]
        self.replay(batch, links, times.flushed)
        self.history.append((batch, links, times.flushed))
        self.reject_changed_inputs()
        self.reject_inputs_written_late(sampled_inputs)
        self.reject_unfinished_outputs(picked, expected_links, links)
        self.reads += [_Read(label, len(self.history) - 1, k, read[k]) for k, label in picked.items()]
        if timed:
            self.times.worker_ms += times.event_ms
            self.times.issue_ms.append(times.issue_ms)
        return elapsed_ms, batch

    def unless_failed(self, reply):
        """`reply`, unless the worker reported a failure: then the job ends with it (a GPU worker is not reused)."""
        if isinstance(reply, Failed):
            raise reported_failure(reply, self.worker.log_tail(), worker_usable=self.session.device == "cpu")
        return reply

    def replay(self, batch: Batch, links: list[int | None], flushed: list[int],
               each_call: Callable[[int, Call], None] = lambda k, call: None) -> None:
        """The batch's redraws on the judge's copies of the sets, with the links and flush results the worker
        says they used (a wrong one leaves its sets unlike the judge's), `each_call` seeing each call's inputs."""
        self.inputs.replay.draw(batch.fresh_seed, batch.calls)
        for k, call in enumerate(batch.calls):
            self.inputs.replay.redraw(k, links[k])
            self.inputs.replay.flip(k, flushed[k])
            each_call(k, call)

    def expected_outputs(self) -> list[CheckedCall]:
        """The picked calls with their references: the judge's copies of the sets are rewound to
        their first state and the job's redraws replayed, each picked call's reference computed on
        the inputs it saw."""
        for current, drawn in zip(self.inputs.current, self.inputs.sets):
            for name, tensor in current.items():
                if isinstance(tensor, torch.Tensor):
                    tensor.copy_(drawn[name])
        wanted = {(read.batch, read.call): read for read in self.reads}
        checked: dict[tuple[int, int], CheckedCall] = {}

        def check(b: int, k: int, call: Call) -> None:
            read = wanted.get((b, k))
            if read is not None:
                checked[b, k] = CheckedCall(read.label, read.outputs, self.reference(call))

        for b, (batch, links, flushed) in enumerate(self.history):
            self.replay(batch, links, flushed, lambda k, call: check(b, k, call))
        return [checked[read.batch, read.call] for read in self.reads]

    def reference(self, call: Call) -> dict:
        references = self.session.references
        if call.seed is None:  # a set as drawn: the same for every solution of the run
            key = (self.inputs.workload.uuid, self.settings.set_seeds[call.set])
            return references.kept(key, lambda: self.inputs.drawn(call.set))
        return references.compute(self.inputs.current[call.set])

    def reject_leftovers(self) -> None:
        leftovers = self.worker.leftovers()
        if leftovers:
            log = self.worker.log_tail()
            first = sandbox.command_line(leftovers[0])  # e.g. multiprocessing's resource tracker, which spawn starts
            self.worker.close()
            raise _Stop(JobOutcome(status="REJECTED", log=log, worker_usable=False,
                                   message=f"left {len(leftovers)} process(es) running after its calls ({first}); "
                                           f"they were killed"))

    def reject_changed_inputs(self) -> None:
        for arena_set, expected in zip(self.arena_sets, self.inputs.current):
            changed = [name for name, tensor in arena_set.items() if not torch.equal(tensor, expected[name])]
            if changed:
                raise _Stop(self.rejected(f"the solution modified its inputs: {', '.join(changed)}"))

    def reject_inputs_written_late(self, sampled: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """The sets, as sampled when the batch's reply arrived, must already be what its redraws make them: the
        worker's own steps (drawing, rotating and writing the fresh windows) run inside the judge's clock, and
        a worker that finished writing them after replying, before the judge's next question, had them out of
        it (a red team: the rows no request reads written late, on a CPU)."""
        for samples, expected in zip(sampled, self.inputs.current):
            late = [name for name, (places, words) in samples.items()
                    if not torch.equal(raw_words(expected[name])[places.to(expected[name].device)].cpu(), words)]
            if late:
                raise _Stop(self.rejected(f"the solution's inputs were still being written when its batch "
                                          f"ended: {', '.join(late)}"))

    def reject_unfinished_outputs(self, picked: dict[int, str], expected: dict[int, int], links: list[int | None]) -> None:
        """Every linked call's redraw must have been linked to the outputs the call before it left in its slot
        (`expected`, read when the batch ended): a link from other bytes means those outputs were still being
        written when the next call's steps began (work left running after its call returned, on another stream
        or in a thread), or a link made up so that the next call's steps could start early."""
        for k, link in expected.items():
            if links[k] != link:
                label = picked.get(k, f"call {k + 1} of its batch")
                raise _Stop(self.rejected(
                    f"the outputs of the call before {label} were still being written after that call returned: "
                    "the next call's inputs were drawn from unfinished outputs (work left running on another "
                    "stream or thread), or its link was made up"))

    def check_outputs(self) -> Verdict:
        """The first checked call that fails, or a pass whose errors are the worst seen per output; the
        first batch's set 0 was called twice, and (unless the definition samples) must agree."""
        return check_job(self.definition, self.expected_outputs(), repeat=(0, len(self.arena_sets)),
                         compute_on=self.session.device, seed=fresh_seed())

    def timing(self) -> dict:
        """The ranked figures: the larger of the two clocks' medians, with that clock's spread. A
        solution is never ranked faster than the judge measured it from outside; where the judge's
        subtraction is noisier than the call, the worker's own per-call clock (which then reads more)
        gives the figure."""
        device_type = torch.device(self.session.device).type
        judge = summarize(self.times.judge_ms)
        worker = summarize(self.times.worker_ms)
        problem = (disagreement(worker["latency_ms"], judge["latency_ms"], device_type)
                   or skipped_steps(self.times.batch_ms, self.times.baseline_ms, self.times.batch_sizes,
                                    self.times.worker_ms, device_type, self.times.clean_step_ms))
        if problem:
            raise _Stop(self.rejected(problem))
        ranked, name = (worker, "worker") if worker["latency_ms"] >= judge["latency_ms"] else (judge, "judge")
        return {**ranked, "clock": {
            "ranked_clock": name, "judge_method": "wall clock per batch, less the harness's steps run by the judge with "
                                             + ("an empty kernel" if device_type == "cuda" else "nothing") + " for the call",
            "batches": len(self.times.batch_ms), "calls_per_batch": self.times.batch_sizes[0],
            "checked_calls": len(self.reads) - len(self.arena_sets) - 1,
            "input_sets": len(self.arena_sets),
            "steps_per_call_ms": self.steps_per_call_ms(),
            "worker_issue_share": self.issue_share(),
        }, "clocks": {
            "judge": {key: judge[key] for key in ("latency_ms", "p10_ms", "p90_ms", "ci_low_ms", "ci_high_ms", "samples")},
            "worker": {key: worker[key] for key in ("latency_ms", "p10_ms", "p90_ms", "ci_low_ms", "ci_high_ms", "samples")},
        }}

    def steps_per_call_ms(self) -> dict:
        """The harness's steps the judge's clock took away per call, and what that figure was chosen
        from: its own baselines (least and median over the batches) and the clean measurement."""
        times = self.times
        own = [base / size for base, size in zip(times.baseline_ms, times.batch_sizes)]
        return {"subtracted": harness_per_call_ms(times.baseline_ms, times.batch_sizes, times.clean_step_ms),
                "least": min(own), "median": statistics.median(own), "clean": times.clean_step_ms}

    def issue_share(self) -> float | None:
        """The median, over the timed batches, of the worker's time to issue a batch over the judge's time
        for it: near 1, the host bounded the batch and the judge's clock read host time, not the device's.
        The worker's word, recorded to explain a figure; nothing is decided by it."""
        # Never above 1: the worker issues a batch within the judge's time for it, whatever it reports.
        shares = [min(issue / batch, 1.0) for issue, batch in zip(self.times.issue_ms, self.times.batch_ms)
                  if batch > 0]
        return statistics.median(shares) if shares else None

    def rejected(self, message: str) -> JobOutcome:
        return JobOutcome(status="REJECTED", message=message, log=self.worker.log_tail())

    def outcome(self, verdict: Verdict, timing: dict | None = None) -> JobOutcome:
        log = self.worker.log_tail() if not verdict.passed else ""
        return JobOutcome(status=verdict.status, message=verdict.message, errors=verdict.errors, log=log, timing=timing)


# Elements of each input tensor read when a batch's reply arrives, at places drawn then from a seed the worker
# never sees: a worker that leaves any share of the sets' writes for later is found with near certainty, for the
# cost of a few small reads per tensor.
SAMPLED_INPUT_WORDS = 4096


def sample_words(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(places, the words there, on the host): every element of a small tensor, else SAMPLED_INPUT_WORDS random
    ones."""
    words = raw_words(tensor)
    if words.numel() <= SAMPLED_INPUT_WORDS:
        places = torch.arange(words.numel(), device=words.device)
    else:
        generator = torch.Generator(words.device).manual_seed(secrets.randbits(63))
        places = torch.randint(words.numel(), (SAMPLED_INPUT_WORDS,), generator=generator, device=words.device)
    return places.cpu(), words[places].cpu()


def _poison(tensor: torch.Tensor) -> None:
    """What an output slot holds until the solution writes it: NaN where the dtype has one, which never passes;
    elsewhere values drawn anew for each batch from a seed the worker never sees, never a constant it could
    count on (int8's minimum was the byte of FP8's -0.0 and True a mask's common value: an element whose right
    value it was passed unwritten)."""
    if has_nan(str(tensor.dtype).removeprefix("torch.")):
        tensor.fill_(float("nan"))
        return
    generator = torch.Generator(tensor.device).manual_seed(secrets.randbits(63))
    if tensor.dtype == torch.bool:
        tensor.random_(0, 2, generator=generator)
    elif tensor.dtype.is_floating_point:  # packed FP4: every byte is two numbers
        tensor.view(torch.uint8).random_(0, 256, generator=generator)
    else:
        info = torch.iinfo(tensor.dtype)
        tensor.random_(info.min, min(info.max, 2**63 - 1), generator=generator)  # uint64's top half: past a long


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
