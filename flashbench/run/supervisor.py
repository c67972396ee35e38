"""Starting a sandboxed worker, asking it things with a deadline, and ending it with everything it started."""

import contextlib
import ctypes
import fcntl
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..environment import usable_memory
from ..registry import ROOT_VARIABLE
from . import sandbox
from .protocol import (MAX_FRAME_BYTES, BatchDone, Channel, ChannelClosed, ChannelTimeout, Failed, ProtocolError, Ready,
                       Setup, Stop, fd_socket_pair, frame, parse_reply, reply_limit, send_fd)

LOG_TAIL_BYTES = 4000
SPEC_FILE = "sandbox.json"  # in the exchange directory: the sandbox the worker starts in (SandboxSpec.write)
# What a solution's build directory, which outlives its runs, may hold once a job is done: more is the pair's
# REJECTED and the directory emptied when the worker ends. A red team filled the disk through it (1 GiB files,
# then small ones): the run ended when its trace could not be written, and every later run when its folder
# could not be staged.
BUILD_DIR_LIMIT_BYTES = 4 << 30
BUILD_DIR_LIMIT_FILES = 200_000  # and its files and folders: a second red team made 300,000 empty files in 3.5 s
STOP_ROUNDS = 100  # listings of the sandbox's processes while stopping them (paused)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerGone(Exception):
    """The worker timed out, died, or said something that is not a reply: it is ended."""

    def __init__(self, status: str, message: str, log: str = ""):
        super().__init__(message)
        self.status = status
        self.message = message
        self.log = log


class Pause:
    """What WorkerProcess.paused found: `held`, whether the sandbox stayed stopped for the whole block."""

    def __init__(self):
        self.held = False


class WorkerProcess:
    """One worker in its sandbox, for one solution on one device. A crash, hang or OOM ends only it."""

    def __init__(self, process: subprocess.Popen, channel: Channel, exchange_dir: Path, log_path: Path, isolation: str,
                 fd_socket=None, log_fd: int | None = None, build_dir: Path | None = None):
        self.process = process
        self.build_dir = build_dir  # the solution's own, kept across runs (its compiled kernels and caches)
        self.channel = channel
        self.fd_socket = fd_socket  # the judge's sending end of the descriptor socket (a CPU arena's memfd)
        self.exchange_dir = exchange_dir
        self.log_path = log_path
        self.log_fd = log_fd  # the judge's own reading descriptor of the log, open from before the worker started
        self.isolation = isolation

    @classmethod
    def start(cls, setup: Setup, isolation: str, work_root: Path, memory_limit_bytes: int | None,
              hidden: tuple[Path, ...] = (), shown: tuple[Path, ...] = (),
              account: sandbox.WorkerAccount = sandbox.WorkerAccount(None),
              task_limit: int | None = None, cpus: tuple[int, ...] | None = None,
              repository: Path | None = None) -> "WorkerProcess":
        """The worker may write only its exchange directory (its TMPDIR at level process) and the
        solution's own build directory; its log is a file it holds open but cannot reach by name. At the
        namespaces level the `hidden` directories are empty to it, but for its solution's folder, build and
        exchange directories and the `shown` ones. It runs as `account` says: a uid of its own owns the build
        and exchange directories.
        `task_limit`: its RLIMIT_NPROC (WorkerAccount.task_limit), if any; `cpus`: its lane's CPUs (pool.lane_cpus);
        `repository`: where it finds the FP8 quantize reference (FLASHBENCH_ROOT; its working directory may lie
        outside the repository, and an installed flashbench has none beside it).
        It gets three descriptors: the request pipe, the reply pipe, and its end of the descriptor
        socket, on which a CPU job's arena (a sealed memfd) comes."""
        setup_frame = frame(setup)  # the worker refuses a larger first frame: say why before it starts
        if len(setup_frame) > MAX_FRAME_BYTES:
            raise WorkerGone("INVALID_SOLUTION", f"its manifest makes the worker's first message {len(setup_frame)} "
                                                 f"bytes; a message may have {MAX_FRAME_BYTES}")
        work_root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(work_root)
        log_fd, exchange = _locked_log(work_root)
        log_path = exchange.with_suffix(LOG_SUFFIX)
        build_dir = Path(setup.build_dir)
        _give_directory(build_dir, account.uid)
        _give_directory(exchange, account.uid)
        spec = sandbox.SandboxSpec(writable=(str(exchange), str(build_dir)), readable=(setup.folder, *map(str, shown)),
                                   hidden=tuple(map(str, hidden)), memory_limit_bytes=memory_limit_bytes,
                                   task_limit=task_limit, cpus=cpus,
                                   tmpfs_bytes=sandbox.default_tmpfs_bytes(usable_memory()))
        # `undo`: what a start that fails leaves behind (the judge's ends, the log, the exchange dir; an EMFILE at the
        # second pipe left the first); `worker_ends`: the worker's copies of its descriptors, closed here either way.
        with contextlib.ExitStack() as worker_ends, contextlib.ExitStack() as undo:
            undo.callback(sandbox.remove_tree, exchange)
            undo.callback(log_path.unlink, missing_ok=True)
            undo.callback(os.close, log_fd)
            to_worker, from_judge = _pipe()
            worker_ends.callback(os.close, to_worker)
            undo.callback(os.close, from_judge)
            to_judge, from_worker = _pipe()
            worker_ends.callback(os.close, from_worker)
            undo.callback(os.close, to_judge)
            fd_socket, worker_socket = fd_socket_pair()
            worker_ends.callback(worker_socket.close)
            undo.callback(fd_socket.close)
            passed = (to_worker, from_worker, worker_socket.fileno())
            command = sandbox.worker_command(isolation, spec.write(exchange / SPEC_FILE), "flashbench.run.worker",
                                             [str(fd) for fd in passed])
            with open(log_path, "ab") as log:
                try:
                    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                               pass_fds=passed, env=_environment(setup, build_dir, repository),
                                               start_new_session=True, preexec_fn=_before_exec(account))
                except subprocess.SubprocessError as exc:
                    # _before_exec failed (taking the uid): Popen says only "Exception occurred in preexec_fn",
                    # not an OSError as when Popen itself changed the uid; the callers take an OSError for a
                    # worker that could not start (jobs.start_worker: DeviceUnusable).
                    raise OSError(f"the worker could not start {account.describe()}: {exc}") from exc
            undo.pop_all()  # started: the judge keeps its ends, the log and the exchange dir
        worker = cls(process, Channel(to_judge, from_judge), exchange, log_path, isolation, fd_socket, log_fd, build_dir)
        try:
            worker.channel.send(setup_frame)  # read before any solution code is imported
        except (ChannelClosed, ChannelTimeout):
            raise worker.end("CRASHED", "the worker ended before it read its setup") from None
        os.set_blocking(from_judge, False)  # from here on, every request has a deadline (Channel.send)
        return worker

    def ask(self, request, timeout: float, fd: int | None = None) -> Ready | Failed | BatchDone:
        return self.timed_ask(request, timeout, fd)[0]

    def timed_ask(self, request, timeout: float, fd: int | None = None,
                  on_receipt: Callable[[], None] = lambda: None) -> tuple[Ready | Failed | BatchDone, float]:
        """The reply, and the judge's own time from sending the request to the reply's first byte (ms).
        `fd` (a CPU job's arena, with its Open) goes over the descriptor socket just before the request.
        The judge's clock stops, and `on_receipt` runs, the moment the reply's first byte is there, before
        any of it is read or parsed: reading and parsing take as long as the worker makes its frame (a red
        team's 1 MiB reply of escaped duplicate keys took about 10 ms), and what the judge reads of the
        worker's memory then would no longer be what the reply stands for."""
        self._refuse_unasked_frames()
        request_frame = frame(request)  # encoded outside the clock: a batch of 300 calls takes 0.1 ms
        try:
            start = time.perf_counter()
            if fd is not None:
                try:
                    send_fd(self.fd_socket, fd)
                except ProtocolError as exc:
                    raise self.end("REJECTED", str(exc)) from None
            self.channel.send(request_frame, timeout)
            arrived = []

            def on_arrival() -> None:
                arrived.append(time.perf_counter())
                on_receipt()

            payload = self.channel.receive_json(timeout, on_arrival, reply_limit(request))
            return parse_reply(payload), (arrived[0] - start) * 1e3
        except ChannelTimeout:
            raise self.end("TIMEOUT", f"no answer within {timeout:g} s") from None
        except ChannelClosed:
            try:
                self.process.wait(timeout=5)  # its exit status says why
            except subprocess.TimeoutExpired:
                pass
            raise self.end("CRASHED", describe_exit(self.process.poll())) from None
        except ProtocolError as exc:
            raise self.end("REJECTED", f"the worker's reply is malformed: {exc}") from None

    def _refuse_unasked_frames(self) -> None:
        """Every reply answers the request before it: a frame already waiting (a reply queued ahead, so
        that the next batch's clock would stop at once) is refused. The end of the pipe (a dead worker)
        is left to the request, which finds it."""
        if not self.channel.pending():
            return
        try:
            self.channel.receive_json(timeout=1.0)
        except ChannelClosed:
            return
        except (ChannelTimeout, ProtocolError):
            pass
        raise self.end("REJECTED", "the worker sent a frame it was not asked for (a reply queued ahead)")

    def end(self, status: str, message: str) -> WorkerGone:
        """Close the worker at once, without a Stop: it has just failed to answer or answered wrongly (a hung
        one would hold the judge for the Stop's 2 s). The error that says why, with its log."""
        log = self.log_tail()
        self.close(ask=False)
        return WorkerGone(status, message, log)

    def leftovers(self) -> list[int]:
        """Processes the solution started that are still running."""
        if self.process.poll() is not None:
            return []
        return sandbox.sandbox_processes(self.process.pid, self.isolation)

    @contextlib.contextmanager
    def paused(self):
        """The worker and everything in its sandbox stopped (SIGSTOP, every thread) for the block: while the
        judge times its own harness steps, a worker that spends the host's CPUs then would make the steps
        look dearer and its own calls, with them subtracted, cheaper. Its queued GPU work runs on. The block
        gets a Pause, whose `held` says after it whether the sandbox stayed stopped throughout: every process
        found stopped before, no process new after, and none given CPU time meanwhile (a process that
        resumed, by any route, and stopped itself again before the end is seen by its CPU time)."""
        pause = Pause()
        worker = sandbox.worker_pid(self.process.pid, self.isolation) if self.process.poll() is None else None
        stopped, all_stopped = self._stop_sandbox(worker) if worker is not None else ([], True)
        before = sandbox.cpu_time_ns(stopped) if all_stopped else None
        try:
            yield pause
        finally:
            if worker is None:
                pause.held = True
            elif all_stopped:
                members = [worker, *self.leftovers()]
                pause.held = set(members) <= set(stopped) and sandbox.cpu_time_ns(stopped) == before
            for pid in stopped:
                _signal(pid, signal.SIGCONT)

    def _stop_sandbox(self, worker: int) -> tuple[list[int], bool]:
        """Stops the worker and whatever its sandbox holds, listing and stopping until one listing finds every
        process stopped: a process forked between a listing and its SIGSTOP shows in the next one, and the
        sandbox's seccomp filter refuses the calls that name SIGCONT, and ptrace (what else resumes one,
        `paused` sees by its CPU time).
        The processes signalled, and whether all were found stopped: a thread kept in the kernel (a long
        madvise) or a sandbox forking faster than STOP_ROUNDS listings is not."""
        stopped = set()
        for _ in range(STOP_ROUNDS):
            members = [worker, *self.leftovers()]
            running = [pid for pid in members if not sandbox.is_stopped(pid)]
            stopped.update(members)
            if not running:
                return sorted(stopped), True
            for pid in running:
                _signal(pid, signal.SIGSTOP)
        return sorted(stopped), False

    def log_tail(self) -> str:
        if self.log_fd is None:
            return ""
        try:
            start = max(os.fstat(self.log_fd).st_size - LOG_TAIL_BYTES, 0)
            return os.pread(self.log_fd, LOG_TAIL_BYTES, start).decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def build_dir_overfull(self) -> str | None:
        """What the solution's build directory holds, when that is more than BUILD_DIR_LIMIT_BYTES or
        BUILD_DIR_LIMIT_FILES (or cannot be measured). Where `du` cannot even start, nothing is known: the
        host's trouble is not held against the solution, and its next worker's end measures again."""
        if self.build_dir is None:
            return None
        try:
            usage = sandbox.disk_usage(self.build_dir)
        except OSError:
            return None
        if usage is None:
            return "more than can be measured"
        held, files = usage
        if held > BUILD_DIR_LIMIT_BYTES or files > BUILD_DIR_LIMIT_FILES:
            return f"{held / 2**30:.1f} GiB in {files} files and folders"
        return None

    def close(self, ask: bool = True) -> None:
        """Ends the worker and everything in its sandbox (`ask`: first asking it to stop); removes its files, and
        its solution's build directory when that is over its limits (build_dir_overfull). Safe to call twice."""
        if ask and self.process.poll() is None:
            try:
                self.channel.send(Stop(), timeout=2)
                self.process.wait(timeout=2)
            except (ChannelClosed, ChannelTimeout, subprocess.TimeoutExpired):
                pass
        sandbox.end_sandbox(self.process, self.isolation)
        self.channel.close()
        if self.fd_socket is not None:
            self.fd_socket.close()  # an arena sent and never taken goes with it
        sandbox.remove_tree(self.exchange_dir)
        if self.build_dir_overfull():
            sandbox.remove_tree(self.build_dir)
        self.log_path.unlink(missing_ok=True)
        if self.log_fd is not None:
            os.close(self.log_fd)
            self.log_fd = None


def _give_directory(path: Path, uid: int | None) -> None:
    """`path`, made where missing, owned by `uid` (None: this process's). A build directory a worker of
    another uid filled is emptied first, not handed over file by file: what it holds is the solution's, and
    a link or a hard link in it would hand the new owner a file of the host's. That includes an earlier
    run's workers of the worker uid when this run's are the runner's: root of a user namespace that maps
    only the runner could not write what they left (a C++ extension's lock file: INVALID_SOLUTION)."""
    owner = os.geteuid() if uid is None else uid
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_uid == owner:
        return
    if any(path.iterdir()):
        sandbox.remove_tree(path)
        path.mkdir(parents=True)
    os.chown(path, owner, os.getegid() if uid is None else uid, follow_symlinks=False)


def _before_exec(account: sandbox.WorkerAccount):
    """What the started process runs before exec, in this order: the OOM killer's first choice
    (sandbox.put_first_for_the_oom_killer, while it holds the runner's capabilities), the worker's uid,
    then a SIGKILL for it when the thread starting it ends, however the judge ends (killed outright
    included), kept across exec (the kernel clears that signal when the uid changes, so it comes last).
    At the namespaces level the process is `unshare`, whose --kill-child passes that death on to the
    worker, and so to its whole PID namespace. The function is resolved here, in the judge, before the fork."""
    linux = sys.platform.startswith("linux")
    prctl, parent = (ctypes.CDLL(None, use_errno=True).prctl if linux else None), os.getpid()
    option, death_signal = ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL)

    def before_exec() -> None:
        sandbox.put_first_for_the_oom_killer()
        account.become()
        if prctl is not None:
            prctl(option, death_signal)
            if os.getppid() != parent:  # the judge died before the line above
                os._exit(1)

    return before_exec


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:  # ended meanwhile
        pass


def _pipe() -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    return read_fd, write_fd


EXCHANGE_PREFIX = "worker-"  # worker-<random>, and its log worker-<random>.log
LOG_SUFFIX = ".log"
UNNAMED_LOG_SUFFIX = ".log-new"  # the log while its exchange folder is being made


def _locked_log(work_root: Path) -> tuple[int, Path]:
    """A new worker's log, open (read and write: byte-range locks over NFS need it) and locked by this runner before
    anything else of the worker exists, then its exchange folder beside it: a runner that finds a log unlocked
    knows its owner is gone (remove_leftovers). Held open while the worker lives and read through: the judge never
    opens the log again, which would wait for the worker if it held a lease on it. The worker writes through an
    open file of its own, which cannot release this one's lock."""
    descriptor, unnamed = tempfile.mkstemp(prefix=EXCHANGE_PREFIX, suffix=UNNAMED_LOG_SUFFIX, dir=work_root)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(descriptor, 0o644)
        exchange = Path(unnamed.removesuffix(UNNAMED_LOG_SUFFIX))
        exchange.mkdir(mode=0o700)
        os.rename(unnamed, exchange.with_suffix(LOG_SUFFIX))
    except BaseException:
        os.close(descriptor)
        with contextlib.suppress(OSError):
            os.unlink(unnamed)
        raise
    return descriptor, exchange


def remove_leftovers(work_root: Path) -> None:
    """Exchange folders and logs of runners that are gone (one killed by SIGKILL or a second Ctrl-C left its
    workers' behind): a living runner holds a lock on each of its workers' logs, whatever its pid namespace
    or host (a cache shared by containers, or over a network); a log found unlocked is a dead runner's. Never
    raises: litter no runner can remove stays, and every worker's start goes on."""
    logs = [*work_root.glob(f"{EXCHANGE_PREFIX}*{LOG_SUFFIX}"), *work_root.glob(f"{EXCHANGE_PREFIX}*{UNNAMED_LOG_SUFFIX}")]
    for log in logs:
        try:
            descriptor = os.open(log, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                continue
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its runner lives
            exchange = log.with_name(log.name.removesuffix(LOG_SUFFIX).removesuffix(UNNAMED_LOG_SUFFIX))
            if exchange.is_dir() and not exchange.is_symlink():
                sandbox.remove_tree(exchange)
            log.unlink()
        except OSError:
            continue
        finally:
            os.close(descriptor)


def _environment(setup: Setup, build_dir: Path, repository: Path | None) -> dict[str, str]:
    """Caches a solution's tools write (Triton, CUDA, nvcc, FlashInfer's JIT under ~/.cache) go to its
    own build directory, the only lasting place it can write."""
    extra = {
        "HOME": str(build_dir / "home"), "TRITON_CACHE_DIR": str(build_dir / "triton"),
        "CUDA_CACHE_PATH": str(build_dir / "nv"), "PYTHONDONTWRITEBYTECODE": "1",
    }
    if repository is not None:
        extra[ROOT_VARIABLE] = str(repository.absolute())
    if setup.device == "cpu":
        extra["TRITON_INTERPRET"] = "1"  # Triton kernels run on the CPU under the interpreter
    return sandbox.worker_environment(extra)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "the worker stopped answering"
    if code < 0:
        try:
            return f"the worker was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the worker was killed by signal {-code}"
    return f"the worker exited with code {code}"
