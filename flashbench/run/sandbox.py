"""The sandbox of a worker, the only process that imports solution code.

Two levels, strongest first:
- "namespaces": the worker starts under `unshare` in new user (root mapped), PID, mount, network
  and IPC namespaces. It is PID 1 of its PID namespace, so when it dies the kernel kills every
  process it started, daemons included. Before running anything else it makes the whole file tree
  read-only (/sys and the kernel's settings under /proc included: as root mapped to root it could
  otherwise write the host's sysctls), allows no namespace below its own but one user namespace,
  puts a /dev of a few devices in place, fresh tmpfs on /tmp, /dev/shm and /dev/pts and an empty
  read-only one on each directory it has no business reading (the repository's solutions, the trace
  and cache directories, the runner's home), binds back the directories it needs from under those
  (its staged solution, the interpreter) and the ones it may write (its exchange and build
  directories), and then enters a nested user namespace, which cannot remount or unmount what its
  parent set up.
- "process": a session and process group of its own, and rlimits. Daemons can escape it.

At both levels a root runner's workers run as a uid of their own where it can reach what they need
(WorkerAccount): they own nothing of the host's but their exchange and build directories, and the kernel
counts their tasks (RLIMIT_NPROC spares root).

At both levels the worker then holds no capability (none effective, permitted, inheritable, ambient or
in its bounding set): at level process a runner started as root would otherwise hand the solution
root's powers (raising its own hard limits again, loading kernel modules, raw sockets), and at level
namespaces root of the user namespace would keep them over what that namespace owns.

Stdlib only: this file also runs as a script (`python sandbox.py SPEC ISOLATION MODULE ARGS...`)
that enters the sandbox before anything else is imported, then runs MODULE as __main__.
"""

import contextlib
import ctypes
import dataclasses
import errno
import functools
import json
import os
import resource
import runpy
import signal
import site
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ISOLATION_LEVELS = ("namespaces", "process")  # strongest first
ISOLATION_VARIABLE = "FLASHBENCH_ISOLATION"
UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
           "--net", "--ipc"]
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(SOURCE_ROOT, "flashbench")
REAP_TIMEOUT_S = 10.0
WORKER_UID_VARIABLE = "FLASHBENCH_WORKER_UID"
OOM_SCORE_ADJ_MAX = 1000  # /proc/PID/oom_score_adj: the OOM killer's first choice
# No account's or container's: systemd gives users, its dynamic users and containers' uids below it. A root
# runner's workers run as it: they own nothing of the host's, and the kernel counts their tasks (RLIMIT_NPROC
# spares root's).
DEFAULT_WORKER_UID = 0x70000000
# RLIMIT_NPROC: the processes and threads of one sandbox. A worker that took every task the kernel would give
# left the judge's other lanes none (their OpenMP threads failed, and ended the runner). A CUDA build runs an
# nvcc per core, each a few processes; a CPU worker a thread per core. Less where the host's limits are low
# (task_limit).
TASK_LIMIT = 4096
MIN_TASK_LIMIT = 256
WORKER_PACKAGES = ("torch", "pydantic")  # what a worker imports from the interpreter's site-packages
DU_TIMEOUT_S = 60.0
DEAD_STATES = ("Z", "X")  # /proc/PID/stat states of a thread that has ended

# Covered by fresh tmpfs inside: whatever the worker needs from under them is bound back.
COVERED = ("/tmp", "/dev/shm")
# The sandbox's /dev: these devices of the host's, and the GPU's (nvidia0, nvidiactl, nvidia-uvm,
# nvidia-caps/ ...), as a container runtime binds them; and links a shell or a library may expect.
KEPT_DEVICES = frozenset({"null", "zero", "full", "random", "urandom"})
KEPT_DEVICE_PREFIXES = ("nvidia",)
DEVICE_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                "stderr": "/proc/self/fd/2"}
# Namespaces that may still be made inside: the nested user namespace that locks the mounts, no other.
NAMESPACE_LIMITS = {"max_user_namespaces": 1, "max_pid_namespaces": 0, "max_mnt_namespaces": 0,
                    "max_net_namespaces": 0, "max_ipc_namespaces": 0, "max_uts_namespaces": 0,
                    "max_cgroup_namespaces": 0, "max_time_namespaces": 0}
# Read-only inside a /proc that is otherwise writable again (as a container runtime keeps them).
KERNEL_SETTINGS = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")

# The worker's environment: toolchains, devices, threads; nothing that could hold a secret or point
# at the runner's files (HOME, XDG_*, caches: the caller gives the worker its own).
ALLOWED_VARIABLES = frozenset({
    "PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV",
    "CONDA_PREFIX", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME", "CUDA_PATH",
    "TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "CC", "CXX", "CUDAHOSTCXX", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
})
ALLOWED_PREFIXES = ("NVIDIA_", "TRITON_", "OPENBLAS_")
DENIED_VARIABLES = frozenset({"TRITON_HOME"})  # and every *_DIR: directories are the caller's to set
# Denied whatever their prefix: a name that says it holds a credential (NVIDIA_API_KEY, a common one on
# NVIDIA's machines, passed the prefixes, and a red team's worker printed it into its trace's message).
SECRET_NAME_PARTS = ("KEY", "TOKEN", "SECRET", "PASSW", "CREDENTIAL", "AUTH", "COOKIE", "PRIVATE", "CERT")
# Directories of tools and libraries (os.pathsep-separated lists): they stay visible inside a hidden directory.
TOOLCHAIN_VARIABLES = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH")

# Linux ABI (mount.h, sched.h, fcntl.h). mount_setattr has the same number on every architecture.
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 0x20, 0x400, 0x800, 0x1000, 0x4000
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
CLONE_NEWUSER = 0x10000000
SYS_MOUNT_SETATTR = 442
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 0x1
REMOUNT_KEPT_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                        "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}


# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h; x86-64 syscall numbers).
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
AUDIT_ARCH_X86_64, X32_SYSCALL_BIT = 0xC000003E, 0x40000000
BPF_AND_K = 0x54
AF_VSOCK, SOCKET_TYPE_MASK = 40, 0xF  # socket.h: SOCK_NONBLOCK and SOCK_CLOEXEC share the type's word
# Capabilities (linux/prctl.h, linux/capability.h).
PR_CAPBSET_READ, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 23, 24, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
MSG_FASTOPEN, F_SETLEASE, SETID_BITS = 0x20000000, 1024, stat.S_ISUID | stat.S_ISGID
O_TMPFILE_BIT = 0o20000000  # fcntl.h: O_TMPFILE is this bit with O_DIRECTORY
# Landlock (linux/landlock.h; the system call numbers are the same on every architecture): the rights that
# write, make, remove or rename (ABI 1), cross-directory renames and links (ABI 2), truncate (ABI 3).
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
LANDLOCK_WRITES = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
LANDLOCK_REFER, LANDLOCK_TRUNCATE = 1 << 13, 1 << 14
LANDLOCK_FILE_RIGHTS = (1 << 1) | LANDLOCK_TRUNCATE  # of these, what a rule for one file may hold: write, truncate
LANDLOCK_SCOPES = (1 << 0) | (1 << 1)  # ABI 6: abstract Unix sockets and signals stay inside the domain
# (syscall number, conditions (argument, mask or None, value) that must all hold, errno returned): the
# calls that name SIGCONT (kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo,
# pidfd_send_signal; fcntl F_SETSIG, prctl PR_SET_PDEATHSIG, clone's exit signal), and ptrace. clone3 takes
# its exit signal in memory a filter cannot read: ENOSYS makes the C library fall back to clone.
SECCOMP_RULES = [
    *((number, [(argument, None, signal.SIGCONT)], errno.EPERM)
      for number, argument in ((62, 1), (200, 1), (234, 2), (129, 1), (297, 2), (424, 1))),
    (72, [(1, None, 10), (2, None, signal.SIGCONT)], errno.EPERM),  # fcntl(fd, F_SETSIG, SIGCONT)
    (157, [(0, None, 1), (1, None, signal.SIGCONT)], errno.EPERM),  # prctl(PR_SET_PDEATHSIG, SIGCONT)
    (56, [(0, 0xFF, signal.SIGCONT)], errno.EPERM),  # clone with SIGCONT as the exit signal
    (435, [], errno.ENOSYS),  # clone3
    (101, [], errno.EPERM),  # ptrace
    # Unix sockets by path: a net namespace does not hold them, and a read-only mount does not stop a
    # connect, so a daemon of the runner's uid (systemd's user bus, docker.sock, an agent) listening outside
    # the hidden folders would hear the worker as the runner. A socket reaches an address by connect, or,
    # for datagrams, by sendto on its own: no connect at all, no Unix datagram socket (socket or
    # socketpair), no AF_VSOCK (the host of a VM, no namespace holds it), and no io_uring, whose socket and
    # connect operations are no system calls a filter sees. socket(AF_UNIX) itself must stay: the CUDA
    # driver's start fails (error 304) where it is refused, and goes on where its connect is.
    (42, [], errno.EACCES),  # connect
    # A Unix socket of any type but stream and seqpacket is a datagram socket (the kernel makes SOCK_RAW one).
    *((number, [(0, None, socket.AF_UNIX), (1, SOCKET_TYPE_MASK, kind)], errno.EACCES)
      for number in (41, 53) for kind in range(SOCKET_TYPE_MASK + 1)  # socket, socketpair
      if kind not in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET)),
    (41, [(0, None, AF_VSOCK)], errno.EACCES),
    (425, [], errno.ENOSYS),  # io_uring_setup
    # TCP Fast Open: sendto, sendmsg or sendmmsg with MSG_FASTOPEN connects without connect (level process).
    *((number, [(argument, MSG_FASTOPEN, MSG_FASTOPEN)], errno.EACCES)
      for number, argument in ((44, 3), (46, 2), (307, 3))),  # sendto, sendmsg, sendmmsg
    # Keyrings: the session keyring is inherited through every namespace, and the user keyring is shared at
    # level process: a store of the runner's secrets and a channel between pairs.
    *((number, [], errno.EPERM) for number in (248, 249, 250)),  # add_key, request_key, keyctl
    (72, [(1, None, F_SETLEASE)], errno.EPERM),  # a lease stalls another process's open of the file for 45 s
    # No set-user-ID or set-group-ID file: root mapped to root makes it the host's root's, in a build dir
    # that lasts (chmod, fchmod, fchmodat, fchmodat2, creat, mknod, mknodat; open and openat where they
    # create, since their mode argument means nothing otherwise).
    *((number, [(argument, SETID_BITS, bits)], errno.EPERM)
      for number, argument in ((90, 1), (91, 1), (268, 2), (452, 2), (85, 1), (133, 1), (259, 2))
      for bits in (stat.S_ISUID, stat.S_ISGID, SETID_BITS)),
    *((number, [(flags, creating, creating), (flags + 1, SETID_BITS, bits)], errno.EPERM)
      for number, flags in ((2, 1), (257, 2)) for creating in (os.O_CREAT, O_TMPFILE_BIT)
      for bits in (stat.S_ISUID, stat.S_ISGID, SETID_BITS)),
    (437, [], errno.ENOSYS),  # openat2: its mode is in memory a filter cannot read; the C library does not use it
    # No way out of its lane's CPUs (SandboxSpec.cpus): sched_setaffinity would widen the set the sandbox set.
    (203, [], errno.EPERM),
]
# At level process only, where the network is the host's (at level namespaces an empty net namespace holds
# none): no IP socket at all. Without connect a TCP socket reaches nothing, but a UDP one reaches any host
# by sendto, and one bound to a port is a channel between two workers that run at once.
PROCESS_LEVEL_RULES = [(number, [(0, None, family)], errno.EACCES)
                       for number in (41, 53) for family in (socket.AF_INET, socket.AF_INET6)]  # socket, socketpair


class SandboxError(Exception):
    """The sandbox could not be set up."""


def default_tmpfs_bytes(memory: int | None = None) -> int:
    """The private /tmp's size (and /dev/shm's): a sixteenth of `memory` (the judge passes what the runner may
    use, a container's limit where lower; else the host's), which the tmpfs counts against, within 1 and 8 GiB.
    A just-in-time build may need more than 1 GiB: FlashInfer's ninja runs an nvcc per core, each with about
    150 MB of temporaries for its fa3 prefill kernels."""
    page = resource.getpagesize()
    if memory is None:
        try:
            memory = os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):
            return 1 << 30
    return max(1 << 30, min(8 << 30, memory // page // 16 * page))  # whole pages: the size the kernel gives


@dataclass(frozen=True)
class SandboxSpec:
    writable: tuple[str, ...] = ()  # absolute directories the worker may write (exchange dir, build dir)
    readable: tuple[str, ...] = ()  # directories it must see though they lie under /tmp, /dev/shm or a hidden one
    hidden: tuple[str, ...] = ()  # directories it must not read (namespaces level): empty inside, but for the above
    memory_limit_bytes: int | None = None  # RLIMIT_AS when set (CPU workers)
    file_size_limit_bytes: int = 1 << 30  # RLIMIT_FSIZE
    task_limit: int | None = None  # RLIMIT_NPROC when set, where it counts the sandbox's tasks alone
    # The host CPUs the worker and all it starts may run on (its lane's share), None: any. A worker of one lane
    # that spun the CPUs from many sessions (each an autogroup of its own) starved another lane's worker and judge
    # while they timed another solution (a red team: 5x on the victim's ranked figure, both PASSED).
    cpus: tuple[int, ...] | None = None
    tmpfs_bytes: int = dataclasses.field(default_factory=default_tmpfs_bytes)  # private /tmp and /dev/shm (namespaces)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SandboxSpec":
        data = json.loads(text)
        return cls(**{key: tuple(value) if isinstance(value, list) else value for key, value in data.items()})

    def write(self, path: Path) -> Path:
        """The spec in a file, for worker_command: its size grows with the folders a solution names, and
        a string of the command line may not pass 128 KiB (execve's E2BIG)."""
        path.write_text(self.to_json())
        return path


# Choosing and starting.

def available_isolation() -> str:
    """The strongest level this machine allows, or the one FLASHBENCH_ISOLATION asks for."""
    requested = os.environ.get(ISOLATION_VARIABLE, "")
    if requested and requested not in ISOLATION_LEVELS:
        raise ValueError(f"{ISOLATION_VARIABLE}={requested!r} is not one of {', '.join(ISOLATION_LEVELS)}")
    if requested == "process":
        return "process"
    problem = _namespaces_problem()
    if problem is None:
        return "namespaces"
    if requested == "namespaces":
        raise SandboxError(f"{ISOLATION_VARIABLE}=namespaces, but {problem}")
    return "process"


@functools.cache
def _namespaces_problem(uid: int | None = None) -> str | None:
    """Why `unshare` cannot start a worker here (run as `uid`, or as this process), or None when it can."""
    try:
        probe = subprocess.run([*UNSHARE, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, timeout=30, **WorkerAccount(uid).popen_options())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare cannot run: {exc}"
    if probe.returncode != 0:
        return f"unshare failed: {_failure_line(probe)}"
    if not os.path.exists("/proc/sys/user/max_pid_namespaces"):
        return "the kernel has no per-namespace limits (/proc/sys/user, Linux 4.9)"
    return None


@dataclass(frozen=True)
class WorkerAccount:
    """Who a run's workers run as: `uid`, or this process's uid when None (`why` says why, for a root
    runner). `counts_tasks`: RLIMIT_NPROC counts the sandbox's tasks alone."""
    uid: int | None
    why: str = ""
    counts_tasks: bool = False

    def task_limit(self, lanes: int) -> int | None:
        """RLIMIT_NPROC for each sandbox of a run over `lanes` lanes, where it counts the sandbox's tasks: all
        the lanes' sandboxes together at most half the tasks the host has (its pid_max and threads-max; a
        task in a PID namespace takes a PID of the host's too). Eight lanes of 4096 threads each took a host
        of pid_max 32768 to its last PIDs, and the judge could fork nothing."""
        if not self.counts_tasks:
            return None
        host = min(_kernel_number("/proc/sys/kernel/pid_max"), _kernel_number("/proc/sys/kernel/threads-max"))
        return max(MIN_TASK_LIMIT, min(TASK_LIMIT, host // (2 * max(lanes, 1))))

    def popen_options(self) -> dict:
        """subprocess.Popen's arguments that start a process as `uid`, in its own group and no other."""
        return {} if self.uid is None else {"user": self.uid, "group": self.uid, "extra_groups": []}

    def become(self) -> None:
        """In a started process before exec: take on `uid` as popen_options would have Popen do it."""
        if self.uid is not None:
            os.setgroups([])
            os.setregid(self.uid, self.uid)
            os.setreuid(self.uid, self.uid)

    def describe(self) -> str:
        if self.uid is not None:
            return f"as uid {self.uid}"
        if os.geteuid() == 0:
            return f"as root, their threads uncounted: {self.why}"
        return f"as the runner's uid {os.geteuid()}"


def worker_account(isolation: str, reachable: tuple[str, ...]) -> WorkerAccount:
    """A root runner's workers run as a uid of their own (WORKER_UID_VARIABLE, else DEFAULT_WORKER_UID)
    where that uid can reach all a worker needs: the interpreter's packages, this source tree, and the
    `reachable` directories (the cache, where the runner stages solutions and makes build directories).
    Otherwise as root, unless WORKER_UID_VARIABLE names the uid (then SandboxError saying why it cannot serve);
    for a runner that is not root, as the runner's uid. RLIMIT_NPROC counts the sandbox's
    tasks alone where the uid is its own, and in a user namespace of its own (namespaces) but for root,
    which the kernel never counts."""
    if os.geteuid() != 0:
        return WorkerAccount(None, counts_tasks=isolation == "namespaces")
    reachable = tuple(os.path.abspath(path) for path in (SOURCE_ROOT, *reachable))
    asked = bool(os.environ.get(WORKER_UID_VARIABLE))
    return _root_runner_account(isolation, reachable, configured_worker_uid(), asked)


@functools.cache
def _root_runner_account(isolation: str, reachable: tuple[str, ...], uid: int, asked: bool) -> WorkerAccount:
    """`uid` where it can serve; where it cannot, root, unless it was `asked` for (then SandboxError)."""
    umask = _umask()
    problem = f"the runner's umask {umask:03o} keeps other users out of what it stages" if umask & 0o005 else \
        _reach_problem(uid, reachable) or (_namespaces_problem(uid) if isolation == "namespaces" else None)
    if problem and asked:  # never root instead of a uid named
        raise SandboxError(f"{WORKER_UID_VARIABLE}={uid}, but {problem}; unset it to run workers as root")
    if problem:
        return WorkerAccount(None, f"uid {uid}: {problem}")
    return WorkerAccount(uid, counts_tasks=True)


def configured_worker_uid() -> int:
    text = os.environ.get(WORKER_UID_VARIABLE, "")
    if not text:
        return DEFAULT_WORKER_UID
    if not text.isdigit() or not 0 < int(text) < 2**32 - 1:
        raise ValueError(f"{WORKER_UID_VARIABLE}={text!r} is no uid (a number from 1 to {2**32 - 2})")
    return int(text)


def _kernel_number(path: str) -> int:
    try:
        return int(Path(path).read_text())
    except (OSError, ValueError):
        return 1 << 22  # Linux's largest pid_max


def _umask() -> int:
    """This process's umask, read without changing it (another thread may be making files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o077  # unknown: take it for the strictest


REACH_PROBE = """
import importlib.util, os, sys
for path in sys.argv[2:]:
    if not os.access(path, os.R_OK | os.X_OK):
        sys.exit(f"cannot read {path}")
for name in filter(None, sys.argv[1].split(",")):
    if importlib.util.find_spec(name) is None:
        sys.exit(f"cannot import {name}")
"""


def _reach_problem(uid: int, paths: tuple[str, ...]) -> str | None:
    """Why a process of `uid`, with a worker's environment, cannot read one of `paths` (the nearest existing
    folder of each) or find the packages a worker imports; None when it can."""
    existing = [_nearest_existing(path) for path in paths]
    command = [sys.executable, "-c", REACH_PROBE, ",".join(WORKER_PACKAGES), *existing]
    try:
        probe = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, timeout=60, cwd="/", env=worker_environment(),
                               **WorkerAccount(uid).popen_options())
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot start the interpreter: {exc}"
    return _failure_line(probe) if probe.returncode != 0 else None


def _failure_line(probe: subprocess.CompletedProcess) -> str:
    """What a failed probe said last on stderr, or its exit code."""
    lines = probe.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {probe.returncode}"


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def worker_command(isolation: str, spec_file: Path, module: str, args: list[str]) -> list[str]:
    """The argv that runs `module` as __main__, with `args` as its arguments, inside the sandbox the file
    `spec_file` describes (SandboxSpec.write)."""
    boot = [sys.executable, os.path.abspath(__file__), str(spec_file), isolation, module, *args]
    if isolation == "namespaces":
        return [*UNSHARE, "--", *boot]
    if isolation == "process":
        return boot
    raise ValueError(f"unknown isolation level {isolation!r}")


def worker_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """An allow-listed copy of this process's environment, then `extra` on top. The user site-packages
    stay this interpreter's own even where `extra` moves HOME into a folder the worker may write: the
    interpreter runs their .pth files at start, before the sandbox is in place."""
    kept = {name: value for name, value in os.environ.items() if _allowed_variable(name)}
    return {**kept, **(extra or {}), "PYTHONUSERBASE": site.getuserbase()}


def _allowed_variable(name: str) -> bool:
    if name in DENIED_VARIABLES or name.endswith("_DIR") or any(part in name.upper() for part in SECRET_NAME_PARTS):
        return False
    return name in ALLOWED_VARIABLES or name.startswith(ALLOWED_PREFIXES)


# Inside the worker.

def enter(spec: SandboxSpec, isolation: str) -> None:
    """Shuts the calling process in; call it while the process is still single-threaded."""
    _leave_session()
    if isolation == "namespaces":
        _enter_namespaces(spec)
    elif isolation == "process":
        _use_private_tmpdir(spec)
    else:
        raise ValueError(f"unknown isolation level {isolation!r}")
    _set_limits(spec)
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)  # inherited by every thread and process it starts
    _refuse_resuming(isolation)
    _write_only_where_allowed(spec, isolation)
    _drop_capabilities()


def _refuse_resuming(isolation: str) -> None:
    """A seccomp filter, for the worker and all it starts: no SIGCONT by a call that names it
    (SECCOMP_RULES), no ptrace, and no socket that reaches an address. The judge stops the sandbox's
    processes while it times its own steps; one of them left running, or started between the judge's
    listing and its signals, could otherwise resume the others (or, tracing them, keep SIGSTOP from
    them). The kernel can still send SIGCONT where no filter sees it (a POSIX timer or mq_notify armed
    with it, an orphaned process group): the judge's pauses check the CPU time. At level process no IP
    socket either. x86-64 only: elsewhere nothing is filtered (docs/threat_model.md)."""
    if os.uname().machine != "x86_64":
        return
    program = _seccomp_program(SECCOMP_RULES + (PROCESS_LEVEL_RULES if isolation == "process" else []))
    filters = (_SockFilter * len(program))(*(_SockFilter(*instruction) for instruction in program))
    fprog = _SockFprog(len(program), filters)
    _forbid_new_privileges()
    _call("prctl(PR_SET_SECCOMP)", _libc().prctl, ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
          ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _seccomp_program(rules: list) -> list[tuple[int, int, int, int]]:
    """Classic BPF over struct seccomp_data (nr at 0, arch at 4, argument i's low word at 16 + 8 * i): every
    call through another ABI refused (i386's `int 0x80`, whose numbers differ, and x32's); each of
    `rules` answered with its action where all its conditions hold; the rest allowed."""
    program = [(BPF_LD_W_ABS, 0, 0, 4), (BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64), (BPF_RET_K, 0, 0, _refusal(errno.EPERM)),
               (BPF_LD_W_ABS, 0, 0, 0), (BPF_JGE_K, 0, 1, X32_SYSCALL_BIT), (BPF_RET_K, 0, 0, _refusal(errno.EPERM))]
    for number, conditions, refusal in rules:
        checks = []
        for argument, mask, value in conditions:
            checks.append((BPF_LD_W_ABS, 0, 0, 16 + 8 * argument))
            if mask is not None:
                checks.append((BPF_AND_K, 0, 0, mask))
            checks.append((BPF_JEQ_K, 0, "next", value))
        # A condition that does not hold goes on to the next rule (one system call may have several), at the
        # reload of the syscall number that follows this rule's refusal.
        checks = [(code, jt, len(checks) - index if jf == "next" else jf, k)
                  for index, (code, jt, jf, k) in enumerate(checks)]
        rule = checks + [(BPF_RET_K, 0, 0, _refusal(refusal))]
        program.append((BPF_JEQ_K, 0, len(rule) + 1, number))  # not this syscall: past the rule and the reload
        program += rule
        program.append((BPF_LD_W_ABS, 0, 0, 0))  # the syscall number again, for the next rule
    return program + [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)]


def confines_writes() -> bool:
    """Whether this kernel has Landlock, which keeps a worker's writes inside its writable folders."""
    return landlock_abi() >= 1


@functools.cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (6 and later also keep signals inside a domain); below 1: none."""
    return _libc().syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                           ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))


def _write_only_where_allowed(spec: SandboxSpec, isolation: str) -> None:
    """A Landlock domain, for the worker and all it starts: nothing is written, made, removed or renamed
    but where `_writable_places` says. A read-only mount refuses writes to files but not to the named
    pipes and device nodes it shows, which a daemon of the runner's uid may be reading; at level process
    nothing else kept the worker from the runner's files. Where the kernel allows (Landlock ABI 6), no
    signal leaves the domain and no abstract Unix socket outside it is reached: at level process the
    runner and other workers are in reach otherwise. Where the kernel has no Landlock (before Linux
    5.13, or not enabled) nothing is confined (docs/threat_model.md)."""
    libc, version = _libc(), landlock_abi()
    if version < 1:
        return
    writes = LANDLOCK_WRITES | (LANDLOCK_REFER if version >= 2 else 0) | (LANDLOCK_TRUNCATE if version >= 3 else 0)
    attr = _LandlockRuleset(writes, 0, LANDLOCK_SCOPES if version >= 6 else 0)
    size = ctypes.sizeof(attr) if version >= 6 else ctypes.sizeof(ctypes.c_uint64)  # older kernels know one field
    ruleset = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise SandboxError(f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path in _writable_places(spec, isolation):
            if os.path.exists(path):
                _allow_beneath(ruleset, path, writes)
        _forbid_new_privileges()
        _call("landlock_restrict_self", libc.syscall, ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset),
              ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


def _writable_places(spec: SandboxSpec, isolation: str) -> list[str]:
    """Its writable dirs; at level namespaces its own /tmp, /dev and /proc, fresh in its namespaces; at
    level process, where those are the host's, only the device nodes it needs and its own /proc entry
    (no host /tmp, /dev/shm, terminal or kernel setting)."""
    if isolation == "namespaces":
        return [*spec.writable, "/tmp", "/dev", "/proc"]
    return [*spec.writable, *(f"/dev/{name}" for name in _kept_devices()), f"/proc/{os.getpid()}"]


def _allow_beneath(ruleset: int, path: str, access: int) -> None:
    """A rule for a directory and all beneath it, or for one file (which takes only the rights of files)."""
    directory = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISDIR(os.fstat(directory).st_mode):
            access &= LANDLOCK_FILE_RIGHTS
        rule = _LandlockPathBeneath(access, directory)
        _call(f"landlock_add_rule for {path}", _libc().syscall, ctypes.c_long(SYS_LANDLOCK_ADD_RULE),
              ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0))
    finally:
        os.close(directory)


class _LandlockRuleset(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _LandlockPathBeneath(ctypes.Structure):
    _pack_ = 1  # packed in linux/landlock.h
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities() -> None:
    """No capability for the worker or anything it runs, root or not: the bounding set emptied (where this
    process may: without CAP_SETPCAP it has nothing there a program could gain, no_new_privs being set),
    the ambient set cleared, and none effective, permitted or inheritable."""
    libc = _libc()
    capability = 0
    while libc.prctl(ctypes.c_int(PR_CAPBSET_READ), ctypes.c_ulong(capability), ctypes.c_ulong(0),
                     ctypes.c_ulong(0), ctypes.c_ulong(0)) >= 0:  # EINVAL past the kernel's last capability
        if libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(capability), ctypes.c_ulong(0),
                      ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0 and ctypes.get_errno() != errno.EPERM:
            raise SandboxError(f"prctl(PR_CAPBSET_DROP, {capability}): {os.strerror(ctypes.get_errno())}")
        capability += 1
    _call("prctl(PR_CAP_AMBIENT_CLEAR_ALL)", libc.prctl, ctypes.c_int(PR_CAP_AMBIENT),
          ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    _call("capset", libc.capset, ctypes.byref(_CapHeader(LINUX_CAPABILITY_VERSION_3, 0)),
          ctypes.byref((_CapData * 2)()))


def _forbid_new_privileges() -> None:
    """What both a seccomp filter and a Landlock domain need from an unprivileged caller (once is enough;
    each sets it, since the filter is not installed everywhere)."""
    _call("prctl(PR_SET_NO_NEW_PRIVS)", _libc().prctl, ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1),
          ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _refusal(error: int) -> int:
    return SECCOMP_RET_ERRNO | error


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _leave_session() -> None:
    """A session and process group of its own: the runner's terminal signals stop reaching it, and the
    group is what the process level ends."""
    if os.getsid(0) == os.getpid():
        return
    try:
        os.setsid()
    except PermissionError:  # already a process group leader: the group is its own
        pass


def _set_limits(spec: SandboxSpec) -> None:
    """Soft and hard limits alike, so the worker cannot raise them again."""
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_FSIZE, spec.file_size_limit_bytes)
    if spec.memory_limit_bytes is not None:
        _limit(resource.RLIMIT_AS, spec.memory_limit_bytes)
    if spec.task_limit is not None:
        _limit(resource.RLIMIT_NPROC, spec.task_limit)


def _limit(which: int, value: int) -> None:
    hard = resource.getrlimit(which)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _use_private_tmpdir(spec: SandboxSpec) -> None:
    if spec.writable:
        tmpdir = os.path.join(spec.writable[0], "tmp")
        os.makedirs(tmpdir, mode=0o700, exist_ok=True)
        os.environ["TMPDIR"] = tmpdir


def _enter_namespaces(spec: SandboxSpec) -> None:
    """The mount steps, in the mount namespace `unshare` made, as root of the user namespace it made."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    _forbid_new_namespaces()
    working_directory, hidden = os.getcwd(), _hidden(spec)
    # Opened before anything covers them: the exchange and build dirs, and what Python imports from, may lie
    # under /tmp or a hidden directory.
    binds = _open_binds(spec, hidden)
    try:
        _make_read_only("/", recursive=True)
        _open_proc_except_kernel_settings()
        _mount_private_tmpfs(spec.tmpfs_bytes)
        _hide_and_bind_back(hidden, binds)
    finally:
        for _, fd, _ in binds:
            os.close(fd)
    os.environ["TMPDIR"] = "/tmp"
    _enter_again(working_directory)
    _lock_mounts()


def _forbid_new_namespaces() -> None:
    """No namespace can be made below this user namespace but the one user namespace `_lock_mounts`
    makes. A process in a PID namespace of its own is not one the runner finds as the sandbox's (to
    stop it while the judge times its steps, to report it left running), and in a user namespace of
    its own the worker would be root again. The limits count for every user namespace below this one,
    and the worker, in the nested one, cannot raise them here."""
    for name, limit in NAMESPACE_LIMITS.items():
        path = f"/proc/sys/user/{name}"
        if os.path.exists(path):  # the time namespace's only since Linux 5.6
            _write_proc(path, str(limit))


def _hidden(spec: SandboxSpec) -> list[str]:
    """The real paths of the directories to cover, but the root and /tmp and /dev/shm (fresh already): covering
    those would take away what every process needs."""
    return [path for path in map(os.path.realpath, spec.hidden) if path not in ("/", *COVERED)]


def _open_binds(spec: SandboxSpec, hidden: list[str]) -> list[tuple[str, int, bool]]:
    """(path, O_PATH descriptor, writable) for each directory to bind back, parents before children, so
    that a writable directory inside a readable one stays writable."""
    # A directory on sys.path or a tool's path that is itself hidden (a checkout flashbench runs from) is not bound
    # back whole: of a checkout a worker imports the package alone.
    found = [path for path in map(os.path.realpath, (*_import_paths(), *_toolchain_paths())) if path not in hidden]
    readable = {*map(os.path.realpath, (*spec.readable, PACKAGE_DIR)), *found}
    wanted = {path: False for path in readable if _covered(path) or any(_within(path, top) for top in hidden)}
    wanted.update({os.path.realpath(path): True for path in spec.writable})
    binds = []
    for path in sorted(wanted, key=lambda p: p.count(os.sep)):
        try:
            binds.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY), wanted[path]))
        except OSError as exc:
            for _, fd, _ in binds:
                os.close(fd)
            raise SandboxError(f"cannot open {path}: {exc.strerror}") from None
    return binds


def _import_paths() -> list[str]:
    """The interpreter's installation (a virtual environment may lie under /tmp) and the directories on
    sys.path: the worker must still start, and import, and run `sys.executable`, as this interpreter could."""
    installation = (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                    os.path.dirname(sys.executable))
    return [path for path in (*installation, *sys.path) if path and os.path.isdir(path)]


def source_checkout() -> str | None:
    """The checkout flashbench runs from (its tests, docs and git history beside the package), None where it
    is an installed package."""
    return SOURCE_ROOT if os.path.isfile(os.path.join(SOURCE_ROOT, "pyproject.toml")) else None


def _toolchain_paths() -> list[str]:
    """The directories the worker's environment names for its tools (compilers, nvcc, ninja, the CUDA
    libraries): a build must find them where the runner's would, under its home too."""
    named = [path for variable in TOOLCHAIN_VARIABLES for path in os.environ.get(variable, "").split(os.pathsep)]
    return [path for path in named if os.path.isabs(path) and os.path.isdir(path)]


def _covered(path: str) -> bool:
    """Inside /tmp or /dev/shm (not those themselves: the fresh tmpfs is the point)."""
    return any(_within(path, root) and path != root for root in COVERED)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _mount_private_tmpfs(size: int) -> None:
    """A /dev of a few devices (below), fresh /tmp and /dev/shm shared with no one, and an empty
    read-only /dev/pts: no terminal of the runner can be opened."""
    _mount_minimal_dev()
    for target in COVERED:
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    if os.path.isdir("/dev/pts"):
        _mount("tmpfs", "/dev/pts", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=755")


def _kept_devices() -> list[str]:
    """The names in /dev of the devices a worker needs."""
    return [name for name in sorted(os.listdir("/dev"))
            if name in KEPT_DEVICES or name.startswith(KEPT_DEVICE_PREFIXES)]


def _mount_minimal_dev() -> None:
    """A fresh /dev holding only the devices a worker needs, bound from the host's: as root mapped to
    root it could otherwise open the host's other device nodes (its kernel log, consoles, disks), which
    a read-only mount does not protect."""
    kept = _kept_devices()
    held = []
    try:
        for name in kept:
            held.append((name, os.open(f"/dev/{name}", os.O_PATH | os.O_NOFOLLOW)))
        _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
        for name, fd in held:
            target = f"/dev/{name}"
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                os.symlink(os.readlink(f"/proc/self/fd/{fd}"), target)
                continue
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.mkdir(target)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # the bind's mount point
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    finally:
        for _, fd in held:
            os.close(fd)
    for name, target in DEVICE_LINKS.items():
        os.symlink(target, f"/dev/{name}")
    for name in ("shm", "pts"):
        os.mkdir(f"/dev/{name}")
    _make_read_only("/dev", recursive=False)


def _hide_and_bind_back(hidden: list[str], binds: list[tuple[str, int, bool]]) -> None:
    """Covers each hidden directory with an empty tmpfs and binds back each directory the worker needs,
    parents before children: what is bound back inside a hidden directory shows, what is hidden inside a
    bound-back one does not. A cover turns read-only once the binds inside it have their mount points."""
    bound = {path for path, _, _ in binds}  # a directory both hidden and needed is needed
    steps = [(path, None) for path in hidden if path not in bound]
    steps += [(path, (fd, writable)) for path, fd, writable in binds]
    covers = []
    for path, bind in sorted(steps, key=lambda step: (step[0].count(os.sep), step[1] is not None)):
        if bind is not None:
            _bind_back(path, *bind)
        elif os.path.isdir(path):  # else nothing of the host's is there (it lies in a fresh tmpfs)
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755")
            covers.append(path)
    for path in covers:
        _make_read_only(path, recursive=False)


def _bind_back(path: str, fd: int, writable: bool) -> None:
    """Binds the directory held by `fd` at `path`: read-only like its source, or made writable."""
    os.makedirs(path, exist_ok=True)  # its mount point, where it lies inside a fresh or covering tmpfs
    _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    if writable:
        _make_writable(path)


def _enter_again(working_directory: str) -> None:
    """The working directory looked up anew, through the mounts just made: the old one still led into the
    host's tree beneath them, where relative paths would reach a hidden directory or the host's /tmp."""
    try:
        os.chdir(working_directory)
    except OSError:  # it lay in a fresh or covering tmpfs: nothing of it is there any more
        os.chdir("/")


def _lock_mounts() -> None:
    """A nested user namespace has no say over this mount namespace: it can neither remount nor unmount
    what was set up, and a mount namespace of its own inherits all of it locked."""
    _unshare(CLONE_NEWUSER)
    _write_proc("/proc/self/setgroups", "deny")
    _write_proc("/proc/self/uid_map", "0 0 1")
    _write_proc("/proc/self/gid_map", "0 0 1")


def _write_proc(path: str, text: str) -> None:
    try:
        with open(path, "w") as handle:
            handle.write(text)
    except OSError as exc:
        raise SandboxError(f"cannot write {path}: {exc.strerror}") from None


# Mounts through libc.

@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _call(what: str, function, *args) -> None:
    if function(*args) != 0:
        raise SandboxError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _call(f"mount on {target}", _libc().mount, _bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags),
          _bytes(data))


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _unshare(flags: int) -> None:
    _call("unshare", _libc().unshare, ctypes.c_int(flags))


def _make_read_only(path: str, recursive: bool) -> None:
    """The mount at `path` read-only, and every mount below it when recursive."""
    if not _mount_setattr(path, AT_RECURSIVE if recursive else 0, attr_set=MOUNT_ATTR_RDONLY):
        targets = [target for target in _mount_options() if _within(target, path)] if recursive else [path]
        _remount_each(targets, read_only=True)


def _open_proc_except_kernel_settings() -> None:
    """The namespace's /proc writable again (CUDA's driver fails to start, error 304, on a read-only
    one), but not the kernel's settings in it: as root mapped to root, the worker could otherwise write
    the host's sysctls or trigger sysrq (the parts a container runtime also keeps read-only)."""
    _make_writable("/proc")
    for path in KERNEL_SETTINGS:
        if os.path.exists(path):
            _mount(path, path, None, MS_BIND | MS_REC)
            _make_read_only(path, recursive=True)


def _make_writable(path: str) -> None:
    """The mount at `path` writable again (it is a bind, read-only like its source)."""
    if not _mount_setattr(path, 0, attr_clr=MOUNT_ATTR_RDONLY):
        _remount_each([path], read_only=False)


def _remount_each(targets: list[str], read_only: bool) -> None:
    """The fallback of kernels without mount_setattr: one bind remount per mount point."""
    options = _mount_options()
    failed = [target for target in targets if not _remount(target, options[target], read_only)]
    # A mount point that a later mount hides cannot be reached by its path, nor by the worker.
    left = [target for target in failed if _is_read_only(target) != read_only]
    if left:
        raise SandboxError(f"cannot remount {left[0]} {'read-only' if read_only else 'writable'}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _mount_setattr(path: str, flags: int, attr_set: int = 0, attr_clr: int = 0) -> bool:
    """mount_setattr(2) (Linux 5.12): False when the kernel lacks it."""
    attr = _MountAttr(attr_set=attr_set, attr_clr=attr_clr)
    result = _libc().syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_long(AT_FDCWD), path.encode(),
                             ctypes.c_long(flags), ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr)))
    if result == 0:
        return True
    if ctypes.get_errno() == errno.ENOSYS:
        return False
    raise SandboxError(f"mount_setattr {path}: {os.strerror(ctypes.get_errno())}")


def _remount(path: str, options: list[str], read_only: bool) -> bool:
    """A bind remount that keeps the mount's other flags: a user namespace may not change them."""
    flags = MS_REMOUNT | MS_BIND | (MS_RDONLY if read_only else 0) | _kept_flags(options)
    return _libc().mount(None, path.encode(), None, ctypes.c_ulong(flags), None) == 0


def _kept_flags(options: list[str]) -> int:
    flags = sum(REMOUNT_KEPT_OPTIONS[option] for option in options if option in REMOUNT_KEPT_OPTIONS)
    if not {"noatime", "relatime"} & set(options):
        flags |= MS_STRICTATIME
    return flags


def _mount_options() -> dict[str, list[str]]:
    """Mount point -> per-mount options of the mount on top there, from /proc/self/mountinfo."""
    options = {}
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            options[_unescape(fields[4])] = fields[5].split(",")
    return options


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in octal (\\040)."""
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def _is_read_only(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


# From the runner's side.

def worker_pid(pid: int, isolation: str) -> int | None:
    """The host PID of the worker started as `pid` (the Popen pid): at the namespaces level the child of
    `unshare`, which is the init of the PID namespace; None when it is not running."""
    if isolation == "process":
        return pid if _alive(pid) else None
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            candidates = [int(child) for child in children.read().split()]
    except OSError:
        return None
    return next((child for child in candidates if _alive(child)), None)


def sandbox_processes(pid: int, isolation: str) -> list[int]:
    """Host PIDs of the live processes in the sandbox of the worker started as `pid`, the worker excepted:
    those in its PID namespace, or at the process level those in its process group. Every process of the
    namespace descends from the worker, its init, to which orphans go (no namespace can be made inside):
    found by parent PIDs, which any runner may read. A namespace link (/proc/PID/ns/pid) would not do: a
    runner without CAP_SYS_PTRACE cannot read it for a process made non-dumpable (by running a file it
    cannot read)."""
    worker = worker_pid(pid, isolation)
    if worker is None:
        return []
    live = _live_processes()
    if isolation == "namespaces":
        members = _descendants(worker, {p: parent for p, (_, parent) in live.items()})
    else:
        members = {p for p, (group, _) in live.items() if group == worker}
    return sorted(p for p in members if p != worker)


def command_line(pid: int, limit: int = 80) -> str:
    """A process's command line as one short line (its own words: the caller keeps them as text), or "?"."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read(4 * limit).split(b"\0")
    except OSError:
        return "?"
    line = " ".join(word.decode(errors="replace") for word in words if word) or "?"
    return line if len(line) <= limit else line[:limit - 3] + "..."


def put_first_for_the_oom_killer() -> None:
    """Make this process, and every process it starts from here on (they inherit the score at fork), the kernel's
    first choice when the host runs out of memory: a GPU worker's host memory has no limit, and a CPU worker's
    address-space limit leaves out memfds it never maps, so without this the largest process, often the runner
    holding every job's references, was the one killed, and the whole run with it. Run by a started worker
    before exec and before it takes its uid: while it holds a root runner's CAP_SYS_RESOURCE, the score is also
    the least it may set again (the kernel keeps it as the floor for a writer without that capability). Set by
    the runner on the started process instead, it missed a child that `unshare` had forked but /proc did not
    yet show: the child had taken its parent's score before the runner raised it."""
    with contextlib.suppress(OSError):  # no such file on this kernel
        # os calls only: this runs in a child forked from the many-threaded judge, where a lock another thread
        # held at the fork (an import's, an encoding lookup's) stays held.
        score = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(score, str(OOM_SCORE_ADJ_MAX).encode())
        finally:
            os.close(score)


def _descendants(root: int, parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, pending = set(), [root]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def disk_usage(path: Path) -> tuple[int, int] | None:
    """The disk space (bytes of blocks, so a sparse file counts what it holds) and the inodes a folder a worker
    could write takes, by `du`, which walks any depth without following links; None when it cannot be measured
    (too large to walk in time). OSError when `du` cannot start: the host's trouble (out of processes or
    memory), not the folder's."""
    try:
        return tuple(_du(path, flag) for flag in ("-B1", "--inodes"))
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def _du(path: Path, flag: str) -> int:
    done = subprocess.run(["du", "-s", flag, "-x", str(path)], capture_output=True, text=True, timeout=DU_TIMEOUT_S)
    return int(done.stdout.split()[0])


def remove_tree(path: Path) -> None:
    """Removes a folder a worker could write, and all in it, never raising: without recursion or deep
    paths (a worker can nest folders deeper than Python's stack and than PATH_MAX: each sub-folder is
    first moved up to the top before it is emptied), and through folder descriptors alone, so that a link
    a process the worker left running swaps in for a folder half-way is removed, never followed."""
    top = _open_folder(str(path))
    if top is None:
        return
    token = os.urandom(6).hex()
    pending, moved = [None], 0  # names in the top folder still to empty; None: the top folder itself
    try:
        while pending:
            name = pending.pop()
            folder = top if name is None else _open_folder(name, top)
            if folder is None:  # no folder any more (a link put in its place): the name alone goes
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=top)
                continue
            try:
                with os.scandir(folder) as listing:
                    entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in listing]
            except OSError:
                entries = []
            for entry, is_folder in entries:
                with contextlib.suppress(OSError):
                    if is_folder:
                        moved += 1
                        target = f".removing-{token}-{moved}"
                        os.rename(entry, target, src_dir_fd=folder, dst_dir_fd=top)
                        pending.append(target)
                    else:
                        os.unlink(entry, dir_fd=folder)
            if name is not None:
                os.close(folder)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _open_folder(name: str, dir_fd: int | None = None) -> int | None:
    """A descriptor that lists the folder `name` (relative to `dir_fd`), made readable first (a folder the
    worker made unreadable is still emptied); None where `name` is no folder: a link is not followed."""
    try:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        with contextlib.suppress(OSError):
            os.chmod(f"/proc/self/fd/{handle}", 0o700)  # the folder itself: the descriptor holds no link
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=handle)
    except OSError:
        return None
    finally:
        os.close(handle)


def end_sandbox(process: subprocess.Popen, isolation: str) -> None:
    """SIGKILLs everything in the sandbox and the started process, and reaps it. Safe to call twice."""
    if isolation == "namespaces":
        _end_pid_namespace(process)
    else:
        _kill(process.pid, group=True)
    process.kill()  # a no-op once it has been reaped
    _reap(process)
    if isolation != "namespaces":  # SIGKILL takes effect when a process next runs: on a busy host, later
        _wait_for_group_to_end(process.pid)


def _end_pid_namespace(process: subprocess.Popen) -> None:
    """Kills the namespace's init, whose death makes the kernel kill everyone else in it, setsid daemons
    included; `unshare` exits once its child is gone, which is after all of them."""
    init = worker_pid(process.pid, "namespaces") if process.poll() is None else None  # unshare's PID is still its
    if init is not None:
        _kill(init)
        _reap(process)


def _wait_for_group_to_end(group: int) -> None:
    deadline = time.monotonic() + REAP_TIMEOUT_S
    while any(g == group for g, _ in _live_processes().values()) and time.monotonic() < deadline:
        time.sleep(0.01)


def _kill(pid: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(process: subprocess.Popen) -> None:
    try:
        process.wait(timeout=REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # stuck in the kernel (a device driver): a later poll reaps it
        pass


def is_stopped(pid: int) -> bool:
    """No thread of the process runs: each is stopped (by a signal, or traced) or ended."""
    return all(state in ("T", "t", *DEAD_STATES) for state in _thread_states(pid))


def cpu_time_ns(pids: list[int]) -> int:
    """The CPU time the processes' threads have had so far, together (ns; /proc/PID/task/TID/schedstat,
    else utime and stime in clock ticks): a stopped process gets none."""
    total = 0
    for pid in pids:
        for tid in _threads(pid):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as schedstat:
                    total += int(schedstat.read().split()[0])
            except (OSError, ValueError, IndexError):
                fields = _stat_fields(pid, tid)
                if fields is not None:
                    total += (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")
    return total


def _live_processes() -> dict[int, tuple[int, int]]:
    """PID -> (process group, parent PID) of every live process on the host."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None and _alive(int(name), fields):
                found[int(name)] = (int(fields[2]), int(fields[1]))
    return found


def _alive(pid: int, fields: list[str] | None = None) -> bool:
    """Not a zombie; or a zombie only in its main thread, which ended on its own while other threads of
    the process run on (its /proc/PID/stat reads Z): such a process is alive and must be found."""
    fields = fields if fields is not None else _stat_fields(pid)
    if fields is None:
        return False
    return fields[0] not in DEAD_STATES or any(state not in DEAD_STATES for state in _thread_states(pid))


def _threads(pid: int) -> list[int]:
    """The thread IDs of a process; none once it has ended."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _thread_states(pid: int) -> list[str]:
    """The /proc state of each of a process's threads that can still be read."""
    return [fields[0] for fields in (_stat_fields(pid, tid) for tid in _threads(pid)) if fields is not None]


def _stat_fields(pid: int, tid: int | None = None) -> list[str] | None:
    """The fields of /proc/PID/stat (of one of its threads: /proc/PID/task/TID/stat) after the command name:
    state, ppid, pgrp, ..."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path, "rb") as stat_file:
            return stat_file.read().rpartition(b")")[2].decode().split()
    except OSError:
        return None


# Script mode: the worker's first Python code.

def _main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.exit("usage: sandbox.py SPEC_FILE ISOLATION MODULE [ARGS...]")
    spec_file, isolation, module, *args = argv
    _import_from_source_root()
    spec = SandboxSpec.from_json(Path(spec_file).read_text())
    try:
        enter(spec, isolation)
    except SandboxError as exc:
        sys.exit(f"sandbox: {exc}")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _import_from_source_root() -> None:
    """The flashbench this file belongs to, rather than its own folder (flashbench/run), which Python put
    first on sys.path for the script."""
    script_dir = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [path for path in sys.path if os.path.abspath(path or ".") != script_dir]
    if SOURCE_ROOT not in sys.path:
        sys.path.insert(0, SOURCE_ROOT)


if __name__ == "__main__":
    _main(sys.argv[1:])
