"""Random workloads for a correctness sweep of every solution (GPU or CPU), tagged `fuzz`.

Appends PER random workloads to the workload sets of every definition but the FP8 cache's own
(MLA paged decode and prefill, the FlashMLA-form decode at 16 and 128 heads, MHA varlen prefill at
d_qk 128 and 192, sparse FP8 decode and sparse prefill, with and without sinks) of the repository in
the current directory: request counts from 1 to 257, lengths at and around tile edges (0, 1, 15-17,
31-33, 63-65, 127-129, ...) mixed with random and a few long ones, 1 to 4 query tokens on the
FlashMLA form (1 or 2 on sparse decode), prefixes or none, invalid index entries trailing or
scattered, queries with none valid, and scales from 0.0417 to 1; and to the MLA paged and MHA varlen
sets one workload whose requests have no query or no key at all (`fuzz_empty`). The same SEED gives the
same workloads (uuids included). Run it in a scratch copy, never in a checkout you commit from, then:

    python benchmarks/fuzz_workloads.py SEED PER
    flashbench run --def mla_paged_decode --workload fuzz --iters 20 --warmup 2

docs/peers.md ("Correctness on random workloads") has what a sweep found.
"""

import itertools
import random
import sys
import uuid
from functools import partial
from pathlib import Path

import yaml

DEFINITIONS = Path.cwd() / "definitions"
EDGES = [0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257, 511, 1023, 1025]
SCALES = [0.0722, 0.1352, 0.0417, 0.5, 1.0]


class Draw:
    """The random choices of one sweep, from its seed."""

    def __init__(self, seed: int):
        self.seed = seed
        self.rng = random.Random(seed)

    def lengths(self, count: int, top: int, zeros: bool = True) -> list[int]:
        """About a third at a tile edge, most up to top/8, a tenth from top/4 to top."""
        out = []
        for _ in range(count):
            r = self.rng.random()
            if r < 0.35:
                out.append(self.rng.choice(EDGES if zeros else EDGES[1:]))
            elif r < 0.9:
                out.append(self.rng.randint(1, top // 8))
            else:
                out.append(self.rng.randint(top // 4, top))
        return out

    def batch(self) -> int:
        return self.rng.choice([1, 2, 3, 5, 7, 13, 31, 33, 64, 97, 130, 257])

    def scale(self) -> dict:
        return {"type": "scalar", "value": self.rng.choice(SCALES)}

    def decode(self) -> dict:
        kv = self.lengths(self.batch(), 40000)
        return {"inputs": {"sm_scale": self.scale()}, "generate": [{
            "generator": "paged_kv", "page_pool": sum(kv) + 50, "kv_lens": {"distribution": "list", "values": kv}}]}

    def prefill(self) -> dict:
        count = self.rng.choice([1, 2, 3, 7, 13, 33])
        q, prefix = self.lengths(count, 3000), self.lengths(count, 6000)
        return {"inputs": {"sm_scale": self.scale()}, "generate": [{
            "generator": "paged_kv", "page_pool": sum(q) + sum(prefix) + 50,
            "q_lens": {"distribution": "list", "values": q}, "prefix_lens": {"distribution": "list", "values": prefix}}]}

    def flashmla_decode(self) -> dict:
        count = self.batch()
        queries = self.rng.choice([1, 1, 2, 3, 4])
        lengths = [max(n, queries) for n in self.lengths(count, 33000, zeros=False)]
        blocks = sum(-(-n // 64) for n in lengths)
        return {"axes": {"seq_len_q": queries}, "inputs": {"softmax_scale": self.scale()}, "generate": [{
            "generator": "block_table", "block_size": 64, "block_pool": blocks + self.rng.randint(0, 100),
            "seqlens": {"distribution": "list", "values": lengths}}]}

    def varlen(self) -> dict:
        count = self.rng.choice([1, 2, 3, 7, 13, 33])
        spec = {"generator": "varlen", "q_lens": {"distribution": "list", "values": self.lengths(count, 6000)}}
        workload = {"inputs": {"softmax_scale": self.scale()}, "generate": [spec]}
        if self.rng.random() < 0.5:
            spec["prefix_lens"] = {"distribution": "list", "values": self.lengths(count, 6000)}
        return workload

    def sparse_inputs(self, scale: str, sink: bool) -> dict:
        inputs = {scale: self.scale()}
        if sink:
            inputs["attn_sink"] = {"type": "random", "distribution": "normal", "mean": 0.0, "std": 2.0}
        return inputs

    def invalid_entries(self, spec: dict, queries: int) -> dict:
        """Scattered invalid entries half the time; now and then a query with none valid."""
        spec["scatter"] = self.rng.random() < 0.5
        if self.rng.random() < 0.3:
            spec["empty_queries"] = self.rng.randint(1, queries)
        return spec

    def sparse_decode(self, sink: bool) -> dict:
        count, queries = self.batch(), self.rng.choice([1, 2])
        lengths = [max(n, queries) for n in self.lengths(count, 33000, zeros=False)]
        blocks = sum(-(-n // 64) for n in lengths)
        spec = {"generator": "sparse_decode_indices", "kv_lens": {"distribution": "list", "values": lengths},
                "seq_len_q": queries, "topk": 2048, "block_size": 64, "block_pool": blocks + self.rng.randint(0, 100),
                "fp8_cache": {"boundary_tiles": self.rng.choice([0.0, 0.05]),
                              "zero_tokens": self.rng.choice([0.0, 0.05])}}
        return {"inputs": self.sparse_inputs("softmax_scale", sink),
                "generate": [self.invalid_entries(spec, count * queries)]}

    def sparse_prefill(self, sink: bool) -> dict:
        count = self.rng.choice([1, 2, 3, 7, 13])
        q_lens = self.lengths(count, 3000, zeros=False)
        spec = {"generator": "sparse_prefill_indices", "q_lens": {"distribution": "list", "values": q_lens},
                "prefix_lens": {"distribution": "list", "values": self.lengths(count, 12000)}, "topk": 2048,
                "invalid": self.rng.choice(["minus_one", "mixed"])}
        if sink:
            spec["topk_length"] = True
        return {"inputs": self.sparse_inputs("sm_scale", sink), "generate": [self.invalid_entries(spec, sum(q_lens))]}


# Batches of empty requests, valid where a definition allows a length of 0: nothing to compute, which a
# kernel's launch or a library's planner may not expect.
EMPTY = {
    "decode": {"inputs": {"sm_scale": {"type": "scalar", "value": 0.0722}}, "generate": [{
        "generator": "paged_kv", "page_pool": 50, "kv_lens": {"distribution": "list", "values": [0, 0, 0]}}]},
    "prefill": {"inputs": {"sm_scale": {"type": "scalar", "value": 0.0722}}, "generate": [{
        "generator": "paged_kv", "page_pool": 50, "q_lens": {"distribution": "list", "values": [0, 0]},
        "prefix_lens": {"distribution": "list", "values": [0, 5]}}]},
    "varlen": {"inputs": {"softmax_scale": {"type": "scalar", "value": 0.0722}}, "generate": [{
        "generator": "varlen", "q_lens": {"distribution": "list", "values": [0, 0]},
        "prefix_lens": {"distribution": "list", "values": [0, 7]}}]},
}


def append(path: Path, make, per: int, draw: Draw, empty: str | None = None) -> None:
    """PER random workloads from `make`, then the EMPTY one named (its uuid from the seed: the random
    draws stay those of earlier versions of this tool)."""
    document = yaml.safe_load(path.read_text())
    # Names a set holds once: a second sweep's (another seed) are numbered on from the first's.
    taken = {w.get("name") for w in document["workloads"]}
    names = (f"fuzz{n}" for n in itertools.count() if f"fuzz{n}" not in taken)
    for _ in range(per):
        workload = make()
        workload.update(uuid=str(uuid.UUID(int=draw.rng.getrandbits(128))), name=next(names), tags=["fuzz"])
        document["workloads"].append(workload)
    if empty:
        named = uuid.uuid5(uuid.NAMESPACE_URL, f"flashbench-fuzz/{draw.seed}/{path.name}")
        name = "fuzz_empty" if "fuzz_empty" not in taken else f"fuzz_empty_{draw.seed}"
        document["workloads"].append({"uuid": str(named), "name": name, "tags": ["fuzz"], **EMPTY[empty]})
    path.write_text(yaml.safe_dump(document, sort_keys=False))


def main(seed: int, per: int) -> None:
    draw = Draw(seed)
    append(DEFINITIONS / "mla_paged/mla_paged_decode_h16_ckv512_kpe64_ps1.workloads.yaml", draw.decode, per, draw,
           "decode")
    append(DEFINITIONS / "mla_paged/mla_paged_prefill_causal_h16_ckv512_kpe64_ps1.workloads.yaml", draw.prefill, per,
           draw, "prefill")
    for heads in (16, 128):
        append(DEFINITIONS / f"flashmla_decode/flashmla_decode_causal_h{heads}_ckv512_kpe64_ps64.workloads.yaml",
               draw.flashmla_decode, per, draw)
    for dim in (128, 192):
        append(DEFINITIONS / f"mha_varlen/mha_varlen_prefill_causal_h128_dqk{dim}_dv128.workloads.yaml", draw.varlen,
               per, draw, "varlen")
    for heads in (64, 128):
        for sink in (False, True):
            decode = f"flashmla_sparse_decode_fp8{'_sink' * sink}_h{heads}_ckv512_kpe64_ps64_topk2048"
            append(DEFINITIONS / f"flashmla_sparse/{decode}.workloads.yaml", partial(draw.sparse_decode, sink), per,
                   draw)
            prefill = f"flashmla_sparse_prefill{'_sink_topklen' * sink}_h{heads}_ckv512_kpe64_topk2048"
            append(DEFINITIONS / f"flashmla_sparse/{prefill}.workloads.yaml", partial(draw.sparse_prefill, sink), per,
                   draw)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/fuzz_workloads.py SEED PER")
    main(int(sys.argv[1]), int(sys.argv[2]))
