"""Finding definitions, workload sets and solution folders, and the folder rules the registry enforces."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import nested_folders
from flashbench import FlashbenchError, Repo, validate
from flashbench.model import loading
from flashbench.build import FolderError, content_hash, folder_files, folder_problem, same_content
from flashbench.registry import find_root, load_solution_folder
from flashbench.run import RunOptions, Runner, install_solution, select_workloads
from flashbench.run.plan import stage_solution

REPO = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
PREFILL = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"


@pytest.fixture(scope="module")
def repo():
    return Repo(REPO)


@pytest.fixture
def root(tmp_path):
    shutil.copytree(REPO / "definitions", tmp_path / "definitions")
    shutil.copytree(REPO / "references", tmp_path / "references")
    (tmp_path / "solutions").mkdir()
    return tmp_path


def add_solution(root: Path, folder: str, definition: str, name="mine") -> Path:
    path = root / "solutions" / folder / name
    path.mkdir(parents=True)
    (path / "solution.yaml").write_text(yaml.safe_dump({
        "name": name, "definition": definition, "author": "tests", "language": "python",
        "entry_point": "kernel.py::run", "destination_passing_style": False,
    }))
    inputs = Repo(REPO).definition(definition).inputs
    (path / "kernel.py").write_text(f"def run({', '.join(inputs)}):\n    raise NotImplementedError\n")
    return path


def test_names_are_sorted_and_include_the_mla_definitions(repo):
    names = repo.names()
    assert names == sorted(names)
    assert {DECODE, PREFILL} <= set(names)


@pytest.mark.parametrize("query, expected", [
    (DECODE, DECODE),
    (PREFILL, PREFILL),
    ("mla_paged_decode", DECODE),
    ("mla_paged_p", PREFILL),
])
def test_resolve_exact_and_unique_prefix(repo, query, expected):
    assert repo.resolve(query) == expected
    assert repo.definition(query).name == expected


def test_resolve_ambiguous_prefix_lists_both(repo):
    with pytest.raises(FlashbenchError) as info:
        repo.resolve("mla")
    message = str(info.value)
    assert "ambiguous" in message and DECODE in message and PREFILL in message


def test_resolve_unknown_lists_close_names(repo):
    with pytest.raises(FlashbenchError) as info:
        repo.resolve("mla_paged_decod_h16_ckv512")
    message = str(info.value)
    assert "no definition named 'mla_paged_decod_h16_ckv512'" in message and DECODE in message


def test_resolve_unknown_with_nothing_close_lists_all(repo):
    with pytest.raises(FlashbenchError) as info:
        repo.resolve("gemm")
    assert DECODE in str(info.value) and PREFILL in str(info.value)


def test_paths(repo):
    assert repo.definition_path("mla_paged_decode") == REPO / "definitions" / "mla_paged" / f"{DECODE}.yaml"
    assert repo.workloads_path("mla_paged_decode").name == f"{DECODE}.workloads.yaml"
    assert repo.workload_set("mla_paged_decode").definition == DECODE


def test_duplicate_definition_names(root):
    source = root / "definitions" / "mla_paged" / f"{DECODE}.yaml"
    copy = source.with_suffix(".yml")
    shutil.copy(source, copy)
    with pytest.raises(FlashbenchError) as info:
        Repo(root).names()
    assert info.value.field == "name"
    assert "is also defined in" in info.value.message
    assert {info.value.file, info.value.message.split()[-1]} == {str(source), str(copy)}


def test_duplicate_definition_names_across_folders(root):
    data = yaml.safe_load((root / "definitions" / "mla_paged" / f"{DECODE}.yaml").read_text())
    data["op_type"] = "attention"
    other = root / "definitions" / "attention" / f"{DECODE}.yaml"
    other.parent.mkdir()
    other.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(FlashbenchError, match="is also defined in"):
        Repo(root).names()


def test_workload_set_naming_the_wrong_definition(root):
    path = root / "definitions" / "mla_paged" / f"{DECODE}.workloads.yaml"
    data = yaml.safe_load(path.read_text())
    data["definition"] = PREFILL
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FlashbenchError) as info:
        Repo(root).workload_set(DECODE)
    assert info.value.file == str(path) and info.value.field == "definition"
    assert PREFILL in info.value.message

    # validate catches it too, and says the same
    results = {c.path: c for c in validate(Repo(root), [path])}
    assert not results[path].ok and "definition" in results[path].error and PREFILL in results[path].error


def test_workload_set_naming_a_prefix_of_its_definition(root):
    path = root / "definitions" / "mla_paged" / f"{DECODE}.workloads.yaml"
    data = yaml.safe_load(path.read_text())
    data["definition"] = "mla_paged_decode"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FlashbenchError):
        Repo(root).workload_set(DECODE)
    assert not {c.path: c for c in validate(Repo(root), [path])}[path].ok


def test_missing_workload_set_is_none(root):
    (root / "definitions" / "mla_paged" / f"{DECODE}.workloads.yaml").unlink()
    assert Repo(root).workload_set(DECODE) is None


def test_solution_folders_are_found(root):
    path = add_solution(root, DECODE, DECODE)
    found = Repo(root).solution_folders("mla_paged_decode")
    assert [f.path for f in found] == [path]
    assert found[0].solution.entry_function == "run"
    assert Repo(root).solution_folders(PREFILL) == []
    assert all(c.ok for c in validate(Repo(root), [root / "solutions"]))


def test_validate_refuses_two_folders_a_reader_takes_for_one(root):
    """`mine` and `rnine` under one definition are two board rows that read as one: a run refuses a folder
    from elsewhere named so, and validate now says it of both repository folders; names apart pass."""
    mine, rnine = add_solution(root, DECODE, DECODE, "mine"), add_solution(root, DECODE, DECODE, "rnine")
    add_solution(root, DECODE, DECODE, "other")
    results = {c.path: c for c in validate(Repo(root), [root / "solutions"])}
    assert "'rnine' reads as 'mine'" in results[rnine].error and "'mine' reads as 'rnine'" in results[mine].error
    assert results[root / "solutions" / DECODE / "other"].ok
    outside = add_solution(root / "elsewhere", DECODE, DECODE, "0ther")
    [checked] = validate(Repo(root), [outside])
    assert "'0ther' reads as 'other'" in checked.error


def test_validate_loads_a_definitions_folders_once(root, monkeypatch):
    """Each folder's name is checked against the others: loading them all again for each made validating a
    repository quadratic in its folders."""
    for name in ("one", "two", "three"):
        add_solution(root, DECODE, DECODE, name)
    repo = Repo(root)
    loads = []
    real = Repo.solution_folders
    monkeypatch.setattr(Repo, "solution_folders", lambda self, name: loads.append(name) or real(self, name))
    assert all(c.ok for c in validate(repo, [root / "solutions"]))
    assert loads == [DECODE]


def test_validate_walks_deep_folders_without_recursion(root):
    """1,500 nested folders under solutions/_shared/ ended `validate` in a RecursionError."""
    deep = root / "solutions" / "_shared" / "deep"
    deep.mkdir(parents=True)
    add_solution(root, DECODE, DECODE, "mine")
    with nested_folders(deep, 1500):
        results = validate(Repo(root), [root / "solutions"])
    assert [c.path.name for c in results] == ["mine"] and results[0].ok


def test_solution_folder_under_the_wrong_definition(root):
    path = add_solution(root, DECODE, PREFILL)
    assert Repo(root).solution_folders(DECODE) == []
    [problem] = Repo(root).invalid_solution_folders(DECODE)
    assert problem.file == str(path / "solution.yaml") and problem.field == "definition"
    assert f"solutions/{DECODE}/" in problem.message

    results = {c.path: c for c in validate(Repo(root), [path])}
    assert results[path].kind == "solution" and not results[path].ok
    assert f"{path / 'solution.yaml'}: definition:" in results[path].error


def test_solution_with_missing_entry_file(root):
    path = add_solution(root, DECODE, DECODE)
    (path / "kernel.py").unlink()
    with pytest.raises(FlashbenchError) as info:
        load_solution_folder(path)
    assert info.value.field == "entry_point" and "kernel.py" in info.value.message
    assert Repo(root).solution_folders(DECODE) == [] and len(Repo(root).invalid_solution_folders(DECODE)) == 1


def test_solution_naming_an_unknown_definition_fails_validation(root):
    path = add_solution(root, DECODE, DECODE)
    manifest = path / "solution.yaml"
    data = yaml.safe_load(manifest.read_text())
    data["definition"] = "gemm_n4096"
    manifest.write_text(yaml.safe_dump(data))
    results = {c.path: c for c in validate(Repo(root), [path])}
    assert not results[path].ok and "no definition named 'gemm_n4096'" in results[path].error


def test_solution_with_wrong_signature_fails_validation(root):
    path = add_solution(root, DECODE, DECODE)
    (path / "kernel.py").write_text("def run(q_nope, q_pe):\n    pass\n")
    results = {c.path: c for c in validate(Repo(root), [path])}
    assert not results[path].ok and "entry_point" in results[path].error and "run takes (q_nope, q_pe)" in results[path].error


DECODE_PARAMETERS = "q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale"


@pytest.mark.parametrize("source, ok", [
    ("from decode_core import decode as run\n", True),  # a callable the import alone can tell
    ("from .decode_core import *\n", True),  # an import of every name may bind it
    (f"def make():\n    def run({DECODE_PARAMETERS}):\n        pass\n    return run, run\nrun, run_sink = make()\n",
     True),
    (f"import torch\ndef decode({DECODE_PARAMETERS}):\n    pass\nrun = torch.no_grad()(decode)\n", True),
    ("try:\n    import triton\nexcept ImportError:\n    pass\nelse:\n"
     f"    def run({DECODE_PARAMETERS}):\n        pass\n", True),
    (f"def run({DECODE_PARAMETERS}, block=64, *, warps=4):\n    pass\n", True),  # more, with defaults
    (f"def run({DECODE_PARAMETERS}, block):\n    pass\n", False),
    (f"def run({DECODE_PARAMETERS}, *, warps):\n    pass\n", False),
    ("def run(q_pe, q_nope, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):\n    pass\n", False),  # order
    ("def decode():\n    pass\nif False:\n    x = 1\n", False),
])
def test_an_entry_function_is_found_wherever_the_import_defines_it_and_takes_the_inputs_in_order(root, source, ok):
    """validate refused entry files that `run` imports and calls: a function bound by an import or an
    assignment, a def inside a top-level try, a parameter more with a default."""
    path = add_solution(root, DECODE, DECODE)
    (path / "kernel.py").write_text(source)
    results = {c.path: c for c in validate(Repo(root), [path])}
    assert results[path].ok == ok, results[path].error


def test_a_manifest_that_is_a_pipe_is_an_invalid_solution_not_a_crash(root, tmp_path):
    """validate took a folder whose solution.yaml is a named pipe for a folder to walk (NotADirectoryError)."""
    folder = tmp_path / "piped"
    folder.mkdir()
    os.mkfifo(folder / "solution.yaml")

    [checked] = validate(Repo(root), [folder])

    assert checked.kind == "solution" and not checked.ok and "not a regular file" in checked.error


def test_validate_walks_no_link_to_a_folder(root, tmp_path):
    """Two links to the folder they sit in made the walk grow as 2^depth: validate ran for ever."""
    folder = tmp_path / "links"
    folder.mkdir()
    (folder / "a").symlink_to(".")
    (folder / "b").symlink_to(".")
    add_solution(root, DECODE, DECODE)
    (folder / "mine").symlink_to(root / "solutions" / DECODE / "mine")

    assert [checked.path for checked in validate(Repo(root), [folder])] == []


@pytest.mark.parametrize("source", [b"x = " + b"-" * 100_000 + b"1\n", b"x = " + b"1+" * 200_000 + b"1\n",
                                    b"def run():\n    return '\xff'\n", b"x = 1\0\n"])
def test_an_entry_source_the_parser_cannot_hold_fails_validation_with_one_line(root, source):
    """Nested operators ran the parser out of stack (RecursionError) or memory, a byte that is not UTF-8 or a
    NUL raised another error type: a traceback, and a whole-repo validate reported none of the other folders."""
    path = add_solution(root, DECODE, DECODE)
    (path / "kernel.py").write_bytes(source)
    results = {c.path: c for c in validate(Repo(root), [path])}
    assert not results[path].ok and "entry_point" in results[path].error


def test_an_entry_file_linked_to_a_fifo_fails_validation_without_blocking(root, tmp_path):
    """An entry file linked to something that blocks on read (/proc/kmsg for a root runner) hung validate."""
    path = add_solution(root, DECODE, DECODE)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (path / "kernel.py").unlink()
    (path / "kernel.py").symlink_to(fifo)
    results = {c.path: c for c in validate(Repo(root), [path])}
    assert not results[path].ok


def test_find_root_searches_upwards(root, monkeypatch):
    monkeypatch.delenv("FLASHBENCH_ROOT", raising=False)
    nested = root / "solutions" / "deep" / "er"
    nested.mkdir(parents=True)
    assert find_root(nested) == root.resolve()


def test_find_root_from_environment(root, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FLASHBENCH_ROOT", str(root))
    assert find_root(tmp_path_factory.mktemp("elsewhere")) == root.resolve()


def test_find_root_without_definitions(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHBENCH_ROOT", raising=False)
    with pytest.raises(FlashbenchError, match="no definitions/ folder"):
        find_root(tmp_path)


def test_a_solution_may_not_take_the_references_name(root):
    """The runner times the definition's reference under that name; a folder taking it would stand in for the
    reference on boards (every speedup is over it)."""
    path = add_solution(root, DECODE, DECODE, name="reference")
    with pytest.raises(FlashbenchError) as info:
        load_solution_folder(path)
    assert info.value.field == "name" and "reference" in info.value.message


def test_an_oversized_manifest_is_refused_with_one_line(root):
    """The manifest travels whole to the worker in its first message: a 2 MiB description made the worker
    refuse that frame and the run end."""
    path = add_solution(root, DECODE, DECODE)
    manifest = yaml.safe_load((path / "solution.yaml").read_text())
    (path / "solution.yaml").write_text(yaml.safe_dump({**manifest, "description": "x" * (2 << 20)}))
    with pytest.raises(FlashbenchError) as info:
        load_solution_folder(path)
    assert "a manifest may have 64 KiB" in info.value.message and info.value.file == str(path / "solution.yaml")


def test_a_file_larger_than_a_document_may_be_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "MAX_DOCUMENT_BYTES", 1024)
    path = tmp_path / "solution.yaml"
    path.write_text("name: x\n" + "# padding\n" * 200)
    with pytest.raises(FlashbenchError, match=f"{path}: larger than 0 MiB"):
        loading.read_document(path)


def test_a_manifest_with_yaml_aliases_is_refused(root):
    """3,000 aliases of one 2,000-character string: 14 KB of file, 6 MB once parsed, more than the worker's
    first message may carry (the run ended with a broken pipe)."""
    path = add_solution(root, DECODE, DECODE)
    text = (path / "solution.yaml").read_text()
    (path / "solution.yaml").write_text(text + "target_hardware: [&h " + "H" * 2000 + ", " + ", ".join(["*h"] * 3000) + "]\n")
    with pytest.raises(FlashbenchError) as info:
        load_solution_folder(path)
    assert "a YAML alias" in info.value.message and info.value.file == str(path / "solution.yaml")


@pytest.mark.parametrize(
    "levels, message",
    [
        (40, "nested deeper than 32 levels"),
        # PyYAML 6.0.4's scanner stops at 1,000 levels before the parser reaches the check; older ones do not.
        (32000, "nested deeper than 32 levels|exceeded maximum nesting depth"),
    ],
)
def test_a_manifest_nested_past_the_limit_is_refused_before_it_is_built(root, levels, message):
    """32,000 nested brackets (64 KB) made libyaml's composer overflow the C stack: the runner died (SIGSEGV)."""
    path = add_solution(root, DECODE, DECODE)
    text = (path / "solution.yaml").read_text()
    (path / "solution.yaml").write_text(text + "target_hardware: " + "[" * levels + "]" * levels + "\n")
    with pytest.raises(FlashbenchError, match=message):
        load_solution_folder(path)


@pytest.mark.parametrize("value", ["2001-13-45", "9" * 5000])
def test_a_manifest_value_yaml_cannot_build_is_refused_with_one_line(root, value):
    """A date past the calendar and an integer past Python's digit limit raise ValueError while the value is
    built, not a YAML error: either stopped every run, board and validation of the definition."""
    good = add_solution(root, DECODE, DECODE, name="good")
    bad = add_solution(root, DECODE, DECODE, name="bad")
    (bad / "solution.yaml").write_text((bad / "solution.yaml").read_text() + f"extra: {value}\n")
    with pytest.raises(FlashbenchError) as info:
        load_solution_folder(bad)
    assert "invalid YAML value" in info.value.message and info.value.file == str(bad / "solution.yaml")
    assert [f.path for f in Repo(root).solution_folders(DECODE)] == [good]


def test_an_invalid_folder_leaves_the_definitions_other_folders_usable(root):
    """One bad folder under solutions/<definition>/ stopped every run of the definition."""
    good = add_solution(root, DECODE, DECODE, name="good")
    bad = add_solution(root, DECODE, DECODE, name="bad")
    (bad / "solution.yaml").write_text((bad / "solution.yaml").read_text() + "bogus: 1\n")
    repo = Repo(root)
    assert [f.path for f in repo.solution_folders(DECODE)] == [good]
    [problem] = repo.invalid_solution_folders(DECODE)
    assert problem.file == str(bad / "solution.yaml") and "unknown key" in problem.message


@pytest.mark.parametrize("target", ["/proc/kmsg", "/dev/zero", "elsewhere.yaml"])
def test_a_manifest_that_is_a_link_is_refused_without_reading_it(root, target):
    """Read through a link, /proc/kmsg held a root runner in a blocking read at selection."""
    path = add_solution(root, DECODE, DECODE)
    (path / "elsewhere.yaml").write_text((path / "solution.yaml").read_text())
    (path / "solution.yaml").unlink()
    (path / "solution.yaml").symlink_to(target)
    with pytest.raises(FlashbenchError, match="solution.yaml is a link"):
        load_solution_folder(path)


def test_a_manifest_that_is_not_a_regular_file_is_refused_without_blocking(root):
    path = add_solution(root, DECODE, DECODE)
    (path / "solution.yaml").unlink()
    os.mkfifo(path / "solution.yaml")
    with pytest.raises(FlashbenchError, match="not a regular file"):
        load_solution_folder(path)


# --- shared folders: solutions/_shared/<name>/, named by a solution's `shared` field ---------------

def add_shared(root: Path, name: str, files: dict[str, str]) -> Path:
    folder = root / "solutions" / "_shared" / name
    for relative, text in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    return folder


def share(path: Path, *names: str) -> None:
    """Sets the `shared` field of the solution's manifest."""
    manifest = path / "solution.yaml"
    data = yaml.safe_load(manifest.read_text())
    manifest.write_text(yaml.safe_dump({**data, "shared": list(names)}))


def kernel_in_shared_folder(root: Path, name="kernel") -> tuple[Path, Path]:
    """A solution whose entry file lives in a shared folder (its own folder: solution.yaml only)."""
    path = add_solution(root, DECODE, DECODE)
    shared = add_shared(root, name, {"kernel.py": (path / "kernel.py").read_text()})
    (path / "kernel.py").unlink()
    share(path, name)
    return path, shared


def shared_error(path: Path) -> FlashbenchError:
    with pytest.raises(FlashbenchError) as info:
        load_solution_folder(path)
    assert info.value.file == str(path / "solution.yaml") and info.value.field == "shared", info.value
    return info.value


@pytest.mark.parametrize("name", ["../kernel", "kernel/..", "a/b", ".", "..", "/tmp/kernel", ".hidden", ""])
def test_shared_names_one_folder_in_shared_by_name(root, name):
    path, _ = kernel_in_shared_folder(root)
    share(path, name)
    assert "must be the name of a folder in solutions/_shared/" in shared_error(path).message
    results = {c.path: c for c in validate(Repo(root), [path])}
    assert not results[path].ok and "shared" in results[path].error


def test_shared_folder_named_twice(root):
    path, _ = kernel_in_shared_folder(root)
    share(path, "kernel", "kernel")
    assert "'kernel' named more than once" in shared_error(path).message


def test_missing_shared_folder(root):
    path, shared = kernel_in_shared_folder(root)
    shutil.rmtree(shared)
    assert "no folder 'kernel' in" in shared_error(path).message
    assert not validate(Repo(root), [path])[0].ok


def test_entry_file_in_a_shared_folder(root):
    path, shared = kernel_in_shared_folder(root)
    (loaded,) = Repo(root).solution_folders(DECODE)
    assert loaded.shared == (shared,) and loaded.entry_folder == shared
    assert set(loaded.files) == {"solution.yaml", "kernel.py"}
    assert all(c.ok for c in validate(Repo(root), [root / "solutions"]))
    (shared / "kernel.py").write_text("def run(q_nope, q_pe):\n    pass\n")  # the signature is checked there
    (checked,) = validate(Repo(root), [path])
    assert not checked.ok and "run takes (q_nope, q_pe)" in checked.error


def test_entry_file_nowhere(root):
    path, shared = kernel_in_shared_folder(root)
    (shared / "kernel.py").rename(shared / "other.py")
    with pytest.raises(FlashbenchError) as info:
        load_solution_folder(path)
    assert info.value.field == "entry_point" and "nor in its shared folders" in info.value.message


@pytest.mark.parametrize("where", ["the solution folder", "another shared folder"])
def test_a_path_may_be_in_one_folder_only(root, where):
    path, _ = kernel_in_shared_folder(root)
    if where == "the solution folder":
        (path / "kernel.py").write_text("def run(): pass\n")
        share(path, "kernel")
    else:
        add_shared(root, "other", {"kernel.py": "def run(): pass\n"})
        share(path, "kernel", "other")
    message = shared_error(path).message
    assert "kernel.py is in _shared/" in message and "a path may be in one of them only" in message


def test_a_link_out_of_a_shared_folder_is_refused(root, tmp_path_factory):
    path, shared = kernel_in_shared_folder(root)
    outside = tmp_path_factory.mktemp("outside") / "secret.py"
    outside.write_text("x = 1\n")
    (shared / "helper.py").symlink_to(outside)
    assert "_shared/kernel/helper.py is a link to" in shared_error(path).message
    assert not validate(Repo(root), [path])[0].ok


@pytest.mark.parametrize("link", ["loop", "nowhere", "folder"])
def test_a_link_loop_or_dangling_link_in_a_shared_folder_is_a_one_line_error(root, link):
    """Found by the same bounded walk as a solution folder's, never by following the link."""
    path, shared = kernel_in_shared_folder(root)
    if link == "loop":
        (shared / "a.py").symlink_to(shared / "b.py")
        (shared / "b.py").symlink_to(shared / "a.py")
    elif link == "nowhere":
        (shared / "a.py").symlink_to(shared / "missing.py")
    else:
        (shared / "sub").mkdir()
        (shared / "a.py").symlink_to(shared / "sub")
    message = shared_error(path).message
    assert message.startswith("_shared/kernel/a.py is a link") and "\n" not in message
    assert not validate(Repo(root), [path])[0].ok


def test_a_link_inside_a_shared_folder_is_kept(root):
    path, shared = kernel_in_shared_folder(root)
    (shared / "alias.py").symlink_to(shared / "kernel.py")
    assert "alias.py" in load_solution_folder(path).files


@pytest.mark.parametrize("linked", ["the shared folder", "_shared itself"])
def test_a_shared_folder_reached_through_a_link_is_refused(root, tmp_path_factory, linked):
    path, shared = kernel_in_shared_folder(root)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    moved = shared if linked == "the shared folder" else shared.parent
    shutil.move(moved, elsewhere / moved.name)
    moved.symlink_to(elsewhere / moved.name)
    assert "through a link" in shared_error(path).message


def test_the_content_hash_covers_shared_files(root):
    path, shared = kernel_in_shared_folder(root)
    loaded = load_solution_folder(path)
    before = loaded.content_hash()
    assert before != content_hash(path)  # its own folder alone is solution.yaml only
    (shared / "NOTES.md").write_text("documentation leaves the hash alone, shared or not\n")
    assert loaded.content_hash() == before
    (shared / "kernel.py").write_text((shared / "kernel.py").read_text() + "# changed\n")
    assert loaded.content_hash() != before


def test_the_hash_of_a_folder_is_what_it_was(root):
    """Without shared folders a solution's hash is the hash of its folder's files as it always was, now
    kept to 128 bits: a record of the 64-bit form still names the same content (a change of scheme
    would make every recorded trace stale)."""
    path = add_solution(root, DECODE, DECODE)
    (path / "sub").mkdir()
    (path / "sub" / "b.cu").write_text("// b\n")
    (path / "NOTES.md").write_text("notes\n")
    digest = hashlib.sha256()
    for name in ("kernel.py", "solution.yaml", "sub/b.cu"):
        digest.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
    assert content_hash(path) == load_solution_folder(path).content_hash() == digest.hexdigest()[:32]
    assert same_content(digest.hexdigest()[:16], content_hash(path))
    assert not same_content(digest.hexdigest()[:16], "0" * 32) and not same_content(content_hash(path)[:20],
                                                                                    content_hash(path))


def test_two_folders_made_to_share_a_hash_run_their_own_files(root, tmp_path, monkeypatch):
    """A staged folder is used again only while it holds the same files: its name, a hash, is not trusted."""
    import flashbench.run.plan as plan

    first, second = add_solution(root, DECODE, DECODE, "first"), add_solution(root, DECODE, DECODE, "second")
    (second / "kernel.py").write_text("def run(*args):\n    return None  # wrong\n")
    monkeypatch.setattr(plan, "content_hash", lambda folder: "f" * 32)  # a collision, made
    staged_first = stage_solution(load_solution_folder(first), tmp_path / "staged")
    first_kernel = (staged_first / "kernel.py").read_bytes()
    staged_second = stage_solution(load_solution_folder(second), tmp_path / "staged")
    assert (staged_second / "kernel.py").read_bytes() == (second / "kernel.py").read_bytes() != first_kernel


def test_the_staged_folder_holds_every_file_under_its_hash(root, tmp_path):
    path, shared = kernel_in_shared_folder(root)
    add_shared(root, "helpers", {"lib/util.py": "K = 1\n"})
    share(path, "kernel", "helpers")
    loaded = load_solution_folder(path)
    staged = stage_solution(loaded, tmp_path / "staged")
    assert staged.name == loaded.content_hash() == content_hash(staged)
    assert sorted(folder_files(staged)) == ["kernel.py", "lib/util.py", "solution.yaml"]
    assert folder_problem(staged, loaded.solution) is None
    assert stage_solution(loaded, tmp_path / "staged") == staged  # staged once per content
    (staged / "kernel.py").write_text("tampered = True\n")
    assert stage_solution(loaded, tmp_path / "staged") == staged
    assert (staged / "kernel.py").read_text() == (shared / "kernel.py").read_text()


def test_a_link_out_of_the_solution_folder_is_refused_before_anything_is_staged(root, tmp_path, tmp_path_factory):
    path, _ = kernel_in_shared_folder(root)
    outside = tmp_path_factory.mktemp("outside") / "secret.py"
    outside.write_text("x = 1\n")
    (path / "helper.py").symlink_to(outside)
    with pytest.raises(FolderError, match="^helper.py is a link to"):
        stage_solution(load_solution_folder(path), tmp_path / "staged")
    assert list((tmp_path / "staged").iterdir()) == []


def test_a_link_the_solution_brings_over_a_shared_folders_path_is_refused(root, tmp_path_factory):
    """The solution folder's link `d` leading out, and a shared folder's file `d/zz.pth`: staging copied the link,
    then wrote the shared file through it, as the runner, wherever it led (a .pth in site-packages runs in every
    later interpreter), before the link was refused (tests/test_plan.py: staging itself writes through no link)."""
    path, _ = kernel_in_shared_folder(root)
    add_shared(root, "payload", {"d/zz.pth": "import os\n"})
    share(path, "kernel", "payload")
    (path / "d").symlink_to(tmp_path_factory.mktemp("site-packages"))
    assert "d is in _shared/payload and in the solution folder" in str(shared_error(path))


@pytest.mark.parametrize("mine", ["file", "link to a file"])
def test_a_file_where_a_shared_folder_has_a_folder_is_refused(root, mine):
    """A file `d` in the solution folder and `d/x.py` in a shared one passed validate, and staging them ended the
    whole run (one folder stopped every other solution's pairs)."""
    path, _ = kernel_in_shared_folder(root)
    add_shared(root, "payload", {"d/x.py": "X = 1\n"})
    share(path, "kernel", "payload")
    if mine == "file":
        (path / "d").write_text("")
    else:
        (path / "d").symlink_to("solution.yaml")
    assert str(shared_error(path)).endswith("d is in _shared/payload and in the solution folder; a path may be in "
                                            "one of them only")


def test_files_under_one_folder_name_in_two_folders_are_allowed(root, tmp_path):
    path, _ = kernel_in_shared_folder(root)
    add_shared(root, "more", {"include/b.h": "int b;\n"})
    add_shared(root, "base", {"include/a.h": "int a;\n"})
    share(path, "kernel", "base", "more")
    staged = stage_solution(load_solution_folder(path), tmp_path / "staged")
    assert sorted(p.name for p in (staged / "include").iterdir()) == ["a.h", "b.h"]


def test_install_brings_the_shared_folders_it_lacks(root, tmp_path_factory):
    path, shared = kernel_in_shared_folder(root)
    other = tmp_path_factory.mktemp("other")
    shutil.copytree(root, other, ignore=shutil.ignore_patterns("solutions"), dirs_exist_ok=True)
    installed = install_solution(Repo(other), path)
    copied = other / "solutions" / "_shared" / "kernel" / "kernel.py"
    assert copied.read_bytes() == (shared / "kernel.py").read_bytes()
    assert load_solution_folder(installed).content_hash() == load_solution_folder(path).content_hash()


def test_install_refuses_a_shared_folder_the_repository_holds_otherwise(root, tmp_path_factory):
    path, _ = kernel_in_shared_folder(root)
    add_shared(root, "helpers", {"util.py": "K = 1\n"})
    share(path, "helpers", "kernel")
    other = tmp_path_factory.mktemp("other")
    shutil.copytree(root, other, ignore=shutil.ignore_patterns("solutions"), dirs_exist_ok=True)
    add_shared(other, "kernel", {"kernel.py": "def run(): pass\n"})
    with pytest.raises(FlashbenchError) as info:
        install_solution(Repo(other), path)
    assert info.value.field == "shared" and "_shared/kernel differs from" in info.value.message
    assert not (other / "solutions" / "_shared" / "helpers").exists()  # nothing installed by halves
    assert not (other / "solutions" / DECODE / "mine").exists()


def test_a_shared_module_runs_in_the_worker_under_its_hash(root, tmp_path):
    """A per-definition wrapper in the solution folder calling a module of a shared folder, run through
    the sandboxed worker from a cache under /tmp: the worker sees both, and the trace carries the hash
    of every file."""
    path = add_solution(root, DECODE, DECODE)
    definition = Repo(REPO).definition(DECODE)
    inputs = ", ".join(definition.inputs)
    add_shared(root, "reference_decode", {"decode_impl.py": (REPO / definition.reference).read_text()})
    (path / "kernel.py").write_text(f"from decode_impl import run as decode\n\n\ndef run({inputs}):\n"
                                    f"    return decode({inputs})\n")
    share(path, "reference_decode")
    repo = Repo(root)
    options = RunOptions(device="cpu", iters=1, warmup=0, input_sets=1, timeout=120, trace_dir=tmp_path / "traces",
                         cache_dir=tmp_path / "cache", save=False)
    runner = Runner(repo, DECODE, options)
    workloads = select_workloads(repo, DECODE, [], "cpu")[:1]
    result = runner.run(runner.candidates(repo.solution_folders(DECODE))[1:], workloads)
    (trace,) = result.traces
    assert trace.status == "PASSED", f"{trace.message} {trace.log[-1500:]}"
    assert trace.solution_hash == load_solution_folder(path).content_hash()


def test_no_two_files_under_solutions_are_the_same():
    """Code that several solution folders use lives once, in solutions/_shared/."""
    seen: dict[bytes, Path] = {}
    for path in sorted((REPO / "solutions").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.stat().st_size:
            content = path.read_bytes()
            assert content not in seen, f"{path} repeats {seen[content]}"
            seen[content] = path


def test_validate_refuses_a_folder_that_run_refuses(root, tmp_path_factory):
    """validate passed a folder with a link leading out, which run then refused as INVALID_SOLUTION."""
    path = add_solution(root, DECODE, DECODE)
    outside = tmp_path_factory.mktemp("outside") / "secret.py"
    outside.write_text("x = 1\n")
    (path / "helper.py").symlink_to(outside)
    [checked] = validate(Repo(root), [path])
    assert not checked.ok and "helper.py is a link to" in checked.error
