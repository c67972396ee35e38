"""Binding concrete inputs to a definition: axis values, shapes, dtypes and constraints."""

from typing import Any

import torch

from .dtypes import torch_dtype
from .model import Definition


class BindingError(ValueError):
    """Concrete inputs that do not fit the definition; the message says which and why."""


def bind_axes(definition: Definition, inputs: dict[str, Any]) -> dict[str, int]:
    """Axis values read off the input tensors; checks presence, dtypes, shapes and constraints."""
    missing = [name for name in definition.inputs if name not in inputs]
    if missing:
        raise BindingError(f"missing input(s): {', '.join(missing)}")
    axes: dict[str, int] = dict(definition.const_axes)
    sources: dict[str, str] = {name: "its const value" for name in axes}
    for name, spec in definition.inputs.items():
        value = inputs[name]
        if spec.shape is None:
            if isinstance(value, torch.Tensor):
                raise BindingError(f"input {name}: expected a Python scalar, got a tensor")
            continue
        check_tensor(name, value, spec.dtype, None)
        if value.dim() != len(spec.shape):
            raise BindingError(f"input {name}: expected {len(spec.shape)} dims {spec.shape}, got shape {list(value.shape)}")
        for axis, size in zip(spec.shape, value.shape):
            if axis in axes and axes[axis] != size:
                raise BindingError(
                    f"input {name}: axis {axis} is {size}, but {sources[axis]} says {axes[axis]}"
                )
            axes.setdefault(axis, size)
            sources.setdefault(axis, f"input {name}")
    check_constraints(definition, axes, inputs)
    return axes


def check_tensor(name: str, value: Any, dtype: str, shape: list[int] | None) -> None:
    if not isinstance(value, torch.Tensor):
        raise BindingError(f"{name}: expected a tensor, got {type(value).__name__}")
    if value.dtype != torch_dtype(dtype):
        raise BindingError(f"{name}: expected dtype {dtype}, got {str(value.dtype).removeprefix('torch.')}")
    if shape is not None and list(value.shape) != shape:
        raise BindingError(f"{name}: expected shape {shape}, got {list(value.shape)}")


def output_shapes(definition: Definition, axes: dict[str, int]) -> dict[str, list[int]]:
    """Concrete output shapes once every axis is bound (outputs use no axis the inputs leave open)."""
    shapes = {}
    for name, spec in definition.outputs.items():
        unbound = [a for a in spec.shape or [] if a not in axes]
        if unbound:
            raise BindingError(f"output {name}: axis {unbound[0]} is not bound by any input")
        shapes[name] = [axes[a] for a in spec.shape or []]
    return shapes


def check_constraints(definition: Definition, axes: dict[str, int], inputs: dict[str, Any]) -> None:
    env = {**inputs, **axes}
    for expression in definition.constraint_expressions:
        try:
            holds = expression.evaluate(env)
            if isinstance(holds, torch.Tensor) and holds.numel() != 1:  # `max(x, 0)`: min and max go element-wise
                raise BindingError(f"constraint {expression.source!r} gives {holds.numel()} values, not one truth")
            holds = bool(holds)
        except BindingError:
            raise
        except Exception as exc:  # an expression over bad inputs can fail in many ways
            raise BindingError(f"constraint {expression.source!r} cannot be evaluated: {exc}") from None
        if not holds:
            raise BindingError(f"constraint {expression.source!r} does not hold ({_describe(expression, env)})")


def _describe(expression, env: dict[str, Any]) -> str:
    shown = []
    for name in sorted(expression.names):
        value = env[name]
        if isinstance(value, torch.Tensor):
            value = value.tolist() if value.numel() <= 8 else f"tensor of shape {list(value.shape)}"
        shown.append(f"{name}={value}")
    return ", ".join(shown)
