"""Checks the wgmma sparse prefill on a GPU against the repository's references, then times it beside FlashMLA.

    python benchmarks/sparse_prefill_wgmma_check.py [SOLUTION] [--no-timing] [--only SUBSTRING]

For each of the four flashmla_sparse_prefill definitions (h128, h64, sink_topklen_h128, sink_topklen_h64)
builds its solution folder SOLUTION (default `cuda_wgmma`) as a worker does (staged with its shared files,
its own compile flags, through `Registry.load_solution`), then runs several shapes:
a few tokens, a fresh prefill (token i sees min(2048, i + 1) entries, the rest -1), scattered invalid
entries (-1, ids >= seq_len_kv, 2^31 - 1, whole 64-entry tiles and whole tokens invalid), topk_length
shorter than topk (0, 1, 63, 64, 65, ..., with ids past it that point at NaN rows), and s_q = 4096 with
all 2048 entries valid. Every kv row that no counted valid entry references is NaN, so a read of a row
the kernel does not own shows up as NaN; the output buffers start as NaN, so an unwritten element shows
up too. Each shape is compared with the definition's reference (fp32, on the GPU) under the definition's
tolerances with the harness's own comparison (`output_error`), printing max errors and PASS/FAIL; an
exception fails its shape and the script goes on. Then (unless --no-timing) times ours and the
`flashmla` solution (FlashMLA's SM90 kernel, when flash_mla imports) with triton.testing.do_bench on
s_q = 4096 (all entries valid, and a fresh prefill) and prints the speed ratio. Exits 1 if any shape
failed. A development check: the harness's verdicts and times are `flashbench run`'s.
"""

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch

import flashbench as fb
from flashbench.run.judge.check import output_error

ROOT = Path(__file__).resolve().parents[1]
DEFINITIONS = [
    "flashmla_sparse_prefill_h128_ckv512_kpe64_topk2048",
    "flashmla_sparse_prefill_h64_ckv512_kpe64_topk2048",
    "flashmla_sparse_prefill_sink_topklen_h128_ckv512_kpe64_topk2048",
    "flashmla_sparse_prefill_sink_topklen_h64_ckv512_kpe64_topk2048",
]
TOPK = 2048
INT_MAX = 2**31 - 1


def make_indices(s_q, s_kv, pattern, gen):
    """[s_q, 1, TOPK] int32 on the CPU, and topk_length [s_q] (None where the pattern has none)."""
    idx = torch.randint(0, s_kv, (s_q, TOPK), generator=gen, dtype=torch.int64)
    length = None
    if pattern == "full_distinct":
        idx = torch.stack([torch.randperm(s_kv, generator=gen)[:TOPK] for _ in range(s_q)])
    elif pattern == "fresh":  # token i sees keys 0..i: min(2048, i + 1) entries, the rest -1
        for i in range(s_q):
            n = min(TOPK, i + 1)
            row = torch.full((TOPK,), -1, dtype=torch.int64)
            if i + 1 <= s_kv:
                row[:n] = torch.randperm(i + 1, generator=gen)[:n]
            else:
                row[:n] = torch.randint(0, s_kv, (n,), generator=gen)
            idx[i] = row
    elif pattern == "invalid_mixed":
        bad = torch.rand(s_q, TOPK, generator=gen) < 0.4
        kinds = torch.randint(0, 3, (s_q, TOPK), generator=gen)
        junk = torch.where(kinds == 0, torch.full_like(idx, -1),
                           torch.where(kinds == 1, s_kv + torch.randint(0, 1000, (s_q, TOPK), generator=gen),
                                       torch.full_like(idx, INT_MAX)))
        idx = torch.where(bad, junk, idx)
        idx[:, 128:256] = -1  # two whole tiles invalid
        idx[:, 1024:1088] = s_kv  # a whole tile out of range
        idx[0] = -1  # a token with no valid entry
        if s_q > 2:
            idx[2] = torch.where(torch.arange(TOPK) == 2047, idx[2].clamp(0, s_kv - 1), torch.full_like(idx[2], -1))
    elif pattern == "topk_len":
        special = [0, 1, 63, 64, 65, 127, 1000, 2047, TOPK]
        length = torch.tensor([special[i] if i < len(special) else int(torch.randint(0, TOPK + 1, (1,), generator=gen))
                               for i in range(s_q)], dtype=torch.int64)
        bad = torch.rand(s_q, TOPK, generator=gen) < 0.1
        idx = torch.where(bad, torch.full_like(idx, -1), idx)
    else:
        raise ValueError(pattern)
    return idx.to(torch.int32).view(s_q, 1, TOPK), length


def counted_valid(indices, length, s_kv):
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    if length is not None:
        valid &= torch.arange(idx.shape[1])[None, :] < length[:, None]
    return valid


def make_inputs(definition, s_q, s_kv, pattern, seed):
    gen = torch.Generator().manual_seed(seed)
    heads = definition.axes["num_heads_q"].value
    q = torch.randn(s_q, heads, 576, generator=gen).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, 576, generator=gen).to(torch.bfloat16)
    indices, length = make_indices(s_q, s_kv, pattern, gen)
    has_sink = "attn_sink" in definition.inputs
    if has_sink and length is None:
        length = torch.full((s_q,), TOPK, dtype=torch.int64)
        length[: max(1, s_q // 3)] = torch.randint(0, TOPK + 1, (max(1, s_q // 3),), generator=gen)
    if has_sink:
        # Past topk_length, point at rows nothing counted references (NaN below): a read shows.
        past = torch.arange(TOPK)[None, :] >= length[:, None]
        idx = indices[:, 0]
        idx[past] = torch.randint(0, s_kv, (int(past.sum()),), generator=gen, dtype=torch.int32)
    valid = counted_valid(indices, length if has_sink else None, s_kv)
    used = torch.zeros(s_kv, dtype=torch.bool)
    used[indices[:, 0].long()[valid]] = True
    kv[~used] = float("nan")
    args = [q, kv, indices]
    extra = []
    if has_sink:
        sink = torch.randn(heads, generator=gen) * 2
        sink[0], sink[1], sink[2] = -math.inf, math.inf, 0.0
        extra = [sink.float(), length.to(torch.int32)]
    return [a.cuda() for a in args], [e.cuda() for e in extra], int(used.sum())


def check_shape(repo, name, run, label, s_q, s_kv, pattern, seed=0) -> bool:
    definition = repo.definition(name)
    reference = repo.reference(name)
    sm_scale = 1 / math.sqrt(576) if seed % 2 == 0 else 0.1352
    try:
        (q, kv, indices), extra, n_used = make_inputs(definition, s_q, s_kv, pattern, seed)
        heads = q.shape[1]
        out = torch.full((s_q, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        max_logits = torch.full((s_q, heads), float("nan"), dtype=torch.float32, device="cuda")
        lse = torch.full((s_q, heads), float("nan"), dtype=torch.float32, device="cuda")
        run(q, kv, indices, sm_scale, *extra, out, max_logits, lse)
        torch.cuda.synchronize()
        want = reference(q, kv, indices, sm_scale, *extra)
        torch.cuda.synchronize()
        ok = True
        parts = []
        for key, got, expected in zip(("out", "max_logits", "lse"), (out, max_logits, lse), want):
            error, failed = output_error(got, expected, definition.tolerance(key), device="cuda")
            ok &= not failed
            parts.append(f"{key} max abs {error.max_abs_error:.3g} (mismatch {error.mismatch_fraction:.2g})")
        print(f"{'PASS' if ok else 'FAIL'} {name} {label} [s_q {s_q}, s_kv {s_kv}, {n_used} rows used]: "
              + "; ".join(parts), flush=True)
        return ok
    except Exception:  # one shape's crash fails that shape only
        print(f"FAIL {name} {label}: exception", flush=True)
        traceback.print_exc()
        return False


SHAPES = [  # label, s_q, s_kv, pattern
    ("few tokens", 3, 100, "fresh"),
    ("fresh prefill", 300, 300, "fresh"),
    ("invalid mixed", 37, 50000, "invalid_mixed"),
    ("topk_len short", 40, 100000, "topk_len"),
    ("random ids", 129, 70000, "full_distinct"),
    ("s_q 4096 full", 4096, 32768, "full_distinct"),
]


def timings(repo, name, run, cases):
    from triton.testing import do_bench
    try:
        peer = repo.load_solution(name, "flashmla")
    except Exception as exc:  # flash_mla missing or failing to import
        peer = None
        print(f"  flashmla solution unavailable: {exc!r}", flush=True)
    for label, s_q, s_kv, pattern in cases:
        try:
            definition = repo.definition(name)
            (q, kv, indices), extra, _ = make_inputs(definition, s_q, s_kv, pattern, 1)
            kv.nan_to_num_(0.0)  # FlashMLA reads whole tiles; keep both on finite data
            heads = q.shape[1]
            out = torch.empty((s_q, heads, 512), dtype=torch.bfloat16, device="cuda")
            max_logits = torch.empty((s_q, heads), dtype=torch.float32, device="cuda")
            lse = torch.empty((s_q, heads), dtype=torch.float32, device="cuda")
            sm_scale = 0.1352
            ours = do_bench(lambda: run(q, kv, indices, sm_scale, *extra, out, max_logits, lse), warmup=50, rep=300)
            valid = int(counted_valid(indices.cpu(), extra[1].cpu().long() if extra else None, s_kv).sum())
            flops = 2 * heads * (576 + 512) * valid
            line = f"  {name} {label}: ours {ours * 1e3:.0f} us ({flops / ours / 1e9:.0f} TFLOP/s)"
            if peer is not None:
                peer_out = peer(q, kv, indices, sm_scale, *extra)
                theirs = do_bench(lambda: peer(q, kv, indices, sm_scale, *extra), warmup=50, rep=300)
                line += (f"; flashmla {theirs * 1e3:.0f} us; ours/flashmla speed {theirs / ours:.2f}x; "
                         f"max |out difference| {(peer_out[0].float() - out.float()).abs().max():.3g}")
            print(line, flush=True)
        except Exception:
            print(f"  {name} {label}: timing failed", flush=True)
            traceback.print_exc()



def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("solution", nargs="?", default="cuda_wgmma")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--only", default="", help="run the definitions whose name contains this")
    args = parser.parse_args(argv)
    solution, only = args.solution, args.only
    repo = fb.load(ROOT)
    failed = 0
    for name in DEFINITIONS:
        if only not in name:
            continue
        started = time.time()
        try:
            run = repo.load_solution(name, solution)
        except Exception:
            print(f"FAIL {name}: build", flush=True)
            traceback.print_exc()
            failed += len(SHAPES)
            continue
        print(f"{name}/{solution}: built in {time.time() - started:.0f} s", flush=True)
        for seed, (label, s_q, s_kv, pattern) in enumerate(SHAPES):
            failed += not check_shape(repo, name, run, label, s_q, s_kv, pattern, seed)
        if not args.no_timing:
            timings(repo, name, run, [("s_q 4096 s_kv 32768 all valid", 4096, 32768, "full_distinct"),
                                      ("s_q 4096 fresh", 4096, 4096, "fresh")])
    print(f"{'ALL PASS' if failed == 0 else f'{failed} shape(s) FAILED'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
