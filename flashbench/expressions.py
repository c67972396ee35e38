"""A safe evaluator for the small expressions definitions contain (constraints, cost models).

Expressions are parsed with `ast` and checked against a whitelist before anything runs:
names, numbers, arithmetic, comparisons, and/or/not, indexing and slicing, the `shape`
attribute and `.item()`. Cost models may also call `sum`, `min` and `max`, constraints `min`
and `max` (over an index tensor: "every request is at least this long"). Nothing else
is allowed, so an expression can never import, call or reach arbitrary code.
"""

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch

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
        raise ValueError(f"does not parse: {exc.msg} in {_shown(source)}") from None
    except (RecursionError, MemoryError):  # the parser's own stack, past its nesting limit
        raise ValueError(f"nests deeper than {MAX_DEPTH} levels: {_shown(source)}") from None
    if _depth(tree) > MAX_DEPTH:
        raise ValueError(f"nests deeper than {MAX_DEPTH} levels: {_shown(source)}")
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


def _shown(source: str) -> str:
    return repr(source) if len(source) <= 200 else repr(source[:200]) + "..."


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
        given = [value.numel() for value in env.values() if isinstance(value, torch.Tensor)]
        self.max_elements = max([_MAX_NEW_ELEMENTS, *given])

    def _bounded(self, compute: Callable[..., Any], *operands: Any) -> Any:
        """compute(*operands), refused before it runs when its result would hold more than max_elements: its
        shape is found on "meta" first. A boolean mask's result, whose size needs the data, is no larger than
        what it selects from."""
        try:
            shaped = compute(*map(_on_meta, operands))
        except NotImplementedError:
            shaped = None
        if isinstance(shaped, torch.Tensor) and shaped.numel() > self.max_elements:
            raise ValueError(f"a result of shape {tuple(shaped.shape)} is too large")
        return compute(*operands)

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
        return self._bounded(_BINARY[type(node.op)], left, right)

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
            if not _truth(self._bounded(_COMPARE[type(op)], left, right)):
                return False
            left = right
        return True

    def visit_Subscript(self, node: ast.Subscript) -> Any:
        return self._bounded(operator.getitem, self.visit(node.value), self.visit(node.slice))

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
        return COST_FUNCTIONS[func.id](*(self.visit(a) for a in node.args))

    def generic_visit(self, node: ast.AST) -> Any:
        raise ValueError(f"cannot evaluate {type(node).__name__}")


def _on_meta(value: Any) -> Any:
    """`value` with its tensors (also inside an index tuple) on "meta": shapes without data. A tensor of one
    value stays a number: indexing by it (`x[indptr[-1] - 1]`) reads it, which "meta" cannot."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.dim() == 0 and not value.is_meta else value.to("meta")
    if isinstance(value, tuple):
        return tuple(map(_on_meta, value))
    return value


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
