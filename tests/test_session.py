"""One job judged from outside its worker (flashbench/run/session.py, judge/references.py).

Real runs on the CPU: every timed call can be checked there, so a solution wrong only from its
Nth call on fails with a message naming a timed call; the inputs of every call differ (a solution
records a fingerprint of each call's inputs; caches keyed by the inputs' buffers or structure go
stale); the two identical calls must agree (tests/test_adversarial.py has a solution that changes its
inputs); the ranked latency is the larger of the judge's and the worker's medians; each trace
records its isolation level and how many timed calls were checked. Then the session's rules
without a worker: which call uses which input set and output slot, which calls are picked for
checking, how the clocks are ranked, how outputs are poisoned and checked; and the reference
outputs kept in memory."""

import contextlib
import shutil
import textwrap
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flashbench.run.jobs

from flashbench import Repo
from flashbench.build import content_hash
from flashbench.run import RunOptions, Runner, sandbox, select_solutions, select_workloads
from flashbench.run.judge.check import CheckedCall
from flashbench.run.judge.references import ReferenceStore
from flashbench.run.options import MIN_BATCHES, MIN_CHECKED_SAMPLES, TARGET_BATCH_MS
from flashbench.run.session import (CLOSE_TIMEOUT_S, PAUSE_ATTEMPTS, Session, SessionSettings, _Deadline, _Job, _poison,
                                    _Stop, _Times, closed, sample_words)
from flashbench.run.protocol import Batch, Call, Close
from flashbench.run.recipe import output_link
from flashbench.run.supervisor import WorkerGone, WorkerProcess

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
FIXTURES = Path(__file__).parent / "fixtures" / "solutions" / DEFINITION
WORKLOAD = "smoke_mixed"
SETS = 2  # input sets; with warmup 0, a job's first three calls are the untimed checks, its 5th call is timed

# Each call appends a fingerprint of all its inputs to $HOME/calls.txt (HOME is the solution's own
# build directory, the one lasting place its worker may write), then computes correctly.
FINGERPRINTS = '''
import hashlib, os
import torch
from decode_math import decode_into


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse):
    digest = hashlib.sha256(repr(sm_scale).encode())
    for tensor in (q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices):
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    os.makedirs(os.environ["HOME"], exist_ok=True)
    with open(os.path.join(os.environ["HOME"], "calls.txt"), "a") as calls:
        calls.write(digest.hexdigest() + "\\n")
    decode_into(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse)
'''

SOLUTIONS = {
    "counts_calls": "INCORRECT_NUMERICAL",  # correct on its first 3 calls, wrong from the 4th on
    "cache_by_pointer": "INCORRECT_NUMERICAL",  # a cache keyed by the input buffers' addresses
    "cache_by_structure": "INCORRECT_NUMERICAL",  # a cache keyed by the index structure and shapes
    "nondeterministic": "REJECTED",  # within tolerance each time, but two identical calls differ
    "fingerprints": "PASSED",
    "correct_dps": "PASSED",
}


def write_fingerprints(folder: Path) -> Path:
    return write_solution(folder, "fingerprints", FINGERPRINTS)


def write_solution(folder: Path, name: str, kernel: str) -> Path:
    """A destination-passing Python solution folder of the decode definition, with the fixtures' decode_math
    (the worker sees no folder outside its own)."""
    folder.mkdir(parents=True)
    (folder / "kernel.py").write_text(kernel)
    shutil.copy(FIXTURES.parent / "_shared" / "decode_support" / "decode_math.py", folder)
    (folder / "solution.yaml").write_text(textwrap.dedent(f"""\
        name: {name}
        definition: {DEFINITION}
        author: tests
        language: python
        entry_point: kernel.py::run
        destination_passing_style: true
        dependencies: [torch]
    """))
    return folder


def run(repo_root: Path, cache: Path, trace_dir: Path, folders: list[Path], **options):
    repo = Repo(repo_root)
    runner = Runner(repo, DEFINITION, RunOptions(**{
        "device": "cpu", "iters": 3, "warmup": 0, "input_sets": SETS, "timeout": 60.0, "trace_dir": trace_dir,
        "cache_dir": cache, **options}))
    candidates = runner.candidates(select_solutions(repo, DEFINITION, [str(f) for f in folders]))[1:]
    result = runner.run(candidates, select_workloads(repo, DEFINITION, [WORKLOAD], "cpu"))
    return result, {c.solution.name: c for c in candidates}


@pytest.fixture(scope="module")
def judged(repo_copy, shared_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("session")
    folders = [write_fingerprints(tmp / "fingerprints") if name == "fingerprints" else FIXTURES / name
               for name in SOLUTIONS]
    (shared_cache / "build" / content_hash(tmp / "fingerprints") / "home" / "calls.txt").unlink(missing_ok=True)
    result, candidates = run(repo_copy, shared_cache, tmp / "traces", folders)
    return result, {t.solution: t for t in result.traces}, candidates


@pytest.mark.parametrize("name, status", SOLUTIONS.items())
def test_status(judged, name, status):
    _, traces, _ = judged
    trace = traces[name]
    assert trace.status == status, f"{name}: {trace.status} {trace.message}"
    assert (trace.performance is not None) is (status == "PASSED")


@pytest.mark.parametrize("name", ["counts_calls", "cache_by_pointer"])
def test_a_solution_wrong_only_on_later_calls_fails_on_a_timed_call(judged, name):
    """On a CPU every timed call is checked (picked after its batch ran, where the worker cannot see)."""
    _, traces, _ = judged
    message = traces[name].message
    assert "timed call" in message and "outside atol/rtol" in message, message


def test_every_timed_call_is_checked_on_a_cpu(judged):
    _, traces, _ = judged
    timing = traces["correct_dps"].performance.timing
    assert timing["checked_calls"] == timing["batches"] * timing["calls_per_batch"]


def test_the_inputs_of_every_call_differ(judged, shared_cache):
    """Every call's inputs are new, except the one repeated on purpose: the job's third call is the
    first input set again, unchanged, to see that identical calls agree."""
    _, _, candidates = judged
    calls = (shared_cache / "build" / candidates["fingerprints"].hash / "home" / "calls.txt").read_text().split()
    assert len(calls) >= SETS + 1 + 1 + 3  # the untimed checks, a warm-up call, at least `iters` timed calls
    assert calls[SETS] == calls[0] and calls[1] != calls[0]
    assert [n for n in Counter(calls).values() if n > 1] == [2]


def test_no_reference_is_computed_between_batches(repo_copy, shared_cache, tmp_path, monkeypatch):
    """The judge's pauses between batches must not depend on which calls are checked: every reference
    of a timed call is computed after the job's last batch (on inputs replayed from the seeds)."""
    events = []
    timed_ask, compute = WorkerProcess.timed_ask, ReferenceStore.compute
    monkeypatch.setattr(WorkerProcess, "timed_ask", lambda self, request, *a: (
        events.append("batch") if isinstance(request, Batch) else None) or timed_ask(self, request, *a))
    monkeypatch.setattr(ReferenceStore, "compute", lambda self, *a: events.append("reference") or compute(self, *a))
    result, _ = run(repo_copy, shared_cache, tmp_path, [FIXTURES / "correct_dps"], checked_calls=2)
    assert [t.status for t in result.traces] == ["PASSED"]
    first_batch, last_batch = events.index("batch"), len(events) - 1 - events[::-1].index("batch")
    assert events.count("batch") >= 4 and events[last_batch + 1:].count("reference") >= 2
    assert "reference" not in events[first_batch:last_batch]


def test_identical_calls_must_agree(judged):
    _, traces, _ = judged
    assert "outputs change between identical calls" in traces["nondeterministic"].message


def test_the_ranked_latency_is_the_larger_of_the_two_clocks(judged):
    _, traces, _ = judged
    performance = traces["correct_dps"].performance
    judge, worker = performance.crosscheck["judge"], performance.crosscheck["worker"]
    assert performance.latency_ms == max(judge["latency_ms"], worker["latency_ms"]) > 0
    ranked = performance.timing["ranked_clock"]
    assert performance.latency_ms == performance.crosscheck[ranked]["latency_ms"]
    batches, size = performance.timing["batches"], performance.timing["calls_per_batch"]
    assert batches >= MIN_BATCHES["cpu"] and batches * size >= 3
    assert judge["samples"] == batches and worker["samples"] == batches * size  # per batch; per call
    assert performance.timing["seeds"] == "secret"


def test_the_isolation_level_is_recorded(judged):
    result, traces, _ = judged
    assert result.isolation == sandbox.available_isolation()
    assert {t.isolation for t in traces.values()} == {result.isolation}
    assert result.workers_as.startswith("as ")  # who the workers ran as, for the run's last line


def test_a_run_at_level_process_checking_one_timed_call(repo_copy, shared_cache, tmp_path):
    result, _ = run(repo_copy, shared_cache, tmp_path / "traces", [FIXTURES / "correct_dps"],
                    isolation="process", checked_calls=1)
    (trace,) = result.traces
    assert (result.isolation, trace.isolation, trace.status) == ("process", "process", "PASSED")
    assert trace.performance.timing["checked_calls"] == trace.performance.timing["batches"]  # one in every batch


# The session's rules, without a worker.

def settings(graph=False, checked_calls=None) -> SessionSettings:
    return SessionSettings(base_dir=Path("."), set_seeds=[1, 2, 3], warmup=0, iters=10, graph=graph, flush="none",
                           timeout=10.0, checked_calls=checked_calls, target_batch_ms=20.0, min_batches=2,
                           slot_budget_bytes=1 << 20)


def job(graph=False, checked_calls=None, slots=8, device="cpu", definition=None) -> _Job:
    """A _Job of 3 input sets and `slots` output slots, with stand-ins for the worker and session."""
    stand_in = object.__new__(_Job)
    stand_in.settings = settings(graph, checked_calls)
    stand_in.session = SimpleNamespace(device=device, flush=SimpleNamespace(keyed=False))
    stand_in.definition = definition or SimpleNamespace(evaluator=SimpleNamespace(kind="allclose"))
    stand_in.worker = SimpleNamespace(log_tail=lambda: "the worker's log")
    stand_in.arena_sets = [{} for _ in range(3)]
    stand_in.arena_slots = [{} for _ in range(slots)]
    stand_in.history, stand_in.reads, stand_in.flushes = [], [], []
    stand_in.times = _Times()
    return stand_in


def test_a_warm_up_longer_than_the_slots_is_split_into_batches_that_share_no_slot(repo_copy, shared_cache, tmp_path,
                                                                                   monkeypatch):
    """Large outputs leave few slots (SETS + 1 here): warm-up calls beyond them go in further batches, or
    the judge, reading each slot when its batch ends, finds a later call's outputs behind an earlier call's
    link and rejects an honest solution (seen on a GPU with 512 MB outputs: 7 slots, 10 warm-up calls)."""
    monkeypatch.setitem(flashbench.run.jobs.SLOT_BUDGET_BYTES, "cpu", 1)
    result, _ = run(repo_copy, shared_cache, tmp_path / "traces", [FIXTURES / "correct_dps"], warmup=SETS + 3)
    (trace,) = result.traces
    assert (trace.status, trace.message) == ("PASSED", "")


def test_a_device_that_cannot_hold_every_input_set_runs_the_job_on_fewer_and_records_how_many(
        repo_copy, shared_cache, tmp_path, monkeypatch):
    """On a GPU the judge keeps a job's sets, slots and copies within a share of the device's memory
    (job_memory_budget, decided from the workload's sizes before the job, never from a worker's word):
    a budget too small for more than one set here, as on a CPU nothing else sets one."""
    monkeypatch.setattr(flashbench.run.session, "job_memory_budget", lambda device: 1)
    result, _ = run(repo_copy, shared_cache, tmp_path / "traces", [FIXTURES / "correct_dps"])
    (trace,) = result.traces
    assert (trace.status, trace.message) == ("PASSED", "")
    assert trace.performance.timing["input_sets"] == 1


def test_warm_up_batches_give_every_call_a_slot_of_its_own():
    for graph, slots, warmup, sizes in [(False, 4, 10, [4, 4, 2]), (True, 4, 0, [1, 1, 1]), (False, 8, 5, [5])]:
        stand_in = job(graph=graph, slots=slots)
        stand_in.settings.warmup = warmup
        batches = []
        stand_in.batch = lambda calls, **_: batches.append(calls) or (1.0, None)
        assert stand_in.warm_up() == len(batches) / sum(sizes)
        assert [len(calls) for calls in batches] == sizes
        assert all(len({c.slot for c in calls}) == len(calls) for calls in batches)
        assert sorted(c.set for calls in batches for c in calls) == sorted(k % 3 for k in range(sum(sizes)))


def test_calls_rotate_over_the_sets_and_slots_each_with_a_fresh_seed():
    calls = [job().fresh_call(k) for k in range(10)]
    assert [c.set for c in calls] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert [c.slot for c in calls] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # every call of a batch has its own slot
    assert len({c.seed for c in calls}) == 10 and all(c.seed is not None for c in calls)


def test_under_graph_replay_every_call_has_a_slot_of_its_own_past_the_capture_slots():
    """A graph writes the slot it was captured with (one per set: 0, 1, 2); the worker copies each
    replay's outputs into the call's own slot, so calls share no slot within a batch."""
    stand_in = job(graph=True)
    assert [stand_in.fresh_call(k).slot for k in range(6)] == [3, 4, 5, 6, 7, 3]
    assert [stand_in.fresh_call(k).set for k in range(6)] == [0, 1, 2, 0, 1, 2]
    assert list(stand_in.call_slots()) == [3, 4, 5, 6, 7]


def test_every_timed_call_can_be_picked():
    picked = job().pick_checks(batches=3, size=4)
    assert sorted((b, k) for b, ks in picked.items() for k in ks) == [(b, k) for b in range(3) for k in range(4)]


def test_a_number_of_checked_calls_picks_that_many_distinct_calls_and_one_in_every_batch():
    picked = job(checked_calls=5).pick_checks(batches=3, size=4)
    chosen = [(b, k) for b, ks in picked.items() for k in ks]
    assert len(chosen) == len(set(chosen)) == 5
    assert all(0 <= b < 3 and 0 <= k < 4 for b, k in chosen)
    assert sum(len(ks) for ks in job(checked_calls=100).pick_checks(batches=2, size=2).values()) == 4
    # Fewer checks asked for than there are batches: still one in each, so no batch is known unchecked.
    assert {b: len(ks) for b, ks in job(checked_calls=1).pick_checks(batches=6, size=50).items()} == {b: 1 for b in range(6)}


def test_under_graph_replay_every_call_can_be_picked_too():
    picked = job(graph=True).pick_checks(batches=2, size=5)
    assert {b: sorted(ks) for b, ks in picked.items()} == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}


def test_a_workloads_timeout_holds_for_all_of_its_requests_together():
    """A worker that answers each untimed request a little under the timeout held its lane for a timeout per
    request and still PASSED: every request now gets what is left of the workload's."""
    given = []

    class SlowWorker:
        def timed_ask(self, request, timeout, fd=None, on_receipt=None):
            given.append(timeout)
            if timeout < 0.05:
                raise WorkerGone("TIMEOUT", f"no answer within {timeout:g} s", "log")
            time.sleep(0.05)
            return "reply", 50.0

    deadline = _Deadline(0.12)
    assert deadline.ask(SlowWorker(), "request") == "reply"
    assert deadline.timed_ask(SlowWorker(), "request") == ("reply", 50.0)
    with pytest.raises(WorkerGone) as gone:
        deadline.ask(SlowWorker(), "request")
    assert gone.value.status == "TIMEOUT" and gone.value.log == "log"
    assert gone.value.message == "no answer within the workload's 0.12 s (its timeout, for all its requests)"
    assert given[0] <= 0.12 and given[1] < given[0] and given[2] < 0.05


@pytest.mark.parametrize("answers", [True, False])
def test_a_worker_gets_at_most_close_timeout_s_to_close_its_job(answers):
    """A worker that never answered the Close held its lane for the rest of the workload's timeout on every
    job, its verdict standing: it gets CLOSE_TIMEOUT_S, and a worker that does not close is not used again."""
    given = []

    class Worker:
        def ask(self, request, timeout):
            given.append((request, timeout))
            if not answers:
                raise WorkerGone("TIMEOUT", f"no answer within {timeout:g} s")

    assert closed(Worker(), _Deadline(300.0)) is answers
    assert isinstance(given[0][0], Close) and given[0][1] == CLOSE_TIMEOUT_S
    closed(Worker(), _Deadline(0.5))
    assert given[1][1] <= 0.5


def test_a_call_linked_to_outputs_other_than_those_its_predecessor_left_is_rejected_picked_or_not():
    """The link a call's redraw used must be the one the judge gets from the previous call's outputs as it
    read them after the batch, for every call of the batch (not only the picked ones): from other bytes,
    those outputs were still being written, or the link was made up so that the next steps could start
    before the call before had ended."""
    final = {"output": torch.arange(6, dtype=torch.bfloat16), "lse": torch.ones(2)}
    unfinished = {name: torch.full_like(tensor, float("nan")) for name, tensor in final.items()}
    expected = {1: output_link(list(final.values())).item()}
    stand_in = job()
    stand_in.reject_unfinished_outputs({1: "timed call 2"}, expected, [None, expected[1]])
    for picked, label in (({1: "timed call 2"}, "timed call 2"), ({0: "timed call 1"}, "call 2 of its batch")):
        with pytest.raises(_Stop) as stopped:
            stand_in.reject_unfinished_outputs(picked, expected, [None, output_link(list(unfinished.values())).item()])
        assert stopped.value.outcome.status == "REJECTED"
        assert f"the call before {label} were still being written" in stopped.value.outcome.message


def test_every_timed_calls_flush_is_checked_against_the_judges_run_of_the_steps():
    """The judge's baseline keyed each flush by the worker's links: a call whose reported flush result is
    not the judge's is REJECTED, picked or not; calls without a seed (nothing flipped) are passed over."""
    stand_in = job()
    stand_in.session.flush = SimpleNamespace(keyed=True)
    batch = Batch(calls=[Call(set=0, slot=0), Call(set=0, slot=1, seed=7), Call(set=0, slot=2, seed=8)])
    baseline = SimpleNamespace(flushed=[11, 22, 33])
    stand_in.reject_unflushed(baseline, batch, [99, 22, 33], b=0)  # the first call has no seed
    with pytest.raises(_Stop) as stopped:
        stand_in.reject_unflushed(baseline, batch, [11, 22, 34], b=1)
    assert "the L2 flush before call 3 of timed batch 2 did not return what the judge's own gives (its keyed " \
        "reads" in stopped.value.outcome.message
    stand_in.session.flush = SimpleNamespace(keyed=False)  # a flush without reads returns its link: checked too
    with pytest.raises(_Stop):
        stand_in.reject_unflushed(baseline, batch, [11, 0, 33], b=0)


@pytest.mark.parametrize("step_ms, sizing", [(5.0, True), (30.0, False)])
def test_timed_batches_are_sized_by_an_untimed_batch_of_about_the_targets_length(step_ms, sizing, monkeypatch):
    """The warm-up's step carries the batch's fixed cost over a few calls and reads long (here 5 ms a call,
    against 1 ms in a batch of 4): the timed batches are sized from a batch of the target's length. A
    call longer than the target (here 30 ms) is timed one by one, with no sizing batch."""
    stand_in = job(slots=40)
    ran = []

    def batch(calls, timed, graph, picked):
        ran.append((len(calls), timed))
        stand_in.history.append((None, [None] * len(calls), [0] * len(calls)))
        return 1.0 * len(calls), Batch(calls=calls)  # 1 ms a call

    monkeypatch.setattr(stand_in, "batch", batch)
    stand_in.worker.paused = lambda: contextlib.nullcontext(SimpleNamespace(held=True))
    baseline = SimpleNamespace(time_ms=lambda batch, links=None: 0.0, flushed=[0] * 40)  # as the worker's
    stand_in.timed_batches(baseline, step_ms)
    if sizing:
        assert ran[0] == (4, False)  # 20 ms over the warm-up's 5 ms a call
        assert all(entry == (20, True) for entry in ran[1:]) and len(ran) == 3  # 20 calls of 1 ms; two batches
    else:
        assert all(entry == (1, True) for entry in ran) and len(ran) == 10  # iters=10 calls, one a batch


@pytest.mark.parametrize("budget_ms, batches", [(100.0, 4), (1000.0, 10), (10.0, 2)])
def test_a_slow_call_runs_what_fits_in_the_budget_and_never_fewer_than_min_batches(budget_ms, batches, monkeypatch):
    """Calls of 25 ms, one a batch, iters=10: a 100 ms budget holds 4 of them, 1000 ms all 10; a 10 ms
    budget holds none past min_batches (2)."""
    stand_in = job()
    stand_in.settings.timed_budget_ms = budget_ms
    ran = []

    def batch(calls, timed, graph, picked):
        ran.append(len(calls))
        stand_in.history.append((None, [None] * len(calls), [0] * len(calls)))
        return 25.0 * len(calls), Batch(calls=calls)

    monkeypatch.setattr(stand_in, "batch", batch)
    stand_in.worker.paused = lambda: contextlib.nullcontext(SimpleNamespace(held=True))
    stand_in.timed_batches(SimpleNamespace(time_ms=lambda batch, links=None: 0.0, flushed=[0]), 25.0)
    assert ran == [1] * batches and stand_in.times.batch_sizes == [1] * batches


@pytest.mark.parametrize("stops_on", [1, 3, None])
def test_the_steps_are_timed_only_with_the_sandbox_stopped(stops_on):
    """A sandbox that did not stay stopped (a process of it held in the kernel, forking, or resumed) would slow
    the judge's own steps: the reading is taken again, and after PAUSE_ATTEMPTS tries the pair is REJECTED."""
    stand_in = job()
    attempts, readings = [], iter([5.0, 4.0, 3.0])
    stand_in.worker.paused = lambda: (attempts.append(1),
                                      contextlib.nullcontext(SimpleNamespace(held=len(attempts) == stops_on)))[1]
    baseline = SimpleNamespace(time_ms=lambda batch, links=None: next(readings))
    if stops_on is None:
        with pytest.raises(_Stop) as stopped:
            stand_in.steps_ms(baseline, batch=None)
        assert stopped.value.outcome.status == "REJECTED" and "could not be stopped" in stopped.value.outcome.message
        assert len(attempts) == PAUSE_ATTEMPTS
    else:
        assert stand_in.steps_ms(baseline, batch=None) == [5.0, 4.0, 3.0][stops_on - 1]
        assert len(attempts) == stops_on


@pytest.mark.parametrize("device, trusted", [("cuda:0", True), ("cuda:0", False), ("cpu", True), ("cpu", False)])
def test_the_references_jobs_measure_the_clean_steps_and_the_others_are_capped_by_them(device, trusted,
                                                                                         monkeypatch):
    """The harness's steps are measured for each workload while the reference's worker holds the device;
    every other job's subtraction is capped by that (a worker's leftover GPU work is not stopped, and a
    process of its sandbox that the judge failed to stop would slow the steps on a CPU)."""
    stand_in = job(device=device)
    measured = []
    clean = SimpleNamespace(get=lambda workload, device: 0.25,
                            measure=lambda baseline, workload, device: measured.append((workload, device)))
    stand_in.session = SimpleNamespace(device=device, clean_steps=clean, trusted=trusted, on_phase=lambda phase: None)
    stand_in.inputs = SimpleNamespace(workload=SimpleNamespace(uuid="w"))
    monkeypatch.setattr(stand_in, "batch", lambda *args, **kwargs: (1.0, None))
    monkeypatch.setattr(stand_in, "warm_up", lambda: 1.0)
    monkeypatch.setattr(stand_in, "timed_batches", lambda baseline, step: None)
    monkeypatch.setattr(stand_in, "check_outputs", lambda: SimpleNamespace(passed=False))
    monkeypatch.setattr(stand_in, "outcome", lambda verdict, timing=None: "judged")
    assert stand_in.judge(baseline=None) == "judged"
    assert measured == ([("w", device)] if trusted else [])
    assert stand_in.times.clean_step_ms == (None if trusted else 0.25)


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: not enough memory"),  # a GPU-sized job on a CPU
    MemoryError(),
])
def test_the_judge_out_of_device_memory_is_the_pairs_outcome_not_the_runs_end(monkeypatch, error):
    """A worker can hold the device's memory while the judge prepares and checks its job; a workload can be
    larger than a CPU's memory."""
    session = object.__new__(Session)

    def full(*args):
        raise error

    monkeypatch.setattr(session, "_run", full)
    outcome = session.run(SimpleNamespace(), SimpleNamespace(), True)
    assert outcome.status == "RUNTIME_ERROR" and not outcome.worker_usable
    assert "no memory left for the judge's own work" in outcome.message


def test_a_judges_runtime_error_that_is_not_memory_stays_an_error(monkeypatch):
    session = object.__new__(Session)
    monkeypatch.setattr(session, "_run", lambda *args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        session.run(SimpleNamespace(), SimpleNamespace(), True)


def timed(judge_ms, worker_ms, device="cpu") -> _Job:
    stand_in = job(device=device)
    size = len(worker_ms) // len(judge_ms)
    stand_in.times = _Times(batch_ms=[ms * size for ms in judge_ms], baseline_ms=[0.0] * len(judge_ms),
                            batch_sizes=[size] * len(judge_ms), worker_ms=worker_ms)
    stand_in.reads = [None] * (3 + 1 + 5)  # the untimed checks, then 5 timed calls
    return stand_in


@pytest.mark.parametrize("judge_ms, worker_ms, ranked", [
    ([2.0, 2.2], [1.0, 1.1, 0.9, 1.0], "judge"),  # the worker's clock reads less: the judge's figure
    ([0.1, 0.0], [1.0, 1.1, 0.9, 1.0], "worker"),  # the judge's subtraction is noisier than the call
])
def test_the_larger_median_is_ranked(judge_ms, worker_ms, ranked):
    timing = timed(judge_ms, worker_ms).timing()
    assert timing["clock"]["ranked_clock"] == ranked
    clocks = timing["clocks"]
    assert timing["latency_ms"] == max(clocks["judge"]["latency_ms"], clocks["worker"]["latency_ms"])
    assert timing["clock"]["batches"] == 2 and timing["clock"]["calls_per_batch"] == 2
    assert timing["clock"]["checked_calls"] == 5


def test_the_steps_taken_away_are_recorded_with_what_they_were_chosen_from():
    stand_in = timed([2.0, 2.2], [1.0, 1.1, 0.9, 1.0])
    stand_in.times.baseline_ms, stand_in.times.clean_step_ms = [0.8, 0.6], 0.35
    steps = stand_in.timing()["clock"]["steps_per_call_ms"]
    assert steps == {"subtracted": 0.3, "least": 0.3, "median": 0.35, "clean": 0.35}


def test_the_workers_issue_time_is_recorded_as_a_share_of_the_judges_batch_time():
    stand_in = timed([2.0, 2.2, 2.4], [1.0] * 6)
    assert stand_in.timing()["clock"]["worker_issue_share"] is None  # a worker that sent none
    stand_in.times.issue_ms = [4.0, 1.1, 4.8]  # the batches took 4.0, 4.4 and 4.8 ms on the judge's clock
    assert stand_in.timing()["clock"]["worker_issue_share"] == pytest.approx(1.0)
    stand_in.times.issue_ms = [4.0e6, 1.1, 4.8e6]  # more than the batch took: the worker's word, capped
    assert stand_in.timing()["clock"]["worker_issue_share"] == pytest.approx(1.0)


def test_on_a_gpu_a_worker_clock_far_below_the_judges_is_rejected():
    with pytest.raises(_Stop) as stop:
        timed([2.0, 2.2], [0.01, 0.01, 0.01, 0.01], device="cuda").timing()
    assert stop.value.outcome.status == "REJECTED" and "clock disagrees" in stop.value.outcome.message
    assert stop.value.outcome.log == "the worker's log"
    timed([2.0, 2.2], [0.01, 0.01, 0.01, 0.01], device="cpu").timing()  # on a CPU it is not judged


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_float_output_slots_are_poisoned_with_nan(dtype):
    tensor = torch.zeros(5, dtype=dtype)
    _poison(tensor)
    assert torch.isnan(tensor.float()).all()


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64, torch.uint64,
                                   torch.float4_e2m1fn_x2])
def test_other_output_slots_are_poisoned_with_values_drawn_anew(dtype):
    """A constant poison passed every element whose right value it was (int8's minimum is FP8's -0.0 byte, True
    a mask's common value) without the solution writing it: the values now differ within a slot and from one
    batch to the next, over the whole range of the dtype."""
    first, second = torch.zeros(4096, dtype=dtype), torch.zeros(4096, dtype=dtype)
    _poison(first)
    _poison(second)
    if dtype == torch.float4_e2m1fn_x2:  # no NaN to poison with ("fill_" is not even implemented for it)
        first, second = first.view(torch.uint8), second.view(torch.uint8)
    assert len(first.unique()) > 1 and not torch.equal(first, second)
    if dtype not in (torch.bool, torch.float4_e2m1fn_x2):
        values = first.to(torch.float64) if dtype != torch.uint64 else first.view(torch.int64).to(torch.float64)
        assert (values < 0).any() or dtype in (torch.uint8, torch.uint64)  # not from a narrow range at zero
        assert values.abs().max() > torch.iinfo(torch.int8).max or dtype in (torch.int8, torch.uint8)


@pytest.fixture(scope="module")
def definition(repo_copy):
    return Repo(repo_copy).definition(DEFINITION)


def outputs(shift=0.0):
    generator = torch.Generator().manual_seed(3)
    return {"output": (torch.randn(2, 16, 512, generator=generator) + shift).to(torch.bfloat16),
            "lse": torch.randn(2, 16, generator=generator) + shift}


def checked(definition, *checks) -> _Job:
    """A job whose picked calls and their references are given."""
    stand_in = job(definition=definition)
    stand_in.expected_outputs = lambda: [CheckedCall(label, got, expected) for label, got, expected in checks]
    return stand_in


def test_the_first_failing_check_is_named(definition):
    right = outputs()
    stand_in = checked(definition, *[(f"input set {i}", right, right) for i in range(3)],
                       ("the repeated call", right, right), ("timed call 3 of 8", outputs(1.0), right),
                       ("timed call 5 of 8", outputs(2.0), right))
    verdict = stand_in.check_outputs()
    assert verdict.status == "INCORRECT_NUMERICAL" and verdict.message.startswith("timed call 3 of 8: output output")


def test_a_pass_records_the_worst_error_of_any_checked_call(definition):
    right = outputs()
    close = {"output": right["output"], "lse": right["lse"] + 5e-4}  # within the tolerance
    stand_in = checked(definition, *[(f"input set {i}", right, right) for i in range(3)],
                       ("the repeated call", right, right), ("timed call 2 of 8", close, right))
    verdict = stand_in.check_outputs()
    assert verdict.passed
    assert verdict.errors["lse"].max_abs_error == pytest.approx(5e-4, rel=2e-2)  # not the first call's 0
    assert verdict.errors["output"].max_abs_error == 0.0


def test_the_repeated_call_must_match_the_first(definition):
    right = outputs()
    drifted = {"output": right["output"], "lse": right["lse"] + 5e-4}  # within tolerance of the reference
    stand_in = checked(definition, *[(f"input set {i}", right, right) for i in range(3)],
                       ("the repeated call", drifted, right))
    assert stand_in.check_outputs().passed  # within the tolerance: close enough to agree
    noisy = {"output": right["output"], "lse": right["lse"] + 1.0}
    stand_in = checked(definition, ("input set 0", right, right), ("input set 1", right, right),
                       ("input set 2", right, right), ("the repeated call", noisy, noisy))
    verdict = stand_in.check_outputs()
    assert verdict.status == "REJECTED" and verdict.message.startswith("outputs change between identical calls")


# Reference outputs, in memory only.

class CountingReference:
    def __init__(self):
        self.calls = 0

    def __call__(self, q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
        self.calls += 1
        return q_nope.t(), torch.full((4,), float(sm_scale))  # a non-contiguous output


def reference_inputs(value: float) -> dict:
    names = ["q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indptr", "kv_indices"]
    return {**{name: torch.full((4, 4), value) for name in names}, "sm_scale": value}


def test_reference_outputs_are_computed_once_per_key(definition):
    reference = CountingReference()
    store = ReferenceStore(definition, reference, budget_bytes=1 << 20)
    first = store.kept(("w", 1), lambda: reference_inputs(1.0))
    again = store.kept(("w", 1), lambda: reference_inputs(5.0))
    assert reference.calls == 1 and again is first
    assert set(first) == {"output", "lse"} and first["output"].is_contiguous() and first["output"].device.type == "cpu"
    store.compute(reference_inputs(2.0))  # a timed call's own inputs: computed each time, never kept
    store.compute(reference_inputs(2.0))
    assert reference.calls == 3 and list(store._kept) == [("w", 1)]


def test_past_the_budget_the_least_recently_used_outputs_go_but_the_newest_stays(definition):
    reference = CountingReference()
    one_set = 4 * 4 * 4 + 4 * 4  # bytes of one key's outputs
    store = ReferenceStore(definition, reference, budget_bytes=2 * one_set)
    for key in ("a", "b"):
        store.kept((key,), lambda: reference_inputs(1.0))
    store.kept(("a",), lambda: reference_inputs(1.0))  # a used again: b is now the least recent
    store.kept(("c",), lambda: reference_inputs(1.0))
    assert list(store._kept) == [("a",), ("c",)] and reference.calls == 3
    store.kept(("b",), lambda: reference_inputs(1.0))  # dropped, so computed again
    assert reference.calls == 4
    nothing = ReferenceStore(definition, reference, budget_bytes=0)
    nothing.kept(("x",), lambda: reference_inputs(1.0))
    nothing.kept(("y",), lambda: reference_inputs(1.0))
    assert list(nothing._kept) == [("y",)]  # over any budget, the outputs just computed are kept


# A worker that leaves the L2 flush out, or reports another result for it. The flush's keyed reads set the
# signs of each call's queries (run/recipe.py L2Flush): the judge recomputes what the flush before each
# checked call returns.
SKIPS_FLUSH = '''
from decode_math import decode_into
from flashbench.run import recipe

recipe.L2Flush.__call__ = {replacement}


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse):
    decode_into(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse)
'''
FLUSH_SKIPPERS = {
    "returns_the_link": "lambda self, link=None, keys=None: link",  # as a flush that reads nothing would
    "returns_a_number": "lambda self, link=None, keys=None: __import__('torch').tensor(12345)",
}


@pytest.mark.parametrize("name", FLUSH_SKIPPERS)
def test_a_worker_that_skips_the_keyed_flush_is_rejected(repo_copy, shared_cache, tmp_path, monkeypatch, name):
    from flashbench.run.jobs import JobJudge
    from flashbench.run.recipe import L2Flush
    flush = L2Flush("read", "cpu", nbytes=1 << 20)  # a CPU run flushes nothing unless made to, as here
    monkeypatch.setattr(JobJudge, "flush", lambda self, device: flush)
    folder = write_solution(tmp_path / name, name, SKIPS_FLUSH.replace("{replacement}", FLUSH_SKIPPERS[name]))
    result, _ = run(repo_copy, shared_cache, tmp_path / "traces", [FIXTURES / "correct_dps", folder])
    statuses = {t.solution: (t.status, t.message) for t in result.traces}
    assert statuses["correct_dps"][0] == "PASSED", statuses
    status, message = statuses[name]
    assert status == "REJECTED" and "L2 flush" in message and "keyed reads" in message, statuses


# Workers that cheat only on calls the judge does not check: they learn nothing of which those are, but
# with the judge made to check only each batch's last call, the cheating is on unchecked calls only.
CHEATS_UNCHECKED = '''
import torch
from decode_math import decode_into
from flashbench.run import recipe
from flashbench.run.worker import handler

state = {"k": 0, "calls": 0}
run_batch, flush, output_link = handler.run_batch, recipe.L2Flush.__call__, recipe.output_link


def counting_run_batch(batch, *args, **kwargs):
    state.update(k=0, calls=len(batch.calls))
    return run_batch(batch, *args, **kwargs)


handler.run_batch = counting_run_batch
{cheat}


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse):
    decode_into(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse)
'''
UNCHECKED_CHEATS = {
    # no flush but before the batch's last call: a made-up result
    "skips_unchecked_flushes": '''
def skipping(self, link=None, keys=None):
    state["k"] += 1
    return flush(self, link, keys) if state["k"] == state["calls"] else torch.tensor(12345)


recipe.L2Flush.__call__ = skipping
''',
    # a link known before the call before ends, so the next steps could start early; the flush done for it
    "makes_up_links": '''
def made_up(outputs):
    state["k"] += 1
    return output_link(outputs) if state["k"] == state["calls"] - 1 else torch.tensor(123456789)


recipe.output_link = made_up
''',
}


@pytest.mark.parametrize("name", UNCHECKED_CHEATS)
def test_cheating_only_on_unchecked_calls_is_rejected(repo_copy, shared_cache, tmp_path, monkeypatch, name):
    """Every call's link is checked against the outputs its predecessor left, and every timed call's flush
    against the judge's own run of the batch's steps: not only the calls picked for checking."""
    from flashbench.run.jobs import JobJudge
    from flashbench.run.recipe import L2Flush
    from flashbench.run.session import _Job
    flush = L2Flush("read", "cpu", nbytes=1 << 20)
    monkeypatch.setattr(JobJudge, "flush", lambda self, device: flush)
    monkeypatch.setattr(_Job, "pick_checks", lambda self, batches, size: {b: [size - 1] for b in range(batches)})
    monkeypatch.setitem(TARGET_BATCH_MS, "cpu", 200.0)  # batches of many calls, even on a loaded machine
    folder = write_solution(tmp_path / name, name, CHEATS_UNCHECKED.replace("{cheat}", UNCHECKED_CHEATS[name]))
    result, _ = run(repo_copy, shared_cache, tmp_path / "traces", [FIXTURES / "correct_dps", folder], iters=20)
    statuses = {t.solution: (t.status, t.message) for t in result.traces}
    assert statuses["correct_dps"][0] == "PASSED", statuses
    assert statuses[name][0] == "REJECTED", statuses


SAMPLING_REPO = Path(__file__).parent / "fixtures" / "sampling_repo"
TOP_K = "top_k_sampling_from_probs_v64"


def test_a_sampling_job_checks_enough_samples_however_few_checked_calls_are_asked(tmp_path):
    """One sample per call and one checked call a batch asked (as on a GPU, 8 a job): the test saw a handful
    of samples, on which an argmax sampler of two-category rows passed; the judge now checks timed calls
    until there are MIN_CHECKED_SAMPLES, and an honest sampler still passes."""
    from flashbench import api as fb

    repo = tmp_path / "repo"
    shutil.copytree(SAMPLING_REPO, repo)
    (repo / "definitions/sampling" / f"{TOP_K}.workloads.yaml").write_text(textwrap.dedent(f"""\
        definition: {TOP_K}
        version: 1
        workloads:
        - uuid: 0c3e8f52-7d1a-4b69-8e2f-5a4d6c7b8e91
          name: smoke_one_row
          tags: [smoke]
          axes: {{batch_size: 1}}
          inputs:
            probs: {{type: random, distribution: uniform}}
            top_k: {{type: random, distribution: uniform, low: 2, high: 3}}
        """))
    draws = {"argmax": "probs.argmax(dim=1)",
             "honest": "torch.multinomial(torch.where(probs >= probs.topk(2, dim=1).values[:, 1:], probs, 0), 1)[:, 0]"}
    for name, draw in draws.items():
        folder = repo / "solutions" / TOP_K / name
        folder.mkdir(parents=True)
        (folder / "kernel.py").write_text(f"import torch\n\n\ndef run(probs, top_k):\n    return {draw}\n")
        (folder / "solution.yaml").write_text(
            f"name: {name}\ndefinition: {TOP_K}\nauthor: tests\nlanguage: python\nentry_point: kernel.py::run\n"
            "destination_passing_style: false\ndependencies: [torch]\n")
    report = fb.run(TOP_K, ["argmax", "honest"], device="cpu", root=repo, trace_dir=tmp_path / "traces", iters=2,
                    warmup=0, checked_calls=1, timeout=120)
    results = {r.solution: r for r in report.results}
    assert results["honest"].status == "PASSED", results["honest"].message
    assert results["argmax"].status == "INCORRECT_NUMERICAL", results["argmax"].message
    samples = int(results["argmax"].message.split("the ")[1].split(" samples")[0])
    assert samples >= MIN_CHECKED_SAMPLES


@pytest.mark.parametrize("numel", [0, 100, 50_000])
def test_input_samples_are_raw_words_that_any_later_change_shows(numel):
    """The inputs as sampled when a batch's reply arrives are compared bit for bit with what the redraws made:
    NaN payloads and -0.0 compare as written; a small tensor is sampled whole, a large one at random places."""
    tensor = torch.randn(numel, dtype=torch.bfloat16)
    if numel:
        tensor[0], tensor[-1] = float("nan"), -0.0
    places, words = sample_words(tensor)
    assert len(places) == min(numel, 4096) and torch.equal(tensor.view(torch.int16)[places], words)
    if numel == 100:
        assert sorted(places.tolist()) == list(range(100))
        later = tensor.clone()
        later[-1] = 0.0  # +0.0 equals -0.0 by value, not by bits
        assert not torch.equal(later.view(torch.int16)[places], words)
