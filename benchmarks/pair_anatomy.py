"""Where a run's time goes, per step of a job: `flashbench run` through the Python API with the
judge's steps timed (wall clock, inclusive: a step's time holds the steps it calls), then one table.
For finding what limits how many pairs a GPU session records; nothing here changes what is measured.

    python benchmarks/pair_anatomy.py mla_paged_decode --solution triton_splitkv --workload b1_l1024 \\
        --workload b128_l8192 [--device cuda] [--timing graph] [--trace-dir DIR]

Traces go to a temporary directory unless --trace-dir names one.
"""

import argparse
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from flashbench import load
from flashbench.run import jobs, pool, session, supervisor
from flashbench.run.judge import clock, inputs, references

# (owner, method, what the table calls it), in the order a job meets them.
STEPS = [
    (jobs.JobJudge, "start_worker", "worker started and built"),
    (jobs.JobJudge, "measure_clean_steps", "clean steps measured (reference's worker ended)"),
    (pool.Lane, "settle_references", "references of the input sets"),
    (references.ReferenceStore, "compute", "  reference computed (each)"),
    (jobs.JobJudge, "run", "job judged"),
    (inputs.JobInputs, "__init__", "  input sets drawn"),
    (session.Session, "_open_arena", "  arena opened"),
    (clock.Baseline, "__init__", "  baseline set up"),
    (session._Job, "warm_up", "  warm-up"),
    (session._Job, "timed_batches", "  timed batches, with the judge's steps"),
    (session._Job, "batch", "    batch (every batch: check, warm-up, sizing, timed)"),
    (session._Job, "steps_ms", "    judge's own steps (worker paused)"),
    (session._Job, "reject_changed_inputs", "    inputs compared"),
    (session._Job, "check_outputs", "  outputs checked (references replayed)"),
    (clock.CleanSteps, "measure", "  clean steps measured (the reference's jobs)"),
    (supervisor.WorkerProcess, "timed_ask", "requests to a worker, until its reply (each)"),
]


class StepTimer:
    """Wraps each step's method to add its wall time to a total (jobs run in the pool's threads)."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def wrap(self, owner, method: str, label: str) -> None:
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                with self._lock:
                    self.totals[label] += time.perf_counter() - start
                    self.counts[label] += 1

        setattr(owner, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("definition")
    parser.add_argument("--solution", action="append", default=[])
    parser.add_argument("--workload", action="append", default=[])
    parser.add_argument("--device", default=None)
    parser.add_argument("--timing", default="events", choices=["events", "graph"])
    parser.add_argument("--trace-dir", type=Path, default=None)
    args = parser.parse_args()

    timer = StepTimer()
    for owner, method, label in STEPS:
        timer.wrap(owner, method, label)
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="flashbench-anatomy-"))
    start = time.perf_counter()
    report = load().run(args.definition, args.solution, args.workload, args.device, timing=args.timing,
                        trace_dir=trace_dir)
    wall = time.perf_counter() - start
    pairs = max(len(report.results), 1)

    print(f"{len(report.results)} pairs in {wall:.1f} s ({wall / pairs:.2f} s a pair); traces in {trace_dir}")
    width = max(len(label) for _, _, label in STEPS)
    print(f"{'step':{width}}  {'times':>6}  {'total s':>8}  {'s a pair':>8}")
    for _, _, label in STEPS:
        if timer.counts[label]:
            total = timer.totals[label]
            print(f"{label:{width}}  {timer.counts[label]:6d}  {total:8.2f}  {total / pairs:8.3f}")


if __name__ == "__main__":
    main()
