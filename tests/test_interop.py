"""FlashInfer-Bench interop: import a FIB 0.1.2 dataset (whole definitions or nothing of them), run its
solutions, export a repository that FIB's own loader reads, and get the repository back from it."""

import hashlib
import json
import math
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from conftest import copy_repo, nested_folders
from flashbench import Repo
from flashbench.cli import main
from flashbench.errors import FlashbenchError
from flashbench.interop import Summary, export_fib, import_fib, imported_trace_dir, solution_from_fib_json
from flashbench.interop import staging
from flashbench.interop.fib_export import definition_to_fib, evaluation_to_fib, fib_names
from flashbench.interop.fib_import import definition_to_ours
from flashbench.interop.fib_model import FibBuildSpec, FibDefinition, FibSolution
from flashbench.interop.fib_solution import plan_folder
from flashbench.leaderboard import read_results
from flashbench.model import Definition, OutputError, Performance, Trace
from flashbench.registry import load_solution_folder
from flashbench.traces import append_trace, read_traces, sole_writer
from flashbench.workloads import structured_inputs

DEF = "mla_paged_decode_h16_ckv512_kpe64_ps1"
ADD = "vector_add_f32"
CAPTURED = "6b0c1d42-7e0a-4c4b-9a55-2f1f3c1e9a01"
RANDOM_INDICES = "0f6c5a7e-3b7d-4a3e-8c59-4e1d2b7c9a10"
ADD_WORKLOAD = "3c9e0b7a-51d2-4f0e-9a7c-2b8d6e4f1a00"
BLOB = f"./blob/workloads/mla_paged/{DEF}/{DEF}_{CAPTURED}.safetensors"  # FIB 0.1.2's blob name

REFERENCE = '''import math
import torch


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
    batch_size, num_heads, dim_ckv = q_nope.shape
    output = torch.zeros(batch_size, num_heads, dim_ckv, dtype=torch.bfloat16, device=q_nope.device)
    lse = torch.full((batch_size, num_heads), -math.inf, dtype=torch.float32, device=q_nope.device)
    ckv_rows = ckv_cache.reshape(-1, dim_ckv)
    kpe_rows = kpe_cache.reshape(-1, q_pe.shape[-1])
    for b in range(batch_size):
        start, end = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if start == end:
            continue
        pages = kv_indices[start:end].long()
        ckv, kpe = ckv_rows[pages].float(), kpe_rows[pages].float()
        logits = (q_nope[b].float() @ ckv.T + q_pe[b].float() @ kpe.T) * sm_scale
        lse_e = torch.logsumexp(logits, dim=-1)
        output[b] = (torch.exp(logits - lse_e[:, None]) @ ckv).to(torch.bfloat16)
        lse[b] = lse_e / math.log(2.0)
    return output, lse
'''

# Written the way a FIB author would: value-returning (destination_passing_style false).
PY_SOLUTION = '''import math
import torch


def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
    batch_size, heads, dim = q_nope.shape
    out = torch.zeros(batch_size, heads, dim, dtype=torch.bfloat16, device=q_nope.device)
    lse = torch.full((batch_size, heads), -math.inf, dtype=torch.float32, device=q_nope.device)
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    keys = torch.cat([ckv_cache[:, 0], kpe_cache[:, 0]], dim=-1).float()
    bounds = kv_indptr.tolist()
    for b in range(batch_size):
        if bounds[b] == bounds[b + 1]:
            continue
        k = keys[kv_indices[bounds[b]:bounds[b + 1]].long()]
        scores = (q[b] @ k.T) * sm_scale
        out[b] = (torch.softmax(scores, dim=-1) @ k[:, :dim]).to(torch.bfloat16)
        lse[b] = torch.logsumexp(scores, dim=-1) * (1 / math.log(2.0))
    return out, lse
'''


# --- a FIB 0.1.2 dataset ---------------------------------------------------------------------------

def var(description=None):
    return {"type": "var", **({"description": description} if description else {})}


def definition() -> dict:
    """Modelled on FIB's mla_paged_decode_h16_ckv512_kpe64_ps1, reference embedded."""
    return {
        "name": DEF, "op_type": "mla_paged",
        "description": "Batched MLA decode over a paged KV cache, page size 1.",
        "tags": ["stage:decode", "status:verified", "model:deepseek-v3"],
        "axes": {
            "batch_size": var(), "num_qo_heads": {"type": "const", "value": 16, "description": "TP 8."},
            "head_dim_ckv": {"type": "const", "value": 512}, "head_dim_kpe": {"type": "const", "value": 64},
            "page_size": {"type": "const", "value": 1}, "num_pages": var("Pages in the pool."),
            "len_indptr": var(), "num_kv_indices": var(),
        },
        "inputs": {
            "q_nope": {"shape": ["batch_size", "num_qo_heads", "head_dim_ckv"], "dtype": "bfloat16"},
            "q_pe": {"shape": ["batch_size", "num_qo_heads", "head_dim_kpe"], "dtype": "bfloat16"},
            "ckv_cache": {"shape": ["num_pages", "page_size", "head_dim_ckv"], "dtype": "bfloat16"},
            "kpe_cache": {"shape": ["num_pages", "page_size", "head_dim_kpe"], "dtype": "bfloat16"},
            "kv_indptr": {"shape": ["len_indptr"], "dtype": "int32"},
            "kv_indices": {"shape": ["num_kv_indices"], "dtype": "int32"},
            "sm_scale": {"shape": None, "dtype": "float32", "description": "Softmax scale."},
        },
        "outputs": {
            "output": {"shape": ["batch_size", "num_qo_heads", "head_dim_ckv"], "dtype": "bfloat16"},
            "lse": {"shape": ["batch_size", "num_qo_heads"], "dtype": "float32"},
        },
        "constraints": ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"],
        "reference": REFERENCE,
    }


def add_definition() -> dict:
    return {"name": ADD, "op_type": "elementwise", "axes": {"n": var()},
            "inputs": {"a": {"shape": ["n"], "dtype": "float32"}, "b": {"shape": ["n"], "dtype": "float32"}},
            "outputs": {"c": {"shape": ["n"], "dtype": "float32"}},
            "reference": "def run(a, b):\n    return a + b\n"}


def workload(uuid, axes, indices) -> dict:
    inputs = {name: {"type": "random"} for name in ("q_nope", "q_pe", "ckv_cache", "kpe_cache")}
    return {"uuid": uuid, "axes": axes, "inputs": inputs | indices | {"sm_scale": {"type": "scalar", "value": 0.0721}}}


def captured() -> dict:
    indices = {k: {"type": "safetensors", "path": BLOB, "tensor_key": k} for k in ("kv_indptr", "kv_indices")}
    return workload(CAPTURED, {"batch_size": 2, "num_pages": 16, "len_indptr": 3, "num_kv_indices": 8}, indices)


def add_workload() -> dict:
    return {"uuid": ADD_WORKLOAD, "axes": {"n": 16}, "inputs": {"a": {"type": "random"}, "b": {"type": "random"}}}


def solution(name, author, language, sources, entry, definition=DEF, **spec) -> dict:
    return {"name": name, "definition": definition, "author": author, "description": f"{name} by {author}",
            "spec": {"language": language, "target_hardware": ["NVIDIA_H100"], "entry_point": entry,
                     "dependencies": ["torch"], **spec},
            "sources": [{"path": p, "content": c} for p, c in sources.items()]}


def evaluation(status, **extra) -> dict:
    return {"status": status, "log": extra.pop("log", ""), **extra,
            "environment": {"hardware": "NVIDIA_H100", "libs": {"torch": "2.8.0"}}, "timestamp": "2025-09-01T12:00:00"}


def passed(latency=0.031) -> dict:
    return evaluation("PASSED", correctness={"max_relative_error": 0.004, "max_absolute_error": 0.002},
                      performance={"latency_ms": latency, "reference_latency_ms": 2.5, "speedup_factor": 80.6})


def traces() -> list[dict]:
    """FIB 0.1.2 writes every solution's traces of a definition to one file, whatever the author."""
    failed = evaluation("RUNTIME_ERROR", log="CUDA error: an illegal memory access")
    wrong = evaluation("INCORRECT_NUMERICAL", correctness={"max_relative_error": 0.9, "max_absolute_error": 3.0})
    return [{"definition": DEF, "workload": captured(), "solution": name, "evaluation": e}
            for name, e in (("py_loop", passed()), ("cuda_tvm", failed), ("tl_kernel", wrong), ("ghost", passed(0.05)))]


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) if isinstance(data, dict) else "".join(json.dumps(d) + "\n" for d in data))
    return path


def make_dataset(root: Path) -> Path:
    write(root / "definitions/mla_paged" / f"{DEF}.json", definition())
    write(root / "definitions/mla_paged" / f"{DEF}.graph.json", {"definition": DEF, "nodes": [], "edges": []})
    write(root / "definitions/elementwise/fp32/nested" / f"{ADD}.json", add_definition())
    blob = root / BLOB
    blob.parent.mkdir(parents=True)
    save_file({"kv_indptr": torch.tensor([0, 3, 8], dtype=torch.int32),
               "kv_indices": torch.tensor([9, 2, 14, 0, 7, 3, 11, 5], dtype=torch.int32)}, str(blob))
    # FIB's own weak point: random index tensors; they cannot satisfy the constraints.
    bad = workload(RANDOM_INDICES, {"batch_size": 2, "num_pages": 16, "len_indptr": 3, "num_kv_indices": 8},
                   {"kv_indptr": {"type": "random"}, "kv_indices": {"type": "random"}})
    write(root / "workloads/mla_paged" / f"{DEF}.jsonl",
          [{"definition": DEF, "workload": w, "solution": None, "evaluation": None} for w in (captured(), bad)])
    write(root / "workloads/elementwise" / f"{ADD}.jsonl",
          [{"definition": ADD, "workload": add_workload(), "solution": None, "evaluation": None}])
    folder = root / "solutions"
    write(folder / "alice/mla_paged" / DEF / "py_loop.json",
          solution("py_loop", "alice", "python", {"main.py": PY_SOLUTION}, "main.py::run", destination_passing_style=False))
    write(folder / "bob/mla_paged" / DEF / "cuda_tvm.json",
          solution("cuda_tvm", "bob", "cuda", {"kernel.cu": "// kernel\n", "main.cpp": "// binding\n"}, "main.cpp::run",
                   binding="tvm-ffi"))
    write(folder / "carol/mla_paged" / DEF / "tl_kernel.json",
          solution("tl_kernel", "carol", "tilelang", {"kernel.py": "def run():\n    pass\n"}, "kernel.py::run"))
    write(folder / "dave/elementwise" / ADD / "add_torch.json",
          solution("add_torch", "dave", "python", {"add.py": "def run(a, b):\n    return a + b\n"}, "add.py::run",
                   definition=ADD, destination_passing_style=False))
    write(root / "traces/mla_paged" / f"{DEF}.jsonl", traces())
    write(root / "traces/elementwise" / f"{ADD}.jsonl",
          [{"definition": ADD, "workload": add_workload(), "solution": "add_torch", "evaluation": passed(0.002)}])
    return root


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def empty_repo(path: Path) -> Path:
    (path / "definitions").mkdir(parents=True)
    return path


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".flashbench-cache" not in p.parts}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("fib"))


@pytest.fixture(scope="module")
def imported(dataset, tmp_path_factory):
    """(repo, summary): the FIB dataset imported into an empty repository."""
    repo = empty_repo(tmp_path_factory.mktemp("repo"))
    result = cli("import-fib", dataset, "--root", repo, "--source", "fib", "--json")
    assert result.exit_code == 0, result.output
    return repo, Summary.model_validate_json(result.stdout)


def rows(summary: Summary, definition: str, kind: str, outcome: str) -> list[str]:
    return [r.why for r in summary.rows if (r.definition, r.kind, r.outcome) == (definition, kind, outcome)]


# --- import ----------------------------------------------------------------------------------------

def test_import_writes_flashbench_layout(imported):
    repo, summary = imported
    assert [summary.count(k) for k in ("definition", "workload", "blob", "solution", "trace")] == [2, 2, 1, 3, 5]
    assert json.loads((repo / "definitions/mla_paged" / f"{DEF}.json").read_text()) == definition()
    # a definition nested two folders deep lands where flashbench keeps it
    assert (repo / "definitions/elementwise" / f"{ADD}.json").is_file()
    workloads = Repo(repo).workload_set(DEF)
    assert workloads.version == 1 and [w.uuid for w in workloads.workloads] == [CAPTURED]
    path = workloads.workloads[0].inputs["kv_indices"].path
    assert path == BLOB.removeprefix("./") and (repo / "definitions/mla_paged" / path).is_file()
    assert sorted(f.solution.name for f in Repo(repo).solution_folders(DEF)) == ["cuda_tvm", "py_loop"]
    cuda = Repo(repo).solution_folders(DEF)[0].solution
    assert (cuda.language, cuda.binding, cuda.sources) == ("cuda", "tvm-ffi", ["kernel.cu", "main.cpp"])
    assert cli("--root", repo, "validate").exit_code == 0


def test_import_summary_says_what_was_skipped_and_why(imported, dataset):
    _, summary = imported
    [workload] = rows(summary, DEF, "workload", "skipped")
    assert workload.startswith(f"{dataset}/workloads/mla_paged/{DEF}.jsonl: line 2: workload {RANDOM_INDICES} not imported")
    [tilelang] = rows(summary, DEF, "solution", "skipped")
    assert "solution tl_kernel not imported: language 'tilelang' has no flashbench builder" in tilelang
    assert any("binding tvm-ffi: imported, but" in why for why in rows(summary, DEF, "solution", "imported"))
    [graph] = rows(summary, "", "file", "ignored")  # JSON among the definitions that is no definition
    assert graph.startswith(f"not a definition: {dataset}/definitions/mla_paged/{DEF}.graph.json: ")
    assert not summary.failed


def test_import_prints_a_table_of_what_came_and_what_did_not(dataset, tmp_path):
    result = cli("import-fib", dataset, "--root", empty_repo(tmp_path))
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "outcome" in line)
    assert all(column in header for column in ("definition", "kind", "outcome", "count", "why"))
    assert "tilelang" in result.output and "ignored" in result.output
    assert result.output.rstrip().endswith("imported 2 definitions, 2 workloads, 1 blob, 3 solutions, 5 traces; "
                                           "2 skipped, 1 ignored, 0 failed")


def test_author_comes_from_the_solution_record_not_the_path(imported):
    """FIB 0.1.2 keeps traces at traces/<op_type>/<definition>.jsonl: the first folder is no author."""
    repo, summary = imported
    traces = {t.solution: t for t in read_traces(imported_trace_dir(repo, "fib") / "nvidia_h100" / f"{DEF}.jsonl")}
    assert {name: t.author for name, t in traces.items()} == {
        "py_loop": "alice", "cuda_tvm": "bob", "tl_kernel": "carol", "ghost": "unknown"}
    assert any("solution ghost has no record in the dataset" in why for why in rows(summary, DEF, "trace", "imported"))


def test_imported_traces_keep_fib_figures(imported):
    repo, _ = imported
    traces = {t.solution: t for t in read_traces(imported_trace_dir(repo, "fib") / "nvidia_h100" / f"{DEF}.jsonl")}
    passed_trace = traces["py_loop"]
    perf = passed_trace.performance
    assert (passed_trace.status, passed_trace.workload) == ("PASSED", CAPTURED)
    assert passed_trace.model_dump()["imported_from"] == "fib"  # provenance
    assert (perf.latency_ms, perf.samples, perf.std_ms, perf.ci_low_ms, perf.ci_high_ms) == (0.031, 1, 0.0, 0.031, 0.031)
    assert (perf.reference_latency_ms, perf.speedup) == (2.5, 80.6)  # FIB's reference latency and speedup
    assert perf.timing["method"] == "imported from FlashInfer-Bench"
    assert passed_trace.solution_hash == load_solution_folder(repo / "solutions" / DEF / "py_loop").content_hash()
    errors = passed_trace.correctness["*"]  # FIB's one error over all outputs
    assert errors.max_abs_error == 0.002 and math.isnan(errors.mismatch_fraction)
    assert traces["cuda_tvm"].log == "CUDA error: an illegal memory access" and traces["cuda_tvm"].performance is None
    assert traces["tl_kernel"].status == "INCORRECT_NUMERICAL"


def test_imported_traces_are_a_board_source_of_their_own(imported):
    repo, _ = imported
    assert read_results(repo / "traces", DEF).empty  # boards read our own runs only
    board = read_results(imported_trace_dir(repo, "fib"), DEF)
    assert sorted(board["solution"]) == ["cuda_tvm", "ghost", "py_loop", "tl_kernel"]
    assert set(board["hardware"]) == {"nvidia_h100"}
    assert set(board["timing_method"].dropna()) == {"imported from FlashInfer-Bench"}


def test_import_twice_adds_nothing(imported, dataset):
    repo, _ = imported
    before = files_of(repo)
    summary = import_fib(dataset, repo, "fib")
    assert [summary.count(k) for k in ("definition", "workload", "blob", "solution", "trace")] == [0, 0, 0, 0, 0]
    assert files_of(repo) == before


def test_import_again_over_a_trace_file_holding_lines_that_are_no_traces(dataset, tmp_path):
    """A line that is JSON but no trace object (a list, a name that is a list) in an earlier import's trace file
    ended the next import with a traceback: such lines are skipped, as every board skips them."""
    repo = empty_repo(tmp_path / "repo")
    import_fib(dataset, repo, "fib")
    [trace_file, *_] = sorted(imported_trace_dir(repo, "fib").rglob("*.jsonl"))
    with trace_file.open("a") as handle:
        handle.write('[1, 2]\n{"solution": ["a"], "workload": "w"}\n')

    summary = import_fib(dataset, repo, "fib")

    assert summary.count("trace") == 0 and not summary.failed


def test_a_broken_record_fails_its_definition_only_and_names_file_line_and_field(tmp_path):
    dataset = make_dataset(tmp_path / "fib")
    path = dataset / "workloads/mla_paged" / f"{DEF}.jsonl"
    path.write_text(path.read_text().replace('"tensor_key": "kv_indptr"', '"key": "kv_indptr"', 1))
    repo = empty_repo(tmp_path / "repo")
    result = cli("import-fib", dataset, "--root", repo, "--json")
    assert result.exit_code == 1
    summary = Summary.model_validate_json(result.stdout)
    [failed] = summary.failed
    assert failed.definition == DEF
    assert f"{path}: line 1, workload.inputs.kv_indptr.safetensors.tensor_key: " in failed.why
    assert "\n" not in failed.why
    written = set(files_of(repo))
    assert not [p for p in written if DEF in p or "mla_paged" in p], written  # nothing of it
    assert f"definitions/elementwise/{ADD}.json" in written  # the other definition came in whole


def test_a_definition_we_have_in_another_shape_is_not_imported(tmp_path):
    dataset = make_dataset(tmp_path / "fib")
    changed = definition()
    changed["axes"]["num_qo_heads"]["value"] = 128
    write(dataset / "definitions/mla_paged" / f"{DEF}.json", changed)
    repo = copy_repo(tmp_path / "repo")  # holds our own YAML of this definition, 16 heads
    before = files_of(repo)
    summary = import_fib(dataset, repo, "fib")
    [failed] = summary.failed
    assert failed.definition == DEF and "axes.num_qo_heads.value: 16 here, 128 there" in failed.why
    assert {k: v for k, v in files_of(repo).items() if ADD not in k} == before


def test_a_definition_we_have_with_its_axes_in_another_order_is_kept(tmp_path):
    """FIB's mla_paged_prefill_causal_h16_ckv512_kpe64_ps1 lists the axes of ours in another order;
    axes are looked up by name, so that is the same interface (inputs and outputs, passed by
    position, must keep their order)."""
    dataset = make_dataset(tmp_path / "fib")
    reordered = definition()
    axes = reordered["axes"]
    reordered["axes"] = {k: axes[k] for k in ("num_qo_heads", "head_dim_ckv", "head_dim_kpe", "page_size",
                                               "batch_size", "num_pages", "len_indptr", "num_kv_indices")}
    write(dataset / "definitions/mla_paged" / f"{DEF}.json", reordered)
    repo = copy_repo(tmp_path / "repo")
    summary = import_fib(dataset, repo, "fib")
    assert not summary.failed, summary.failed
    [kept] = rows(summary, DEF, "definition", "unchanged")
    assert "has the same interface; kept it" in kept
    assert not (repo / "definitions/mla_paged" / f"{DEF}.json").exists()

    swapped = definition()
    inputs = swapped["inputs"]
    swapped["inputs"] = {k: inputs[k] for k in ("q_pe", "q_nope", *list(inputs)[2:])}
    swapped["reference"] = REFERENCE.replace("def run(q_nope, q_pe,", "def run(q_pe, q_nope,")
    write(dataset / "definitions/mla_paged" / f"{DEF}.json", swapped)
    [failed] = import_fib(dataset, copy_repo(tmp_path / "repo2"), "fib").failed
    assert "inputs: q_nope, q_pe, ckv_cache" in failed.why and "q_pe, q_nope, ckv_cache" in failed.why


def test_a_workload_whose_blob_is_absent_is_skipped_and_says_missing(tmp_path):
    """FIB's git copy of its dataset has workloads/ but no blob/ (the blobs are published apart):
    such a workload is skipped as missing its blob, which is not the same as a path that leaves
    the dataset."""
    dataset = make_dataset(tmp_path / "fib")
    (dataset / BLOB).unlink()
    escaping = captured() | {"uuid": "7d1e2f30-0000-4000-8000-000000000001"}
    escaping["inputs"] = escaping["inputs"] | {"kv_indptr": {"type": "safetensors", "path": "../outside.safetensors",
                                                             "tensor_key": "kv_indptr"}}
    write(dataset / "workloads/mla_paged" / f"{DEF}.jsonl",
          [{"definition": DEF, "workload": w, "solution": None, "evaluation": None} for w in (captured(), escaping)])
    (dataset / "traces/mla_paged" / f"{DEF}.jsonl").unlink()
    summary = import_fib(dataset, empty_repo(tmp_path / "repo"), "fib")
    assert not summary.failed, summary.failed
    missing, outside = rows(summary, DEF, "workload", "skipped")
    assert f"workload {CAPTURED} not imported: inputs.kv_indptr: safetensors file {BLOB} is missing from the dataset" \
        in missing
    assert "inputs.kv_indptr: safetensors file ../outside.safetensors is not inside the dataset" in outside


def test_a_skipped_workload_names_its_field(tmp_path):
    """The reason said what was wrong ("an integer past int64 is no value here"), not where in the record."""
    dataset = make_dataset(tmp_path / "fib")
    huge = captured() | {"uuid": "7d1e2f30-0000-4000-8000-000000000002"}
    huge["inputs"] = huge["inputs"] | {"sm_scale": {"type": "scalar", "value": 10**30}}
    write(dataset / "workloads/mla_paged" / f"{DEF}.jsonl",
          [{"definition": DEF, "workload": huge, "solution": None, "evaluation": None}])
    (dataset / "traces/mla_paged" / f"{DEF}.jsonl").unlink()
    (skipped,) = rows(import_fib(dataset, empty_repo(tmp_path / "repo"), "fib"), DEF, "workload", "skipped")
    assert skipped.endswith(f"workload {huge['uuid']} not imported: inputs.sm_scale.scalar.value: an integer past "
                            "int64 is no value here")


def test_a_failed_move_puts_the_repository_back_as_it_was(tmp_path, monkeypatch):
    dataset = make_dataset(tmp_path / "fib")
    repo = empty_repo(tmp_path / "repo")
    import_fib(dataset, repo, "fib")
    before = files_of(repo)
    # A new solution (its folder is moved in) and a new trace (its file is rewritten)...
    source = dataset / "solutions/alice/mla_paged" / DEF / "py_loop.json"
    record = json.loads(source.read_text())
    (source.parent / "py_loop_v2.json").write_text(json.dumps(record | {"name": "py_loop_v2"}))
    newer = traces()[0] | {"evaluation": passed() | {"timestamp": "2025-09-02T12:00:00"}}
    with open(dataset / "traces/mla_paged" / f"{DEF}.jsonl", "a") as handle:
        handle.write(json.dumps(newer) + "\n")
    # ...and moving the new trace file in fails (once), after the solution folder was moved in.
    real, moved, failure = os.replace, [], [OSError(28, "No space left on device")]
    trace_file = imported_trace_dir(repo, "fib") / "nvidia_h100" / f"{DEF}.jsonl"

    def failing(src, dst, **folders):  # moves into the repository name the target in its folder's descriptor
        if dst == trace_file.name and failure:
            raise failure.pop()
        moved.append(dst)
        return real(src, dst, **folders)

    monkeypatch.setattr(staging.os, "replace", failing)
    summary = import_fib(dataset, repo, "fib")
    assert [f.definition for f in summary.failed] == [DEF]
    assert "No space left on device" in summary.failed[0].why
    assert "py_loop_v2" in moved  # the new folder was in place before the failure
    assert files_of(repo) == before
    assert not any((repo / ".flashbench-cache" / "import-staging").iterdir())  # no staging left behind


def test_a_dataset_cannot_replace_a_folder_by_naming_its_author(tmp_path):
    """An author is a name any dataset can write: a folder with other files is never replaced."""
    dataset = make_dataset(tmp_path / "fib")
    repo = empty_repo(tmp_path / "repo")
    import_fib(dataset, repo, "fib")
    folder = repo / "solutions" / DEF / "py_loop"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    source = dataset / "solutions/alice/mla_paged" / DEF / "py_loop.json"
    source.write_text(source.read_text().replace("return out, lse", "return out, lse  # changed"))
    summary = import_fib(dataset, repo, "evil")
    (skipped,) = [r for r in rows(summary, DEF, "solution", "skipped") if "py_loop" in r]
    assert "holds other files; not replaced" in skipped
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def import_again_with_copies(tmp_path: Path, names: tuple[str, ...], broken: tuple[str, ...] = ()
                             ) -> tuple[list[str], set[str]]:
    """Imports the dataset, then again with copies of py_loop under `names` (those in `broken` with an entry point
    that names no function): the second import's skipped rows, and the folders the definition then has."""
    dataset = make_dataset(tmp_path / "fib")
    repo = empty_repo(tmp_path / "repo")
    import_fib(dataset, repo, "fib")
    source = dataset / "solutions/alice/mla_paged" / DEF / "py_loop.json"
    record = json.loads(source.read_text())
    for name in names:
        copy = record | {"name": name}
        if name in broken:
            copy["spec"] = record["spec"] | {"entry_point": "main.py::nothing"}
        (source.parent / f"{name}.json").write_text(json.dumps(copy))
    summary = import_fib(dataset, repo, "again")
    return rows(summary, DEF, "solution", "skipped"), {p.name for p in (repo / "solutions" / DEF).iterdir()}


def test_a_dataset_cannot_add_a_folder_named_like_one_here_but_for_case(tmp_path):
    """On a case-insensitive file system Py_loop is the folder py_loop: it is neither imported beside it nor
    over it, and two records of one dataset whose names differ only in case give one folder."""
    skipped, names = import_again_with_copies(tmp_path, ("Py_loop", "PY_LOOP_V2", "py_loop_v2"))
    assert any("Py_loop differs from" in why and "only in case" in why for why in skipped)
    assert any("(case aside) was already imported" in why for why in skipped)
    lowered = [name.lower() for name in names]
    assert "py_loop_v2" in lowered and len(lowered) == len(set(lowered))  # one of the two, and no two alike


def test_a_dataset_cannot_add_a_folder_whose_name_reads_as_one_here(tmp_path):
    """`py_Ioop` (a capital i for the l) beside `py_loop` is two board rows a reader takes for one, as `pyloop_2`
    and `pyl00p_2` of one dataset are (the first by name is imported): a run refuses such a folder from
    elsewhere, and the import skips it."""
    skipped, names = import_again_with_copies(tmp_path, ("py_Ioop", "pyloop_2", "pyl00p_2", "pyIoop_3", "pyloop_3",
                                                         "py1oop_4", "pyloop_4"), broken=("py1oop_4",))
    assert any("the name py_Ioop reads as py_loop on a board" in why for why in skipped)
    assert any("the name pyloop_2 reads as pyl00p_2 on a board" in why for why in skipped)  # in the order of names
    assert any("the name pyloop_3 reads as pyIoop_3 on a board" in why for why in skipped)  # a capital I: as written
    assert any("py1oop_4" in why and "not imported" in why for why in skipped)  # skipped, so it holds no name
    assert {"pyl00p_2", "pyIoop_3", "pyloop_4"} <= names and not names & {"py_Ioop", "pyloop_2", "pyloop_3"}


def test_a_dataset_of_deeply_nested_folders_is_read_to_a_depth(tmp_path):
    """pathlib's `**` recursed: 1,200 nested folders under solutions/ ended the import in a RecursionError. The
    walk now stops 16 folders down, says so, and imports the rest."""
    dataset = make_dataset(tmp_path / "fib")
    with nested_folders(dataset / "solutions", 1200):
        summary = import_fib(dataset, empty_repo(tmp_path / "repo"), "fib")
    assert any("more than 16 folders deep; not read" in why for why in rows(summary, "", "file", "ignored"))
    assert rows(summary, DEF, "solution", "imported")


def test_a_dataset_trace_cannot_stand_for_the_reference(tmp_path):
    """On a board the reference is every speedup's denominator: only an export's side file may give it."""
    dataset = make_dataset(tmp_path / "fib")
    forged = traces()[0] | {"solution": "reference", "evaluation": passed(100.0)}
    with open(dataset / "traces/mla_paged" / f"{DEF}.jsonl", "a") as handle:
        handle.write(json.dumps(forged) + "\n")
    repo = empty_repo(tmp_path / "repo")
    summary = import_fib(dataset, repo, "fib")
    (skipped,) = rows(summary, DEF, "trace", "skipped")
    assert "may not be the definition's 'reference'" in skipped
    imported = read_traces(imported_trace_dir(repo, "fib") / "nvidia_h100" / f"{DEF}.jsonl")
    assert "reference" not in {t.solution for t in imported} and imported


def test_import_never_runs_a_definition_reference(tmp_path):
    """A downloaded dataset is data: its reference is checked by reading it (a `run` of the inputs), never run."""
    dataset = make_dataset(tmp_path / "fib")
    marker = tmp_path / "ran"
    ran = add_definition() | {"reference": f"open({str(marker)!r}, 'w').close()\n\n\ndef run(a, b):\n    return a\n"}
    write(dataset / "definitions/elementwise/fp32/nested" / f"{ADD}.json", ran)
    wrong = definition() | {"reference": f"open({str(marker)!r}, 'w').close()\n\n\ndef run(a):\n    return a\n"}
    write(dataset / "definitions/mla_paged" / f"{DEF}.json", wrong)
    summary = import_fib(dataset, empty_repo(tmp_path / "repo"), "fib")
    assert not marker.exists()
    assert rows(summary, ADD, "definition", "imported")
    (failed,) = rows(summary, DEF, "definition", "failed")
    assert "run takes (a) but must take (q_nope" in failed


def test_a_second_dataset_cannot_replace_a_definition_an_earlier_import_wrote(tmp_path):
    """A JSON definition here is the repository's like any other: never replaced, whatever its file's name."""
    repo = empty_repo(tmp_path / "repo")
    import_fib(make_dataset(tmp_path / "first"), repo, "first")
    path = repo / "definitions/elementwise" / f"{ADD}.json"
    before = path.read_bytes()
    second = make_dataset(tmp_path / "second")
    lax = add_definition() | {"reference": "def run(a, b):\n    return a * 0\n",
                              "flashbench": {"tolerances": {"c": {"atol": 1e9, "rtol": 1e9}}}}
    write(second / "definitions/elementwise/fp32/nested" / f"{ADD}.json", lax)
    summary = import_fib(second, repo, "second")
    assert path.read_bytes() == before
    (kept,) = rows(summary, ADD, "definition", "unchanged")
    assert "kept it" in kept
    lax["inputs"]["a"]["dtype"] = "float16"
    write(second / "definitions/elementwise/fp32/nested" / f"{ADD}.json", lax)
    (failed,) = rows(import_fib(second, repo, "second"), ADD, "definition", "failed")
    assert "inputs.a.dtype" in failed and path.read_bytes() == before


def test_import_reads_no_file_through_a_link_out_of_the_dataset_nor_a_fifo(tmp_path):
    dataset = make_dataset(tmp_path / "fib")
    outside = write(tmp_path / "outside.json", add_definition() | {"name": "stolen"})
    (dataset / "definitions/stolen.json").symlink_to(outside)
    blob = dataset / BLOB
    shutil.move(blob, tmp_path / "outside.safetensors")
    blob.symlink_to(tmp_path / "outside.safetensors")
    os.mkfifo(dataset / "traces/elementwise/fifo.jsonl")  # read, it blocked the import for ever
    (dataset / "workloads/elementwise/zero.jsonl").symlink_to("/dev/zero")
    repo = empty_repo(tmp_path / "repo")
    summary = import_fib(dataset, repo, "fib")
    assert "stolen" not in Repo(repo).names() and not list(repo.rglob("*.safetensors"))
    ignored = " ".join(rows(summary, "", "file", "ignored"))
    assert all(f"{name}: a link out of the dataset" in ignored for name in ("stolen.json", "fifo.jsonl", "zero.jsonl"))
    (skipped,) = [w for w in rows(summary, DEF, "workload", "skipped") if CAPTURED in w]
    assert "a link out of the dataset" in skipped


def test_import_copies_no_repository_trace_file_that_is_a_link(tmp_path):
    """A committed link in place of a trace file (to /proc/self/environ) was read and its target's bytes committed."""
    dataset = make_dataset(tmp_path / "fib")
    repo = empty_repo(tmp_path / "repo")
    secret = tmp_path / "secret.txt"
    secret.write_text("MY_API_TOKEN=sekrit-123\n")
    trace_file = imported_trace_dir(repo, "fib") / "nvidia_h100" / f"{ADD}.jsonl"
    trace_file.parent.mkdir(parents=True)
    trace_file.symlink_to(secret)

    summary = import_fib(dataset, repo, "fib")

    assert trace_file.is_symlink()  # left as it was: no plain file holds what it leads to
    assert not any(b"sekrit" in p.read_bytes() for p in repo.rglob("*") if p.is_file() and not p.is_symlink())
    (failed,) = summary.failed
    assert failed.definition == ADD and f"{trace_file}: cannot read: it is a link" in failed.why
    assert summary.count("trace", "imported") == len(traces())  # the other definition came in


def test_import_writes_nothing_through_a_folder_of_the_repository_that_is_a_link(tmp_path):
    """A committed link definitions/<op_type> to a folder outside received the import's definition and workloads."""
    dataset = make_dataset(tmp_path / "fib")
    repo = empty_repo(tmp_path / "repo")
    outside = tmp_path / "outside"
    outside.mkdir()
    (repo / "definitions/elementwise").symlink_to(outside)

    summary = import_fib(dataset, repo, "fib")

    assert not any(outside.iterdir())
    (failed,) = summary.failed
    assert failed.definition == ADD
    assert failed.why == (f"nothing of it imported: {repo / 'definitions/elementwise'}: a link or a file where a "
                          "folder should be; nothing is placed through it")
    assert ADD not in Repo(repo).names() and DEF in Repo(repo).names()
    assert not list(imported_trace_dir(repo, "fib").rglob(f"{ADD}*"))  # none of its files came in elsewhere


def test_hostile_records_are_one_line_each_and_the_rest_comes_in(tmp_path):
    """Each of these stopped the whole import with a traceback (or failed its whole definition)."""
    dataset = make_dataset(tmp_path / "fib")
    path = dataset / "solutions/dave/elementwise" / ADD / "add_torch.json"
    record = json.loads(path.read_text())
    manifest = ("name: add_torch\ndefinition: vector_add_f32\nauthor: dave\nlanguage: python\nentry_point: add.py::run\n"
                "destination_passing_style: false\nshared: [lib]\n")
    record["flashbench"] = {"name": "add_torch", "manifest": manifest, "solution_hash": "0", "shared": {"lib": ["x.py"]}}
    write(path, record)  # a shared file that is none of its sources (KeyError)
    long = solution("long_name", "eve", "python", {"add.py": "def run(a, b):\n    return a\n", "x" * 300: "y"},
                    "add.py::run", definition=ADD, destination_passing_style=False)
    write(dataset / "solutions/eve/long_name.json", long)  # OSError: the definition failed
    huge = add_workload() | {"uuid": "5e1f0000-huge", "axes": {"n": 10**30}}  # TypeError from torch
    over = add_workload() | {"uuid": "5e1f0000-over", "axes": {"n": 2**62}}  # RuntimeError from torch
    with open(dataset / "workloads/elementwise" / f"{ADD}.jsonl", "a") as handle:
        handle.write("".join(json.dumps({"definition": ADD, "workload": w}) + "\n" for w in (huge, over)))
    with open(dataset / "traces/elementwise/deep.jsonl", "w") as handle:
        handle.write("[" * 100_000 + "\n")  # RecursionError
    summary = import_fib(dataset, empty_repo(tmp_path / "repo"), "fib")
    assert not rows(summary, ADD, "definition", "failed") and rows(summary, ADD, "definition", "imported")
    (manifest_note,) = rows(summary, ADD, "solution", "imported")
    assert "flashbench.shared.lib names 'x.py'" in manifest_note
    (too_long,) = rows(summary, ADD, "solution", "skipped")
    assert "long_name.json" in too_long and "cannot be written" in too_long
    skipped = rows(summary, ADD, "workload", "skipped")
    assert len(skipped) == 2 and "less than or equal" in skipped[0] and "cannot be made" in skipped[1]
    assert any("deep.jsonl: line(s) 1: not a FIB record" in why for why in rows(summary, "", "file", "ignored"))


def test_a_reference_trace_file_holds_its_definition_reference_traces_only(tmp_path):
    dataset = make_dataset(tmp_path / "fib")
    forged = our_trace("add_torch", ADD_WORKLOAD, "PASSED", "2030-01-01", performance=performance(0.0001))
    elsewhere = forged.model_copy(update={"definition": DEF, "solution": "reference"})
    lines = [forged.model_dump_json() + "\n", elsewhere.model_dump_json() + "\n"]
    fib_path = dataset / "flashbench/reference_traces" / f"{ADD}.jsonl"
    fib_path.parent.mkdir(parents=True)
    fib_path.write_text("".join(lines))
    repo = empty_repo(tmp_path / "repo")
    summary = import_fib(dataset, repo, "fib")
    assert len(rows(summary, ADD, "trace", "skipped")) == 2
    imported = [t for f in imported_trace_dir(repo, "fib").rglob("*.jsonl") for t in read_traces(f)]
    assert "2030-01-01" not in {t.timestamp for t in imported} and imported


def test_a_workload_uuid_here_with_other_axes_there_brings_neither_it_nor_its_traces(tmp_path):
    repo = empty_repo(tmp_path / "repo")
    import_fib(make_dataset(tmp_path / "first"), repo, "first")
    second = make_dataset(tmp_path / "second")
    other = add_workload() | {"axes": {"n": 4096}}
    write(second / "workloads/elementwise" / f"{ADD}.jsonl", [{"definition": ADD, "workload": other}])
    write(second / "traces/elementwise" / f"{ADD}.jsonl",
          [{"definition": ADD, "workload": other, "solution": "add_torch", "evaluation": passed(0.5)}])
    summary = import_fib(second, repo, "second")
    (skipped,) = rows(summary, ADD, "workload", "skipped")
    assert "has axes {'n': 4096} there, {'n': 16} here" in skipped
    assert not rows(summary, ADD, "trace", "imported")


def test_a_workload_whose_uuid_is_a_name_here_is_skipped_and_the_set_still_loads(tmp_path):
    """Workload sets refuse a name that is another workload's name or uuid (two rows no one can tell apart); an
    import appended such a workload unchecked and left a file no later command could load."""
    repo = empty_repo(tmp_path / "repo")
    import_fib(make_dataset(tmp_path / "first"), repo, "first")
    (workloads_file,) = (repo / "definitions").rglob(f"{ADD}.workloads.yaml")
    workloads_file.write_text(workloads_file.read_text().replace(f"- uuid: {ADD_WORKLOAD}",
                                                                 f"- uuid: {ADD_WORKLOAD}\n  name: named_workload"))
    second = make_dataset(tmp_path / "second")
    write(second / "workloads/elementwise" / f"{ADD}.jsonl",
          [{"definition": ADD, "workload": add_workload() | {"uuid": "named_workload"}}])
    summary = import_fib(second, repo, "second")
    (skipped,) = rows(summary, ADD, "workload", "skipped")
    assert "uuid: named_workload is another workload's name" in skipped
    assert [w.name for w in Repo(repo).workload_set(ADD).workloads] == ["named_workload"]


def test_a_workload_run_would_refuse_is_not_imported(tmp_path):
    """A dataset's workload capturing a query (data no call redraws) was imported into the repository's set; then
    `run` refused the whole definition, every default CPU run and `submit` included."""
    root = make_dataset(tmp_path / "fib")
    save_file({"q_pe": torch.zeros(2, 16, 64, dtype=torch.bfloat16)}, str(root / "blob" / "q_pe.safetensors"))
    hostile = captured()
    hostile["uuid"] = "0bad0bad-0000-4000-8000-000000000001"
    hostile["inputs"]["q_pe"] = {"type": "safetensors", "path": "./blob/q_pe.safetensors", "tensor_key": "q_pe"}
    write(root / "workloads/mla_paged" / f"{DEF}.jsonl", [{"definition": DEF, "workload": hostile}])
    repo = empty_repo(tmp_path / "repo")
    summary = import_fib(root, repo, "fib")
    assert any("inputs q_pe carry data that no call redraws" in why for why in rows(summary, DEF, "workload", "skipped"))
    assert hostile["uuid"] not in {w.uuid for w in Repo(repo).workload_set(DEF).workloads}


def test_an_import_waits_for_a_run_writing_the_trace_directory(tmp_path, capsys):
    """A run sets aside any file it did not write under its trace directory: traces imported meanwhile left the
    boards as `*.untrusted`. The import waits for the run (its lock on the folder), as a second run does."""
    repo = empty_repo(tmp_path / "repo")
    (repo / "traces").mkdir()
    dataset = make_dataset(tmp_path / "fib")
    done = threading.Event()
    thread = threading.Thread(target=lambda: (import_fib(dataset, repo, "fib"), done.set()))
    with sole_writer(repo / "traces"):
        thread.start()
        while "waiting for another flashbench run" not in capsys.readouterr().err:
            assert thread.is_alive()
            done.wait(0.01)
        assert not done.is_set() and not imported_trace_dir(repo, "fib").exists()
    thread.join()
    assert done.is_set() and any(imported_trace_dir(repo, "fib").rglob("*.jsonl"))


# --- running a FIB solution JSON as it is -------------------------------------------------------------

def test_a_fib_solution_json_runs_as_a_solution_folder(imported, dataset, tmp_path):
    repo, _ = imported
    fib_json = dataset / "solutions/alice/mla_paged" / DEF / "py_loop.json"
    folder = solution_from_fib_json(fib_json, tmp_path / "materialised")
    assert solution_from_fib_json(fib_json, tmp_path / "materialised") == folder  # the same file, the same folder
    assert (folder / "main.py").read_text() == PY_SOLUTION
    result = cli("--root", repo, "run", "--def", "mla_paged_decode", "--solution", folder, "--workload", CAPTURED,
                 "--device", "cpu", "--iters", 2, "--warmup", 0, "--trace-dir", tmp_path / "traces")
    assert result.exit_code == 0, result.output
    [path] = (tmp_path / "traces").glob(f"*/{DEF}.jsonl")
    assert {t.solution: t.status for t in read_traces(path)} == {"reference": "PASSED", "py_loop": "PASSED"}


def test_a_fib_solution_json_runs_its_own_files_whatever_its_folder_holds(tmp_path):
    """The folder a JSON is made into is named by 64 bits of its hash (two files made to share them: minutes of
    two cores, threat model class 10) and was used again on its name alone: the second JSON of a colliding
    pair ran the first one's code, and its trace, content hash and all, said so."""
    into = tmp_path / "materialised"
    sources = {name: f"def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):\n    return {name!r}\n"
               for name in ("correct", "wrong")}
    correct = write(tmp_path / "correct.json", solution("x", "eve", "python", {"main.py": sources["correct"]}, "main.py::run"))
    wrong = write(tmp_path / "wrong.json", solution("x", "eve", "python", {"main.py": sources["wrong"]}, "main.py::run"))
    made = solution_from_fib_json(wrong, into)
    shutil.rmtree(made)  # what the correct JSON leaves there when its name is the wrong one's
    shutil.copytree(solution_from_fib_json(correct, into), made)
    assert (solution_from_fib_json(wrong, into) / "main.py").read_text() == sources["wrong"]


def test_a_fib_solution_json_that_cannot_run_here_says_why(dataset, tmp_path):
    with pytest.raises(FlashbenchError, match="cannot run this solution here: language 'tilelang' has no flashbench"):
        solution_from_fib_json(dataset / "solutions/carol/mla_paged" / DEF / "tl_kernel.json", tmp_path)
    broken = write(tmp_path / "broken.json", solution("x", "y", "python", {"a.py": "x"}, "a.py::run") | {"spec": {}})
    with pytest.raises(FlashbenchError, match=r"broken\.json: spec\.language: "):
        solution_from_fib_json(broken, tmp_path)


@pytest.mark.parametrize("sources", [{"main.py": "def run(): pass", ".": "x"},
                                     {"main.py": "def run(): pass", "lib": "x", "lib/a.py": "y"},
                                     {"main.py": "def run(): pass", ".git/config": "[core]\n\tfsmonitor = x\n"},
                                     {"main.py": "def run(): pass", "docs/.gitattributes": "* -diff\n"}])
def test_a_fib_solution_json_whose_source_path_names_a_folder_says_why(tmp_path, sources):
    """A source at "." (the folder itself) or at a path another source lies under ended in IsADirectoryError;
    one under `.git` (a red team's dataset: its `core.fsmonitor` ran when `git status` was typed in the imported
    folder) or another of version control's files was written."""
    odd = write(tmp_path / "odd.json", solution("x", "y", "python", sources, "main.py::run"))
    with pytest.raises(FlashbenchError, match="cannot be written inside a solution folder"):
        solution_from_fib_json(odd, tmp_path / "materialised")


@pytest.mark.parametrize("path", ["d/" * 1500 + "x.py", "/".join(["p" * 250] * 17) + "/x.py"])
def test_a_fib_solution_json_with_a_source_too_deep_or_too_long_says_why(tmp_path, path):
    """1,500 nested folders ended the run in a RecursionError, a 4,268-byte path in ENAMETOOLONG: one line now."""
    odd = write(tmp_path / "odd.json", solution("x", "y", "python", {"main.py": "def run(): pass", path: ""},
                                               "main.py::run"))
    with pytest.raises(FlashbenchError, match="names deep|bytes long") as refused:
        solution_from_fib_json(odd, tmp_path / "materialised")
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 400


def test_a_fib_manifest_of_yaml_aliases_is_refused_before_it_is_expanded(tmp_path):
    """A 444-byte flashbench.manifest of nested aliases held the runner for minutes at 8 GB while an error message
    quoted the list it expands to: it is refused as a folder's own solution.yaml is, and the spec used instead."""
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    levels += [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefghij", "bcdefghijk")]
    manifest = "\n".join(levels + ["language: *k", "name: x", "definition: d", "entry_point: main.py::run"]) + "\n"
    record = solution("x", "y", "python", {"main.py": "def run(): pass"}, "main.py::run")
    record["flashbench"] = {"name": "x", "manifest": manifest, "solution_hash": "0", "shared": {}}
    plan = plan_folder(FibSolution.model_validate(record))
    assert any("flashbench.manifest not used" in note and "a YAML alias" in note for note in plan.notes)
    assert "&a" not in plan.manifest


# --- export ----------------------------------------------------------------------------------------

def test_fib_dataset_round_trip_keeps_what_both_formats_express(imported, dataset, tmp_path):
    repo, _ = imported
    summary = export_fib(repo, tmp_path / "out")
    out = tmp_path / "out"

    def load(path):
        return json.loads(path.read_text())

    def lines(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    assert summary.count("trace") == 5
    assert load(out / "definitions/mla_paged" / f"{DEF}.json") == definition()
    [entry] = lines(out / "workloads/mla_paged" / f"{DEF}.jsonl")
    assert entry == {"definition": DEF, "workload": captured(), "solution": None, "evaluation": None}
    assert (out / BLOB).read_bytes() == (dataset / BLOB).read_bytes()
    for author, name in (("alice", "py_loop"), ("bob", "cuda_tvm")):
        original = load(dataset / "solutions" / author / "mla_paged" / DEF / f"{name}.json")
        exported = load(out / "solutions" / author / "mla_paged" / DEF / f"{name}.json")
        for field in ("name", "definition", "author", "description"):
            assert exported[field] == original[field], field
        spec = FibBuildSpec.model_validate
        assert spec(exported["spec"]) == spec(original["spec"])  # defaults filled in
        assert exported["sources"] == original["sources"]
    exported = {t["solution"]: t for t in lines(out / "traces/mla_paged" / f"{DEF}.jsonl")}
    for record in traces():
        assert exported[record["solution"]] == record, record["solution"]  # FIB's own records come back as they were


def our_trace(solution, workload, status, timestamp, **fields) -> Trace:
    return Trace(definition=DECODE, workload=workload, solution=solution, solution_hash="0" * 16, author="me",
                 hardware="NVIDIA H200", status=status, timestamp=timestamp,
                 environment={"hardware": "NVIDIA H200", "torch": "2.13.0", "cuda": "12.8"}, **fields)


DECODE, PREFILL = DEF, "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"
KERNEL = "from .helpers import scale\n\n\ndef run(*args):\n    return scale(args)\n"


def performance(latency: float) -> Performance:
    return Performance(latency_ms=latency, mean_ms=latency * 1.1, std_ms=0.01, min_ms=latency * 0.9, p10_ms=latency * 0.95,
                       p90_ms=latency * 1.2, samples=40, ci_low_ms=latency * 0.98, ci_high_ms=latency * 1.02,
                       reference_latency_ms=2.0, speedup=2.0 / latency, bytes=1e6, flops=2e9,
                       timing={"method": "events", "l2_flush": "write+read v2"}, crosscheck={"agrees": True})


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    """A small repository of our own: two definitions whose solutions share a name, a shared folder, an
    empty file, and traces of every kind FIB lacks (REJECTED, CRASHED, the reference's, graph timings)."""
    root = copy_repo(tmp_path_factory.mktemp("ours"))
    shared = root / "solutions/_shared/torch_common"
    shared.mkdir(parents=True)
    (shared / "helpers.py").write_text("def scale(args):\n    return args\n")
    for name, extra in ((DECODE, "shared: [torch_common]\ntags: [baseline]\n"), (PREFILL, "")):
        folder = root / "solutions" / name / "torch_ref"
        folder.mkdir(parents=True)
        (folder / "kernel.py").write_text(KERNEL if extra else "def run(*args):\n    return args\n")
        (folder / "__init__.py").write_text("")
        (folder / "solution.yaml").write_text(f"name: torch_ref\ndefinition: {name}\nauthor: me\nlanguage: python\n"
                                              f"entry_point: kernel.py::run\ndestination_passing_style: false\n{extra}")
    first, second = [w.uuid for w in Repo(root).workload_set(DECODE).workloads[:2]]
    events = root / "traces/nvidia_h200" / f"{DECODE}.jsonl"
    errors = {"output": OutputError(max_abs_error=0.01, max_rel_error=0.002, mismatch_fraction=0.0),
              "lse": OutputError(max_abs_error=0.5, max_rel_error=math.inf, mismatch_fraction=0.25)}
    for trace in (
        our_trace("reference", first, "PASSED", "2026-01-01T00:00:00+00:00", performance=performance(2.0)),
        our_trace("torch_ref", first, "PASSED", "2026-01-01T00:00:01+00:00", performance=performance(0.5),
                  correctness=errors, solution_tags=["baseline"], workload_name="smoke_empty_short", isolation="namespaces"),
        our_trace("torch_ref", second, "REJECTED", "2026-01-01T00:00:02+00:00", message="inputs changed by the call",
                  correctness=errors, log="worker log"),
        our_trace("gone", first, "CRASHED", "2026-01-01T00:00:03+00:00", message="worker died (SIGSEGV)"),
    ):
        append_trace(events, trace)
    append_trace(root / "traces/nvidia_h200" / f"{DECODE}.graph.jsonl",
                 our_trace("torch_ref", first, "PASSED", "2026-01-01T00:00:04+00:00", performance=performance(0.4)))
    return root


@pytest.fixture(scope="module")
def exported(ours, tmp_path_factory) -> tuple[Path, Summary]:
    out = tmp_path_factory.mktemp("export") / "fib"
    return out, export_fib(ours, out)


def test_export_loads_in_flashinfer_bench(exported, ours):
    data = pytest.importorskip(
        "flashinfer_bench.data", reason="flashinfer-bench 0.1.2 is not installed; CI installs it with "
        "`pip install --no-deps flashinfer-bench==0.1.2 docstring-parser`")
    out, _ = exported
    trace_set = data.TraceSet.from_path(str(out))  # FIB's own loader: every record validated by its models
    assert set(trace_set.definitions) == {DECODE, PREFILL}
    names = {s.name: s.definition for solutions in trace_set.solutions.values() for s in solutions}
    assert names == {f"torch_ref_{hashlib.sha256(d.encode()).hexdigest()[:8]}": d for d in (DECODE, PREFILL)}
    decode_name = next(n for n, d in names.items() if d == DECODE)
    outcomes = sorted((t.solution, t.evaluation.status.value) for t in trace_set.traces[DECODE])
    assert outcomes == [("gone", "RUNTIME_ERROR"), (decode_name, "INCORRECT_NUMERICAL"), (decode_name, "PASSED")]
    assert len(trace_set.workloads[DECODE]) == len(Repo(ours).workload_set(DECODE).workloads)
    best = trace_set.get_best_trace(DECODE, max_abs_error=1.0, max_rel_error=math.inf)
    assert best.solution == decode_name and best.evaluation.performance.latency_ms == 0.5


def test_export_keeps_what_fib_cannot_hold(exported, ours):
    out, summary = exported
    decode_name = f"torch_ref_{hashlib.sha256(DECODE.encode()).hexdigest()[:8]}"
    side = json.loads((out / "flashbench.json").read_text())
    assert side["solutions"][decode_name] == {"definition": DECODE, "name": "torch_ref"}
    assert side["timing"] == "events"
    records = {(t["solution"], t["evaluation"]["status"]): t
               for t in map(json.loads, (out / "traces/mla_paged" / f"{DECODE}.jsonl").read_text().splitlines())}
    rejected = records[(decode_name, "INCORRECT_NUMERICAL")]
    assert rejected["flashbench"]["status"] == "REJECTED"  # not a RUNTIME_ERROR, and the exact status kept
    assert rejected["evaluation"]["log"] == "flashbench REJECTED: inputs changed by the call\nworker log"
    assert rejected["evaluation"]["correctness"] == {"max_relative_error": "Infinity", "max_absolute_error": 0.5}
    assert "performance" not in rejected["evaluation"]
    kept = records[(decode_name, "PASSED")]
    assert kept["evaluation"]["performance"] == {"latency_ms": 0.5, "reference_latency_ms": 2.0, "speedup_factor": 4.0}
    assert kept["flashbench"]["performance"]["p90_ms"] == 0.6 and kept["flashbench"]["solution_tags"] == ["baseline"]
    assert records[("gone", "RUNTIME_ERROR")]["flashbench"]["status"] == "CRASHED"
    [reference] = read_traces(out / "flashbench/reference_traces" / f"{DECODE}.jsonl")  # FIB has no reference traces
    assert reference.performance.latency_ms == 2.0
    definition_record = json.loads((out / "definitions/mla_paged" / f"{DECODE}.json").read_text())
    assert definition_record["flashbench"]["tolerances"] == json.loads(
        Repo(ours).definition(DECODE).model_dump_json(include={"tolerances"}))["tolerances"]
    solution_record = json.loads((out / "solutions/me/mla_paged" / DECODE / f"{decode_name}.json").read_text())
    assert {s["path"] for s in solution_record["sources"]} == {"kernel.py", "helpers.py"}  # the shared file inline
    assert solution_record["flashbench"]["empty_files"] == ["__init__.py"]  # FIB refuses empty sources
    assert not (out / "blob").exists()  # generated inputs need no blob by default
    assert summary.count("trace") == 4 and not [r for r in summary.rows if r.outcome in ("skipped", "failed")]


def test_export_then_import_gives_the_repository_back(exported, ours, tmp_path):
    out, _ = exported
    back = empty_repo(tmp_path / "back")
    summary = import_fib(out, back, "ours")
    assert not summary.failed and not [r for r in summary.rows if r.outcome in ("skipped", "ignored")], summary.rows
    for relative in ("solutions/_shared/torch_common", f"solutions/{DECODE}/torch_ref", f"solutions/{PREFILL}/torch_ref"):
        assert files_of(back / relative) == files_of(ours / relative), relative  # byte for byte: hashes hold
    original, again = Repo(ours), Repo(back)
    for name in (DECODE, PREFILL):
        assert again.workload_set(name) == original.workload_set(name)
        assert again.definition(name).tolerances == original.definition(name).tolerances
        assert again.definition(name).cost == original.definition(name).cost
    mine = read_traces(ours / "traces/nvidia_h200" / f"{DECODE}.jsonl")
    theirs = read_traces(imported_trace_dir(back, "ours") / "nvidia_h200" / f"{DECODE}.jsonl")
    def without_source(traces):
        return sorted(t.model_dump_json(exclude={"imported_from"}) for t in traces)

    assert without_source(theirs) == without_source(mine)
    assert {t.model_dump()["imported_from"] for t in theirs} == {"ours"}


def test_export_writes_index_blobs_on_request(ours, tmp_path):
    export_fib(ours, tmp_path / "fib", index_blobs=True)
    smoke = Repo(ours).workload_set(DECODE).workloads[0]  # smoke_empty_short: a paged_kv generator
    lines = (tmp_path / "fib/workloads/mla_paged" / f"{DECODE}.jsonl").read_text().splitlines()
    [entry] = [e for e in map(json.loads, lines) if e["workload"]["uuid"] == smoke.uuid]
    record = entry["workload"]
    assert record["axes"] == {"batch_size": 3, "num_pages": 200, "len_indptr": 4, "num_kv_indices": 38}
    assert record["inputs"]["sm_scale"] == {"type": "scalar", "value": smoke.inputs["sm_scale"].value}
    assert record["inputs"]["q_nope"] == {"type": "random"}
    blob = record["inputs"]["kv_indices"]["path"]
    assert blob == f"./blob/workloads/mla_paged/{DECODE}/{smoke.uuid}.safetensors"
    generated, _ = structured_inputs(smoke, "cpu")
    assert torch.equal(load_file(str(tmp_path / "fib" / blob))["kv_indices"], generated["kv_indices"])
    assert record["flashbench"]["generate"][0]["generator"] == "paged_kv"  # flashbench remakes them, blob or not


def test_export_refuses_a_folder_that_holds_something(ours, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out/keep.txt").write_text("mine")
    with pytest.raises(FlashbenchError, match="exists and is not an empty folder"):
        export_fib(ours, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no partial export left beside it


def test_export_of_hostile_trace_lines_and_links_says_why_and_leaks_nothing(ours, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ours, repo)
    trace_file = next(p for p in sorted((repo / "traces").glob("*/*.jsonl")) if not p.name.endswith(".graph.jsonl"))
    definition = trace_file.name.removesuffix(".jsonl")
    other = next(n for n in Repo(repo).names() if n != definition)
    stray = read_traces(trace_file)[0].model_copy(update={"definition": other, "timestamp": "stray"})
    with open(trace_file, "a") as handle:
        handle.write(stray.model_dump_json() + "\n" + "[" * 100_000 + "\n")  # KeyError, RecursionError
        # a red team: a list for a name ended the export in a TypeError; lines of no record naming solutions that
        # clashed in FIB's one namespace stopped it ("rename one")
        handle.write('{"solution": ["x"]}\n{"solution": "a"}\n')
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    folder = Repo(repo).solution_folders(definition)[0].path
    (folder / "leak.py").symlink_to(secret)
    summary = export_fib(repo, tmp_path / "out")
    assert f"is a trace of {other}" in " ".join(rows(summary, definition, "trace", "skipped"))
    assert "leak.py: a link out" in " ".join(rows(summary, definition, "solution", "exported"))
    assert not any(b"the host's secret" in p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file())


# --- conversions -----------------------------------------------------------------------------------

def test_solution_names_are_unique_across_definitions():
    names = fib_names({("a", "triton"), ("b", "triton"), ("a", "cuda")})
    assert names[("a", "cuda")] == "cuda"
    assert names[("a", "triton")] == f"triton_{hashlib.sha256(b'a').hexdigest()[:8]}"
    assert len(set(names.values())) == 3


def test_statuses_fib_lacks_map_to_the_nearest_and_keep_the_exact_one():
    rejected = evaluation_to_fib(our_trace("mine", CAPTURED, "REJECTED", "t", message="outputs alias an input"))
    assert (rejected.status, rejected.performance) == ("INCORRECT_NUMERICAL", None)
    assert math.isnan(rejected.correctness.max_absolute_error)  # no error was measured: no FIB filter passes it
    assert rejected.log == "flashbench REJECTED: outputs alias an input\n"
    crashed = evaluation_to_fib(our_trace("mine", CAPTURED, "CRASHED", "t", message="worker died (SIGSEGV)",
                                          log="Segmentation fault"))
    assert (crashed.status, crashed.correctness, crashed.log) == (
        "RUNTIME_ERROR", None, "flashbench CRASHED: worker died (SIGSEGV)\nSegmentation fault")
    missing = evaluation_to_fib(our_trace("mine", CAPTURED, "MISSING_DEPENDENCY", "t"))
    assert (missing.status, missing.log) == ("COMPILE_ERROR", "flashbench MISSING_DEPENDENCY\n")


def test_older_fib_spellings_are_normalised():
    """null for "not given" and float8_e4m3 without "fn", as some FIB versions write them."""
    data = definition() | {"description": None, "tags": None, "constraints": None}
    data["axes"]["batch_size"] = {"type": "var", "description": None}
    data["inputs"]["q_pe"] = {"shape": ["batch_size", "num_qo_heads", "head_dim_kpe"], "dtype": "float8_e4m3",
                              "description": None}
    ours = Definition.model_validate(definition_to_ours(FibDefinition.model_validate(data)))
    assert ours.inputs["q_pe"].dtype == "float8_e4m3fn" and ours.inputs["sm_scale"].shape is None
    assert (ours.description, ours.tags, ours.constraints, ours.axes["batch_size"].description) == ("", [], [], "")


def test_not_a_dataset_is_bad_input(tmp_path):
    result = cli("import-fib", tmp_path, "--root", empty_repo(tmp_path / "repo"))
    assert result.exit_code == 2 and "not a FlashInfer-Bench dataset" in result.output


# FIB's sampling definitions: their references draw samples (torch.multinomial), so they are judged
# by evaluator sampling with reference: samples, not compared element by element.

FIB_SAMPLING = Path(__file__).parent / "fixtures" / "fib_sampling"
TOP_K_TOP_P = "top_k_top_p_sampling_from_probs_v64"
SAMPLING_WORKLOADS = f"""definition: {TOP_K_TOP_P}
version: 1
workloads:
- uuid: 8e2b6c1a-4d3f-4b5e-9a7c-1f0e2d3c4b5a
  name: smoke_b64
  tags: [smoke]
  axes: {{batch_size: 64}}
  inputs:
    probs: {{type: random, distribution: uniform}}
    top_k: {{type: random, distribution: uniform, low: 0, high: 40}}
    top_p: {{type: random, distribution: uniform, low: 0.5, high: 1.0}}
"""


def test_a_fib_sampling_definition_is_judged_by_its_samples(tmp_path):
    summary = import_fib(FIB_SAMPLING, empty_repo(tmp_path / "repo"), "fib")
    assert not summary.failed, summary.failed
    [imported] = rows(summary, TOP_K_TOP_P, "definition", "imported")
    assert imported.startswith("op_type sampling: its reference draws samples, so the outputs are judged by "
                               "evaluator sampling (reference: samples)")
    evaluator = Repo(tmp_path / "repo").definition(TOP_K_TOP_P).evaluator
    assert (evaluator.kind, evaluator.reference, evaluator.reference_draws) == ("sampling", "samples", 8)


def test_only_fib_sampling_definitions_of_sample_ids_get_the_samples_evaluator():
    record = FibDefinition.model_validate_json((FIB_SAMPLING / "definitions/sampling" / f"{TOP_K_TOP_P}.json").read_text())
    assert definition_to_ours(record)["evaluator"] == {"kind": "sampling", "reference": "samples"}
    other = record.model_copy(update={"op_type": "norm"})
    assert "evaluator" not in definition_to_ours(other)
    floats = record.model_copy(update={"outputs": {"samples": record.outputs["samples"].model_copy(
        update={"dtype": "float32"})}})
    assert "evaluator" not in definition_to_ours(floats)


def sampling_solution(folder: Path, name: str, draw: str) -> None:
    """A solution of the fixture's definition: its reference with the last line of the draw replaced."""
    folder.mkdir(parents=True)
    record = json.loads((FIB_SAMPLING / "definitions/sampling" / f"{TOP_K_TOP_P}.json").read_text())
    source = record["reference"].replace("samples[r] = torch.multinomial(weights, 1).squeeze(0)", draw)
    (folder / "kernel.py").write_text(source)
    (folder / "solution.yaml").write_text(
        f"name: {name}\ndefinition: {TOP_K_TOP_P}\nauthor: tests\nlanguage: python\nentry_point: kernel.py::run\n"
        "destination_passing_style: false\ndependencies: [torch]\n")


def test_an_imported_sampling_definition_runs_end_to_end_on_a_cpu(tmp_path):
    from flashbench import api as fb

    repo = empty_repo(tmp_path / "repo")
    assert not import_fib(FIB_SAMPLING, repo, "fib").failed
    (repo / "definitions/sampling" / f"{TOP_K_TOP_P}.workloads.yaml").write_text(SAMPLING_WORKLOADS)
    solutions = repo / "solutions" / TOP_K_TOP_P
    sampling_solution(solutions / "honest", "honest", "samples[r] = torch.multinomial(weights, 1).squeeze(0)")
    sampling_solution(solutions / "greedy", "greedy", "samples[r] = weights.argmax()")
    report = fb.run(TOP_K_TOP_P, device="cpu", root=repo, trace_dir=tmp_path / "traces", iters=8, warmup=0,
                    timeout=120)
    statuses = {r.solution: r.status for r in report.results}
    assert statuses == {"reference": "PASSED", "honest": "PASSED", "greedy": "INCORRECT_NUMERICAL"}, \
        [(r.solution, r.status, r.message) for r in report.results]
    [greedy] = [r for r in report.results if r.solution == "greedy"]
    assert "do not follow the reference's distribution" in greedy.message


def test_an_evaluator_other_than_allclose_survives_export_and_import():
    definition = Repo(Path(__file__).parent / "fixtures" / "sampling_repo").definition("top_k_sampling_from_probs_v64")
    assert definition.evaluator.kind == "sampling"
    record = definition_to_fib(definition, "def run(): pass\n")
    assert Definition.model_validate(definition_to_ours(record)).evaluator == definition.evaluator


def test_a_constant_input_survives_export_and_import():
    repo = Repo(Path(__file__).resolve().parents[1])
    definition = repo.definition(next(n for n in repo.names() if n.startswith("flashmla_sparse_decode_fp8_sink_h64")))
    record = definition_to_fib(definition, "def run(): pass\n")
    assert record.flashbench.constant_inputs == ["attn_sink"]
    assert Definition.model_validate(definition_to_ours(record)).inputs == definition.inputs


def test_one_trace_flashbench_refuses_is_skipped_alone(tmp_path):
    """A trace of solution '-phantom' (a name no folder may start with '-') and one of a solution whose author
    holds a right-to-left override made the whole definition fail: 'nothing of it imported'."""
    root = make_dataset(tmp_path / "fib")
    write(root / "solutions/eve/mla_paged" / DEF / "mirror.json",
          solution("mirror", "eve\u202e", "python", {"main.py": PY_SOLUTION}, "main.py::run",
                   destination_passing_style=False))
    extra = [{"definition": DEF, "workload": captured(), "solution": name, "evaluation": passed()}
             for name in ("-phantom", "mirror")]
    write(root / "traces/mla_paged" / f"{DEF}.jsonl", traces() + extra)
    repo = empty_repo(tmp_path / "repo")
    result = cli("import-fib", root, "--root", repo, "--source", "fib", "--json")
    assert result.exit_code == 0, result.output
    summary = Summary.model_validate_json(result.stdout)
    names = {t.solution for t in read_traces(imported_trace_dir(repo, "fib") / "nvidia_h100" / f"{DEF}.jsonl")}
    assert {"py_loop", "phantom"} <= names and "mirror" not in names
    assert any("line 6: not imported: author" in why for why in rows(summary, DEF, "trace", "skipped"))


def test_export_notes_generated_data_that_is_shapes_only_there(tmp_path):
    """Generated data (an FP8 cache) is made on "meta" where inputs are checked, not on the CPU beside the index
    tensors: the export took it for a plain random input and lost its note that the generator remakes it."""
    name = "flashmla_sparse_fp8_dequantize_ckv512_kpe64_ps64"
    root = Path(__file__).resolve().parents[1]
    for folder, suffixes in (("definitions", (".yaml", ".workloads.yaml")), ("references", (".py",))):
        (tmp_path / "ours" / folder / "flashmla_sparse").mkdir(parents=True)
        for suffix in suffixes:
            shutil.copy(root / folder / "flashmla_sparse" / f"{name}{suffix}",
                        tmp_path / "ours" / folder / "flashmla_sparse")
    summary = export_fib(tmp_path / "ours", tmp_path / "fib")
    exported = [row.why for row in summary.rows if row.kind == "workload" and row.outcome == "exported"]
    assert exported and all("generated input(s) kv_cache_fp8 written as FIB random inputs" in why
                            for why in exported), exported
