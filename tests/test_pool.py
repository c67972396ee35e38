"""The device pool (flashbench/run/pool.py): jobs shared by several devices give the same results
as one device, one trace line per pair; a device whose workers cannot use it is taken out and its
jobs finish on the others; device lists. Real runs use CPU "devices"; the scheduling rules are
also checked on a stand-in runner, without worker processes."""

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashbench import FlashbenchError, Repo
from flashbench.run import RunOptions, RunResult, Runner, parse_devices, select_solutions, select_workloads
from flashbench.run.pool import DevicePool, Lane
from flashbench.run.process import DeviceUnusable
from flashbench.run.runner import Job

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
SOLUTIONS = [ROOT / "solutions" / DEFINITION / "torch_vectorized",
             Path(__file__).parent / "fixtures" / "solutions" / DEFINITION / "correct_dps"]
BROKEN = "nodevice"  # parses nowhere: every worker fails its device check


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
        run_on(repo_copy, shared_cache, tmp_path, [BROKEN, "meta"], solutions=[], workloads=["smoke_mixed"])
    assert f"{BROKEN}: the device check failed" in str(failed.value)
    assert "meta: the device check failed: RuntimeError" in str(failed.value)
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("flashbench "))


# The scheduling rules on a stand-in runner: jobs take a moment and record which device ran them.

class StandInRunner:
    def __init__(self, broken=(), seconds=0.05):
        self.options = SimpleNamespace(device="cpu")
        self.broken = set(broken)
        self.seconds = seconds
        self.busy: dict[str, int] = {}
        self.most_at_once: dict[str, int] = {}
        self.starts: list[str] = []
        self.lock = threading.Lock()

    def known_failure(self, candidate):
        return None

    def settle_references(self, workload, device):
        pass

    def start_worker(self, candidate, device):
        with self.lock:
            self.starts.append(device)
        if device in self.broken:
            raise DeviceUnusable("the device check failed: broken")
        return SimpleNamespace(close=lambda: None, kill=lambda: None)

    def run_job(self, worker, job, device):
        with self.lock:
            self.busy[device] = self.busy.get(device, 0) + 1
            self.most_at_once[device] = max(self.most_at_once.get(device, 0), self.busy[device])
        time.sleep(self.seconds)
        with self.lock:
            self.busy[device] -= 1
        return (job.index, device), False

    def judge(self, job, outcome, device):
        return (job.index, device)


def stand_in_jobs(count: int) -> list[Job]:
    candidate = SimpleNamespace(name="c")
    return [Job(i, candidate, SimpleNamespace(uuid=f"w{i}")) for i in range(count)]


def test_every_job_runs_once_and_no_device_runs_two_at_once():
    runner = StandInRunner()
    with DevicePool(runner, ["cuda:0", "cuda:1", "cuda:2"]) as pool:
        done = list(pool.run(stand_in_jobs(12)))
    assert sorted(job.index for job, _ in done) == list(range(12))
    assert set(runner.most_at_once.values()) == {1} and len(runner.most_at_once) == 3
    assert runner.starts.count("cuda:0") == 1  # one worker per device for a candidate's jobs


def test_a_pool_of_one_keeps_the_order():
    with DevicePool(StandInRunner(seconds=0), ["cpu"]) as pool:
        assert [job.index for job, _ in pool.run(stand_in_jobs(5))] == list(range(5))


def test_a_broken_device_is_tried_twice_then_its_job_moves(capsys):
    runner = StandInRunner(broken={"cuda:1"})
    with DevicePool(runner, ["cuda:0", "cuda:1"]) as pool:
        done = list(pool.run(stand_in_jobs(4)))
    assert sorted(job.index for job, _ in done) == [0, 1, 2, 3]
    assert {device for _, (_, device) in done} == {"cuda:0"}
    assert runner.starts.count("cuda:1") == 2
    assert "device cuda:1 is taken out of the pool: the device check failed: broken" in capsys.readouterr().err


def test_an_error_in_a_device_thread_reaches_the_caller():
    class Failing(StandInRunner):
        def run_job(self, worker, job, device):
            raise FlashbenchError("workload w0: cannot bind")

    with pytest.raises(FlashbenchError, match="cannot bind"):
        with DevicePool(Failing(), ["cpu", "cpu"]) as pool:
            list(pool.run(stand_in_jobs(2)))


def test_a_single_unusable_device_is_named():
    with pytest.raises(FlashbenchError, match="device cuda:3 cannot be used: the device check failed: broken"):
        with DevicePool(StandInRunner(broken={"cuda:3"}), ["cuda:3"]) as pool:
            list(pool.run(stand_in_jobs(1)))


def test_a_job_waiting_to_be_recorded_is_still_running():
    with DevicePool(StandInRunner(seconds=0), ["cpu"]) as pool:
        for job, _ in pool.run(stand_in_jobs(2)):
            assert job.index in pool.running()


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


def test_a_reference_that_finds_the_device_full_ends_the_idle_worker_and_runs(repo_copy, shared_cache, tmp_path,
                                                                              monkeypatch):
    # The second workload's reference finds the device's memory taken (a solution's worker can hold
    # it): the lane's idle worker is ended, the reference tried again, and the run goes on.
    compute, calls, closed = Runner.compute_references, [], []

    def full_once(runner, workload, keys, device):
        calls.append(workload.name)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return compute(runner, workload, keys, device)

    close = Lane.close

    def counted_close(lane):
        closed.append((len(calls), lane.worker is not None))
        close(lane)

    monkeypatch.setattr(Runner, "compute_references", full_once)
    monkeypatch.setattr(Lane, "close", counted_close)
    result = run_on(repo_copy, shared_cache, tmp_path, ["cpu"], solutions=SOLUTIONS[:1])
    assert {status for _, _, status in outcomes(result)} == {"PASSED"} and len(result.traces) == 4
    assert calls[1] == calls[2]  # the failed reference, computed again
    assert (2, True) in closed  # when the second reference failed, the idle worker of the reference was ended


# A trace file changed while several jobs ran: every one of them is rejected.

def test_a_changed_trace_file_rejects_every_job_that_ran_alongside(one_device, repo_copy, shared_cache, tmp_path):
    runner = Runner(Repo(repo_copy), DEFINITION, RunOptions(device="cpu", trace_dir=tmp_path, cache_dir=shared_cache))
    result = RunResult(trace_file=runner.trace_file)
    first, second, third = one_device.traces[:3]
    runner.trace_file.parent.mkdir(parents=True)
    runner.trace_file.write_bytes(b"forged\n")  # while jobs 0 and 1 ran
    runner._record(Job(0, None, None), first, result, running={0, 1})
    runner._record(Job(1, None, None), second, result, running={1})
    runner._record(Job(2, None, None), third, result, running={2})
    assert [t.status for t in result.traces] == ["REJECTED", "REJECTED", third.status]
    assert b"forged" not in runner.trace_file.read_bytes()
    assert len(runner.trace_file.read_bytes().splitlines()) == 3
