"""Launch settings of our FlashMLA-form Triton decode kernels at 16 heads, FlashMLA alongside (GPU only).

Builds each workload's inputs here (random bf16 q and cache, 64-token blocks in a shuffled block table),
then times with `triton.testing.do_bench` (its own L2 flush, a write) FlashMLA (when installed) and:

  configs  `triton_splitkv` and `triton_balanced` under each (num_warps, num_stages), and
           `triton_splitkv` with 1-8 key splits, on uniform and skewed batches
  defaults both kernels as they launch themselves
  units    `triton_balanced` with several unit counts, on variable-length and skewed batches

Prints one line per setting: workload, kernel, setting, µs (and, in configs, the largest difference
from FlashMLA's output). The logs under docs/data/decode_variants_h100/ were made by it.

    python benchmarks/flashmla_decode_configs.py {configs,defaults,units}
"""

import argparse
import importlib.util
import math
from pathlib import Path

import torch
from triton.testing import do_bench

SHARED = Path(__file__).resolve().parents[1] / "solutions" / "_shared"
HEADS = 16
WARPS_STAGES = [(4, 2), (8, 2), (4, 3), (8, 3), (4, 1), (8, 1)]
SPLITS = (1, 2, 4, 6, 8)
UNITS = (None, 66, 132, 198, 264, 396, 528)
SKEWED = ([65536] + [1024] * 31, 2)


def load(folder: str):
    spec = importlib.util.spec_from_file_location(folder, SHARED / folder / "kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LaunchOverride:
    """Stands in for a Triton kernel so that `launch` runs it with other launch settings."""

    def __init__(self, kernel):
        self.kernel, self.settings = kernel, {}

    def __getitem__(self, grid):
        launcher = self.kernel[grid]
        return lambda *args, **kwargs: launcher(*args, **{**kwargs, **self.settings})


def normal_lengths(count: int, mean: int, std: int) -> list[int]:
    draws = torch.randn(count, generator=torch.Generator().manual_seed(1)) * std + mean
    return [int(x) for x in draws.clamp(2, 32768).round()]


def workloads(mode: str) -> dict[str, tuple[list[int], int]]:
    if mode == "units":
        return {"b128_var8192_sq1": (normal_lengths(128, 8192, 4096), 1),
                "b128_var8192_sq2": (normal_lengths(128, 8192, 4096), 2),
                "b128_var4096_sq2": (normal_lengths(128, 4096, 2048), 2), "b32_skewed_sq2": SKEWED}
    uniform = {"b128_l8192_sq1": ([8192] * 128, 1), "b128_l8192_sq2": ([8192] * 128, 2),
               "b128_l4096_sq2": ([4096] * 128, 2), "b64_l4096_sq2": ([4096] * 64, 2), "b32_skewed_sq2": SKEWED}
    return {"b128_l4096_sq1": ([4096] * 128, 1), **uniform} if mode == "defaults" else uniform


def inputs(lengths: list[int], s_q: int):
    generator = torch.Generator(device="cuda").manual_seed(0)
    blocks = [math.ceil(length / 64) for length in lengths]
    q = torch.randn(len(lengths), s_q, HEADS, 576, device="cuda", dtype=torch.bfloat16, generator=generator)
    cache = torch.randn(sum(blocks), 64, 1, 576, device="cuda", dtype=torch.bfloat16, generator=generator)
    order = torch.randperm(sum(blocks), device="cuda", generator=generator).to(torch.int32)
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device="cuda")
    for row, start in enumerate(torch.tensor([0] + blocks).cumsum(0)[:-1].tolist()):
        table[row, :blocks[row]] = order[start:start + blocks[row]]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = torch.empty(len(lengths), s_q, HEADS, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(len(lengths), HEADS, s_q, device="cuda", dtype=torch.float32)
    return q, cache, table, seqlens, 576 ** -0.5, out, lse


def microseconds(call) -> float:
    call()
    return do_bench(call, warmup=50, rep=300) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["configs", "defaults", "units"])
    mode = parser.parse_args().mode
    splitkv, balanced = load("flashmla_decode_triton_splitkv"), load("flashmla_decode_triton_balanced")
    for kernel in (splitkv, balanced):
        kernel._decode_kernel = LaunchOverride(kernel._decode_kernel)
    try:
        flashmla = load("flashmla_decode_flashmla")
    except ImportError as missing:
        print(f"FlashMLA not timed: {missing}")
        flashmla = None
    for name, (lengths, s_q) in workloads(mode).items():
        args = inputs(lengths, s_q)
        expected = None
        if flashmla is not None:
            expected = flashmla.run(*args[:5])[0].float()
            print(f"{name:18} flashmla                       {microseconds(lambda: flashmla.run(*args[:5])):8.1f} us")
        if mode == "units":
            for units in UNITS:
                time = microseconds(lambda: balanced.launch(*args, target_units=units))
                print(f"{name:18} balanced target_units={units}   {time:8.1f} us")
            continue
        for kernel, label in ((splitkv, "splitkv"), (balanced, "balanced")):
            for warps, stages in WARPS_STAGES if mode == "configs" else [(4, 2)]:
                kernel._decode_kernel.settings = dict(num_warps=warps, num_stages=stages) if mode == "configs" else {}
                time = microseconds(lambda: kernel.launch(*args))
                error = (args[5].float() - expected).abs().max().item() if expected is not None else float("nan")
                print(f"{name:18} {label:9} w{warps} s{stages}          {time:8.1f} us  err {error:.3g}")
            if kernel is splitkv and mode == "configs":
                warps = 8 if s_q == 2 else 4
                kernel._decode_kernel.settings = dict(num_warps=warps, num_stages=2)
                for splits in SPLITS:
                    time = microseconds(lambda: kernel.launch(*args, num_splits=splits))
                    print(f"{name:18} splitkv splits={splits} w{warps} s2   {time:8.1f} us")
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
