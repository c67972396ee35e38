"""The device pool (flashbench/run/pool.py): jobs shared by several devices give the same results
as one device, one trace line per pair; a device whose workers cannot use it is taken out and its
jobs finish on the others; device lists. Real runs use CPU "devices"; the scheduling rules, and
how a lane keeps or replaces its worker, are also checked on a fake JobJudge, without worker
processes; so is the runner's rejection of every job that ran while the trace file changed."""

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashbench import FlashbenchError, Repo
from flashbench.run import RunOptions, Runner, parse_devices, select_solutions, select_workloads
from flashbench.run.jobs import DeviceUnusable
from flashbench.run.plan import Job
from flashbench.run import pool
from flashbench.run.pool import DevicePool, device_threads_left
from flashbench.run.recorder import TRACE_FILE_CHANGED
from flashbench.run.session import JobOutcome
from flashbench.run.supervisor import WorkerGone, WorkerProcess

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
SOLUTIONS = [ROOT / "solutions" / DEFINITION / "torch_vectorized",
             Path(__file__).parent / "fixtures" / "solutions" / DEFINITION / "correct_dps"]
BROKEN = "meta"  # a device without values: every worker fails its device check


def run_on(repo_root, cache, trace_dir, devices, solutions=SOLUTIONS, workloads=()):
    """The reference and `solutions` through the Python API on a pool of `devices`."""
    repo = Repo(repo_root)
    options = RunOptions(device="cpu", devices=devices, iters=2, warmup=0, timeout=60, trace_dir=trace_dir,
                         cache_dir=cache)
    runner = Runner(repo, DEFINITION, options)
    candidates = runner.candidates(select_solutions(repo, DEFINITION, [str(p) for p in solutions]))
    return runner.run(candidates, select_workloads(repo, DEFINITION, list(workloads), "cpu"))


def outcomes(result) -> set:
    return {(t.solution, t.workload_name, t.status) for t in result.traces}


@pytest.fixture(scope="module")
def one_device(repo_copy, shared_cache, tmp_path_factory):
    return run_on(repo_copy, shared_cache, tmp_path_factory.mktemp("one"), ["cpu"])


@pytest.fixture(scope="module")
def three_devices(repo_copy, shared_cache, tmp_path_factory):
    return run_on(repo_copy, shared_cache, tmp_path_factory.mktemp("three"), ["cpu"] * 3)


def test_three_devices_give_the_results_of_one(one_device, three_devices):
    assert len(one_device.traces) == 6
    assert outcomes(three_devices) == outcomes(one_device)
    assert {status for _, _, status in outcomes(one_device)} == {"PASSED"}


def test_one_trace_line_per_pair(three_devices):
    records = [json.loads(line) for line in three_devices.trace_file.read_text().splitlines()]
    pairs = [(r["solution"], r["workload_name"]) for r in records]
    assert len(pairs) == len(set(pairs)) == 6
    assert [r["status"] for r in records] == [t.status for t in three_devices.traces]  # in the order recorded


def test_the_reference_is_recorded_first_so_every_speedup_is_known(three_devices):
    first, then = three_devices.traces[:2], three_devices.traces[2:]
    assert [t.solution for t in first] == ["reference", "reference"]
    reference_ms = {t.workload: t.performance.latency_ms for t in first}
    for trace in then:
        assert trace.performance.reference_latency_ms == reference_ms[trace.workload]
        assert trace.performance.speedup > 0


def test_a_device_whose_workers_cannot_start_is_taken_out(repo_copy, shared_cache, tmp_path, capsys):
    result = run_on(repo_copy, shared_cache, tmp_path, [BROKEN, "cpu"], solutions=SOLUTIONS[1:])
    assert outcomes(result) == {(s, w, "PASSED") for s in ("reference", "correct_dps")
                                for w in ("smoke_empty_short", "smoke_mixed")}
    assert all(t.environment["device"] == "cpu" for t in result.traces)
    warning = capsys.readouterr().err
    assert f"device {BROKEN} is taken out of the pool: the device check failed" in warning
    assert "its jobs go to the 1 other device(s)" in warning


def test_when_every_device_fails_the_run_ends(repo_copy, shared_cache, tmp_path):
    with pytest.raises(FlashbenchError, match="every device failed") as failed:
        run_on(repo_copy, shared_cache, tmp_path, ["nodevice", BROKEN], solutions=[], workloads=["smoke_mixed"])
    assert "nodevice: it cannot be described: " in str(failed.value)  # no such device: no worker is started
    assert f"{BROKEN}: the device check failed: RuntimeError" in str(failed.value)
    assert device_threads_left() == []


def test_a_worker_that_cannot_start_for_its_candidate_fails_that_candidate_not_the_device(repo_copy, shared_cache,
                                                                                         tmp_path, monkeypatch):
    """A start that fails for what the candidate is (its setup: WorkerGone) is that candidate's outcome on
    every workload; the device stays, and the next candidate runs on it."""
    start = WorkerProcess.start

    def refuse_one(setup, *args, **kwargs):
        if setup.solution.name == "correct_dps":
            raise WorkerGone("INVALID_SOLUTION", "its manifest makes the worker's first message too large")
        return start(setup, *args, **kwargs)

    monkeypatch.setattr(WorkerProcess, "start", refuse_one)
    result = run_on(repo_copy, shared_cache, tmp_path, ["cpu"], solutions=SOLUTIONS[::-1], workloads=["smoke_mixed"])
    assert outcomes(result) == {("reference", "smoke_mixed", "PASSED"), ("correct_dps", "smoke_mixed", "INVALID_SOLUTION"),
                                ("torch_vectorized", "smoke_mixed", "PASSED")}
    assert all("start: its manifest" in t.message for t in result.traces if t.solution == "correct_dps")


# The scheduling rules on a fake JobJudge: jobs take a moment and record which device ran them.

class FakeWorker:
    def __init__(self, judge, device):
        self.judge = judge
        self.device = device
        self.closed = threading.Event()

    def alive(self) -> bool:
        return not self.closed.is_set()

    def close(self) -> None:
        self.closed.set()
        with self.judge.lock:
            self.judge.closed.append(self)


class FakeJudge:
    """known_failure / start_worker / run / references_for / environment_of, as a Lane and the
    DevicePool use them, without worker processes."""

    def __init__(self, broken=(), seconds=0.05):
        self.broken = set(broken)  # devices whose workers fail their device check
        self.seconds = seconds
        self.failures: dict[str, JobOutcome] = {}  # candidate name -> why it cannot run
        self.unbuildable: set[str] = set()  # candidates whose build fails (start_worker gives None)
        self.outcomes: dict[int, JobOutcome] = {}  # job index -> its outcome (default: PASSED)
        self.full_once = False  # the next references_for finds the device's memory full
        self.unmeasured: set[str] = set()  # workloads whose steps were not measured clean yet
        self.held_after: set[int] = set()  # jobs after which the idle worker holds the device
        self.measured: list[tuple[str, int]] = []  # (workload, workers alive) at each clean measurement
        self.held: set[int] = set()  # jobs that run until their worker is closed
        self.together: threading.Barrier | None = None  # jobs wait here for one on each other lane
        self.holding = threading.Event()
        self.busy: dict[str, int] = {}
        self.most_at_once: dict[str, int] = {}
        self.starts: list[str] = []
        self.closed: list[FakeWorker] = []
        self.references: list[tuple[str, str]] = []
        self.ran: list[tuple[int, FakeWorker]] = []
        self.phases: list[tuple[int, str]] = []  # (job index, phase) as the lanes announce them
        self.lock = threading.Lock()

    def on_phase(self, job, phase):
        with self.lock:
            self.phases.append((job.index, phase))

    def known_failure(self, candidate):
        return self.failures.get(candidate.name)

    def start_worker(self, candidate, device, cpus=None):
        with self.lock:
            self.starts.append(device)
        if device in self.broken:
            raise DeviceUnusable("the device check failed: broken")
        if candidate.name in self.unbuildable:
            self.failures[candidate.name] = JobOutcome(status="COMPILE_ERROR", message="build: broken")
            return None
        return FakeWorker(self, device)

    def device_held_by_others(self, device):
        with self.lock:
            return bool(self.ran) and self.ran[-1][0] in self.held_after

    def lacks_clean_steps(self, job, device):
        return job.workload.uuid in self.unmeasured

    def measure_clean_steps(self, workload, device):
        with self.lock:
            alive = len(self.starts) - len(self.closed)
            self.measured.append((workload.uuid, alive))
            self.unmeasured.discard(workload.uuid)

    def references_for(self, workload, device):
        with self.lock:
            self.references.append((workload.uuid, device))
            full, self.full_once = self.full_once, False
        if full:
            raise torch.cuda.OutOfMemoryError("out of memory")

    def run(self, worker, job, device) -> JobOutcome:
        assert worker.alive() and worker.device == device
        with self.lock:
            self.ran.append((job.index, worker))
            self.busy[device] = self.busy.get(device, 0) + 1
            self.most_at_once[device] = max(self.most_at_once.get(device, 0), self.busy[device])
        if job.index in self.held:
            self.holding.set()
            worker.closed.wait(30)
        if self.together is not None:
            self.together.wait(30)
        time.sleep(self.seconds)
        with self.lock:
            self.busy[device] -= 1
        return self.outcomes.get(job.index, JobOutcome(status="PASSED", message=f"job {job.index}"))

    def environment_of(self, device):
        return {"device": device}


def fake_jobs(count: int, candidates=None) -> list[Job]:
    candidates = candidates or [SimpleNamespace(name="c")]
    per = count // len(candidates)
    return [Job(i, candidates[i // per], SimpleNamespace(uuid=f"w{i % per}")) for i in range(count)]


def test_every_job_runs_once_and_no_device_runs_two_at_once():
    judge = FakeJudge()
    with DevicePool(judge, ["cuda:0", "cuda:1", "cuda:2"]) as pool:
        done = list(pool.run(fake_jobs(12)))
    assert sorted(job.index for job, _, _ in done) == list(range(12))
    assert all(outcome.message == f"job {job.index}" for job, outcome, _ in done)
    assert set(judge.most_at_once.values()) == {1} and len(judge.most_at_once) == 3
    assert judge.starts.count("cuda:0") == 1  # one worker per device for a candidate's jobs
    # each workload's reference outputs were settled on the device that then ran its job
    assert all((f"w{index}", worker.device) in judge.references for index, worker in judge.ran)
    assert len(judge.closed) == 3  # every worker ended with the pool


def test_a_pool_of_one_keeps_the_order():
    judge = FakeJudge(seconds=0)
    with DevicePool(judge, ["cpu"]) as pool:
        assert [job.index for job, _, _ in pool.run(fake_jobs(5))] == list(range(5))
    # A lane announces a job's build (when it starts a worker) and its references, for progress displays.
    assert judge.phases[:2] == [(0, "build"), (0, "reference")]


def test_the_environment_is_that_of_the_device_that_ran_the_job():
    judge = FakeJudge(seconds=0)
    with DevicePool(judge, ["cuda:0", "cuda:1"]) as pool:
        done = list(pool.run(fake_jobs(6)))
    ran_on = {index: worker.device for index, worker in judge.ran}
    assert all(environment == {"device": ran_on[job.index]} for job, _, environment in done)


def test_a_broken_device_is_tried_twice_then_its_job_moves(capsys):
    judge = FakeJudge(broken={"cuda:1"})
    with DevicePool(judge, ["cuda:0", "cuda:1"]) as pool:
        done = list(pool.run(fake_jobs(4)))
    assert sorted(job.index for job, _, _ in done) == [0, 1, 2, 3]
    assert {environment["device"] for _, _, environment in done} == {"cuda:0"}
    assert judge.starts.count("cuda:1") == 2
    assert "device cuda:1 is taken out of the pool: the device check failed: broken" in capsys.readouterr().err


def test_an_error_in_a_device_thread_reaches_the_caller():
    class Failing(FakeJudge):
        def run(self, worker, job, device):
            raise FlashbenchError("workload w0: cannot bind")

    with pytest.raises(FlashbenchError, match="cannot bind"):
        with DevicePool(Failing(), ["cpu", "cpu"]) as pool:
            list(pool.run(fake_jobs(2)))
    assert device_threads_left() == []


def test_an_error_while_recording_ends_the_jobs_in_flight():
    """The recording thread fails (or is interrupted) while another device runs a job: that job's
    worker is ended rather than waited for."""
    judge = FakeJudge(seconds=0)
    judge.held = {1}
    with pytest.raises(RuntimeError, match="recording failed"):
        with DevicePool(judge, ["cpu", "cpu"]) as pool:
            for job, _, _ in pool.run(fake_jobs(2)):
                assert job.index == 0 and judge.holding.wait(30)  # job 1 is running on the other device
                raise RuntimeError("recording failed")
    (held,) = [worker for index, worker in judge.ran if index == 1]
    assert held.closed.is_set()
    assert device_threads_left() == []


def test_a_single_unusable_device_is_named():
    with pytest.raises(FlashbenchError, match="device cuda:3 cannot be used: the device check failed: broken"):
        with DevicePool(FakeJudge(broken={"cuda:3"}), ["cuda:3"]) as pool:
            list(pool.run(fake_jobs(1)))


def test_a_job_waiting_to_be_recorded_is_still_running():
    with DevicePool(FakeJudge(seconds=0), ["cpu"]) as pool:
        for job, _, _ in pool.run(fake_jobs(2)):
            assert job.index in pool.running()
    assert pool.running() == set()


# A lane's worker: kept for a candidate's jobs, replaced when it cannot be used again.

def test_a_worker_that_cannot_be_used_again_is_replaced_for_the_next_job():
    judge = FakeJudge(seconds=0)
    judge.outcomes[1] = JobOutcome(status="CRASHED", message="the worker was killed by SIGSEGV", worker_usable=False)
    with DevicePool(judge, ["cpu"]) as pool:
        done = list(pool.run(fake_jobs(4)))
    assert [outcome.status for _, outcome, _ in done] == ["PASSED", "CRASHED", "PASSED", "PASSED"]
    workers = [worker for _, worker in judge.ran]
    assert workers[0] is workers[1] and workers[1] is not workers[2] and workers[2] is workers[3]
    assert workers[1].closed.is_set() and len(judge.starts) == 2


def test_an_idle_worker_holding_the_device_is_ended_before_the_next_job():
    """A solution's caches can keep earlier jobs' memory: the judge, not the worker, says when a job
    starts on a fresh worker, and it says so before the job."""
    judge = FakeJudge(seconds=0)
    judge.held_after = {1}  # after job 1, the idle worker holds the device
    with DevicePool(judge, ["cpu"]) as pool:
        done = list(pool.run(fake_jobs(4)))
    assert [outcome.status for _, outcome, _ in done] == ["PASSED"] * 4
    workers = [worker for _, worker in judge.ran]
    assert workers[0] is workers[1] and workers[1] is not workers[2] and workers[2] is workers[3]
    assert workers[1].closed.is_set() and len(judge.starts) == 2 and [i for i, _ in judge.ran] == [0, 1, 2, 3]


def test_a_build_that_fails_when_the_worker_is_started_again_is_the_jobs_outcome():
    """The references found the device full, the idle worker was ended, and the fresh one's build fails."""
    judge, jobs = FakeJudge(seconds=0), fake_jobs(2)
    with DevicePool(judge, ["cpu"]) as pool:
        first = list(pool.run(jobs[:1]))
        judge.full_once = True
        judge.unbuildable.add("c")
        second = list(pool.run(jobs[1:]))
    assert [outcome.status for _, outcome, _ in first + second] == ["PASSED", "COMPILE_ERROR"]
    assert len(judge.ran) == 1


def test_steps_are_measured_clean_before_the_jobs_with_no_worker_alive_and_once_per_workload():
    judge = FakeJudge(seconds=0)
    judge.unmeasured = {"w0", "w1"}
    with DevicePool(judge, ["cpu"]) as pool:
        done = list(pool.run(fake_jobs(4)))  # workloads w0, w1, w0, w1 of one candidate
    assert [outcome.status for _, outcome, _ in done] == ["PASSED"] * 4
    assert judge.measured == [("w0", 0), ("w1", 0)]
    workers = [worker for _, worker in judge.ran]
    assert workers[0] is workers[1] is workers[2] is workers[3] and len(judge.starts) == 1


def test_every_lanes_worker_is_ended_before_steps_are_measured_clean():
    """A worker left from the phase before on another lane (a resumed run's second phase) could load the host
    or its GPU while the judge times the steps alone: every lane's worker ends first."""
    judge = FakeJudge(seconds=0)
    judge.together = threading.Barrier(2)  # each lane runs jobs of the first phase, however the threads are scheduled
    with DevicePool(judge, ["cpu", "cpu"]) as pool:
        list(pool.run(fake_jobs(4)))
        assert len(judge.starts) - len(judge.closed) == 2  # both lanes hold a worker
        judge.together = None
        judge.unmeasured = {"w0", "w1"}
        done = list(pool.run(fake_jobs(4)))
    assert [outcome.status for _, outcome, _ in done] == ["PASSED"] * 4
    assert judge.measured == [("w0", 0), ("w1", 0)]


def test_each_candidate_gets_a_worker_of_its_own():
    judge = FakeJudge(seconds=0)
    first, second = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    with DevicePool(judge, ["cpu"]) as pool:
        list(pool.run(fake_jobs(4, [first, second])))
    workers = [worker for _, worker in judge.ran]
    assert workers[0] is workers[1] and workers[2] is workers[3] and workers[1] is not workers[2]
    assert workers[1].closed.is_set() and len(judge.starts) == 2  # the first ended before the second started


def test_a_candidate_that_cannot_run_gets_its_failure_without_a_worker():
    judge = FakeJudge(seconds=0)
    judge.failures["c"] = JobOutcome(status="MISSING_DEPENDENCY", message="not installed: xyz")
    with DevicePool(judge, ["cpu"]) as pool:
        done = list(pool.run(fake_jobs(2)))
    assert [outcome.status for _, outcome, _ in done] == ["MISSING_DEPENDENCY"] * 2
    assert judge.starts == [] and judge.ran == []


def test_a_failed_build_is_the_outcome_of_every_job_of_the_candidate():
    judge = FakeJudge(seconds=0)
    judge.unbuildable.add("c")
    with DevicePool(judge, ["cpu"]) as pool:
        done = list(pool.run(fake_jobs(3)))
    assert [(outcome.status, outcome.message) for _, outcome, _ in done] == [("COMPILE_ERROR", "build: broken")] * 3
    assert judge.starts == ["cpu"]  # built once; its later jobs know the failure


def test_a_reference_that_finds_the_device_full_ends_the_idle_worker_and_runs():
    """The references of a workload find the device's memory taken (a solution's worker can hold
    it): the lane's idle worker is ended, the references computed again, and a fresh worker runs the job."""
    judge, jobs = FakeJudge(seconds=0), fake_jobs(2)
    with DevicePool(judge, ["cpu"]) as pool:
        first = list(pool.run(jobs[:1]))
        judge.full_once = True
        second = list(pool.run(jobs[1:]))
    assert [outcome.status for _, outcome, _ in first + second] == ["PASSED", "PASSED"]
    assert judge.references == [("w0", "cpu"), ("w1", "cpu"), ("w1", "cpu")]  # the failed one, computed again
    (_, before), (_, after) = judge.ran
    assert before is not after and before.closed.is_set() and len(judge.starts) == 2


def test_a_workload_whose_inputs_or_reference_cannot_be_made_fails_its_pairs_and_the_run_goes_on():
    """A workload that validates but cannot be drawn (an integer range past its dtype, a page index past the
    cache) ended the whole run with a traceback, and the pairs after it got no status."""
    judge = FakeJudge(seconds=0)
    jobs = fake_jobs(4, [SimpleNamespace(name="a"), SimpleNamespace(name="b")])  # workloads w0, w1, w0, w1
    broken = judge.references_for
    def references_for(workload, device):
        broken(workload, device)
        if workload.uuid == "w1":
            raise ValueError("high is out of bounds for int32")
    judge.references_for = references_for
    judge.unmeasured = {"w1"}
    judge.measure_clean_steps = lambda workload, device: references_for(workload, device)
    with DevicePool(judge, ["cpu"]) as pool:
        done = [(job.workload.uuid, outcome) for job, outcome, _ in pool.run(jobs)]
    assert [(uuid, outcome.status) for uuid, outcome in done] == [("w0", "PASSED"), ("w1", "RUNTIME_ERROR"),
                                                                  ("w0", "PASSED"), ("w1", "RUNTIME_ERROR")]
    assert "the workload's fault" in done[1][1].message and "out of bounds for int32" in done[1][1].message


# A trace file changed while several jobs ran: every one of them is rejected.

class ForgingBackend:
    """Yields each job's outcome, reporting `alongside[index]` as the jobs running with it; before
    the first, something writes the trace file."""

    def __init__(self, trace_file, alongside):
        self.trace_file = trace_file
        self.alongside = alongside
        self.now: set[int] = set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def run(self, jobs):
        for job in jobs:
            self.now = self.alongside[job.index]
            if job.index == 0:
                self.trace_file.write_bytes(b"forged\n")  # while jobs 0 and 1 ran
            yield job, JobOutcome(status="PASSED"), {"device": "cpu"}

    def running(self):
        return set(self.now)


def test_a_changed_trace_file_rejects_every_job_that_ran_alongside(repo_copy, shared_cache, tmp_path, monkeypatch):
    repo = Repo(repo_copy)
    runner = Runner(repo, DEFINITION, RunOptions(device="cpu", trace_dir=tmp_path, cache_dir=shared_cache))
    backend = ForgingBackend(runner.trace_file, {0: {0, 1}, 1: {1}, 2: {2, 3}, 3: {3}})
    monkeypatch.setattr(Runner, "_backend", lambda self, judge, config: backend)
    candidates = runner.candidates(select_solutions(repo, DEFINITION, [str(p) for p in SOLUTIONS]))[1:]
    result = runner.run(candidates, select_workloads(repo, DEFINITION, [], "cpu"))
    assert [t.status for t in result.traces] == ["REJECTED", "REJECTED", "PASSED", "PASSED"]
    assert all(t.message == TRACE_FILE_CHANGED for t in result.traces[:2])
    assert b"forged" not in runner.trace_file.read_bytes()
    assert [json.loads(line)["status"] for line in runner.trace_file.read_text().splitlines()] == \
        [t.status for t in result.traces]


# Device lists.

@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("spec, devices", [
    ("cpu:3", ["cpu"] * 3), ("cpu,cpu", ["cpu", "cpu"]), ("cpu", ["cpu"]),
])
def test_cpu_devices(spec, devices):
    assert parse_devices(spec) == devices


@pytest.mark.parametrize("spec, devices", [
    ("all", ["cuda:0", "cuda:1"]), ("0,1", ["cuda:0", "cuda:1"]), ("1", ["cuda:1"]), ("cuda:1, cuda:0", ["cuda:1", "cuda:0"]),
])
def test_gpu_devices(two_gpus, spec, devices):
    assert parse_devices(spec) == devices


@pytest.mark.parametrize("spec, message", [
    ("2", "no GPU 2; 2 visible"), ("0,0", "a GPU is named twice"), ("cpu,0", "cannot share a run"),
    ("cpu:0", "'cpu:0' is not"), ("gpu", "'gpu' is not"),
])
def test_bad_device_lists(two_gpus, spec, message):
    with pytest.raises(FlashbenchError, match=message):
        parse_devices(spec)


def test_all_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FlashbenchError, match="no GPU is visible; for CPU devices give cpu:N"):
        parse_devices("all")


@pytest.mark.parametrize("available, devices, expected", [
    ([0, 1, 2, 3], ["cuda:0"], [None]),  # one lane: any CPU
    ([0, 1, 2, 3], ["cuda:0", "cuda:1"], [(0, 2), (1, 3)]),
    ([0, 1, 2, 3, 4], ["cuda:0", "cuda:1", "cuda:2"], [(0, 3), (1, 4), (2,)]),
    ([0, 1], ["cuda:0", "cuda:1", "cuda:2"], [(0,), (1,), (0,)]),  # more lanes than CPUs: shared, one CPU each
    ([2, 3, 5], ["cpu"], [(5,)]),  # a CPU device: as many CPUs as the judge times the steps with, by PID
    ([0, 1, 2, 3], ["cpu", "cpu"], [(0,), (1,)]),
])
def test_lanes_get_cpus_of_their_own(monkeypatch, available, devices, expected):
    """A worker of one lane spinning from many sessions starved another lane's worker while it was timed
    (a red team: 20 ms a call against 3.8 ms); each lane's sandboxes now run on CPUs of their own. On a CPU
    device, a worker could run the harness's steps (which the judge subtracts, timed with one thread) on a
    spare CPU beside its calls: it keeps one CPU."""
    monkeypatch.setattr(pool.os, "sched_getaffinity", lambda pid: set(available))
    monkeypatch.setattr(pool.os, "getpid", lambda: 11)

    assert pool.lane_cpus(devices) == expected
