"""What a result was measured on: recorded in every trace."""

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch


def hardware_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU {platform.machine()}"


def describe_environment(device: str, root: Path) -> dict:
    env = {
        "device": device,
        "hardware": hardware_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flashbench": _version("flashbench") or _package_version(),
        **git_provenance(root),
    }
    if torch.device(device).type == "cuda":
        env["cuda"] = torch.version.cuda
        env.update(_nvidia_smi(torch.device(device).index or 0))
    return env


def usable_memory(cgroup_root: Path = Path("/sys/fs/cgroup"),
                  membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """The bytes of memory this process may use: the machine's, or the lowest memory limit of its cgroup and the
    cgroups above it where lower (cgroup v2's memory.max, v1's memory.limit_in_bytes); None where the machine
    does not say."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    places = []  # (the hierarchy's mount, this process's cgroup in it, the file of its limit)
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            places.append((cgroup_root, path, "memory.max"))
        elif "memory" in controllers.split(","):
            places.append((cgroup_root / "memory", path, "memory.limit_in_bytes"))
    for root, path, name in places:
        folder = root / path.strip("/")
        while True:  # its own cgroup and every one above it that this mount shows (a container's root included)
            try:
                limit = (folder / name).read_text().strip()
            except OSError:
                limit = ""
            if limit.isdigit():
                memory = min(memory, int(limit))
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent
    return memory


def git_provenance(root: Path) -> dict:
    """git_commit and git_dirty of root's own checkout. A folder that is not a checkout itself gets no commit from
    git: inside another repository, git would name that repository's commit, which says nothing about this tree."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == Path(root).resolve():
        return {"git_commit": _git(root, "rev-parse", "HEAD"),
                "git_dirty": bool(_git(root, "status", "--porcelain", "--untracked-files=no"))}
    # A copy of the tree without .git (e.g. shipped to a GPU machine) may name its commit; whether it was
    # edited since is unknown.
    return {"git_commit": os.environ.get("FLASHBENCH_GIT_COMMIT"), "git_dirty": None}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_version() -> str:
    from . import __version__
    return __version__


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _nvidia_smi(index: int) -> dict:
    fields = ["driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "power.limit"]
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if done.returncode != 0:
        return {}
    values = [v.strip() for v in done.stdout.strip().split(",")]
    return dict(zip(["driver", "sm_clock", "mem_clock", "max_sm_clock", "power_limit"], values))
