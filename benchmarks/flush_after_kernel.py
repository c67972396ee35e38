"""Does the judge's way of timing (a batch's wall time less the harness's steps timed alone) see
more than CUDA events, in one process? (GPU only.)

Batches of CALLS calls, each [event, L2 flush (write+read), event, kernel, event], against the same
batches without the kernel, for synthetic kernels that write or read a few to 64 MB (what a call
leaves dirty in the L2, or evicts, before the next call's flush). Per kernel, the median over
REPEATS batches, per call: the wall time, the host's time to issue the batch, the device's time
per call (cycle), the flush's device time and the kernel's events; then the wall time less the
no-kernel batch's and less the kernel's events, which is what the judge would read above the
events if the steps cost the same with and without the call.

    python benchmarks/flush_after_kernel.py > docs/data/clock_study_h200/v7_flush_after_kernel.txt
"""

import statistics
import time

import torch

from flashbench.run.recipe import L2Flush

CALLS = 200
REPEATS = 7
MB = 1 << 20


def kernels(device: str) -> dict:
    written = {mb: torch.empty(mb * MB, dtype=torch.uint8, device=device) for mb in (4, 16, 64)}
    read = {mb: torch.ones(mb * MB // 4, dtype=torch.float32, device=device) for mb in (16, 64)}
    sink, one = torch.empty((), device=device), torch.zeros(1, device=device)
    chosen = {"noop": None, "empty": lambda: one.add_(1.0)}
    chosen.update({f"write{mb}": (lambda b=b: b.fill_(1)) for mb, b in written.items()})
    chosen.update({f"read{mb}": (lambda b=b: torch.sum(b, dim=0, out=sink)) for mb, b in read.items()})
    chosen["read64write16"] = lambda: (torch.sum(read[64], dim=0, out=sink), written[16].fill_(2))
    return chosen


class Batch:
    def __init__(self, flush: L2Flush):
        self.flush = flush
        event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self.cycle = [event() for _ in range(CALLS + 1)]
        self.starts = [event() for _ in range(CALLS)]
        self.ends = [event() for _ in range(CALLS)]

    def run(self, kernel) -> dict[str, float]:
        """Per call, in ms."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        for k in range(CALLS):
            self.cycle[k].record()
            self.flush()
            self.starts[k].record()
            if kernel is not None:
                kernel()
            self.ends[k].record()
        self.cycle[CALLS].record()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        return {
            "wall": (end - start) * 1e3 / CALLS,
            "host": (issued - start) * 1e3 / CALLS,
            "cycle": self.cycle[0].elapsed_time(self.cycle[CALLS]) / CALLS,
            "flush": statistics.fmean(self.cycle[k].elapsed_time(self.starts[k]) for k in range(CALLS)),
            "events": statistics.fmean(self.starts[k].elapsed_time(self.ends[k]) for k in range(CALLS)),
        }


def main() -> None:
    chosen = kernels("cuda")
    batch = Batch(L2Flush("write+read", "cuda"))
    for kernel in chosen.values():  # warm up every kernel and the batch itself
        batch.run(kernel)
    readings = {name: [] for name in chosen}
    for _ in range(REPEATS):  # interleaved, so that drift shows in every kernel alike
        for name, kernel in chosen.items():
            readings[name].append(batch.run(kernel))
    median = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in readings.items()}
    base = median["noop"]
    us = lambda ms: f"{ms * 1e3:8.2f}"  # noqa: E731
    print(f"µs per call, median of {REPEATS} batches of {CALLS} calls on {torch.cuda.get_device_name()}")
    print(f"{'kernel':14s} {'wall':>8s} {'host':>8s} {'cycle':>8s} {'flush':>8s} {'events':>8s} | "
          "wall-noop-events  cycle-noop-events  flush-noop")
    for name, m in median.items():
        print(f"{name:14s} {us(m['wall'])} {us(m['host'])} {us(m['cycle'])} {us(m['flush'])} {us(m['events'])} | "
              f"{us(m['wall'] - base['wall'] - m['events'])}  {us(m['cycle'] - base['cycle'] - m['events'])}  "
              f"{us(m['flush'] - base['flush'])}")
    walls = sorted(r["wall"] for r in readings["noop"])
    print("no-kernel batches, wall per call:", " ".join(us(w) for w in walls),
          f" spread (max-min)/median {(walls[-1] - walls[0]) / statistics.median(walls) * 100:.2f}%")


if __name__ == "__main__":
    main()
