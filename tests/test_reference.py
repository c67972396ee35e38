"""Loading a definition's reference: every failure is a FlashbenchError on the definition's `reference`."""

import shutil
from pathlib import Path

import pytest

from flashbench import FlashbenchError, Repo
from flashbench.model import Definition, load_model
from flashbench.reference import check_signature, load_reference, reference_source
from flashbench.registry import load_definition_file

REPO = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
INPUTS = "q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale"


@pytest.fixture
def repo_root(tmp_path):
    shutil.copytree(REPO / "definitions", tmp_path / "definitions")
    shutil.copytree(REPO / "references", tmp_path / "references")
    return tmp_path


def definition_path(root: Path) -> Path:
    return root / "definitions" / "mla_paged" / f"{DECODE}.yaml"


def reference_path(root: Path) -> Path:
    return root / "references" / "mla_paged" / f"{DECODE}.py"


def expect_reference_error(root: Path, *fragments: str) -> FlashbenchError:
    path = definition_path(root)
    with pytest.raises(FlashbenchError) as info:
        load_definition_file(path, root)
    error = info.value
    assert error.file == str(path)
    assert error.field == "reference"
    assert str(error).startswith(f"{path}: reference: ")
    for fragment in fragments:
        assert fragment in error.message
    return error


def test_the_repo_reference_loads():
    run = Repo(REPO).reference(DECODE)
    assert callable(run) and run.__name__ == "run"


def test_missing_reference_file(repo_root):
    reference_path(repo_root).unlink()
    expect_reference_error(repo_root, "does not exist", f"{DECODE}.py")


@pytest.mark.parametrize("named", ["absolute", "../outside.py", "references/link.py"])
def test_a_reference_file_outside_the_repository_is_refused_and_never_imported(repo_root, tmp_path_factory, named):
    outside = tmp_path_factory.mktemp("elsewhere") / "outside.py"
    marker = outside.with_suffix(".ran")
    outside.write_text(f"open({str(marker)!r}, 'w').close()\ndef run({INPUTS}):\n    pass\n")
    if named == "absolute":
        named = str(outside)
    elif named == "../outside.py":
        shutil.copy(outside, repo_root.parent / "outside.py")
        marker = repo_root.parent / "outside.ran"
        (repo_root.parent / "outside.py").write_text(outside.read_text().replace(str(outside.with_suffix(".ran")),
                                                                                 str(marker)))
    else:
        (repo_root / named).symlink_to(outside)
    text = definition_path(repo_root).read_text()
    old = f"reference: references/mla_paged/{DECODE}.py"
    assert old in text
    definition_path(repo_root).write_text(text.replace(old, f"reference: {named}"))
    expect_reference_error(repo_root, "is outside the repository")
    assert not marker.exists()


@pytest.mark.parametrize("named", [".flashbench-cache/build/0123/ref.py", "solutions/ref.py", "references/out.py"])
def test_a_reference_file_outside_the_references_folder_is_refused_and_never_imported(repo_root, named):
    """A path into the cache named a file a sandboxed worker may rewrite (its build folder lasts between runs): an
    imported dataset's reference named one, which every later command ran in the runner. A link in references/
    to such a file is refused alike."""
    target = repo_root / (".flashbench-cache/build/0123/ref.py" if named == "references/out.py" else named)
    target.parent.mkdir(parents=True, exist_ok=True)
    marker = target.with_suffix(".ran")
    target.write_text(f"open({str(marker)!r}, 'w').close()\ndef run({INPUTS}):\n    pass\n")
    if named == "references/out.py":
        (repo_root / named).symlink_to(target)
    text = definition_path(repo_root).read_text()
    old = f"reference: references/mla_paged/{DECODE}.py"
    definition_path(repo_root).write_text(text.replace(old, f"reference: {named}"))
    expect_reference_error(repo_root, "outside the repository's references/ folder")
    assert not marker.exists()


def test_reference_without_run(repo_root):
    reference_path(repo_root).write_text("def forward(q_nope):\n    return q_nope\n")
    expect_reference_error(repo_root, "no function 'run'")


def test_reference_whose_run_is_not_a_function(repo_root):
    reference_path(repo_root).write_text("run = 42\n")
    expect_reference_error(repo_root, "no function 'run'")


@pytest.mark.parametrize("signature", [
    "q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices",  # one missing
    "q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, extra",  # one extra
    "q_pe, q_nope, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale",  # out of order
    "q, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale",  # renamed
])
def test_run_parameters_must_match_inputs(repo_root, signature):
    reference_path(repo_root).write_text(f"def run({signature}):\n    pass\n")
    expect_reference_error(repo_root, f"run takes ({signature})", f"the inputs are ({INPUTS})")


def test_run_with_varargs_is_accepted(repo_root):
    reference_path(repo_root).write_text("def run(*args):\n    return args\n")
    run = load_definition_file(definition_path(repo_root), repo_root)
    assert run.definition.name == DECODE


@pytest.mark.parametrize("source, fragment", [
    ("raise RuntimeError('needs a GPU')\n", "needs a GPU"),
    ("import module_that_does_not_exist_anywhere\n", "module_that_does_not_exist_anywhere"),
    ("def run(q_nope:\n", "SyntaxError"),
    ("x = 1 / 0\n", "ZeroDivisionError"),
])
def test_reference_that_fails_at_import(repo_root, source, fragment):
    reference_path(repo_root).write_text(source)
    expect_reference_error(repo_root, "fails to import", fragment)


def test_broken_reference_is_reported_by_the_repo_too(repo_root):
    reference_path(repo_root).write_text("raise RuntimeError('boom')\n")
    with pytest.raises(FlashbenchError) as info:
        Repo(repo_root).reference(DECODE)
    assert info.value.field == "reference" and "boom" in info.value.message


def test_load_reference_without_a_file_names_the_definition(repo_root):
    definition = load_model(Definition, definition_path(repo_root))
    reference_path(repo_root).unlink()
    with pytest.raises(FlashbenchError) as info:
        load_reference(definition, repo_root)
    assert info.value.file == DECODE and info.value.field == "reference"


def test_embedded_reference_problems(repo_root):
    definition = load_model(Definition, definition_path(repo_root))
    for source, fragment in [
        ("x = 1\n", "no function 'run'"),
        ("def run(q_nope):\n    pass\n", "run takes (q_nope)"),
        ("raise KeyError('k')\n", "embedded reference fails to load"),
    ]:
        embedded = definition.model_copy(update={"reference": source})
        assert not embedded.reference_is_path
        with pytest.raises(FlashbenchError) as info:
            load_reference(embedded, repo_root, "where.json")
        assert info.value.file == "where.json" and info.value.field == "reference"
        assert fragment in info.value.message


def test_the_reference_source_is_the_named_file_or_the_embedded_text(repo_root):
    definition = load_model(Definition, definition_path(repo_root))
    assert reference_source(definition, repo_root) == reference_path(repo_root).read_text()
    embedded = definition.model_copy(update={"reference": "def run():\n    pass\n"})
    assert reference_source(embedded, repo_root) == "def run():\n    pass\n"


def test_check_signature_accepts_exact_parameters_only():
    def run(a, b):
        pass
    check_signature(run, ["a", "b"], "f", "reference")
    with pytest.raises(FlashbenchError, match=r"run takes \(a, b\) but the inputs are \(b, a\)"):
        check_signature(run, ["b", "a"], "f", "reference")
