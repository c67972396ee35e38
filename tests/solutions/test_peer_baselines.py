"""The baseline solutions that wrap peer libraries (FlashMLA through the sgl-flash-mla wheel,
FlashInfer), checked without a GPU.

- Every folder validates, is tagged baseline and names its package in `dependencies`.
- Where the package is not installed (this CPU machine), the runner reports MISSING_DEPENDENCY for
  every smoke workload without starting the solution.
- The wrappers' own code (layout conversion, plan caches, convention fix-ups) runs on the CPU
  against stand-ins for the libraries: `flash_mla` answered by the definitions' references (with
  FlashMLA's +inf lse for prefill rows that see nothing), FlashInfer's MLA wrapper by an
  independent CSR implementation, so a wrong block-table conversion or lse layout shows. They also
  check that a plan or scheduler metadata is made once per index set and not again when the
  random inputs are redrawn in place (which bumps the version counter every arena view shares).
"""

import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from flashbench import Repo, generate_inputs
from flashbench.build import missing_dependencies
from flashbench.registry import load_solution_folder
from flashbench.run import RunOptions, Runner, select_solutions, select_workloads
from flashbench.validate import validate
from solution_checks import load_module, nan_tail_case, solution_file

ROOT = Path(__file__).resolve().parents[2]

FLASHMLA_DEFINITIONS = [
    "flashmla_decode_causal_h128_ckv512_kpe64_ps64",
    "flashmla_decode_causal_h16_ckv512_kpe64_ps64",
    "flashmla_sparse_decode_fp8_h128_ckv512_kpe64_ps64_topk2048",
    "flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048",
    "flashmla_sparse_decode_fp8_sink_h128_ckv512_kpe64_ps64_topk2048",
    "flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048",
    "flashmla_sparse_prefill_h128_ckv512_kpe64_topk2048",
    "flashmla_sparse_prefill_h64_ckv512_kpe64_topk2048",
    "flashmla_sparse_prefill_sink_topklen_h128_ckv512_kpe64_topk2048",
    "flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048",
]
FLASHINFER_DEFINITIONS = [
    "flashmla_decode_causal_h128_ckv512_kpe64_ps64",
    "flashmla_decode_causal_h16_ckv512_kpe64_ps64",
    "mha_varlen_prefill_causal_h128_dqk128_dv128",
    "mha_varlen_prefill_causal_h128_dqk192_dv128",
    "mla_paged_decode_h16_ckv512_kpe64_ps1",
    "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1",
]
PEERS = ([(d, "flashmla", "flash_mla") for d in FLASHMLA_DEFINITIONS]
         + [(d, "flashinfer_fa3", "flashinfer") for d in FLASHINFER_DEFINITIONS])


def folder(definition, name):
    return ROOT / "solutions" / definition / name


@pytest.mark.parametrize("definition, name, package", PEERS)
def test_peer_folder_validates_as_a_baseline(definition, name, package):
    results = validate(Repo(ROOT), [folder(definition, name)])
    assert [r.kind for r in results] == ["solution"] and results[0].ok, results
    solution = load_solution_folder(folder(definition, name)).solution
    assert solution.definition == definition and solution.name == name
    assert "baseline" in solution.tags
    assert solution.dependencies == [package]
    assert solution.language == "python"


@pytest.mark.parametrize("package", ["flash_mla", "flashinfer"])
def test_missing_peer_is_reported_without_running(package, tmp_path):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    repo = Repo(ROOT)
    options = RunOptions(device="cpu", iters=1, warmup=0, input_sets=1, timeout=60, trace_dir=tmp_path,
                         cache_dir=tmp_path, save=False)
    for definition, name, dependency in PEERS:
        if dependency != package:
            continue
        (candidate,) = select_solutions(repo, definition, [name])
        assert missing_dependencies(candidate.solution) == [package]
        if definition.startswith(("flashmla_decode_causal_h16", "flashmla_sparse_prefill_h64")):
            runner = Runner(repo, definition, options)
            workloads = select_workloads(repo, definition, [], "cpu")
            result = runner.run(runner.candidates([candidate])[1:], workloads)
            assert [t.status for t in result.traces] == ["MISSING_DEPENDENCY"] * len(workloads)
            assert all(package in t.message for t in result.traces)


# --- the wrappers' own code, on stand-ins for the libraries ----------------------------------------

def arena_views(values):
    """The tensors copied into one byte buffer and given back as views of it, as the worker sees its
    inputs: views of one storage share one version counter."""
    sizes = [(v.numel() * v.element_size() + 63) // 64 * 64 if isinstance(v, torch.Tensor) else 0 for v in values]
    memory = torch.zeros(max(sum(sizes), 64), dtype=torch.uint8)
    views, offset = [], 0
    for value, size in zip(values, sizes):
        if isinstance(value, torch.Tensor):
            view = memory[offset:offset + value.numel() * value.element_size()].view(value.dtype).view(value.shape)
            view.copy_(value)
            value = view
        views.append(value)
        offset += size
    return views


def smoke_inputs(definition):
    """Each smoke workload's inputs (generated as the runner does), in definition order, as views
    of one buffer."""
    repo = Repo(ROOT)
    d = repo.definition(definition)
    base = repo.definition_path(definition).parent
    for workload in select_workloads(repo, definition, [], "cpu"):
        inputs = generate_inputs(d, workload, seed=3, base_dir=base)
        yield workload.name, arena_views([inputs[name] for name in d.inputs])


def reference(definition):
    return load_module(f"ref_{definition}", ROOT / Repo(ROOT).definition(definition).reference)


def redraw(tensor):
    """An in-place change of a random input, as the harness makes between calls."""
    tensor.copy_(torch.randn(tensor.shape).to(tensor.dtype))


def close(actual, expected, atol=1e-2, rtol=2e-2):
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, equal_nan=False)


class FakeFlashMLA(types.ModuleType):
    """flash_mla with the definitions' references behind its entry points, FlashMLA's conventions
    (lse +inf for a sparse-prefill row with no valid entry) and call counts."""

    class SchedMeta:
        def __init__(self):
            self.filled = False

    def __init__(self):
        super().__init__("flash_mla")
        self.metas_made = 0
        self.calls = []

    def get_mla_metadata(self, *args, **kwargs):
        self.metas_made += 1
        return FakeFlashMLA.SchedMeta(), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits=None,
                               softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                               attn_sink=None, use_legacy=False, **kwargs):
        assert use_legacy and head_dim_v == 512 and isinstance(meta, FakeFlashMLA.SchedMeta)
        self.calls.append(meta.filled)
        meta.filled = True
        if indices is None:  # dense bf16 decode
            assert causal == (q.shape[1] > 1) and not is_fp8_kvcache
            return reference("flashmla_decode_causal_h16_ckv512_kpe64_ps64").run(q, k_cache, block_table,
                                                                                 cache_seqlens, softmax_scale)
        assert is_fp8_kvcache and block_table is None and cache_seqlens is None and not causal
        if attn_sink is None:
            return reference("flashmla_sparse_decode_fp8_h64_ckv512_kpe64_ps64_topk2048").run(
                q, k_cache, indices, softmax_scale)
        return reference("flashmla_sparse_decode_fp8_sink_h64_ckv512_kpe64_ps64_topk2048").run(
            q, k_cache, indices, softmax_scale, attn_sink)

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                             use_legacy=False, return_log2_lse=None):
        assert use_legacy and return_log2_lse is True and d_v == 512
        self.calls.append(True)
        if attn_sink is None and topk_length is None:
            out, max_logits, lse = reference("flashmla_sparse_prefill_h64_ckv512_kpe64_topk2048").run(
                q, kv, indices, sm_scale)
        else:
            out, max_logits, lse = reference("flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048").run(
                q, kv, indices, sm_scale, attn_sink, topk_length)
        lse = torch.where(torch.isneginf(lse), math.inf, lse)  # FlashMLA's kernel: +inf where nothing is valid
        return [out, max_logits, lse]


@pytest.mark.parametrize("definition", FLASHMLA_DEFINITIONS)
def test_flashmla_wrapper_on_a_stand_in(definition, monkeypatch):
    fake = FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    kernel = load_module(f"flashmla_{definition}", solution_file(definition, "flashmla"))
    entry = getattr(kernel, load_solution_folder(folder(definition, "flashmla")).solution.entry_function)
    ref = reference(definition)
    sparse_prefill = "sparse_prefill" in definition
    cases = dead_rows = 0
    for name, inputs in smoke_inputs(definition):
        expected = ref.run(*inputs)
        if sparse_prefill:
            dead_rows += int(torch.isneginf(expected[2]).any(dim=1).sum())
        for call in range(2):
            got = entry(*inputs)
            assert len(got) == len(expected)
            for actual, wanted in zip(got, expected):
                assert actual.shape == wanted.shape and actual.dtype == wanted.dtype
                if actual.dtype == torch.float32:  # lse and max_logits: infinities in the same places
                    assert torch.equal(torch.isinf(actual), torch.isinf(wanted)), (name, call)
                    assert torch.equal(actual[torch.isinf(actual)], wanted[torch.isinf(wanted)]), (name, call)
                    finite = torch.isfinite(wanted)
                    close(actual[finite], wanted[finite], atol=1e-4, rtol=1e-5)
                else:
                    close(actual, wanted)
            redraw(inputs[0])  # q: bumps the version counter of every view of the same storage
            expected = ref.run(*inputs)
        cases += 1
    assert cases >= 2
    # Every call after an index set's first found its state by identity (a version counter in the
    # key would miss after each redraw and add an identity per call).
    identities = kernel._dead_rows if sparse_prefill else getattr(kernel, "_by_identity", getattr(kernel, "_metas", None))
    assert len(identities) == cases
    if sparse_prefill:
        assert dead_rows > 0  # the smoke workloads have query tokens without a valid entry: the +inf fix-up runs
    else:
        # One schedule per index set, made by its first call and reused by the next.
        assert fake.metas_made == cases
        assert fake.calls == [False, True] * cases


class FakeMLAWrapper:
    """FlashInfer's BatchMLAPagedAttentionWrapper computed from the CSR page lists it is planned with."""

    plans = 0

    def __init__(self, workspace, backend="auto"):
        assert backend == "fa3"

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
             q_data_type, kv_data_type, query_layout="packed", kv_cache_layout="packed", lse_mode="none"):
        FakeMLAWrapper.plans += 1
        for t in (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_len_arr):
            assert t.dtype == torch.int32
        self.qo = metadata.qo_indptr.tolist()
        self.kv = metadata.kv_indptr.tolist()
        self.pages = metadata.kv_indices.long()
        self.lengths = metadata.kv_len_arr.tolist()
        self.heads, self.dims, self.page_size = num_heads, (head_dim_ckv, head_dim_kpe), page_size
        self.causal, self.sm_scale, self.lse_mode = causal, sm_scale, lse_mode
        assert query_layout == kv_cache_layout == "packed" and lse_mode == "basee"

    def run(self, *, query, kv_cache, out, lse, return_lse, return_lse_base_on_e):
        assert return_lse and return_lse_base_on_e
        ckv = self.dims[0]
        assert query.shape[-1] == kv_cache.shape[-1] == sum(self.dims) and kv_cache.shape[1] == self.page_size
        assert out.shape == (query.shape[0], self.heads, ckv) and lse.shape == (query.shape[0], self.heads)
        for b in range(len(self.lengths)):
            rows = slice(self.qo[b], self.qo[b + 1])
            q_len, kv_len = self.qo[b + 1] - self.qo[b], self.lengths[b]
            keys = kv_cache[self.pages[self.kv[b]:self.kv[b + 1]]].reshape(-1, kv_cache.shape[-1])[:kv_len].float()
            logits = torch.einsum("qhd,kd->qhk", query[rows].float(), keys) * self.sm_scale
            if self.causal:
                visible = torch.arange(kv_len)[None, :] <= kv_len - q_len + torch.arange(q_len)[:, None]
                logits = logits.masked_fill(~visible[:, None, :], -math.inf)
            row_lse = torch.logsumexp(logits, dim=-1)
            out[rows] = (torch.exp(logits - row_lse[..., None]) @ keys[:, :ckv]).to(out.dtype)
            lse[rows] = row_lse
        return out, lse


class FakeRaggedWrapper:
    """FlashInfer's BatchPrefillWithRaggedKVCacheWrapper answered by the varlen reference (base-2 lse
    from the kernel, rescaled for lse_base="ln" as FlashInfer does)."""

    plans = 0

    def __init__(self, workspace, kv_layout="NHD", backend="auto"):
        assert kv_layout == "NHD" and backend == "fa3"

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             causal=False, sm_scale=None, q_data_type=None, kv_data_type=None):
        FakeRaggedWrapper.plans += 1
        assert causal and qo_indptr.dtype == kv_indptr.dtype == torch.int32
        self.qo, self.kv, self.sm_scale = qo_indptr.clone(), kv_indptr.clone(), sm_scale

    def run(self, q, k, v, out=None, lse=None, return_lse=False, lse_base="log2"):
        assert return_lse and lse_base == "ln"
        o, l = reference("mha_varlen_prefill_causal_h128_dqk128_dv128").run(q, k, v, self.qo, self.kv, self.sm_scale)
        out.copy_(o)
        lse.copy_(l / math.log(2.0))  # the kernel's base 2 ...
        lse.mul_(math.log(2.0))  # ... made natural in place by FlashInfer's run
        return out, lse


def fake_flashinfer(monkeypatch):
    FakeMLAWrapper.plans = FakeRaggedWrapper.plans = 0
    package = types.ModuleType("flashinfer")
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    mla.MLAPlanMetadata = types.SimpleNamespace(csr=lambda qo, kv, idx, lens: types.SimpleNamespace(
        qo_indptr=qo, kv_indptr=kv, kv_indices=idx, kv_len_arr=lens))
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.BatchPrefillWithRaggedKVCacheWrapper = FakeRaggedWrapper
    package.mla, package.prefill = mla, prefill
    for name, module in [("flashinfer", package), ("flashinfer.mla", mla), ("flashinfer.prefill", prefill)]:
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("definition", FLASHINFER_DEFINITIONS[:4])
def test_flashinfer_wrapper_on_a_stand_in(definition, monkeypatch):
    fake_flashinfer(monkeypatch)
    kernel = load_module(f"flashinfer_{definition}", solution_file(definition, "flashinfer_fa3"))
    ref = reference(definition)
    cases = 0
    for name, inputs in smoke_inputs(definition):
        for call in range(3):
            expected = ref.run(*inputs)
            out = torch.full_like(expected[0], math.nan)
            lse = torch.full_like(expected[1], math.nan)
            assert kernel.run(*inputs, out, lse) is None
            close(out, expected[0])
            close(lse, expected[1], atol=1e-4, rtol=1e-5)
            redraw(inputs[0])
        cases += 1
    assert cases >= 1
    assert FakeMLAWrapper.plans + FakeRaggedWrapper.plans == cases  # one plan per index set
    assert len(kernel._by_identity) == cases  # found by identity after the first call, despite the redraws


def test_flashinfer_decode_never_reads_unused_table_slots(monkeypatch):
    """Block tails past each length NaN and unused table slots -1: the CSR page lists skip both."""
    fake_flashinfer(monkeypatch)
    definition = "flashmla_decode_causal_h16_ckv512_kpe64_ps64"
    kernel = load_module("flashinfer_nan_tails", solution_file(definition, "flashinfer_fa3"))
    inputs = list(nan_tail_case())
    table, k_cache = inputs[2], inputs[1]
    unused = sorted(set(range(k_cache.shape[0])) - set(table[table >= 0].tolist()))
    k_cache[unused] = math.nan
    expected = reference(definition).run(*inputs)
    out, lse = torch.empty_like(expected[0]), torch.empty_like(expected[1])
    kernel.run(*inputs, out, lse)
    close(out, expected[0])
    close(lse, expected[1], atol=1e-4, rtol=1e-5)
