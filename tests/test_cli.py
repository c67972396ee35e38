"""The `list`, `show` and `validate` commands."""

import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flashbench.cli import main
from flashbench.registry import find_root

REPO = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
PREFILL = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"


def invoke(root, *args):
    return CliRunner().invoke(main, ["--root", str(root), *args])


@pytest.fixture
def root(tmp_path):
    shutil.copytree(REPO / "definitions", tmp_path / "definitions")
    shutil.copytree(REPO / "references", tmp_path / "references")
    return tmp_path


def break_definition(root, edit):
    path = root / "definitions" / "mla_paged" / f"{DECODE}.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_list_shows_both_definitions():
    result = invoke(REPO, "list")
    assert result.exit_code == 0, result.output
    assert DECODE in result.output and PREFILL in result.output  # full names, never cut short
    assert "mla_paged" in result.output and "stage:decode" in result.output


def test_list_counts_workloads(root):
    result = invoke(root, "list")
    assert result.exit_code == 0, result.output
    decode_row = next(line for line in result.output.splitlines() if DECODE in line)
    assert " 11 " in decode_row  # the decode workload set has 11 workloads


def test_list_on_an_empty_repo(tmp_path):
    (tmp_path / "definitions").mkdir()
    result = invoke(tmp_path, "list")
    assert result.exit_code == 0 and "Traceback" not in result.output


def test_show_prints_axes_constraints_and_cost():
    result = invoke(REPO, "show", "mla_paged_decode")
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.startswith(DECODE)
    for axis in ("batch_size", "num_qo_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "num_pages",
                 "len_indptr", "num_kv_indices"):
        assert axis in out
    for constraint in ("len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1]", "kv_indptr[0] == 0"):
        assert f"  {constraint}\n" in out
    assert "[len_indptr]" in out and "[num_kv_indices]" in out and "scalar" in out  # shapes are shown
    assert "cost model" in out and "bytes:" in out and "flops: 2 * num_qo_heads" in out
    assert "lse: atol=0.001 rtol=0.0" in out
    assert f"references/mla_paged/{DECODE}.py" in out


def test_show_marks_a_constant_input():
    result = invoke(REPO, "show", "flashmla_sparse_decode_fp8_sink_h64")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in result.output.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["attn_sink"] == "input, constant" and rows["q"] == "input" and rows["out"] == "output"


def test_show_and_list_print_a_definitions_words_as_text(root):
    """An imported definition may say anything in its words: escape sequences (a window title, an erased line)
    reached the terminal, and an axis named "a[/x]" ended `show` with a traceback."""
    def edit(data):
        data["description"] = "MLA\x1b]0;title\x07\x1b[2K decode\nsecond line"
        data["axes"]["batch_size"]["description"] = "[/x] \x1b[31mred"
        data["axes"]["a[/x]"] = {"type": "const", "value": 1}
        data["tags"] = ["\x1b]52;c;AAAA\x07"]
    break_definition(root, edit)
    shown = invoke(root, "show", DECODE)
    assert shown.exit_code == 0, shown.output
    assert "MLA?]0;title??[2K decode\nsecond line\n" in shown.output and "[/x] ?[31mred" in shown.output
    assert "a[/x]" in shown.output and "\x1b" not in shown.output
    listed = invoke(root, "list")
    assert listed.exit_code == 0, listed.output
    assert "?]52;c;AAAA?" in listed.output and "\x1b" not in listed.output


def test_an_error_naming_a_hostile_folder_is_one_line_of_text(root, tmp_path_factory):
    """A FlashbenchError names the file: a folder's escape sequences reached the terminal through it."""
    folder = tmp_path_factory.mktemp("hostile") / "x\x1b]0;title\x1b\\"
    shutil.copytree(REPO / "solutions" / DECODE / "torch_vectorized", folder)
    with open(folder / "solution.yaml", "a") as manifest:
        manifest.write("oops: 1\n")
    for command in ("validate", "submit"):  # in a copy of the repository: a submit that got through writes there
        result = invoke(root, command, str(folder))
        assert result.exit_code == 2, result.output
        assert "x?]0;title?\\/solution.yaml: oops: unknown key" in result.stderr and "\x1b" not in result.output


def test_show_unknown_lists_close_names():
    result = invoke(REPO, "show", "mla_paged_decod")
    assert result.exit_code == 0  # a unique prefix
    result = invoke(REPO, "show", "gqa_paged_decode")
    assert result.exit_code == 2
    assert "no definition named 'gqa_paged_decode'" in result.output and DECODE in result.output
    assert "Traceback" not in result.output


def test_show_ambiguous_lists_candidates():
    result = invoke(REPO, "show", "mla")
    assert result.exit_code == 2
    assert "ambiguous" in result.output and DECODE in result.output and PREFILL in result.output
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_validate_the_repo():
    result = invoke(REPO, "validate")
    assert result.exit_code == 0, result.output
    assert "invalid" not in result.output.replace(" 0 invalid", "")
    assert f"{DECODE}.yaml" in result.output and f"{PREFILL}.workloads.yaml" in result.output


def test_validate_one_file():
    result = invoke(REPO, "validate", str(REPO / "definitions" / "mla_paged" / f"{DECODE}.workloads.yaml"))
    assert result.exit_code == 0, result.output
    assert "1 valid, 0 invalid" in result.output


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["inputs"]["q_pe"].update(dtype="float33"), "inputs.q_pe.dtype"),
    (lambda d: d["constraints"].append("__import__('os').system('x')"), "constraints[5]"),
    (lambda d: d["axes"]["page_size"].pop("value"), "axes.page_size"),
    (lambda d: d.update(reference="references/mla_paged/missing.py"), "reference"),
])
def test_validate_a_broken_definition(root, edit, field):
    path = break_definition(root, edit)
    result = invoke(root, "validate")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("invalid definition")]
    assert len(errors) == 1
    assert f"{path}: {field}: " in errors[0]
    assert "valid, " in result.output and " invalid" in result.output


def test_validate_prints_every_invalid_workload_of_a_file(root):
    path = root / "definitions" / "mla_paged" / f"{DECODE}.workloads.yaml"
    data = yaml.safe_load(path.read_text())
    data["workloads"][0]["inputs"]["scale"] = {"type": "scalar", "value": 1}
    data["workloads"][2]["generate"][0]["page_pool"] = 3
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke(root, "validate", str(path))
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = result.stderr.splitlines()
    assert [line.split(": ")[:2] for line in errors] == [
        [f"invalid workloads  {path}", f"workloads[0] ({data['workloads'][0]['name']})"],
        [f"invalid workloads  {path}", f"workloads[2] ({data['workloads'][2]['name']})"]]
    assert "0 valid, 1 invalid" in result.output  # files, as before


def test_validate_a_yaml_syntax_error(root):
    path = root / "definitions" / "mla_paged" / f"{DECODE}.yaml"
    path.write_text(path.read_text().replace("axes:\n", "axes:\n\t", 1))
    result = invoke(root, "validate", str(path))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{path}: line 11: invalid YAML" in result.output


def test_validate_a_broken_reference(root):
    (root / "references" / "mla_paged" / f"{PREFILL}.py").write_text("raise ImportError('triton missing')\n")
    result = invoke(root, "validate", str(root / "definitions" / "mla_paged" / f"{PREFILL}.yaml"))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "reference: " in result.output and "triton missing" in result.output


def test_validate_a_missing_path(root):
    result = invoke(root, "validate", str(root / "nowhere"))
    assert result.exit_code == 2 and "no such file or folder" in result.output
    assert "Traceback" not in result.output


def test_commands_without_a_repository(tmp_path, monkeypatch):
    monkeypatch.delenv("FLASHBENCH_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["list"])
    assert result.exit_code == 2 and "no definitions/ folder" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("arguments, message", [
    (["run", "--def", "mla_paged_decode", "--bogus"], "No such option '--bogus'. See 'main run --help'."),
    (["run", "--def", "mla_paged_decode", "--iters", "0"], "Invalid value for '--iters': 0 is not in the range x>=1."),
    (["run"], "Missing option '--def'. See 'main run --help'."),
    (["runn"], "No such command 'runn'. Did you mean 'run'? See 'main --help'."),
    (["--root"], "Option '--root' requires an argument. See 'flashbench --help'."),
    (["run", "--def", "gqa_paged_decode", "--device", "cpu"], "no definition named 'gqa_paged_decode'"),
])
def test_usage_errors_are_one_line_and_exit_2(arguments, message):
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and message in line and "Usage" not in result.output


def test_bare_command_still_shows_the_help():
    result = CliRunner().invoke(main, [])
    assert "Commands:" in result.output and "run" in result.output


def test_root_is_the_repository_of_everything_the_command_does(root, tmp_path, monkeypatch):
    """What finds the repository by itself (the FP8 quantize reference, loaded by path where inputs are made) found
    the working directory's, not `--root`'s: an installed flashbench run from outside the repository failed every
    FP8 workload. `--root` now is the process's repository (and its workers are told it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLASHBENCH_ROOT", str(tmp_path))
    assert invoke(root, "list").exit_code == 0
    assert find_root() == root.resolve()


def test_a_root_that_is_no_folder_says_so(tmp_path):
    """It said "no definition named 'x'; known: none"."""
    result = invoke(tmp_path / "missing", "list")
    assert result.exit_code == 2 and "--root: no such folder" in result.output
