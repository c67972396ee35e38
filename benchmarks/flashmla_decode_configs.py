"""Launch settings of our FlashMLA-form Triton decode kernels (16 heads, or 128), FlashMLA alongside (GPU only).

Makes the inputs of the definition's own workloads (`generate_inputs`, seed 0, on the GPU), then times
with `triton.testing.do_bench` (its own L2 flush, a write) FlashMLA (when installed) and:

  configs  `triton_splitkv`, `triton_balanced` and `triton_flat` under each (num_warps, num_stages), and
           `triton_splitkv` with 1-8 key splits, on uniform and skewed batches
  defaults the three kernels as they launch themselves, on every workload but the smoke ones, and balanced with
           its older schedule, whose units are not fitted to one wave (fit=False)
  units    `triton_balanced` with several unit counts, on variable-length and skewed batches
  splits   `triton_splitkv` with 32-264 key splits, on the single-request workloads
  compare  splitkv and balanced as they were at git revision --against ("old") and as they are ("new"),
           flat, and beside them more key splits, half-block key tiles (block_n=32), other unit counts
  flat     `triton_flat`'s options: no floor on blocks a program, one token's rows a tile (16-row tiles
           at two draft tokens), fewer value columns a merge program, other launch settings

Prints one line per setting: workload, kernel, setting, µs, and the largest difference from
FlashMLA's output. The logs under docs/data/decode_variants_h100/ were made by it: the configs,
defaults and units logs by its first form, which made inputs of its own with the same shapes, and
the compare log by a script with the same variants but flat (which did not exist yet).

    python benchmarks/flashmla_decode_configs.py {configs,defaults,units,splits,flat} [--heads 128]
    python benchmarks/flashmla_decode_configs.py compare --against REV [--heads 128]
"""

import argparse
import importlib.util
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench

from flashbench import Repo, generate_inputs
from flashbench.binding import bind_axes, output_shapes
from flashbench.dtypes import torch_dtype

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "solutions" / "_shared"
DEFINITION = "flashmla_decode_causal_h{heads}_ckv512_kpe64_ps64"
WARPS_STAGES = [(4, 2), (8, 2), (4, 3), (8, 3), (4, 1), (8, 1)]
SPLITS = (1, 2, 4, 6, 8)
MANY_SPLITS = (32, 64, 132, 264)
UNITS = (None, 66, 132, 198, 264, 396, 528)
SKEWED = "b32_skewed_65536_31x1024_sq2"
EXTRACTED: list[tempfile.TemporaryDirectory] = []  # older revisions' kernels, kept while their modules are in use
WORKLOADS = {
    "configs": ["b128_l8192_sq1", "b128_l8192_sq2", "b128_l4096_sq2", "b64_captured_sq2", SKEWED],
    "units": ["b128_var8192_sq1", "b128_var8192_sq2", "b128_var4096_sq2", SKEWED],
    "splits": ["b1_l32768_sq1", "b1_l131072_sq2"],
    "flat": ["b1_l32768_sq1", "b1_l131072_sq2", SKEWED, "b64_captured_sq2", "b128_l4096_sq2", "b128_var4096_sq2",
             "b128_var8192_sq2", "b128_var8192_sq1"],
    "compare": ["b1_l32768_sq1", "b1_l131072_sq2", SKEWED, "b128_var8192_sq2", "b128_var4096_sq2", "b128_var8192_sq1",
                "b64_captured_sq2", "b128_l4096_sq2", "b128_l8192_sq1"],
}


def load(path: Path, *siblings: Path):
    """The module at `path`, importing from its own folder and `siblings` as a staged solution does (and
    afresh for each load, so that two revisions' modules of one name do not mix)."""
    folders = [path.parent, *siblings]
    spec = importlib.util.spec_from_file_location(str(path), path)
    module = importlib.util.module_from_spec(spec)
    sys.path[:0] = map(str, folders)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.path[:len(folders)]
        imported = [name for name, loaded in sys.modules.items()
                    if getattr(loaded, "__file__", None) and Path(loaded.__file__).parent in folders]
        for name in imported:
            del sys.modules[name]
    return module


def our_kernel(name: str, shared: Path = SHARED):
    """Our Triton kernel `name` (splitkv, balanced, flat) in `shared`, in any layout the repository has had:
    its own shared folder beside the tile module's, one folder for all, or a kernel.py of its own."""
    tiles = shared / "flashmla_decode_triton"
    for path in (shared / f"flashmla_decode_triton_{name}" / f"{name}.py", tiles / f"{name}.py",
                 shared / f"flashmla_decode_triton_{name}" / "kernel.py"):
        if path.is_file():
            return load(path, tiles)
    raise FileNotFoundError(f"no {name} kernel under {shared}")


def kernels_at(revision: str) -> tuple:
    """(splitkv, balanced) as they were at `revision`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "solutions/_shared"],
                             capture_output=True, check=True).stdout
    folder = tempfile.TemporaryDirectory(prefix="flashmla_decode_")  # removed when the script ends
    EXTRACTED.append(folder)
    shared = Path(folder.name) / "solutions" / "_shared"
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(shared.parents[1], filter="data")
    return our_kernel("splitkv", shared), our_kernel("balanced", shared)


class LaunchOverride:
    """Stands in for a Triton kernel so that `launch` runs it with other launch settings."""

    def __init__(self, kernel):
        self.kernel, self.settings = kernel, {}

    def __getitem__(self, grid):
        launcher = self.kernel[grid]
        return lambda *args, **kwargs: launcher(*args, **{**kwargs, **self.settings})


def workloads(repo: Repo, definition: str, mode: str) -> list:
    every = repo.workload_set(definition).workloads
    if mode == "defaults":
        return [w for w in every if "smoke" not in w.tags]
    by_name = {w.name: w for w in every}
    return [by_name[name] for name in WORKLOADS[mode]]


def inputs(repo: Repo, definition_name: str, workload) -> list:
    """The kernel's arguments: the workload's inputs (seed 0) and empty out / lse."""
    definition = repo.definition(definition_name)
    made = generate_inputs(definition, workload, 0, "cuda", repo.definition_path(definition_name).parent)
    args = [made[name] for name in definition.inputs]
    shapes = output_shapes(definition, bind_axes(definition, made))
    return args + [torch.empty(shape, dtype=torch_dtype(definition.outputs[name].dtype), device="cuda")
                   for name, shape in shapes.items()]


def microseconds(call) -> float:
    call()
    return do_bench(call, warmup=50, rep=300) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["configs", "defaults", "units", "splits", "compare", "flat"])
    parser.add_argument("--against", metavar="REV", help="compare: the git revision whose kernels are 'old'")
    parser.add_argument("--heads", type=int, choices=[16, 128], default=16,
                        help="the definition's query heads (both definitions name their workloads alike)")
    options = parser.parse_args()
    mode, definition = options.mode, DEFINITION.format(heads=options.heads)
    if (mode == "compare") != (options.against is not None):
        parser.error("--against goes with compare, and compare needs it")
    repo = Repo(ROOT)
    print(f"# device: {torch.cuda.get_device_name()}")
    print(f"# definition: {definition}")
    old_splitkv, old_balanced = kernels_at(options.against) if options.against else (None, None)
    splitkv, balanced, flat = our_kernel("splitkv"), our_kernel("balanced"), our_kernel("flat")
    for kernel in (splitkv, balanced, flat):
        kernel._decode_kernel = LaunchOverride(kernel._decode_kernel)
    try:
        flashmla = load(SHARED / "flashmla_decode_flashmla" / "kernel.py")
    except ImportError as missing:
        print(f"FlashMLA not timed: {missing}")
        flashmla = None
    for workload in workloads(repo, definition, mode):
        name = workload.name
        args = inputs(repo, definition, workload)
        expected = None
        if flashmla is not None:
            expected = flashmla.run(*args[:5])[0].float()
            print(f"{name:28} {'flashmla':30} {microseconds(lambda: flashmla.run(*args[:5])):8.1f} us")

        def timed(label: str, kernel, **options) -> None:
            args[5].fill_(float("nan"))
            time = microseconds(lambda: kernel.launch(*args, **options))
            error = (args[5].float() - expected).abs().max().item() if expected is not None else float("nan")
            print(f"{name:28} {label:30} {time:8.1f} us  err {error:.3g}")

        if mode == "units":
            for units in UNITS:
                timed(f"balanced target_units={units}", balanced, target_units=units)
        elif mode == "compare":
            for label, kernel, launch_options in [
                    ("splitkv old", old_splitkv, {}), ("splitkv new", splitkv, {}), ("balanced old", old_balanced, {}),
                    ("balanced new", balanced, {}), ("flat new", flat, {}),
                    *[(f"splitkv new splits={n}", splitkv, {"num_splits": n})
                      for n in (132, 264) if args[0].shape[0] == 1],  # q: [batch, s_q, heads, 576]
                    ("splitkv new bn32", splitkv, {"block_n": 32}), ("balanced new bn32", balanced, {"block_n": 32}),
                    *[(f"balanced new units={n}", balanced, {"target_units": n}) for n in (132, 396)]]:
                timed(label, kernel, **launch_options)
        elif mode == "flat":
            two_tokens = args[0].shape[1] == 2  # q: [batch, s_q, heads, 576]
            for label, launch_options, settings in [
                    ("flat default", {}, {}), ("flat min_blocks=1", {"min_blocks": 1}, {}),
                    ("flat merge_columns=32", {"merge_columns": 32}, {}),
                    ("flat min_blocks=16", {"min_blocks": 16}, {}),
                    *[(f"flat block_m=16{extra}", {"block_m": 16, **more}, {}) for extra, more in
                      [("", {}), (" merge_columns=32", {"merge_columns": 32})] if two_tokens],
                    ("flat w8 s2", {}, {"num_warps": 8, "num_stages": 2}),
                    ("flat w4 s3", {}, {"num_warps": 4, "num_stages": 3})]:
                flat._decode_kernel.settings = settings
                timed(label, flat, **launch_options)
            flat._decode_kernel.settings = {}
        elif mode == "splits":
            timed("splitkv default", splitkv)
            for splits in MANY_SPLITS:
                timed(f"splitkv splits={splits}", splitkv, num_splits=splits)
        kernels = ((splitkv, "splitkv"), (balanced, "balanced"), (flat, "flat"))
        for kernel, label in kernels if mode in ("configs", "defaults") else ():
            for warps, stages in WARPS_STAGES if mode == "configs" else [(None, None)]:
                kernel._decode_kernel.settings = dict(num_warps=warps, num_stages=stages) if warps else {}
                timed(f"{label} w{warps} s{stages}" if warps else f"{label} default", kernel)
            if kernel is splitkv and mode == "configs":
                warps = 8 if args[0].shape[1] * args[0].shape[2] >= 32 else 4  # q: [batch, s_q, heads, 576]
                kernel._decode_kernel.settings = dict(num_warps=warps, num_stages=2)
                for splits in SPLITS:
                    timed(f"splitkv splits={splits} w{warps} s2", kernel, num_splits=splits)
            kernel._decode_kernel.settings = {}
            if kernel is balanced and mode == "defaults":
                timed("balanced unfitted", balanced, fit=False)
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
