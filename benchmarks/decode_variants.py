"""Launch settings of our Triton MLA paged decode against FlashInfer's fa3 kernel (GPU only).

For each decode workload named (default: the non-smoke ones and smoke_mixed), times FlashInfer
(when installed) and `triton_splitkv` under each of VARIANTS with CUDA events around each call,
after the `write+read` L2 flush; median of CALLS calls, µs. "split_only" is the default without
its merge kernel (a lower bound: the partials are written but never combined). Every variant's
output is compared with that of the equal-cuts setting over ten calls; a mismatch is printed.
One line per workload.

    python benchmarks/decode_variants.py [WORKLOAD,WORKLOAD,...]
"""

import sys
from pathlib import Path

import torch

from flashbench import Repo, generate_inputs
from flashbench.build import BuildError, load_entry_point
from flashbench.registry import load_solution_folder
from flashbench.run.recipe import L2Flush
from l2_flush import outputs_for, time_after_flush

ROOT = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
CALLS = 60
SEED = 1234
VARIANTS = {
    "equal_cuts": dict(aligned=False),  # chunks cut from the flattened tokens alone
    "default": {},
    "merge_fine1w": dict(merge="fine1w"),
    "merge_columns": dict(merge="columns"),
    "merge_fine": dict(merge="fine"),
    "units_per_sm_1": dict(units_per_sm=1),
    "units_per_sm_3": dict(units_per_sm=3),
    "stages_4": dict(num_stages=4),
}


def module(solution: str):
    folder = load_solution_folder(ROOT / "solutions" / DECODE / solution)
    entry = load_entry_point(folder.path, folder.solution, ROOT / ".flashbench-cache" / "build")
    return sys.modules[entry.__module__]


def main(names: list[str]) -> None:
    repo = Repo(ROOT)
    definition = repo.definition(DECODE)
    workloads = {w.name: w for w in repo.workload_set(DECODE).workloads}
    names = names or ["smoke_mixed"] + [n for n, w in workloads.items() if "smoke" not in w.tags]
    triton = module("triton_splitkv")
    try:
        flashinfer = module("flashinfer_fa3").run_decode
    except BuildError as error:
        flashinfer = None
        print(f"FlashInfer left out: {error}")
    flush = L2Flush("write+read", "cuda")
    for name in names:
        inputs = generate_inputs(definition, workloads[name], SEED, "cuda", ROOT)
        output, lse = outputs_for(definition, inputs)
        args = [inputs[name] for name in definition.inputs] + [output, lse]
        row = {}
        if flashinfer is not None:
            row["flashinfer"] = time_after_flush(lambda: flashinfer(*args), flush, CALLS)
        triton.launch(*args, aligned=False)
        torch.cuda.synchronize()
        expected = output.clone(), lse.clone()
        for variant, settings in VARIANTS.items():
            row[variant] = time_after_flush(lambda: triton.launch(*args, **settings), flush, CALLS)
            for _ in range(10):
                output.fill_(float("nan"))
                triton.launch(*args, **settings)
                if not (torch.allclose(output.float(), expected[0].float(), atol=1e-2, rtol=1e-2)
                        and torch.allclose(lse, expected[1], atol=1e-3, rtol=1e-3)):
                    print(f"MISMATCH {name} {variant}")
                    break
        launch = triton.fast_launch.launch
        triton.fast_launch.launch = lambda kernel, *a: None if kernel is triton._mla_decode_merge_kernel else launch(kernel, *a)
        row["split_only"] = time_after_flush(lambda: triton.launch(*args), flush, CALLS)
        triton.fast_launch.launch = launch
        print(f"{name:24s} B={output.shape[0]} tokens={inputs['kv_indices'].shape[0]} "
              + " ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else [])
