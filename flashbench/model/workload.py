"""Workloads: concrete var-axis values and how to make each input, stored next to a definition."""

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from .definition import Strict


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
    values: list[int] = Field([], description="list: the lengths")
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
    page_pool: int | None = Field(None, gt=0, description="pages in the cache (default: just enough)")

    @model_validator(mode="after")
    def _one_mode(self):
        if (self.kv_lens is None) == (self.q_lens is None):
            raise ValueError("give exactly one of kv_lens (decode) or q_lens (prefill)")
        if self.prefix_lens is not None and self.q_lens is None:
            raise ValueError("prefix_lens needs q_lens")
        return self


GeneratorSpec = Annotated[Union[PagedKV], Field(discriminator="generator")]


class Workload(Strict):
    uuid: str = Field(min_length=8)
    name: str = Field("", description="a short human label, e.g. b64_l4096")
    tags: list[str] = Field([], description="'smoke' marks tiny workloads for CPU runs")
    axes: dict[str, int] = Field({}, description="var-axis values; others are bound from generated inputs")
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
    def _unique_uuids(self):
        seen: set[str] = set()
        for i, workload in enumerate(self.workloads):
            if workload.uuid in seen:
                raise ValueError(f"workloads[{i}].uuid: {workload.uuid} appears twice")
            seen.add(workload.uuid)
        return self
