"""Binding concrete inputs to a definition: axes read off tensors, and every mismatch explained."""

import math
from pathlib import Path

import pytest
import torch

from flashbench import BindingError, Repo, bind_axes
from flashbench.binding import check_tensor, output_shapes

REPO = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
PREFILL = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"


@pytest.fixture(scope="module")
def decode():
    return Repo(REPO).definition(DECODE)


@pytest.fixture(scope="module")
def prefill():
    return Repo(REPO).definition(PREFILL)


def indptr(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def decode_inputs(kv_lens=(2, 0, 5), num_pages=9, heads=16):
    batch = len(kv_lens)
    return {
        "q_nope": torch.zeros(batch, heads, 512, dtype=torch.bfloat16),
        "q_pe": torch.zeros(batch, heads, 64, dtype=torch.bfloat16),
        "ckv_cache": torch.zeros(num_pages, 1, 512, dtype=torch.bfloat16),
        "kpe_cache": torch.zeros(num_pages, 1, 64, dtype=torch.bfloat16),
        "kv_indptr": indptr(kv_lens),
        "kv_indices": torch.arange(sum(kv_lens), dtype=torch.int32),
        "sm_scale": 1 / math.sqrt(576),
    }


def prefill_inputs(q_lens=(1, 3), kv_lens=(4, 3), num_pages=8):
    total_q = sum(q_lens)
    return {
        "q_nope": torch.zeros(total_q, 16, 512, dtype=torch.bfloat16),
        "q_pe": torch.zeros(total_q, 16, 64, dtype=torch.bfloat16),
        "ckv_cache": torch.zeros(num_pages, 1, 512, dtype=torch.bfloat16),
        "kpe_cache": torch.zeros(num_pages, 1, 64, dtype=torch.bfloat16),
        "qo_indptr": indptr(q_lens),
        "kv_indptr": indptr(kv_lens),
        "kv_indices": torch.arange(sum(kv_lens), dtype=torch.int32),
        "sm_scale": 0.1,
    }


def test_binds_var_axes_from_tensors(decode):
    axes = bind_axes(decode, decode_inputs(kv_lens=(2, 0, 5), num_pages=9))
    assert axes == {
        "num_qo_heads": 16, "head_dim_ckv": 512, "head_dim_kpe": 64, "page_size": 1,
        "batch_size": 3, "num_pages": 9, "len_indptr": 4, "num_kv_indices": 7,
    }
    assert output_shapes(decode, axes) == {"output": [3, 16, 512], "lse": [3, 16]}


def test_binds_prefill_axes(prefill):
    axes = bind_axes(prefill, prefill_inputs(q_lens=(1, 3), kv_lens=(4, 3)))
    assert axes["total_q"] == 4 and axes["len_indptr"] == 3 and axes["num_kv_indices"] == 7
    assert output_shapes(prefill, axes) == {"output": [4, 16, 512], "lse": [4, 16]}


def test_empty_batch_binds(decode):
    axes = bind_axes(decode, decode_inputs(kv_lens=(), num_pages=1))
    assert axes["batch_size"] == 0 and axes["num_kv_indices"] == 0


def test_wrong_const_axis(decode):
    with pytest.raises(BindingError, match="input q_nope: axis num_qo_heads is 8, but its const value says 16"):
        bind_axes(decode, decode_inputs(heads=8))


def test_wrong_const_axis_in_a_later_input(decode):
    inputs = decode_inputs()
    inputs["kpe_cache"] = torch.zeros(9, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(BindingError, match="input kpe_cache: axis head_dim_kpe is 32, but its const value says 64"):
        bind_axes(decode, inputs)


def test_inconsistent_axis_across_tensors(decode):
    inputs = decode_inputs(kv_lens=(2, 0, 5))
    inputs["q_pe"] = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(BindingError, match="input q_pe: axis batch_size is 2, but input q_nope says 3"):
        bind_axes(decode, inputs)


def test_inconsistent_pages(decode):
    inputs = decode_inputs(num_pages=9)
    inputs["kpe_cache"] = torch.zeros(10, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(BindingError, match="axis num_pages is 10, but input ckv_cache says 9"):
        bind_axes(decode, inputs)


@pytest.mark.parametrize("name, value, message", [
    ("q_nope", torch.zeros(3, 16, 512, dtype=torch.float32), "q_nope: expected dtype bfloat16, got float32"),
    ("kv_indptr", torch.tensor([0, 2, 2, 7], dtype=torch.int64), "kv_indptr: expected dtype int32, got int64"),
    ("kv_indices", torch.arange(7, dtype=torch.float16), "kv_indices: expected dtype int32, got float16"),
])
def test_wrong_dtype(decode, name, value, message):
    inputs = decode_inputs()
    inputs[name] = value
    with pytest.raises(BindingError, match=message):
        bind_axes(decode, inputs)


@pytest.mark.parametrize("name, shape", [
    ("q_nope", (3, 16, 512, 1)),
    ("q_pe", (3, 1024)),
    ("ckv_cache", (9, 512)),
])
def test_wrong_rank(decode, name, shape):
    inputs = decode_inputs()
    inputs[name] = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(BindingError, match=rf"input {name}: expected {len(decode.inputs[name].shape)} dims"):
        bind_axes(decode, inputs)


def test_scalar_given_as_tensor(decode):
    inputs = decode_inputs()
    inputs["sm_scale"] = torch.tensor(0.1)
    with pytest.raises(BindingError, match="input sm_scale: expected a Python scalar, got a tensor"):
        bind_axes(decode, inputs)


def test_tensor_given_as_list(decode):
    inputs = decode_inputs()
    inputs["kv_indptr"] = [0, 2, 2, 7]
    with pytest.raises(BindingError, match="kv_indptr: expected a tensor, got list"):
        bind_axes(decode, inputs)


def test_missing_input(decode):
    inputs = decode_inputs()
    del inputs["sm_scale"], inputs["kv_indices"]
    with pytest.raises(BindingError, match="missing input\\(s\\): kv_indices, sm_scale"):
        bind_axes(decode, inputs)


def test_constraint_failure_names_the_constraint(decode):
    inputs = decode_inputs(kv_lens=(2, 0, 5))
    inputs["kv_indices"] = torch.arange(6, dtype=torch.int32)  # kv_indptr[-1] is 7
    with pytest.raises(BindingError) as info:
        bind_axes(decode, inputs)
    message = str(info.value)
    assert "constraint 'num_kv_indices == kv_indptr[-1]' does not hold" in message
    assert "num_kv_indices=6" in message and "kv_indptr=[0, 2, 2, 7]" in message


def test_constraint_indptr_must_start_at_zero(decode):
    inputs = decode_inputs(kv_lens=(2, 0, 5))
    inputs["kv_indptr"] = torch.tensor([1, 3, 3, 7], dtype=torch.int32)
    inputs["kv_indices"] = torch.arange(7, dtype=torch.int32)
    with pytest.raises(BindingError, match=r"constraint 'kv_indptr\[0\] == 0' does not hold"):
        bind_axes(decode, inputs)


def test_constraint_on_indptr_length(decode):
    inputs = decode_inputs(kv_lens=(2, 0, 5))
    inputs["kv_indptr"] = torch.tensor([0, 2, 7], dtype=torch.int32)
    with pytest.raises(BindingError, match=r"constraint 'len_indptr == batch_size \+ 1' does not hold"):
        bind_axes(decode, inputs)


def test_prefill_constraints(prefill):
    inputs = prefill_inputs(q_lens=(1, 3))
    inputs["qo_indptr"] = torch.tensor([0, 1, 5], dtype=torch.int32)  # says 5 queries, q_nope has 4
    with pytest.raises(BindingError, match=r"constraint 'total_q == qo_indptr\[-1\]' does not hold"):
        bind_axes(prefill, inputs)
    inputs = prefill_inputs()
    inputs["qo_indptr"] = torch.tensor([1, 2, 4], dtype=torch.int32)
    with pytest.raises(BindingError, match=r"qo_indptr\[0\] == 0 and kv_indptr\[0\] == 0"):
        bind_axes(prefill, inputs)


def test_constraint_that_cannot_be_evaluated(prefill):
    inputs = prefill_inputs(q_lens=(), kv_lens=())
    inputs["qo_indptr"] = torch.zeros(0, dtype=torch.int32)  # qo_indptr[-1] is out of range
    inputs["kv_indptr"] = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(BindingError, match=r"constraint 'total_q == qo_indptr\[-1\]' cannot be evaluated"):
        bind_axes(prefill, inputs)


def test_output_shapes_need_every_axis(decode):
    with pytest.raises(BindingError, match="output output: axis batch_size is not bound"):
        output_shapes(decode, {"num_qo_heads": 16, "head_dim_ckv": 512})


def test_check_tensor_shape():
    check_tensor("x", torch.zeros(2, 3), "float32", [2, 3])
    with pytest.raises(BindingError, match=r"x: expected shape \[3, 2\], got \[2, 3\]"):
        check_tensor("x", torch.zeros(2, 3), "float32", [3, 2])


@pytest.mark.parametrize("constraint", ["max(kv_indptr, 0)", "min(kv_indices, num_pages)", "kv_indptr[1:]"])
def test_a_constraint_of_many_values_is_a_binding_error(decode, constraint):
    """min and max of a tensor and a number go element by element: a constraint so written gave a tensor, and
    `not holds` raised RuntimeError (a traceback in `validate`) where Python's max had raised inside evaluate."""
    definition = decode.model_copy(update={"constraints": [*decode.constraints, constraint]})
    with pytest.raises(BindingError, match="gives 4 values|gives 7 values|gives 3 values"):
        bind_axes(definition, decode_inputs(kv_lens=(2, 0, 5)))
