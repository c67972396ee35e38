"""Definition files: what loads, and how each kind of mistake is reported (file and field)."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from flashbench import BindingError, FlashbenchError, Repo, bind_axes
from flashbench.model import Definition, Solution, load_model
from flashbench.model.solution import dependency_name
from flashbench.registry import load_definition_file

REPO = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
PREFILL = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"


def source_definition(name=DECODE) -> dict:
    return yaml.safe_load((REPO / "definitions" / "mla_paged" / f"{name}.yaml").read_text())


@pytest.fixture
def repo_root(tmp_path):
    """An empty repository that has the real references (definitions are written by each test)."""
    shutil.copytree(REPO / "references", tmp_path / "references")
    (tmp_path / "definitions" / "mla_paged").mkdir(parents=True)
    return tmp_path


def write(root: Path, data: dict, suffix=".yaml", folder="mla_paged", stem=None) -> Path:
    path = root / "definitions" / folder / f"{stem or data['name']}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2) if suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    return path


def test_repo_definitions_load():
    for name in (DECODE, PREFILL):
        path = REPO / "definitions" / "mla_paged" / f"{name}.yaml"
        loaded = load_definition_file(path, REPO).definition
        assert loaded.name == name and loaded.op_type == "mla_paged"
        assert loaded.const_axes == {"num_qo_heads": 16, "head_dim_ckv": 512, "head_dim_kpe": 64, "page_size": 1}
        assert loaded.reference_is_path


def test_decode_definition_contents():
    definition = load_model(Definition, REPO / "definitions" / "mla_paged" / f"{DECODE}.yaml")
    assert definition.var_axes == ["batch_size", "num_pages", "len_indptr", "num_kv_indices"]
    assert list(definition.inputs) == ["q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indptr", "kv_indices", "sm_scale"]
    assert definition.inputs["sm_scale"].shape is None
    assert list(definition.outputs) == ["output", "lse"]
    assert (definition.tolerance("lse").atol, definition.tolerance("lse").rtol) == (1e-3, 0.0)
    assert [e.source for e in definition.constraint_expressions] == definition.constraints


def _set(path, value):
    def mutate(data):
        *parents, last = path
        target = data
        for key in parents:
            target = target[key]
        target[last] = value
    return mutate


def _delete(path):
    def mutate(data):
        *parents, last = path
        target = data
        for key in parents:
            target = target[key]
        del target[last]
    return mutate


def _append_constraint(source):
    return lambda data: data["constraints"].append(source)


BAD_DEFINITIONS = [
    ("unknown dtype", _set(("inputs", "q_pe", "dtype"), "float33"), "inputs.q_pe.dtype", "'float33' is not allowed"),
    ("output dtype", _set(("outputs", "lse", "dtype"), "fp32"), "outputs.lse.dtype", "'fp32'"),
    ("undefined axis in input", _set(("inputs", "q_pe", "shape"), ["batch_size", "heads"]),
     "inputs.q_pe.shape", "axis 'heads' is not defined"),
    ("undefined axis in output", _set(("outputs", "lse", "shape"), ["batch", "num_qo_heads"]),
     "outputs.lse.shape", "axis 'batch' is not defined"),
    ("input/output clash", _set(("outputs", "q_pe"), {"shape": None, "dtype": "float32"}),
     "outputs.q_pe", "both an input and an output"),
    ("const axis without value", _delete(("axes", "page_size", "value")), "axes.page_size", "needs a 'value'"),
    ("axis type", _set(("axes", "batch_size", "type"), "variable"), "axes.batch_size.type", "'variable'"),
    ("constraint does not parse", _append_constraint("len_indptr =="), "constraints[5]", "does not parse"),
    ("constraint imports", _append_constraint("__import__('os').system('x')"), "constraints[5]", "calls"),
    ("constraint dunder", _append_constraint("kv_indptr.__class__ == 0"), "constraints[5]", "'__class__'"),
    ("constraint comprehension", _append_constraint("[i for i in kv_indptr]"), "constraints[5]", "ListComp"),
    ("constraint string", _append_constraint("kv_indptr == 'x'"), "constraints[5]", "literal 'x'"),
    ("constraint calls sum", _append_constraint("sum(kv_indptr) > 0"), "constraints[5]", "calls sum"),
    ("constraint unknown name", _append_constraint("num_heads == 16"), "constraints[5]", "unknown name(s) num_heads"),
    ("constraint names an output", _append_constraint("lse.shape[0] == batch_size"), "constraints[5]", "lse"),
    ("cost disallowed call", _set(("cost", "flops"), "sum(kv_indptr) + open(1)"), "cost.flops", "calls open"),
    ("cost unknown name", _set(("cost", "bytes"), "bytes_per_token * 2"), "cost.bytes", "bytes_per_token"),
    ("unknown top-level key", _set(("colour",), "red"), "colour", "unknown key"),
    ("unknown nested key", _set(("inputs", "q_pe", "layout"), "nhd"), "inputs.q_pe.layout", "unknown key"),
    ("unknown axis key", _set(("axes", "batch_size", "max"), 4), "axes.batch_size.max", "unknown key"),
    ("tolerance for a non-output", _set(("tolerances", "q_pe"), {"atol": 1, "rtol": 1}),
     "tolerances.q_pe", "not an output"),
    ("negative tolerance", _set(("tolerances", "output", "atol"), -1), "tolerances.output.atol", "greater than or equal"),
    ("missing inputs", _delete(("inputs",)), "inputs", "Field required"),
    ("shape not a list", _set(("inputs", "q_pe", "shape"), "batch_size"), "inputs.q_pe.shape", ""),
    # from anyone: each ended validate with a traceback (torch.empty's OverflowError, the parser's RecursionError
    # and MemoryError), or took gigabytes and minutes (6 MB of a tuple)
    ("const axis past int64", _set(("axes", "page_size", "value"), 10**30), "axes.page_size.value", "past int64"),
    ("negative const axis", _set(("axes", "page_size", "value"), -1), "axes.page_size.value", "greater than or equal"),
    ("constraint nested deep", _append_constraint("-" * 4000 + "1 < 0"), "constraints[5]", "nests deeper"),
    ("cost nested deep", _set(("cost", "bytes"), "1+" * 1500 + "1"), "cost.bytes", "nests deeper"),
    ("constraint too long", _append_constraint(f"({', 1' * 3000}) == 1"), "constraints[5]", "characters long"),
]


@pytest.mark.parametrize("mutate, field, message", [c[1:] for c in BAD_DEFINITIONS], ids=[c[0] for c in BAD_DEFINITIONS])
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_bad_definition_names_file_and_field(repo_root, mutate, field, message, suffix):
    data = source_definition()
    mutate(data)
    path = write(repo_root, data, suffix)
    with pytest.raises(FlashbenchError) as info:
        load_definition_file(path, repo_root)
    error = info.value
    assert error.file == str(path)
    assert error.field == field
    assert message in error.message
    assert str(error).startswith(f"{path}: {field}: ")


def test_yaml_syntax_error_names_the_line(repo_root):
    lines = (REPO / "definitions" / "mla_paged" / f"{DECODE}.yaml").read_text().splitlines()
    assert lines[12].startswith("  head_dim_ckv:")
    lines[12] = "\t" + lines[12].lstrip()  # line 13: a tab cannot start a YAML token
    path = repo_root / "definitions" / "mla_paged" / f"{DECODE}.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FlashbenchError) as info:
        load_definition_file(path, repo_root)
    assert info.value.file == str(path)
    assert info.value.message.startswith("line 13: invalid YAML")


def test_json_syntax_error_names_the_line(repo_root):
    lines = json.dumps(source_definition(), indent=2).splitlines()
    assert lines[4].strip().startswith('"tags"')
    lines[4] += " oops"  # line 5
    path = repo_root / "definitions" / "mla_paged" / f"{DECODE}.json"
    path.write_text("\n".join(lines))
    with pytest.raises(FlashbenchError) as info:
        load_definition_file(path, repo_root)
    assert info.value.file == str(path)
    assert info.value.message.startswith("line 5: invalid JSON")


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_document_that_is_not_a_mapping(repo_root, text):
    path = repo_root / "definitions" / "mla_paged" / f"{DECODE}.yaml"
    path.write_text(text)
    with pytest.raises(FlashbenchError, match="expected a mapping") as info:
        load_definition_file(path, repo_root)
    assert info.value.file == str(path)


def test_file_name_must_match_name(repo_root):
    path = write(repo_root, source_definition(), stem="mla_decode")
    with pytest.raises(FlashbenchError) as info:
        load_definition_file(path, repo_root)
    assert info.value.file == str(path) and info.value.field == "name"
    assert "'mla_decode'" in info.value.message


def test_folder_must_match_op_type(repo_root):
    path = write(repo_root, source_definition(), folder="attention")
    with pytest.raises(FlashbenchError) as info:
        load_definition_file(path, repo_root)
    assert info.value.file == str(path) and info.value.field == "op_type"
    assert "'attention'" in info.value.message


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_every_suffix_loads_the_same_definition(repo_root, suffix):
    data = source_definition()
    path = write(repo_root, data, suffix)
    loaded = load_definition_file(path, repo_root).definition
    assert loaded == Definition.model_validate(data)
    assert Repo(repo_root).names() == [DECODE]


# A definition written the way FlashInfer-Bench writes them: the reference is embedded source with a
# top-level `run`, constraints use `.item()`, every axis and tensor has a description, no tolerances or cost.
FIB_REFERENCE = '''\
import math
import torch


@torch.no_grad()
def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
    batch_size, num_qo_heads, head_dim_ckv = q_nope.shape
    assert num_qo_heads == 16 and head_dim_ckv == 512 and q_pe.shape[-1] == 64
    assert ckv_cache.shape[1] == 1
    assert kv_indptr.shape[0] == batch_size + 1
    assert kv_indices.shape[0] == kv_indptr[-1].item()
    keys_c = ckv_cache.squeeze(1).to(torch.float32)
    keys_p = kpe_cache.squeeze(1).to(torch.float32)
    output = torch.zeros((batch_size, num_qo_heads, head_dim_ckv), dtype=torch.bfloat16)
    lse = torch.full((batch_size, num_qo_heads), -float("inf"), dtype=torch.float32)
    for b in range(batch_size):
        begin, end = int(kv_indptr[b].item()), int(kv_indptr[b + 1].item())
        if begin >= end:
            continue
        pages = kv_indices[begin:end].to(torch.long)
        kc, kp = keys_c[pages], keys_p[pages]
        scores = (q_nope[b].to(torch.float32) @ kc.T + q_pe[b].to(torch.float32) @ kp.T) * sm_scale
        lse[b] = torch.logsumexp(scores, dim=-1) / math.log(2.0)
        output[b] = (torch.softmax(scores, dim=-1) @ kc).to(torch.bfloat16)
    return output, lse
'''


def fib_definition() -> dict:
    return {
        "name": DECODE,
        "op_type": "mla_paged",
        "tags": ["stage:decode", "status:verified", "model:deepseek-v3"],
        "description": "Batched MLA decode with a paged KV cache, page size 1.",
        "axes": {
            "batch_size": {"type": "var", "description": "Number of requests."},
            "num_qo_heads": {"type": "const", "value": 16, "description": "Query heads after TP split."},
            "head_dim_ckv": {"type": "const", "value": 512, "description": "Compressed KV dimension."},
            "head_dim_kpe": {"type": "const", "value": 64, "description": "Positional key dimension."},
            "page_size": {"type": "const", "value": 1, "description": "Tokens per page."},
            "num_pages": {"type": "var", "description": "Pages in the pool."},
            "len_indptr": {"type": "var", "description": "batch_size + 1."},
            "num_kv_indices": {"type": "var", "description": "Total KV tokens."},
        },
        "constraints": ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"],
        "inputs": {
            "q_nope": {"shape": ["batch_size", "num_qo_heads", "head_dim_ckv"], "dtype": "bfloat16",
                       "description": "Query without positional part."},
            "q_pe": {"shape": ["batch_size", "num_qo_heads", "head_dim_kpe"], "dtype": "bfloat16",
                     "description": "Query positional part."},
            "ckv_cache": {"shape": ["num_pages", "page_size", "head_dim_ckv"], "dtype": "bfloat16",
                          "description": "Compressed KV cache."},
            "kpe_cache": {"shape": ["num_pages", "page_size", "head_dim_kpe"], "dtype": "bfloat16",
                          "description": "Positional key cache."},
            "kv_indptr": {"shape": ["len_indptr"], "dtype": "int32", "description": "Request offsets."},
            "kv_indices": {"shape": ["num_kv_indices"], "dtype": "int32", "description": "Page ids."},
            "sm_scale": {"shape": None, "dtype": "float32", "description": "Softmax scale."},
        },
        "outputs": {
            "output": {"shape": ["batch_size", "num_qo_heads", "head_dim_ckv"], "dtype": "bfloat16"},
            "lse": {"shape": ["batch_size", "num_qo_heads"], "dtype": "float32",
                    "description": "Base-2 log-sum-exp."},
        },
        "reference": FIB_REFERENCE,
    }


def _decode_inputs(kv_lens, num_pages, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = len(kv_lens)
    total = sum(kv_lens)
    indptr = torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0).tolist()), dtype=torch.int32)
    return {
        "q_nope": torch.randn(batch, 16, 512, generator=g).bfloat16(),
        "q_pe": torch.randn(batch, 16, 64, generator=g).bfloat16(),
        "ckv_cache": torch.randn(num_pages, 1, 512, generator=g).bfloat16(),
        "kpe_cache": torch.randn(num_pages, 1, 64, generator=g).bfloat16(),
        "kv_indptr": indptr,
        "kv_indices": torch.randperm(num_pages, generator=g)[:total].to(torch.int32),
        "sm_scale": 1 / math.sqrt(576),
    }


def test_flashinfer_bench_definition_loads_unchanged_and_its_reference_runs(tmp_path):
    (tmp_path / "definitions" / "mla_paged").mkdir(parents=True)
    data = fib_definition()
    path = tmp_path / "definitions" / "mla_paged" / f"{DECODE}.json"
    path.write_text(json.dumps(data, indent=2))
    original = path.read_text()

    repo = Repo(tmp_path)
    definition = repo.definition("mla_paged_decode")
    assert definition.name == DECODE and not definition.reference_is_path
    assert definition.axes["batch_size"].description == "Number of requests."
    assert definition.tolerances == {} and definition.cost is None
    assert path.read_text() == original  # loading never rewrites the file
    assert definition.model_dump(exclude_defaults=True) == data  # nothing dropped or renamed

    inputs = _decode_inputs([3, 0, 1, 9], num_pages=40)
    axes = bind_axes(definition, inputs)
    assert axes["batch_size"] == 4 and axes["num_kv_indices"] == 13 and axes["len_indptr"] == 5

    run = repo.reference(DECODE)
    output, lse = run(**inputs)
    assert output.dtype == torch.bfloat16 and output.shape == (4, 16, 512)
    assert lse.dtype == torch.float32 and lse.shape == (4, 16)
    assert torch.all(output[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.isfinite(lse[[0, 2, 3]]).all()

    # The repository's own reference (a file) agrees with the embedded FlashInfer-Bench one.
    ours_output, ours_lse = Repo(REPO).reference(DECODE)(**inputs)
    torch.testing.assert_close(lse, ours_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(output.float(), ours_output.float(), rtol=1e-2, atol=1e-2)


def test_flashinfer_bench_item_constraint_is_checked(tmp_path):
    (tmp_path / "definitions" / "mla_paged").mkdir(parents=True)
    path = tmp_path / "definitions" / "mla_paged" / f"{DECODE}.json"
    path.write_text(json.dumps(fib_definition()))
    definition = Repo(tmp_path).definition(DECODE)
    inputs = _decode_inputs([3, 2], num_pages=10)
    inputs["kv_indices"] = inputs["kv_indices"][:4]
    with pytest.raises(BindingError, match=r"num_kv_indices == kv_indptr\[-1\]\.item\(\)"):
        bind_axes(definition, inputs)


def test_embedded_reference_that_fails_names_the_field(tmp_path):
    (tmp_path / "definitions" / "mla_paged").mkdir(parents=True)
    data = fib_definition()
    data["reference"] = "import torch\nraise ValueError('no GPU here')\n"
    path = tmp_path / "definitions" / "mla_paged" / f"{DECODE}.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FlashbenchError) as info:
        load_definition_file(path, tmp_path)
    assert info.value.file == str(path) and info.value.field == "reference"
    assert "no GPU here" in info.value.message



# solution.yaml's dependencies: package names the judge looks up without importing them.

SOLUTION_MANIFEST = {"name": "s", "definition": DECODE, "author": "a", "language": "python",
                     "entry_point": "kernel.py::run"}


def write_solution(tmp_path: Path, dependencies: list[str]) -> Path:
    path = tmp_path / "solution.yaml"
    path.write_text(yaml.safe_dump({**SOLUTION_MANIFEST, "dependencies": dependencies}))
    return path


@pytest.mark.parametrize("entry", ["kernel::run", "kernel.PY::run", "kernel.pyc::run", "src/kernel.so::run"])
def test_a_python_entry_file_is_python_source(tmp_path, entry):
    """A file Python's loader does not know ended the build with a bare AttributeError; bytecode ran what neither
    validate nor a reader can see."""
    path = tmp_path / "solution.yaml"
    path.write_text(yaml.safe_dump({**SOLUTION_MANIFEST, "entry_point": entry}))
    with pytest.raises(FlashbenchError, match="must be a Python source file"):
        load_model(Solution, path)


@pytest.mark.parametrize("dependency, name", [
    ("torch", "torch"), ("flash-mla", "flash-mla"), ("torch>=2.4", "torch"), ("triton == 3.1.0", "triton"),
    ("flashinfer-python >= 0.2, < 0.3", "flashinfer-python"), ("zope.interface>=6", "zope.interface")])
def test_a_dependency_is_a_package_name_with_an_optional_version(tmp_path, dependency, name):
    solution = load_model(Solution, write_solution(tmp_path, [dependency]))
    assert dependency_name(solution.dependencies[0]) == name


@pytest.mark.parametrize("dependency", ["../kernel", "/tmp/x", "torch; import os", "", ".hidden", "zope.", "a b"])
def test_a_dependency_that_is_not_a_package_name_is_refused_with_one_line(tmp_path, dependency):
    path = write_solution(tmp_path, ["torch", dependency])
    with pytest.raises(FlashbenchError) as refused:
        load_model(Solution, path)
    expected = f"{path}: dependencies: {dependency!r} must be the name of an installed package"
    assert str(refused.value).startswith(expected)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("field, value", [("name", ".."), ("name", "."), ("name", ".hidden"), ("name", "a/b"),
                                          ("definition", ".."), ("definition", "../../tmp")])
def test_a_solutions_name_and_definition_are_folder_names_never_dot_or_dotdot(tmp_path, field, value):
    """`flashbench submit` installs a folder at solutions/<definition>/<name>/, replacing what is there: a
    name of '..' would have replaced every solution of the definition."""
    path = tmp_path / "solution.yaml"
    path.write_text(yaml.safe_dump({**SOLUTION_MANIFEST, field: value}))
    with pytest.raises(FlashbenchError) as refused:
        load_model(Solution, path)
    assert f"{path}: {field}:" in str(refused.value)


@pytest.mark.parametrize("field, value", [
    ("tags", ["baseline|x\n## NVIDIA H200"]), ("tags", ["[verified](https://evil.example)"]), ("tags", ["<img>"]),
    ("tags", ["\x1b]52;c;aGk=\x07"]), ("author", "a\nb"), ("author", "[maintainers](https://evil.example)"),
    ("author", "x\x1b[2J"), ("author", ""), ("author", "flashbench\u202e"), ("author", "flash\u200bbench"),
    # drawn as a blank or as nothing: each read as the repository's own author on a board
    ("author", "flashbench\u3164"), ("author", "flash\u2800bench"), ("author", "flashbench\u00a0"),
    ("author", "flashbench\ufe0f"), ("author", "flashbench "), ("author", "flash  bench")])
def test_tags_and_author_cannot_carry_markup_or_escapes(tmp_path, field, value):
    """Both reach boards and terminals: a tag is a word, an author one plain line."""
    path = tmp_path / "solution.yaml"
    path.write_text(yaml.safe_dump({**SOLUTION_MANIFEST, field: value}))
    with pytest.raises(FlashbenchError) as refused:
        load_model(Solution, path)
    assert f"{path}: {field}" in str(refused.value)


def test_plain_tags_and_authors_are_kept(tmp_path):
    path = tmp_path / "solution.yaml"
    path.write_text(yaml.safe_dump({**SOLUTION_MANIFEST, "tags": ["baseline", "library:flashmla", "v1.2"],
                                    "author": "Jane Doe (jane@example.com)"}))
    solution = load_model(Solution, path)
    assert solution.tags == ["baseline", "library:flashmla", "v1.2"] and solution.author.startswith("Jane")
    path.write_text(yaml.safe_dump({**SOLUTION_MANIFEST, "author": "José Núñez, 李"}, allow_unicode=True))
    assert load_model(Solution, path).author == "José Núñez, 李"  # letters of any script: only format characters go
    # the joiners Persian and Indic names need
    for author in ("\u0645\u06cc\u200c\u0631\u0627", "\u0915\u094d\u200d\u0937"):
        path.write_text(yaml.safe_dump({**SOLUTION_MANIFEST, "author": author}, allow_unicode=True))
        assert load_model(Solution, path).author == author


def test_no_definition_is_named_after_the_shared_folder():
    """Red team: an imported dataset's definition `_shared` had its solutions written into solutions/_shared/."""
    path = Path(__file__).resolve().parents[1] / "definitions/mla_paged/mla_paged_decode_h16_ckv512_kpe64_ps1.yaml"
    data = json.loads(json.dumps(yaml.safe_load(path.read_text())))
    Definition.model_validate(data)
    for name in ("_shared", "_Shared"):  # the second is the same folder on a case-insensitive file system
        with pytest.raises(ValueError, match="shared"):
            Definition.model_validate(data | {"name": name})


def test_a_name_is_at_most_128_characters():
    """Red team: a solution named with 600 characters ran and PASSED, then `submit` ended in ENAMETOOLONG staging
    `.<name>.incoming`, and the charts' legends crowded out their axes. FlashInfer-Bench solution names are cut to
    fit, each keeping a digest of its whole name (two names cut alike had one board row)."""
    from flashbench.interop.fib_solution import safe_name

    fields = {"definition": "d", "author": "a", "language": "python", "entry_point": "k.py::run"}
    assert Solution(name="x" * 128, **fields).name == "x" * 128
    with pytest.raises(ValueError, match="name"):
        Solution(name="x" * 129, **fields)
    cut = safe_name("y" * 300 + "A")
    assert len(cut) == 128 and cut.startswith("y" * 119) and cut != safe_name("y" * 300 + "B")
    Solution(name=cut, **fields)
