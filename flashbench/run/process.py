"""Starting, talking to and killing a worker process, with timeouts and crash detection."""

import os
import signal
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

from .worker import worker_main


class WorkerTimeout(Exception):
    pass


class WorkerCrashed(Exception):
    pass


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


