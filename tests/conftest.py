"""Shared fixtures: a throw-away copy of the repository's definitions and references, and one
reference-output cache for the whole session, so tests never write into the repository's
traces/ or .flashbench-cache."""

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def copy_repo(target: Path) -> Path:
    """definitions/ and references/ only: no solutions, no traces, no cache."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("definitions", "references"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    return target


@pytest.fixture(scope="session")
def repo_copy(tmp_path_factory) -> Path:
    return copy_repo(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")
