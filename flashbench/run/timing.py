"""Timing protocols. The worker imports this module before any solution code, so the clock
functions below are captured before a solution could patch them.

Every protocol rotates through several input sets and prepares each call (poisoned outputs,
flushed L2) outside the timed window.
"""

import math
import statistics
import time
from typing import Callable

import torch

_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_synchronize = torch.cuda.synchronize
_CUDAGraph = torch.cuda.CUDAGraph
_graph = torch.cuda.graph

# What a solution might patch to fake its timings, as found before any solution code ran.
_WATCHED = [(obj, attr, getattr(obj, attr)) for obj, attr in [
    (time, "perf_counter"), (torch.cuda, "synchronize"), (torch.cuda, "Event"), (torch.cuda, "CUDAGraph"),
    (torch.cuda.Event, "record"), (torch.cuda.Event, "elapsed_time"), (torch.cuda.Event, "synchronize"),
    (torch.cuda.CUDAGraph, "replay"), (torch.cuda.Stream, "synchronize"),
]]
_CAPTURED = {"_perf_counter": _perf_counter, "_Event": _Event, "_synchronize": _synchronize,
             "_CUDAGraph": _CUDAGraph, "_graph": _graph}


def tampered() -> list[str]:
    """Names of timing functions that no longer are what they were when this module loaded."""
    changed = [f"{getattr(obj, '__name__', obj)}.{attr}" for obj, attr, original in _WATCHED
               if getattr(obj, attr) is not original]
    return changed + [f"flashbench timing.{name}" for name, original in _CAPTURED.items() if globals()[name] is not original]

Call = Callable[[int], None]  # runs the solution on input set i
Prepare = Callable[[int], None]  # poisons set i's outputs before a call

# Crosscheck: events that read less than half the wall-clock time, by more than this, are flagged.
CROSSCHECK_SLACK_MS = 0.05


class HostTimer:
    """CPU: the host clock around each call. Same protocol as CudaTimer, without an L2 flush and
    without the wall-clock crosscheck (both of its clocks would be this one)."""

    def flush(self) -> None:
        pass

    def warm_up(self, call: Call, prepare: Prepare, sets: int, warmup: int) -> None:
        for k in range(warmup):
            prepare(k % sets)
            call(k % sets)

    def events(self, call: Call, prepare: Prepare, sets: int, iters: int) -> list[float]:
        samples = []
        for k in range(iters):
            prepare(k % sets)
            start = _perf_counter()
            call(k % sets)
            samples.append((_perf_counter() - start) * 1e3)
        return samples


class CudaTimer:
    """CUDA events around each call, with L2 flushed before it by writing a large buffer."""

    def __init__(self, device: str, flush_bytes: int):
        self.device = device
        self.flush_buffer = torch.empty(flush_bytes, dtype=torch.uint8, device=device)

    def flush(self) -> None:
        self.flush_buffer.zero_()

    def warm_up(self, call: Call, prepare: Prepare, sets: int, warmup: int) -> None:
        for k in range(warmup):
            prepare(k % sets)
            call(k % sets)
        _synchronize(self.device)

    def events(self, call: Call, prepare: Prepare, sets: int, iters: int) -> list[float]:
        starts = [_Event(enable_timing=True) for _ in range(iters)]
        ends = [_Event(enable_timing=True) for _ in range(iters)]
        for k in range(iters):
            prepare(k % sets)
            self.flush()
            starts[k].record()
            call(k % sets)
            ends[k].record()
        _synchronize(self.device)  # device-wide: work on any stream has finished
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def graph(self, call: Call, prepare: Prepare, sets: int, iters: int, calls_per_graph: int = 8) -> list[float]:
        """Launch-overhead-free: replay a graph of (flush, call) pairs, minus a graph of flushes alone."""
        work, flushes = _CUDAGraph(), _CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            try:
                with _graph(work, stream=stream):
                    for k in range(calls_per_graph):
                        self.flush()
                        call(k % sets)
            except RuntimeError as exc:
                raise RuntimeError(f"the call cannot be captured in a CUDA graph, which --timing graph needs "
                                   f"(time it with --timing events): {exc}") from exc
            with _graph(flushes, stream=stream):
                for _ in range(calls_per_graph):
                    self.flush()
        _synchronize(self.device)
        flush_ms = statistics.median(self._replay(flushes) for _ in range(5))
        return [max(self._replay(work) - flush_ms, 0.0) / calls_per_graph for _ in range(iters)]

    def _replay(self, graph) -> float:
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        _synchronize(self.device)
        return start.elapsed_time(end)

    def wall_clock(self, call: Call, prepare: Prepare, sets: int, iters: int) -> tuple[float, float]:
        """Host time per call with a device-wide sync, minus the same step without the call: sees every
        stream and thread. Medians of single steps, so one stall of the host (a page fault, another
        process) cannot raise it. Also the median host time spent inside the call itself."""
        inside = []

        def step_ms(k: int, with_call: bool) -> float:
            _synchronize(self.device)
            start = _perf_counter()
            prepare(k % sets)
            self.flush()
            if with_call:
                entered = _perf_counter()
                call(k % sets)
                inside.append((_perf_counter() - entered) * 1e3)
            _synchronize(self.device)
            return (_perf_counter() - start) * 1e3

        bare = statistics.median(step_ms(k, False) for k in range(iters))
        full = statistics.median(step_ms(k, True) for k in range(iters))
        return max(full - bare, 0.0), statistics.median(inside)


def crosscheck(events_median_ms: float, wall_ms: float, host_call_ms: float = 0.0) -> dict:
    """Flag events under half the wall clock, beyond a slack plus the host time spent inside the
    call: a Triton kernel's launch can take longer on the host than the kernel on the device, and
    that time is in the wall clock but not in the events. Hiding device work behind host time does
    not pay: the end event is recorded only once the call returns."""
    gap = wall_ms - events_median_ms
    suspicious = events_median_ms < 0.5 * wall_ms and gap > CROSSCHECK_SLACK_MS + host_call_ms
    return {"method": "host wall clock, device-wide sync per call", "wall_ms": wall_ms,
            "host_call_ms": host_call_ms, "agrees": not suspicious}


def summarize(samples: list[float]) -> dict:
    """Median (the headline), spread, and a distribution-free 95% confidence interval of the median."""
    ordered = sorted(samples)
    n = len(ordered)
    half_width = 1.96 * math.sqrt(n) / 2
    low = max(int(math.floor(n / 2 - half_width)), 0)
    high = min(int(math.ceil(n / 2 + half_width)), n - 1)
    return {
        "latency_ms": statistics.median(ordered),
        "mean_ms": statistics.fmean(ordered),
        "std_ms": statistics.stdev(ordered) if n > 1 else 0.0,
        "min_ms": ordered[0],
        "p10_ms": _quantile(ordered, 0.10),
        "p90_ms": _quantile(ordered, 0.90),
        "samples": n,
        "ci_low_ms": ordered[low],
        "ci_high_ms": ordered[high],
    }


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    below = int(math.floor(position))
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
