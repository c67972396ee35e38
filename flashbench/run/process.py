"""Starting, talking to and killing a worker process, with timeouts and crash detection."""

import os
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp

from .worker import worker_main


# The device check runs no solution code, so --timeout does not apply to it; it includes the
# worker's start (importing torch, creating the CUDA context) on a possibly busy host.
DEVICE_CHECK_TIMEOUT_S = 120.0


class WorkerTimeout(Exception):
    pass


class WorkerCrashed(Exception):
    pass


class DeviceUnusable(Exception):
    """A worker could not use its device: the check it makes before any solution code runs failed."""


@dataclass
class Outcome:
    """A worker's answer to one request, or why there is none."""

    reply: dict | None = None
    status: str = ""  # without a reply: TIMEOUT, CRASHED, REJECTED or the status the worker reported
    message: str = ""
    log: str = ""
    ended: bool = False  # the worker is gone, or must not be used again


class WorkerProcess:
    """One spawned worker. A crash, hang or OOM ends only this process."""

    def __init__(self, config: dict):
        context = mp.get_context("spawn")
        self.log_path = Path(tempfile.mkstemp(prefix="flashbench-worker-", suffix=".log")[1])
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child, str(self.log_path), config), daemon=True)
        self.process.start()
        child.close()

    def request(self, message: dict, timeout: float) -> dict:
        try:
            self.conn.send(message)
            if not self.conn.poll(timeout):
                self.kill()
                raise WorkerTimeout(f"no answer within {timeout:g} s")
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            self.process.join(timeout=5)
            raise WorkerCrashed(describe_exit(self.process.exitcode)) from None

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send({"op": "stop"})
            except OSError:
                pass
            self.process.join(timeout=5)
        self.kill()

    def end_leftover_processes(self) -> int:
        """Kill processes the solution started that outlived its call; how many there were."""
        leftovers = [pid for pid in group_members(self.process.pid) if pid != self.process.pid]
        for pid in leftovers:
            _kill(pid)
        return len(leftovers)

    def kill(self) -> None:
        """End the worker and everything left in its process group."""
        for pid in group_members(self.process.pid):
            _kill(pid)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    def close(self) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)


def ask(worker: WorkerProcess, request: dict, timeout: float) -> Outcome:
    try:
        reply = worker.request(request, timeout)
    except WorkerTimeout as exc:
        return Outcome(status="TIMEOUT", message=str(exc), log=worker.log_tail(), ended=True)
    except WorkerCrashed as exc:
        return Outcome(status="CRASHED", message=str(exc), log=worker.log_tail(), ended=True)
    if not reply["ok"]:
        return Outcome(status=reply["status"], message=reply["message"], log=worker.log_tail())
    return Outcome(reply=reply, log=worker.log_tail())


def start_worker(config: dict, timeout: float) -> tuple[WorkerProcess, Outcome | None]:
    """A worker that checked its device and built the solution, and the build's failure if it
    failed. A failed device check is the device's fault, not the solution's: DeviceUnusable."""
    try:
        worker = WorkerProcess(config)
    except OSError as exc:
        raise DeviceUnusable(f"its worker could not start: {exc}") from None
    probe = ask(worker, {"op": "probe"}, DEVICE_CHECK_TIMEOUT_S)
    if probe.reply is None:
        worker.close()
        raise DeviceUnusable(f"the device check failed: {probe.message}")
    build = ask(worker, {"op": "build"}, timeout)
    if build.reply is not None:
        return worker, None
    if build.ended:
        build.message = f"build: {build.message}"
    return worker, build


def run_job(worker: WorkerProcess, request: dict, timeout: float, on_gpu: bool) -> Outcome:
    outcome = ask(worker, request, timeout)
    if outcome.ended:
        return outcome
    leftovers = worker.end_leftover_processes()
    if leftovers:
        message = f"left {leftovers} process(es) running after the call; they were killed"
        return Outcome(status="REJECTED", message=message, log=worker.log_tail(), ended=True)
    # A CUDA error (an illegal address, say) poisons the worker's context: start afresh.
    outcome.ended = outcome.reply is None and on_gpu
    return outcome


def group_members(pgid: int | None) -> list[int]:
    """Processes in a process group, read from /proc (Linux); empty where that is not available."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if pgid is not None and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "the worker stopped answering"
    if code < 0:
        try:
            return f"the worker was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the worker was killed by signal {-code}"
    return f"the worker exited with code {code}"


