"""Structured generators: inputs that must agree with each other, made together.

A generator takes its spec (a model in flashbench.model.workload) and a numpy random
generator, and returns tensors by input name plus the axis values it decides. New op
families register theirs with @register("name").
"""

from typing import Callable

import numpy as np
import torch

from ..model import Lengths, PagedKV

GeneratedInputs = tuple[dict[str, torch.Tensor], dict[str, int]]
GENERATORS: dict[str, Callable[..., GeneratedInputs]] = {}


def register(name: str):
    def add(func):
        GENERATORS[name] = func
        return func
    return add


def sample_lengths(spec: Lengths, rng: np.random.Generator) -> np.ndarray:
    """Per-request lengths drawn as the spec says, as int64."""
    kind = spec.distribution
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


def _indptr(lengths: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


@register("paged_kv")
def paged_kv(spec: PagedKV, rng: np.random.Generator) -> GeneratedInputs:
    tensors: dict[str, torch.Tensor] = {}
    axes: dict[str, int] = {}
    if spec.q_lens is not None:
        q_lens = sample_lengths(spec.q_lens, rng)
        prefix = sample_lengths(spec.prefix_lens, rng) if spec.prefix_lens else np.zeros_like(q_lens)
        if len(prefix) != len(q_lens):
            raise ValueError(f"prefix_lens gives {len(prefix)} requests but q_lens gives {len(q_lens)}")
        kv_lens = prefix + q_lens
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
    tensors["kv_indices"] = torch.from_numpy(rng.permutation(pool)[:total].astype(np.int32))
    axes["num_pages"] = pool
    return tensors, axes
