"""The safe evaluator for constraints and cost models: what it computes and what it refuses."""

import pytest
import torch

from flashbench.expressions import COST_FUNCTIONS, parse

COST = frozenset(COST_FUNCTIONS)


def evaluate(source, env=None, functions=frozenset()):
    env = env or {}
    return parse(source, set(env), functions).evaluate(env)


@pytest.mark.parametrize("source, expected", [
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("7 // 2", 3),
    ("7 % 4", 3),
    ("7 / 2", 3.5),
    ("2 ** 10", 1024),
    ("2 ** -2", 0.25),
    ("-3 + +1", -2),
    ("a * b - c", 3 * 4 - 5),
    ("(a + b) // c", 1),
])
def test_arithmetic(source, expected):
    assert evaluate(source, {"a": 3, "b": 4, "c": 5}) == expected


@pytest.mark.parametrize("source, expected", [
    ("a == 3", True), ("a != 3", False), ("a < b", True), ("a <= 3", True),
    ("a > b", False), ("b >= 5", False), ("a == b", False),
])
def test_comparisons(source, expected):
    assert evaluate(source, {"a": 3, "b": 4}) is expected


@pytest.mark.parametrize("source, expected", [
    ("0 <= a < b", True),
    ("0 <= a < b < 4", False),
    ("1 < 2 < 1", False),
    ("a < b > 1", True),
    ("3 == a == 3 != b", True),
])
def test_chained_comparisons(source, expected):
    assert evaluate(source, {"a": 3, "b": 4}) is expected


def test_chained_comparison_over_tensor_elements():
    x = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert evaluate("x[0] <= x[1] <= x[2]", {"x": x}) is True
    assert evaluate("x[0] <= x[2] <= x[1]", {"x": x}) is False


@pytest.mark.parametrize("source, expected", [
    ("a > 0 and b > 0", True),
    ("a > 0 and b < 0", False),
    ("a < 0 or b > 0", True),
    ("a < 0 or b < 0", False),
    ("not a", False),
    ("not (a < 0)", True),
    ("not a == 3 or b == 4", True),
])
def test_boolean_operators(source, expected):
    assert evaluate(source, {"a": 3, "b": 4}) is expected


def test_and_or_short_circuit():
    # x[10] would raise IndexError if it were evaluated
    x = torch.arange(3)
    assert evaluate("a == 3 or x[10] > 0", {"a": 3, "x": x}) is True
    assert evaluate("a == 4 and x[10] > 0", {"a": 3, "x": x}) is False
    with pytest.raises(IndexError):
        evaluate("a == 3 and x[10] > 0", {"a": 3, "x": x})


def test_indexing_and_slicing_tensors():
    x = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    m = torch.arange(6).reshape(2, 3)
    env = {"x": x, "m": m, "n": 4}
    assert evaluate("x[-1] == 10", env) is True
    assert evaluate("x[0] == 0 and x[1] == 3", env) is True
    assert torch.equal(evaluate("x[1:] - x[:-1]", env), torch.tensor([3, 0, 7], dtype=torch.int32))
    assert torch.equal(evaluate("x[::2]", env), torch.tensor([0, 3], dtype=torch.int32))
    assert evaluate("m[1, 2]", env) == 5
    assert torch.equal(evaluate("m[:, 0]", env), torch.tensor([0, 3]))
    assert evaluate("x[n - 1] == 10", env) is True


def test_shape_attribute():
    m = torch.zeros(2, 3)
    env = {"m": m, "rows": 2}
    assert evaluate("m.shape[0] == rows", env) is True
    assert evaluate("m.shape[1]", env) == 3
    assert evaluate("m.shape == (2, 3)", env) is True
    assert evaluate("m.shape[-1] * m.shape[0]", env) == 6


def test_shape_of_a_number_is_an_error():
    with pytest.raises(ValueError, match="has no shape"):
        evaluate("a.shape[0]", {"a": 3})


def test_item_returns_a_python_number():
    x = torch.tensor([0, 5, 9], dtype=torch.int32)
    value = evaluate("x[-1].item()", {"x": x})
    assert value == 9 and type(value) is int
    assert evaluate("n == x[-1].item()", {"x": x, "n": 9}) is True
    assert evaluate("n == x[-1].item()", {"x": x, "n": 8}) is False


def test_multi_element_comparison_is_an_error_not_a_silent_truth():
    x = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="expected one"):
        evaluate("x == x", {"x": x})
    with pytest.raises(ValueError, match="expected one"):
        evaluate("not x", {"x": x})


def test_cost_functions_when_allowed():
    x = torch.tensor([0, 2, 7, 11])
    env = {"x": x, "a": 3, "b": 8}
    assert evaluate("sum(x)", env, COST) == 20
    assert evaluate("sum(x[1:] - x[:-1])", env, COST) == 11
    assert evaluate("max(a, b)", env, COST) == 8
    assert evaluate("min(a, b, 1)", env, COST) == 1
    assert evaluate("max(x)", env, COST) == 11 and type(evaluate("max(x)", env, COST)) is int
    assert evaluate("min(x[1:])", env, COST) == 2
    expression = parse("sum(x) + max(a, b)", {"x", "a", "b"}, COST)
    assert expression.names == {"x", "a", "b"}  # function names are not free names


@pytest.mark.parametrize("source", ["sum(x)", "max(a, b)", "min(x)"])
def test_cost_functions_rejected_when_not_allowed(source):
    with pytest.raises(ValueError, match="allowed calls: .item\\(\\), none"):
        parse(source, {"x", "a", "b"})


def test_names_are_collected():
    assert parse("a + x[0] > b", {"a", "b", "x", "unused"}).names == {"a", "b", "x"}


@pytest.mark.parametrize("source, complaint", [
    ("__import__('os').system('x')", "calls"),
    ("().__class__.__bases__", "attribute"),
    ("x.__class__", "attribute '__class__'"),
    ("x.sum()", "calls x.sum"),
    ("x.sum", "attribute 'sum'"),
    ("x.dtype", "attribute 'dtype'"),
    ("x.item(1)", "calls"),
    ("x.item()()", "calls"),
    ("lambda: 1", "Lambda"),
    ("(lambda: 1)()", "calls lambda"),
    ("[i for i in x]", "ListComp"),
    ("{i for i in x}", "SetComp"),
    ("sum(i for i in x)", "GeneratorExp"),
    ("'abc'", "literal 'abc'"),
    ("b'abc'", "literal"),
    ("None", "literal None"),
    ("1j", "literal"),
    ("max(x, key=a)", "keyword"),
    ("f'{a}'", "JoinedStr"),
    ("(y := 1)", "NamedExpr"),
    ("a if a else 1", "IfExp"),
    ("[1, 2]", "List"),
    ("{1: 2}", "Dict"),
    ("x[...]", "literal Ellipsis"),
    ("sum(*x)", "Starred"),
    ("open('f')", "calls open"),
    ("getattr(x, 'shape')", "calls getattr"),
    ("import os", "does not parse"),
    ("a; b", "does not parse"),
    ("a ==", "does not parse"),
])
def test_rejects_constructs_before_running_anything(source, complaint):
    with pytest.raises(ValueError) as info:
        parse(source, {"a", "x"}, COST)
    assert complaint in str(info.value)


def test_rejected_code_never_runs(monkeypatch):
    import os
    calls = []
    monkeypatch.setattr(os, "system", lambda *args: calls.append(args))
    with pytest.raises(ValueError):
        evaluate("__import__('os').system('x')")
    assert calls == []


@pytest.mark.parametrize("source", [
    "10**10**10",
    "2 ** 100000",
    "((10**64)**64)**64",
    "(((((10**64)**64)**64)**64)**64)",
    "(1,) * 10**9",
    "m.shape * 10**9",
])
def test_huge_results_are_refused_before_they_are_computed(source):
    with pytest.raises(ValueError, match="too large|tuple"):  # computed, each would take minutes or all memory
        evaluate(source, {"m": torch.zeros(2, 3)})


@pytest.mark.parametrize("source, complaint", [
    ("-" * 100_000 + "1", "characters long"),  # was the parser's MemoryError
    ("-" * 4000 + "1", "nests deeper"),  # was a RecursionError building the tree
    ("1+" * 2000 + "1", "nests deeper"),  # parsed, then a RecursionError in the evaluator
    ("x" + "[0]" * 500, "nests deeper"),
    (f"({', 1' * 2_000_000})", "characters long"),  # was 3 GB and 15 s to parse, and as long to evaluate
])
def test_huge_or_deep_expressions_are_refused_before_they_run(source, complaint):
    with pytest.raises(ValueError, match=complaint):
        evaluate(source, {"x": torch.zeros(3)})


def test_nesting_as_deep_as_a_real_expression_still_evaluates():
    assert evaluate("(" * 40 + "1" + ")" * 40 + " + " + "-" * 40 + "1") == 2


def test_moderate_powers_still_work():
    assert evaluate("2 ** 64") == 18446744073709551616
    assert evaluate("(2 ** 8) ** 8") == 2 ** 64
    assert evaluate("2.0 ** 0.5") == pytest.approx(2 ** 0.5)


def test_unknown_names_are_rejected_at_parse_time():
    with pytest.raises(ValueError, match="unknown name\\(s\\) zz"):
        parse("a + zz", {"a"})
    with pytest.raises(ValueError, match="os"):
        parse("os", {"a"})


def test_missing_value_at_evaluation_time():
    expression = parse("a + b", {"a", "b"})
    with pytest.raises(ValueError, match="no value for 'b'"):
        expression.evaluate({"a": 1})


def test_min_and_max_of_several_values_with_a_tensor_go_element_by_element():
    """A cost counts, per request, the queries that see any key: the smaller of two lengths, request by request
    (Python's min compared the two tensors whole and raised)."""
    q, k = torch.tensor([4, 1, 3]), torch.tensor([1, 2, 3])
    assert parse("sum(min(q, k))", frozenset({"q", "k"}), frozenset({"min", "sum"})).evaluate({"q": q, "k": k}) == 5
    assert parse("sum(max(q, 2))", frozenset({"q"}), frozenset({"max", "sum"})).evaluate({"q": q}) == 9
    assert parse("min(3, 5)", frozenset(), frozenset({"min"})).evaluate({}) == 3
    # A tuple beside a tensor would be a tensor too, one no size check saw: a literal column of 800 `(0,)` against
    # a long index made 800 times the index (a reviewer: 3.9 GB for an index of 200,000).
    column = "(" + ",".join(["(0,)"] * 800) + ")"
    with pytest.raises(ValueError, match="max of a tensor and a tuple"):
        parse(f"sum(max(q, {column}))", frozenset({"q"}), frozenset({"max", "sum"})).evaluate({"q": q})


def test_min_and_max_of_an_empty_tensor_hold_vacuously():
    """A batch without requests, or a request without queries: `min(x) >= 0` and `max(x) < n` hold of no x
    (they raised, and a valid workload failed its own constraints)."""
    empty = torch.zeros(0, dtype=torch.int32)
    for source in ("min(x) >= -1 and max(x) < 4", "not (min(x) < 0)"):
        assert parse(source, frozenset({"x"}), frozenset({"min", "max"})).evaluate({"x": empty}) is True
    assert parse("min(x) >= 1", frozenset({"x"}), frozenset({"min"})).evaluate({"x": torch.tensor([0])}) is False



@pytest.mark.parametrize("source", [
    "min(c - x) >= 0",  # a column against a row: an outer product
    "c[:, :1] == x",
    "min(t[x]) >= 0",  # rows of a table gathered by an index longer than the table
])
def test_a_result_far_larger_than_the_tensors_given_is_refused_before_it_is_made(source):
    """Index tensors of a million entries each: it needed terabytes, and the judge died in the allocator."""
    env = {"x": torch.zeros(1 << 20, dtype=torch.int64), "c": torch.zeros(1 << 20, 1, dtype=torch.int64),
           "t": torch.zeros(1024, 4096, dtype=torch.int32)}
    with pytest.raises(ValueError, match="too large"):
        evaluate(source, env, COST)


def test_slices_arithmetic_and_gathers_within_what_is_given_still_evaluate():
    env = {"x": torch.arange(1 << 20), "t": torch.zeros(1 << 20, 2)}
    assert evaluate("min(x[1:] - x[:-1]) >= 1 and x[x[:4]][3] == 3 and t[x].shape[0] == 1048576", env, COST)
    assert evaluate("x[x[-1] - 1] == 1048574 and t[x[2], 1] == 0 and x[(x[3],)] == 3", env)


@pytest.mark.parametrize("source", [
    "x[-1] / z[0] > 1e30",  # a one-value tensor over zero is inf, as torch has it: the shape check read it as a
    "not (f[0] // g[0] < 0) and f[0] % g[0] != f[0] % g[0]",  # Python number and raised ZeroDivisionError
    "f[0] / z[0] > 1e30 and f[0] ** 44 > 1e30",  # Python's float pow raised OverflowError where torch gives inf
    "f[0] / 0 > 1e30 and not (g[0] ** -1 < 1)",
])
def test_one_value_tensors_divide_and_overflow_as_torch_does(source):
    env = {"x": torch.tensor([1, 2]), "z": torch.tensor([0]), "f": torch.tensor([2.0 ** 40]), "g": torch.tensor([0.0])}
    assert evaluate(source, env) is True


@pytest.mark.filterwarnings("ignore:indexing with dtype torch.uint8")
def test_indexing_reads_one_value_tensors_and_masks_as_torch_does():
    x, u = torch.arange(4), torch.tensor([1, 0, 1, 1], dtype=torch.uint8)
    env = {"x": x, "u": u, "b": torch.tensor(255, dtype=torch.uint8), "s": torch.tensor(7)}
    assert evaluate("x[u].shape[0] == 3 and x[b].shape == (1, 4) and s[()] == 7 and x[(u,)][2] == 3", env)
    with pytest.raises(IndexError, match="must be long, int, byte or bool"):
        evaluate("x[f]", {"x": x, "f": torch.tensor(1.0)})


def test_a_length_mismatch_names_the_sizes_as_torch_does():
    with pytest.raises(RuntimeError, match=r"size of tensor a \(3\) must match the size of tensor b \(4\)"):
        evaluate("min(x[1:] - y) >= 0", {"x": torch.arange(4), "y": torch.arange(4)}, COST)


def test_a_mask_beside_a_long_index_is_refused_before_it_is_made():
    """The mask's shape on "meta" needed its data (NotImplementedError), so the check was skipped: rows of a long
    index against every position a mask selects, their sizes' product (here 2^25; 2^32 for a million rows)."""
    env = {"c": torch.zeros(1 << 13, 1, dtype=torch.int64), "t": torch.zeros(16, 4096, dtype=torch.int32),
           "m": torch.ones(4096, dtype=torch.bool)}  # a bool input (a comparison gives one value, never a mask)
    with pytest.raises(ValueError, match="too large"):
        evaluate("min(t[c[:, :1], m]) >= 0", env, COST)
    assert evaluate("t[c[:4, :1], m].shape == (4, 4096) and t[m[:16]].shape[0] == 16 and t[:, m].shape[1] == 4096", env)


def test_inputs_on_meta_do_not_raise_the_bound():
    """`check_workload` makes random inputs on "meta": a workload's axis of 2^40 gave one of 2^40 elements, which
    held no memory yet let a real result of that many elements through."""
    env = {"x": torch.zeros(1 << 13, dtype=torch.int64), "c": torch.zeros(1 << 12, 1, dtype=torch.int64),
           "cache": torch.empty(1 << 40, dtype=torch.bfloat16, device="meta")}
    with pytest.raises(ValueError, match="too large"):
        evaluate("c[:, :1] == x", env)
    assert evaluate("(cache * 2).shape[0] == 1099511627776 and x[c[:, 0]].shape[0] == 4096", env)


def test_tuples_compared_item_by_item_are_bounded_too():
    """Python compares tuples by each pair's `==`: a column's against a row's is their sizes' product."""
    env = {"x": torch.zeros(1 << 13, dtype=torch.int64), "c": torch.zeros(1 << 12, 1, dtype=torch.int64)}
    with pytest.raises(ValueError, match="too large"):
        evaluate("(1, c) == (1, x)", env)
    assert evaluate("(x.shape[0], x[0]) == (8192, 0) and (c[0], x[:1]) == (c[1], x[1:2])", env)


@pytest.mark.parametrize("source", ["sum((c, x))[0, 0] == 0", "max(c, x) >= 0", "min((x, c)) >= 0",
                                    "sum((1, c, 2, x)) > 0"])
def test_sums_and_extremes_of_several_values_are_bounded_too(source):
    """sum adds its values one by one, min and max compare them: a column and a row made their sizes' product."""
    env = {"x": torch.zeros(1 << 13, dtype=torch.int64), "c": torch.zeros(1 << 12, 1, dtype=torch.int64)}
    with pytest.raises(ValueError, match="too large"):
        evaluate(source, env, COST)
    assert evaluate("sum((x[0], x[1], 3)) == 3 and max(x[0], 2, c[0, 0]) == 2 and min(x) == 0", env, COST)
