"""Shared fixtures: throw-away copies of the repository's definitions and references, and one
build cache for the whole session, so tests never write into the repository's traces/ or
.flashbench-cache. (Reference outputs are no longer cached on disk: nothing needs a private
XDG_CACHE_HOME.)"""

import contextlib
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def share_the_cores() -> None:
    """Under pytest-xdist, each test process (and every process it starts: CLI runs, Ray, Triton's
    interpreter, the sandboxed workers before they set their own count) gets its share of the
    machine's cores for torch's intra-op threads, not all of them: two processes of two threads on
    two cores spent a quarter of the suite's CPU time in threads waiting for one another (the
    judge's references and checks, whole-repository validations). Without xdist, and where
    OMP_NUM_THREADS is set, nothing changes. Called before torch (and numpy, whose BLAS reads the
    variable once) is imported in this process."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


share_the_cores()


ROOT_AT_START = os.environ.get("FLASHBENCH_ROOT")


@pytest.fixture(autouse=True)
def own_root_variable():
    """`--root` and `flashbench.load(root)` point FLASHBENCH_ROOT at their repository for the rest of the process
    (registry.use_root): after each test the variable is as the session found it, whatever order the tests run
    in (a module's fixture may have set it before the test began)."""
    yield
    if ROOT_AT_START is None:
        os.environ.pop("FLASHBENCH_ROOT", None)
    else:
        os.environ["FLASHBENCH_ROOT"] = ROOT_AT_START


OP_TYPE = "mla_paged"  # the definitions the runner tests use; other op types are left out


@contextlib.contextmanager
def nested_folders(top: Path, depth: int):
    """`depth` folders `d` nested under `top` for the block (deeper than Python's recursion goes), then removed
    deepest first: shutil.rmtree, and so pytest's own clean-up of old temporary folders, recurses too."""
    here = os.getcwd()
    os.chdir(top)
    try:
        for _ in range(depth):  # relative: an absolute path this deep may pass the system's limit
            os.mkdir("d")
            os.chdir("d")
    finally:
        os.chdir(here)
    try:
        yield
    finally:
        for level in range(depth, 0, -1):
            os.rmdir(top / "/".join(["d"] * level))


def copy_repo(target: Path) -> Path:
    """definitions/ and references/ of OP_TYPE only: no solutions, no traces, no cache."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("definitions", "references"):
        shutil.copytree(ROOT / name / OP_TYPE, target / name / OP_TYPE, ignore=shutil.ignore_patterns("__pycache__"))
    return target


@pytest.fixture(scope="session")
def repo_copy(tmp_path_factory) -> Path:
    return copy_repo(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def fresh_repo(tmp_path) -> Path:
    """A copy of its own, for commands that write into the repository (the CLI's cache, submit)."""
    return copy_repo(tmp_path / "repo")


@pytest.fixture(scope="module")
def module_repo(tmp_path_factory) -> Path:
    """Like fresh_repo, shared by the tests of one module."""
    return copy_repo(tmp_path_factory.mktemp("repo"))

