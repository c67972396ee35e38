"""Finding definitions, workload sets and solution folders, and the folder rules the registry enforces."""

import shutil
from pathlib import Path

import pytest
import yaml

from flashbench import FlashbenchError, Repo, validate
from flashbench.registry import find_root

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


def test_solution_folder_under_the_wrong_definition(root):
    path = add_solution(root, DECODE, PREFILL)
    with pytest.raises(FlashbenchError) as info:
        Repo(root).solution_folders(DECODE)
    assert info.value.file == str(path / "solution.yaml") and info.value.field == "definition"
    assert f"solutions/{DECODE}/" in info.value.message

    results = {c.path: c for c in validate(Repo(root), [path])}
    assert results[path].kind == "solution" and not results[path].ok
    assert f"{path / 'solution.yaml'}: definition:" in results[path].error


def test_solution_with_missing_entry_file(root):
    path = add_solution(root, DECODE, DECODE)
    (path / "kernel.py").unlink()
    with pytest.raises(FlashbenchError) as info:
        Repo(root).solution_folders(DECODE)
    assert info.value.field == "entry_point" and "kernel.py" in info.value.message


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
