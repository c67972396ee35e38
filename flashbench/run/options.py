"""How a run checks and times: every default in one place."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..environment import usable_memory
from .recipe import DEFAULT_FLUSH, FLUSH_METHODS


# A CPU worker that imports torch maps about 0.7 GB before any solution code: with 0.6 GiB of address space it
# could not start, with 0.5 GiB it hung until its timeout, with 0.75 GiB it started (the 2-core development machine).
MIN_WORKER_ADDRESS_SPACE = 2 << 30


def default_memory_limit() -> int | None:
    """Three quarters of the memory the runner may use (a container's limit where lower) for a CPU worker's
    address space, but never less than a worker needs to start: in a small container the kernel's OOM killer then
    takes the worker, its first choice, rather than every pair failing at import."""
    memory = usable_memory()
    return max(memory * 3 // 4, MIN_WORKER_ADDRESS_SPACE) if memory else None


class RunOptions(BaseModel):
    """Checked as the CLI's options are (the Python API passes them on as given): a count below its least, a
    timeout that is not a positive number (inf: none), an unknown flush or option is an error naming the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    device: str = "cpu"  # names the hardware (and so the trace file); references run on its type
    devices: list[str] | None = None  # the pool the jobs are spread over; None: [device]
    backend: str = "local"  # local: the pool, in this process; ray: Ray tasks
    ray_address: str | None = None  # None: a Ray instance of this machine's own
    # Bounded: a warm-up of 10^20 calls was a list the judge built in memory before any deadline applied.
    warmup: int = Field(5, ge=0, le=100_000)
    iters: int = Field(50, ge=1, le=10_000_000)  # at least this many timed calls per job, within TIMED_BUDGET_MS
    seed: int | None = None  # None: input seeds drawn afresh for the run, unknown to any solution
    input_sets: int = Field(3, ge=1)
    timeout: float = Field(300.0, gt=0)
    timing: str = "events"
    flush: str = DEFAULT_FLUSH
    # Timed calls checked per job, picked at random after they ran; None: all of them (on a CPU,
    # where the reference is cheap), else this many.
    checked_calls: int | None = Field(None, ge=0)
    isolation: str | None = None  # None: the strongest the machine allows (run/sandbox.py)
    resume: bool = False
    save: bool = True
    trace_dir: Path | None = None
    cache_dir: Path | None = None  # builds, and the workers' exchange directories
    reference_memory_bytes: int = Field(8 << 30, ge=0)  # reference outputs kept for the run's later jobs
    memory_limit_bytes: int | None = Field(default_factory=default_memory_limit, ge=1)

    @field_validator("flush")
    @classmethod
    def _known_flush(cls, flush: str) -> str:
        if flush not in FLUSH_METHODS:
            raise ValueError(f"no flush {flush!r}; known: {', '.join(FLUSH_METHODS)}")
        return flush

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


# Per device kind: a timed batch lasts at least this long (ms), so the judge's fixed cost around it
# (the request, the worker's reply with its event times: about 1 ms a batch on the H200, where 20 ms
# batches read 20-90 µs per call above CUDA events) stays near 1% (the calls of a slow solution, e.g.
# Triton's interpreter, are batched one by one); at least this many batches; output slots within
# this many bytes.
TARGET_BATCH_MS = {"cuda": 100.0, "cpu": 20.0}
MIN_BATCHES = {"cuda": 5, "cpu": 2}
SLOT_BUDGET_BYTES = {"cuda": 4 << 30, "cpu": 256 << 20}
# Per device kind: past MIN_BATCHES, a job's timed batches stop at this much time. Without it a 170 ms
# reference ran 50 batches of one call, each checked, and took 30-45 s a workload on the H200.
TIMED_BUDGET_MS = {"cuda": 2000.0, "cpu": 2000.0}
GPU_CHECKED_CALLS = 8
# A sampling definition's test has little power on few samples (an argmax sampler passes under about 35
# samples of rows whose likeliest category has probability 0.5): its jobs check timed calls until each output
# has at least this many samples, running more timed calls where the run's would not hold them.
MIN_CHECKED_SAMPLES = 512
