"""Structured generators: inputs that must agree with each other, made together.

A generator takes its spec (a model in flashbench.model.workload) and a numpy random
generator, and returns tensors by input name plus the axis values it decides. New op
families register theirs with @register("name").

Index structure (lengths, page tables, index sets) comes from that generator, seeded by the
workload alone: every run and every solution sees the same structure. Data (values a solution
computes with, e.g. an FP8 KV cache) must not be public nor fixed: a generator that makes data
registers with @register("name", data=describe), takes a third argument, a DataSource (a torch generator
seeded by the input set's secret seed, on the device the inputs are for; None for shapes only: its data
outputs are made on "meta", nothing drawn, so that checking a workload costs its index structure, not its
data), and `describe(spec, rng)`
says which of its outputs are data and how a call redraws a window of each (GeneratedData),
recomputing from the structure's generator whatever the window needs (which rows carry data).

What a generator guarantees of its index structure is also a rule (IndexRule, @register("name",
rules=...)) for the same structure captured in a workload instead of made: the definitions' constraints
bound values, and let through structures no generator makes, on which the reference computes garbage.
"""

import functools
import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..model import Lengths, PagedKV
from ..model.workload import (BlockTable, FP8KVCache, KVCacheValues, SparseDecodeIndices, SparsePrefillIndices,
                              Varlen)
from .tensors import captured_memory_budget

GeneratedInputs = tuple[dict[str, torch.Tensor], dict[str, int]]
INT32_MAX = 2**31 - 1  # generated index tensors are int32
GENERATORS: dict[str, Callable[..., GeneratedInputs]] = {}


@dataclass(frozen=True)
class GeneratedData:
    """A generated input that carries data. Every call redraws a window of it in place: whole rows
    of `width` elements (the tensor viewed as [-1, width]), at most REDRAW_WINDOW_BYTES of them,
    taken from `fresh(count, generator, device)`: `count` new rows, valid as the generator's own
    are (quantised as it quantises, scales included), the same for the same torch generator state.
    `rows` are the rows that carry data, in the order windows run over them (None: every row);
    the others (e.g. poisoned tokens no valid index reaches) are never rewritten. A generated input
    that cannot be redrawn validly has fresh=None and says why in `fixed`: unredrawn_data_inputs
    lists it, and another data input of its definition must change per call."""

    width: int
    fresh: Callable[[int, torch.Generator, str], torch.Tensor] | None
    rows: torch.Tensor | None = None
    fixed: str = ""

    def on(self, device) -> "GeneratedData":
        return self if self.rows is None else replace(self, rows=self.rows.to(device))


@dataclass(frozen=True)
class DataSource:
    """Where a generator draws its data: `generator`, seeded by the input set's secret seed, on `device`, where
    the inputs are made (a cache of 10^5 tokens took seconds a set in numpy on the host)."""

    generator: torch.Generator
    device: str

    @classmethod
    def seeded(cls, seed: int, device: str) -> "DataSource":
        return cls(torch.Generator(device=device).manual_seed(seed), device)


DescribeData = Callable[..., dict[str, GeneratedData]]
DATA_OUTPUTS: dict[str, DescribeData] = {}


@dataclass(frozen=True)
class IndexRule:
    """What a generator's index structure is, for the same inputs captured: it applies to a definition that has
    `inputs` (name: rank, as the generator makes them) as integer tensors and `axes`, and `check(arrays, axes)`
    (those inputs as numpy arrays, the bound axes) raises ValueError naming the input at fault. Entries a
    definition never reads (table slots past a request's blocks) are left to its constraints, which state its
    invalid-entry convention (-1, or ids past the cache)."""

    inputs: dict[str, int]
    axes: tuple[str, ...]
    check: Callable[[dict[str, np.ndarray], dict[str, int]], None]


INDEX_RULES: list[IndexRule] = []


def register(name: str, data: DescribeData | None = None, rules: tuple[IndexRule, ...] = ()):
    """`data(spec, rng)`: the generator's data outputs for `spec` (rng as the generator gets it); `rules`: what
    its index structure is (IndexRule)."""
    def add(func):
        GENERATORS[name] = func
        if data is not None:
            DATA_OUTPUTS[name] = data
        INDEX_RULES.extend(rules)
        return func
    return add


def shape_only(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A data output when no data is drawn (no DataSource): its shape and dtype, on "meta"."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _host_room(what: str, nbytes: int) -> None:
    """ValueError where making `what` would take more of the host's memory than one workload's inputs may
    (captured_memory_budget): index structure is made for real wherever a workload is checked, before its sizes are
    weighed, and a page pool of 2^31 took 16 GB to order."""
    budget = captured_memory_budget()
    if nbytes > budget:
        raise ValueError(f"{what} takes {nbytes:,} bytes to make, more than the {budget:,} of this machine's memory "
                         "(a sixteenth) one workload's inputs may")


def _refuse_first(name: str, values: np.ndarray, bad: np.ndarray, why: str) -> None:
    """ValueError naming the first entry of input `name` that is `bad`, its value and `why` it may not be."""
    if bad.any():
        at = tuple(int(i) for i in np.unravel_index(np.argmax(bad), bad.shape))
        raise ValueError(f"inputs.{name}: {name}[{', '.join(map(str, at))}] is {values[at]}, {why}")


def sample_lengths(spec: Lengths, rng: np.random.Generator) -> np.ndarray:
    """Per-request lengths drawn as the spec says, as int64; ValueError past int32, which the index tensors made
    from them are (a length of 2^32 became 0)."""
    lengths = _draw_lengths(spec, rng)
    if len(lengths) and lengths.max() > INT32_MAX:
        raise ValueError(f"a length of {lengths.max()} is past int32, the index tensors' dtype")
    return lengths


def _draw_lengths(spec: Lengths, rng: np.random.Generator) -> np.ndarray:
    kind = spec.distribution
    _host_room(f"{spec.count} lengths", 16 * spec.count)  # normal draws are float64, then int64
    if kind == "list":
        return np.asarray(spec.values, dtype=np.int64)
    if kind == "fixed":
        return np.full(spec.count, spec.value, dtype=np.int64)
    if kind == "uniform":
        return rng.integers(spec.low, spec.high + 1, size=spec.count, dtype=np.int64)
    if kind == "normal":
        draws = rng.normal(spec.mean, spec.std, size=spec.count)
    else:  # skewed: log-normal around the median, a long tail of long requests
        draws = rng.lognormal(np.log(max(spec.median, 1.0)), spec.sigma, size=spec.count)
    return np.clip(np.rint(draws), spec.low, spec.high).astype(np.int64)


def _prefixed_lengths(spec: PagedKV | Varlen | SparsePrefillIndices, rng: np.random.Generator,
                      unit: str) -> tuple[np.ndarray, np.ndarray]:
    """(query lengths, key lengths: each `unit`'s cached prefix plus its queries), drawn in that order."""
    q_lens = sample_lengths(spec.q_lens, rng)
    prefix = sample_lengths(spec.prefix_lens, rng) if spec.prefix_lens else np.zeros_like(q_lens)
    if len(prefix) != len(q_lens):
        raise ValueError(f"prefix_lens gives {len(prefix)} {unit} but q_lens gives {len(q_lens)}")
    return q_lens, prefix + q_lens


def _indptr(lengths: np.ndarray) -> torch.Tensor:
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if offsets.max() > INT32_MAX:  # each length is within int32, so a sum that wraps passes this first
        raise ValueError(f"the lengths add up past int32 ({INT32_MAX}), the offsets' dtype")
    return torch.from_numpy(offsets.astype(np.int32))


def _check_indptr(name: str, indptr: np.ndarray, end: int, what: str) -> np.ndarray:
    """Offsets as _indptr makes them: from 0 to `end` (`what` says what that is), never decreasing (a request may
    be empty); ValueError naming input `name` otherwise. Returns the lengths they give, entry by entry: that of
    the request an entry ends (0 for the first)."""
    if len(indptr) == 0 or indptr[0] != 0:
        raise ValueError(f"inputs.{name}: starts with {indptr[0] if len(indptr) else 'nothing'}, not 0")
    # Compared, not subtracted: int64 differences wrap (0, 2^63 - 1, -2^63 went "up" by 1).
    down = np.concatenate([[False], indptr[1:] < indptr[:-1]])
    _refuse_first(name, indptr, down, "less than the offset before it: a request of negative length")
    if indptr[-1] != end:
        raise ValueError(f"inputs.{name}: ends at {indptr[-1]}, but {what} is {end}")
    return np.diff(indptr.astype(np.int64), prepend=0)  # from 0 up to `end`: no difference wraps


def check_paged_kv(arrays: dict[str, np.ndarray], axes: dict[str, int]) -> None:
    """paged_kv's: kv_indptr offsets into kv_indices, which holds pages of the pool."""
    indices, pages = arrays["kv_indices"], axes["num_pages"]
    _check_indptr("kv_indptr", arrays["kv_indptr"], len(indices), "the length of kv_indices")
    _refuse_first("kv_indices", indices, (indices < 0) | (indices >= pages), f"not one of the {pages} pages")


def check_query_offsets(arrays: dict[str, np.ndarray], axes: dict[str, int]) -> None:
    """paged_kv's (prefill): qo_indptr offsets into the queries."""
    _check_indptr("qo_indptr", arrays["qo_indptr"], axes["total_q"], "total_q")


@register("paged_kv", rules=(IndexRule({"kv_indptr": 1, "kv_indices": 1}, ("num_pages",), check_paged_kv),
                             IndexRule({"qo_indptr": 1}, ("total_q",), check_query_offsets)))
def paged_kv(spec: PagedKV, rng: np.random.Generator) -> GeneratedInputs:
    tensors: dict[str, torch.Tensor] = {}
    axes: dict[str, int] = {}
    if spec.q_lens is not None:
        q_lens, kv_lens = _prefixed_lengths(spec, rng, "requests")
        tensors["qo_indptr"] = _indptr(q_lens)
        axes["total_q"] = int(q_lens.sum())
    else:
        kv_lens = sample_lengths(spec.kv_lens, rng)
        axes["batch_size"] = len(kv_lens)
    total = int(kv_lens.sum())
    pool = spec.page_pool or max(total, 1)
    if pool < total:
        raise ValueError(f"page_pool {pool} is smaller than the {total} KV tokens it must hold")
    tensors["kv_indptr"] = _indptr(kv_lens)
    # Real caches hand out pages in no particular order: a random permutation of the pool.
    _host_room(f"a pool of {pool} pages", 8 * pool)  # its order, drawn whole
    tensors["kv_indices"] = torch.from_numpy(rng.permutation(pool)[:total].astype(np.int32))
    axes["num_pages"] = pool
    return tensors, axes


def _blocks_per_request(lengths: np.ndarray, block_size: int) -> np.ndarray:
    return -(-lengths // block_size)  # rounded up


def _used_slots(blocks: np.ndarray, width: int) -> np.ndarray:
    """[requests, width]: the table slots that hold each request's blocks, its first ones."""
    return np.arange(width)[None, :] < blocks[:, None]


def check_block_table(arrays: dict[str, np.ndarray], axes: dict[str, int]) -> None:
    """block_table's: each request's first blocks (as many as its cache_seqlens fill) are blocks of the pool."""
    table, seqlens, pool = arrays["block_table"], arrays["cache_seqlens"], axes["num_blocks"]
    if len(seqlens) != len(table):
        raise ValueError(f"inputs.cache_seqlens: {len(seqlens)} requests, but block_table has {len(table)} rows")
    _refuse_first("cache_seqlens", seqlens, seqlens < 0, "a negative length")
    blocks = _blocks_per_request(seqlens.astype(np.int64), axes["page_block_size"])
    width = table.shape[1]
    _refuse_first("cache_seqlens", seqlens, blocks > width, f"more blocks than the table's {width} slots")
    _refuse_first("block_table", table, _used_slots(blocks, width) & ((table < 0) | (table >= pool)),
                  f"a slot its request's cache_seqlens fills, yet not one of the {pool} blocks")


@register("block_table", rules=(IndexRule({"block_table": 2, "cache_seqlens": 1}, ("num_blocks", "page_block_size"),
                                          check_block_table),))
def block_table(spec: BlockTable, rng: np.random.Generator) -> GeneratedInputs:
    seqlens = sample_lengths(spec.seqlens, rng)
    blocks = _blocks_per_request(seqlens, spec.block_size)
    needed = int(blocks.sum())
    pool = spec.block_pool or max(needed, 1)
    if pool < needed:
        raise ValueError(f"block_pool {pool} is smaller than the {needed} blocks the requests need")
    longest = int(blocks.max()) if len(blocks) else 0
    width = spec.max_blocks_per_seq or max(longest, 1)
    if width < longest:
        raise ValueError(f"max_blocks_per_seq {width} is smaller than the longest request's {longest} blocks")
    if 0 <= spec.unused < pool:
        raise ValueError(f"unused {spec.unused} is a real block id (the pool has {pool}); use -1 (or an id past the "
                         "pool where the definition allows one)")
    # Real caches hand out blocks in no particular order: a random permutation of the pool.
    _host_room(f"a pool of {pool} blocks and a table of {len(seqlens)} x {width}", 8 * pool + 4 * len(seqlens) * width)
    ids = rng.permutation(pool)[:needed].astype(np.int32)
    table = np.full((len(seqlens), width), spec.unused, dtype=np.int32)
    table[_used_slots(blocks, width)] = ids  # row-major: request after request, each one's blocks in order
    tensors = {
        "block_table": torch.from_numpy(table),
        "cache_seqlens": torch.from_numpy(seqlens.astype(np.int32)),
    }
    axes = {"batch_size": len(seqlens), "num_blocks": pool, "max_blocks_per_seq": width,
            "page_block_size": spec.block_size}
    return tensors, axes


def check_varlen(arrays: dict[str, np.ndarray], axes: dict[str, int]) -> None:
    """varlen's: offsets into the queries and into the keys, each sequence with at least as many keys as queries."""
    q_lens = _check_indptr("cu_seqlens_q", arrays["cu_seqlens_q"], axes["total_q"], "total_q")
    k_lens = _check_indptr("cu_seqlens_k", arrays["cu_seqlens_k"], axes["total_k"], "total_k")
    if len(k_lens) != len(q_lens):
        raise ValueError(f"inputs.cu_seqlens_k: {len(k_lens)} offsets, but cu_seqlens_q has {len(q_lens)}")
    _refuse_first("cu_seqlens_k", arrays["cu_seqlens_k"], k_lens < q_lens,
                  "leaving the sequence it ends fewer keys than queries")


@register("varlen", rules=(IndexRule({"cu_seqlens_q": 1, "cu_seqlens_k": 1}, ("total_q", "total_k"), check_varlen),))
def varlen(spec: Varlen, rng: np.random.Generator) -> GeneratedInputs:
    q_lens, k_lens = _prefixed_lengths(spec, rng, "sequences")
    tensors = {"cu_seqlens_q": _indptr(q_lens), "cu_seqlens_k": _indptr(k_lens)}
    axes = {"total_q": int(q_lens.sum()), "total_k": int(k_lens.sum())}
    return tensors, axes


# Sparse attention (FlashMLA's DSA kernels): top-k index sets and FP8 KV caches.

FP8_QUANTIZE_REFERENCE = Path("references/flashmla_sparse/flashmla_sparse_fp8_quantize_ckv512_kpe64_ps64.py")
MLA_HEAD_DIM, MLA_LATENT, MLA_TILE = 576, 512, 128
MLA_FP8_BYTES = MLA_LATENT + 4 * (MLA_LATENT // MLA_TILE) + 2 * (MLA_HEAD_DIM - MLA_LATENT)  # 656 per packed token


@functools.cache
def fp8_quantize() -> Callable[[torch.Tensor], torch.Tensor]:
    """The FP8 quantize reference's run: the one statement of the cache format, loaded by path
    from this checkout, else from the repository (find_root: a worker is told it in FLASHBENCH_ROOT)."""
    candidates = [Path(__file__).resolve().parents[2] / FP8_QUANTIZE_REFERENCE]
    try:
        from ..registry import find_root

        candidates.append(find_root() / FP8_QUANTIZE_REFERENCE)
    except Exception:
        pass
    for path in candidates:
        if path.is_file():
            spec = importlib.util.spec_from_file_location("flashbench_fp8_quantize_reference", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.run
    raise ValueError(f"the FP8 quantize reference {FP8_QUANTIZE_REFERENCE} is not in this repository")


# MLA cache tokens, whole caches and redrawn windows (GeneratedData.fresh) alike: drawn in torch on the inputs'
# device, every token on its own (a cache whose slots shared a few thousand distinct tokens let a solution
# quantise or dequantise those once a call and gather the rest: docs/threat_model.md, class 4), chunk by
# chunk so that the float32 work space stays under ~0.5 GiB however many tokens are drawn.
FRESH_CHUNK_TOKENS = 1 << 16


def fresh_mla_tokens(spec: KVCacheValues, count: int, generator: torch.Generator, device) -> torch.Tensor:
    """[count, 576] bfloat16 tokens as a KVCacheValues describes them (tile magnitudes 2^u, u uniform in
    [-spread/2, spread/2]; boundary tiles; zero tokens), every one drawn on its own."""
    return _in_chunks(count, MLA_HEAD_DIM, torch.bfloat16, device,
                      lambda n: _fresh_token_values(spec, n, generator, device).to(torch.bfloat16))


def fresh_mla_fp8_tokens(spec: KVCacheValues, count: int, generator: torch.Generator, device) -> torch.Tensor:
    """[count, 656] packed FP8 tokens (int8 bytes): fresh_mla_tokens' tokens quantised by the quantize
    reference, scales included."""
    def chunk(n: int) -> torch.Tensor:
        tokens = _fresh_token_values(spec, n, generator, device).to(torch.bfloat16)
        return fp8_quantize()(tokens.view(n, 1, 1, MLA_HEAD_DIM)).view(n, -1)
    return _in_chunks(count, MLA_FP8_BYTES, torch.int8, device, chunk)


def _in_chunks(count: int, width: int, dtype: torch.dtype, device, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    out = torch.empty(count, width, dtype=dtype, device=device)
    for start in range(0, count, FRESH_CHUNK_TOKENS):
        n = min(FRESH_CHUNK_TOKENS, count - start)
        out[start:start + n] = make(n)
    return out


def _fresh_token_values(spec: KVCacheValues, n: int, generator: torch.Generator, device) -> torch.Tensor:
    """fresh_mla_tokens' draw, float32 (no host synchronisation: masks, not nonzero)."""
    values = torch.randn(n, MLA_HEAD_DIM, generator=generator, device=device, dtype=torch.float32)
    tiles = values[:, :MLA_LATENT].unflatten(-1, (MLA_LATENT // MLA_TILE, MLA_TILE))  # a view
    half = spec.spread / 2
    tile_shape = (n, MLA_LATENT // MLA_TILE, 1)
    exponents = torch.rand(tile_shape, generator=generator, device=device, dtype=torch.float32) * (2 * half) - half
    tiles.mul_(torch.exp2(exponents))
    if spec.boundary_tiles > 0:
        chosen = torch.rand(tile_shape, generator=generator, device=device, dtype=torch.float32) < spec.boundary_tiles
        largest = tiles.abs().argmax(dim=-1, keepdim=True)
        peak = tiles.gather(-1, largest)
        # the next 448 * 2^k at or above the tile's largest |value|: its scale is exactly 2^k
        bound = 448.0 * torch.exp2(torch.ceil(torch.log2(peak.abs().clamp_min(1e-30) / 448.0)))
        tiles.scatter_(-1, largest, torch.where(chosen, torch.copysign(bound, peak), peak))
    if spec.zero_tokens > 0:
        zero = torch.rand(n, 1, generator=generator, device=device, dtype=torch.float32) < spec.zero_tokens
        values = torch.where(zero, 0.0, values)
    return values


def _nan_token_bytes(bytes_per_token: int) -> torch.Tensor:
    """One packed FP8 token whose every field is NaN: e4m3 0x7F, float32 and bfloat16 NaNs."""
    row = torch.full((bytes_per_token,), 0x7F, dtype=torch.int8)
    row[MLA_LATENT:MLA_LATENT + 16] = torch.full((4,), float("nan"), dtype=torch.float32).view(torch.int8)
    row[MLA_LATENT + 16:] = torch.full(((bytes_per_token - MLA_LATENT - 16) // 2,), float("nan"),
                                       dtype=torch.bfloat16).view(torch.int8)
    return row


def random_subsets(rng: np.random.Generator, visible: np.ndarray, k: int) -> np.ndarray:
    """[rows, k]: row r holds min(k, visible[r]) distinct positions out of 0..visible[r]-1 in
    random order, then -1s. When more than k are visible, a top-k as an indexer returns it: the
    k // 4 most recent positions and one at random from each of k - k // 4 equal strata of the
    older ones (a local window plus keys spread over the whole context)."""
    visible = np.asarray(visible, dtype=np.int64)
    _host_room(f"{len(visible)} rows of {k} indices", 32 * len(visible) * k)  # the output and the strata's work
    out = np.full((len(visible), k), -1, dtype=np.int64)
    for row in np.nonzero(visible <= k)[0].tolist():  # every visible position, shuffled
        out[row, :visible[row]] = rng.permutation(visible[row])
    many = np.nonzero(visible > k)[0]
    if len(many):
        window, spread = k // 4, k - k // 4
        v = visible[many, None]
        recent = v - 1 - np.arange(window)[None, :]
        older = v - window  # positions 0..older-1 in `spread` strata of at least one position each
        bounds = (np.arange(spread + 1)[None, :] * older) // spread
        picks = bounds[:, :-1] + (rng.random((len(many), spread)) * (bounds[:, 1:] - bounds[:, :-1])).astype(np.int64)
        out[many] = rng.permuted(np.concatenate([recent, picks], axis=1), axis=1)
    return out


def _empty_rows(rng: np.random.Generator, rows: int, wanted: int) -> np.ndarray:
    if wanted > rows:
        raise ValueError(f"empty_queries {wanted} is more than the {rows} query tokens")
    return rng.choice(rows, size=wanted, replace=False)


def check_prefill_indices(arrays: dict[str, np.ndarray], axes: dict[str, int]) -> None:
    """sparse_prefill_indices': ids into the packed keys; -1 and ids >= seq_len_kv are invalid, nothing else is."""
    indices = arrays["indices"]
    _refuse_first("indices", indices, indices < -1, f"neither a key id nor invalid (-1, or >= {axes['seq_len_kv']})")


def check_topk_length(arrays: dict[str, np.ndarray], axes: dict[str, int]) -> None:
    """sparse_prefill_indices' (topk_length): how many of a query's topk entries count."""
    length, topk = arrays["topk_length"], axes["topk"]
    _refuse_first("topk_length", length, (length < 0) | (length > topk), f"not a count of 0 to topk ({topk}) entries")


@register("sparse_prefill_indices", rules=(IndexRule({"indices": 3}, ("seq_len_kv",), check_prefill_indices),
                                           IndexRule({"topk_length": 1}, ("topk",), check_topk_length)))
def sparse_prefill_indices(spec: SparsePrefillIndices, rng: np.random.Generator) -> GeneratedInputs:
    q_lens, kv_lens = _prefixed_lengths(spec, rng, "requests")
    seq_len_q, seq_len_kv, topk = int(q_lens.sum()), int(kv_lens.sum()), spec.topk
    request = np.repeat(np.arange(len(q_lens)), q_lens)
    first_query = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64)
    first_key = np.concatenate([[0], np.cumsum(kv_lens)[:-1]]).astype(np.int64)
    # causal: query token i of a request sees its request's keys 0..prefix + i
    visible = (kv_lens - q_lens)[request] + np.arange(seq_len_q) - first_query[request] + 1
    visible[_empty_rows(rng, seq_len_q, spec.empty_queries)] = 0
    indices = random_subsets(rng, visible, topk)
    valid = indices >= 0
    indices += np.where(valid, first_key[request, None], 0)  # positions -> ids into the packed keys
    if spec.invalid == "mixed":  # FlashMLA ignores -1 and any id >= seq_len_kv alike: a third of each
        row, col = np.nonzero(~valid)
        kind = rng.integers(0, 3, size=len(row))
        indices[row, col] = np.where(kind == 1, seq_len_kv + rng.integers(0, 65536, size=len(row)),
                                     np.where(kind == 2, INT32_MAX, -1))
    if spec.scatter:
        indices = rng.permuted(indices, axis=1)
    tensors = {}
    if spec.topk_length:
        valid = (indices >= 0) & (indices < seq_len_kv)
        length = np.where(valid.any(axis=1), topk - np.argmax(valid[:, ::-1], axis=1), 0)
        # past topk_length: real key ids, which a solution must ignore all the same
        row, col = np.nonzero(np.arange(topk) >= length[:, None])
        indices[row, col] = rng.integers(0, max(seq_len_kv, 1), size=len(row))
        tensors["topk_length"] = torch.from_numpy(length.astype(np.int32))
    tensors["indices"] = torch.from_numpy(indices.astype(np.int32)).reshape(seq_len_q, 1, topk)
    return tensors, {"seq_len_q": seq_len_q, "seq_len_kv": seq_len_kv}


def _decode_layout(spec: SparseDecodeIndices, rng: np.random.Generator) -> dict:
    """The index structure of sparse_decode_indices: indices, and which cache tokens requests hold."""
    kv_lens = sample_lengths(spec.kv_lens, rng)
    size, seq_len_q, topk = spec.block_size, spec.seq_len_q, spec.topk
    blocks = _blocks_per_request(kv_lens, size)
    needed = int(blocks.sum())
    pool = spec.block_pool or max(needed, 1)
    if pool < needed:
        raise ValueError(f"block_pool {pool} is smaller than the {needed} blocks the requests need")
    if pool * size > INT32_MAX + 1:
        raise ValueError(f"{pool} blocks of {size} tokens are more cache tokens than int32 indices reach")
    _host_room(f"a pool of {pool} blocks of {size} tokens", 8 * pool + 17 * pool * size)  # order, tokens held
    # Real caches hand out blocks in no particular order: a random permutation of the pool.
    block_ids = rng.permutation(pool)[:needed].astype(np.int64)
    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    batch_size = len(kv_lens)
    request = np.repeat(np.arange(batch_size), seq_len_q)
    # query token s sits at position kv_len - seq_len_q + s and sees positions 0..that
    visible = np.maximum(kv_lens[request] - seq_len_q + np.tile(np.arange(seq_len_q), batch_size) + 1, 0)
    visible[_empty_rows(rng, batch_size * seq_len_q, spec.empty_queries)] = 0
    position = random_subsets(rng, visible, topk)
    block = block_ids[np.minimum(first_block[request, None] + position // size, max(needed - 1, 0))] if needed else position
    indices = np.where(position >= 0, block * size + position % size, -1)
    if spec.scatter:
        indices = rng.permuted(indices, axis=1)
    used = np.zeros(pool * size, dtype=bool)  # cache tokens some request holds
    token = block_ids[:, None] * size + np.arange(size)  # tokens of every handed-out block, request after request
    in_request = np.arange(size)[None, :] + (np.arange(needed) - np.repeat(first_block, blocks))[:, None] * size
    used[token[in_request < np.repeat(kv_lens, blocks)[:, None]]] = True
    return {"indices": indices.reshape(batch_size, seq_len_q, topk), "used": used, "pool": pool,
            "batch_size": batch_size}


def sparse_decode_data(spec: SparseDecodeIndices, rng: np.random.Generator) -> dict[str, GeneratedData]:
    """k_cache carries data in the tokens requests hold (the rest are NaN bytes no valid index
    reaches, and stay so): windows of those tokens are redrawn and quantised afresh."""
    if spec.fp8_cache is None:
        return {}
    used = _decode_layout(spec, rng)["used"]
    return {"k_cache": GeneratedData(MLA_FP8_BYTES, functools.partial(fresh_mla_fp8_tokens, spec.fp8_cache),
                                     rows=torch.from_numpy(np.flatnonzero(used)))}


def check_decode_indices(arrays: dict[str, np.ndarray], axes: dict[str, int]) -> None:
    """sparse_decode_indices': cache tokens block * page_block_size + offset, or -1, the only invalid entry."""
    indices, tokens = arrays["indices"], axes["num_blocks"] * axes["page_block_size"]
    _refuse_first("indices", indices, (indices < -1) | (indices >= tokens),
                  f"neither -1 nor one of the {tokens} cache tokens")


@register("sparse_decode_indices", data=sparse_decode_data,
          rules=(IndexRule({"indices": 3}, ("num_blocks", "page_block_size"), check_decode_indices),))
def sparse_decode_indices(spec: SparseDecodeIndices, rng: np.random.Generator,
                          data: DataSource | None) -> GeneratedInputs:
    layout = _decode_layout(spec, rng)
    pool, batch_size, size = layout["pool"], layout["batch_size"], spec.block_size
    tensors = {"indices": torch.from_numpy(layout["indices"].astype(np.int32))}
    if spec.fp8_cache is not None and data is None:
        tensors["k_cache"] = shape_only([pool, size, 1, MLA_FP8_BYTES], torch.int8)
    elif spec.fp8_cache is not None:
        flat = fresh_mla_fp8_tokens(spec.fp8_cache, pool * size, data.generator, data.device)
        unused = torch.from_numpy(~layout["used"]).to(data.device)
        flat[unused] = _nan_token_bytes(MLA_FP8_BYTES).to(data.device)  # never reached by a valid index
        tensors["k_cache"] = flat.view(pool, size, 1, MLA_FP8_BYTES)
    return tensors, {"batch_size": batch_size, "seq_len_q": spec.seq_len_q, "num_blocks": pool,
                     "page_block_size": size}


def fp8_kv_cache_data(spec: FP8KVCache, rng: np.random.Generator) -> dict[str, GeneratedData]:
    """The whole cache is data: any window of tokens is redrawn (and, packed, quantised afresh)."""
    if spec.packed:
        return {"kv_cache_fp8": GeneratedData(MLA_FP8_BYTES, functools.partial(fresh_mla_fp8_tokens, spec.values))}
    return {"kv_cache": GeneratedData(MLA_HEAD_DIM, functools.partial(fresh_mla_tokens, spec.values))}


@register("fp8_kv_cache", data=fp8_kv_cache_data)
def fp8_kv_cache(spec: FP8KVCache, rng: np.random.Generator, data: DataSource | None) -> GeneratedInputs:
    """No structure: all of it is data."""
    axes = {"num_blocks": spec.num_blocks, "page_block_size": spec.block_size}
    name, width, dtype, make = ("kv_cache_fp8", MLA_FP8_BYTES, torch.int8, fresh_mla_fp8_tokens) if spec.packed else \
        ("kv_cache", MLA_HEAD_DIM, torch.bfloat16, fresh_mla_tokens)
    shape = [spec.num_blocks, spec.block_size, 1, width]
    if data is None:
        return {name: shape_only(shape, dtype)}, axes
    return {name: make(spec.values, spec.num_blocks * spec.block_size, data.generator, data.device).view(shape)}, axes
