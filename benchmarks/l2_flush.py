"""How the L2 flush before a timed call changes the call's time (GPU only).

For each flush method of flashbench.run.recipe (and a warm L2), times a few kernels with CUDA
events after that flush: a read-only reduction and a device copy of 151 MB, and our Triton MLA
decode on three workloads. Writes one JSON record per (kernel, flush) to stdout's last line and a
Markdown table before it.

    python benchmarks/l2_flush.py [--calls 60] [--json OUT.json]

With `--profile` it instead runs each MLA decode kernel PROFILE_CALLS times after each flush method, in
the order of FLUSH_METHODS (printed first, as JSON), for Nsight Compute to read the DRAM traffic of the
timed kernel: run it under `ncu --cache-control none --clock-control none --csv` and make the table
with `python benchmarks/evidence_tables.py flush_profile CSV`.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from flashbench import Repo, generate_inputs
from flashbench.build import load_entry_point
from flashbench.registry import load_solution_folder
from flashbench.run.recipe import FLUSH_METHODS, L2Flush

ROOT = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
DECODE_WORKLOADS = ["b16_l8192", "b128_l1024", "b64_l4096", "b128_l8192"]
STREAM_BYTES = 151 << 20
PROFILE_CALLS = 3


def kernels() -> dict:
    """name -> a function that runs the kernel once."""
    device = "cuda"
    data = torch.randn(STREAM_BYTES // 2, dtype=torch.bfloat16, device=device)
    copy = torch.empty_like(data)
    sink = torch.empty((), dtype=torch.float32, device=device)
    found = {
        "reduction 151 MB": lambda: torch.sum(data, dim=0, dtype=torch.float32, out=sink),
        "copy 151 MB": lambda: copy.copy_(data),
    }
    repo = Repo(ROOT)
    definition = repo.definition(DECODE)
    folder = load_solution_folder(ROOT / "solutions" / DECODE / "triton_splitkv")
    run = load_entry_point(folder.path, folder.solution, ROOT / ".flashbench-cache" / "build")
    for workload in repo.workload_set(DECODE).workloads:
        if workload.name in DECODE_WORKLOADS:
            inputs = generate_inputs(definition, workload, 1, device, repo.definition_path(DECODE).parent)
            outputs = outputs_for(definition, inputs)
            args = [inputs[name] for name in definition.inputs] + outputs
            found[f"MLA decode {workload.name}"] = lambda args=args: run(*args)
    return found


def outputs_for(definition, inputs) -> list:
    from flashbench.binding import bind_axes, output_shapes
    from flashbench.dtypes import torch_dtype

    shapes = output_shapes(definition, bind_axes(definition, inputs))
    return [torch.empty(shapes[name], dtype=torch_dtype(spec.dtype), device="cuda") for name, spec in definition.outputs.items()]


def time_after_flush(kernel, flush: L2Flush, calls: int) -> float:
    """Median µs of `kernel` with `flush` run before each call, outside the timed window."""
    for _ in range(5):
        flush()
        kernel()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for k in range(calls):
        flush()
        starts[k].record()
        kernel()
        ends[k].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    found = kernels()
    if args.profile:
        decode = [name for name in found if name.startswith("MLA decode")]
        print(json.dumps({"kernels": decode, "flushes": list(FLUSH_METHODS), "calls": PROFILE_CALLS}), flush=True)
        for name in decode:
            for method in FLUSH_METHODS:
                flush = L2Flush(method, "cuda")
                for _ in range(PROFILE_CALLS):
                    flush()
                    found[name]()
                torch.cuda.synchronize()
                del flush
        return
    flushes = {method: L2Flush(method, "cuda") for method in FLUSH_METHODS}
    records = [{"kernel": name, "flush": method, "median_us": time_after_flush(kernel, flush, args.calls),
                "device": torch.cuda.get_device_name(), "calls": args.calls}
               for name, kernel in found.items() for method, flush in flushes.items()]
    print("| kernel | " + " | ".join(flushes) + " |")
    print("|---|" + "---|" * len(flushes))
    for name in found:
        cells = [f"{r['median_us']:.1f}" for r in records if r["kernel"] == name]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
