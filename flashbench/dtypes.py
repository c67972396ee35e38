"""The dtype names a definition may use and their torch equivalents."""

import math
from typing import Literal

import torch

DTypeName = Literal[
    "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1",
    "int64", "int32", "int16", "int8", "bool",
]

_TORCH_NAMES = {"float4_e2m1": "float4_e2m1fn_x2"}  # torch packs two fp4 values per byte


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a definition's dtype name."""
    attr = _TORCH_NAMES.get(name, name)
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not supported by torch {torch.__version__}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The definition's name for a torch dtype (inverse of torch_dtype)."""
    name = str(dtype).removeprefix("torch.")
    return {v: k for k, v in _TORCH_NAMES.items()}.get(name, name)


def nbytes(name: str, shape) -> int:
    """The bytes of a tensor of a definition's dtype name and this shape."""
    return math.prod(shape) * torch_dtype(name).itemsize


def is_float(name: str) -> bool:
    return name.startswith("float") or name == "bfloat16"


def has_nan(name: str) -> bool:
    """Whether the float dtype (a definition's or torch's name) can hold a NaN: e2m1 has none."""
    return is_float(name) and not name.startswith("float4")
