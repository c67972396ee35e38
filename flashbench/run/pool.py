"""Spreading a run's jobs over several devices: one thread per device in the runner's process,
each owning the worker processes of its device.

Jobs wait in one queue shared by the devices. A device takes the next job only once its last
result is recorded, so no device ever runs two jobs at once, and a pool of one device runs the
jobs in order, exactly like a plain run. Results go back to the thread that called `run`, which
alone records them. Every worker checks its device before any solution code runs; a device
that fails that check twice in a row is taken out of the pool (a message on stderr) and the job
it held goes back to the queue for the others. When no device is left, the run ends.
"""

import os
import queue
import sys
import threading
from dataclasses import dataclass, field

import torch

from ..errors import FlashbenchError, shortened
from .jobs import DeviceUnusable, JobJudge
from .recipe import CPU_THREADS
from .session import JobOutcome

STARTS_BEFORE_OUT = 2  # failed device checks in a row that take a device out of the pool
ABORT_WAIT_S = 10.0  # after an error, how long to wait for the device threads to end their jobs
DEVICE_THREAD = "flashbench device "  # how a pool's threads are named: the prefix, then the device


def parse_devices(spec: str) -> list[str]:
    """`all` (every visible GPU), GPU indices and device names (`0,1`, `cuda:0,cuda:2`), `cpu`
    repeated (`cpu,cpu`) or `cpu:N` for N CPU devices, which exercise the pool without a GPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec.strip() == "all":
        if not gpus:
            raise FlashbenchError("--devices all: no GPU is visible; for CPU devices give cpu:N")
        return [f"cuda:{i}" for i in range(gpus)]
    devices = []
    for token in (t.strip() for t in spec.split(",")):
        kind, _, index = token.partition(":")
        if token.isdigit() or (kind == "cuda" and index.isdigit()):
            number = int(token) if token.isdigit() else int(index)
            if number >= gpus:
                raise FlashbenchError(f"--devices: no GPU {number}; {gpus} visible")
            devices.append(f"cuda:{number}")
        elif token == "cpu" or (kind == "cpu" and index.isdigit() and int(index) > 0):
            devices += ["cpu"] * (int(index) if index else 1)
        else:
            raise FlashbenchError(f"--devices: {token!r} is not all, a GPU index, cuda:N, cpu or cpu:N")
    if len({torch.device(d).type for d in devices}) > 1:
        raise FlashbenchError("--devices: GPUs and CPU devices cannot share a run")
    if len(set(devices)) < len(devices) and devices[0] != "cpu":
        raise FlashbenchError("--devices: a GPU is named twice; two jobs on one GPU would time each other")
    return devices


def lane_cpus(devices: list[str]) -> list[tuple[int, ...] | None]:
    """Each lane's share of the CPUs this process may use, disjoint where there are enough: a worker (and all it
    starts) of one lane cannot take CPU time from another lane's worker while that one is timed. One lane: any.
    A CPU device's lane keeps CPU_THREADS of its share, the threads the judge times the harness's steps with:
    the judge subtracts those steps from the worker's batches, so a worker that ran them on spare CPUs beside
    its calls would have the difference credited to its calls. (A single CPU lane starts at a CPU picked by the
    runner's PID, so that runs side by side do not all crowd onto the first.)"""
    lanes = len(devices)
    available = sorted(os.sched_getaffinity(0))
    shares = [None] if lanes < 2 else [tuple(available[lane::lanes]) or (available[lane % len(available)],)
                                       for lane in range(lanes)]
    start = os.getpid() % len(available)
    return [(share or tuple(available[start:] + available[:start]))[:CPU_THREADS]
            if device.partition(":")[0] == "cpu" else share for device, share in zip(devices, shares)]


class DeviceOut(Exception):
    """A device taken out of the pool, and why."""


class Lane:
    """One device and the worker it holds: that of the candidate whose job it ran last."""

    def __init__(self, judge: JobJudge, device: str, cpus: tuple[int, ...] | None = None):
        self.judge = judge
        self.device = device
        self.cpus = cpus  # the host CPUs its workers may use (lane_cpus); None: any
        self.candidate = None
        self.worker = None

    def run(self, job) -> JobOutcome:
        if job.candidate is not self.candidate:
            self.close()
            self.candidate = job.candidate
        failure = self.judge.known_failure(job.candidate)
        if failure is None and self.judge.lacks_clean_steps(job, self.device):
            failure = self.measure_clean_steps(job)
        if failure is None and self.worker is not None and self.judge.device_held_by_others(self.device):
            # What its earlier jobs left in the idle worker (a solution's caches holding their arenas)
            # is not the next job's to start with. The judge measures it before the job: no outcome
            # a worker reports can call for a fresh one.
            self.close()
        if failure is None and self.worker is None:
            self.judge.on_phase(job, "build")
            self.worker = self._start(job.candidate)
            failure = self.judge.known_failure(job.candidate)
        if failure is not None:
            return failure
        self.judge.on_phase(job, "reference")
        failure = self._prepare(lambda: self.settle_references(job.workload))
        if failure is not None:
            return failure
        if self.worker is None:  # ended to free the device for the references
            self.worker = self._start(job.candidate)
            if self.worker is None:  # its build failed this time
                return self.judge.known_failure(job.candidate)
        outcome = self.judge.run(self.worker, job, self.device)
        if not outcome.worker_usable or not self.worker.alive():
            self.close()
        return outcome

    def measure_clean_steps(self, job) -> JobOutcome | None:
        """The steps' clean cost of the job's workload on this device; the pair's outcome if it cannot be."""
        self.close()  # no solution's work may share the device while the judge times its steps alone
        return self._prepare(lambda: self.judge.measure_clean_steps(job.workload, self.device))

    def _prepare(self, step) -> JobOutcome | None:
        """The judge's own work on a job's workload (its inputs drawn, its reference run); the pair's outcome
        if that failed. A workload can validate and still not be drawable (an index past a cache whose bound
        its definition does not state, a reference that fails on its data): that once ended the whole run with
        a traceback."""
        try:
            step()
        except DeviceOut:
            raise
        except Exception as exc:  # noqa: BLE001 - trusted code on a workload that cannot be made
            self.close()
            return JobOutcome(status="RUNTIME_ERROR", worker_usable=False, message=shortened(
                "the workload's inputs or reference outputs could not be made (the workload's fault, not the "
                f"solution's): {type(exc).__name__}: {exc}", 500))
        return None

    def settle_references(self, workload) -> None:
        """The reference outputs of the workload's input sets, on this device while its worker is idle.
        That worker may hold the device's memory (a solution can take all of it): then it is ended
        and the lane starts a fresh one for the job."""
        try:
            self.judge.references_for(workload, self.device)
        except torch.cuda.OutOfMemoryError:
            self.close()
            torch.cuda.empty_cache()
            self.judge.references_for(workload, self.device)

    def _start(self, candidate):
        for _ in range(STARTS_BEFORE_OUT):
            try:
                return self.judge.start_worker(candidate, self.device, self.cpus)
            except DeviceUnusable as exc:
                reason = str(exc)
        raise DeviceOut(reason)

    def abort(self) -> None:
        """From another thread: end the job in flight (its worker) instead of waiting for it."""
        worker = self.worker
        if worker is not None:
            worker.close()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


@dataclass
class _Result:
    lane: Lane
    job: object = None
    outcome: JobOutcome | None = None
    recorded: threading.Event = field(default_factory=threading.Event)
    out: str = ""  # the lane's device was taken out of the pool, and why
    error: BaseException | None = None


class DevicePool:
    """The local backend: `run` hands out jobs and yields (job, outcome, environment) as devices finish them."""

    def __init__(self, judge: JobJudge, devices: list[str]):
        self.judge = judge
        shares = lane_cpus(devices)
        self.lanes = [Lane(judge, device, cpus) for device, cpus in zip(devices, shares)]
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._running: dict[int, int] = {}  # id(lane) -> index of the job it holds
        self._running_lock = threading.Lock()
        self._closing = threading.Event()
        self._out: list[str] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self):
        for lane in self.lanes:
            thread = threading.Thread(target=self._serve, args=(lane,), name=DEVICE_THREAD + lane.device, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, kind, error, tb):
        self._closing.set()
        for _ in self._threads:
            self._jobs.put(None)
        if kind is not None:  # an error or an interrupt: end the jobs in flight
            for lane in self.lanes:
                lane.abort()
        patience = ABORT_WAIT_S if kind is not None else None
        self._release_threads(patience)

    def run(self, jobs):
        self._measure_clean_steps(jobs)
        for job in jobs:
            self._jobs.put(job)
        left = len(jobs)
        while left:
            result = self._results.get()
            if result.error is not None:
                raise result.error
            if result.out:
                self._take_out(result)
                continue
            try:
                yield result.job, result.outcome, self.judge.environment_of(result.lane.device)
            finally:
                result.recorded.set()
            left -= 1

    def _measure_clean_steps(self, jobs) -> None:
        """The steps' clean cost of each workload of `jobs` that lacks it on a device (the reference's jobs
        measure it; a resumed run may skip them), measured before any of `jobs` starts, with no worker alive
        on any device: a worker of one lane can load the host, or its GPU, while another lane's judge times
        its steps alone (a red team's second worker of one solution spun the CPUs then, and with no cap its
        sibling's time read 1 µs). Called between phases, while every lane waits for a job."""
        first_of_workload = {}
        for job in jobs:
            first_of_workload.setdefault(job.workload.uuid, job)
        wanted = [(lane, job) for lane in self.lanes for job in first_of_workload.values()
                  if self.judge.lacks_clean_steps(job, lane.device)]
        if not wanted:
            return
        for lane in self.lanes:
            lane.close()
        for lane, job in wanted:  # a workload that cannot be measured gets its outcome in its job (Lane.run)
            if self.judge.lacks_clean_steps(job, lane.device):  # lanes of one kind of device share a measurement
                lane.measure_clean_steps(job)

    def running(self) -> set[int]:
        """The jobs devices hold now, run or waiting to be recorded."""
        with self._running_lock:
            return set(self._running.values())

    def _serve(self, lane: Lane) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None or self._closing.is_set():
                    return
                with self._running_lock:
                    self._running[id(lane)] = job.index
                try:
                    outcome = lane.run(job)
                except DeviceOut as exc:
                    self._jobs.put(job)  # for the devices still in the pool
                    self._results.put(_Result(lane, out=str(exc)))
                    return
                result = _Result(lane, job, outcome)
                self._results.put(result)
                result.recorded.wait()
                with self._running_lock:
                    self._running.pop(id(lane), None)
        except BaseException as exc:  # handed to the recording thread, which raises it
            self._results.put(_Result(lane, error=exc))
        finally:
            with self._running_lock:
                self._running.pop(id(lane), None)
            lane.close()

    def _take_out(self, result: _Result) -> None:
        device = result.lane.device
        self._out.append(f"{device}: {result.out}")
        left = len(self.lanes) - len(self._out)
        if not left and len(self.lanes) == 1:
            raise FlashbenchError(f"device {device} cannot be used: {result.out}")
        if not left:
            raise FlashbenchError(f"every device failed; {'; '.join(self._out)}")
        print(f"warning: device {device} is taken out of the pool: {result.out}; its jobs go to the "
              f"{left} other device(s)", file=sys.stderr, flush=True)

    def _release_threads(self, patience: float | None) -> None:
        """Wait for the device threads to end (at most `patience` s), letting go of any result
        still unrecorded; threads left are daemons, and their workers end with this process."""
        waited = 0.0
        while any(thread.is_alive() for thread in self._threads) and (patience is None or waited < patience):
            try:
                self._results.get(timeout=0.1).recorded.set()
            except queue.Empty:
                waited += 0.1


def device_threads_left() -> list[str]:
    """The device threads of this process's pools still running: after an interrupt or an error, those that
    did not end within ABORT_WAIT_S, held in the judge's own work (a reference on a large workload, a copy
    off the device), which nothing cuts short."""
    return [thread.name for thread in threading.enumerate() if thread.name.startswith(DEVICE_THREAD)]
