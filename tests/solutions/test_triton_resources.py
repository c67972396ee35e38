"""Build check of the Triton solutions for the H200, no GPU needed.

Each Triton solution's entry point is called once on the first non-smoke workload of its
definition, with shape-only ("meta") inputs, while kernel launches are recorded instead of run.
Every recorded launch is then compiled by Triton for sm_90a the way that launch would specialise
it on a GPU (argument dtypes, 16-byte alignment and integer specialisation, constexprs, warps,
stages), and ptxas -v (Triton's own) reports registers, spills and shared memory per kernel
(`pytest -n 0 -s` prints the table). Each kernel must compile; a spill-free kernel must stay free of
spills, and a kernel that spills today may not spill more than KNOWN_SPILLS says.

Launch configurations that depend on the SM count see the solution's non-GPU value (small);
constexprs that follow from shapes match the GPU's. This reaches into Triton's launcher
(`create_function_from_signature`, `JITFunction._pack_args`), so it is tied to the pinned Triton.
"""

import re
import subprocess
from pathlib import Path

import pytest
import torch
import triton
import yaml
from solution_checks import load_module, resource_report
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from flashbench import Repo
from flashbench.binding import bind_axes, output_shapes
from flashbench.dtypes import torch_dtype
from flashbench.registry import load_solution_folder
from flashbench.workloads import generate_inputs

ROOT = Path(__file__).resolve().parents[2]
H200 = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

# Bytes of spill stores measured for sm_90a with Triton 3.6 when this list was written: the kernel
# keeps more values live than the 255 registers a thread may have. Lower is welcome; more fails.
KNOWN_SPILLS = {
    ("flashmla_decode_causal_h128_ckv512_kpe64_ps64/triton_splitkv", "_decode_kernel"): 56,
    ("flashmla_decode_causal_h128_ckv512_kpe64_ps64/triton_balanced", "_decode_kernel"): 56,
    ("flashmla_decode_causal_h16_ckv512_kpe64_ps64/triton_splitkv", "_decode_kernel"): 52,
    ("flashmla_decode_causal_h16_ckv512_kpe64_ps64/triton_balanced", "_decode_kernel"): 52,
    # The key loop inside a loop over the requests a range touches keeps more live.
    ("flashmla_decode_causal_h128_ckv512_kpe64_ps64/triton_flat", "_decode_kernel"): 444,
    ("flashmla_decode_causal_h16_ckv512_kpe64_ps64/triton_flat", "_decode_kernel"): 168,
    **{(f"flashmla_sparse_decode_fp8_{variant}_ckv512_kpe64_ps64_topk2048/triton_fp8_splitk", "_sparse_decode_kernel"): 420
       for variant in ("h128", "h64", "sink_h128", "sink_h64")},
    ("mla_paged_decode_h16_ckv512_kpe64_ps1/triton_splitkv", "_mla_decode_split_kernel"): 4,
}


def triton_folders() -> list[Path]:
    return [m.parent for m in sorted((ROOT / "solutions").glob("*/*/solution.yaml"))
            if (yaml.safe_load(m.read_text()) or {}).get("language") == "triton"]


FOLDERS = triton_folders()


def record_launches(call) -> list[tuple]:
    """(kernel, args, kwargs) of every `kernel[grid](...)` made by `call`, none of them run."""
    launches = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        call()
    finally:
        JITFunction.run = original
    return launches


def compile_for_h200(kernel: JITFunction, args: tuple, kwargs: dict):
    """What JITFunction.run compiles for this launch, for sm_90a instead of the current device."""
    kwargs = {**kwargs, "debug": kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}
    backend = make_backend(H200)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=H200, options=options.__dict__)


def ptxas_resources(ptx: str, tmp_path: Path) -> dict:
    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    proc = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", str(source), "-o", str(tmp_path / "kernel.cubin")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = resource_report(proc.stderr)
    return report


def launches_on_a_real_shape(folder: Path, monkeypatch) -> tuple[str, list[tuple]]:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's code path, not the interpreter's
    loaded = load_solution_folder(folder)
    solution = loaded.solution
    repo = Repo(ROOT)
    definition = repo.definition(solution.definition)
    workload = next(w for w in repo.workload_set(definition.name).workloads if "smoke" not in w.tags)
    inputs = generate_inputs(definition, workload, 0, "meta", repo.definition_path(definition.name).parent)
    args = [inputs[name] for name in definition.inputs]
    if solution.destination_passing_style:
        shapes = output_shapes(definition, bind_axes(definition, inputs))
        args += [torch.empty(shape, dtype=torch_dtype(definition.outputs[name].dtype), device="meta")
                 for name, shape in shapes.items()]
    entry = loaded.entry_folder / solution.entry_file
    module = load_module(f"triton_resources_{folder.parent.name}_{folder.name}", entry, folder)
    return workload.name, record_launches(lambda: getattr(module, solution.entry_function)(*args))


@pytest.mark.parametrize("folder", FOLDERS, ids=[f"{f.parent.name}/{f.name}" for f in FOLDERS])
def test_triton_kernels_compile_for_the_h200_within_their_spill_budget(folder, monkeypatch, tmp_path):
    key = f"{folder.parent.name}/{folder.name}"
    workload, launches = launches_on_a_real_shape(folder, monkeypatch)
    assert launches, f"{key} launched no Triton kernel on {workload}"
    print(f"\n{key} on {workload} (sm_90a)")
    for kernel, args, kwargs in launches:
        compiled = compile_for_h200(kernel, args, kwargs)
        report = ptxas_resources(compiled.asm["ptx"], tmp_path)
        print(f"  {kernel.__name__}: {kwargs.get('num_warps')} warps, {kwargs.get('num_stages')} stages, "
              f"{report['registers']} registers, {report['spill_stores']} bytes spilled, "
              f"{compiled.metadata.shared} bytes shared memory")
        budget = KNOWN_SPILLS.get((key, kernel.__name__), 0)
        assert report["spill_stores"] <= budget, (
            f"{kernel.__name__} of {key} spills {report['spill_stores']} bytes (allowed: {budget})")


def test_the_spill_list_names_kernels_that_exist():
    names = {f"{f.parent.name}/{f.name}" for f in FOLDERS}
    for folder, kernel in KNOWN_SPILLS:
        assert folder in names, folder
        files = load_solution_folder(ROOT / "solutions" / folder).files
        sources = [data.decode() for name, data in files.items() if name.endswith(".py")]
        assert any(re.search(rf"def {kernel}\(", source) for source in sources), (folder, kernel)
