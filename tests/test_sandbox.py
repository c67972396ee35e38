"""The worker's sandbox (run/sandbox.py). Each test starts a small probe module through
`worker_command`, as the runner starts its workers, and looks at what the probe could do from the
inside and at what is left on the host afterwards. Tests of the namespaces level skip where
`unshare` does not work."""

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from flashbench.run import sandbox

PROBE = textwrap.dedent(r'''
    """Runs one check (argv[1]) inside the sandbox and prints what it found as JSON; "wait" checks
    print "ready" first and stay until their stdin closes."""
    import ctypes, errno, fcntl, json, os, resource, socket, subprocess, sys, time

    MARKER = "flashbench-sandbox-test"
    libc = ctypes.CDLL(None, use_errno=True)


    def outcome(action):
        """"ok", or the errno name of the OSError it raised."""
        try:
            action()
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))
        return "ok"


    def libc_outcome(call, *args):
        return "ok" if call(*args) == 0 else errno.errorcode[ctypes.get_errno()]


    def write(path, data=b"x"):
        with open(path, "wb") as handle:
            handle.write(data)


    def mount_attempts():
        """Remounting the root writable, unmounting the private /tmp or what keeps sysctls read-only, then
        writing a sysctl."""
        return {"remount": libc_outcome(libc.mount, None, b"/", None, ctypes.c_ulong(0x1000 | 0x20), None),
                "umount": libc_outcome(libc.umount2, b"/tmp", 2),
                "umount_sys": libc_outcome(libc.umount2, b"/proc/sys", 2),
                "sysctl": outcome(lambda: os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY)))}


    def mount_attempts_in_new_namespaces():
        """New namespaces of its own, and the mount attempts again from there (made in a child: they are for
        good)."""
        read, write_end = os.pipe()
        if os.fork() == 0:
            os.close(read)
            pid = libc_outcome(libc.unshare, 0x20000000)  # CLONE_NEWPID, as root of its user namespace
            unshared = libc_outcome(libc.unshare, 0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS
            os.write(write_end, json.dumps({"pid": pid, "unshare": unshared, **mount_attempts()}).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read) as pipe:
            found = json.loads(pipe.read())
        os.wait()
        return found


    def files(host_dir, readable_dir, writable_dir, root_file):
        return {
            "host_dir": outcome(lambda: write(os.path.join(host_dir, "forged"))),
            "root": outcome(lambda: write(root_file)),
            "readable_seen": os.path.exists(os.path.join(readable_dir, "input")),
            "readable": outcome(lambda: write(os.path.join(readable_dir, "forged"))),
            "writable": outcome(lambda: write(os.path.join(writable_dir, "output"))),
            "sysctl": outcome(lambda: os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))),
            "dev_null": outcome(lambda: write("/dev/null")),
            "dev": listing("/dev"),
            "kmsg": outcome(lambda: write("/dev/kmsg")),
            "direct": mount_attempts(),
            "nested": mount_attempts_in_new_namespaces(),
        }


    def writes(host_dir, writable_dir):
        """Writing, making, truncating, removing and renaming away a host folder's files, and writing a
        writable folder."""
        existing = os.path.join(host_dir, "existing")
        return {"new": outcome(lambda: write(os.path.join(host_dir, "forged"))),
                "existing": outcome(lambda: write(existing)),
                "truncate": outcome(lambda: os.truncate(existing, 0)),
                "mkdir": outcome(lambda: os.mkdir(os.path.join(host_dir, "made"))),
                "rename": outcome(lambda: os.rename(existing, os.path.join(writable_dir, "taken"))),
                "remove": outcome(lambda: os.remove(existing)),
                "writable": outcome(lambda: write(os.path.join(writable_dir, "output")))}


    def text(path):
        """A file's text, or the errno name of why it could not be read."""
        found = []
        failed = outcome(lambda: found.append(open(path).read()))
        return found[0] if found else failed


    def listing(path):
        found = []
        failed = outcome(lambda: found.append(sorted(os.listdir(path))))
        return found[0] if found else failed


    def hidden(hidden_dir, needed_dir, writable_dir):
        """What shows of a hidden folder (from its path, and relative to the working directory, which the test
        put inside it), of the folders bound back inside it and of one hidden again inside those."""
        return {"listing": listing(hidden_dir), "secret": text(os.path.join(hidden_dir, "secret")),
                "relative": text("secret"), "parent": listing(".."), "needed": text(os.path.join(needed_dir, "file")),
                "hidden_again": listing(os.path.join(needed_dir, "inner")),
                "write_cover": outcome(lambda: write(os.path.join(hidden_dir, "forged"))),
                "writable": outcome(lambda: write(os.path.join(writable_dir, "output")))}


    def checkout(source_root, hidden_import_dir):
        """What shows of a hidden checkout flashbench runs from and of a hidden folder on the import path:
        the package, imported afresh, and nothing else."""
        try:
            import flashbench.leaderboard.formats
            package = "ok"
        except ImportError as exc:
            package = str(exc)
        return {"package": package, "listing": listing(source_root),
                "pyproject": text(os.path.join(source_root, "pyproject.toml")),
                "git": listing(os.path.join(source_root, ".git")),
                "import_dir": text(os.path.join(hidden_import_dir, "secret"))}


    def pids():
        return {"pid": os.getpid(), "ppid": os.getppid(),
                "proc": sorted(int(name) for name in os.listdir("/proc") if name.isdigit())}


    def mount_type(path):
        with open("/proc/self/mountinfo") as mountinfo:
            types = [line.split(" - ")[1].split()[0] for line in mountinfo if line.split()[4] == path]
        return types[-1]


    def tmp(host_file, host_shm_file, leftover):
        found = {"host_file": os.path.exists(host_file), "host_shm_file": os.path.exists(host_shm_file),
                 "tmp_type": mount_type("/tmp"), "shm_type": mount_type("/dev/shm"), "pts": os.listdir("/dev/pts"),
                 "leftover_before": os.path.exists(leftover), "tmpdir": os.environ.get("TMPDIR"),
                 "sizes": [os.statvfs(p).f_blocks * os.statvfs(p).f_frsize for p in ("/tmp", "/dev/shm")]}
        write(leftover)
        return found


    def limits(writable_dir, size):
        return {"sid": os.getsid(0) == os.getpid(), "core": resource.getrlimit(resource.RLIMIT_CORE),
                "fsize": resource.getrlimit(resource.RLIMIT_FSIZE), "as": resource.getrlimit(resource.RLIMIT_AS),
                "tmpdir": os.environ.get("TMPDIR"),
                "big_write": outcome(lambda: write(os.path.join(writable_dir, "big"), b"x" * (int(size) + 1)))}


    def connect(port):
        return {"connect": outcome(lambda: socket.create_connection(("127.0.0.1", int(port)), timeout=5).close())}


    def connect_unix(path):
        """A host daemon's Unix socket by its path (a read-only mount does not stop connect), with a stream
        socket of its own, with a datagram socket of its own (sendto), and with a datagram socketpair's
        end re-pointed at it; and whether a stream socket and a stream socketpair can still be made (the
        CUDA driver's start needs the one, the arena's descriptor crosses the other)."""
        def stream():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(5)
                client.connect(path)

        def datagram():
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as client:
                client.sendto(b"x", path + ".dgram")

        def datagram_pair():
            one, two = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            with one, two:
                one.sendto(b"x", path + ".dgram")

        def made():
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
            for end in socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET):
                end.close()
        # io_uring's IORING_OP_SOCKET and IORING_OP_CONNECT make the same calls where no filter sees them:
        # with no io_uring, the setup answers ENOSYS (a NULL params pointer otherwise gives EFAULT).
        io_uring = libc_outcome(libc.syscall, ctypes.c_long(425), ctypes.c_long(1), None)
        return {"stream": outcome(stream), "datagram": outcome(datagram), "datagram_pair": outcome(datagram_pair),
                "made": outcome(made), "io_uring": io_uring}


    def environment():
        return dict(os.environ)


    def child(tag):
        """A child that outlives this check, in the same session and process group; running its own
        program (not a fork of this one still) before "ready"."""
        started = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)",
                                    f"{MARKER}-{tag}"], stdout=subprocess.PIPE)
        started.stdout.readline()


    def interpreter():
        """Where this interpreter lives, and whether it can start itself again."""
        again = subprocess.run([sys.executable, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
        return {"prefix": sys.prefix, "again": again.stdout.strip()}


    def write_fifo(path):
        """A host daemon's named pipe by its path: a read-only mount refuses writes to files, not to pipes."""
        def write():
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
        return {"fifo": outcome(write)}


    def refused_calls(writable_dir, port):
        """What the seccomp filter refuses beyond sockets by path: keyrings, a Unix SOCK_RAW socket (a
        datagram socket), TCP Fast Open, leases, set-user-ID and set-group-ID modes."""
        def fast_open():
            with socket.socket() as client:
                client.sendto(b"x", 0x20000000, ("127.0.0.1", int(port)))  # MSG_FASTOPEN

        def lease():
            with open(os.path.join(writable_dir, "leased"), "w"):
                pass
            with open(os.path.join(writable_dir, "leased")) as handle:
                fcntl.fcntl(handle, 1024, fcntl.F_RDLCK)  # F_SETLEASE

        setuid_file = os.path.join(writable_dir, "setuid")
        return {"keyctl": libc_outcome(libc.syscall, ctypes.c_long(250), ctypes.c_long(0), ctypes.c_long(-3)),
                "unix_raw": outcome(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_RAW).close()),
                "fast_open": outcome(fast_open),
                "lease": outcome(lease),
                "create_setuid": outcome(lambda: os.close(os.open(setuid_file, os.O_CREAT | os.O_WRONLY, 0o4755))),
                "create_plain": outcome(lambda: os.close(os.open(setuid_file, os.O_CREAT | os.O_WRONLY, 0o755))),
                "chmod_setgid": outcome(lambda: os.chmod(setuid_file, 0o2755)),
                "open_no_create": outcome(lambda: os.close(os.open(setuid_file, os.O_RDONLY, 0o4755))),
                "chmod_plain": outcome(lambda: os.chmod(setuid_file, 0o700))}


    def capabilities(host_file):
        """The capability sets of this process and of a program it runs, whether it can raise a hard limit of
        its own again (RLIMIT_CORE: the sandbox set it to 0), give a file of the host's to another user, or
        take a real-time priority or a higher one than the runner's (which would starve the judge of CPU)."""
        def sets(status):
            return {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines()
                    if line.startswith(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))}

        def raise_limit():
            try:
                resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except ValueError:  # how Python reports EPERM here
                return "EPERM"
            return "ok"

        child = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                               capture_output=True, text=True, check=True).stdout
        with open("/proc/self/status") as status:
            return {"own": sets(status.read()), "child": sets(child), "raise_limit": raise_limit(),
                    "chown": outcome(lambda: os.chown(host_file, 1, -1)),
                    "realtime": outcome(lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))),
                    "nice": outcome(lambda: os.setpriority(os.PRIO_PROCESS, 0, -5))}


    def udp(port):
        """A datagram to a UDP port of the host's loopback."""
        def send():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
                sender.sendto(b"x", ("127.0.0.1", int(port)))
        return {"udp": outcome(send)}


    def host_reach(runner_pid):
        """At level process: the host's kernel settings, its /dev/shm, and a signal to the runner."""
        return {"core_pattern": outcome(lambda: os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))),
                "dev_shm": outcome(lambda: os.close(os.open("/dev/shm/flashbench-sandbox-test-shm",
                                                            os.O_CREAT | os.O_WRONLY, 0o600))),
                "signal": outcome(lambda: os.kill(int(runner_pid), 0)),
                "dev_null": outcome(lambda: write("/dev/null"))}


    def runner_memory(pid):
        """Opening a process's memory (another process of the same uid, at level process)."""
        return {"mem": outcome(lambda: os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY)))}


    def tasks(root_file, writable_dir):
        """Threads until the kernel refuses one (at most 2000), then a read of a file only root may read, and a
        write in its writable folder."""
        import threading
        release, started = threading.Event(), 0
        try:
            while started < 2000:
                threading.Thread(target=release.wait, daemon=True).start()
                started += 1
        except RuntimeError:  # "can't start new thread"
            pass
        release.set()
        return {"threads": started, "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0],
                "root_file": outcome(lambda: open(root_file).close()),
                "write": outcome(lambda: write(os.path.join(writable_dir, "made")))}


    def cpus():
        """The CPUs it may run on, those a child of a new session may run on, and widening the set again."""
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, start_new_session=True)
        return {"mine": sorted(os.sched_getaffinity(0)), "child": json.loads(child.stdout),
                "widen": outcome(lambda: os.sched_setaffinity(0, range(os.cpu_count())))}


    def cuda_starts():
        """The first CUDA call, as a GPU solution's first launch makes it."""
        import torch
        try:
            torch.zeros(1, device="cuda").add_(1)
            torch.cuda.synchronize()
        except Exception as exc:  # anything the driver says is the finding
            return {"cuda": str(exc).splitlines()[0]}
        return {"cuda": "ok"}


    DAEMON = """
    import os, sys, time
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    open(sys.argv[1] + ".tmp", "w").close()
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(60)
    """


    def daemon(tag, ready_file):
        """A double-forked setsid daemon, started and detached before "ready"."""
        subprocess.run([sys.executable, "-c", DAEMON, ready_file, f"{MARKER}-{tag}"], check=True)
        deadline = time.monotonic() + 30  # the test fails, rather than hangs, if the daemon cannot say it started
        while not os.path.exists(ready_file) and time.monotonic() < deadline:
            time.sleep(0.01)


    if __name__ == "__main__":
        name, args = sys.argv[1], sys.argv[2:]
        if name in ("child", "daemon"):
            globals()[name](*args)
            print("ready", flush=True)
            sys.stdin.read()
        else:
            print(json.dumps(globals()[name](*args)))
''')

LIFETIME_S = 60  # what the probe's children sleep: a sandbox that fails to end them leaves them no longer


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    """The probe module's folder. It lies under /tmp, which the namespaces level covers with a fresh
    tmpfs: the probe imports only because folders on the import path are bound back."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "sandbox_probe.py").write_text(PROBE)
    return folder


@pytest.fixture(params=sandbox.ISOLATION_LEVELS)
def isolation(request) -> str:
    if request.param == "namespaces":
        require_namespaces()
    return request.param


@pytest.fixture
def namespaces() -> str:
    require_namespaces()
    return "namespaces"


def require_namespaces() -> None:
    if sandbox.available_isolation() != "namespaces":
        pytest.skip("the namespaces level is not available here (unshare failed, or FLASHBENCH_ISOLATION=process)")


@pytest.fixture
def stray():
    """Unique host paths (in / or /tmp) that only a broken sandbox would create; removed after the test."""
    paths = []

    def make(folder: str) -> Path:
        paths.append(Path(folder) / f"flashbench-sandbox-test-{uuid.uuid4().hex}")
        return paths[-1]

    yield make
    for path in paths:
        path.unlink(missing_ok=True)


@pytest.fixture
def host_dir():
    """A folder of the host outside /tmp and /dev/shm, which the sandbox shows read-only."""
    if not os.path.isdir("/var/tmp"):
        pytest.skip("no /var/tmp for a folder outside /tmp")
    folder = Path(tempfile.mkdtemp(prefix="flashbench-sandbox-test-", dir="/var/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


SPEC_FILES: list[Path] = []  # one folder for the module's spec files, removed after its tests


@pytest.fixture(scope="module", autouse=True)
def spec_files():
    SPEC_FILES.append(Path(tempfile.mkdtemp(prefix="flashbench-sandbox-specs-")))
    yield
    shutil.rmtree(SPEC_FILES.pop(), ignore_errors=True)


def command(isolation: str, spec: sandbox.SandboxSpec, check: str, *args) -> list[str]:
    fd, name = tempfile.mkstemp(suffix=".json", dir=SPEC_FILES[-1])
    os.close(fd)
    return sandbox.worker_command(isolation, spec.write(Path(name)), "sandbox_probe", [check, *map(str, args)])


def environment(probe_dir: Path, *import_path: str) -> dict[str, str]:
    return sandbox.worker_environment({"PYTHONPATH": os.pathsep.join([str(probe_dir), *import_path])})


def run_probe(probe_dir: Path, isolation: str, spec: sandbox.SandboxSpec, check: str, *args,
              import_path: tuple[str, ...] = ()) -> dict:
    """Runs a check to its end (started as a child of this process: not a session leader)."""
    done = subprocess.run(command(isolation, spec, check, *args), env=environment(probe_dir, *import_path),
                          capture_output=True, text=True, timeout=LIFETIME_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def start_probe(probe_dir: Path, isolation: str, spec: sandbox.SandboxSpec, check: str, *args) -> subprocess.Popen:
    """A probe that stays, once it says "ready", until its stdin closes or end_sandbox ends it."""
    process = subprocess.Popen(command(isolation, spec, check, *args), env=environment(probe_dir), text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits, briefly, for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


# The namespaces level.

def test_only_the_writable_folders_can_be_written_and_mounts_are_locked(probe_dir, namespaces, host_dir, tmp_path,
                                                                         stray):
    readable, writable = tmp_path / "readable", host_dir / "writable"
    readable.mkdir()
    (readable / "input").write_text("for the worker")
    writable.mkdir()
    spec = sandbox.SandboxSpec(writable=(str(writable),), readable=(str(readable),))

    root_file = stray("/")
    found = run_probe(probe_dir, namespaces, spec, "files", host_dir, readable, writable, root_file)

    assert (found["host_dir"], found["root"], found["readable"]) == ("EROFS", "EROFS", "EROFS")
    assert found["readable_seen"]
    assert found["writable"] == "ok" and (writable / "output").exists()
    assert found["sysctl"] == "EROFS"  # root mapped to root could otherwise write the host's sysctls
    assert found["dev_null"] == "ok"
    assert found["direct"] == {"remount": "EPERM", "umount": "EPERM", "umount_sys": "EPERM", "sysctl": "EROFS"}
    # Only the devices a worker needs (no kernel log, console or disk of the host's), and the GPU's where
    # there is one.
    assert set(found["dev"]) - {"fd", "stdin", "stdout", "stderr", "shm", "pts"} <= sandbox.KEPT_DEVICES | {
        name for name in found["dev"] if name.startswith(sandbox.KEPT_DEVICE_PREFIXES)}
    assert "kmsg" not in found["dev"] and found["kmsg"] != "ok"
    nested = found["nested"]
    # No namespace of its own: a process in a PID namespace below the worker's would be one the runner
    # neither stops nor finds left running; and what the worker got stays locked. A PID namespace needs
    # CAP_SYS_ADMIN, which the worker no longer holds; a user namespace needs none, and the limit refuses it.
    assert (nested["pid"], nested["unshare"]) == ("EPERM", "ENOSPC")
    assert (nested["remount"], nested["sysctl"]) == ("EPERM", "EROFS")
    assert nested["umount"] != "ok" and nested["umount_sys"] != "ok"
    assert sorted(os.listdir(host_dir)) == ["writable"] and sorted(os.listdir(readable)) == ["input"]
    assert not root_file.exists()


@pytest.mark.skipif(not sandbox.confines_writes(), reason="the kernel has no Landlock")
def test_only_the_writable_folders_can_be_written_at_level_process_too(probe_dir, host_dir):
    """At level process the file system is the runner's: Landlock keeps the worker's writes, makes,
    removals and renames inside its writable folders."""
    writable = host_dir / "writable"
    writable.mkdir()
    (host_dir / "existing").write_text("the runner's")
    spec = sandbox.SandboxSpec(writable=(str(writable),))

    found = run_probe(probe_dir, "process", spec, "writes", host_dir, writable)

    assert {key: found[key] for key in found if key != "writable"} == dict.fromkeys(
        ["new", "existing", "truncate", "mkdir", "rename", "remove"], "EACCES"), found
    assert found["writable"] == "ok" and (writable / "output").exists()
    assert (host_dir / "existing").read_text() == "the runner's"
    assert sorted(os.listdir(host_dir)) == ["existing", "writable"]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter is installed on x86-64 only")
def test_keyrings_raw_unix_sockets_fast_open_leases_and_setid_modes_are_refused(probe_dir, isolation, tmp_path):
    """Each a way out the filter missed once: the runner's session keyring (inherited through every
    namespace), a Unix SOCK_RAW socket (the kernel makes it a datagram one), TCP Fast Open (connects
    without connect), a lease on a file it can read, and a set-user-ID file of the host's root's."""
    writable = tmp_path / "writable"
    writable.mkdir()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(writable=(str(writable),)), "refused_calls",
                          writable, listener.getsockname()[1])

    assert found["keyctl"] == "EPERM" and found["unix_raw"] == "EACCES" and found["lease"] == "EPERM", found
    assert found["fast_open"] != "ok", found
    assert (found["create_setuid"], found["chmod_setgid"]) == ("EPERM", "EPERM"), found
    # A mode means nothing to an open that creates nothing (and may hold anything there): not refused.
    assert (found["create_plain"], found["chmod_plain"], found["open_no_create"]) == ("ok",) * 3, found


@pytest.mark.skipif(not sandbox.confines_writes(), reason="the kernel has no Landlock")
def test_the_hosts_settings_shm_and_processes_are_out_of_reach_at_level_process(probe_dir):
    shm = Path("/dev/shm/flashbench-sandbox-test-shm")
    try:
        found = run_probe(probe_dir, "process", sandbox.SandboxSpec(), "host_reach", os.getpid())
        made = shm.exists()
    finally:
        shm.unlink(missing_ok=True)

    assert found["core_pattern"] == "EACCES" and found["dev_shm"] == "EACCES" and not made, found
    assert found["dev_null"] == "ok", found
    if sandbox.landlock_abi() >= 6:  # signals scoped to the domain
        assert found["signal"] == "EPERM", found


@pytest.mark.skipif(not sandbox.confines_writes(), reason="the kernel has no Landlock")
def test_the_runners_memory_is_out_of_reach_at_level_process_too(probe_dir):
    """At level process the runner's /proc is visible; Landlock lets no process of its domain reach the
    memory of one outside it (in the PID namespace the runner is not there at all)."""
    found = run_probe(probe_dir, "process", sandbox.SandboxSpec(), "runner_memory", os.getpid())

    assert found["mem"] == "EACCES", found


def test_hidden_folders_show_only_what_is_bound_back_in_them(probe_dir, isolation, host_dir, monkeypatch):
    """A hidden folder (another solution's, the trace directory) is an empty read-only tmpfs inside, but for
    the folders the worker needs from under it; one hidden inside those stays hidden; a working directory
    inside it leads nowhere. At level process nothing is hidden."""
    hidden, needed, writable = host_dir / "hidden", host_dir / "hidden" / "needed", host_dir / "hidden" / "writable"
    (needed / "inner").mkdir(parents=True)
    writable.mkdir()
    for secret in (hidden / "secret", needed / "inner" / "secret"):
        secret.write_text("secret")
    (needed / "file").write_text("needed")
    spec = sandbox.SandboxSpec(writable=(str(writable),), readable=(str(needed),),
                               hidden=(str(hidden), str(needed / "inner")))
    monkeypatch.chdir(hidden)

    found = run_probe(probe_dir, isolation, spec, "hidden", hidden, needed, writable)

    assert (found["needed"], found["writable"]) == ("needed", "ok")
    if isolation == "namespaces":
        assert found["listing"] == ["needed", "writable"]  # the mount points of what is bound back
        assert (found["secret"], found["relative"], found["hidden_again"]) == ("ENOENT", "ENOENT", [])
        assert found["parent"] == sorted(os.listdir(host_dir)) and found["write_cover"] == "EROFS"
        assert sorted(os.listdir(hidden)) == ["needed", "secret", "writable"]
    else:
        assert (found["secret"], found["relative"], found["hidden_again"]) == ("secret", "secret", ["secret"])


@pytest.mark.skipif(sandbox.source_checkout() is None, reason="flashbench runs from an installed package")
def test_a_hidden_checkout_on_the_import_path_shows_the_package_alone(probe_dir, namespaces, host_dir, monkeypatch):
    """The judge hides the checkout flashbench runs from (its git history holds every committed solution
    and trace); a folder on the import path or a tool's path is bound back whole unless it is hidden itself,
    so of the checkout the worker sees only the package it imports, and of another hidden folder on the
    paths nothing."""
    on_path = host_dir / "on_path"
    on_path.mkdir()
    (on_path / "secret").write_text("secret")
    monkeypatch.setenv("PATH", os.pathsep.join([sandbox.SOURCE_ROOT, str(on_path), os.environ["PATH"]]))
    spec = sandbox.SandboxSpec(hidden=(sandbox.SOURCE_ROOT, str(on_path)))

    found = run_probe(probe_dir, namespaces, spec, "checkout", sandbox.SOURCE_ROOT, on_path,
                      import_path=(str(on_path), sandbox.SOURCE_ROOT))

    assert (found["package"], found["listing"]) == ("ok", ["flashbench"]), found
    assert (found["pyproject"], found["git"], found["import_dir"]) == ("ENOENT",) * 3, found


def test_the_runner_is_not_in_the_sandbox_proc(probe_dir, namespaces):
    found = run_probe(probe_dir, namespaces, sandbox.SandboxSpec(), "pids")

    assert (found["pid"], found["ppid"], found["proc"]) == (1, 0, [1])


def test_a_detached_daemon_dies_with_the_sandbox(probe_dir, namespaces, tmp_path):
    tag = uuid.uuid4().hex
    spec = sandbox.SandboxSpec(writable=(str(tmp_path),))
    process = start_probe(probe_dir, namespaces, spec, "daemon", tag, tmp_path / "daemon-ready")
    try:
        inside = sandbox.sandbox_processes(process.pid, namespaces)
        daemons = [pid for pid in inside if tag in command_line(pid)]
        assert len(daemons) == 1 and os.getsid(daemons[0]) != os.getsid(process.pid)
        assert sandbox.worker_pid(process.pid, namespaces) not in inside
    finally:
        sandbox.end_sandbox(process, namespaces)

    assert not any(running(pid) for pid in inside)
    assert process.returncode is not None


def test_tmp_and_shm_are_private_and_vanish_with_the_sandbox(probe_dir, namespaces, tmp_path, stray):
    host_file = tmp_path / "runner-file"
    host_file.write_text("the runner's")
    host_shm_file = stray("/dev/shm")
    host_shm_file.write_text("the runner's")
    leftover = stray("/tmp")
    first = run_probe(probe_dir, namespaces, sandbox.SandboxSpec(), "tmp", host_file, host_shm_file, leftover)
    second = run_probe(probe_dir, namespaces, sandbox.SandboxSpec(), "tmp", host_file, host_shm_file, leftover)

    assert (first["host_file"], first["host_shm_file"]) == (False, False)
    assert (first["tmp_type"], first["shm_type"], first["pts"], first["tmpdir"]) == ("tmpfs", "tmpfs", [], "/tmp")
    assert first["sizes"] == [sandbox.SandboxSpec().tmpfs_bytes] * 2
    assert not leftover.exists() and not second["leftover_before"]


def test_the_private_tmpfs_is_a_sixteenth_of_the_hosts_memory_within_1_and_8_gib(monkeypatch):
    """A just-in-time build (FlashInfer's ninja, an nvcc per core with about 150 MB of temporaries each)
    overflowed 1 GiB on a 16-core GPU host; the tmpfs counts against the host's memory."""
    gib = 1 << 30
    for memory, size in [(4 * gib, gib), (24 * gib, 24 * gib // 16), (128 * gib, 8 * gib), (2048 * gib, 8 * gib)]:
        monkeypatch.setattr(os, "sysconf", lambda name, memory=memory: memory // resource.getpagesize())
        assert sandbox.default_tmpfs_bytes() == size
        assert sandbox.default_tmpfs_bytes(memory) == size
    # A container's limit, where the judge passes one, and not the host's memory: the tmpfs counts against it.
    assert sandbox.default_tmpfs_bytes(64 * gib) == 4 * gib


def test_a_folder_that_cannot_be_bound_fails_the_start_with_one_line(probe_dir, namespaces, tmp_path):
    spec = sandbox.SandboxSpec(writable=(str(tmp_path / "missing"),))
    done = subprocess.run(command(namespaces, spec, "pids"), env=environment(probe_dir), capture_output=True,
                          text=True, timeout=LIFETIME_S)

    assert done.returncode != 0
    assert done.stderr.strip() == f"sandbox: cannot open {tmp_path / 'missing'}: No such file or directory"


def test_the_remount_fallback_makes_the_same_tree(probe_dir, namespaces, host_dir, tmp_path, stray):
    """Kernels before 5.12 lack mount_setattr: each mount point is then remounted read-only, the covers of
    hidden folders included."""
    readable, writable, hidden = tmp_path / "readable", host_dir / "writable", host_dir / "hidden"
    for folder in (readable, writable, hidden):
        folder.mkdir()
    (hidden / "secret").write_text("secret")
    spec = sandbox.SandboxSpec(writable=(str(writable),), readable=(str(readable),), hidden=(str(hidden),))
    boot = textwrap.dedent("""
        import importlib.util, json, os, sys
        spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
        sandbox = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sandbox)
        sandbox._mount_setattr = lambda *args, **kwargs: False
        sandbox.enter(sandbox.SandboxSpec.from_json(sys.argv[2]), "namespaces")
        import sandbox_probe
        hidden = sys.argv[7]
        write = lambda: sandbox_probe.write(os.path.join(hidden, "x"))
        print(json.dumps({**sandbox_probe.files(*sys.argv[3:7]), "hidden": sandbox_probe.listing(hidden),
                          "hidden_write": sandbox_probe.outcome(write)}))
    """)
    argv = [*sandbox.UNSHARE, "--", sys.executable, "-c", boot, sandbox.__file__, spec.to_json(),
            str(host_dir), str(readable), str(writable), str(stray("/")), str(hidden)]
    done = subprocess.run(argv, env=environment(probe_dir), capture_output=True, text=True, timeout=LIFETIME_S)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)

    assert (found["host_dir"], found["root"], found["readable"], found["sysctl"]) == ("EROFS",) * 4
    assert (found["writable"], found["dev_null"]) == ("ok", "ok")
    assert found["direct"] == {"remount": "EPERM", "umount": "EPERM", "umount_sys": "EPERM", "sysctl": "EROFS"}
    assert (found["hidden"], found["hidden_write"]) == ([], "EROFS")


# Both levels.

def test_an_interpreter_installed_under_tmp_still_runs_in_the_sandbox(probe_dir, namespaces, tmp_path):
    """A virtual environment under /tmp (as CI makes one) is bound back, so the worker starts and can run
    its own interpreter again."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    argv = command("namespaces", sandbox.SandboxSpec(), "interpreter")
    argv[argv.index(sys.executable)] = str(venv / "bin" / "python")
    done = subprocess.run(argv, env=environment(probe_dir), capture_output=True, text=True, timeout=LIFETIME_S,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"prefix": str(venv), "again": str(venv)}


def test_a_child_left_running_is_listed_and_ended(probe_dir, isolation):
    tag = uuid.uuid4().hex
    process = start_probe(probe_dir, isolation, sandbox.SandboxSpec(), "child", tag)
    try:
        inside = sandbox.sandbox_processes(process.pid, isolation)
        worker = sandbox.worker_pid(process.pid, isolation)
        assert [tag in command_line(pid) for pid in inside] == [True]
        assert worker is not None and worker not in inside
    finally:
        sandbox.end_sandbox(process, isolation)

    assert not running(inside[0]) and not running(worker)
    assert sandbox.sandbox_processes(process.pid, isolation) == []
    sandbox.end_sandbox(process, isolation)  # twice is fine


def test_limits_and_session(probe_dir, isolation, tmp_path):
    spec = sandbox.SandboxSpec(writable=(str(tmp_path),), file_size_limit_bytes=4096, memory_limit_bytes=8 << 30)
    found = run_probe(probe_dir, isolation, spec, "limits", tmp_path, 4096)

    assert found["sid"]
    assert (found["core"], found["fsize"], found["as"]) == ([0, 0], [4096, 4096], [8 << 30, 8 << 30])
    assert found["big_write"] == "EFBIG"
    assert found["tmpdir"] == ("/tmp" if isolation == "namespaces" else str(tmp_path / "tmp"))


def test_a_worker_and_all_it_starts_keep_to_their_lanes_cpus(probe_dir, isolation):
    """A worker that spun every CPU from many sessions (each an autogroup of the scheduler's) starved another
    lane's worker while it was timed: a red team's honest victim read 20 ms a call against 3.8 ms."""
    share = sorted(os.sched_getaffinity(0))[:1]
    found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(cpus=tuple(share)), "cpus")

    assert found == {"mine": share, "child": share, "widen": "EPERM"}


def test_the_network_is_out_of_reach(probe_dir, isolation):
    """The net namespace holds no route out; at level process the seccomp filter (x86-64) refuses connect."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(), "connect", listener.getsockname()[1])

    assert (found["connect"] == "ok") == (isolation == "process" and os.uname().machine != "x86_64")


def test_the_worker_and_what_it_runs_hold_no_capability(probe_dir, isolation, host_dir):
    """At level process a runner started as root would hand a worker root's powers (raising the hard limits
    the sandbox set, giving the runner's files away, loading a kernel module, raw sockets); at level
    namespaces it is root of its user namespace. Neither it nor a program it runs keeps any capability."""
    (host_dir / "runners").write_text("the runner's")
    found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(), "capabilities", host_dir / "runners")

    for sets in (found["own"], found["child"]):
        assert sets["CapEff"] == sets["CapPrm"] == sets["CapInh"] == sets.get("CapAmb", 0) == 0, found
    assert found["raise_limit"] == "EPERM", found
    assert found["chown"] == ("EROFS" if isolation == "namespaces" else "EPERM"), found
    assert found["realtime"] == "EPERM" and found["nice"] in ("EACCES", "EPERM"), found
    assert (host_dir / "runners").stat().st_uid == os.geteuid()
    if isolation == "namespaces" or os.geteuid() == 0:  # a caller without CAP_SETPCAP keeps its bounding set
        assert found["own"]["CapBnd"] == found["child"]["CapBnd"] == 0, found


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter is installed on x86-64 only")
def test_no_datagram_reaches_the_hosts_network(probe_dir, isolation):
    """Without connect a UDP socket still reaches any address by sendto: at level namespaces the empty net
    namespace has no route; at level process no IP socket can be made."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(), "udp", listener.getsockname()[1])
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.recv(1)

    assert found["udp"] == ("ENETUNREACH" if isolation == "namespaces" else "EACCES"), found


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the seccomp filter is installed on x86-64 only")
def test_a_host_daemons_unix_socket_is_out_of_reach(probe_dir, isolation, host_dir):
    """A pathname Unix socket is no part of the net namespace: one of the runner's daemons (systemd's user
    bus under /run/user, docker.sock, an agent) listening outside the hidden folders would hear the worker,
    as the runner's uid, and could act for it outside the sandbox."""
    stream_path = str(host_dir / "daemon.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as datagrams:
        listener.bind(stream_path)
        listener.listen()
        datagrams.bind(stream_path + ".dgram")
        found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(), "connect_unix", stream_path)

    assert (found["stream"], found["datagram"], found["datagram_pair"]) == ("EACCES",) * 3, found
    assert found["made"] == "ok" and found["io_uring"] == "ENOSYS", found


def test_a_host_daemons_named_pipe_is_out_of_reach(probe_dir, isolation, host_dir):
    """A named pipe, like a socket, is an endpoint in the file system that a read-only mount leaves open
    for writing: a daemon of the runner's uid reading one would take the worker's words as the runner's."""
    path = str(host_dir / "daemon.fifo")
    os.mkfifo(path, 0o600)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(), "write_fifo", path)
        heard = os.read(reader, 16)
    finally:
        os.close(reader)

    assert heard == b"" and found["fifo"] != "ok", found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_driver_starts_in_the_sandbox(probe_dir, isolation):
    """Every rule of the sandbox leaves the CUDA driver able to start: it failed with error 304 in every
    worker while the seccomp filter refused socket(AF_UNIX), which the driver opens at its start."""
    found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(), "cuda_starts")

    assert found["cuda"] == "ok", found


def test_a_pth_file_planted_in_the_workers_home_never_runs(probe_dir, isolation, tmp_path):
    """The worker's HOME is its build folder, which it may write and which lasts: a .pth file it plants
    in the user site-packages there must not run when the next worker's interpreter starts (before
    its sandbox exists)."""
    home, evidence = tmp_path / "home", tmp_path / "pth-ran"
    planted = home / ".local" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    planted.mkdir(parents=True)
    (planted / "planted.pth").write_text(f"import pathlib; pathlib.Path({str(evidence)!r}).touch()\n")
    environment = sandbox.worker_environment({"PYTHONPATH": str(probe_dir), "HOME": str(home)})
    done = subprocess.run(command(isolation, sandbox.SandboxSpec(), "environment"), env=environment,
                          capture_output=True, text=True, timeout=LIFETIME_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["HOME"] == str(home)
    assert not evidence.exists()


def test_the_worker_gets_an_allow_listed_environment(probe_dir, isolation, monkeypatch):
    monkeypatch.setenv("FLASHBENCH_SECRET_TEST", "secret")
    monkeypatch.setenv("XDG_CACHE_HOME", "/runner/cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/runner/triton")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    for name in ("NVIDIA_API_KEY", "TRITON_SERVER_TOKEN", "NVIDIA_NGC_Password"):  # allowed prefixes, secret names
        monkeypatch.setenv(name, "secret")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    found = run_probe(probe_dir, isolation, sandbox.SandboxSpec(), "environment")

    assert "FLASHBENCH_SECRET_TEST" not in found and "XDG_CACHE_HOME" not in found
    assert "TRITON_CACHE_DIR" not in found and "HOME" not in found
    assert "secret" not in found.values() and found["TRITON_INTERPRET"] == "0"
    assert found["CUDA_VISIBLE_DEVICES"] == "1" and found["PATH"] == os.environ["PATH"]
    assert found["PYTHONPATH"] == str(probe_dir)  # the extra on top


# Choosing and describing.

def test_the_isolation_variable_forces_the_process_level(monkeypatch):
    monkeypatch.setenv(sandbox.ISOLATION_VARIABLE, "process")
    assert sandbox.available_isolation() == "process"
    monkeypatch.setenv(sandbox.ISOLATION_VARIABLE, "chroot")
    with pytest.raises(ValueError, match="FLASHBENCH_ISOLATION='chroot' is not one of namespaces, process"):
        sandbox.available_isolation()


def test_namespaces_asked_for_where_unshare_fails(monkeypatch):
    monkeypatch.setattr(sandbox, "_namespaces_problem", lambda: "unshare failed: Operation not permitted")
    monkeypatch.delenv(sandbox.ISOLATION_VARIABLE, raising=False)
    assert sandbox.available_isolation() == "process"
    monkeypatch.setenv(sandbox.ISOLATION_VARIABLE, "namespaces")
    with pytest.raises(sandbox.SandboxError, match="namespaces, but unshare failed: Operation not permitted"):
        sandbox.available_isolation()


def test_the_spec_crosses_in_a_file_unchanged_however_many_folders_it_names(tmp_path):
    """A spec names every folder a solution came from: in the command line, 50 long shared folders passed
    the 128 KiB a string of it may have, and the worker could not start (E2BIG), which took its device out."""
    hidden = tuple(f"/{'d' * 4000}/{k}" for k in range(50))
    spec = sandbox.SandboxSpec(writable=("/a", "/b"), readable=("/c",), hidden=hidden, memory_limit_bytes=1 << 33,
                               tmpfs_bytes=1 << 20)
    spec_file = spec.write(tmp_path / "sandbox.json")
    assert sandbox.SandboxSpec.from_json(spec_file.read_text()) == spec
    command = sandbox.worker_command("namespaces", spec_file, "flashbench.run.worker", ["3", "4"])
    assert command[:command.index("--")] == sandbox.UNSHARE
    assert command[-5:] == [str(spec_file), "namespaces", "flashbench.run.worker", "3", "4"]
    assert max(map(len, command)) < 4096
    with pytest.raises(ValueError, match="unknown isolation level 'chroot'"):
        sandbox.worker_command("chroot", spec_file, "flashbench.run.worker", [])


def test_remove_tree_takes_a_folder_deeper_than_the_stack_and_path_max(tmp_path):
    """A worker nested 3000 folders in its exchange directory: shutil.rmtree recursed into a RecursionError
    that ended the run. Links are removed, never followed; an unreadable folder is still emptied."""
    top = tmp_path / "exchange"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_text("x")
    fd = os.open(tmp_path, os.O_RDONLY)
    os.mkdir("exchange", dir_fd=fd)
    current = os.open("exchange", os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    for _ in range(3000):  # relative to an open folder: the whole path would be past PATH_MAX
        os.mkdir("d", dir_fd=current)
        os.symlink(str(outside), "link", dir_fd=current)
        deeper = os.open("d", os.O_RDONLY, dir_fd=current)
        os.close(current)
        current = deeper
    os.close(current)
    (top / "locked").mkdir()
    (top / "locked" / "f").write_text("x")
    (top / "locked").chmod(0)
    sandbox.remove_tree(top)
    assert not top.exists() and (outside / "kept").read_text() == "x"
    sandbox.remove_tree(top)  # nothing there: no error


def test_remove_tree_follows_no_link_swapped_in_for_a_folder_half_way(tmp_path, monkeypatch):
    """At level process a daemon of the worker's outlives it: it swapped the folder remove_tree had just
    moved up for a link to another folder, and the runner emptied that one for it."""
    top, victim = tmp_path / "exchange", tmp_path / "victim"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_text("x")
    victim.mkdir()
    (victim / "precious").write_text("kept")
    victim.chmod(0o750)
    real_rename = os.rename

    def rename_then_swap(source, target, **folders):
        real_rename(source, target, **folders)
        moved = os.path.join(top, target)
        if os.path.isdir(moved) and not os.path.islink(moved):
            real_rename(moved, tmp_path / "taken")  # the daemon takes the folder away and leaves a link
            os.symlink(victim, moved)
    monkeypatch.setattr(os, "rename", rename_then_swap)

    sandbox.remove_tree(top)

    assert (victim / "precious").read_text() == "kept" and sorted(os.listdir(victim)) == ["precious"]
    assert victim.stat().st_mode & 0o777 == 0o750  # not made the runner's own either
    assert not top.exists()


# A root runner's workers, as a uid of their own.

@pytest.fixture
def worker_uid(monkeypatch) -> int:
    """The worker uid, with an interpreter it can start (the tests' own may lie in root's home): the probe and
    the sandbox need the standard library alone."""
    if os.geteuid() != 0:
        pytest.skip("only a root runner runs its workers as a uid of their own")
    uid = sandbox.configured_worker_uid()
    for interpreter in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            started = subprocess.run([interpreter, "-c", ""], capture_output=True, timeout=60,
                                     **sandbox.WorkerAccount(uid).popen_options())
        except OSError:  # missing, or in a folder the uid cannot reach
            continue
        if started.returncode == 0:
            monkeypatch.setattr(sys, "executable", interpreter)
            return uid
    pytest.skip(f"no interpreter here that uid {uid} can start")


@pytest.fixture
def open_dir():
    """A folder every uid may read, outside /tmp (pytest's folders are root's alone)."""
    if not os.path.isdir("/var/tmp"):
        pytest.skip("no /var/tmp")
    folder = Path(tempfile.mkdtemp(prefix="flashbench-sandbox-test-", dir="/var/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_root_runners_worker_runs_as_its_own_uid_and_its_threads_are_counted(worker_uid, open_dir, isolation):
    """RLIMIT_NPROC spares root, and root mapped to root is root to the kernel: a worker that took every
    thread the kernel would give left the judge's other lanes none."""
    probe, writable, secret = open_dir / "probe", open_dir / "writable", open_dir / "secret"
    probe.mkdir()
    (probe / "sandbox_probe.py").write_text(PROBE)
    writable.mkdir()
    os.chown(writable, worker_uid, worker_uid)
    secret.write_text("root's")
    secret.chmod(0o600)
    spec = sandbox.SandboxSpec(writable=(str(writable),), readable=(str(probe),), task_limit=64)
    argv = sandbox.worker_command(isolation, spec.write(open_dir / "spec.json"), "sandbox_probe",
                                  ["tasks", str(secret), str(writable)])
    done = subprocess.run(argv, env=environment(probe), capture_output=True, text=True, timeout=LIFETIME_S,
                          stdin=subprocess.DEVNULL, **sandbox.WorkerAccount(worker_uid).popen_options())
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)

    assert found["nproc"] == 64 and 0 < found["threads"] < 64
    assert (found["root_file"], found["write"]) == ("EACCES", "ok")
    assert (writable / "made").stat().st_uid == worker_uid


def test_a_root_runners_workers_get_their_own_uid_only_where_it_reaches_all_they_need(worker_uid, open_dir,
                                                                                      monkeypatch):
    monkeypatch.setattr(sandbox, "WORKER_PACKAGES", ())  # the probing interpreter's packages are not the point
    sandbox._root_runner_account.cache_clear()
    closed = open_dir / "closed"
    closed.mkdir(mode=0o700)
    try:
        reached = sandbox.worker_account("process", (str(open_dir / "cache"),))
        refused = sandbox.worker_account("process", (str(closed / "cache"),))
        monkeypatch.setattr(sandbox, "_umask", lambda: 0o077)
        strict = sandbox.worker_account("process", (str(open_dir / "other"),))
    finally:
        sandbox._root_runner_account.cache_clear()

    assert reached == sandbox.WorkerAccount(worker_uid, counts_tasks=True)
    assert refused.uid is None and refused.why == f"uid {worker_uid}: cannot read {closed}"
    assert strict.uid is None and "umask 077" in strict.why
    assert refused.describe().startswith("as root, their threads uncounted: ")


def test_a_runner_that_is_not_root_keeps_its_uid_and_counts_tasks_in_a_user_namespace(monkeypatch):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)

    assert sandbox.worker_account("namespaces", ()) == sandbox.WorkerAccount(None, counts_tasks=True)
    assert sandbox.worker_account("process", ()) == sandbox.WorkerAccount(None)
    assert sandbox.WorkerAccount(None).describe() == "as the runner's uid 1000"
    assert sandbox.WorkerAccount(None).popen_options() == {}


def test_a_worker_uid_asked_for_that_cannot_serve_stops_the_run_not_runs_workers_as_root(monkeypatch):
    """Without FLASHBENCH_WORKER_UID a root runner whose default uid reaches too little runs its workers as root
    (and says so); an operator who named a uid gets that uid or a refusal naming why, never root."""
    monkeypatch.setattr(sandbox, "_reach_problem", lambda uid, reachable: "cannot read /opt/venv")
    monkeypatch.setattr(sandbox, "_umask", lambda: 0o022)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    sandbox._root_runner_account.cache_clear()
    try:
        monkeypatch.delenv(sandbox.WORKER_UID_VARIABLE, raising=False)
        fallback = sandbox.worker_account("process", ())
        monkeypatch.setenv(sandbox.WORKER_UID_VARIABLE, "4242")
        with pytest.raises(sandbox.SandboxError, match="^FLASHBENCH_WORKER_UID=4242, but cannot read /opt/venv; "):
            sandbox.worker_account("process", ())
    finally:
        sandbox._root_runner_account.cache_clear()
    assert fallback.uid is None and "cannot read /opt/venv" in fallback.why


@pytest.mark.parametrize("text", ["0", "-5", "root", str(2**32 - 1)])
def test_a_worker_uid_that_is_no_uid_is_refused_in_one_line(monkeypatch, text):
    monkeypatch.setenv(sandbox.WORKER_UID_VARIABLE, text)

    with pytest.raises(ValueError, match=sandbox.WORKER_UID_VARIABLE):
        sandbox.configured_worker_uid()


@pytest.mark.parametrize("pid_max, threads_max, lanes, expected", [
    (4194304, 1000000, 1, 4096),  # a large host: the limit itself
    (32768, 193107, 1, 4096),
    (32768, 193107, 8, 2048),  # eight lanes of 4096 took a host of pid_max 32768 to its last PIDs
    (32768, 20000, 4, 2500),  # threads-max the lower
    (4096, 193107, 16, sandbox.MIN_TASK_LIMIT),  # never below what a worker needs
])
def test_all_lanes_sandboxes_together_take_at_most_half_the_hosts_tasks(monkeypatch, pid_max, threads_max, lanes,
                                                                         expected):
    numbers = {"/proc/sys/kernel/pid_max": pid_max, "/proc/sys/kernel/threads-max": threads_max}
    monkeypatch.setattr(sandbox, "_kernel_number", numbers.__getitem__)

    assert sandbox.WorkerAccount(1 << 30, counts_tasks=True).task_limit(lanes) == expected
    assert sandbox.WorkerAccount(None).task_limit(lanes) is None  # root's tasks: never counted
