"""Provenance: a trace names the project's own commit, never that of a repository the tree happens to sit in."""

import subprocess

import pytest

from flashbench.environment import describe_environment, usable_memory

GIT = ["git", "-c", "user.name=tests", "-c", "user.email=tests@example.com"]


def git(folder, *args) -> str:
    return subprocess.run([*GIT, "-C", str(folder), *args], check=True, capture_output=True, text=True).stdout.strip()


def checkout(folder):
    folder.mkdir(parents=True, exist_ok=True)
    git(folder, "init", "-q")
    (folder / "README.md").write_text("flashbench\n")
    git(folder, "add", "README.md")
    git(folder, "commit", "-q", "-m", "first")
    return git(folder, "rev-parse", "HEAD")


@pytest.fixture(autouse=True)
def no_named_commit(monkeypatch):
    monkeypatch.delenv("FLASHBENCH_GIT_COMMIT", raising=False)


def test_a_checkout_at_the_root_gives_its_commit_and_dirty_flag(tmp_path):
    commit = checkout(tmp_path / "repo")
    env = describe_environment("cpu", tmp_path / "repo")
    assert (env["git_commit"], env["git_dirty"]) == (commit, False)
    (tmp_path / "repo" / "README.md").write_text("edited\n")
    assert describe_environment("cpu", tmp_path / "repo")["git_dirty"] is True


def test_a_folder_inside_another_repository_gives_no_commit(tmp_path, monkeypatch):
    checkout(tmp_path)
    (tmp_path / "project").mkdir()
    env = describe_environment("cpu", tmp_path / "project")
    assert (env["git_commit"], env["git_dirty"]) == (None, None)
    # A copy shipped without .git may name its commit; a checkout never takes it from the environment.
    monkeypatch.setenv("FLASHBENCH_GIT_COMMIT", "abc1234")
    assert describe_environment("cpu", tmp_path / "project")["git_commit"] == "abc1234"
    assert describe_environment("cpu", tmp_path)["git_commit"] == git(tmp_path, "rev-parse", "HEAD")


def test_usable_memory_is_the_cgroup_limit_where_lower(tmp_path):
    machine = usable_memory(tmp_path / "absent")
    assert machine and machine > 1 << 20
    limit = tmp_path / "memory.max"
    limit.write_text("1048576\n")
    assert usable_memory(limit) == 1 << 20
    limit.write_text("max\n")  # no limit
    assert usable_memory(limit) == machine
    limit.write_text(f"{machine * 2}\n")
    assert usable_memory(limit) == machine
