"""A sandboxed worker seen from the judge (flashbench/run/supervisor.py): every way it can fail to
answer ends it with one status and a one-line reason (garbage on the reply pipe: REJECTED; killed
by a signal: CRASHED naming the signal; no answer in time: TIMEOUT), and closing it leaves
nothing behind: no process, no exchange directory, no log. The workers are real ones
(flashbench.run.worker in its sandbox); small solutions written by each test misbehave while
they are imported, which the worker does when asked to build."""

import errno
import fcntl
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flashbench import Repo
from flashbench.model import Solution
from flashbench.run import sandbox, select_workloads, supervisor
from flashbench.run.arena import Arena, plan_layout, views
from flashbench.run.judge.inputs import JobInputs
from flashbench.run.protocol import MAX_FRAME_BYTES, Build, Close, Failed, Open, Probe, Ready, Setup
from flashbench.run.supervisor import LOG_TAIL_BYTES, WorkerGone, WorkerProcess, describe_exit

DEFINITION = "mla_paged_decode_h16_ckv512_kpe64_ps1"
LEVELS = ["process"] + (["namespaces"] if sandbox._namespaces_problem() is None else [])
DEFAULT_LEVEL = LEVELS[-1]  # the strongest this machine allows, as a run would use
DPS_SIGNATURE = "q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse"


@pytest.fixture(scope="module")
def definition(repo_copy):
    return Repo(repo_copy).definition(DEFINITION)


@pytest.fixture
def start(definition, tmp_path):
    """Starts a worker whose solution's module is `source` (its `run` does nothing); ends whatever
    the test left running."""
    started = []

    def start(source: str, isolation: str = DEFAULT_LEVEL) -> WorkerProcess:
        folder = tmp_path / f"solution{len(started)}"
        folder.mkdir()
        (folder / "kernel.py").write_text(textwrap.dedent(source) + f"\n\ndef run({DPS_SIGNATURE}):\n    pass\n")
        solution = Solution(name=folder.name, definition=DEFINITION, author="tests", language="python",
                            entry_point="kernel.py::run", dependencies=["torch"])
        setup = Setup(definition=definition, solution=solution, folder=str(folder), device="cpu",
                      build_dir=str(tmp_path / "build" / folder.name))
        worker = WorkerProcess.start(setup, isolation, tmp_path / "workers", memory_limit_bytes=None)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def setup_describing(definition, tmp_path: Path, description_bytes: int) -> Setup:
    """A worker's first message whose solution's description is that long."""
    solution = Solution(name="long", definition=DEFINITION, author="tests", language="python",
                        entry_point="kernel.py::run", description="x" * description_bytes)
    return Setup(definition=definition, solution=solution, folder=str(tmp_path), device="cpu",
                 build_dir=str(tmp_path / "build"))


def test_a_setup_larger_than_a_message_may_be_is_refused_before_any_worker_starts(definition, tmp_path):
    """The worker refuses a first frame past MAX_FRAME_BYTES and exits; the judge then wrote into a closed pipe
    and the run ended. Now it is the candidate's failure, and nothing is started or left behind."""
    with pytest.raises(WorkerGone) as gone:
        WorkerProcess.start(setup_describing(definition, tmp_path, MAX_FRAME_BYTES + 1), DEFAULT_LEVEL,
                            tmp_path / "workers", memory_limit_bytes=None)
    assert gone.value.status == "INVALID_SOLUTION" and "first message" in gone.value.message
    assert left_in(tmp_path / "workers") == []


def test_a_worker_gone_before_reading_its_setup_is_a_crash_that_leaves_nothing(definition, tmp_path, monkeypatch):
    """A setup larger than a pipe holds, to a worker that exits at once: the judge's write fails."""
    monkeypatch.setattr(sandbox, "worker_command", lambda isolation, spec_file, module, args: [sys.executable, "-c", ""])
    with pytest.raises(WorkerGone) as gone:
        WorkerProcess.start(setup_describing(definition, tmp_path, 512 << 10), DEFAULT_LEVEL, tmp_path / "workers",
                            memory_limit_bytes=None)
    assert gone.value.status == "CRASHED" and "before it read its setup" in gone.value.message
    assert left_in(tmp_path / "workers") == []


def left_in(work_root: Path) -> list[str]:
    return sorted(p.name for p in work_root.iterdir()) if work_root.exists() else []


def running(pid: int | None) -> bool:
    return pid is not None and sandbox._alive(pid)


def ended(pid: int | None, patience_s: float = 20.0) -> bool:
    """Whether `pid` stops running (a SIGKILLed process takes a moment to die)."""
    deadline = time.monotonic() + patience_s
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


# A worker that answers; what close() leaves.

CHATTY = """
    import os, subprocess, sys
    print("HOME=" + os.environ["HOME"], "TRITON_INTERPRET=" + os.environ.get("TRITON_INTERPRET", ""))
    print("x" * 3 * {tail})
    print("the last line", flush=True)
    CHILD = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
"""


@pytest.mark.parametrize("isolation", LEVELS)
def test_a_worker_answers_and_close_leaves_nothing(start, tmp_path, isolation):
    worker = start(CHATTY.format(tail=LOG_TAIL_BYTES), isolation)
    reply, elapsed_ms = worker.timed_ask(Probe(), 120)
    assert isinstance(reply, Ready) and elapsed_ms > 0
    assert isinstance(worker.ask(Build(), 60), Ready)
    assert worker.alive() and worker.exchange_dir.is_dir() and worker.log_path.is_file()
    assert worker.log_path.parent == worker.exchange_dir.parent == tmp_path / "workers"

    log = worker.log_tail()  # the worker's output, only its tail
    assert len(log) <= LOG_TAIL_BYTES and log.rstrip().endswith("the last line")
    whole = worker.log_path.read_text()
    assert f"HOME={tmp_path / 'build' / 'solution0' / 'home'}" in whole and "TRITON_INTERPRET=1" in whole

    leftovers = worker.leftovers()  # what the solution started and left running
    assert len(leftovers) == 1 and running(leftovers[0])
    host_pid = sandbox.worker_pid(worker.process.pid, isolation)
    worker.close()
    assert not worker.alive() and ended(host_pid) and ended(leftovers[0])
    assert left_in(tmp_path / "workers") == []  # no exchange directory, no log
    worker.close()  # twice is safe
    assert worker.leftovers() == []


# The arena's descriptor.

@pytest.mark.parametrize("isolation", LEVELS)
def test_a_worker_maps_only_a_sealed_arena_sent_with_its_job(start, repo_copy, definition, isolation):
    """A CPU job's arena is a sealed memfd that crosses the descriptor socket with its Open; one
    anyone may resize is refused, and the worker goes on to the next job, which gets its own."""
    worker = start("""
        import os
        links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                 if os.path.exists(f"/proc/self/fd/{fd}")]
        print("memfds at import:", sum("memfd:" in link for link in links), flush=True)
        print("sockets at import:", sum(link.startswith("socket:") for link in links), flush=True)
    """, isolation)
    assert isinstance(worker.ask(Build(), 120), Ready)
    [workload] = select_workloads(Repo(repo_copy), DEFINITION, ["smoke_mixed"], "cpu")
    inputs = JobInputs(definition, workload, [1], "cpu", repo_copy)
    layout = plan_layout(inputs.tensors, inputs.scalars, inputs.outputs, sets=1, slots=2)
    job = Open(workload=workload, arena={"kind": "memfd"}, layout=layout, flush="none", flush_bytes=1 << 20)

    unsealed = os.memfd_create("flashbench-arena", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, layout.nbytes)
    try:
        reply = worker.ask(job, 60, fd=unsealed)
    finally:
        os.close(unsealed)
    assert isinstance(reply, Failed) and "not sealed" in reply.message

    arena = Arena.create_memfd(layout.nbytes)
    try:
        for name, tensor in views(arena.memory, layout.sets[0]).items():
            tensor.copy_(inputs.sets[0][name])
        assert isinstance(worker.ask(job, 60, fd=arena.fd), Ready)
        assert isinstance(worker.ask(Close(), 60), Ready)
        assert os.fstat(arena.fd).st_size == arena.memory.numel()
        assert fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS) & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    finally:
        arena.close()
    log = worker.log_tail()  # before any job: its end of the descriptor socket, and no arena
    assert worker.alive() and "memfds at import: 0" in log and "sockets at import: 1" in log


# Garbage on the reply pipe.

@pytest.mark.parametrize("garbage, words", [
    (b"\x05\x00\x00\x00hello", "not a valid reply"),  # a frame that is not JSON
    ((MAX_FRAME_BYTES + 1).to_bytes(4, "little"), "a frame of"),  # a length past the cap, never read
])
def test_garbage_on_the_reply_pipe_is_a_malformed_reply(start, tmp_path, garbage, words):
    worker = start(f"""
        import os, sys
        print("writing garbage", flush=True)
        os.write(int(sys.argv[2]), {garbage!r})
    """)
    assert isinstance(worker.ask(Probe(), 120), Ready)
    with pytest.raises(WorkerGone) as gone:
        worker.ask(Build(), 60)
    assert gone.value.status == "REJECTED"
    assert gone.value.message.startswith("the worker's reply is malformed") and words in gone.value.message
    assert "\n" not in gone.value.message
    assert "writing garbage" in gone.value.log  # the log, taken before the files went
    assert not worker.alive() and left_in(tmp_path / "workers") == []


def test_a_reply_queued_ahead_of_its_request_is_refused(start, tmp_path):
    """A worker that writes one frame more than it is asked for (here a Ready while it builds, so its own
    answer to the Build comes second) would have the next request answered before it ran."""
    worker = start("""
        import os, struct, sys
        frame = b'{"kind": "ready"}'
        os.write(int(sys.argv[2]), struct.pack("<I", len(frame)) + frame)
    """)
    assert isinstance(worker.ask(Probe(), 120), Ready)
    assert isinstance(worker.ask(Build(), 60), Ready)  # the frame it wrote, taken for its answer
    time.sleep(1.0)  # its own answer to the Build has come by now
    with pytest.raises(WorkerGone) as gone:
        worker.ask(Probe(), 60)
    assert gone.value.status == "REJECTED" and "not asked for" in gone.value.message
    assert not worker.alive() and left_in(tmp_path / "workers") == []



def test_what_the_judge_reads_at_a_reply_is_read_before_the_reply_is_parsed(tmp_path, monkeypatch):
    """The judge's clock stops when a reply's first byte is there; reading and parsing the frame take as long as
    the worker makes it (up to MAX_FRAME_BYTES of escaped duplicate keys: about 10 ms to parse), and a worker
    that goes on writing its outputs meanwhile must not be read after it did. `on_receipt` (where the judge
    copies the outputs) comes first (test_protocol.py: at the first byte)."""
    order = []

    class Channel:
        def pending(self):
            return False

        def send(self, request_frame, timeout):
            order.append("sent")

        def receive_json(self, timeout, on_arrival, max_bytes=None):
            on_arrival()
            order.append("received")
            return b'{"kind": "ready"}'

    parse = supervisor.parse_reply
    monkeypatch.setattr(supervisor, "parse_reply", lambda payload: order.append("parsed") or parse(payload))
    worker = WorkerProcess(None, Channel(), tmp_path, tmp_path / "log", DEFAULT_LEVEL)
    reply, elapsed_ms = worker.timed_ask(Probe(), 1.0, on_receipt=lambda: order.append("read"))
    assert isinstance(reply, Ready) and elapsed_ms >= 0
    assert order == ["sent", "read", "received", "parsed"]


# Death by a signal.

@pytest.mark.parametrize("isolation", LEVELS)
def test_a_worker_that_faults_crashes_naming_the_signal(start, tmp_path, isolation):
    worker = start("""
        import ctypes
        ctypes.string_at(0)  # a real fault: signals a namespace's init sends itself are ignored
    """, isolation)
    assert isinstance(worker.ask(Probe(), 120), Ready)
    with pytest.raises(WorkerGone) as gone:
        worker.ask(Build(), 60)
    assert (gone.value.status, gone.value.message) == ("CRASHED", "the worker was killed by SIGSEGV")
    assert not worker.alive() and left_in(tmp_path / "workers") == []


@pytest.mark.parametrize("isolation", [
    pytest.param(level, marks=pytest.mark.xfail(
        reason="util-linux unshare (2.38) cannot re-raise SIGKILL on itself: it exits with code 1 "
               "('sigprocmask unblock failed'), so the judge reads 'exited with code 1'", strict=False))
    if level == "namespaces" else level
    for level in LEVELS
])
def test_a_worker_killed_from_outside_crashes_naming_the_signal(start, isolation):
    """SIGKILL is how the OOM killer (or an operator) ends a process."""
    worker = start("import time\ntime.sleep(600)\n", isolation)
    assert isinstance(worker.ask(Probe(), 120), Ready)
    threading.Timer(0.5, os.kill, (sandbox.worker_pid(worker.process.pid, isolation), signal.SIGKILL)).start()
    with pytest.raises(WorkerGone) as gone:
        worker.ask(Build(), 120)  # the import sleeps: the reply pipe closes when the worker dies
    assert (gone.value.status, gone.value.message) == ("CRASHED", "the worker was killed by SIGKILL")


# Memory.

CAP_SYS_RESOURCE = 24


def holds_capability(number: int) -> bool:
    effective = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
    return bool(int(effective.split()[1], 16) >> number & 1)


def oom_score(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


@pytest.mark.parametrize("isolation", LEVELS)
def test_a_worker_is_the_oom_killers_first_choice(start, isolation):
    """The kernel kills the largest process when the host's memory runs out: a worker's memory (a GPU
    worker's host memory has no limit) ended the runner, and every job of the run, sooner than itself."""
    worker = start("""
        import sys
        try:
            with open("/proc/self/oom_score_adj", "w") as score:
                score.write("0")
            print("score lowered", file=sys.stderr)
        except OSError as exc:
            print("score kept:", exc.strerror, file=sys.stderr)
    """, isolation)
    assert isinstance(worker.ask(Probe(), 120), Ready)
    started = [worker.process.pid, sandbox.worker_pid(worker.process.pid, isolation)]
    assert [oom_score(pid) for pid in started] == [sandbox.OOM_SCORE_ADJ_MAX] * 2

    assert isinstance(worker.ask(Build(), 120), Ready)  # imports the solution, which tries to lower its score
    if holds_capability(CAP_SYS_RESOURCE):  # what makes the score the floor (not held in some containers' root)
        assert "score kept: Permission denied" in worker.log_tail()
        assert oom_score(started[1]) == sandbox.OOM_SCORE_ADJ_MAX


# No answer.

def test_a_hang_times_out_and_the_worker_is_ended(start, tmp_path):
    worker = start("""
        print("hanging", flush=True)
        while True:
            pass
    """)
    assert isinstance(worker.ask(Probe(), 120), Ready)
    host_pid = sandbox.worker_pid(worker.process.pid, worker.isolation)
    sent, send = [], worker.channel.send

    def recording_send(frame, *args, **kwargs):
        sent.append(type(frame).__name__)
        return send(frame, *args, **kwargs)
    worker.channel.send = recording_send
    with pytest.raises(WorkerGone) as gone:
        worker.ask(Build(), 1)
    assert (gone.value.status, gone.value.message) == ("TIMEOUT", "no answer within 1 s")
    assert "hanging" in gone.value.log
    assert not worker.alive() and ended(host_pid)
    assert "Stop" not in sent  # killed at once: a hung worker would never read a Stop
    assert left_in(tmp_path / "workers") == []


# How an exit reads.

@pytest.mark.parametrize("code, message", [
    (None, "the worker stopped answering"),
    (0, "the worker exited with code 0"),
    (3, "the worker exited with code 3"),
    (-signal.SIGSEGV, "the worker was killed by SIGSEGV"),
    (-signal.SIGKILL, "the worker was killed by SIGKILL"),
    (-200, "the worker was killed by signal 200"),
])
def test_describe_exit(code, message):
    assert describe_exit(code) == message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_worker_dies_with_the_thread_that_started_it(start, tmp_path):
    """However the judge ends (killed outright included), its workers end with it: here the thread
    that started the worker ends while the worker hangs in its import."""
    workers = []

    def start_and_leave():
        worker = start("while True:\n    pass\n")
        worker.channel.send(Build())
        workers.append(worker)

    thread = threading.Thread(target=start_and_leave)
    thread.start()
    thread.join()
    worker = workers[0]
    assert worker.process.wait(timeout=30) == -signal.SIGKILL


# Pausing a worker while the judge times its own steps.

BUSY_THREAD = """
    import threading
    def spin():
        while True:
            pass
    threading.Thread(target=spin, daemon=True).start()
"""


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, every thread


@pytest.mark.parametrize("isolation", LEVELS)
def test_a_paused_worker_spends_no_cpu_and_runs_on_afterwards(start, isolation, monkeypatch):
    """A worker that burns the host's CPUs from a thread while the judge times its own steps would make
    them look dearer: paused, none of its threads runs, and the pause says it held; CPU time given to the
    sandbox during a pause says it did not."""
    worker = start(BUSY_THREAD, isolation)
    assert isinstance(worker.ask(Build(), 120), Ready)  # imported: the thread spins
    pid = sandbox.worker_pid(worker.process.pid, isolation)
    with worker.paused() as pause:
        time.sleep(0.2)  # the stop takes effect
        before = cpu_ticks(pid)
        time.sleep(0.5)
        assert cpu_ticks(pid) == before and sandbox._stat_fields(pid)[0] == "T"
    assert pause.held
    time.sleep(0.5)
    assert cpu_ticks(pid) > before  # going again
    readings = iter([1, 2])  # CPU time given to the sandbox during the block: it did not stay stopped
    monkeypatch.setattr(sandbox, "cpu_time_ns", lambda pids: next(readings))
    with worker.paused() as pause:
        pass
    assert not pause.held
    assert isinstance(worker.ask(Probe(), 60), Ready)


def test_a_directory_a_worker_of_another_uid_filled_is_emptied_before_it_is_handed_over(tmp_path):
    """Owned by the worker's uid, its build directory is kept as it is; one of another owner is emptied, not
    handed over file by file (a hard link in it would hand over a file of the host's)."""
    if os.geteuid() != 0:
        pytest.skip("only root hands a directory to another uid")
    uid = sandbox.configured_worker_uid()
    ours, theirs, new = tmp_path / "ours", tmp_path / "theirs", tmp_path / "new"
    for folder in (ours, theirs):
        folder.mkdir()
        (folder / "kernel.so").write_bytes(b"built")
    os.chown(ours, uid, uid)
    host_file = tmp_path / "host_file"
    host_file.write_text("the host's")
    os.link(host_file, theirs / "hard_link")

    for folder in (ours, theirs, new):
        supervisor._give_directory(folder, uid)

    assert [(f.stat().st_uid, sorted(p.name for p in f.iterdir())) for f in (ours, theirs, new)] == [
        (uid, ["kernel.so"]), (uid, []), (uid, [])]
    assert host_file.stat().st_uid == 0 and host_file.read_text() == "the host's"


def test_a_directory_the_worker_uid_filled_is_emptied_for_a_run_whose_workers_are_root(tmp_path):
    """Runs as the worker uid, then as root (an interpreter the uid cannot reach): root of the user namespace
    could not write the folders an earlier run's workers left, and a C++ extension's build failed."""
    if os.geteuid() != 0:
        pytest.skip("only root hands a directory to another uid")
    uid = sandbox.configured_worker_uid()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "lock").write_bytes(b"")
    os.chown(theirs, uid, uid)
    os.chown(theirs / "lock", uid, uid)

    supervisor._give_directory(theirs, None)

    assert (theirs.stat().st_uid, list(theirs.iterdir())) == (0, [])


def test_a_build_directory_du_cannot_even_start_on_is_not_held_against_the_solution(tmp_path, monkeypatch):
    """Other lanes' sandboxes had taken the host's last PIDs: the judge's `du` could not fork, and the honest
    solution whose job had just ended was REJECTED and its build directory emptied."""
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    (build_dir / "kernel.so").write_bytes(b"built")

    def no_fork(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    def too_long(*args, **kwargs):
        raise sandbox.subprocess.TimeoutExpired("du", sandbox.DU_TIMEOUT_S)

    worker = WorkerProcess(None, None, tmp_path, tmp_path / "log", DEFAULT_LEVEL, build_dir=build_dir)
    monkeypatch.setattr(sandbox.subprocess, "run", no_fork)
    assert worker.build_dir_overfull() is None
    monkeypatch.setattr(sandbox.subprocess, "run", too_long)
    assert worker.build_dir_overfull() == "more than can be measured"  # too large to walk in time: the folder's


def test_a_worker_that_cannot_take_its_uid_is_an_os_error(definition, tmp_path, monkeypatch):
    """The uid is taken in preexec_fn (after the OOM score): a failure there is Popen's SubprocessError, which
    jobs.start_worker, catching OSError for a worker that cannot start, let through and the run ended."""
    def refuse(self):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(sandbox.WorkerAccount, "become", refuse)
    monkeypatch.setattr(supervisor, "_give_directory", lambda path, uid: None)
    setup = Setup(definition=definition, solution=Solution(name="x", definition=DEFINITION, author="tests",
                  language="python", entry_point="kernel.py::run"), folder=str(tmp_path), device="cpu",
                  build_dir=str(tmp_path / "build"))
    with pytest.raises(OSError, match="could not start as uid 12345"):
        WorkerProcess.start(setup, DEFAULT_LEVEL, tmp_path / "workers", memory_limit_bytes=None,
                            account=sandbox.WorkerAccount(12345))
    assert left_in(tmp_path / "workers") == []


def test_a_start_that_cannot_make_its_descriptors_leaves_nothing(definition, tmp_path, monkeypatch):
    """Out of descriptors (EMFILE) at the worker's socket: the two pipes made before it stayed open and its exchange
    directory stayed behind."""
    def no_more(*args):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(supervisor, "fd_socket_pair", no_more)
    setup = Setup(definition=definition, solution=Solution(name="x", definition=DEFINITION, author="tests",
                  language="python", entry_point="kernel.py::run"), folder=str(tmp_path), device="cpu",
                  build_dir=str(tmp_path / "build"))
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Too many open files"):
        WorkerProcess.start(setup, DEFAULT_LEVEL, tmp_path / "workers", memory_limit_bytes=None)
    assert left_in(tmp_path / "workers") == []
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_worker_is_told_where_the_repository_is(tmp_path):
    """The repository is hidden from a worker but for the FP8 quantize reference's folder, which its redraws load
    by path: an installed flashbench has no checkout beside it, and the worker's working directory may lie outside
    the repository, so it is told (a reviewer: every FP8 pair failed so)."""
    from types import SimpleNamespace

    told = supervisor._environment(SimpleNamespace(device="cpu"), tmp_path / "build", tmp_path / "repo")
    assert told["FLASHBENCH_ROOT"] == str(tmp_path / "repo") and told["HOME"] == str(tmp_path / "build" / "home")
    assert "FLASHBENCH_ROOT" not in supervisor._environment(SimpleNamespace(device="cpu"), tmp_path / "build", None)


def test_exchange_folders_of_runners_that_are_gone_are_removed(tmp_path):
    """A runner killed (SIGKILL, a second Ctrl-C) left its workers' exchange folders and logs in the cache for
    good. A living runner holds a lock on each of its workers' logs, whatever its pid namespace (by pid, a
    runner in another namespace sharing the cache had its live folders removed): those stay."""
    for name in ("gone", "alive"):
        (tmp_path / f"worker-{name}").mkdir()
        (tmp_path / f"worker-{name}" / "arena").write_text("x")
        (tmp_path / f"worker-{name}.log").write_text("log")
    (tmp_path / "worker-starting").mkdir()  # a runner killed as it made it: its unnamed log unlocked
    (tmp_path / "worker-starting.log-new").write_text("")
    (tmp_path / "worker-stray.log").mkdir()  # no log: left, and no start of a worker ends on it
    held = os.open(tmp_path / "worker-alive.log", os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        supervisor.remove_leftovers(tmp_path)
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-alive", "worker-alive.log", "worker-stray.log"]


def test_a_live_workers_folders_are_left_to_it(start, tmp_path):
    """Another runner sharing the cache (remove_leftovers) leaves a live worker's folders alone, and takes them
    once the runner that held it is gone without closing it."""
    worker = start("")
    supervisor.remove_leftovers(tmp_path / "workers")
    assert worker.exchange_dir.is_dir() and worker.log_path.is_file()
    os.close(worker.log_fd)  # as the runner's death closes it
    worker.log_fd = None
    supervisor.remove_leftovers(tmp_path / "workers")
    assert not worker.exchange_dir.exists() and not worker.log_path.exists()
