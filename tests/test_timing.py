"""Timing statistics and protocols (flashbench/run/timing.py) on known samples and fake calls."""

import random
import statistics

import pytest

from flashbench.run import timing


def test_summarize_known_samples():
    stats = timing.summarize([float(v) for v in range(10, 0, -1)])  # 1..10, unordered
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
    stats = timing.summarize([3.0, 1.0, 2.0])
    assert stats["latency_ms"] == 2.0
    assert stats["p10_ms"] == pytest.approx(1.2) and stats["p90_ms"] == pytest.approx(2.8)
    assert stats["min_ms"] <= stats["p10_ms"] <= stats["latency_ms"] <= stats["p90_ms"]


def test_summarize_single_sample():
    stats = timing.summarize([0.7])
    assert stats["latency_ms"] == stats["min_ms"] == stats["p10_ms"] == stats["p90_ms"] == 0.7
    assert stats["std_ms"] == 0.0 and stats["samples"] == 1
    assert stats["ci_low_ms"] == stats["ci_high_ms"] == 0.7


@pytest.mark.parametrize("n", [2, 3, 5, 10, 11, 50, 100, 1000])
def test_confidence_interval_contains_the_median_and_narrows(n):
    rng = random.Random(n)
    samples = [rng.lognormvariate(0, 0.3) for _ in range(n)]
    stats = timing.summarize(samples)
    assert min(samples) <= stats["ci_low_ms"] <= stats["latency_ms"] <= stats["ci_high_ms"] <= max(samples)
    if n >= 100:  # order statistics around rank n/2 +- 1.96 sqrt(n)/2, not the whole range
        ordered = sorted(samples)
        assert ordered[int(0.35 * n)] <= stats["ci_low_ms"] and stats["ci_high_ms"] <= ordered[int(0.65 * n)]


def test_confidence_interval_of_constant_samples_is_a_point():
    stats = timing.summarize([2.0] * 20)
    assert stats["ci_low_ms"] == stats["ci_high_ms"] == stats["latency_ms"] == 2.0 and stats["std_ms"] == 0.0


@pytest.mark.parametrize("events, wall, agrees", [
    (1.0, 1.0, True),        # equal
    (0.6, 1.0, True),        # more than half the wall time
    (0.5, 1.0, True),        # exactly half: not flagged
    (0.4, 1.0, False),       # under half and 0.6 ms apart: flagged
    (0.01, 0.05, True),      # under half but within the slack (launch overhead of tiny kernels)
    (0.01, 0.0601, False),   # under half and just beyond the slack
    (2.0, 1.0, True),        # events above wall-clock are never flagged
])
def test_crosscheck_flagging_rule(events, wall, agrees):
    result = timing.crosscheck(events, wall)
    assert result["agrees"] is agrees
    assert result["wall_ms"] == wall and "method" in result


@pytest.mark.parametrize("events, wall, host_call, agrees", [
    (0.011, 0.09, 0.08, True),    # a tiny kernel behind a slow launch: the gap is host time
    (0.011, 0.09, 0.01, False),   # the same gap with a quick launch: device work escaped
    (0.4, 1.0, 0.3, False),       # 0.6 ms apart: more than the slack plus 0.3 ms of host time
    (0.4, 1.0, 0.6, True),        # the whole gap is host time spent in the call
])
def test_crosscheck_allows_the_host_time_of_the_call(events, wall, host_call, agrees):
    assert timing.crosscheck(events, wall, host_call)["agrees"] is agrees


class FakeSolution:
    """Records every prepare and call; each call advances a fake clock by a known amount."""

    def __init__(self, monkeypatch, durations):
        self.now = 0.0
        self.durations = durations
        self.events = []
        monkeypatch.setattr(timing, "_perf_counter", lambda: self.now)

    def prepare(self, i):
        self.events.append(("prepare", i))
        self.now += 100.0  # preparation is outside the timed window: must not show up

    def call(self, i):
        self.events.append(("call", i))
        self.now += self.durations[i]


def time_host(call, prepare, sets, warmup, iters):
    timer = timing.HostTimer()
    timer.warm_up(call, prepare, sets, warmup)
    return timer.events(call, prepare, sets, iters)


def test_time_host_counts_calls_and_rotates_sets(monkeypatch):
    fake = FakeSolution(monkeypatch, durations=[0.001, 0.002, 0.003])
    samples = time_host(fake.call, fake.prepare, sets=3, warmup=4, iters=7)
    calls = [i for kind, i in fake.events if kind == "call"]
    assert calls == [0, 1, 2, 0] + [0, 1, 2, 0, 1, 2, 0]  # warm-up, then timed calls, rotating
    assert fake.events[0::2] == [("prepare", i) for i in calls]  # every call is prepared first
    assert fake.events[1::2] == [("call", i) for i in calls]
    assert samples == pytest.approx([1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0])  # milliseconds, preparation excluded


def test_time_host_without_warmup(monkeypatch):
    fake = FakeSolution(monkeypatch, durations=[0.005])
    assert time_host(fake.call, fake.prepare, sets=1, warmup=0, iters=2) == pytest.approx([5.0, 5.0])
    assert [i for kind, i in fake.events if kind == "call"] == [0, 0]


def test_clock_is_captured_at_import(monkeypatch):
    """A solution that patches time.perf_counter after the worker imported timing cannot fake samples."""
    import time

    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    ticks = []
    samples = time_host(lambda i: ticks.append(i), lambda i: None, sets=1, warmup=0, iters=3)
    assert len(samples) == 3 and len(ticks) == 3
    assert timing._perf_counter is not time.perf_counter


def test_wall_clock_subtracts_the_steps_without_the_call_and_reports_host_time_in_the_call(monkeypatch):
    """The CUDA timer's crosscheck with the device sync stubbed: a call whose work finishes at the
    sync shows in the wall clock but not in the host time inside the call."""
    fake = FakeSolution(monkeypatch, durations=[0.002])
    monkeypatch.setattr(timing, "_synchronize", lambda device: setattr(fake, "now", fake.now + 0.001 * fake.pending))
    fake.pending = 0

    def call(i):
        fake.call(i)
        fake.pending = 3  # 3 ms of device work left when the call returns

    def prepare(i):
        fake.prepare(i)
        fake.pending = 0

    timer = timing.CudaTimer("cpu", flush_bytes=16)
    wall_ms, host_ms = timer.wall_clock(call, prepare, sets=1, iters=4)
    assert wall_ms == pytest.approx(5.0) and host_ms == pytest.approx(2.0)


def test_wall_clock_ignores_a_single_host_stall(monkeypatch):
    """One step stalled by 50 ms (another process, a page fault) must not move the crosscheck's wall clock."""
    fake = FakeSolution(monkeypatch, durations=[0.002])
    syncs = []

    def synchronize(device):
        syncs.append(device)
        if len(syncs) == 12:  # the end of the first step with the call
            fake.now += 0.050
    monkeypatch.setattr(timing, "_synchronize", synchronize)
    timer = timing.CudaTimer("cpu", flush_bytes=16)
    wall_ms, host_ms = timer.wall_clock(fake.call, fake.prepare, sets=1, iters=5)
    assert wall_ms == pytest.approx(2.0, abs=1e-6) and host_ms == pytest.approx(2.0)


def test_a_call_a_cuda_graph_cannot_capture_is_named(monkeypatch):
    """--timing graph on a call that syncs with the host: the error says so and names the way out."""
    from contextlib import contextmanager

    @contextmanager
    def failing_capture(graph, stream=None):
        yield
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    monkeypatch.setattr(timing, "_graph", failing_capture)
    monkeypatch.setattr(timing, "_CUDAGraph", object)
    monkeypatch.setattr(timing.torch.cuda, "Stream", lambda device: None)
    timer = timing.CudaTimer("cpu", flush_bytes=16)
    with pytest.raises(RuntimeError, match=r"cannot be captured in a CUDA graph.*--timing events.*Cannot copy"):
        timer.graph(lambda i: None, lambda i: None, sets=1, iters=2)
