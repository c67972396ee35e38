"""Turning workloads into inputs: the paged_kv generator, length distributions, seeds, safetensors, the rules
captured index structure is held to."""

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError
from safetensors.torch import save_file

from flashbench import BindingError, Repo, Workload, bind_axes, generate_inputs, validate
from flashbench.errors import FlashbenchError
from flashbench.model import Lengths, PagedKV
from flashbench.model.workload import RandomInput
from flashbench.run.plan import refuse_invalid_workloads
from flashbench.workloads import GENERATORS, index_inputs, sample_lengths, structured_inputs
from flashbench.workloads.tensors import random_tensor

REPO = Path(__file__).resolve().parents[1]
DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
PREFILL = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"
SCALE = {"sm_scale": {"type": "scalar", "value": 0.0722}}


@pytest.fixture(scope="module")
def repo():
    return Repo(REPO)


@pytest.fixture(scope="module")
def decode(repo):
    return repo.definition(DECODE)


@pytest.fixture(scope="module")
def prefill(repo):
    return repo.definition(PREFILL)


def paged_kv(**spec):
    return PagedKV.model_validate({"generator": "paged_kv", **spec})


def generate(spec, seed=0):
    return GENERATORS["paged_kv"](spec, np.random.default_rng(seed))


def workload(uuid="0f1e2d3c-aaaa-bbbb-cccc-000000000001", inputs=None, **generator):
    return Workload.model_validate({
        "uuid": uuid, "inputs": SCALE if inputs is None else inputs,
        "generate": [{"generator": "paged_kv", **generator}],
    })


def assert_paged_structure(tensors, kv_lens, pool):
    indptr, indices = tensors["kv_indptr"], tensors["kv_indices"]
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int32
    assert indptr[0].item() == 0
    assert torch.equal(indptr[1:] - indptr[:-1], torch.tensor(kv_lens, dtype=torch.int32))
    assert indices.numel() == indptr[-1].item() == sum(kv_lens)
    assert indices.unique().numel() == indices.numel(), "pages are handed out once"
    assert indices.numel() == 0 or (indices.min() >= 0 and indices.max() < pool)


def test_decode_generator_structure():
    tensors, axes = generate(paged_kv(kv_lens={"distribution": "list", "values": [0, 1, 37, 5]}, page_pool=100))
    assert set(tensors) == {"kv_indptr", "kv_indices"}
    assert axes == {"batch_size": 4, "num_pages": 100}
    assert_paged_structure(tensors, [0, 1, 37, 5], 100)
    assert not torch.equal(tensors["kv_indices"].sort().values, tensors["kv_indices"]), "pages are not in order"


def test_prefill_generator_structure():
    spec = paged_kv(q_lens={"distribution": "list", "values": [1, 7, 12, 3]},
                    prefix_lens={"distribution": "list", "values": [0, 5, 20, 0]}, page_pool=64)
    tensors, axes = generate(spec)
    assert set(tensors) == {"qo_indptr", "kv_indptr", "kv_indices"}
    assert axes == {"total_q": 23, "num_pages": 64}
    assert torch.equal(tensors["qo_indptr"], torch.tensor([0, 1, 8, 20, 23], dtype=torch.int32))
    assert_paged_structure(tensors, [1, 12, 32, 3], 64)


def test_prefill_without_prefix_has_kv_equal_to_queries():
    tensors, _ = generate(paged_kv(q_lens={"distribution": "fixed", "count": 3, "value": 4}))
    assert torch.equal(tensors["qo_indptr"], tensors["kv_indptr"])


def test_default_pool_is_just_enough():
    tensors, axes = generate(paged_kv(kv_lens={"distribution": "list", "values": [3, 4]}))
    assert axes["num_pages"] == 7
    assert sorted(tensors["kv_indices"].tolist()) == list(range(7))


def test_all_empty_requests_still_have_a_page():
    tensors, axes = generate(paged_kv(kv_lens={"distribution": "fixed", "count": 3, "value": 0}))
    assert axes == {"batch_size": 3, "num_pages": 1}
    assert tensors["kv_indices"].numel() == 0 and tensors["kv_indptr"].tolist() == [0, 0, 0, 0]


def test_page_pool_smaller_than_total_is_a_clear_error():
    with pytest.raises(ValueError, match="page_pool 10 is smaller than the 12 KV tokens"):
        generate(paged_kv(kv_lens={"distribution": "list", "values": [5, 7]}, page_pool=10))


def test_page_pool_error_through_generate_inputs(decode):
    w = workload(kv_lens={"distribution": "list", "values": [5, 7]}, page_pool=10)
    with pytest.raises(BindingError, match=r"generate\[0\] \(paged_kv\): page_pool 10 is smaller"):
        generate_inputs(decode, w, seed=0)


def test_prefix_count_must_match_queries():
    spec = paged_kv(q_lens={"distribution": "list", "values": [1, 2]},
                    prefix_lens={"distribution": "list", "values": [3]})
    with pytest.raises(ValueError, match="prefix_lens gives 1 requests but q_lens gives 2"):
        generate(spec)


@pytest.mark.parametrize("spec, message", [
    ({}, "exactly one of kv_lens"),
    ({"kv_lens": {"distribution": "list", "values": [1]}, "q_lens": {"distribution": "list", "values": [1]}},
     "exactly one of kv_lens"),
    ({"kv_lens": {"distribution": "list", "values": [1]}, "prefix_lens": {"distribution": "list", "values": [1]}},
     "prefix_lens needs q_lens"),
    ({"kv_lens": {"distribution": "list", "values": [1]}, "page_pool": 0}, "greater than 0"),
])
def test_paged_kv_spec_validation(spec, message):
    with pytest.raises(ValidationError, match=message):
        paged_kv(**spec)


def lengths(**spec):
    return Lengths.model_validate(spec)


def test_list_and_fixed_lengths():
    rng = np.random.default_rng(0)
    values = sample_lengths(lengths(distribution="list", values=[3, 0, 9]), rng)
    assert values.dtype == np.int64 and values.tolist() == [3, 0, 9]
    assert sample_lengths(lengths(distribution="fixed", count=4, value=7), rng).tolist() == [7, 7, 7, 7]


def test_uniform_lengths_cover_both_bounds():
    values = sample_lengths(lengths(distribution="uniform", count=2000, low=3, high=6), np.random.default_rng(1))
    assert values.dtype == np.int64 and len(values) == 2000
    assert set(values.tolist()) == {3, 4, 5, 6}


@pytest.mark.parametrize("spec", [
    {"distribution": "normal", "count": 500, "mean": 100, "std": 80, "low": 50, "high": 150},
    {"distribution": "normal", "count": 50, "mean": -1000, "std": 1, "low": 1, "high": 10},
    {"distribution": "normal", "count": 50, "mean": 1e6, "std": 1, "low": 1, "high": 10},
    {"distribution": "skewed", "count": 500, "median": 600, "sigma": 1.5, "low": 500, "high": 5000},
    {"distribution": "uniform", "count": 500, "low": 0, "high": 0},
])
def test_lengths_are_clipped_to_low_high(spec):
    values = sample_lengths(lengths(**spec), np.random.default_rng(2))
    assert values.dtype == np.int64 and len(values) == spec["count"]
    assert values.min() >= spec["low"] and values.max() <= spec["high"]


def test_clipping_hits_the_bounds():
    below = sample_lengths(lengths(distribution="normal", count=20, mean=-50, std=1, low=2, high=9), np.random.default_rng(0))
    above = sample_lengths(lengths(distribution="skewed", count=20, median=1e5, sigma=0.1, low=2, high=9), np.random.default_rng(0))
    assert below.tolist() == [2] * 20 and above.tolist() == [9] * 20


def test_skewed_lengths_have_a_long_tail():
    values = sample_lengths(lengths(distribution="skewed", count=4000, median=100, sigma=1.0, low=1, high=100000),
                            np.random.default_rng(3))
    assert 80 <= np.median(values) <= 120
    assert values.mean() > 1.3 * np.median(values)


@pytest.mark.parametrize("spec, message", [
    ({"distribution": "list"}, "needs 'values'"),
    ({"distribution": "uniform", "low": 1, "high": 4}, "needs 'count' > 0"),
    ({"distribution": "uniform", "count": 3, "low": 5, "high": 4}, "low <= high"),
    ({"distribution": "normal", "count": 3, "mean": 5, "std": 1}, "needs 'high'"),
    ({"distribution": "skewed", "count": 3, "median": 5}, "needs 'high'"),
    ({"distribution": "poisson", "count": 3}, "'poisson'"),
    ({"distribution": "fixed", "count": 3, "value": -1}, "greater than or equal to 0"),
    ({"distribution": "list", "values": [5, -3, 4]}, "greater than or equal to 0"),  # every pair PASSED on it
])
def test_lengths_validation(spec, message):
    with pytest.raises(ValidationError, match=message):
        lengths(**spec)


DECODE_VARIABLE = {"kv_lens": {"distribution": "uniform", "count": 6, "low": 0, "high": 40}, "page_pool": 300}


def test_generated_decode_inputs_satisfy_the_definition(decode):
    inputs = generate_inputs(decode, workload(**DECODE_VARIABLE), seed=0)
    axes = bind_axes(decode, inputs)
    assert axes["batch_size"] == 6 and axes["num_pages"] == 300
    assert axes["len_indptr"] == axes["batch_size"] + 1
    assert axes["num_kv_indices"] == inputs["kv_indptr"][-1].item()
    assert inputs["sm_scale"] == pytest.approx(0.0722) and isinstance(inputs["sm_scale"], float)
    assert inputs["q_nope"].dtype == torch.bfloat16 and inputs["q_nope"].std().item() > 0.5
    assert_paged_structure(inputs, (inputs["kv_indptr"][1:] - inputs["kv_indptr"][:-1]).tolist(), 300)


def test_generated_prefill_inputs_satisfy_the_definition(prefill):
    w = workload(q_lens={"distribution": "uniform", "count": 5, "low": 1, "high": 9},
                 prefix_lens={"distribution": "uniform", "count": 5, "low": 0, "high": 20})
    inputs = generate_inputs(prefill, w, seed=4)
    axes = bind_axes(prefill, inputs)
    q_lens = inputs["qo_indptr"][1:] - inputs["qo_indptr"][:-1]
    kv_lens = inputs["kv_indptr"][1:] - inputs["kv_indptr"][:-1]
    assert axes["total_q"] == q_lens.sum().item() == inputs["q_nope"].shape[0]
    assert torch.all(kv_lens >= q_lens)
    assert axes["num_pages"] == kv_lens.sum().item()


def test_same_seed_gives_identical_inputs(decode):
    first = generate_inputs(decode, workload(**DECODE_VARIABLE), seed=11)
    second = generate_inputs(decode, workload(**DECODE_VARIABLE), seed=11)
    assert first.keys() == second.keys()
    for name, value in first.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, second[name]), name
        else:
            assert value == second[name]


def test_different_seeds_change_data_but_not_index_structure(decode):
    first = generate_inputs(decode, workload(**DECODE_VARIABLE), seed=1)
    second = generate_inputs(decode, workload(**DECODE_VARIABLE), seed=2)
    for name in ("kv_indptr", "kv_indices"):
        assert torch.equal(first[name], second[name]), name
    for name in ("q_nope", "q_pe", "ckv_cache", "kpe_cache"):
        assert first[name].shape == second[name].shape
        assert not torch.equal(first[name], second[name]), name
    assert not torch.equal(first["q_nope"], first["q_pe"][..., :1].expand_as(first["q_nope"]))


def test_inputs_of_one_workload_are_independent(decode):
    inputs = generate_inputs(decode, workload(**DECODE_VARIABLE), seed=1)
    assert not torch.equal(inputs["q_nope"][..., :64], inputs["q_pe"])


def test_different_workloads_get_different_structure(decode):
    first = generate_inputs(decode, workload(uuid="aaaaaaaa-0001", **DECODE_VARIABLE), seed=1)
    second = generate_inputs(decode, workload(uuid="aaaaaaaa-0002", **DECODE_VARIABLE), seed=1)
    assert not torch.equal(first["kv_indices"], second["kv_indices"]) or \
        not torch.equal(first["kv_indptr"], second["kv_indptr"])


def test_meta_device_keeps_indices_real(decode):
    inputs = generate_inputs(decode, workload(**DECODE_VARIABLE), seed=0, device="meta")
    assert inputs["q_nope"].device.type == "meta"
    assert inputs["kv_indptr"].device.type == "cpu" and inputs["kv_indices"].device.type == "cpu"


def test_workload_axes_must_agree_with_generated_inputs(decode):
    w = Workload.model_validate({
        "uuid": "bbbbbbbb-0001", "axes": {"batch_size": 5}, "inputs": SCALE,
        "generate": [{"generator": "paged_kv", "kv_lens": {"distribution": "list", "values": [1, 2]}}],
    })
    with pytest.raises(BindingError, match="axes.batch_size is 5 in the workload but the inputs give 2"):
        generate_inputs(decode, w, seed=0)


def test_scalar_input_needs_a_value(decode):
    w = workload(inputs={}, kv_lens={"distribution": "list", "values": [1]})
    with pytest.raises(BindingError, match="input sm_scale is a scalar"):
        generate_inputs(decode, w, seed=0)


def test_random_input_needs_its_axes(decode):
    w = Workload.model_validate({"uuid": "cccccccc-0001", "inputs": SCALE})
    with pytest.raises(BindingError, match="input q_nope needs axis batch_size"):
        generate_inputs(decode, w, seed=0)


def test_a_uuid_is_at_most_a_file_name_long():
    """export-fib --index-blobs names a blob <uuid>.safetensors: a uuid of 300 characters passed and the export
    ended with ENAMETOOLONG."""
    assert Workload.model_validate({"uuid": "u" * 128}).uuid == "u" * 128
    with pytest.raises(ValidationError, match="at most 128 characters"):
        Workload.model_validate({"uuid": "u" * 300})


def test_uniform_random_inputs(decode):
    w = workload(inputs={**SCALE, "q_pe": {"type": "random", "distribution": "uniform", "low": 2, "high": 3}},
                 kv_lens={"distribution": "list", "values": [4, 4]})
    q_pe = generate_inputs(decode, w, seed=0)["q_pe"].float()
    assert q_pe.min() >= 2 and q_pe.max() <= 3


@pytest.mark.parametrize("spec, dtype", [
    ({"type": "random", "distribution": "uniform", "low": 2, "high": 3}, torch.bfloat16),
    ({"type": "random", "mean": 5.0, "std": 0.5}, torch.float32),
    ({"type": "random", "low": 0, "high": 7}, torch.int32),
])
def test_a_whole_refill_draws_every_element_in_place_by_its_seed(spec, dtype):
    from flashbench.model.workload import RandomInput
    from flashbench.workloads.tensors import refill_random
    spec = RandomInput.model_validate(spec)
    drawn = [torch.full((64, 32), -1, dtype=dtype) for _ in range(3)]
    buffers = [t.data_ptr() for t in drawn]
    for tensor, seed in zip(drawn, (11, 11, 12)):
        refill_random(tensor, spec, seed, torch.Generator())
    assert [t.data_ptr() for t in drawn] == buffers  # in place
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])
    values = drawn[0].double()
    assert not (values == -1).any()
    if spec.distribution == "uniform":
        assert values.min() >= 2 and values.max() <= 3
    elif dtype.is_floating_point:
        assert abs(values.mean().item() - 5.0) < 0.1 and abs(values.std().item() - 0.5) < 0.1
    else:
        assert values.min() >= 0 and values.max() < 7


def test_repo_workload_files_validate(repo):
    results = validate(repo, [REPO / "definitions"])
    kinds = [c.kind for c in results]
    assert kinds.count("definition") == len(repo.names())
    assert kinds.count("workloads") == len(repo.names())  # every definition ships a workload set
    assert [c.error for c in results if not c.ok] == []


def test_repo_smoke_workloads_generate_on_cpu(repo):
    for name in (DECODE, PREFILL):
        definition = repo.definition(name)
        for w in repo.workload_set(name).workloads:
            if "smoke" in w.tags:
                bind_axes(definition, generate_inputs(definition, w, seed=0))


@pytest.fixture
def root(tmp_path):
    shutil.copytree(REPO / "definitions", tmp_path / "definitions")
    shutil.copytree(REPO / "references", tmp_path / "references")
    return tmp_path


def edit_workloads(root, name, edit):
    path = root / "definitions" / "mla_paged" / f"{name}.workloads.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["workloads"][1]["generate"][0].update(page_pool=3), "page_pool 3 is smaller"),
    (lambda d: d["workloads"][1].update(axes={"num_qo_heads": 16}), "axes.num_qo_heads: not a var axis"),
    (lambda d: d["workloads"][1]["inputs"].update(scale={"type": "scalar", "value": 1}), "inputs.scale: not an input"),
    (lambda d: d["workloads"][1].update(uuid=d["workloads"][0]["uuid"]), "appears twice"),
    # two rows by one name on every board, and `--workload NAME` picked both
    (lambda d: d["workloads"][1].update(name=d["workloads"][0]["name"]), "workloads[1].name: smoke_empty_short appears"),
    (lambda d: d["workloads"][1].update(name=d["workloads"][0]["uuid"]), "is another workload's uuid"),
    (lambda d: d["workloads"][0].update(name=d["workloads"][1]["uuid"]), "workloads[1].uuid: 810323f4-6465-4c15-a87f"),
    # validate itself ended in a traceback on a negative axis
    (lambda d: d["workloads"][1].update(axes={"batch_size": -1}), "greater than or equal to 0"),
    (lambda d: d["workloads"][1]["inputs"].update(kv_indptr={"type": "safetensors", "path": "nope.safetensors",
                                                           "tensor_key": "x"}), "inputs.kv_indptr: a generator"),
    (lambda d: d["workloads"][1].update(axes={"batch_size": 4, "num_pages": 9}, generate=[], inputs={
        **d["workloads"][1]["inputs"],
        "kv_indptr": {"type": "safetensors", "path": "nope.safetensors", "tensor_key": "x"}}), "does not exist"),
    # a malformed blob, and a page pool past any memory, ended validate in a traceback
    (lambda d: d["workloads"][1].update(axes={"batch_size": 4, "num_pages": 9}, generate=[], inputs={
        **d["workloads"][1]["inputs"],
        "kv_indptr": {"type": "safetensors", "path": "garbage.safetensors", "tensor_key": "x"}}),
     "cannot be read as safetensors"),
    (lambda d: d["workloads"][1]["generate"][0].update(kv_lens={"distribution": "fixed", "count": 10 ** 12,
                                                                "value": 1}), "lengths takes 16,000,000,000,000 bytes to make"),
    (lambda d: d["workloads"][1]["generate"][0].update(page_pool=10 ** 12), "less than or equal to 2147483648"),
])
def test_validate_reports_bad_workloads(root, edit, message):
    (root / "definitions" / "mla_paged" / "garbage.safetensors").write_bytes(b"\xff" * 64)
    path = edit_workloads(root, DECODE, edit)
    results = {c.path: c for c in validate(Repo(root), [root / "definitions" / "mla_paged"])}
    assert not results[path].ok
    assert str(path) in results[path].error and message in results[path].error
    assert sum(not c.ok for c in results.values()) == 1



def test_a_workload_may_be_named_by_its_own_uuid(root):
    path = edit_workloads(root, DECODE, lambda d: d["workloads"][1].update(name=d["workloads"][1]["uuid"]))
    assert {c.path: c for c in validate(Repo(root), [root / "definitions" / "mla_paged"])}[path].ok


def test_a_workload_file_with_yaml_aliases_is_refused_before_it_is_built(root):
    """Nested aliases let 735 bytes stand for more than any memory: validate grew until it ran out."""
    path = root / "definitions" / "mla_paged" / f"{DECODE}.workloads.yaml"
    path.write_text(path.read_text() + "x0: &a [1, 1]\nx1: [*a, *a]\n")
    results = {c.path: c for c in validate(Repo(root), [root / "definitions" / "mla_paged"])}
    assert not results[path].ok and "a YAML alias" in results[path].error


# Captured tensors, the way FlashInfer-Bench datasets store index tensors.

def captured_workload(blob_path: str, **keys):
    inputs = {**SCALE}
    for name, key in keys.items():
        inputs[name] = {"type": "safetensors", "path": blob_path, "tensor_key": key}
    return Workload.model_validate({"uuid": "dddddddd-0001", "axes": {"batch_size": 3, "num_pages": 16},
                                    "inputs": inputs})


def test_safetensors_inputs_load(decode, tmp_path):
    indptr = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    indices = torch.tensor([9, 3, 15, 0, 4, 11, 8], dtype=torch.int32)
    q_pe = torch.randn(3, 16, 64).bfloat16()
    (tmp_path / "blob").mkdir()
    save_file({"indptr": indptr, "indices": indices, "q_pe": q_pe}, str(tmp_path / "blob" / "b.safetensors"))
    w = captured_workload("blob/b.safetensors", kv_indptr="indptr", kv_indices="indices", q_pe="q_pe")
    inputs = generate_inputs(decode, w, seed=0, base_dir=tmp_path)
    assert torch.equal(inputs["kv_indptr"], indptr) and torch.equal(inputs["kv_indices"], indices)
    assert torch.equal(inputs["q_pe"], q_pe)
    assert inputs["ckv_cache"].shape == (16, 1, 512)
    assert bind_axes(decode, inputs)["num_kv_indices"] == 7


def test_safetensors_wrong_dtype_is_rejected(decode, tmp_path):
    save_file({"indptr": torch.tensor([0, 2, 2, 7], dtype=torch.int64)}, str(tmp_path / "b.safetensors"))
    w = captured_workload("b.safetensors", kv_indptr="indptr")
    with pytest.raises(ValueError, match="indptr is int64, the definition says int32"):
        generate_inputs(decode, w, seed=0, base_dir=tmp_path)


def test_safetensors_missing_key_lists_keys(decode, tmp_path):
    save_file({"indptr": torch.tensor([0, 2, 2, 7], dtype=torch.int32)}, str(tmp_path / "b.safetensors"))
    w = captured_workload("b.safetensors", kv_indptr="indptr", kv_indices="indices")
    with pytest.raises(ValueError, match=r"has no tensor 'indices' \(keys: indptr\)"):
        generate_inputs(decode, w, seed=0, base_dir=tmp_path)


def test_safetensors_that_break_a_constraint(decode, tmp_path):
    save_file({"indptr": torch.tensor([0, 2, 2, 7], dtype=torch.int32),
               "indices": torch.arange(6, dtype=torch.int32)}, str(tmp_path / "b.safetensors"))
    w = captured_workload("b.safetensors", kv_indptr="indptr", kv_indices="indices")
    with pytest.raises(BindingError, match=r"num_kv_indices == kv_indptr\[-1\]"):
        generate_inputs(decode, w, seed=0, base_dir=tmp_path)


def test_validate_resolves_safetensors_next_to_the_workload_file(root):
    blob = root / "definitions" / "mla_paged" / "blob"
    blob.mkdir()
    save_file({"indptr": torch.tensor([0, 2, 2, 7], dtype=torch.int32),
               "indices": torch.tensor([9, 3, 15, 0, 4, 11, 8], dtype=torch.int32)}, str(blob / "b.safetensors"))

    def edit(data):
        data["workloads"] = [{
            "uuid": "eeeeeeee-0001", "axes": {"batch_size": 3, "num_pages": 16},
            "inputs": {**SCALE,
                       "kv_indptr": {"type": "safetensors", "path": "blob/b.safetensors", "tensor_key": "indptr"},
                       "kv_indices": {"type": "safetensors", "path": "blob/b.safetensors", "tensor_key": "indices"}},
        }]
    path = edit_workloads(root, DECODE, edit)
    results = {c.path: c for c in validate(Repo(root), [root / "definitions" / "mla_paged"])}
    assert results[path].ok, results[path].error


def test_validate_reports_every_invalid_workload_of_a_file(root):
    """A file with several invalid workloads gave only the first: one fixing it found the next on the next run."""
    def edit(data):
        data["workloads"][1]["generate"][0].update(page_pool=3)
        data["workloads"][2].update(axes={"batch_size": -1})  # the schema's: the others are checked all the same
        data["workloads"][4]["inputs"].update(scale={"type": "scalar", "value": 1})
    path = edit_workloads(root, DECODE, edit)
    labels = [w["name"] for w in yaml.safe_load(path.read_text())["workloads"]]
    (checked,) = validate(Repo(root), [path])
    assert [e.split(": ")[:2] for e in checked.errors] == [[str(path), f"workloads[1] ({labels[1]})"],
                                                         [str(path), "workloads[2]"],
                                                         [str(path), f"workloads[4] ({labels[4]})"]]
    assert "page_pool 3 is smaller" in checked.errors[0]
    assert "axes.batch_size: Input should be greater than or equal to 0" in checked.errors[1]
    assert "inputs.scale: not an input" in checked.errors[2]
    assert validate(Repo(root), [path.with_name(f"{PREFILL}.workloads.yaml")])[0].errors == ()  # a valid file: as before


def decode_with_kv_indices(indices: dict):
    """A decode workload of three requests (7 keys) whose kv_indptr is captured and kv_indices as given."""
    return {"uuid": "eeeeeeee-0002", "name": "odd", "axes": {"batch_size": 3, "num_pages": 16, "num_kv_indices": 7},
            "inputs": {**SCALE, "kv_indptr": {"type": "safetensors", "path": "blob.safetensors", "tensor_key": "indptr"},
                       "kv_indices": indices}}


CAPTURED = {"type": "safetensors", "path": "blob.safetensors", "tensor_key": "indices"}


@pytest.mark.parametrize("indices, message", [
    # an integer range past its dtype, and bounds torch.randint would truncate to an empty range
    ({"type": "random", "low": 0, "high": 2**40}, "inputs.kv_indices: high 1099511627776 is past the int32 range"),
    ({"type": "random", "low": -2**31 - 1, "high": 4}, "inputs.kv_indices: low -2147483649 is below the least int32"),
    ({"type": "random", "low": 0.2, "high": 0.7}, "inputs.kv_indices: a random int32 input needs whole numbers"),
    # a captured page index past the cache: the reference failed on it
    (CAPTURED, "max(kv_indices) < num_pages)' does not hold"),
])
def test_validate_refuses_what_could_only_fail_at_run_time(root, indices, message):
    folder = root / "definitions" / "mla_paged"
    save_file({"indptr": torch.tensor([0, 2, 2, 7], dtype=torch.int32),
               "indices": torch.tensor([9, 3, 15, 0, 4, 11, 16], dtype=torch.int32)}, str(folder / "blob.safetensors"))
    path = edit_workloads(root, DECODE, lambda d: d["workloads"].append(decode_with_kv_indices(indices)))
    (checked,) = validate(Repo(root), [path])
    (error,) = checked.errors
    assert error.startswith(f"{path}: workloads[{len(yaml.safe_load(path.read_text())['workloads']) - 1}] (odd): ")
    assert message in error


def test_integer_ranges_are_checked_alike_when_drawn(decode, tmp_path):
    """The rule validate applies on "meta" is the one drawing applies: the run's inputs fail as validate does."""
    save_file({"indptr": torch.tensor([0, 2, 2, 7], dtype=torch.int32)}, str(tmp_path / "blob.safetensors"))
    odd = Workload.model_validate(decode_with_kv_indices({"type": "random", "low": 0, "high": 2**40}))
    for device in ("meta", "cpu"):
        with pytest.raises(BindingError, match="inputs.kv_indices: high 1099511627776 is past the int32 range"):
            generate_inputs(decode, odd, seed=0, device=device, base_dir=tmp_path)
    whole = Workload.model_validate(decode_with_kv_indices({"type": "random", "low": 0, "high": 2**31}))
    with pytest.raises(BindingError, match="max\\(kv_indices\\) < num_pages"):  # in range of its dtype, past the cache
        generate_inputs(decode, whole, seed=0, device="cpu", base_dir=tmp_path)


@pytest.mark.parametrize("folder, name, generator", [
    ("flashmla_decode", "flashmla_decode_causal_h16_ckv512_kpe64_ps64", "block_table"),
    ("flashmla_sparse", "flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048", "sparse_decode_indices"),
    ("flashmla_sparse", "flashmla_sparse_fp8_dequantize_ckv512_kpe64_ps64", "fp8_kv_cache"),
])
def test_validate_refuses_a_block_size_other_than_the_definitions_page_size(root, folder, name, generator):
    """A block table of 128-token blocks bound to a definition of 64-token pages, and ran on keys it never laid out."""
    path = root / "definitions" / folder / f"{name}.workloads.yaml"
    data = yaml.safe_load(path.read_text())
    data["workloads"][0]["generate"][0]["block_size"] = 128
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    (checked,) = validate(Repo(root), [path])
    (error,) = checked.errors
    assert error.startswith(f"{path}: workloads[0] ({data['workloads'][0]['name']}): generate[0] ({generator}): ")
    assert error.endswith("makes page_block_size 128, but the definition fixes it at 64")


def test_a_calls_window_starts_follow_the_batch_and_its_own_seed():
    from flashbench.workloads import window_starts
    spans = {"ckv_cache": 10**6, "q_nope": 0}
    first = window_starts(123, [456, 789], spans)
    assert first == window_starts(123, [456, 789], spans)  # the worker's and the judge's alike
    assert first["q_nope"] == [0, 0] and all(0 <= start <= 10**6 for start in first["ckv_cache"])
    assert window_starts(123, [457, 789], spans)["ckv_cache"][0] != first["ckv_cache"][0]
    assert window_starts(124, [456, 789], spans)["ckv_cache"] != first["ckv_cache"]


def test_only_inputs_drawn_around_zero_may_have_their_signs_flipped():
    """Flipping a query's column signs keeps a zero-mean draw as it was; probabilities in [0, 1) would turn
    negative (an imported sampling definition's reference refused them)."""
    from flashbench.model.workload import RandomInput
    from flashbench.workloads.tensors import symmetric
    assert symmetric(RandomInput(type="random"))
    assert symmetric(RandomInput(type="random", distribution="uniform", low=-2.0, high=2.0))
    assert not symmetric(RandomInput(type="random", distribution="uniform"))
    assert not symmetric(RandomInput(type="random", mean=1.0))


def test_only_normal_draws_about_zero_may_be_scaled():
    """A call without a query scales such an input by a factor in [1, 2): a normal about zero stays one; a
    uniform range would move its bounds (values in [-1, 1) could reach 2)."""
    from flashbench.model.workload import RandomInput
    from flashbench.workloads.tensors import scalable
    assert scalable(RandomInput(type="random", std=3.0))
    assert not scalable(RandomInput(type="random", distribution="uniform", low=-1.0, high=1.0))
    assert not scalable(RandomInput(type="random", mean=1.0))


@pytest.mark.parametrize("where", ["sm_scale", "random"])
def test_validate_refuses_nan_in_a_workload(root, where):
    """A NaN sm_scale passed validate and failed every pair, the reference's included."""
    def edit(data):
        inputs = data["workloads"][0]["inputs"]
        if where == "sm_scale":
            inputs["sm_scale"] = {"type": "scalar", "value": "NAN"}
        else:
            inputs["q_pe"] = {"type": "random", "mean": "NAN"}
    path = edit_workloads(root, DECODE, edit)
    path.write_text(path.read_text().replace("'NAN'", ".nan"))
    (checked,) = validate(Repo(root), [path])
    (error,) = checked.errors
    assert error.startswith(f"{path}: workloads[0]") and "NaN is no value" in error


@pytest.mark.parametrize("uuid", ["../../../../etc/x", "..-escape", "with/slash", "a b c d e f"])
def test_a_workload_uuid_that_is_no_plain_name_is_refused(uuid):
    """Exports name files after it: a uuid with `..` ended `export-fib --index-blobs` with a traceback."""
    with pytest.raises(ValidationError, match="uuid"):
        Workload.model_validate({"uuid": uuid})


@pytest.mark.parametrize("spec", [RandomInput(type="random", mean=0.5, std=3.0),
                                  RandomInput(type="random", distribution="uniform", low=-2.0, high=7.0)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_random_tensor_holds_the_values_the_out_of_place_formula_gives(spec, dtype):
    """It scales and shifts in place (the windows' redraw on a CPU is a step the judge times and subtracts:
    temporaries made it dearer than a worker's own rewrite); the values, so every `--seed`'s data, are those of
    the formula it replaced."""
    made = random_tensor(spec, [4096], dtype, seed=7, device="cpu")
    generator = torch.Generator().manual_seed(7)
    if spec.distribution == "uniform":
        formula = torch.rand([4096], generator=generator) * (spec.high - spec.low) + spec.low
    else:
        formula = torch.randn([4096], generator=generator) * spec.std + spec.mean
    assert torch.equal(made, formula.to(made.dtype))


# Captured index structure: what the generator that makes such inputs makes (generators.INDEX_RULES), whatever the
# definition's constraints say. They bound values, and let a -1 among a request's blocks or offsets that go down
# through: the reference and every solution then read garbage.

_fuzz_spec = importlib.util.spec_from_file_location("fuzz_workloads", REPO / "benchmarks" / "fuzz_workloads.py")
fuzz = importlib.util.module_from_spec(_fuzz_spec)
_fuzz_spec.loader.exec_module(fuzz)
FUZZ_EMPTY = {DECODE: "decode", PREFILL: "prefill", "mha_varlen_prefill_causal_h128_dqk128_dv128": "varlen",
              "mha_varlen_prefill_causal_h128_dqk192_dv128": "varlen"}


def captured_set(root: Path, name: str, workloads: list[Workload], corrupt=None) -> Path:
    """The workload file of `name` under `root`, now holding `workloads` with the integer tensors their generators
    make captured instead (blob<i>.safetensors beside it; `corrupt(tensors)` edits them first); what they make
    of floating point is left to the default draw."""
    repo = Repo(root)
    definition, path = repo.definition(name), repo.workloads_path(name)
    records = []
    for i, workload in enumerate(workloads):
        made, axes = structured_inputs(workload, "cpu", seed=0)
        tensors = {key: value for key, value in made.items() if not value.is_floating_point()}
        if corrupt:
            corrupt(tensors)
        save_file(tensors, str(path.parent / f"blob{i}.safetensors"))
        blobs = {key: {"type": "safetensors", "path": f"blob{i}.safetensors", "tensor_key": key} for key in tensors}
        given = {key: value.model_dump(exclude_defaults=True) for key, value in workload.inputs.items()}
        records.append({"uuid": workload.uuid, "name": workload.name, "inputs": {**given, **blobs},
                        "axes": {**{a: v for a, v in axes.items() if a in definition.var_axes}, **workload.axes}})
    data = yaml.safe_load(path.read_text())
    data["workloads"] = records
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def named(root: Path, name: str, workload: str) -> Workload:
    return next(w for w in Repo(root).workload_set(name).workloads if w.name == workload)


@pytest.mark.parametrize("name", Repo(REPO).names())
def test_the_structure_a_generator_makes_is_valid_captured(root, name):
    """Every smoke workload and the sweep's empty batch (requests with no query or no key, trailing, scattered and
    mixed invalid sparse entries, queries with none valid, topk_length), captured as made, validates: its index
    structure holds. A packed FP8 cache captured with it is data that no call redraws, and only that is refused."""
    empty = [fuzz.EMPTY[FUZZ_EMPTY[name]]] if name in FUZZ_EMPTY else []
    workloads = [w for w in Repo(root).workload_set(name).workloads if "smoke" in w.tags]
    workloads += [Workload.model_validate({"uuid": "fuzz-empty-0001", "name": "fuzz_empty", **w}) for w in empty]
    path = captured_set(root, name, workloads)
    definition = Repo(root).definition(name)
    integers = {n for n, spec in definition.inputs.items() if spec.dtype.startswith("int")}
    packed = sorted(integers - index_inputs(definition))
    refusal = f"inputs {', '.join(packed)} carry data that no call redraws"
    errors = validate(Repo(root), [path])[0].errors
    assert all(error.endswith(refusal) for error in errors) and len(errors) == (len(workloads) if packed else 0)


def put(name: str, at, value):
    """A corruption: entries `at` of input `name` set to `value`."""
    return lambda tensors: tensors[name].__setitem__(at, torch.tensor(value))


@pytest.mark.parametrize("name, workload, corrupt, message", [
    # request 4 holds 70 tokens, in the first two slots of its row: the reference read block -1
    ("flashmla_decode_causal_h16_ckv512_kpe64_ps64", "smoke_b8_sq2", put("block_table", (4, 1), -1),
     "block_table[4, 1] is -1, a slot its request's cache_seqlens fills, yet not one of the 16 blocks"),
    ("flashmla_decode_causal_h128_ckv512_kpe64_ps64", "smoke_sq1", put("block_table", (2, 0), -1),
     "block_table[2, 0] is -1, a slot its request's cache_seqlens fills, yet not one of the 10 blocks"),
    # from 0 to the length of kv_indices, as the constraints ask, but going down on the way
    (DECODE, "smoke_mixed", put("kv_indptr", slice(1, 3), [69, 5]),
     "kv_indptr[2] is 5, less than the offset before it: a request of negative length"),
    (PREFILL, "smoke_three", put("qo_indptr", slice(1, 3), [8, 1]),
     "qo_indptr[2] is 1, less than the offset before it: a request of negative length"),
    (PREFILL, "smoke_three", put("kv_indptr", slice(1, 3), [30, 10]),
     "kv_indptr[2] is 10, less than the offset before it: a request of negative length"),
])
def test_validate_and_run_refuse_captured_structure_no_generator_makes(root, name, workload, corrupt, message):
    path = captured_set(root, name, [named(root, name, workload)], corrupt)
    (checked,) = validate(Repo(root), [path])
    field = message.split("[")[0]
    assert checked.errors == (f"{path}: workloads[0] ({workload}): inputs.{field}: {message}",)
    repo = Repo(root)
    with pytest.raises(FlashbenchError, match=f"workload {workload}: inputs.{field}: "):
        refuse_invalid_workloads(repo, repo.definition(name), repo.workload_set(name).workloads, "cpu")


# A decode workload of an 8192-page cache, drawn at random: some 8 MiB of inputs.
LARGE_POOL = {"uuid": "dddddddd-0001-4000-8000-000000000001", "name": "large_pool", "inputs": SCALE,
              "generate": [{"generator": "paged_kv", "kv_lens": {"distribution": "list", "values": [1, 2]},
                            "page_pool": 8192}]}


def drawn_on(monkeypatch) -> list[str]:
    """The devices random inputs are drawn on from now on."""
    devices, draw = [], random_tensor
    monkeypatch.setattr("flashbench.workloads.random_tensor", lambda *args: devices.append(args[-1]) or draw(*args))
    return devices


@pytest.mark.parametrize("device, budget, where", [
    ("cpu", "captured_memory_budget", "of this machine's memory (a sixteenth)"),
    ("cuda:0", "job_memory_budget", "a job may take of cuda:0"),
])
def test_run_refuses_a_workload_one_input_set_of_which_its_device_cannot_hold(repo, decode, monkeypatch, device,
                                                                                budget, where):
    """An imported workload of 2^28 floats per input passed validate, and `run` drew its sets in the judge, which
    was killed for memory: no trace, no word, the run lost. One set's bytes are told from the shapes, and a set past
    the device's budget is refused, before anything is drawn, with one line."""
    large, devices = Workload.model_validate(LARGE_POOL), drawn_on(monkeypatch)
    monkeypatch.setattr(f"flashbench.workloads.{budget}", lambda *device: 1 << 20)
    with pytest.raises(FlashbenchError) as refused:
        refuse_invalid_workloads(repo, decode, [large], device)
    assert re.search(r"workload large_pool: .*one input set.* needs [\d,]+ bytes \([\d,]+ of inputs, [\d,]+ of "
                     rf"outputs\), more than the 1,048,576 {re.escape(where)}", str(refused.value))
    assert "\n" not in str(refused.value) and set(devices) == {"meta"}
    monkeypatch.setattr(f"flashbench.workloads.{budget}", lambda *device: 1 << 30)
    refuse_invalid_workloads(repo, decode, [large], device)


def test_validate_refuses_a_workload_one_input_set_of_which_no_gpu_could_hold(root, monkeypatch):
    """`validate` and `import-fib` know no device: a workload past the largest GPU made is invalid; the
    repository's own, GPU-sized ones past this machine's memory too, stay valid."""
    path = edit_workloads(root, DECODE, lambda d: d["workloads"].append(LARGE_POOL))
    devices = drawn_on(monkeypatch)
    assert validate(Repo(root), [path])[0].ok
    edit_workloads(root, DECODE, lambda d: d.update(workloads=[LARGE_POOL]))
    monkeypatch.setattr("flashbench.workloads.LARGEST_GPU_BYTES", 10 << 20)
    (checked,) = validate(Repo(root), [path])
    assert len(checked.errors) == 1 and "\n" not in checked.errors[0] and set(devices) == {"meta"}
    assert re.search(r"\(large_pool\): a job of one input set \(the judge's copies too\) needs [\d,]+ bytes .*more "
                     r"than the 6,291,456 a job may take of any GPU$", checked.errors[0])


# A dequantize workload of a 2^16-block packed FP8 cache: 2.75 GB of generated data.
LARGE_FP8_CACHE = {"uuid": "dddddddd-0002-4000-8000-000000000002", "name": "large_fp8_cache",
                   "generate": [{"generator": "fp8_kv_cache", "num_blocks": 1 << 16, "block_size": 64, "packed": True}]}


def test_a_generated_cache_is_told_from_its_shape_not_drawn_to_check_it(repo, monkeypatch):
    """The memory check drew a generator's data (an FP8 cache of 2^16 blocks: 5 GB at its peak) on the host before
    refusing it, and `validate` did the same to every workload it checked. A generator's data is shapes only there:
    the refusal names the cache's bytes, and nothing of it is drawn."""
    name = "flashmla_sparse_fp8_dequantize_ckv512_kpe64_ps64"
    drawn = []
    for maker in ("fresh_mla_tokens", "fresh_mla_fp8_tokens"):  # the data's draw
        monkeypatch.setattr(f"flashbench.workloads.generators.{maker}", lambda *args, **kw: drawn.append(args))
    monkeypatch.setattr("flashbench.workloads.job_memory_budget", lambda *device: 1 << 30)
    with pytest.raises(FlashbenchError, match=rf"workload large_fp8_cache: .* \({(1 << 16) * 64 * 656:,} of inputs"):
        refuse_invalid_workloads(repo, repo.definition(name), [Workload.model_validate(LARGE_FP8_CACHE)], "cuda:0")
    assert drawn == []


@pytest.mark.parametrize("generate, what", [
    ({"generator": "paged_kv", "kv_lens": {"distribution": "list", "values": [1, 2]}, "page_pool": 1 << 20},
     "a pool of 1048576 pages takes 8,388,608 bytes"),
    ({"generator": "paged_kv", "kv_lens": {"distribution": "fixed", "count": 1 << 20, "value": 1}},
     "1048576 lengths takes 16,777,216 bytes"),
])
def test_index_structure_past_the_hosts_share_is_refused_before_it_is_made(repo, decode, monkeypatch, generate, what):
    """Index structure is made for real wherever a workload is checked, before its sizes are weighed: a page pool of
    2^31 (within int32) took 16 GB to order. What a generator is about to make is weighed first, against the share
    of the host's memory one workload's inputs may take (here 1 MiB)."""
    monkeypatch.setattr("flashbench.workloads.generators.captured_memory_budget", lambda: 1 << 20)
    workload = Workload.model_validate({**LARGE_POOL, "generate": [generate]})
    with pytest.raises(FlashbenchError, match=f"generate\\[0\\] \\(paged_kv\\): {what} to make, more than the "
                                              "1,048,576 of this machine's memory"):
        refuse_invalid_workloads(repo, decode, [workload], "cpu")


SPARSE_DECODE = "flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048"
SPARSE_PREFILL = "flashmla_sparse_prefill_sink_topklen_h128_ckv512_kpe64_topk2048"


@pytest.mark.parametrize("name, workload, corrupt, field, message", [
    (DECODE, "smoke_mixed", put("kv_indptr", 0, 1), "kv_indptr", "starts with 1, not 0"),
    (DECODE, "smoke_mixed", put("kv_indptr", -1, 213), "kv_indptr", "ends at 213, but the length of kv_indices is 214"),
    (DECODE, "smoke_mixed", put("kv_indices", 3, 512), "kv_indices", "kv_indices[3] is 512, not one of the 512 pages"),
    (PREFILL, "smoke_square", put("qo_indptr", -1, 18), "qo_indptr", "ends at 18, but total_q is 19"),
    ("flashmla_decode_causal_h16_ckv512_kpe64_ps64", "smoke_sq1", put("cache_seqlens", 1, -3), "cache_seqlens",
     "cache_seqlens[1] is -3, a negative length"),
    ("flashmla_decode_causal_h16_ckv512_kpe64_ps64", "smoke_sq1", put("cache_seqlens", 0, 193), "cache_seqlens",
     "cache_seqlens[0] is 193, more blocks than the table's 3 slots"),
    ("flashmla_decode_causal_h16_ckv512_kpe64_ps64", "smoke_sq1", put("block_table", (2, 1), 10), "block_table",
     "block_table[2, 1] is 10, a slot its request's cache_seqlens fills, yet not one of the 10 blocks"),
    ("mha_varlen_prefill_causal_h128_dqk192_dv128", "smoke_varlen", put("cu_seqlens_k", 1, 2), "cu_seqlens_k",
     "cu_seqlens_k[1] is 2, leaving the sequence it ends fewer keys than queries"),
    (SPARSE_DECODE, "smoke_sq1", put("indices", (2, 0, 5), -2), "indices",
     "indices[2, 0, 5] is -2, neither -1 nor one of the 256 cache tokens"),
    (SPARSE_DECODE, "smoke_sq1", put("indices", (1, 0, 0), 256), "indices",
     "indices[1, 0, 0] is 256, neither -1 nor one of the 256 cache tokens"),
    (SPARSE_PREFILL, "smoke_two_requests", put("indices", (3, 0, 7), -5), "indices",
     "indices[3, 0, 7] is -5, neither a key id nor invalid (-1, or >= 17)"),
    (SPARSE_PREFILL, "smoke_invalid_mixed", put("topk_length", 1, 2049), "topk_length",
     "topk_length[1] is 2049, not a count of 0 to topk (2048) entries"),
])
def test_captured_structure_is_held_to_its_generators_rule_whatever_the_constraints(root, name, workload, corrupt,
                                                                                     field, message):
    """The rules are the generators', not the definition's constraints (these ones bound the values too): a
    definition with none, as an import may bring, still gets its captured structure checked."""
    definition_path = next((root / "definitions").glob(f"*/{name}.yaml"))
    document = yaml.safe_load(definition_path.read_text())
    definition_path.write_text(yaml.safe_dump({**document, "constraints": []}, sort_keys=False))
    path = captured_set(root, name, [named(root, name, workload)], corrupt)
    (checked,) = validate(Repo(root), [path])
    assert checked.errors == (f"{path}: workloads[0] ({workload}): inputs.{field}: {message}",)


def hand_captured(root: Path, name: str, constraints: list[str], tensors: dict, axes: dict, inputs: dict,
                  edit=lambda document: None) -> Path:
    """The workload file of `name` under `root` holding one workload: `tensors` captured (blob.safetensors), the
    other `inputs` as given; the definition's constraints replaced (as an import may bring others) and `edit`ed."""
    definition_path = next((root / "definitions").glob(f"*/{name}.yaml"))
    document = {**yaml.safe_load(definition_path.read_text()), "constraints": constraints}
    edit(document)
    definition_path.write_text(yaml.safe_dump(document, sort_keys=False))
    path = Repo(root).workloads_path(name)
    save_file(tensors, str(path.parent / "blob.safetensors"))
    blobs = {key: {"type": "safetensors", "path": "blob.safetensors", "tensor_key": key} for key in tensors}
    data = {**yaml.safe_load(path.read_text()),
            "workloads": [{"uuid": "hand-0001", "name": "hand", "axes": axes, "inputs": {**inputs, **blobs}}]}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_captured_offsets_beside_page_ids_drawn_at_random_validate_and_run(root):
    """FlashInfer-Bench's paged decode constrains kv_indptr alone; page ids drawn from the pool are as valid as
    captured ones. validate (on "meta": a random input there is shapes only) refused it: 'Cannot copy out of meta
    tensor'; the run checks them drawn."""
    path = hand_captured(root, DECODE, ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1]"],
                         {"kv_indptr": torch.tensor([0, 3, 5], dtype=torch.int32)},
                         {"batch_size": 2, "num_pages": 8, "num_kv_indices": 5, "len_indptr": 3},
                         {"kv_indices": {"type": "random", "low": 0, "high": 8}, **SCALE})
    assert validate(Repo(root), [path])[0].errors == ()
    repo = Repo(root)
    generate_inputs(repo.definition(DECODE), repo.workload_set(DECODE).workloads[0], seed=0, base_dir=path.parent)


def to_int64(document):
    """A definition edit: its index inputs int64, as an imported definition may have them."""
    for name in ("kv_indptr", "kv_indices"):
        document["inputs"][name]["dtype"] = "int64"


def test_captured_offsets_that_go_down_past_int64_wrapping_are_refused(root):
    """0, 2^63 - 1, -2^63, -1, 5: each difference "up" once int64 wraps it; validate passed it, and the reference
    read its pages where an honest solution (torch.arange of the longest request) raised."""
    path = hand_captured(root, DECODE, [], {"kv_indptr": torch.tensor([0, 2**63 - 1, -2**63, -1, 5]),
                                            "kv_indices": torch.tensor([1, 2, 3, 4, 5])},
                         {"batch_size": 4, "num_pages": 8, "num_kv_indices": 5, "len_indptr": 5}, SCALE, to_int64)
    (checked,) = validate(Repo(root), [path])
    assert checked.errors == (f"{path}: workloads[0] (hand): inputs.kv_indptr: kv_indptr[2] is -9223372036854775808, "
                              "less than the offset before it: a request of negative length",)


@pytest.mark.parametrize("where", ["../outside.safetensors", "{tmp}/outside.safetensors", "link.safetensors"])
def test_a_blob_outside_the_workload_files_folder_is_not_read(decode, tmp_path, where):
    """A workload from anyone named a file elsewhere (absolute, through '..' or a link) and it was read: its values
    reached the constraints' messages and the worker."""
    save_file({"indptr": torch.tensor([0, 2, 2, 7], dtype=torch.int32)}, str(tmp_path / "outside.safetensors"))
    folder = tmp_path / "definitions"
    folder.mkdir()
    (folder / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    w = captured_workload(where.format(tmp=tmp_path), kv_indptr="indptr")
    with pytest.raises(BindingError, match=r"^inputs.kv_indptr: safetensors file .* is outside "):
        generate_inputs(decode, w, seed=0, base_dir=folder)


def sparse_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file whose header declares these (dtype code, shape) tensors, their data a hole: tiny on disk,
    as large as declared when read."""
    sizes = {"I32": 4, "BF16": 2}
    header, offset = {}, 0
    for key, (code, shape) in tensors.items():
        end = offset + math.prod(shape) * sizes[code]
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header).encode()
    with open(path, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little") + encoded)
        out.truncate(8 + len(encoded) + offset)


def test_a_blob_declaring_more_than_the_memory_budget_is_refused_unread(decode, tmp_path, monkeypatch):
    """A sparse file of a few bytes on disk declared a tensor of hundreds of GiB, and the judge read it whole
    (killed for memory on a real budget). Captured tensors of one workload share a sixteenth of the machine's memory."""
    monkeypatch.setattr("flashbench.workloads.captured_memory_budget", lambda: 1 << 20)
    sparse_safetensors(tmp_path / "b.safetensors", {"indptr": ("I32", [4]), "q_pe": ("BF16", [3, 16, 64]),
                                                    "huge": ("BF16", [1 << 20])})
    w = captured_workload("b.safetensors", kv_indptr="indptr", q_pe="huge")
    with pytest.raises(BindingError, match=r"^inputs.q_pe: .*b.safetensors:huge holds 2,097,152 bytes, more than "
                                           "the 1,048,576 left of the sixteenth of this machine's memory"):
        generate_inputs(decode, w, seed=0, base_dir=tmp_path)
    # The budget is for all of a workload's captured tensors together: the last one read is refused past it.
    tensors = {"indptr": torch.tensor([0, 2, 2, 7], dtype=torch.int32), "indices": torch.arange(7, dtype=torch.int32),
               "q_pe": torch.randn(3, 16, 64).bfloat16()}
    save_file(tensors, str(tmp_path / "real.safetensors"))
    w = captured_workload("real.safetensors", kv_indptr="indptr", kv_indices="indices", q_pe="q_pe")
    total = sum(t.nbytes for t in tensors.values())
    monkeypatch.setattr("flashbench.workloads.captured_memory_budget", lambda: total)
    assert torch.equal(generate_inputs(decode, w, seed=0, base_dir=tmp_path)["kv_indices"], tensors["indices"])
    monkeypatch.setattr("flashbench.workloads.captured_memory_budget", lambda: total - 1)
    with pytest.raises(BindingError, match=r"^inputs.kv_indices: .*real.safetensors:indices holds 28 bytes, more than "
                                           "the 27 left"):
        generate_inputs(decode, w, seed=0, base_dir=tmp_path)


@pytest.mark.parametrize("lengths, message", [
    ({"distribution": "list", "values": [2**32]}, "a length of 4294967296 is past int32"),
    ({"distribution": "list", "values": [2**31 - 1, 2**31 - 1]}, "add up past int32"),
    ({"distribution": "fixed", "count": 2, "value": 10**30}, "an integer past int64"),
])
def test_lengths_past_the_index_dtype_are_refused_not_wrapped(lengths, message):
    """A length of 2^32 became offsets [0, 0]; one of 10^30 an OverflowError out of numpy."""
    with pytest.raises(ValueError, match=message):
        structured_inputs(Workload.model_validate({"uuid": "lengths-0001", "generate": [
            {"generator": "varlen", "q_lens": lengths}]}), "meta")


def with_axis(axis: str, input_name: str, shape: list[str], dtype: str | None = None):
    """A definition edit: var axis `axis` added, input `input_name` of `shape` (and `dtype`)."""
    def edit(document):
        document["axes"][axis] = {"type": "var", "description": "added"}
        document["inputs"][input_name] = {**document["inputs"][input_name], "shape": shape,
                                          **({"dtype": dtype} if dtype else {})}
    return edit


FLASHMLA_DECODE = "flashmla_decode_causal_h16_ckv512_kpe64_ps64"
DECODE_AXES = {"batch_size": 2, "seq_len_q": 1, "num_blocks": 4}


@pytest.mark.parametrize("name, edit, tensors, axes, error", [
    # an index name of another dtype: data, not the generator's structure (numpy has no bfloat16: a TypeError)
    ("mha_varlen_prefill_causal_h128_dqk128_dv128", with_axis("len_q", "cu_seqlens_q", ["len_q"], "bfloat16"),
     {"cu_seqlens_q": torch.tensor([0.0, 2.0], dtype=torch.bfloat16),
      "cu_seqlens_k": torch.tensor([0, 2], dtype=torch.int32)}, {"total_q": 2, "total_k": 2, "len_q": 2},
     "inputs cu_seqlens_q carry data that no call redraws"),
    # a table of another shape than one row per request: an IndexError naming its missing row 1
    (FLASHMLA_DECODE, with_axis("rows", "block_table", ["rows", "max_blocks_per_seq"]),
     {"block_table": torch.tensor([[0, -1]], dtype=torch.int32),
      "cache_seqlens": torch.tensor([64, 128], dtype=torch.int32)}, {**DECODE_AXES, "max_blocks_per_seq": 2, "rows": 1},
     "inputs.cache_seqlens: 2 requests, but block_table has 1 rows"),
    # offsets of another count: an IndexError too
    ("mha_varlen_prefill_causal_h128_dqk128_dv128", with_axis("len_k", "cu_seqlens_k", ["len_k"]),
     {"cu_seqlens_q": torch.tensor([0, 2], dtype=torch.int32), "cu_seqlens_k": torch.tensor([0], dtype=torch.int32)},
     {"total_q": 2, "total_k": 0, "len_k": 1}, "inputs.cu_seqlens_k: 1 offsets, but cu_seqlens_q has 2"),
    # another rank: an IndexError reading the width of a table of one axis
    (FLASHMLA_DECODE, with_axis("slots", "block_table", ["slots"]),
     {"block_table": torch.tensor([0, 1], dtype=torch.int32),
      "cache_seqlens": torch.tensor([64, 128], dtype=torch.int32)}, {**DECODE_AXES, "slots": 2}, None),
])
def test_captured_inputs_named_as_index_structure_yet_not_it_get_an_error_not_a_crash(root, name, edit, tensors,
                                                                                        axes, error):
    """A definition and workload as an import may bring them: validate named every invalid workload, and crashed."""
    path = hand_captured(root, name, [], tensors, axes, {"softmax_scale": {"type": "scalar", "value": 0.1}}, edit)
    (checked,) = validate(Repo(root), [path])
    assert checked.errors == ((f"{path}: workloads[0] (hand): {error}",) if error else ())


def test_a_blobs_fp4_tensor_is_counted_by_its_bytes(tmp_path):
    """A header's shape counts FP4 values, two to a byte: counted a byte each, a blob within the budget was refused."""
    from flashbench.model.workload import SafetensorsInput
    from flashbench.workloads.tensors import safetensors_tensor

    packed = torch.zeros(4, 8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)  # 32 bytes, 64 FP4 values
    save_file({"w": packed}, str(tmp_path / "w.safetensors"))
    spec = SafetensorsInput(type="safetensors", path="w.safetensors", tensor_key="w")
    assert safetensors_tensor(spec, tmp_path, "float4_e2m1", "cpu", 32).nbytes == 32
    with pytest.raises(ValueError, match="holds 32 bytes, more than the 31 left"):
        safetensors_tensor(spec, tmp_path, "float4_e2m1", "cpu", 31)


@pytest.mark.parametrize("descriptor, message", [
    ({"std": 1e38}, r"draws reach 1.6e\+39, past the largest bfloat16"),  # scaled by up to 2
    ({"distribution": "uniform", "low": 5, "high": -5}, r"needs low < high, not \[5, -5\)"),
    ({"distribution": "uniform", "low": 3}, r"needs low < high, not \[3, 1\) \(high defaults to 1\)"),
    ({"low": -1, "high": 1}, "low, high do\\(es\\) not apply to a normal distribution"),
    ({"distribution": "uniform", "std": 2}, "std do\\(es\\) not apply to a uniform distribution"),
])
def test_a_random_float_input_draws_what_its_fields_say(decode, descriptor, message):
    """A hunt for hidden workloads: a std of 1e38 drew inf in bfloat16 (the reference failed against itself), an
    inverted or one-sided uniform range drew from other bounds than written, and fields of the other distribution
    were ignored; `validate` passed them all."""
    workload = Workload.model_validate({"uuid": "dddddddd-0002", "axes": {"batch_size": 2, "num_pages": 8,
                                                                          "num_kv_indices": 4, "len_indptr": 3},
                                       "inputs": {"q_nope": {"type": "random", **descriptor}}})
    with pytest.raises(BindingError, match=rf"^inputs.q_nope: .*{message}"):
        generate_inputs(decode, workload, seed=0, device="meta")


@pytest.mark.parametrize("descriptor, dtype, message", [
    # drawn in float32, a range wider than float32's largest drew inf everywhere
    ({"distribution": "uniform", "low": -2e38, "high": 2e38}, "bfloat16", r"the range \[-2e\+38, 2e\+38\) is wider"),
    # a whole redraw (refill_random) draws in the dtype itself: torch's uniform_ refused a width past the dtype
    ({"distribution": "uniform", "low": -1.7e38, "high": 1.7e38}, "bfloat16", "is wider than the largest bfloat16"),
    # a call without queries scales an input drawn about 0 by up to 2: past the dtype there
    ({"std": 4.2e37}, "bfloat16", r"draws reach 6.72e\+38, past the largest bfloat16"),
    ({"distribution": "uniform", "low": 5, "high": -5}, "bfloat16", r"not \[5, -5\)$"),
    ({"std": 2.0}, "float4_e2m1", "torch draws no random float4_e2m1 values"),
])
def test_a_random_float_input_draws_within_its_dtype_on_every_path(decode, descriptor, dtype, message):
    """Found by a review: these passed `validate` and drew inf (the float32 draw, or the scaled redraw of a call
    without queries), failed the whole redraw of a query (bfloat16 uniform_), or failed with torch's own words
    (FP4, whose finfo raises NotImplementedError, not TypeError)."""
    definition = decode.model_copy(deep=True)
    definition.inputs["q_nope"] = definition.inputs["q_nope"].model_copy(update={"dtype": dtype})
    workload = Workload.model_validate({"uuid": "dddddddd-0003", "axes": {"batch_size": 2, "num_pages": 8,
                                                                          "num_kv_indices": 4, "len_indptr": 3},
                                       "inputs": {"q_nope": {"type": "random", **descriptor}}})
    with pytest.raises(BindingError, match=rf"^inputs.q_nope: .*{message}"):
        generate_inputs(definition, workload, seed=0, device="meta")


def test_an_fp8_query_is_redrawn_whole():
    """torch's normal_ and uniform_ draw no FP8: a whole redraw of an FP8 query failed (NotImplementedError)."""
    from flashbench.workloads.tensors import DEFAULT_RANDOM, refill_random
    tensor = torch.zeros(64, 8, dtype=torch.float8_e4m3fn)
    refill_random(tensor, DEFAULT_RANDOM, 3, torch.Generator())
    assert torch.equal(tensor.view(torch.int8), random_tensor(DEFAULT_RANDOM, [64, 8], "float8_e4m3fn", 3, "cpu")
                       .view(torch.int8)) and tensor.float().abs().sum() > 0


def test_a_captured_bool_mask_a_constraint_reads_is_structure(decode):
    """Before index_inputs a captured bool tensor was never refused; it was then refused as data even where a
    constraint reads it, unlike an int8 input so read."""
    definition = decode.model_copy(deep=True)
    definition.inputs["valid"] = definition.inputs["kv_indptr"].model_copy(update={"dtype": "bool"})
    definition.inputs["mask"] = definition.inputs["kv_indptr"].model_copy(update={"dtype": "bool"})
    definition.constraints = [*definition.constraints, "valid.shape[0] == len_indptr"]
    assert {"valid"} <= index_inputs(definition) and "mask" not in index_inputs(definition)
