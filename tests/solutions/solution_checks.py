"""Helpers shared by the solution tests: finding a solution's file (in its folder or a shared one),
loading a file as a module, comparing an attention result (output, lse) with the reference's,
reading ptxas's resource report, and running solutions on workloads two ways: through the runner
(`run_through_runner`, on a cut-down workload: `cut_down`) and by calling their entry points directly
in a child process under Triton's interpreter (`interpreted`, `check_directly`). Importable from a
test's child process too, which runs with this folder first on sys.path."""

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import torch

from flashbench import Repo
from flashbench.binding import bind_axes, output_shapes
from flashbench.build import (BuildError, folder_files, folder_problem, is_documentation, load_entry_point,
                              missing_dependencies)
from flashbench.dtypes import torch_dtype
from flashbench.model import Workload
from flashbench.reference import load_reference
from flashbench.registry import load_solution_folder
from flashbench.run import RunOptions, Runner, select_workloads
from flashbench.run.judge.check import compare_outputs
from flashbench.run.judge.references import ReferenceStore
from flashbench.run.plan import stage_solution
from flashbench.workloads import generate_inputs

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
OUTPUT_TOL = dict(atol=1e-2, rtol=2e-2)
LSE_TOL = dict(atol=1e-2, rtol=1e-3)


def solution_file(definition, name, file="kernel.py") -> Path:
    """Where a file of solutions/<definition>/<name>/ is: in that folder or one of its shared folders."""
    return next(folder / file for folder in load_solution_folder(SOLUTIONS / definition / name).folders
                if file in folder_files(folder))


def load_module(name, path, folder: Path | None = None):
    """The module at `path`; when it is a solution's file, `folder` is that solution's folder, whose
    files and its shared folders' it imports as siblings (as the staged copy lets it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folders = load_solution_folder(folder).folders if folder else ()
    search = sorted({str((where / relative).parent) for where in folders for relative in folder_files(where)})
    sys.path[:0] = search
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.path[:len(search)]
    return module


def compare(output, lse, ref_output, ref_lse):
    """Returns a list of problems (empty when the result matches the reference)."""
    problems = []
    if output.shape != ref_output.shape or lse.shape != ref_lse.shape:
        return [f"shapes {tuple(output.shape)} / {tuple(lse.shape)}"]
    out, ref_out = output.float(), ref_output.float()
    if not torch.isfinite(out).all():
        problems.append("non-finite output")
    elif not torch.allclose(out, ref_out, **OUTPUT_TOL):
        problems.append(f"output max abs error {(out - ref_out).abs().max().item():.3g}")
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
        problems.append("lse -inf positions differ")
    finite = torch.isfinite(ref_lse)
    if not torch.isfinite(lse[finite]).all():
        problems.append("non-finite lse where the reference is finite")
    elif finite.any() and not torch.allclose(lse[finite], ref_lse[finite], **LSE_TOL):
        problems.append(f"lse max abs error {(lse[finite] - ref_lse[finite]).abs().max().item():.3g}")
    return problems


def resource_report(log: str) -> list[dict]:
    """Per kernel and target: registers, shared memory, stack, spill stores and loads (ptxas -v)."""
    kernels = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '([^']+)'", line)
        if m:
            current = (m.group(1), m.group(2))
            kernels.setdefault(current, {"kernel": m.group(1), "target": m.group(2)})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m and current is not None and m.group(1) != current[0]:
            current = None  # a device function's properties: not an entry
            continue
        if current is None:
            continue
        entry = kernels[current]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            entry.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entry["registers"] = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            entry["static_smem"] = int(smem.group(1)) if smem else 0
    return list(kernels.values())


# Running solutions on workloads. Under Triton's interpreter every call costs up to seconds (its cost is
# per operation and per program: 128 heads are 128 programs), and a runner job makes five calls on one
# workload (its input set, the same set again, a warm-up and two timed batches) besides starting and
# ending a worker (about two seconds). So every smoke workload is checked with one direct call of
# each solution's entry point, loaded as the worker loads it, all of a test file's calls in one child
# process (`check_directly`); and each kernel goes through the runner once (`kernel_of` tells which
# folders run the same code: a kernel shared by definitions that differ only in sizes runs there for
# one of them), on a cut-down workload, for what only the runner checks (the sandboxed worker, output
# slots poisoned before each call, the repeated call, timed calls on redrawn inputs).


def kernel_of(folder) -> tuple[str, str, str]:
    """What a solution folder runs: its language, entry function and a hash of its files (its shared
    folders' included; the manifest and documentation left out)."""
    digest = hashlib.sha256()
    for name, data in sorted(folder.files.items()):
        if name != "solution.yaml" and not is_documentation(name):
            digest.update(name.encode() + b"\0" + data + b"\0")
    return folder.solution.language, folder.solution.entry_function, digest.hexdigest()


def cut_down(workload: Workload, axes: dict | None = None, name: str = "cut_down", **fields) -> Workload:
    """`workload` with its generator's `fields` replaced (a list of ints is a list of lengths) and the
    var `axes` it gives set, under a uuid of its own and the name `<workload's name>_<name>`; with
    no fields or axes, `workload` itself."""
    if not fields and not axes:
        return workload
    data = workload.model_dump()
    for key, value in fields.items():
        data["generate"][0][key] = {"distribution": "list", "values": value} if isinstance(value, list) else value
    if axes:
        data["axes"] = {**(data.get("axes") or {}), **axes}
    changes = sorted(fields.items()) + sorted((axes or {}).items())
    data["uuid"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{workload.uuid}/{name}/{changes}"))
    data["name"] = f"{workload.name}_{name}"
    return Workload.model_validate(data)


def run_through_runner(definition: str, folders: list, workloads: list[Workload], tmp_path: Path) -> list:
    """The traces of `folders` (solution folders of `definition`) on `workloads`, run as `flashbench run`
    runs them on a CPU, with one input set. The reference's own jobs are left out (it is checked
    against float64 in tests/test_flashmla*_references.py); its outputs are computed all the same."""
    repo = Repo(ROOT)
    options = RunOptions(device="cpu", iters=1, warmup=0, input_sets=1, timeout=120, trace_dir=tmp_path,
                         cache_dir=tmp_path, save=False)
    runner = Runner(repo, definition, options)
    return runner.run(runner.candidates(folders)[1:], workloads).traces


def interpreted(script: str, flag: str, results: Path, timeout: float = 600) -> dict:
    """Runs `script flag results` in a child process under Triton's interpreter (so the variable never
    leaks into other tests) and returns the JSON object it wrote to `results`. One thread: the
    interpreter's numpy operations are too small to gain from more, and the suite's other worker
    process has the machine's other core."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, script, flag, str(results)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(Path(results).read_text())


def _poisoned(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An output buffer as the runner hands it over: NaN, True or the smallest integer everywhere."""
    tensor = torch.empty(shape, dtype=dtype)
    if tensor.is_floating_point():
        return tensor.fill_(float("nan"))
    return tensor.fill_(True if dtype == torch.bool else torch.iinfo(dtype).min)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def call_entry_point(definition, solution, entry, inputs: dict) -> tuple[dict | None, list[str]]:
    """One call of a solution's entry point as the worker makes it (inputs in the definition's order, then
    the output buffers, poisoned, for destination passing; else the outputs returned): the outputs (None
    when they are not tensors of the declared shapes and dtypes), and what is wrong with them or with
    the inputs after the call."""
    shapes = output_shapes(definition, bind_axes(definition, inputs))
    dtypes = {name: torch_dtype(spec.dtype) for name, spec in definition.outputs.items()}
    arguments = [inputs[name] for name in definition.inputs]
    before = {name: value.clone() for name, value in inputs.items() if isinstance(value, torch.Tensor)}
    problems = []
    if solution.destination_passing_style:
        outputs = {name: _poisoned(shapes[name], dtypes[name]) for name in definition.outputs}
        entry(*arguments, *outputs.values())
    else:
        returned = entry(*arguments)
        returned = returned if isinstance(returned, (tuple, list)) else (returned,)
        outputs = dict(zip(definition.outputs, returned))
        if len(returned) != len(definition.outputs):
            problems.append(f"returned {len(returned)} values for {len(definition.outputs)} outputs")
        for name, value in outputs.items():
            if not isinstance(value, torch.Tensor) or list(value.shape) != shapes[name] or value.dtype != dtypes[name]:
                problems.append(f"output {name}: {getattr(value, 'dtype', type(value))} "
                                f"{list(getattr(value, 'shape', []))}, expected {dtypes[name]} {shapes[name]}")
    usable = not problems
    problems += [f"changed input {name}" for name, value in before.items() if not _same_bytes(value, inputs[name])]
    return (outputs if usable else None), problems


def narrowed(definition, **const_axes):
    """`definition` with other values for some of its const axes (fewer heads: where a kernel's programs
    each own one head, the same code runs at a fraction of the interpreter's cost)."""
    axes = {**definition.axes, **{name: definition.axes[name].model_copy(update={"value": value})
                                  for name, value in const_axes.items()}}
    return definition.model_copy(update={"axes": axes})


def load_as_worker(folder, stage_dir: Path):
    """`folder`'s entry point loaded as the worker loads it (from the folder the runner stages, after the
    runner's checks of the folder and of its dependencies), and what keeps the runner from running it."""
    staged = stage_solution(folder, stage_dir / "solutions")
    problem = folder_problem(staged, folder.solution)
    missing = missing_dependencies(folder.solution)
    if problem or missing:
        return None, [f"INVALID_SOLUTION: {problem}" if problem else f"MISSING_DEPENDENCY: {', '.join(missing)}"]
    try:
        return load_entry_point(staged, folder.solution, stage_dir / "build"), []
    except BuildError as exc:
        return None, [f"INVALID_SOLUTION: {exc}"]


def check_directly(pairs: list[tuple[str, str]], stage_dir: Path, skip: set[tuple[str, str, str]] = frozenset(),
                   narrow: dict | None = None, seed: int = 1,
                   workloads: dict[str, list[Workload]] | None = None) -> dict[str, dict]:
    """In the child process: every (definition, solution) of `pairs` called once on each smoke workload of
    its definition, or on those `workloads` gives for it where it gives any (but those in `skip`, as
    (definition, solution, workload uuid): the runner runs them),
    loaded as the worker loads it (staged under `stage_dir`), with inputs generated as the runner
    generates them and outputs judged by the definition's evaluator against its reference; a definition
    named in `narrow` gets the const axis values it gives there (`narrowed`).
    {"definition/solution/workload": {"problems": [...], "max_abs_error": {output: error}}}."""
    repo = Repo(ROOT)
    results, references = {}, {}
    for definition_name, solution_name in pairs:
        definition = narrowed(repo.definition(definition_name), **(narrow or {}).get(definition_name, {}))
        definition_file = repo.definition_path(definition_name)
        folder = load_solution_folder(SOLUTIONS / definition_name / solution_name)
        entry, load_problems = load_as_worker(folder, stage_dir)
        if definition_name not in references:
            references[definition_name] = ReferenceStore(definition, load_reference(definition, ROOT, definition_file),
                                                         1 << 30)
        chosen = (workloads or {}).get(definition_name) or select_workloads(repo, definition_name, [], "cpu")
        for workload in chosen:
            if (definition_name, solution_name, workload.uuid) in skip:
                continue
            key = f"{definition_name}/{solution_name}/{workload.name}"
            if entry is None:
                results[key] = {"problems": load_problems, "max_abs_error": {}}
                continue
            inputs = generate_inputs(definition, workload, seed, "cpu", definition_file.parent)
            expected = references[definition_name].kept((workload.uuid, seed), lambda: inputs)
            try:
                outputs, problems = call_entry_point(definition, folder.solution, entry, inputs)
            except Exception as exc:  # the worker's RUNTIME_ERROR; the other calls go on
                outputs, problems = None, [f"RUNTIME_ERROR: {type(exc).__name__}: {exc}"[:2000]]
            verdict = compare_outputs(definition, outputs, expected) if outputs is not None else None
            if verdict is not None and not verdict.passed:
                problems.append(f"{verdict.status}: {verdict.message}")
            results[key] = {
                "problems": problems,
                "max_abs_error": {name: e.max_abs_error for name, e in verdict.errors.items()} if verdict else {},
            }
    return results


def nan_tail_case(seed=0):
    """Three requests with two draft tokens; block tails past each length are NaN, unused table slots -1."""
    gen = torch.Generator().manual_seed(seed)
    lengths, pool = [2, 70, 129], 12
    ids = torch.randperm(pool, generator=gen).to(torch.int32)
    table = torch.full((3, 4), -1, dtype=torch.int32)
    k_cache = torch.randn(pool, 64, 1, 576, generator=gen)
    used = 0
    for b, length in enumerate(lengths):
        blocks = (length + 63) // 64
        table[b, :blocks] = ids[used:used + blocks]
        used += blocks
        k_cache[table[b, blocks - 1].item(), length - (blocks - 1) * 64:] = float("nan")
    q = torch.randn(3, 2, 16, 576, generator=gen).bfloat16()
    return q, k_cache.bfloat16(), table, torch.tensor(lengths, dtype=torch.int32), 0.1352
