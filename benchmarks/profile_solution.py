"""One call of a repository solution on one workload, for a profiler (GPU only): `ncu` with
`--profile-from-start off` sees that call's kernels alone, after two warm-up calls (builds, autotuning).

The solution folder's files and its shared folders' are copied into one temporary folder, as the judge
stages them, and its entry point loaded in this process: it is our own code, never a submission's.

    ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python benchmarks/profile_solution.py flashmla_decode_causal_h128_ckv512_kpe64_ps64 triton_splitkv b128_l8192_sq1

The ncu reports under docs/data/profile_h100/ were made by it (one file per DEFINITION__SOLUTION__WORKLOAD,
read by `benchmarks/evidence_tables.py ncu`).
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashbench import Repo, generate_inputs  # noqa: E402
from flashbench.binding import bind_axes, output_shapes  # noqa: E402
from flashbench.build import load_entry_point  # noqa: E402
from flashbench.dtypes import torch_dtype  # noqa: E402
from flashbench.run import select_solutions, select_workloads  # noqa: E402


def staged(folder, into: Path) -> Path:
    for name, path in folder.files.items():
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, into / name)
    return into


def main(definition: str, solution: str, workload: str) -> None:
    repo = Repo(ROOT)
    definition = repo.resolve(definition)
    spec = repo.definition(definition)
    chosen = {w.name: w for w in select_workloads(repo, definition, [], "cuda")}[workload]
    folder = select_solutions(repo, definition, [solution])[0]
    inputs = generate_inputs(spec, chosen, 0, "cuda", ROOT)
    arguments = [inputs[name] for name in spec.inputs]
    if folder.solution.destination_passing_style:
        shapes = output_shapes(spec, bind_axes(spec, inputs))
        arguments += [torch.empty(shapes[name], dtype=torch_dtype(output.dtype), device="cuda")
                      for name, output in spec.outputs.items()]
    with tempfile.TemporaryDirectory() as scratch:
        entry = load_entry_point(staged(folder, Path(scratch)), folder.solution, ROOT / ".flashbench-cache" / "build")
        for _ in range(2):
            entry(*arguments)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        entry(*arguments)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"{solution} on {workload}: profiled one call")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
