"""The judge's clock (flashbench/run/judge/clock.py): summary statistics on known samples, the
per-call time of a batch less its baseline, the rule that flags a worker's own clock, and the
baseline batch (the harness's steps without the solution's call) run for real on the CPU. Also
the message of a call a CUDA graph cannot capture (the capture is in run/worker/handler.py)."""

import random
import statistics
from types import SimpleNamespace

import pytest
import torch

from flashbench import Repo
from flashbench.run.judge.clock import (AGREEMENT_SHARE, BASELINE_REPEATS, SKIPPED_STEPS_SHARE, SLACK_MS, Baseline,
                                        CleanSteps, harness_per_call_ms,
                                        disagreement, skipped_steps,
                                        judge_per_call_ms, per_call_ms, summarize)
from flashbench.run.judge.inputs import JobInputs
from flashbench.run.protocol import Batch, Call
from flashbench.run.recipe import CPU_THREADS

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"


# summarize: the headline median, the spread and a confidence interval of the median.

def test_summarize_known_samples():
    stats = summarize([float(v) for v in range(10, 0, -1)])  # 1..10, unordered
    assert stats["latency_ms"] == 5.5
    assert stats["mean_ms"] == 5.5
    assert stats["std_ms"] == pytest.approx(statistics.stdev(range(1, 11)))
    assert stats["min_ms"] == 1.0
    assert stats["p10_ms"] == pytest.approx(1.9)  # linear interpolation: 1 + 0.1 * 9
    assert stats["p90_ms"] == pytest.approx(9.1)
    assert stats["samples"] == 10
    assert stats["ci_low_ms"] <= stats["latency_ms"] <= stats["ci_high_ms"]
    assert stats["ci_low_ms"] in range(1, 11) and stats["ci_high_ms"] in range(1, 11)


def test_summarize_odd_count_and_quantile_endpoints():
    stats = summarize([3.0, 1.0, 2.0])
    assert stats["latency_ms"] == 2.0
    assert stats["p10_ms"] == pytest.approx(1.2) and stats["p90_ms"] == pytest.approx(2.8)
    assert stats["min_ms"] <= stats["p10_ms"] <= stats["latency_ms"] <= stats["p90_ms"]


def test_summarize_single_sample():
    stats = summarize([0.7])
    assert stats["latency_ms"] == stats["min_ms"] == stats["p10_ms"] == stats["p90_ms"] == 0.7
    assert stats["std_ms"] == 0.0 and stats["samples"] == 1
    assert stats["ci_low_ms"] == stats["ci_high_ms"] == 0.7


@pytest.mark.parametrize("n", [2, 3, 5, 10, 11, 50, 100, 1000])
def test_confidence_interval_contains_the_median_and_narrows(n):
    rng = random.Random(n)
    samples = [rng.lognormvariate(0, 0.3) for _ in range(n)]
    stats = summarize(samples)
    assert min(samples) <= stats["ci_low_ms"] <= stats["latency_ms"] <= stats["ci_high_ms"] <= max(samples)
    if n >= 100:  # order statistics around rank n/2 +- 1.96 sqrt(n)/2, not the whole range
        ordered = sorted(samples)
        assert ordered[int(0.35 * n)] <= stats["ci_low_ms"] and stats["ci_high_ms"] <= ordered[int(0.65 * n)]


def test_confidence_interval_of_constant_samples_is_a_point():
    stats = summarize([2.0] * 20)
    assert stats["ci_low_ms"] == stats["ci_high_ms"] == stats["latency_ms"] == 2.0 and stats["std_ms"] == 0.0


def test_a_single_stalled_batch_does_not_move_the_headline():
    """One batch stalled by 50 ms (another process, a page fault) changes the mean, not the median."""
    steady = [2.0, 2.1, 1.9, 2.0, 2.05]
    stats = summarize(steady + [52.0])
    assert stats["latency_ms"] == pytest.approx(statistics.median(steady + [52.0])) == pytest.approx(2.025)
    assert stats["mean_ms"] > 10


# per_call_ms: the judge's time for a batch, less the harness's own steps, per call.

def test_per_call_time_subtracts_the_baseline_and_divides_by_the_calls():
    assert per_call_ms(50.0, 10.0, 8) == pytest.approx(5.0)
    assert per_call_ms(10.0, 0.0, 1) == 10.0


def test_a_batch_faster_than_its_baseline_counts_as_no_time():
    """Host noise can make the baseline read longer than the batch: never a negative time."""
    assert per_call_ms(9.0, 10.0, 4) == 0.0


def test_a_baseline_slowed_by_load_does_not_take_the_solutions_time():
    """Batches of 2 calls of 10 ms each with 1 ms of harness steps per call; one baseline stalled by
    other load reads 21 ms: the job's cheapest harness cost per call is subtracted from every batch."""
    per_call = judge_per_call_ms([22.0, 22.0, 22.0], [2.0, 21.0, 2.5], [2, 2, 2])
    assert per_call == pytest.approx([10.0, 10.0, 10.0])


def test_every_baseline_slowed_by_leftover_gpu_work_is_capped_by_the_clean_cost():
    """A worker that leaves GPU work running after each reply slows every one of the judge's baselines (the
    work is not stopped with the worker), here from 1 ms to 1.4 ms of steps per call; with forged events
    that took 0.4 ms a call off a 0.1 ms call. The cost measured while only the reference held the device
    caps what is subtracted, and the skipped-steps check reads the honest steps."""
    batches, sizes = [2.2, 2.2, 2.2], [2, 2, 2]  # 1 ms of steps and 0.1 ms of call per call
    inflated = [2.8, 2.8, 2.8]
    assert judge_per_call_ms(batches, inflated, sizes) == pytest.approx([0.0] * 3)
    assert judge_per_call_ms(batches, inflated, sizes, clean_ms=1.0) == pytest.approx([0.1] * 3)
    assert harness_per_call_ms([1.8, 1.9], [2, 2], clean_ms=1.0) == pytest.approx(0.9)  # the least of the two
    forged = [0.001] * 6
    assert skipped_steps(batches, inflated, sizes, forged, "cuda", clean_ms=1.0) is None  # the steps all ran


def test_clean_steps_keep_the_least_cost_per_call_of_each_workload_and_device():
    clean = CleanSteps()
    assert clean.get("w", "cuda:0") is None
    readings = iter([50.0, 80.0, 30.0])
    baseline = SimpleNamespace(max_calls=100, time_ms=lambda batch: next(readings) * len(batch.calls) / 100)
    for _ in range(3):
        clean.measure(baseline, "w", "cuda:0")
    assert clean.get("w", "cuda:0") == pytest.approx(0.3) and clean.get("w", "cuda:1") is None
    calls = []
    clean.measure(SimpleNamespace(max_calls=7, time_ms=lambda batch: calls.append(len(batch.calls)) or 7.0),
                  "v", "cuda:0")
    assert calls == [7] and clean.get("v", "cuda:0") == pytest.approx(1.0)  # never more calls than its clock holds


def test_clean_steps_measure_fewer_calls_on_a_cpu_whose_steps_cost_milliseconds():
    calls = []
    baseline = SimpleNamespace(max_calls=1000, time_ms=lambda batch: calls.append(len(batch.calls)) or 1.0)
    clean = CleanSteps()
    clean.measure(baseline, "w", "cpu")
    clean.measure(baseline, "w", "cuda:0")
    assert calls == [CleanSteps.CALLS["cpu"], CleanSteps.CALLS["cuda"]] and calls[0] < calls[1]


# disagreement: the worker's own clock against the judge's.

@pytest.mark.parametrize("worker, judge, flagged", [
    (1.0, 1.0, False),          # equal
    (0.2, 1.0, False),          # more than the share of the judge's time (an honest host-heavy call)
    (0.05, 1.0, False),         # exactly the share: not flagged
    (0.04, 1.0, True),          # under the share and 0.96 ms apart
    (0.0005, 0.1, False),       # under the share, but within the slack (a few µs of handshake per call)
    (0.0005, 0.11, True),       # under the share and just beyond the slack
    (2.0, 1.0, False),          # a worker clock above the judge's is never flagged
])
def test_the_flagging_rule_on_a_gpu(worker, judge, flagged):
    assert (worker < AGREEMENT_SHARE * judge - SLACK_MS) is flagged  # the rule as documented
    assert (disagreement(worker, judge, "cuda") is not None) is flagged


def test_the_rejection_gives_both_figures():
    message = disagreement(0.01, 1.0, "cuda")
    assert "clock disagrees" in message and "10.0 µs" in message and "1000.0 µs" in message


@pytest.mark.parametrize("worker, judge", [(0.0, 1.0), (0.001, 5.0), (1.0, 1.0)])
def test_on_a_cpu_the_worker_clock_is_never_judged(worker, judge):
    """Both clocks are the host's: other load alone can split them."""
    assert disagreement(worker, judge, "cpu") is None


# skipped_steps: a batch must last its harness steps plus the calls the worker timed.

def _batches(steps_ms, call_ms, batches=5, size=10, gap_ms=0.002, skipped_share=0.0):
    """Batches whose calls each ran `steps_ms` of harness steps (less the share skipped) and `call_ms`."""
    batch = size * (steps_ms * (1 - skipped_share) + call_ms + gap_ms)
    return [batch] * batches, [size * steps_ms] * batches, [size] * batches, [call_ms] * (batches * size)


@pytest.mark.parametrize("steps, call", [(0.15, 0.05), (0.15, 1.0), (0.02, 0.01)])
def test_honest_batches_are_not_flagged(steps, call):
    assert skipped_steps(*_batches(steps, call), "cuda") is None


@pytest.mark.parametrize("steps, call", [(0.15, 0.05), (0.15, 1.0)])
def test_batches_that_skip_the_flush_are_flagged_whatever_the_call_costs(steps, call):
    """A short call after a skipped flush leaves the batch shorter than the steps alone; a long one
    leaves it a flush short of steps plus call: both are caught."""
    message = skipped_steps(*_batches(steps, call, skipped_share=1.0), "cuda")
    assert message is not None and "steps did not all run" in message


def test_the_rule_holds_at_its_share():
    steps = 0.2
    assert skipped_steps(*_batches(steps, 0.1, gap_ms=0.0, skipped_share=SKIPPED_STEPS_SHARE * 0.9), "cuda") is None
    assert skipped_steps(*_batches(steps, 0.1, gap_ms=0.0, skipped_share=SKIPPED_STEPS_SHARE * 1.2), "cuda") is not None


def test_one_short_batch_does_not_flag_a_job():
    batch_ms, baseline_ms, sizes, worker_ms = _batches(0.15, 0.05)
    batch_ms[0] = 0.0
    assert skipped_steps(batch_ms, baseline_ms, sizes, worker_ms, "cuda") is None


def test_the_steps_are_never_judged_on_a_cpu():
    assert skipped_steps(*_batches(0.15, 0.05, skipped_share=1.0), "cpu") is None


# The baseline: a batch's steps without the solution's call, run by the judge on the CPU.

@pytest.fixture(scope="module")
def job_inputs(repo_copy):
    repo = Repo(repo_copy)
    definition = repo.definition(DEFINITION)
    workload = next(w for w in repo.workload_set(DEFINITION).workloads if w.name == "smoke_mixed")
    return JobInputs(definition, workload, [11, 12], "cpu", repo.definition_path(DEFINITION).parent)


class CountingFlush:
    def __init__(self):
        self.count = 0

    def __call__(self, link=None, keys=None):
        self.count += 1
        return link


def seeded_batch(calls: int) -> Batch:
    return Batch(calls=[Call(set=k % 2, slot=k, seed=1000 + k) for k in range(calls)], fresh_seed=7)


def snapshot(tensors: dict) -> dict:
    return {name: value.clone() for name, value in tensors.items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("copies_outputs", [False, True])
def test_the_baseline_runs_the_steps_of_every_call_on_scratch_inputs(job_inputs, copies_outputs):
    sets, current = [snapshot(s) for s in job_inputs.sets], [snapshot(s) for s in job_inputs.current]
    flush = CountingFlush()
    baseline = Baseline(job_inputs, flush, copies_outputs=copies_outputs, max_calls=5)
    scratch = snapshot(baseline.inputs.sets[0])
    for slot in baseline.slots:
        slot.fill_(1)  # unlike what a call returns (zeros), until the copies
    elapsed = baseline.time_ms(seeded_batch(5))
    assert elapsed >= 0
    assert flush.count == 5 * BASELINE_REPEATS["cpu"]  # one flush per call, in each repeat
    # The redraws ran, on the baseline's own copy of one set (every call maps to it) ...
    assert len(baseline.inputs.sets) == 1
    assert any(not torch.equal(baseline.inputs.sets[0][n], scratch[n]) for n in job_inputs.random_names)
    # ... and the judge's sets and its replay of the worker's sets are untouched.
    for before, after in zip(sets + current, job_inputs.sets + job_inputs.current):
        assert all(torch.equal(before[name], after[name]) for name in before)
    if copies_outputs:  # a solution that returns its outputs has them copied into a slot: so does the baseline
        assert [tuple(returned.shape) for returned in baseline.returned] == \
            [tuple(shape) for _, shape in job_inputs.outputs.values()]
        assert all(torch.equal(slot, returned) for slot, returned in zip(baseline.slots, baseline.returned))
    else:  # nothing is moved; the slot is there to link the calls from, as the worker's
        assert baseline.returned is None and all(bool((slot == 1).all()) for slot in baseline.slots)


def test_the_baseline_is_the_least_of_its_repeats(job_inputs, monkeypatch):
    """Other load on the host only ever adds time."""
    readings = iter([5.0, 3.0, 4.0, 6.0, 7.0, 8.0][:BASELINE_REPEATS["cpu"]])
    baseline = Baseline(job_inputs, CountingFlush(), copies_outputs=False, max_calls=2)
    monkeypatch.setattr(baseline, "_once", lambda batch, links=None: next(readings))
    assert baseline.time_ms(seeded_batch(2)) == 3.0


def test_the_baseline_on_a_cpu_times_the_steps_with_one_thread(job_inputs, monkeypatch):
    """A pool of threads waits for its slowest: on a loaded host that made the steps look 45x dearer."""
    suite_threads = torch.get_num_threads()
    before = CPU_THREADS + 1  # not the count the steps get (the suite's processes may run with one: conftest.py)
    torch.set_num_threads(before)
    try:
        baseline = Baseline(job_inputs, CountingFlush(), copies_outputs=False, max_calls=2)
        seen = []
        monkeypatch.setattr(baseline, "_once", lambda batch, links=None: seen.append(torch.get_num_threads()) or 1.0)
        baseline.time_ms(seeded_batch(2))
        assert seen == [CPU_THREADS] * BASELINE_REPEATS["cpu"] and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(suite_threads)


def test_the_baseline_times_a_batch_of_unseeded_calls(job_inputs):
    batch = Batch(calls=[Call(set=1, slot=0), Call(set=0, slot=1)], fresh_seed=3)
    assert Baseline(job_inputs, CountingFlush(), copies_outputs=True, max_calls=2).time_ms(batch) >= 0


# Graph timing (run/worker/handler.py): a call that cannot be captured says so and names the way out.

def test_a_call_a_cuda_graph_cannot_capture_is_named(monkeypatch):
    from contextlib import contextmanager

    from flashbench.run.worker import handler

    @contextmanager
    def failing_capture(graph, stream=None):
        yield
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    @contextmanager
    def on_stream(stream):
        yield

    class Stream:
        def __init__(self, device):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(handler.torch.cuda, "graph", failing_capture)
    monkeypatch.setattr(handler.torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(handler.torch.cuda, "Stream", Stream)
    monkeypatch.setattr(handler.torch.cuda, "stream", on_stream)
    monkeypatch.setattr(handler.torch.cuda, "current_stream", lambda device=None: Stream(device))
    job = object.__new__(handler.Job)
    job.device, job.graphs, calls = "cpu", {}, []
    job.call = lambda call: calls.append("call")
    job.store = lambda call: calls.append("store")
    with pytest.raises(RuntimeError, match=r"cannot be captured in a CUDA graph.*--timing events.*Cannot copy"):
        job.replay(Call(set=0, slot=0))
    assert calls == ["call", "store", "call", "store"]  # a warm-up outside the capture, then the capture


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_baseline_runs_an_empty_kernel_for_each_call(job_inputs, monkeypatch):
    gpu_inputs = SimpleNamespace(**{**vars(job_inputs), "device": "cuda",
                                    "tensors": {n: t.cuda() for n, t in job_inputs.tensors.items()}})
    baseline = Baseline(gpu_inputs, CountingFlush(), copies_outputs=False, max_calls=3)
    launched = []
    monkeypatch.setattr(baseline, "_empty", SimpleNamespace(zero_=lambda: launched.append(1)))
    baseline.time_ms(seeded_batch(3))
    assert len(launched) == 3 * BASELINE_REPEATS["cuda"]
