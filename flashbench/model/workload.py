"""Workloads: concrete var-axis values and how to make each input, stored next to a definition."""

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from .definition import FOLDER_NAME_OR_NONE, NAME_CHARS, Strict

# Generated ids (pages, blocks) are int32: a pool past this could not be indexed, and drawing its order
# alone would take tens of GB before anything refused it.
ID_LIMIT = 2**31


class RandomInput(Strict):
    """Seeded random tensor of the declared shape and dtype."""

    type: Literal["random"]
    distribution: Literal["normal", "uniform"] = "normal"
    mean: float = 0.0
    std: float = Field(1.0, gt=0)
    low: float | None = Field(None, description="uniform: inclusive lower bound (floats: default 0)")
    high: float | None = Field(None, description="uniform: exclusive upper bound (floats: default 1); integers need both")


class ScalarInput(Strict):
    type: Literal["scalar"]
    value: int | float | bool


class SafetensorsInput(Strict):
    """A captured tensor: `path` is relative to the workload file."""

    type: Literal["safetensors"]
    path: str
    tensor_key: str


InputDescriptor = Annotated[Union[RandomInput, ScalarInput, SafetensorsInput], Field(discriminator="type")]


class Lengths(Strict):
    """Per-request lengths: an explicit list, or `count` draws from a distribution (clipped to low..high)."""

    distribution: Literal["list", "fixed", "uniform", "normal", "skewed"]
    values: list[Annotated[int, Field(ge=0)]] = Field([], description="list: the lengths")
    count: int = Field(0, ge=0, description="number of requests to draw")
    value: int = Field(0, ge=0, description="fixed: every length")
    low: int = Field(0, ge=0)
    high: int = Field(0, ge=0)
    mean: float = Field(0.0, description="normal: mean before clipping")
    std: float = Field(0.0, ge=0, description="normal: standard deviation")
    median: float = Field(0.0, ge=0, description="skewed: median of a log-normal")
    sigma: float = Field(1.0, gt=0, description="skewed: log-space standard deviation")

    @model_validator(mode="after")
    def _complete(self):
        if self.distribution == "list" and not self.values:
            raise ValueError("distribution 'list' needs 'values'")
        if self.distribution != "list" and self.count == 0:
            raise ValueError(f"distribution {self.distribution!r} needs 'count' > 0")
        if self.distribution in ("uniform", "normal", "skewed") and self.high < self.low:
            raise ValueError("needs low <= high")
        if self.distribution in ("normal", "skewed") and self.high == 0:
            raise ValueError(f"distribution {self.distribution!r} needs 'high' (the clip bound)")
        return self


class PagedKV(Strict):
    """Index tensors of a paged KV cache (page size 1): kv_indptr and kv_indices over a pool of
    pages drawn as a random permutation, and qo_indptr when query lengths are given (prefill,
    where each request's KV is its prefix followed by its queries)."""

    generator: Literal["paged_kv"]
    kv_lens: Lengths | None = Field(None, description="decode: KV length per request")
    q_lens: Lengths | None = Field(None, description="prefill: query length per request")
    prefix_lens: Lengths | None = Field(None, description="prefill: cached prefix per request (default 0)")
    page_pool: int | None = Field(None, gt=0, le=ID_LIMIT, description="pages in the cache (default: just enough)")

    @model_validator(mode="after")
    def _one_mode(self):
        if (self.kv_lens is None) == (self.q_lens is None):
            raise ValueError("give exactly one of kv_lens (decode) or q_lens (prefill)")
        if self.prefix_lens is not None and self.q_lens is None:
            raise ValueError("prefix_lens needs q_lens")
        return self


class BlockTable(Strict):
    """A block-paged KV cache as FlashMLA and vLLM address it: cache_seqlens (tokens per request)
    and block_table [batch, max_blocks_per_seq], whose row b lists the cache blocks holding request
    b's tokens in order (token t lives in block block_table[b, t // block_size] at offset
    t % block_size). Block ids are a random permutation of the pool; table slots past a request's
    last block hold `unused`."""

    generator: Literal["block_table"]
    seqlens: Lengths = Field(description="tokens in the cache per request")
    block_size: int = Field(64, gt=0, description="tokens per block (the definition's page_block_size)")
    block_pool: int | None = Field(None, gt=0, le=ID_LIMIT, description="blocks in the cache (default: just enough)")
    max_blocks_per_seq: int | None = Field(None, gt=0, description="table width (default: the longest request's blocks)")
    unused: int = Field(-1, description="value of table slots past a request's last block")


class Varlen(Strict):
    """Packed variable-length sequences as flash_attn_varlen_func takes them: cu_seqlens_q and
    cu_seqlens_k (int32, batch + 1 offsets starting at 0). Each sequence's keys are its cached
    prefix followed by its queries, so k_len = prefix_len + q_len >= q_len."""

    generator: Literal["varlen"]
    q_lens: Lengths = Field(description="query tokens per sequence")
    prefix_lens: Lengths | None = Field(None, description="keys before the queries per sequence (default 0)")


class KVCacheValues(Strict):
    """Contents of a generated MLA KV cache before any quantisation: bfloat16 tokens of 576 values
    [512 latent | 64 rope], standard normal, each 128-value latent tile multiplied by 2^u with u
    uniform in [-spread/2, spread/2] so that tiles need different FP8 scales."""

    spread: float = Field(4.0, ge=0, le=32, description="range of log2 of the per-tile magnitude")
    zero_tokens: float = Field(0.0, ge=0, le=1, description="share of tokens that are all zeros")
    boundary_tiles: float = Field(
        0.0, ge=0, le=1,
        description="share of latent tiles whose largest |value| is exactly 448 * 2^k (the scale is then exactly 2^k)",
    )


class SparsePrefillIndices(Strict):
    """Top-k index sets for sparse prefill (flash_mla_sparse_fwd): requests packed along one token
    axis, query token i of a request at position prefix + i sees its request's keys 0..prefix + i
    and gets min(topk, prefix + i + 1) of them as indices into the packed keys, in random order:
    all of them if they fit, else the topk // 4 most recent and one from each of topk - topk // 4
    equal strata of the older ones (an indexer's local window plus keys spread over the context);
    the remaining entries are invalid. indices is [seq_len_q, 1, topk]; with topk_length, also
    topk_length [seq_len_q]."""

    generator: Literal["sparse_prefill_indices"]
    q_lens: Lengths = Field(description="query tokens per request")
    prefix_lens: Lengths | None = Field(None, description="keys before each request's queries (default 0)")
    topk: int = Field(gt=0, description="entries per query token: the definition's topk")
    invalid: Literal["minus_one", "mixed"] = Field(
        "minus_one", description="invalid entries: -1, or a mix of -1, ids >= seq_len_kv and 2^31 - 1"
    )
    scatter: bool = Field(False, description="interleave invalid entries with valid ones instead of trailing them")
    empty_queries: int = Field(0, ge=0, description="query tokens, picked at random, with no valid entry at all")
    topk_length: bool = Field(
        False, description="emit topk_length (entries that count per query); entries past it hold in-range ids to ignore"
    )


class SparseDecodeIndices(Strict):
    """Top-k index sets for sparse decode over a paged cache (flash_mla_with_kvcache with indices):
    request b holds kv_lens[b] tokens in 64-token blocks drawn from a random permutation of the
    pool; its query token s (of seq_len_q, MTP) sits at position kv_len - seq_len_q + s, sees
    positions 0..that, and gets min(topk, visible) of them (picked as for prefill) as cache ids
    block * 64 + offset; the other entries are -1. indices is [batch_size, seq_len_q, topk]. With fp8_cache, also k_cache,
    the pool quantised by the FP8 quantize reference [num_blocks, 64, 1, 656] (int8 bytes); tokens
    outside every request hold NaN bytes, which no valid index reaches."""

    generator: Literal["sparse_decode_indices"]
    kv_lens: Lengths = Field(description="cached tokens per request, its seq_len_q newest included")
    seq_len_q: int = Field(1, gt=0, description="query tokens per request (1, or 2 with an MTP draft token)")
    topk: int = Field(gt=0, description="entries per query token: the definition's topk")
    block_size: int = Field(64, gt=0, description="tokens per cache block")
    block_pool: int | None = Field(None, gt=0, le=ID_LIMIT, description="blocks in the cache (default: just enough)")
    scatter: bool = Field(False, description="interleave the -1 entries with valid ones instead of trailing them")
    empty_queries: int = Field(0, ge=0, description="query tokens, picked at random, with no valid entry at all")
    fp8_cache: KVCacheValues | None = Field(None, description="also make k_cache, the FP8 pool, with these contents")


class FP8KVCache(Strict):
    """A whole MLA KV cache [num_blocks, block_size, 1, 576]: bfloat16 as kv_cache, or (packed)
    quantised by the FP8 quantize reference as kv_cache_fp8 [num_blocks, block_size, 1, 656]
    (int8 bytes)."""

    generator: Literal["fp8_kv_cache"]
    num_blocks: int = Field(gt=0, le=ID_LIMIT)
    block_size: int = Field(64, gt=0)
    packed: bool = Field(False, description="emit the FP8 bytes (kv_cache_fp8) instead of the bfloat16 cache (kv_cache)")
    values: KVCacheValues = KVCacheValues()


GeneratorSpec = Annotated[
    Union[PagedKV, BlockTable, Varlen, SparsePrefillIndices, SparseDecodeIndices, FP8KVCache],
    Field(discriminator="generator"),
]


class Workload(Strict):
    # At most NAME_CHARS: `export-fib --index-blobs` names a file <uuid>.safetensors, and a uuid of 300
    # characters passed `validate` and ended the export with a traceback (ENAMETOOLONG).
    uuid: str = Field(min_length=8, max_length=NAME_CHARS, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$",
                      description="letters, digits, '-' and '_': exports name files after it")
    name: str = Field("", pattern=FOLDER_NAME_OR_NONE, description="a short human label, e.g. b64_l4096")
    tags: list[str] = Field([], description="'smoke' marks tiny workloads for CPU runs")
    # At most int64's largest: a tensor's size is one (an axis of 10^30 crashed `import-fib` in torch.empty).
    axes: dict[str, Annotated[int, Field(ge=0, le=2**63 - 1)]] = Field({}, description="var-axis values; others are "
                                                                                     "bound from generated inputs")
    inputs: dict[str, InputDescriptor] = Field({}, description="inputs not listed are random normal")
    generate: list[GeneratorSpec] = []

    @property
    def label(self) -> str:
        return self.name or self.uuid[:8]


class WorkloadSet(Strict):
    definition: str
    version: int = Field(ge=1, description="bump when any workload changes meaning")
    workloads: list[Workload]

    @model_validator(mode="after")
    def _unique_uuids_and_names(self):
        names: set[str] = set()
        uuids: set[str] = set()
        for i, workload in enumerate(self.workloads):
            clash = naming_clash(names, uuids, workload)
            if clash:
                raise ValueError(f"workloads[{i}].{clash}")
            names.add(workload.name)
            uuids.add(workload.uuid)
        return self


def naming_clash(names: set[str], uuids: set[str], workload: Workload) -> str | None:
    """Why `workload` cannot join a set whose workloads have these names and uuids ("field: reason"): a workload is
    picked and shown by its name or its uuid, and two by one name would be two rows no one can tell apart,
    `--workload NAME` picking both."""
    if workload.uuid in uuids:
        return f"uuid: {workload.uuid} appears twice"
    if workload.name and workload.name in names:
        return f"name: {workload.name} appears twice"
    if workload.name and workload.name in uuids:
        return f"name: {workload.name} is another workload's uuid"
    if workload.uuid in names:
        return f"uuid: {workload.uuid} is another workload's name"
    return None
