"""Helpers shared by the solution tests: finding a solution's file (in its folder or a shared one),
loading a file as a module, comparing an attention result (output, lse) with the reference's, and
reading ptxas's resource report. Importable from a test's child process too, which runs with this
folder first on sys.path."""

import importlib.util
import re
from pathlib import Path

import torch

from flashbench.registry import load_solution_folder

SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"
OUTPUT_TOL = dict(atol=1e-2, rtol=2e-2)
LSE_TOL = dict(atol=1e-2, rtol=1e-3)


def solution_file(definition, name, file="kernel.py") -> Path:
    """Where a file of solutions/<definition>/<name>/ is: in that folder or one of its shared folders."""
    return load_solution_folder(SOLUTIONS / definition / name).files[file]


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
