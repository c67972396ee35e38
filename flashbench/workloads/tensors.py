"""Making single inputs from their descriptors: random, scalar, safetensors."""

from pathlib import Path

import torch
from safetensors import safe_open

from ..dtypes import dtype_name, is_float, torch_dtype
from ..model.workload import RandomInput, SafetensorsInput, ScalarInput

DEFAULT_RANDOM = RandomInput(type="random")


def random_tensor(spec: RandomInput, shape: list[int], dtype: str, seed: int, device: str) -> torch.Tensor:
    target = torch_dtype(dtype)
    if device == "meta":  # shape-only validation: no data, no generator
        return torch.empty(shape, dtype=target, device="meta")
    generator = torch.Generator(device=device).manual_seed(seed)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=generator, device=device).bool()
    if not is_float(dtype):
        low, high = int(spec.low), int(spec.high) if spec.high > spec.low else int(spec.low) + 1
        return torch.randint(low, high, shape, generator=generator, device=device, dtype=target)
    if spec.distribution == "uniform":
        values = torch.rand(shape, generator=generator, device=device) * (spec.high - spec.low) + spec.low
    else:
        values = torch.randn(shape, generator=generator, device=device) * spec.std + spec.mean
    return values.to(target)


def scalar_value(spec: ScalarInput, dtype: str):
    if dtype == "bool":
        return bool(spec.value)
    return float(spec.value) if is_float(dtype) else int(spec.value)


def safetensors_tensor(spec: SafetensorsInput, base: Path, dtype: str, device: str) -> torch.Tensor:
    path = (base / spec.path).resolve()
    if not path.is_file():
        raise ValueError(f"safetensors file {path} does not exist")
    with safe_open(str(path), framework="pt") as blob:
        if spec.tensor_key not in blob.keys():
            raise ValueError(f"{path} has no tensor {spec.tensor_key!r} (keys: {', '.join(blob.keys())})")
        tensor = blob.get_tensor(spec.tensor_key)
    if tensor.dtype != torch_dtype(dtype):
        raise ValueError(f"{path}:{spec.tensor_key} is {dtype_name(tensor.dtype)}, the definition says {dtype}")
    return tensor.to(device)
