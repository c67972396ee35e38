"""flashbench/build.py in the judge: the bounded walk of an untrusted solution folder (for its hash, its
staged copy and its checks), and the dependency and toolchain checks, which never import what a solution
names. (Building and importing, in the worker, are tested through the runner: tests/test_runner.py.)"""

import os
import resource
import shutil
import sys
from pathlib import Path

import pytest

from flashbench import build
from flashbench.build import FolderError, content_hash, folder_files, folder_problem, missing_dependencies, read_file
from flashbench.model import Solution

KERNEL = "def run(x):\n    return x\n"


def solution(**fields) -> Solution:
    return Solution(**{"name": "s", "definition": "d", "author": "a", "language": "python",
                       "entry_point": "kernel.py::run", **fields})


@pytest.fixture
def folder(tmp_path) -> Path:
    path = tmp_path / "folder"
    (path / "sub").mkdir(parents=True)
    (path / "kernel.py").write_text(KERNEL)
    (path / "sub" / "util.py").write_text("K = 1\n")
    return path


def refusal(path: Path) -> str:
    with pytest.raises(FolderError) as refused:
        content_hash(path)
    message = refused.value.message
    assert "\n" not in message and folder_problem(path, solution()) == message
    return message


def test_a_file_holding_nul_bytes_cannot_pass_for_two_files(tmp_path):
    """The plain form hashes path, NUL, data, NUL: without lengths, one file's data could read as the
    next file's path and data, and two folders of other content would share a hash."""
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    (two / "a.bin").write_bytes(b"one")
    (two / "b.bin").write_bytes(b"two")
    (one / "a.bin").write_bytes(b"one\0b.bin\0two")
    assert content_hash(two) != content_hash(one)


def test_a_folder_without_nul_bytes_keeps_the_plain_hash(tmp_path):
    """Recorded traces carry the plain form's hashes; folders of text keep them."""
    import hashlib

    (tmp_path / "kernel.py").write_text("x = 1\n")
    (tmp_path / "util.py").write_text("y = 2\n")
    plain = hashlib.sha256(b"kernel.py\0x = 1\n\0util.py\0y = 2\n\0").hexdigest()[:32]
    assert content_hash(tmp_path) == plain


def test_a_plain_folder_is_walked_and_checked(folder):
    assert folder_files(folder) == {"kernel.py": KERNEL.encode(), "sub/util.py": b"K = 1\n"}
    assert folder_problem(folder, solution()) is None
    assert "missing.py does not exist" in folder_problem(folder, solution(entry_point="missing.py::run"))


def test_a_huge_sparse_file_is_refused_by_its_size_before_it_is_read(folder, monkeypatch):
    with open(folder / "weights.bin", "wb") as file:
        file.truncate(2 * build.MAX_FILE_BYTES)  # sparse: no disk, and reading it would be 64 MiB of zeros
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("a file was read whole"))
    assert refusal(folder) == f"weights.bin is {2 * build.MAX_FILE_BYTES} bytes; a file may have 32 MiB"


def test_the_total_and_the_number_of_entries_are_bounded(folder, monkeypatch):
    monkeypatch.setattr(build, "MAX_TOTAL_BYTES", len(KERNEL) + 2)
    assert "over the 0 MiB they may have" in refusal(folder)
    monkeypatch.setattr(build, "MAX_TOTAL_BYTES", 1 << 20)
    monkeypatch.setattr(build, "MAX_ENTRIES", 2)  # kernel.py, sub/, sub/util.py
    assert refusal(folder) == "the solution folder holds more than 2 files and folders"


@pytest.mark.parametrize("name", [b"\xff\xfe.py", b"new\nline.py"])
def test_a_name_that_is_not_printable_utf8_is_refused(folder, name):
    open(os.fsencode(folder / "sub") + b"/" + name, "wb").close()  # the bytes as they are, not encoded from a str
    message = refusal(folder)
    assert message.startswith("'sub/") and message.endswith("a file name must be printable UTF-8")
    message.encode()  # shown escaped: the message itself is valid UTF-8 for the trace


def test_a_fifo_is_refused_without_opening_it(folder):
    os.mkfifo(folder / "sub" / "pipe")
    assert refusal(folder) == "sub/pipe is not a regular file"


def test_a_hard_link_is_refused(folder, tmp_path):
    """Red team: a file hard-linked to the run's trace file (hidden from the worker) was read by the judge and its
    bytes staged into the worker's copy. A file's other names may lie anywhere: any file with more than one is
    refused, one inside the folder too."""
    secret = tmp_path / "secret.jsonl"
    secret.write_text("hidden\n")
    os.link(secret, folder / "sub" / "data.txt")
    assert refusal(folder) == "sub/data.txt is a hard link (2 names): a file of a solution folder may have no other name"
    (folder / "sub" / "data.txt").unlink()
    os.link(folder / "kernel.py", folder / "sub" / "kernel_again.py")
    assert "hard link" in refusal(folder)
    with pytest.raises(FolderError, match="kernel.py is a hard link"):  # made after the walk: refused when read
        read_file(folder, "kernel.py")


@pytest.mark.parametrize("name", [".git/config", "docs/.git/config", ".GIT/config", ".gitignore", "sub/.gitattributes",
                                  ".gitmodules", ".hg/hgrc"])
def test_version_controls_files_are_refused_notes_included(folder, name):
    """A red team submitted a folder holding `docs/.git/config` with `core.fsmonitor` set: `git status` in the
    installed folder ran its command as the maintainer; a `.gitignore` kept the computing file out of the commit."""
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("[core]\n\tfsmonitor = touch pwned\n")
    assert "version control's files have no place in a solution folder" in refusal(folder)


def test_a_link_loop_is_refused_not_followed(folder):
    (folder / "loop").symlink_to("loop")
    assert folder_problem(folder, solution()) == "loop is a link that leads nowhere (Too many levels of symbolic links)"
    content_hash(folder)  # hashed as a link: the walk itself does not fail


def test_a_link_out_of_the_folder_is_never_read(folder, monkeypatch):
    (folder / "table.bin").symlink_to("/proc/self/pagemap")
    before = content_hash(folder)  # read, the link would fail with EINVAL
    assert folder_problem(folder, solution()).startswith("table.bin is a link to /proc/")
    assert folder_problem(folder, solution()).endswith(", outside the solution folder")
    (folder / "table.bin").unlink()
    (folder / "table.bin").symlink_to("/dev/zero")  # where it leads does not count: it never runs
    assert content_hash(folder) == before
    (folder / "table.bin").unlink()
    (folder / "table.bin").symlink_to("../nowhere/table.bin")  # leading out, to nothing: still out
    assert folder_problem(folder, solution()) == f"table.bin is a link to {folder.parent}/nowhere/table.bin, " \
                                                 "outside the solution folder"


def test_a_link_to_a_file_inside_is_that_file_and_a_link_to_a_folder_is_refused(folder):
    (folder / "alias.py").symlink_to("sub/util.py")
    assert folder_files(folder)["alias.py"] == b"K = 1\n"
    assert folder_problem(folder, solution(entry_point="alias.py::run")) is None
    (folder / "tree").symlink_to("sub")
    assert folder_problem(folder, solution()).endswith("/sub, which is not a file")


@pytest.mark.parametrize("relative", ["sub/../../outside.py", "../outside.py", "/etc/passwd", ""])
def test_read_file_reads_no_path_that_leaves_the_folder(folder, relative):
    """`..` is no link: opened name by name without following one, it still climbed out of the folder."""
    (folder.parent / "outside.py").write_text("SECRET\n")
    with pytest.raises(FolderError, match="is no path inside the folder"):
        read_file(folder, relative)


def test_read_file_follows_no_link_and_opens_no_fifo(folder):
    (folder / "alias.py").symlink_to("kernel.py")
    os.mkfifo(folder / "pipe")
    assert read_file(folder, "kernel.py") == KERNEL.encode()
    with pytest.raises(FolderError, match="alias.py cannot be read"):
        read_file(folder, "alias.py")
    with pytest.raises(FolderError, match="pipe is not a regular file"):
        read_file(folder, "pipe")  # returns at once: opened without blocking


# A folder changing while it is walked. Red team: the folder's owner swapped sub-folder `a` for a link to a root-only
# folder (renameat2 RENAME_EXCHANGE, every 15 ms) while the root runner staged it; the walk had lstat'ed `a`, then
# listed it by path and read its files by path (O_NOFOLLOW guards a path's last name only), and staged the secret.
# Here the swap is made at once, from inside the walk, at the moment the race needed.

SECRET = b"RUNNER-SECRET\n"


def swap_when(monkeypatch, module, function: str, name: str, swapped: Path, replacement: Path) -> None:
    """Once `module.function` has been called on a path whose last name is `name`, `swapped` is moved out of its
    folder and `replacement` (a link, or a folder, from outside) takes its name, as renameat2's RENAME_EXCHANGE
    swaps them."""
    original = getattr(module, function)

    def hooked(path, *args, **kwargs):
        try:
            return original(path, *args, **kwargs)
        finally:
            if os.path.basename(path) == name and not os.path.lexists(swapped.parent.parent / "honest"):
                swapped.rename(swapped.parent.parent / "honest")
                replacement.rename(swapped)
    monkeypatch.setattr(module, function, hooked)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder outside the solution's, holding a util.py of its own: what a swapped sub/ leads to."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "util.py").write_bytes(SECRET)
    return path


@pytest.mark.parametrize("swapped_for, refusal", [("link", "cannot be listed: Not a directory"),  # O_DIRECTORY
                                                   ("outside", "was replaced while the folder was read")])
def test_a_folder_swapped_after_its_lstat_is_refused_not_read(folder, outside, monkeypatch, swapped_for, refusal):
    """sub/ swapped for a link to outside/, or outside/ itself, once zz.py is read: after the walk has lstat'ed
    sub/, before it lists it. Read by path, the secret was hashed as sub/util.py; the walk opens sub/ from its
    folder's descriptor, without following a link, and only while it is the folder it lstat'ed."""
    (folder / "zz.py").write_text("")  # listed after sub/
    (folder.parent / "link").symlink_to(outside)
    swap_when(monkeypatch, os, "open", "zz.py", folder / "sub", folder.parent / swapped_for)
    with pytest.raises(FolderError) as refused:
        content_hash(folder)
    assert refused.value.message == f"{folder / 'sub'} {refusal}"


def test_a_link_whose_folder_is_swapped_after_it_is_resolved_reads_nothing_outside(folder, outside, monkeypatch):
    """A link to a file inside is read as that file: where it leads is found by path, but the file is opened name
    by name from the folder's descriptor. Swapped for a link out once the link is resolved, __pycache__/ (which the
    walk never lists, so that only the link leads there) is not opened: alias.py is hashed as a link refused, where
    read by path it was hashed as the secret."""
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "util.py").write_text("K = 1\n")
    (folder / "alias.py").symlink_to("__pycache__/util.py")
    refused, leaked = (shutil.copytree(folder, folder.parent / name, symlinks=True) for name in ("refused", "leaked"))
    (refused / "alias.py").unlink()
    (refused / "alias.py").symlink_to("/nowhere")
    (leaked / "alias.py").unlink()
    (leaked / "alias.py").write_bytes(SECRET)
    (folder.parent / "link").symlink_to(outside)
    swap_when(monkeypatch, os.path, "realpath", "alias.py", folder / "__pycache__", folder.parent / "link")
    assert content_hash(folder) != content_hash(leaked)
    assert content_hash(folder) == content_hash(refused)


def test_a_walk_holds_no_descriptor_past_its_folders_depth(tmp_path, monkeypatch):
    """Sub-folders are opened, listed and closed one at a time: 5,000 folders of one file each under a limit of
    64 open descriptors, and none left open after the walk."""
    monkeypatch.setattr(build, "MAX_ENTRIES", 10_000)
    for index in range(5_000):
        (tmp_path / "wide" / str(index)).mkdir(parents=True)
        (tmp_path / "wide" / str(index) / "k.py").write_text("")
    before = len(os.listdir("/proc/self/fd"))
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, limits[1]))
    try:
        assert len(folder_files(tmp_path / "wide")) == 5_000
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert len(os.listdir("/proc/self/fd")) == before


# Dependencies: decided without importing anything a solution names.

def test_dependencies_are_found_in_the_interpreters_library_folders():
    assert missing_dependencies(solution(dependencies=["torch>=2.0", "PyYAML", "json", "no_such_package_xyz"])) \
        == ["no_such_package_xyz"]


def test_a_package_in_the_working_directory_does_not_count_and_is_never_imported(tmp_path, monkeypatch):
    """The runner's sys.path starts with its working directory, where a repository's solutions/ lies; a red
    team's dotted dependency made find_spec import the solution folder's __init__.py in the judge."""
    package = tmp_path / "planted_package_xyz"
    package.mkdir()
    (package / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), *sys.path])
    assert missing_dependencies(solution(dependencies=["planted_package_xyz"])) == ["planted_package_xyz"]
    dotted = solution(dependencies=["planted_package_xyz.sub"])  # a distribution's name only, never a module path
    assert missing_dependencies(dotted) == ["planted_package_xyz.sub"]
    assert not (tmp_path / "ran").exists() and "planted_package_xyz" not in sys.modules


def test_a_distribution_with_a_dot_in_its_name_counts(tmp_path, monkeypatch):
    """Names such as zope.interface are distributions' own; they were refused as manifests."""
    metadata = tmp_path / "site" / "zope.fake_xyz-1.0.dist-info"
    metadata.mkdir(parents=True)
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: zope.fake_xyz\nVersion: 1.0\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "site")])
    assert missing_dependencies(solution(dependencies=["zope.fake_xyz>=1.0", "zope.other_xyz"])) == ["zope.other_xyz"]


def test_a_package_in_a_pythonpath_folder_counts_and_is_never_imported(tmp_path, monkeypatch):
    """Packages carried to a machine in a folder PYTHONPATH names (not site-packages) are installed."""
    folder = tmp_path / "site"
    (folder / "carried_package_xyz").mkdir(parents=True)
    (folder / "carried_package_xyz" / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])
    assert missing_dependencies(solution(dependencies=["carried_package_xyz"])) == []
    assert not (tmp_path / "ran").exists() and "carried_package_xyz" not in sys.modules


@pytest.fixture
def imports(monkeypatch):
    """sys.path, sys.modules and the entry modules' own names as they were, after the test's imports."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("kernel", "helper", "util"):  # an earlier test's solution, loaded in this process
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_a_sibling_importing_the_entry_file_back_gets_the_entry_module(tmp_path, imports):
    """A circular import plain Python allows (`python -c "import kernel"`): the sibling's `import kernel` is the
    entry module, half run, not a second copy, whose `from helper import scaled` would find helper half run."""
    (tmp_path / "kernel.py").write_text("from helper import scaled\n\nSCALE = 2\n\n\ndef run(x):\n"
                                        "    return scaled(x)\n")
    (tmp_path / "helper.py").write_text("import kernel\n\n\ndef scaled(x):\n    return x * kernel.SCALE\n")
    run = build.load_entry_point(tmp_path, solution(), tmp_path / "build")
    assert run(3) == 6 and sys.modules["kernel"] is sys.modules[run.__module__]


def test_an_entry_file_imports_the_folders_files_relatively_too(tmp_path, imports):
    """FlashInfer-Bench loads a solution's files as a package: its entry files may import their siblings relatively,
    and did not run here (an entry file was a top-level module). Both styles, from the top and from a subfolder."""
    (tmp_path / "kernel.py").write_text("from .helper import scaled\nfrom . import helper\n\n\ndef run(x):\n"
                                        "    return scaled(x) + helper.OFFSET\n")
    (tmp_path / "helper.py").write_text("OFFSET = 1\n\n\ndef scaled(x):\n    return x * 2\n")
    (tmp_path / "src" / "ops").mkdir(parents=True)
    (tmp_path / "src" / "kernel.py").write_text("from .ops.core import scaled\nfrom ..helper import OFFSET\n"
                                                "from helper import scaled as by_name\n\n\ndef run(x):\n"
                                                "    return scaled(x) + OFFSET + by_name(x)\n")
    (tmp_path / "src" / "ops" / "core.py").write_text("def scaled(x):\n    return x * 3\n")
    assert build.load_entry_point(tmp_path, solution(), tmp_path / "build")(2) == 5
    assert build.load_entry_point(tmp_path, solution(entry_point="src/kernel.py::run"), tmp_path / "build")(2) == 11


def test_an_entry_file_runs_once_and_loads_from_any_folder_name(tmp_path, imports):
    """A subfolder's __init__.py importing the entry back ran the entry file twice when the loader imported the
    subfolder's package first; a subfolder named v1.2 cannot be a package and failed to load."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "__init__.py").write_text("from src.kernel import run\n")
    (tmp_path / "src" / "kernel.py").write_text("import builtins\nbuiltins.loads = getattr(builtins, 'loads', 0) + 1\n"
                                                "\n\ndef run(x):\n    return x\n")
    (tmp_path / "v1.2").mkdir()
    (tmp_path / "v1.2" / "kernel.py").write_text(KERNEL)
    try:
        assert build.load_entry_point(tmp_path, solution(entry_point="src/kernel.py::run"), tmp_path / "build")(3) == 3
        import builtins
        assert builtins.loads == 1
    finally:
        import builtins
        builtins.__dict__.pop("loads", None)
    assert build.load_entry_point(tmp_path, solution(entry_point="v1.2/kernel.py::run"), tmp_path / "build")(1) == 1


def test_a_subfolder_package_importing_its_entry_file_back_loads_as_python_would(tmp_path, imports):
    """`import pkg.kernel` runs pkg/__init__.py first, whose `from .kernel import run` imports the entry whole; the
    loader ran the entry first, so its `from .util import` ran __init__.py, which found the entry half run."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .kernel import run\n")
    (tmp_path / "pkg" / "util.py").write_text("OFFSET = 1\n")
    (tmp_path / "pkg" / "kernel.py").write_text("import builtins\nfrom .util import OFFSET\n"
                                                "builtins.loads = getattr(builtins, 'loads', 0) + 1\n\n\n"
                                                "def run(x):\n    return x + OFFSET\n")
    import builtins

    try:
        assert build.load_entry_point(tmp_path, solution(entry_point="pkg/kernel.py::run"), tmp_path / "build")(1) == 2
        assert build.load_entry_point(tmp_path, solution(entry_point="pkg/__init__.py::run"), tmp_path / "b")(2) == 3
        assert builtins.loads == 1
    finally:
        builtins.__dict__.pop("loads", None)


@pytest.mark.parametrize("entry", ["flash-decode.py", "mla-decode/kernel.py"])
def test_an_entry_path_that_is_no_identifier_imports_relatively(tmp_path, imports, entry):
    """FlashInfer-Bench imports such a file as a module of its package; here it was a top-level module, whose
    `from .helper import` found no parent package."""
    (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / entry).write_text("from .helper import OFFSET\n\n\ndef run(x):\n    return x + OFFSET\n")
    (tmp_path / entry).with_name("helper.py").write_text("OFFSET = 1\n")
    assert build.load_entry_point(tmp_path, solution(entry_point=f"{entry}::run"), tmp_path / "build")(1) == 2


def test_the_solution_package_reads_its_files_through_importlib_resources(tmp_path, imports):
    """files(__package__) failed with 'Invalid path': the package had no namespace loader to read files through."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "scale.txt").write_text("3")
    (tmp_path / "kernel.py").write_text("import importlib.resources\n\n"
                                        "SCALE = int(importlib.resources.files(__package__).joinpath('data/scale.txt')"
                                        ".read_text())\n\n\ndef run(x):\n    return x * SCALE\n")
    assert build.load_entry_point(tmp_path, solution(), tmp_path / "build")(2) == 6


def test_an_entry_file_never_hides_a_module_of_its_name(tmp_path, imports):
    (tmp_path / "json.py").write_text(KERNEL)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "kernel.py").write_text(KERNEL)
    (tmp_path / "util").mkdir()  # a package: what `import util` finds, not util.py
    (tmp_path / "util" / "__init__.py").write_text("")
    (tmp_path / "util.py").write_text(KERNEL)
    import json

    for entry in ("json.py", "sub/kernel.py", "util.py"):
        assert build.load_entry_point(tmp_path, solution(entry_point=f"{entry}::run"), tmp_path / "build")(1) == 1
    assert sys.modules["json"] is json and "kernel" not in sys.modules and "util" not in sys.modules


def test_a_second_solution_loaded_in_the_process_gets_its_own_entry_module(tmp_path, imports):
    """api.best() loads several solutions in one process: each sibling's `import kernel` is its own entry."""
    for scale in (2, 5):
        folder = tmp_path / f"s{scale}"
        folder.mkdir()
        (folder / "kernel.py").write_text(f"from helper import scaled\n\nSCALE = {scale}\n\n\ndef run(x):\n"
                                          "    return scaled(x)\n")
        (folder / "helper.py").write_text("import kernel\n\n\ndef scaled(x):\n    return x * kernel.SCALE\n")
        for name in ("helper",):  # the first solution's sibling, as a worker for the second would not have it
            sys.modules.pop(name, None)
        assert build.load_entry_point(folder, solution(), folder / "build")(1) == scale


def test_a_builtin_module_name_is_never_taken_by_an_entry_file(tmp_path, imports):
    name = next(n for n in sys.builtin_module_names if n.isidentifier() and n not in sys.modules)
    (tmp_path / f"{name}.py").write_text(KERNEL)
    assert build.load_entry_point(tmp_path, solution(entry_point=f"{name}.py::run"), tmp_path / "build")(1) == 1
    assert name not in sys.modules or not sys.modules[name].__name__.startswith("flashbench_solution_")


def test_an_entry_file_that_fails_to_import_leaves_no_module_of_its_name(tmp_path, imports):
    (tmp_path / "kernel.py").write_text("raise ValueError('no')\n")
    with pytest.raises(build.BuildError, match="no"):
        build.load_entry_point(tmp_path, solution(), tmp_path / "build")
    assert "kernel" not in sys.modules


def test_a_missing_cuda_toolchain_is_found_by_the_judge(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert build.missing_toolchain().startswith("nvcc")


def test_write_whole_replaces_a_file_at_once_or_not_at_all(tmp_path, monkeypatch):
    """What the recorder restores a trace file with and the cached reference is written by: a reader sees the
    old bytes or the new ones, and a failed write leaves the old ones and no temporary file."""
    target = tmp_path / "op.jsonl"
    target.write_bytes(b"old\n")
    build.write_whole(target, b"new\n")
    assert target.read_bytes() == b"new\n" and oct(target.stat().st_mode & 0o777) == "0o644"
    monkeypatch.setattr(build.os, "replace", lambda *_: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        build.write_whole(target, b"newer\n")
    assert target.read_bytes() == b"new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["op.jsonl"]
