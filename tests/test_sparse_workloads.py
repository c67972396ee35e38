"""The sparse-attention generators (flashbench/workloads/generators.py: sparse_prefill_indices,
sparse_decode_indices, fp8_kv_cache) and the flashmla_sparse workload sets and cost models; the
data they make (FP8 caches) drawn from the set's seed and redrawn per call, validly, by the worker
and the judge alike; a solution memoizing generated data per input set fails."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from flashbench import BindingError, Repo
from flashbench.binding import bind_axes
from flashbench.cost import evaluate_cost
from flashbench.model import Lengths, Workload
from flashbench.model.workload import FP8KVCache, KVCacheValues, SparseDecodeIndices, SparsePrefillIndices
from flashbench.run.judge.inputs import JobInputs
from flashbench.run.protocol import Call
from flashbench.run.recipe import InputSets, mixed_link
from flashbench.workloads import (
    REDRAW_WINDOW_BYTES, GeneratedData, check_workload, derive_seed, draw_data_windows, generate_inputs, generated_data,
    generators, index_inputs, random_inputs, unredrawn_data_inputs,
)
from flashbench.workloads.generators import (
    DATA_OUTPUTS, GENERATORS, DataSource, fp8_quantize, fresh_mla_fp8_tokens, fresh_mla_tokens, random_subsets,
)

ROOT = Path(__file__).resolve().parents[1]
INT32_MAX = 2**31 - 1


def lengths(*values):
    return Lengths(distribution="list", values=list(values))


def prefill(seed=0, **fields):
    spec = SparsePrefillIndices(generator="sparse_prefill_indices", **{"topk": 32, **fields})
    return GENERATORS["sparse_prefill_indices"](spec, np.random.default_rng(seed))


def decode(seed=0, **fields):
    spec = SparseDecodeIndices(generator="sparse_decode_indices", **{"topk": 16, **fields})
    return GENERATORS["sparse_decode_indices"](spec, np.random.default_rng(seed), DataSource.seeded(seed + 1, "cpu"))


def test_random_subsets_are_distinct_visible_positions_then_minus_one():
    visible = np.array([0, 1, 7, 16, 17, 40, 64, 65, 1000, 5000])
    out = random_subsets(np.random.default_rng(0), visible, 16)
    for v, row in zip(visible, out):
        chosen = row[: min(16, v)]
        assert len(set(chosen.tolist())) == len(chosen) and (chosen >= 0).all() and (chosen < v).all()
        assert (row[min(16, v):] == -1).all()


def test_prefill_indices_are_causal_per_request():
    tensors, axes = prefill(q_lens=lengths(5, 40), prefix_lens=lengths(0, 10))
    assert axes == {"seq_len_q": 45, "seq_len_kv": 55}
    indices = tensors["indices"]
    assert indices.shape == (45, 1, 32) and indices.dtype == torch.int32 and "topk_length" not in tensors
    for row in range(45):
        first_key, visible = (0, row + 1) if row < 5 else (5, 10 + row - 5 + 1)
        ids = indices[row, 0]
        count = min(32, visible)
        assert ((ids[:count] >= first_key) & (ids[:count] < first_key + visible)).all()
        assert len(set(ids[:count].tolist())) == count and (ids[count:] == -1).all()


def test_prefill_invalid_mix_scatter_empty_rows_and_topk_length():
    tensors, axes = prefill(q_lens=lengths(3, 30), prefix_lens=lengths(2, 40), invalid="mixed", scatter=True,
                            empty_queries=2, topk_length=True)
    indices, length = tensors["indices"][:, 0].long(), tensors["topk_length"].long()
    seq_len_kv = axes["seq_len_kv"]
    valid = (indices >= 0) & (indices < seq_len_kv)
    counted = valid & (torch.arange(32)[None, :] < length[:, None])
    visible = torch.tensor([3, 4, 5] + [41 + i for i in range(30)])
    assert (length == 0).sum() == 2  # the empty query tokens
    expected = torch.where(length == 0, 0, torch.clamp(visible, max=32))
    assert torch.equal(counted.sum(1), expected)
    assert valid[length < 32].any()  # past topk_length: real ids that must be ignored
    invalid = indices[~valid & (torch.arange(32)[None, :] < length[:, None])]
    assert {-1, INT32_MAX} <= set(invalid.tolist()) and (invalid >= seq_len_kv).any()


def test_decode_indices_point_into_each_requests_blocks_and_nan_tokens_are_never_valid():
    tensors, axes = decode(kv_lens=lengths(0, 1, 70, 130), seq_len_q=2, block_size=64, block_pool=8,
                           fp8_cache=KVCacheValues(zero_tokens=0.1))
    assert axes == {"batch_size": 4, "seq_len_q": 2, "num_blocks": 8, "page_block_size": 64}
    indices, cache = tensors["indices"].long(), tensors["k_cache"]
    assert indices.shape == (4, 2, 16) and cache.shape == (8, 64, 1, 656) and cache.dtype == torch.int8
    counts = (indices != -1).sum(-1)
    assert counts.tolist() == [[0, 0], [0, 1], [16, 16], [16, 16]]  # a token sees positions 0..kv_len - s_q + s
    blocks_of = [set((row[row >= 0] // 64).tolist()) for row in indices.reshape(4, -1)]
    assert all(not (a & b) for i, a in enumerate(blocks_of) for b in blocks_of[i + 1:])  # requests own their blocks
    tokens = cache.view(-1, 656)
    nan_token = (tokens[:, :512] == 0x7F).all(1)
    assert nan_token.sum() == 8 * 64 - (1 + 70 + 130) and not nan_token[indices[indices >= 0]].any()
    scales = tokens[~nan_token, 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two


@pytest.mark.parametrize("packed", [False, True])
def test_a_generated_cache_repeats_no_token(packed, monkeypatch):
    """Caches past 2048 tokens held at most 2048 distinct ones, and every call kept the duplication (the quantize's
    cache is its first values times a factor): a solution that deduplicated a set's tokens once quantised about
    2048 a call and gathered the rest, bit-exact (a red team: 27 ms against an honest 180 ms on a CPU). Every token
    is drawn on its own, and quantised in chunks (here of 1000) as the whole would be."""
    monkeypatch.setattr("flashbench.workloads.generators.FRESH_CHUNK_TOKENS", 1000)
    spec = FP8KVCache(generator="fp8_kv_cache", num_blocks=40, packed=packed, values=KVCacheValues(zero_tokens=0.0))
    (cache,) = GENERATORS["fp8_kv_cache"](spec, np.random.default_rng(0), DataSource.seeded(1, "cpu"))[0].values()
    rows = cache.reshape(40 * 64, -1)
    assert torch.unique(rows.view(torch.int8 if packed else torch.int16), dim=0).shape[0] == 40 * 64
    if packed:
        plain = GENERATORS["fp8_kv_cache"](spec.model_copy(update={"packed": False}), np.random.default_rng(0),
                                           DataSource.seeded(1, "cpu"))[0]["kv_cache"]
        assert torch.equal(fp8_quantize()(plain), cache)


def test_packed_fp8_cache_is_the_quantize_reference_of_the_bfloat16_one():
    spec = dict(generator="fp8_kv_cache", num_blocks=3, values=KVCacheValues(spread=12, boundary_tiles=0.2, zero_tokens=0.1))
    (plain, _), (packed, axes) = (GENERATORS["fp8_kv_cache"](FP8KVCache(**spec, packed=p), np.random.default_rng(0),
                                                                     DataSource.seeded(7, "cpu"))
                                  for p in (False, True))
    path = ROOT / "references" / "flashmla_sparse" / "flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64.py"
    module_spec = importlib.util.spec_from_file_location("quantize_reference", path)
    quantize = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(quantize)
    assert axes == {"num_blocks": 3, "page_block_size": 64}
    assert torch.equal(quantize.run(plain["kv_cache"]), packed["kv_cache_fp8"])
    tiles = plain["kv_cache"][..., :512].float().reshape(-1, 4, 128).abs().amax(-1)
    assert (tiles == 0).any() and ((tiles / 448) == torch.exp2(torch.log2(tiles / 448).round())).any()  # zero and 448 * 2^k tiles


def sparse_definitions():
    return [n for n in Repo(ROOT).names() if n.startswith("flashmla_sparse_")]


@pytest.mark.parametrize("name", sparse_definitions())
def test_smoke_workloads_are_tiny_and_the_cost_counts_valid_entries(name):
    repo = Repo(ROOT)
    definition = repo.definition(name)
    smoke = [w for w in repo.workload_set(name).workloads if "smoke" in w.tags]
    assert len(smoke) >= 2
    for workload in smoke:
        inputs = generate_inputs(definition, workload, seed=0, device="cpu", base_dir=repo.definition_path(name).parent)
        axes = bind_axes(definition, inputs)
        nbytes, flops = evaluate_cost(definition, axes, inputs)
        assert nbytes > 0 and flops > 0
        if "indices" not in inputs:
            continue
        indices = inputs["indices"].long()
        assert indices.shape[-1] == 2048 and indices.numel() <= 16 * 2048
        if "topk_length" in inputs:
            counted = int(inputs["topk_length"].sum())
        elif "seq_len_kv" in axes:
            counted = int(((indices >= 0) & (indices < axes["seq_len_kv"])).sum())
        else:
            counted = int((indices != -1).sum())
        assert counted > 0
        assert flops == 2 * axes["num_heads_q"] * (576 + 512) * counted


# Generated data (FP8 caches): drawn from the input set's seed, and a window of it redrawn by every
# call like the random inputs, validly, leaving index structure alone; the judge's replay and the
# worker's redraw write the same bytes.

QUANTIZE = "flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64"
DEQUANTIZE = "flashmla_sparse_fp8_dequantize_ckv512_kpe64_ps64"
DECODE_FP8 = "flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048"
STRUCTURE_DTYPES = (torch.int32, torch.int64, torch.bool)


def load_reference(name):
    path = ROOT / "references" / "flashmla_sparse" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(f"reference_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def repo_workload(name, workload_name):
    repo = Repo(ROOT)
    return repo.definition(name), next(w for w in repo.workload_set(name).workloads if w.name == workload_name)


def made_tensors(definition, workload, seed):
    made = generate_inputs(definition, workload, seed=seed, device="cpu", base_dir=ROOT / "definitions")
    return made, {k: v for k, v in made.items() if isinstance(v, torch.Tensor)}


def redrawn(definition, workload, tensors, batch_seed=5, calls=3, call_seed=77, k=1):
    """A worker's view: the set after one call's redraw (window k of a batch of `calls`)."""
    sets = InputSets(definition, workload, [{n: t.clone() for n, t in tensors.items()}], random_inputs(definition, workload))
    sets.draw(batch_seed, [Call(set=0, slot=j, seed=call_seed if j == k else None) for j in range(calls)])
    sets.redraw(k)
    return sets


def big_quantize(packed):
    """A cache a few windows large: 40 blocks of 64 tokens."""
    return Workload.model_validate({"uuid": f"5eed0000-fp8-{int(packed)}", "generate": [{
        "generator": "fp8_kv_cache", "num_blocks": 40, "packed": packed,
        "values": {"spread": 12, "boundary_tiles": 0.2, "zero_tokens": 0.05}}]})


def big_decode():
    """Requests holding 3000, 100 and 0 tokens in a pool of 60 blocks: more data tokens than a window."""
    generator = {"generator": "sparse_decode_indices", "kv_lens": lengths(3000, 100, 0).model_dump(), "seq_len_q": 2,
                 "topk": 2048, "block_pool": 60, "scatter": True, "fp8_cache": {"boundary_tiles": 0.1, "zero_tokens": 0.05}}
    return Workload.model_validate({"uuid": "5eed0000-decode-fp8", "generate": [generator],
                                    "inputs": {"softmax_scale": {"type": "scalar", "value": 0.1}}})


def assert_valid_packed(rows):
    """Packed tokens as the quantize reference writes them: no NaN byte, finite power-of-two scales
    within the format's range, finite rope values."""
    assert not ((rows[:, :512] == 0x7F) | (rows[:, :512] == -1)).any()  # e4m3's NaNs: 0x7F, 0xFF
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    assert torch.isfinite(scales).all() and (scales >= 2.0**-14).all()
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))
    assert torch.isfinite(rows[:, 528:].contiguous().view(torch.bfloat16)).all()


def test_every_generator_output_that_is_not_index_structure_is_declared_data():
    """Over the repository's workloads: what a generator makes in a byte or floating type is data,
    declared (so redrawn), and it changes with the set seed; integer structure does not."""
    repo = Repo(ROOT)
    seen = set()
    for name in repo.names():
        definition = repo.definition(name)
        for workload in repo.workload_set(name).workloads:
            if workload.name != next(w.name for w in repo.workload_set(name).workloads):
                continue  # one workload per set is enough
            declared = generated_data(workload)
            for spec in workload.generate:
                rng = lambda: np.random.default_rng(3)  # noqa: E731
                if spec.generator in DATA_OUTPUTS:
                    first, _ = GENERATORS[spec.generator](spec, rng(), DataSource.seeded(1, "cpu"))
                    second, _ = GENERATORS[spec.generator](spec, rng(), DataSource.seeded(2, "cpu"))
                else:
                    first, _ = GENERATORS[spec.generator](spec, rng())
                    second = first
                for output, tensor in first.items():
                    seen.add(spec.generator)
                    if tensor.dtype in STRUCTURE_DTYPES:
                        assert output not in declared and torch.equal(tensor, second[output]), (name, output)
                    else:
                        assert output in declared and declared[output].fresh is not None, (name, output)
                        assert not torch.equal(tensor, second[output]), (name, output)
            assert unredrawn_data_inputs(definition, workload) == [], name
    assert {"fp8_kv_cache", "sparse_decode_indices", "paged_kv", "block_table"} <= seen


@pytest.mark.parametrize("name, workload_name, data", [
    (QUANTIZE, "smoke_wide_scales", "kv_cache"), (DEQUANTIZE, "smoke_one_block", "kv_cache_fp8"),
    (DECODE_FP8, "smoke_sq1", "k_cache"),
])
def test_the_set_seed_changes_generated_data_not_structure(name, workload_name, data):
    definition, workload = repo_workload(name, workload_name)
    _, first = made_tensors(definition, workload, 1)
    _, again = made_tensors(definition, workload, 1)
    _, second = made_tensors(definition, workload, 2)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first[data], second[data])
    for n, tensor in first.items():
        if n != data and tensor.dtype in STRUCTURE_DTYPES:
            assert torch.equal(tensor, second[n]), n
    if data == "k_cache":  # the tokens no request holds are NaN bytes in every set
        nan = (first[data].view(-1, 656)[:, :512] == 0x7F).all(1)
        assert torch.equal(nan, (second[data].view(-1, 656)[:, :512] == 0x7F).all(1)) and nan.any()


def rotation_of(before: torch.Tensor, after: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The rotation of `before`'s rows that `after`'s rows match best, and which rows match under it."""
    weights = torch.randint(1, 1 << 20, (before.shape[1],), generator=torch.Generator().manual_seed(0))
    def signature(rows):
        return (rows.view(torch.uint8 if rows.element_size() == 1 else torch.int16).to(torch.int64) * weights).sum(1)
    old, new = signature(before), signature(after)
    matches = [torch.roll(old, -shift) == new for shift in range(len(old))]
    shift = max(range(len(old)), key=lambda s: int(matches[s].sum()))
    return shift, matches[shift]


@pytest.mark.parametrize("packed", [False, True])
def test_a_call_redraws_a_window_of_a_generated_cache_validly(packed):
    definition = Repo(ROOT).definition(DEQUANTIZE if packed else QUANTIZE)
    workload = big_quantize(packed)
    name, width = ("kv_cache_fp8", 656) if packed else ("kv_cache", 576)
    made, tensors = made_tensors(definition, workload, 4)
    sets = redrawn(definition, workload, tensors)
    assert sets.redrawn_names == [name] and sets.random_names == []
    before, after = tensors[name].view(-1, width), sets.sets[0][name].view(-1, width)
    count = min(40 * 64, REDRAW_WINDOW_BYTES // (width * after.element_size()))
    assert count < 40 * 64  # the window is part of the cache
    # Nothing is drawn whole here: packed bytes have every row moved (a rotation of all rows), bfloat16 values
    # are scaled by a factor from the mix of the link (none here: 0) and the call's seed; then a window is written.
    if packed:
        shift, kept = rotation_of(before, after)
        assert shift != 0
    else:
        factor = torch.tensor(mixed_link(0, 77), dtype=torch.float32) * 2.0 ** -31 + 1
        scaled = (before.float() * factor).to(torch.bfloat16)  # in float32: the factor keeps its 24 bits
        kept = (after == scaled).all(1)
        assert 1 < factor.item() < 2 and (scaled != before).float().mean() > 0.9  # all but zeros change
    assert int(kept.sum()) >= 40 * 64 - count
    changed = torch.nonzero(~kept).flatten()
    start = int(changed.min())
    assert int(changed.max()) < start + count and len(changed) > 0.95 * count  # one window, (nearly) every row of it
    fresh = draw_data_windows(workload, tensors, sets.data, seed=5, calls=3)[name]  # the batch's draw in `redrawn`
    assert rotation_of(fresh[count:2 * count], after[start:start + count])[1].all()  # window k=1, rotated
    bind_axes(definition, {**made, **sets.sets[0]})  # shapes, dtypes, constraints: as validate checks them
    if packed:
        assert_valid_packed(after)
    else:
        assert torch.isfinite(after.float()).all()


@pytest.mark.parametrize("packed", [False, True])
def test_a_cache_changed_by_a_link_is_changed_alike_by_the_worker_and_the_judge(packed):
    """The worker rotates (packed bytes) or scales (bfloat16) with its link as a tensor, the judge with the
    integer it was told: the same values land in the same places; another link changes them otherwise."""
    definition = Repo(ROOT).definition(DEQUANTIZE if packed else QUANTIZE)
    workload = big_quantize(packed)
    _, tensors = made_tensors(definition, workload, 4)
    name = "kv_cache_fp8" if packed else "kv_cache"
    results = []
    for link in (torch.tensor(123456789), 123456789, 987654321):
        sets = InputSets(definition, workload, [{n: t.clone() for n, t in tensors.items()}], random_inputs(definition, workload))
        sets.draw(5, [Call(set=0, slot=j, seed=77 + j) for j in range(2)])
        sets.redraw(1, link)
        results.append(sets.sets[0][name])
    assert torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])


def test_no_token_of_a_scaled_cache_comes_back_in_the_next_call():
    """A rotation of the rows let a worker that knows it move its previous outputs into their new rows and
    compute only the window (a red team's FP8 quantize: 5x faster on a CPU). Scaled by a factor from the
    link, the values the set started with give no token of one call again in the next (but all-zero ones)."""
    definition = Repo(ROOT).definition(QUANTIZE)
    workload = big_quantize(False)
    _, tensors = made_tensors(definition, workload, 4)
    sets = InputSets(definition, workload, [{n: t.clone() for n, t in tensors.items()}], random_inputs(definition, workload))
    sets.draw(5, [Call(set=0, slot=j, seed=77 + j) for j in range(3)])
    caches = []
    for k, link in ((1, 11), (2, 12)):
        sets.redraw(k, link)
        caches.append({tuple(row) for row in sets.sets[0]["kv_cache"].view(-1, 576).view(torch.int16).tolist() if any(row)})
    assert len(caches[0]) > 1000 and not caches[0] & caches[1]
    # Multiplied in the input's own 16-bit type (as a GPU does with a 16-bit tensor and a 0-d factor), the
    # factor would take 129 values, few enough for a table of outputs per factor: the first values are float32.
    assert sets._first[0, "kv_cache"].dtype == torch.float32


def test_a_call_redraws_only_the_decode_caches_data_tokens():
    definition = Repo(ROOT).definition(DECODE_FP8)
    workload = big_decode()
    made, tensors = made_tensors(definition, workload, 4)
    sets = redrawn(definition, workload, tensors)
    assert sets.redrawn_names == ["q", "k_cache"]
    before, after = tensors["k_cache"].view(-1, 656), sets.sets[0]["k_cache"].view(-1, 656)
    nan = (before[:, :512] == 0x7F).all(1)
    assert int((~nan).sum()) == 3100
    changed = (before != after).any(1)
    assert not (changed & nan).any()  # NaN tokens stay NaN
    assert 0.95 * (REDRAW_WINDOW_BYTES // 656) < int(changed.sum()) <= REDRAW_WINDOW_BYTES // 656
    assert torch.equal(sets.sets[0]["indices"], tensors["indices"])  # index structure untouched
    assert_valid_packed(after[~nan])
    axes = bind_axes(definition, {**made, **sets.sets[0]})
    assert axes["num_blocks"] == 60
    reference = load_reference("flashmla_sparse_decode_fp8")  # the reference still has finite outputs
    out, lse = reference.run(sets.sets[0]["q"], sets.sets[0]["k_cache"], sets.sets[0]["indices"], 0.1)
    assert torch.isfinite(out.float()).all() and not torch.isnan(lse).any()


def test_fresh_tokens_are_drawn_and_quantised_as_the_generator_makes_them():
    values = KVCacheValues(spread=12, boundary_tiles=1.0, zero_tokens=0.0)
    tokens = fresh_mla_tokens(values, 300, torch.Generator().manual_seed(9), "cpu")
    packed = fresh_mla_fp8_tokens(values, 300, torch.Generator().manual_seed(9), "cpu")
    quantize = load_reference(QUANTIZE)
    assert torch.equal(quantize.run(tokens.view(300, 1, 1, 576)).view(300, 656), packed)
    amax = tokens[:, :512].float().view(300, 4, 128).abs().amax(-1)  # every tile a boundary tile: 448 * 2^k
    assert torch.equal(amax / 448, torch.exp2(torch.log2(amax / 448).round()))
    spread = torch.log2(tokens[:, :512].float().view(300, 4, 128).std(-1))
    assert spread.max() - spread.min() > 8  # tiles of very different magnitudes
    zeros = fresh_mla_tokens(KVCacheValues(zero_tokens=1.0), 5, torch.Generator().manual_seed(1), "cpu")
    assert torch.equal(zeros, torch.zeros_like(zeros)) and not torch.signbit(zeros.float()).any()
    chunk = generators.FRESH_CHUNK_TOKENS
    chunked = fresh_mla_tokens(values, chunk + 300, torch.Generator().manual_seed(9), "cpu")  # past one chunk
    assert chunked.shape == (chunk + 300, 576) and torch.isfinite(chunked.float()).all()
    assert not torch.equal(chunked[:300], chunked[chunk:])  # chunks draw on, never repeat


@pytest.mark.parametrize("name, workload_name", [(QUANTIZE, "smoke_one_block"), (DEQUANTIZE, "smoke_wide_scales"),
                                                 (DECODE_FP8, "smoke_mtp2")])
def test_the_judges_replay_writes_what_the_worker_writes(name, workload_name):
    """JobInputs' replay (the judge) and an InputSets as the worker builds it, on the same seeds."""
    definition, workload = repo_workload(name, workload_name)
    judge = JobInputs(definition, workload, [11, 12], "cpu", ROOT / "definitions")
    worker = InputSets(definition, workload, [{n: t.clone() for n, t in s.items() if isinstance(t, torch.Tensor)}
                                              for s in judge.sets], random_inputs(definition, workload))
    data = next(n for n in judge.redrawn_names if n not in judge.random_names)
    for batch_seed, calls in ((3, [(0, 101), (1, 102), (0, 103)]), (4, [(1, 104)])):
        for sets in (judge.replay, worker):
            sets.draw(batch_seed, [Call(set=index, slot=k, seed=seed) for k, (index, seed) in enumerate(calls)])
            for k in range(len(calls)):
                sets.redraw(k)
    for index in (0, 1):
        for n, tensor in worker.sets[index].items():
            assert torch.equal(tensor, judge.current[index][n]), n
        assert not torch.equal(judge.current[index][data], judge.sets[index][data])  # the calls changed it
    assert not torch.equal(judge.current[0][data], judge.current[1][data])


def test_unredrawn_data_inputs_names_fixed_data(monkeypatch):
    definition, workload = repo_workload(QUANTIZE, "smoke_one_block")
    assert unredrawn_data_inputs(definition, workload) == []
    # A generator whose data cannot be redrawn is named...
    monkeypatch.setitem(DATA_OUTPUTS, "fp8_kv_cache",
                        lambda spec, rng: {"kv_cache": GeneratedData(576, None, fixed="no valid redraw")})
    assert unredrawn_data_inputs(definition, workload) == ["kv_cache"]
    sets = InputSets(definition, workload, [made_tensors(definition, workload, 1)[1]], [])
    assert sets.redrawn_names == []
    monkeypatch.undo()
    # ...and so is a captured floating-point tensor (an integer one may be index structure: below).
    captured = Workload.model_validate({"uuid": "5eed0000-captured", "inputs": {
        "kv_cache": {"type": "safetensors", "path": "x.safetensors", "tensor_key": "kv"}}})
    assert unredrawn_data_inputs(definition, captured) == ["kv_cache"]
    assert derive_seed(1, "a") != derive_seed(2, "a")


def test_captured_integer_data_is_data_and_index_structure_is_not():
    """A captured FP8 cache (int8 bytes) counted as index structure because it is integer, so `validate` passed a
    workload whose cache no call redraws and a solution could memoize its outputs (a hunt for hidden workloads).
    Index structure is what a constraint or a generator's rule reads."""
    dequantize = Repo(ROOT).definition(DEQUANTIZE)
    cache = Workload.model_validate({"uuid": "5eed0000-captured-bytes", "inputs": {
        "kv_cache_fp8": {"type": "safetensors", "path": "x.safetensors", "tensor_key": "cache"}}})
    assert index_inputs(dequantize) == set() and unredrawn_data_inputs(dequantize, cache) == ["kv_cache_fp8"]
    decode = Repo(ROOT).definition(DECODE_FP8)
    assert index_inputs(decode) == {"indices"}
    captured = {name: {"type": "safetensors", "path": "x.safetensors", "tensor_key": name}
                for name in ("indices", "k_cache")}
    both = Workload.model_validate({"uuid": "5eed0000-c2", "inputs": captured})
    assert unredrawn_data_inputs(decode, both) == ["k_cache"]


def test_a_packed_cache_left_to_the_default_draw_names_the_generator_that_makes_it():
    """Without `fp8_cache` the int8 cache fell to the default random draw, whose complaint (low < high) pointed at
    giving random bounds: random bytes are no valid FP8 cache."""
    definition, workload = repo_workload(DECODE_FP8, "smoke_sq1")
    record = workload.model_dump(exclude_defaults=True)
    del record["generate"][0]["fp8_cache"]
    with pytest.raises(BindingError) as refused:
        check_workload(definition, Workload.model_validate(record), ROOT / "definitions")
    assert "inputs.k_cache: not given, so drawn at random, and a random int8 input needs low < high" in str(
        refused.value)
    assert "add the generator that makes it" in str(refused.value)


def test_a_captured_model_weight_may_stay_the_same_but_no_other_data_input():
    """A per-head sink is a model weight (`constant: true`): captured (mixed -inf, +inf and finite values per head, which
    no random distribution gives), it is what a serving system keeps across calls. A captured query is not."""
    repo = Repo(ROOT)
    sink = repo.definition(next(name for name in repo.names() if name.startswith("flashmla_sparse_decode_fp8_sink_h64")))
    assert sink.inputs["attn_sink"].constant and not sink.inputs["q"].constant
    sinks = next(w for w in repo.workload_set(sink.name).workloads if "smoke" in w.tags)
    blob = {"type": "safetensors", "path": "x.safetensors", "tensor_key": "x"}

    def capturing(*names):
        record = sinks.model_dump(exclude_defaults=True)
        return Workload.model_validate({**record, "inputs": {**record.get("inputs", {}), **dict.fromkeys(names, blob)}})

    assert unredrawn_data_inputs(sink, capturing("attn_sink")) == []
    assert unredrawn_data_inputs(sink, capturing("attn_sink", "q")) == ["q"]
    # Drawn at random, it is drawn once and kept, as declared: a solution keeping exp(attn_sink) stays right.
    assert "q" in random_inputs(sink, sinks) and "attn_sink" not in random_inputs(sink, sinks)


def test_a_random_model_weight_is_one_weight_in_every_input_set_and_workload():
    """`constant: true` says a solution may keep what it derives from the input. Drawn from each input set's own
    seed, the sink differed between a job's three sets (and between workloads), and a solution that prepared
    exp(attn_sink) on its first call, as a serving system does at load, read INCORRECT_NUMERICAL on input set 1."""
    repo = Repo(ROOT)
    for prefix in ("flashmla_sparse_decode_fp8_sink_h64", "flashmla_sparse_prefill_sink_topklen_h64"):
        sink = repo.definition(next(name for name in repo.names() if name.startswith(prefix)))
        smoke = [w for w in repo.workload_set(sink.name).workloads if "smoke" in w.tags]
        job = JobInputs(sink, smoke[0], [11, 12, 13], "cpu", ROOT / "definitions")
        weights = [job.drawn(i)["attn_sink"] for i in range(3)]
        weights.append(generate_inputs(sink, smoke[1], 14, "cpu", ROOT / "definitions")["attn_sink"])
        assert all(torch.equal(weights[0], other) for other in weights[1:])
        # ...while the other data inputs still differ from set to set
        assert not torch.equal(job.drawn(0)["q"], job.drawn(1)["q"])


# A solution that memoizes per input set what it derives from generated data: it passed while
# generated inputs were public and never changed; now every call's cache differs, and it fails.

MEMO_SOLUTIONS = {
    QUANTIZE: '''
import torch

_memo = {}


def quantize(kv_cache):
    tokens = kv_cache.reshape(-1, 576)
    nope = tokens[:, :512].float().reshape(-1, 4, 128)
    bound = torch.clamp_min(nope.abs().amax(-1) / 448.0, 1e-4)
    mantissa, exponent = torch.frexp(bound)
    scale = torch.ldexp(torch.ones_like(bound), exponent - (mantissa == 0.5).to(exponent.dtype))
    packed = torch.empty(tokens.shape[0], 656, dtype=torch.int8)
    packed[:, :512] = (nope / scale[..., None]).to(torch.float8_e4m3fn).reshape(-1, 512).view(torch.int8)
    packed[:, 512:528] = scale.contiguous().view(torch.int8)
    packed[:, 528:] = tokens[:, 512:].contiguous().view(torch.int8)
    return packed.reshape(*kv_cache.shape[:3], 656)


def run(kv_cache):
    key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
    if key not in _memo:
        _memo[key] = quantize(kv_cache)
    return _memo[key].clone()
''',
    DEQUANTIZE: '''
import torch

_memo = {}


def dequantize(kv_cache_fp8):
    tokens = kv_cache_fp8.reshape(-1, 656)
    nope = tokens[:, :512].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, 4, 128)
    scale = tokens[:, 512:528].contiguous().view(torch.float32)
    out = torch.cat([(nope * scale[..., None]).reshape(-1, 512).to(torch.bfloat16),
                     tokens[:, 528:].contiguous().view(torch.bfloat16)], dim=-1)
    return out.reshape(*kv_cache_fp8.shape[:3], 576)


def run(kv_cache_fp8):
    key = (kv_cache_fp8.data_ptr(), tuple(kv_cache_fp8.shape))
    if key not in _memo:
        _memo[key] = dequantize(kv_cache_fp8)
    return _memo[key].clone()
''',
    # q is random and redrawn each call: this one keeps only the dequantized cache per input set.
    DECODE_FP8: '''
import math

import torch

_keys = {}


def dequantize(rows):
    nope = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, 4, 128)
    scale = rows[:, 512:528].contiguous().view(torch.float32)
    nope = (nope * scale[..., None]).reshape(-1, 512).to(torch.bfloat16)
    return torch.cat([nope, rows[:, 528:].contiguous().view(torch.bfloat16)], dim=-1).float()


def run(q, k_cache, indices, softmax_scale):
    key = (k_cache.data_ptr(), tuple(k_cache.shape))
    if key not in _keys:
        _keys[key] = dequantize(k_cache.reshape(-1, 656))
    cache = _keys[key]
    batch_size, seq_len_q, num_heads, _ = q.shape
    out = torch.zeros(batch_size, seq_len_q, num_heads, 512, dtype=torch.bfloat16)
    lse = torch.full((batch_size, num_heads, seq_len_q), math.inf, dtype=torch.float32)
    for b in range(batch_size):
        idx = indices[b].long()
        valid = idx != -1
        keys = torch.where(valid[..., None], cache[idx.clamp_min(0)], 0.0)
        logits = (q[b].float() @ keys.transpose(1, 2)) * softmax_scale
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)
        seen = valid.any(dim=-1)[:, None]
        row_lse = torch.logsumexp(logits, dim=-1)
        weights = torch.exp(logits - torch.where(seen, row_lse, 0.0)[..., None])
        out[b] = torch.where(seen[..., None], weights @ keys[..., :512], 0.0).to(torch.bfloat16)
        lse[b] = torch.where(seen, row_lse, math.inf).T
    return out, lse
''',
}


def write_memo_solution(folder: Path, definition: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "kernel.py").write_text(MEMO_SOLUTIONS[definition])
    (folder / "solution.yaml").write_text(
        f"name: memoizes_generated\ndefinition: {definition}\nauthor: tests\n"
        "description: Remembers per input set (its buffer's address) what it derives from the generated cache.\n"
        "language: python\nentry_point: kernel.py::run\ndestination_passing_style: false\ndependencies: [torch]\n")
    return folder


@pytest.mark.timeout(600)
@pytest.mark.parametrize("definition", [QUANTIZE, DEQUANTIZE, DECODE_FP8])
def test_a_solution_memoizing_generated_data_per_input_set_fails(definition, tmp_path):
    from flashbench.run import RunOptions, Runner, select_solutions, select_workloads

    repo = Repo(ROOT)
    folder = write_memo_solution(tmp_path / "memoizes_generated", definition)
    # At level process the solution folder under /tmp is the host's; the attack needs no sandbox.
    runner = Runner(repo, definition, RunOptions(device="cpu", iters=3, warmup=0, input_sets=2, timeout=120.0,
                                                 isolation="process", trace_dir=tmp_path / "traces",
                                                 cache_dir=tmp_path / "cache"))
    candidates = runner.candidates(select_solutions(repo, definition, [str(folder)]))
    result = runner.run(candidates[1:], select_workloads(repo, definition, ["smoke"], "cpu"))
    assert len(result.traces) == 2
    for trace in result.traces:
        assert trace.status == "INCORRECT_NUMERICAL", (trace.workload_name, trace.status, trace.message)
        assert trace.message.startswith("timed call"), trace.message  # the sets as drawn: right
