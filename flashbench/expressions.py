"""A safe evaluator for the small expressions definitions contain (constraints, cost models).

Expressions are parsed with `ast` and checked against a whitelist before anything runs:
names, numbers, arithmetic, comparisons, and/or/not, indexing and slicing, the `shape`
attribute and `.item()`. Cost models may also call `sum`, `min` and `max`, constraints `min`
and `max` (over an index tensor: "every request is at least this long"). Nothing else
is allowed, so an expression can never import, call or reach arbitrary code.
"""

import ast
import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import shortened

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
    ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
}
_MAX_EXPONENT = 64  # keeps `10 ** 10 ** 10` from hanging the evaluator
_MAX_INT_BITS = 4096  # keeps `((10 ** 64) ** 64) ** 64` from hanging it too
# Elements a tensor the evaluator makes may hold beyond the largest tensor it is given: slices, arithmetic
# and reductions never need more, while an outer product (`x[:, None] - x[None, :]`) or a gather by a long
# index needs their sizes' product, terabytes for index tensors of a million entries.
_MAX_NEW_ELEMENTS = 1 << 24
# A definition may come from anyone (an imported dataset). The longest expression in definitions/ is 235
# characters and 6 levels deep; 6 MB of `(1, 1, ...)` took 3 GB and minutes to parse, and deep nesting
# ended `validate` with a RecursionError or a MemoryError from the parser, or would in the evaluator.
MAX_SOURCE_CHARS = 4096
MAX_DEPTH = 100


def _sum(value):
    return value.sum().item() if isinstance(value, torch.Tensor) else sum(value)


def _extreme(pick):
    def apply(*values):
        if len(values) == 1 and isinstance(values[0], torch.Tensor):
            if values[0].numel() == 0:  # the least of nothing is above everything, so `min(x) >= 0` holds of no x
                return math.inf if pick == "min" else -math.inf
            return getattr(values[0], pick)().item()
        if any(isinstance(value, torch.Tensor) for value in values):  # several: element by element, as torch's
            if any(isinstance(value, tuple) for value in values):  # as a tensor it would escape _check_many's sizes
                raise ValueError(f"{pick} of a tensor and a tuple")
            return functools.reduce({"max": torch.maximum, "min": torch.minimum}[pick], map(torch.as_tensor, values))
        return {"max": max, "min": min}[pick](*values)
    return apply


COST_FUNCTIONS = {"sum": _sum, "max": _extreme("max"), "min": _extreme("min")}


@dataclass(frozen=True)
class Expression:
    """A parsed, whitelisted expression. `names` are the free names it reads."""

    source: str
    tree: ast.Expression
    names: frozenset[str]
    functions: frozenset[str]

    def evaluate(self, env: dict[str, Any]) -> Any:
        return _Evaluator(env, self.functions).visit(self.tree.body)


def parse(source: str, allowed_names: set[str], functions: frozenset[str] = frozenset()) -> Expression:
    """Parse `source`; raise ValueError naming the first construct or name that is not allowed."""
    if len(source) > MAX_SOURCE_CHARS:
        raise ValueError(f"is {len(source)} characters long; an expression may hold {MAX_SOURCE_CHARS}")
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"does not parse: {exc.msg} in {shortened(repr(source))}") from None
    except (RecursionError, MemoryError):  # the parser's own stack, past its nesting limit
        raise ValueError(f"nests deeper than {MAX_DEPTH} levels: {shortened(repr(source))}") from None
    if _depth(tree) > MAX_DEPTH:
        raise ValueError(f"nests deeper than {MAX_DEPTH} levels: {shortened(repr(source))}")
    names: set[str] = set()
    for node in ast.walk(tree):
        _check_node(node, source, functions)
        if isinstance(node, ast.Name) and node.id not in functions:
            names.add(node.id)
    unknown = sorted(names - allowed_names)
    if unknown:
        raise ValueError(
            f"{source!r} uses unknown name(s) {', '.join(unknown)}; "
            f"only axis and input names are allowed"
        )
    return Expression(source, tree, frozenset(names), functions)


def _depth(tree: ast.AST) -> int:
    """How deep the tree nests, found without recursion (the evaluator recurses once per level)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


_ALLOWED_NODES = (
    ast.Expression, ast.Name, ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare,
    ast.Subscript, ast.Slice, ast.Tuple, ast.Attribute, ast.Call, ast.Load,
    ast.And, ast.Or, *_BINARY, *_UNARY, *_COMPARE,
)


def _check_node(node: ast.AST, source: str, functions: frozenset[str]) -> None:
    if not isinstance(node, _ALLOWED_NODES):
        raise ValueError(f"{source!r} uses {type(node).__name__}, which is not allowed here")
    if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, bool)):
        raise ValueError(f"{source!r} uses the literal {node.value!r}; only numbers are allowed")
    if isinstance(node, ast.Attribute) and node.attr not in ("shape", "item"):
        raise ValueError(f"{source!r} reads attribute {node.attr!r}; only 'shape' is allowed")
    if isinstance(node, ast.Attribute) and node.attr == "item":
        return  # checked with its call below
    if isinstance(node, ast.Call):
        _check_call(node, source, functions)


def _check_call(node: ast.Call, source: str, functions: frozenset[str]) -> None:
    if node.keywords:
        raise ValueError(f"{source!r} passes keyword arguments, which are not allowed")
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "item" and not node.args:
        return  # `x[-1].item()`, as FlashInfer-Bench definitions write it
    if isinstance(func, ast.Name) and func.id in functions:
        return
    allowed = ", ".join(sorted(functions)) or "none"
    raise ValueError(f"{source!r} calls {ast.unparse(func)}; allowed calls: .item(), {allowed}")


class _Evaluator(ast.NodeVisitor):
    def __init__(self, env: dict[str, Any], functions: frozenset[str]):
        self.env = env
        self.functions = functions
        # Tensors on "meta" (`check_workload`'s random inputs) hold no memory: a workload's axis of 10^12 made one
        # of 10^12 elements and lifted the bound with it.
        given = [value.numel() for value in env.values() if isinstance(value, torch.Tensor) and not value.is_meta]
        self.max_elements = max([_MAX_NEW_ELEMENTS, *given])

    def _refuse(self, shape: Any) -> None:
        if math.prod(shape) > self.max_elements:
            raise ValueError(f"a result of shape {tuple(shape)} is too large")

    def _elementwise(self, compute: Callable[[Any, Any], Any], left: Any, right: Any) -> Any:
        """compute(left, right) (arithmetic, a comparison), refused before it runs when the shape its operands
        broadcast to holds more than max_elements. Only shapes are read: reading a one-value tensor as a Python
        number made `x[-1] / y[0]` raise ZeroDivisionError (and `f[0] ** 44` OverflowError) where torch gives inf."""
        self._check_broadcast(left, right)
        return compute(left, right)

    def _check_broadcast(self, left: Any, right: Any) -> None:
        if isinstance(left, tuple) and isinstance(right, tuple):  # compared item by item, each pair a tensor's `==`
            for pair in zip(left, right):
                self._check_broadcast(*pair)
        # With one tensor, or two of one shape, the result is no larger than a tensor already made (and checked).
        elif (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor) and left.shape != right.shape
                and not left.is_meta and not right.is_meta):  # a result on "meta" holds no memory
            try:
                shape = torch.broadcast_shapes(left.shape, right.shape)
            except RuntimeError:  # shapes that do not broadcast: the operation raises its own error
                return
            self._refuse(shape)

    def _subscript(self, value: Any, index: Any) -> Any:
        """value[index], refused before it runs when its result would hold more than max_elements: its shape is
        found on "meta" first, a boolean mask standing there for the positions it selects (their number read
        from the mask), as torch itself reads it."""
        parts = index if isinstance(index, tuple) else (index,)
        gathers = any(isinstance(part, tuple) or isinstance(part, torch.Tensor) and part.dim() > 0 for part in parts)
        if gathers and isinstance(value, torch.Tensor) and not value.is_meta:  # else a view, or one value's mask
            try:
                shaped = value.to("meta")[_meta_index(index)]
            except NotImplementedError:  # a mask itself on "meta": the real indexing cannot read it either
                shaped = None
            if isinstance(shaped, torch.Tensor):
                self._refuse(shaped.shape)
        return value[index]

    def visit_Name(self, node: ast.Name) -> Any:
        if node.id not in self.env:
            raise ValueError(f"no value for {node.id!r}")
        return self.env[node.id]

    def visit_Constant(self, node: ast.Constant) -> Any:
        return node.value

    def visit_BinOp(self, node: ast.BinOp) -> Any:
        left, right = self.visit(node.left), self.visit(node.right)
        if isinstance(left, (tuple, list)) or isinstance(right, (tuple, list)):
            raise ValueError("arithmetic on a tuple is not allowed")
        if isinstance(node.op, ast.Pow):
            if abs(_as_number(right)) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large")
            if _is_int(left) and _is_int(right) and abs(left).bit_length() * abs(right) > _MAX_INT_BITS:
                raise ValueError("the power is too large")
        return self._elementwise(_BINARY[type(node.op)], left, right)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Any:
        operand = self.visit(node.operand)
        if isinstance(node.op, ast.Not):
            return not _truth(operand)
        return _UNARY[type(node.op)](operand)

    def visit_BoolOp(self, node: ast.BoolOp) -> Any:
        want_all = isinstance(node.op, ast.And)
        for value_node in node.values:
            if _truth(self.visit(value_node)) != want_all:
                return not want_all
        return want_all

    def visit_Compare(self, node: ast.Compare) -> Any:
        left = self.visit(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = self.visit(right_node)
            if not _truth(self._elementwise(_COMPARE[type(op)], left, right)):
                return False
            left = right
        return True

    def visit_Subscript(self, node: ast.Subscript) -> Any:
        return self._subscript(self.visit(node.value), self.visit(node.slice))

    def visit_Slice(self, node: ast.Slice) -> Any:
        parts = (node.lower, node.upper, node.step)
        return slice(*(self.visit(p) if p is not None else None for p in parts))

    def visit_Tuple(self, node: ast.Tuple) -> Any:
        return tuple(self.visit(e) for e in node.elts)

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        if node.attr != "shape":
            raise ValueError(f"cannot read attribute {node.attr!r}")
        value = self.visit(node.value)
        if not hasattr(value, "shape"):
            raise ValueError(f"{ast.unparse(node.value)} has no shape (it is {type(value).__name__})")
        return tuple(value.shape)

    def visit_Call(self, node: ast.Call) -> Any:
        func = node.func
        if isinstance(func, ast.Attribute):  # .item()
            value = self.visit(func.value)
            return value.item() if hasattr(value, "item") else value
        args = [self.visit(a) for a in node.args]
        self._check_many(args[0] if len(args) == 1 and isinstance(args[0], tuple) else args)
        return COST_FUNCTIONS[func.id](*args)

    def _check_many(self, values: Any) -> None:
        """Python's sum adds the values one by one (`sum((c, x))`), its min and max compare them two by two
        (`max(c, x)`): each running sum and each pair is refused as a binary operation's result would be."""
        distinct = list({id(v): v for v in values if isinstance(v, (torch.Tensor, tuple))}.values())
        if len({v.shape if isinstance(v, torch.Tensor) else id(v) for v in distinct}) < 2:
            return  # one shape: each sum and comparison as large as a value already made
        for i, left in enumerate(distinct):
            for right in distinct[i + 1:]:
                self._check_broadcast(left, right)
        shape: Any = ()
        for value in (v for v in distinct if isinstance(v, torch.Tensor) and not v.is_meta):
            try:
                shape = torch.broadcast_shapes(shape, value.shape)
            except RuntimeError:  # the sum raises its own error there
                return
            self._refuse(shape)

    def generic_visit(self, node: ast.AST) -> Any:
        raise ValueError(f"cannot evaluate {type(node).__name__}")


def _meta_index(index: Any) -> Any:
    """An index (a tuple's parts each) for the value's "meta" copy: a one-value tensor as the Python number torch
    reads it as (`x[indptr[-1] - 1]`; a bool or uint8 one is a mask, True or False), a mask as one index tensor
    per dimension it covers, as long as the positions it selects, and other tensors on "meta"."""
    if isinstance(index, tuple):
        return tuple(part for item in index for part in _meta_index_parts(item))
    parts = _meta_index_parts(index)
    return parts[0] if len(parts) == 1 and not _is_mask(index) else tuple(parts)


def _is_mask(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and not value.is_meta and value.dim() > 0
            and value.dtype in (torch.bool, torch.uint8))


def _meta_index_parts(value: Any) -> list[Any]:
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return [value]
    if value.is_floating_point() or value.is_complex():  # torch's own refusal, which "meta" raises as RuntimeError
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    if value.dim() == 0:
        return [bool(value.item()) if value.dtype in (torch.bool, torch.uint8) else int(value.item())]
    if _is_mask(value):
        selected = int(torch.count_nonzero(value).item())
        return [torch.empty(selected, dtype=torch.int64, device="meta") for _ in range(value.dim())]
    return [value.to("meta")]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_number(value: Any) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def _truth(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"a comparison produced {value.numel()} values; expected one")
        return bool(value.item())
    return bool(value)
