"""Making single inputs from their descriptors: random, scalar, safetensors."""

import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..dtypes import dtype_name, is_float, nbytes, torch_dtype
from ..environment import usable_memory
from ..errors import shortened
from ..model.workload import RandomInput, SafetensorsInput, ScalarInput

DEFAULT_RANDOM = RandomInput(type="random")


def random_tensor(spec: RandomInput, shape: list[int], dtype: str, seed: int, device: str) -> torch.Tensor:
    target = torch_dtype(dtype)
    integer = not is_float(dtype) and dtype != "bool"
    if integer:
        check_integer_range(spec, dtype)
    elif dtype != "bool":
        check_float_range(spec, dtype)
    if device == "meta":  # shape-only validation: no data, no generator
        return torch.empty(shape, dtype=target, device="meta")
    generator = torch.Generator(device=device).manual_seed(seed)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=generator, device=device).bool()
    if integer:
        return torch.randint(int(spec.low), int(spec.high), shape, generator=generator, device=device, dtype=target)
    # Scaled and shifted in place: the same values as out of place, without two temporaries as large, which cost
    # a CPU more than the conversion (a call's fresh windows are drawn so, and a worker that skips the temporaries
    # runs its harness steps more cheaply than the judge's run of them, which it subtracts).
    if spec.distribution == "uniform":
        low, high = uniform_range(spec)
        values = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
        values.mul_(high - low).add_(low)
    else:
        values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        values.mul_(spec.std).add_(spec.mean)
    return values.to(target)


def check_integer_range(spec: RandomInput, dtype: str) -> None:
    """A random integer input's [low, high): whole numbers within its dtype. Checked on "meta" too, so that
    `validate` refuses what torch.randint would refuse only once the inputs are drawn."""
    if spec.low is None or spec.high is None or not spec.low < spec.high:
        raise ValueError(f"a random {dtype} input needs low < high (e.g. {{type: random, low: 0, high: 100}})")
    if not (spec.low.is_integer() and spec.high.is_integer()):
        raise ValueError(f"a random {dtype} input needs whole numbers for low and high, "
                         f"not {spec.low:g} and {spec.high:g}")
    info = torch.iinfo(torch_dtype(dtype))
    top = min(info.max + 1, torch.iinfo(torch.int64).max)  # high is exclusive; torch takes it as an int64
    if spec.low < info.min:
        raise ValueError(f"low {int(spec.low)} is below the least {dtype}, {info.min}")
    if spec.high > top:
        raise ValueError(f"high {int(spec.high)} is past the {dtype} range (high is exclusive: at most {top})")


# Draws of a normal distribution stay within this many standard deviations of the mean (beyond 8, one in 10^15).
NORMAL_REACH = 8


def check_float_range(spec: RandomInput, dtype: str) -> None:
    """A random floating-point input's fields: those of its distribution only (a normal one ignored `low`, a
    uniform one `std`), a uniform range that is one (`low` 3 with the default `high` 1 drew from (1, 3]), and
    draws within the dtype (a std of 1e38 drew inf in bfloat16, and the reference failed against itself)."""
    # By value, not by the fields a file set: a workload crosses to the judge's processes dumped in full.
    given = {"low": spec.low is not None, "high": spec.high is not None, "mean": spec.mean != 0.0,
             "std": spec.std != 1.0}
    ignored = [name for name in (("low", "high") if spec.distribution == "normal" else ("mean", "std")) if given[name]]
    if ignored:
        raise ValueError(f"{', '.join(ignored)} do(es) not apply to a {spec.distribution} distribution")
    if dtype == "float4_e2m1":  # torch has no range for packed FP4 (finfo raises) and converts nothing to it
        raise ValueError("torch draws no random float4_e2m1 values (packed FP4): capture the input")
    # Drawn in float32 (random_tensor) or in the dtype itself (refill_random, whose uniform_ refuses a width past it).
    largest = min(torch.finfo(torch_dtype(dtype)).max, torch.finfo(torch.float32).max)
    if spec.distribution == "uniform":
        low, high = uniform_range(spec)
        if not low < high:
            defaults = "".join(f" ({name} defaults to {value})" for name, value, bound in
                               (("low", 0, spec.low), ("high", 1, spec.high)) if bound is None)
            raise ValueError(f"a uniform input needs low < high, not [{low:g}, {high:g}){defaults}")
        if high - low > largest:
            raise ValueError(f"the range [{low:g}, {high:g}) is wider than the largest {dtype}, {largest:g}")
        reach = max(abs(low), abs(high))
    else:
        # A call that redraws no query scales an input drawn about 0 by a factor below 2 (recipe, SCALED_DTYPES).
        reach = abs(spec.mean) + NORMAL_REACH * spec.std * (2 if scalable(spec) else 1)
    if reach > largest:
        raise ValueError(f"draws reach {reach:g}, past the largest {dtype}, {largest:g}")


def uniform_range(spec: RandomInput) -> tuple[float, float]:
    """A floating-point uniform input's bounds: [0, 1) unless the workload gives them."""
    return spec.low or 0.0, 1.0 if spec.high is None else spec.high


def symmetric(spec: RandomInput) -> bool:
    """Whether negating values drawn from `spec` leaves their distribution as it is (mean 0, or bounds
    around 0): only such an input may have its signs flipped."""
    if spec.distribution == "normal":
        return spec.mean == 0.0
    low, high = uniform_range(spec)
    return low == -high


def scalable(spec: RandomInput) -> bool:
    """Whether values drawn from `spec` times a positive factor are of the same kind (a normal about 0
    stays one; a uniform range would move its bounds): only such an input may be scaled."""
    return spec.distribution == "normal" and spec.mean == 0.0


def refill_random(tensor: torch.Tensor, spec: RandomInput, seed: int, generator: torch.Generator) -> None:
    """Every element of `tensor` drawn afresh in place from `spec`, seeded by `seed` (`generator`, on the
    tensor's device, is reseeded): 16- to 64-bit floating-point data in one pass in its own dtype; other dtypes
    (FP8 included, which torch's normal_ and uniform_ refuse) through random_tensor."""
    if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):  # FP8: torch draws none
        tensor.copy_(random_tensor(spec, list(tensor.shape), dtype_name(tensor.dtype), seed, str(tensor.device)))
        return
    generator.manual_seed(seed)
    if spec.distribution == "uniform":
        tensor.uniform_(*uniform_range(spec), generator=generator)
    else:
        tensor.normal_(spec.mean, spec.std, generator=generator)


def scalar_value(spec: ScalarInput, dtype: str):
    if dtype == "bool":
        return bool(spec.value)
    return float(spec.value) if is_float(dtype) else int(spec.value)


# Bits per element of safetensors' dtype codes (a header's shape counts FP4 and FP6 values, not bytes); any other
# code is one byte.
_SAFETENSORS_BITS = {"F64": 64, "I64": 64, "U64": 64, "C64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16,
                     "BF16": 16, "I16": 16, "U16": 16, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}


def captured_memory_budget() -> int:
    """The bytes all captured tensors of one workload may hold: a sixteenth of the memory the judge may use (the
    machine's, or its cgroup's limit where lower). A header may declare any size, and a sparse file on disk reads
    back as that many bytes; a run keeps about six copies of its inputs (one per input set and the current one in
    the judge, the worker's, the references' reads), so past this the judge would be killed for memory rather
    than refuse."""
    return (usable_memory() or 16 << 30) // 16


# The share of a GPU's memory a job's input sets, output slots and the baseline's copies may take (sets_within
# keeps to it with fewer sets); the rest is for the reference's and the solution's own work, the CUDA contexts
# and the flush. Counted so, the largest MHA varlen workload (d_qk 192, 16 sequences of 128-8192 tokens) needs
# about 74 GB with three sets at its mean length: the H200's 141 GB holds them, as in v7 and v8; an 80 GB
# H100, which ran out with three, holds one.
JOB_MEMORY_SHARE = 0.6


def job_memory_budget(device: str) -> int | None:
    """What a job's sets may take of the device (none on a CPU: the host's memory is not the judge's to divide)."""
    if torch.device(device).type != "cuda":
        return None
    return int(JOB_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory)


# The most memory of any GPU made now (an NVIDIA B300's 288 GB): `validate` knows no device, so it refuses only a
# workload one input set of which no GPU could hold (job_bytes within JOB_MEMORY_SHARE of this).
LARGEST_GPU_BYTES = 288 * 10**9


def input_set_bytes(inputs: dict) -> int:
    """The bytes of an input set's tensors (its scalars take none)."""
    return sum(value.nbytes for value in inputs.values() if isinstance(value, torch.Tensor))


def outputs_bytes(outputs: dict[str, tuple[str, list[int]]]) -> int:
    """The bytes of a call's outputs, given as {name: (dtype, shape)}."""
    return sum(nbytes(dtype, shape) for dtype, shape in outputs.values())


def job_bytes(count: int, set_bytes: int, output_bytes: int) -> int:
    """The device memory a job of `count` input sets takes: each set twice (the judge's current copy and the
    worker's arena) and the baseline's one, an output slot per set and one more, and the baseline's two output
    buffers."""
    return (2 * count + 1) * set_bytes + (count + 3) * output_bytes


def safetensors_tensor(spec: SafetensorsInput, base: Path, dtype: str, device: str, budget: int) -> torch.Tensor:
    """The captured tensor; `base` is the workload file's folder, and the blob must be a file inside it (a workload
    from anyone named /home/..., ../.. or a link out, and its worker was handed whatever that file held). A tensor
    declaring more than `budget` bytes is refused unread."""
    path = (base / spec.path).resolve()
    if not path.is_relative_to(Path(base).resolve()):
        raise ValueError(f"safetensors file {spec.path} is outside {base} (absolute, through '..' or a link)")
    if not path.is_file():
        raise ValueError(f"safetensors file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as blob:
            if spec.tensor_key not in blob.keys():
                keys = shortened(", ".join(blob.keys()))  # a header may hold millions of them
                raise ValueError(f"{path} has no tensor {spec.tensor_key!r} (keys: {keys})")
            header = blob.get_slice(spec.tensor_key)
            size = -(-math.prod(header.get_shape()) * _SAFETENSORS_BITS.get(header.get_dtype(), 8) // 8)
            if size > budget:
                raise ValueError(f"{path}:{spec.tensor_key} holds {size:,} bytes, more than the {max(budget, 0):,} "
                                 "left of the sixteenth of this machine's memory that captured tensors may hold")
            tensor = blob.get_tensor(spec.tensor_key)
    except (SafetensorError, OSError, MemoryError) as exc:  # a malformed header, a size past memory, no file
        raise ValueError(f"{path} cannot be read as safetensors: {shortened(str(exc))}") from None
    if tensor.dtype != torch_dtype(dtype):
        raise ValueError(f"{path}:{spec.tensor_key} is {dtype_name(tensor.dtype)}, the definition says {dtype}")
    return tensor.to(device)
