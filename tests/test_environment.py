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


def test_usable_memory_is_the_lowest_cgroup_limit_where_lower(tmp_path):
    root, membership = tmp_path / "cgroup", tmp_path / "self_cgroup"
    machine = usable_memory(root, tmp_path / "absent")
    assert machine and machine > 1 << 20
    membership.write_text("0::/\n")  # a container's own cgroup namespace: its limit at the mount's root
    root.mkdir()
    (root / "memory.max").write_text("1048576\n")
    assert usable_memory(root, membership) == 1 << 20
    (root / "memory.max").write_text("max\n")  # no limit
    assert usable_memory(root, membership) == machine
    (root / "memory.max").write_text(f"{machine * 2}\n")
    assert usable_memory(root, membership) == machine
    nested = root / "system.slice" / "runner.service"  # v2 without a namespace: the limit on a parent
    nested.mkdir(parents=True)
    (nested / "memory.max").write_text("max\n")
    (nested.parent / "memory.max").write_text("2097152\n")
    membership.write_text("0::/system.slice/runner.service\n")
    assert usable_memory(root, membership) == 2 << 20
    v1 = root / "memory" / "docker" / "abc"  # cgroup v1: memory.limit_in_bytes, "unlimited" a huge number
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("3145728\n")
    (v1.parent / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    membership.write_text("4:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n")
    (root / "memory.max").write_text("max\n")
    assert usable_memory(root, membership) == 3 << 20
