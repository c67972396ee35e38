"""The judge's clock: the time a worker takes for a batch of calls, measured from the judge's own
process, less what the harness's steps of that batch cost when the judge runs them itself.

The worker's own per-call times (CUDA events or its host clock) are advisory: they are recorded,
and on a GPU a pair whose worker reports far less time than the judge measured is rejected (work
outside the timed calls, or a replaced timer), but the ranked figure is always the judge's.
"""

import math
import statistics
import threading
import time

import torch

from ...dtypes import torch_dtype
from ..protocol import Batch, Call
from ..recipe import CallClock, InputSets, L2Flush, link_values, run_batch, steps_threads
from .inputs import JobInputs, fresh_seed

# Worker times under this share of the judge's, beyond the slack, cannot be honest. Judged on a GPU
# only: on a CPU both clocks are the host's, and other load on it alone can split them. Honest pairs
# on the H200 read down to 0.195: a wrapper's host work per call (FlashMLA's, on a 20 µs sparse
# decode) hides from its own events behind the flush queued before it, not from the judge
# (docs/measurement.md). Forged timers read under 0.001. The ranked figure is the larger clock
# either way: this rule names a lie, it does not set the rank, so a liar gains nothing above it.
AGREEMENT_SHARE = 0.05
SLACK_MS = 0.005
# A batch runs the harness's steps and the calls one after the other, so it lasts at least as long as
# both; one shorter by more than this share of the steps, beyond the slack, skipped steps (the flush).
SKIPPED_STEPS_SHARE = 0.5
# The least of these: other load on the host only ever adds time. A CPU's steps cost little and a busy
# host delays many readings, so it takes more. A GPU's are device-bound (the flush) and as long as the
# batch (100 ms): one run each, since the judge's clock takes the least per call over the job's
# batches anyway (judge_per_call_ms), and a second run adds as much device time as the timed batches.
BASELINE_REPEATS = {"cpu": 6, "cuda": 1}


class Baseline:
    """A batch's steps with an empty call in place of the solution's, on scratch copies of one input set.
    On a GPU the empty call is one kernel of one element: every call of a solution launches at least one
    kernel, whose launch the device pays between the flush and the call's first event, outside its
    events; measured in one process on the H200, flush + kernel batches less flush + empty-kernel
    batches matched the kernel's events within 0.1-1.7 µs per call."""

    def __init__(self, inputs: JobInputs, flush: L2Flush, copies_outputs: bool, max_calls: int):
        self.device = inputs.device
        self.max_calls = max_calls
        self.clock = CallClock(self.device, max_calls)  # made once, as the worker's
        scratch = {name: tensor.to(self.device, copy=True) for name, tensor in inputs.tensors.items()}
        self.inputs = InputSets(inputs.definition, inputs.workload, [scratch], inputs.random_names)
        self.flush = flush
        self._empty = torch.zeros(1, device=self.device) if torch.device(self.device).type == "cuda" else None
        # A slot the outputs are linked from (output_link), as the worker's; and, where the worker moves
        # returned outputs into their slot, outputs to move.
        self.slots = [torch.zeros(shape, dtype=torch_dtype(dtype), device=self.device)
                      for dtype, shape in inputs.outputs.values()]
        self.returned = [torch.zeros_like(slot) for slot in self.slots] if copies_outputs else None
        self.flushed: list[int] = []  # what each flush of the last batch returned (0: none)

    def time_ms(self, batch: Batch, links: list | None = None) -> float:
        """The batch's steps (ms); with `links` (the worker's reported ones) each flush is keyed by them and
        what it returned is kept in `self.flushed` (ints), the judge's value for every call."""
        mapped = batch.model_copy(update={"calls": [Call(set=0, slot=0, seed=call.seed) for call in batch.calls]})
        with steps_threads(self.device):
            return min(self._once(mapped, links) for _ in range(BASELINE_REPEATS[torch.device(self.device).type]))

    def _once(self, batch: Batch, links: list | None = None) -> float:
        start = time.perf_counter()
        _, flushed = run_batch(batch, self.inputs, self.flush, self._empty_call, self._copy, self.clock,
                               lambda call: self.slots, links)
        elapsed = (time.perf_counter() - start) * 1e3
        self.flushed = link_values(flushed)  # after the clock
        return elapsed

    def _empty_call(self, call: Call) -> None:
        if self._empty is not None:
            self._empty.zero_()

    def _copy(self, call: Call) -> None:
        if self.returned:
            torch._foreach_copy_(self.slots, self.returned)


class CleanSteps:
    """The harness's steps' cost per call of each (workload, device), measured by the judge while the
    definition's reference (trusted code: its worker leaves nothing running) held the device, and never
    while a solution's worker did; the least seen. The reference's jobs run before every other's."""

    # Calls in the measuring batch, per device kind. A GPU's steps cost under a millisecond a call, and 200
    # make the batch's fixed cost (the draw, the final sync) a few µs a call. A CPU's redraw the inputs on
    # the host, about 5 ms a call on the decode smoke workloads: 200 calls, timed six times
    # (BASELINE_REPEATS), took 6 s a workload, most of a CPU run; 20 leave the fixed cost as small a share.
    CALLS = {"cuda": 200, "cpu": 20}

    def __init__(self):
        self._costs: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def measure(self, baseline: "Baseline", workload: str, device: str) -> None:
        calls = min(self.CALLS[torch.device(device).type], baseline.max_calls)
        batch = Batch(calls=[Call(set=0, slot=0, seed=fresh_seed()) for _ in range(calls)], fresh_seed=fresh_seed())
        per_call = baseline.time_ms(batch) / calls
        with self._lock:
            known = self._costs.get((workload, device))
            self._costs[(workload, device)] = per_call if known is None else min(known, per_call)

    def get(self, workload: str, device: str) -> float | None:
        with self._lock:
            return self._costs.get((workload, device))


def per_call_ms(batch_ms: float, baseline_ms: float, calls: int) -> float:
    return max(batch_ms - baseline_ms, 0.0) / calls


def harness_per_call_ms(baseline_ms: list[float], sizes: list[int], clean_ms: float | None = None) -> float:
    """The cheapest harness cost per call over the job: other load on the host only ever adds time. Never
    more than `clean_ms`, the cost measured while no untrusted process could touch the device
    (CleanSteps): GPU work a worker leaves running after its reply is not stopped with it, shares the
    device with the judge's steps and would make them look dearer."""
    least = min(base / size for base, size in zip(baseline_ms, sizes))
    return least if clean_ms is None else min(least, clean_ms)


def judge_per_call_ms(batch_ms: list[float], baseline_ms: list[float], sizes: list[int],
                      clean_ms: float | None = None) -> list[float]:
    """Each batch's time per call, less the cheapest harness cost per call measured over the job. Every
    call of a job runs the same harness steps, and other load on the host only ever adds time to a
    baseline: a baseline slowed by load must not take the solution's own time away with it."""
    harness = harness_per_call_ms(baseline_ms, sizes, clean_ms)
    return [per_call_ms(batch, harness * size, size) for batch, size in zip(batch_ms, sizes)]


def disagreement(worker_ms: float, judge_ms: float, device_type: str) -> str | None:
    """Why the worker's own median per-call time cannot be true next to the judge's, if it cannot."""
    if device_type != "cuda" or worker_ms >= AGREEMENT_SHARE * judge_ms - SLACK_MS:
        return None
    return (f"the solution's own clock disagrees with the judge's: {worker_ms * 1e3:.1f} µs per call against "
            f"{judge_ms * 1e3:.1f} µs measured from outside (work outside the timed calls, or a replaced timer)")


def skipped_steps(batch_ms: list[float], baseline_ms: list[float], sizes: list[int], worker_ms: list[float],
                  device_type: str, clean_ms: float | None = None) -> str | None:
    """Why the batches cannot have run the harness's steps before each call, if they cannot: the judge
    subtracts steps it assumes ran (above all the L2 flush), so a worker that skips them would shorten
    the judge's clock by their cost. Each batch must last its steps (the judge's own, cheapest per
    call) plus the calls as the worker timed them; the median shortfall per call may not exceed
    SKIPPED_STEPS_SHARE of the steps. GPU only, as `disagreement`."""
    if device_type != "cuda":
        return None
    steps = harness_per_call_ms(baseline_ms, sizes, clean_ms)
    shortfalls, start = [], 0
    for batch, size in zip(batch_ms, sizes):
        calls = worker_ms[start:start + size]
        start += size
        shortfalls.append(steps + statistics.fmean(calls) - batch / size)
    shortfall = statistics.median(shortfalls)
    if shortfall <= SKIPPED_STEPS_SHARE * steps + SLACK_MS:
        return None
    return (f"the batches took less time than the harness's steps and the calls the solution timed: "
            f"{shortfall * 1e3:.1f} µs per call short of {steps * 1e3:.1f} µs of steps (L2 flush, input redraw) "
            f"plus {statistics.median(worker_ms) * 1e3:.1f} µs of call; the steps did not all run")


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
