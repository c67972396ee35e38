"""Launching a Triton kernel with less host time per call.

Triton's own launch path costs tens of microseconds of host time per call; a decode or prefill kernel
of 10-50 microseconds is then bound by the host. `launch` caches the compiled kernel per
specialisation and calls it directly. FLASHBENCH_TRITON_FAST_LAUNCH=0 falls back to Triton's path.
"""

import os

import torch

FAST_LAUNCH = os.environ.get("FLASHBENCH_TRITON_FAST_LAUNCH", "1") == "1"
_compiled = {}


def specialisation(args):
    """What Triton specialises a launch on (tensor dtype and 16-byte alignment, integers equal to 1
    or divisible by 16), and the arguments as the launcher takes them (pointers as integers)."""
    key, raw = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            key.append((a.dtype, ptr & 15 == 0))
            raw.append(ptr)
        else:
            key.append((a == 1, a % 16 == 0) if type(a) is int else None)
            raw.append(a)
    return tuple(key), raw


def launch(kernel, grid, args, constexprs, num_warps, num_stages, device):
    """kernel[grid](...) with the compiled kernel cached per specialisation and launched directly on
    repeated calls. Triton's own path costs tens of microseconds of host time per launch (argument
    binding, launch hooks that build metadata, a driver query per tensor argument); pointers passed
    as integers skip the query, and the launch hooks are left out."""
    if not FAST_LAUNCH or device.type != "cuda":
        return kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
    index = device.index if device.index is not None else torch.cuda.current_device()
    spec, raw = specialisation(args)
    key = (kernel, index, spec, tuple(constexprs.values()), num_warps, num_stages)
    ck = _compiled.get(key)
    if ck is None:
        ck = kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        _compiled[key] = ck
        return ck
    ck.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(index), ck.function, ck.packed_metadata,
           None, None, None, *raw, *constexprs.values())
    return ck
