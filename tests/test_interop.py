"""FlashInfer-Bench interop: import a FIB dataset, validate and run it, export it back unchanged."""

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from flashbench import Repo
from flashbench.build import content_hash
from flashbench.cli import main
from flashbench.interop import export_fib, import_fib
from flashbench.interop.fib_export import evaluation_to_fib
from flashbench.interop.fib_import import definition_to_ours
from flashbench.interop.fib_model import FibBuildSpec, FibDefinition
from flashbench.model import Definition, OutputError, Performance, Trace
from flashbench.traces import read_traces
from flashbench.workloads import structured_inputs

DEF = "mla_paged_decode_h16_ckv512_kpe64_ps1"
CAPTURED = "6b0c1d42-7e0a-4c4b-9a55-2f1f3c1e9a01"
RANDOM_INDICES = "0f6c5a7e-3b7d-4a3e-8c59-4e1d2b7c9a10"
BLOB = f"./blob/workloads/mla_paged/{DEF}/{CAPTURED}.safetensors"

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


def workload(uuid, axes, indices) -> dict:
    inputs = {name: {"type": "random"} for name in ("q_nope", "q_pe", "ckv_cache", "kpe_cache")}
    return {"uuid": uuid, "axes": axes, "inputs": inputs | indices | {"sm_scale": {"type": "scalar", "value": 0.0721}}}


def captured() -> dict:
    indices = {k: {"type": "safetensors", "path": BLOB, "tensor_key": k} for k in ("kv_indptr", "kv_indices")}
    return workload(CAPTURED, {"batch_size": 2, "num_pages": 16, "len_indptr": 3, "num_kv_indices": 8}, indices)


def solution(name, author, language, sources, entry, **spec) -> dict:
    return {"name": name, "definition": DEF, "author": author, "description": f"{name} by {author}",
            "spec": {"language": language, "target_hardware": ["NVIDIA_H100"], "entry_point": entry,
                     "dependencies": ["torch"], **spec},
            "sources": [{"path": p, "content": c} for p, c in sources.items()]}


def evaluation(status, **extra) -> dict:
    return {"status": status, "log": extra.pop("log", ""), **extra,
            "environment": {"hardware": "NVIDIA_H100", "libs": {"torch": "2.8.0"}}, "timestamp": "2025-09-01T12:00:00"}


def traces() -> dict[str, list[dict]]:
    passed = evaluation("PASSED", correctness={"max_relative_error": 0.004, "max_absolute_error": 0.002},
                        performance={"latency_ms": 0.031, "reference_latency_ms": 2.5, "speedup_factor": 80.6})
    failed = evaluation("RUNTIME_ERROR", log="CUDA error: an illegal memory access")
    wrong = evaluation("INCORRECT_NUMERICAL", correctness={"max_relative_error": 0.9, "max_absolute_error": 3.0})
    return {
        "alice": [{"definition": DEF, "workload": captured(), "solution": "py_loop", "evaluation": passed}],
        "bob": [{"definition": DEF, "workload": captured(), "solution": "cuda_tvm", "evaluation": failed}],
        "carol": [{"definition": DEF, "workload": captured(), "solution": "tl_kernel", "evaluation": wrong}],
    }


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) if isinstance(data, dict) else "".join(json.dumps(d) + "\n" for d in data))
    return path


def make_dataset(root: Path) -> Path:
    write(root / "definitions/mla_paged" / f"{DEF}.json", definition())
    blob = root / BLOB
    blob.parent.mkdir(parents=True)
    save_file({"kv_indptr": torch.tensor([0, 3, 8], dtype=torch.int32),
               "kv_indices": torch.tensor([9, 2, 14, 0, 7, 3, 11, 5], dtype=torch.int32)}, str(blob))
    # FIB's own weak point: random index tensors; they cannot satisfy the constraints.
    bad = workload(RANDOM_INDICES, {"batch_size": 2, "num_pages": 16, "len_indptr": 3, "num_kv_indices": 8},
                   {"kv_indptr": {"type": "random"}, "kv_indices": {"type": "random"}})
    lines = [{"definition": DEF, "workload": w, "solution": None, "evaluation": None} for w in (captured(), bad)]
    write(root / "workloads/mla_paged" / f"{DEF}.jsonl", lines)
    folder = root / "solutions"
    write(folder / "alice/mla_paged" / DEF / "py_loop.json",
          solution("py_loop", "alice", "python", {"main.py": PY_SOLUTION}, "main.py::run", destination_passing_style=False))
    write(folder / "bob/mla_paged" / DEF / "cuda_tvm.json",
          solution("cuda_tvm", "bob", "cuda", {"kernel.cu": "// kernel\n", "main.cpp": "// binding\n"}, "main.cpp::run",
                   binding="tvm-ffi"))
    write(folder / "carol/mla_paged" / DEF / "tl_kernel.json",
          solution("tl_kernel", "carol", "tilelang", {"kernel.py": "def run():\n    pass\n"}, "kernel.py::run"))
    for author, records in traces().items():
        write(root / "traces" / author / "mla_paged" / f"{DEF}.jsonl", records)
    return root


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(dataset, repo, import output): a FIB dataset imported into an empty repository."""
    dataset = make_dataset(tmp_path_factory.mktemp("fib"))
    repo = tmp_path_factory.mktemp("repo")
    (repo / "definitions").mkdir()
    result = cli("import-fib", dataset, "--root", repo)
    assert result.exit_code == 0, result.output
    return dataset, repo, result.output


def test_import_writes_flashbench_layout(imported):
    _, repo, output = imported
    assert "1 definitions, 1 workloads, 1 blobs, 2 solutions, 3 traces" in output
    assert json.loads((repo / "definitions/mla_paged" / f"{DEF}.json").read_text()) == definition()
    workloads = Repo(repo).workload_set(DEF)
    assert workloads.version == 1 and [w.uuid for w in workloads.workloads] == [CAPTURED]
    path = workloads.workloads[0].inputs["kv_indices"].path
    assert path == BLOB.removeprefix("./") and (repo / "definitions/mla_paged" / path).is_file()
    assert sorted(f.solution.name for f in Repo(repo).solution_folders(DEF)) == ["cuda_tvm", "py_loop"]
    cuda = Repo(repo).solution_folders(DEF)[0].solution
    assert (cuda.language, cuda.binding, cuda.sources) == ("cuda", "tvm-ffi", ["kernel.cu", "main.cpp"])


def test_import_warns_about_what_it_cannot_carry(imported):
    _, _, output = imported
    assert f"workload {RANDOM_INDICES} not imported" in output
    assert "binding tvm-ffi: imported" in output
    assert "language 'tilelang' has no flashbench builder" in output


def test_imported_repository_validates(imported):
    _, repo, _ = imported
    result = cli("--root", repo, "validate")
    assert result.exit_code == 0, result.output
    assert "4 valid, 0 invalid" in result.output  # definition, workload set, two solutions


def test_imported_traces_get_honest_defaults(imported):
    _, repo, _ = imported
    traces = {t.solution: t for t in read_traces(repo / "traces/nvidia_h100" / f"{DEF}.jsonl")}
    passed = traces["py_loop"]
    perf = passed.performance
    assert (passed.status, passed.author, passed.workload) == ("PASSED", "alice", CAPTURED)
    assert (perf.latency_ms, perf.samples, perf.std_ms, perf.ci_low_ms, perf.ci_high_ms) == (0.031, 1, 0.0, 0.031, 0.031)
    assert (perf.reference_latency_ms, perf.speedup) == (2.5, 80.6)
    assert perf.timing["method"] == "imported from FlashInfer-Bench"
    assert passed.solution_hash == content_hash(repo / "solutions" / DEF / "py_loop")
    assert passed.correctness["*"].max_abs_error == 0.002 and math.isnan(passed.correctness["*"].mismatch_fraction)
    assert traces["cuda_tvm"].log == "CUDA error: an illegal memory access" and traces["cuda_tvm"].performance is None
    # Not imported (tilelang): the trace still comes in, keyed by a hash of the name.
    assert traces["tl_kernel"].solution_hash == hashlib.sha256(b"tl_kernel").hexdigest()[:16]


def test_imported_python_solution_passes_flashbench_run(imported, tmp_path):
    _, repo, _ = imported
    result = cli("--root", repo, "run", "--def", "mla_paged_decode", "--solution", "py_loop", "--workload", CAPTURED,
                 "--device", "cpu", "--iters", 2, "--warmup", 0, "--trace-dir", tmp_path)
    assert result.exit_code == 0, result.output
    [path] = tmp_path.glob(f"*/{DEF}.jsonl")
    statuses = {t.solution: t.status for t in read_traces(path)}
    assert statuses == {"reference": "PASSED", "py_loop": "PASSED"}, result.output


def test_round_trip_keeps_what_both_formats_express(imported, tmp_path):
    dataset, repo, _ = imported
    result = cli("export-fib", tmp_path, "--root", repo)
    assert result.exit_code == 0, result.output

    def load(path):
        return json.loads(path.read_text())

    def lines(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    assert load(tmp_path / "definitions/mla_paged" / f"{DEF}.json") == definition()
    [entry] = lines(tmp_path / "workloads/mla_paged" / f"{DEF}.jsonl")
    assert entry == {"definition": DEF, "workload": captured(), "solution": None, "evaluation": None}
    assert load_file(str(tmp_path / BLOB)).keys() == {"kv_indptr", "kv_indices"}
    assert (tmp_path / BLOB).read_bytes() == (dataset / BLOB).read_bytes()
    for author, name in (("alice", "py_loop"), ("bob", "cuda_tvm")):
        original = load(dataset / "solutions" / author / "mla_paged" / DEF / f"{name}.json")
        exported = load(tmp_path / "solutions" / author / "mla_paged" / DEF / f"{name}.json")
        for field in ("name", "definition", "author", "description"):
            assert exported[field] == original[field], field
        assert FibBuildSpec.model_validate(exported["spec"]) == FibBuildSpec.model_validate(original["spec"])  # defaults filled
        assert {s["path"]: s["content"] for s in exported["sources"]} == {s["path"]: s["content"] for s in original["sources"]}
    for author, records in traces().items():
        [exported] = lines(tmp_path / "traces" / author / "mla_paged" / f"{DEF}.jsonl")
        for field in ("definition", "workload", "solution"):
            assert exported[field] == records[0][field], field
        for field in ("status", "log", "correctness", "performance", "environment", "timestamp"):
            assert exported["evaluation"].get(field) == records[0]["evaluation"].get(field), field


def test_import_twice_adds_nothing(imported):
    dataset, repo, _ = imported
    before = (repo / "definitions/mla_paged" / f"{DEF}.workloads.yaml").read_text()
    result = cli("import-fib", dataset, "--root", repo)
    assert result.exit_code == 0, result.output
    assert "0 definitions, 0 workloads, 0 blobs, 0 solutions, 0 traces" in result.output
    assert (repo / "definitions/mla_paged" / f"{DEF}.workloads.yaml").read_text() == before


def test_export_materialises_generated_indices_and_imports_back(repo_copy, tmp_path):
    out = tmp_path / "fib"
    export_fib(repo_copy, out)
    ours = Repo(repo_copy).workload_set(DEF).workloads[0]  # smoke_empty_short: a paged_kv generator
    [entry] = [e for e in map(json.loads, (out / "workloads/mla_paged" / f"{DEF}.jsonl").read_text().splitlines())
               if e["workload"]["uuid"] == ours.uuid]
    fib_workload = entry["workload"]
    assert fib_workload["axes"] == {"batch_size": 3, "num_pages": 200, "len_indptr": 4, "num_kv_indices": 38}
    assert fib_workload["inputs"]["sm_scale"] == {"type": "scalar", "value": ours.inputs["sm_scale"].value}
    assert fib_workload["inputs"]["q_nope"] == {"type": "random"}
    blob = fib_workload["inputs"]["kv_indices"]["path"]
    assert blob == f"./blob/workloads/mla_paged/{DEF}/{ours.uuid}.safetensors"
    generated, _ = structured_inputs(ours, "cpu")
    assert torch.equal(load_file(str(out / blob))["kv_indices"], generated["kv_indices"])
    # ...and back into an empty repository: it validates, with the same index tensors.
    back = tmp_path / "back"
    (back / "definitions").mkdir(parents=True)
    summary = import_fib(out, back)
    assert summary.counts["definitions"] == len(Repo(repo_copy).names()) and not summary.warnings
    assert cli("--root", back, "validate").exit_code == 0


def test_a_broken_dataset_line_names_file_line_and_field(tmp_path):
    dataset = make_dataset(tmp_path / "fib")
    path = dataset / "workloads/mla_paged" / f"{DEF}.jsonl"
    path.write_text(path.read_text().replace('"tensor_key": "kv_indptr"', '"key": "kv_indptr"', 1))
    shutil.rmtree(dataset / "traces")
    (tmp_path / "repo/definitions").mkdir(parents=True)
    result = cli("import-fib", dataset, "--root", tmp_path / "repo")
    assert result.exit_code == 2
    assert f"{path}: line 1, workload.inputs.kv_indptr.safetensors.tensor_key" in result.output
    assert len(result.output.strip().splitlines()) == 1


def native_trace(status, **fields) -> Trace:
    return Trace(definition=DEF, workload=CAPTURED, solution="mine", solution_hash="h", author="me",
                 hardware="NVIDIA H200", status=status, timestamp="2026-01-01T00:00:00+00:00",
                 environment={"hardware": "NVIDIA H200", "torch": "2.13.0", "triton": None, "cuda": "12.8"}, **fields)


def test_flashbench_results_are_written_as_fib_evaluations():
    errors = {"output": OutputError(max_abs_error=0.1, max_rel_error=0.2, mismatch_fraction=0.0),
              "lse": OutputError(max_abs_error=0.3, max_rel_error=0.05, mismatch_fraction=0.0)}
    performance = Performance(latency_ms=1.5, mean_ms=1.6, std_ms=0.1, min_ms=1.4, p10_ms=1.45, p90_ms=1.7, samples=50,
                              ci_low_ms=1.48, ci_high_ms=1.52, reference_latency_ms=3.0, speedup=2.0, timing={})
    passed = evaluation_to_fib(native_trace("PASSED", correctness=errors, performance=performance))
    assert passed.correctness.model_dump() == {"max_relative_error": 0.2, "max_absolute_error": 0.3}  # worst output
    assert passed.performance.model_dump() == {"latency_ms": 1.5, "reference_latency_ms": 3.0, "speedup_factor": 2.0}
    assert passed.environment.model_dump() == {"hardware": "NVIDIA H200", "libs": {"torch": "2.13.0", "cuda": "12.8"}}
    crashed = evaluation_to_fib(native_trace("CRASHED", message="worker died (SIGSEGV)", log="Segmentation fault"))
    assert (crashed.status, crashed.correctness, crashed.performance) == ("RUNTIME_ERROR", None, None)
    assert crashed.log == "flashbench status CRASHED: worker died (SIGSEGV)\nSegmentation fault"


def test_older_fib_spellings_are_normalised():
    """null for "not given" and float8_e4m3 without "fn", as some FIB versions write them."""
    data = definition() | {"description": None, "tags": None, "constraints": None}
    data["axes"]["batch_size"] = {"type": "var", "description": None}
    data["inputs"]["q_pe"] = {"shape": ["batch_size", "num_qo_heads", "head_dim_kpe"], "dtype": "float8_e4m3",
                              "description": None}
    ours = Definition.model_validate(definition_to_ours(FibDefinition.model_validate(data)))
    assert ours.inputs["q_pe"].dtype == "float8_e4m3fn" and ours.inputs["sm_scale"].shape is None
    assert (ours.description, ours.tags, ours.constraints, ours.axes["batch_size"].description) == ("", [], [], "")
