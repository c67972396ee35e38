"""Checks a wgmma decode kernel on a GPU against an fp32 reference, then times it beside FlashMLA.

    python benchmarks/flashmla_decode_wgmma_check.py [SOLUTION] [--any-heads] [--kernels]

Builds the solution folder SOLUTION (default `cuda_wgmma`) of the 128-head definition as a worker does
(staged with its shared files, its own compile flags; `Registry.load_solution`), runs nine shapes (1 to
200 requests, lengths 1 to 5000, one and two query tokens, 64 and 128 heads; cache blocks scrambled; NaN
in every cache slot past a request's length), with `--any-heads` also head counts that are not multiples
of 64 (16, 48; fewer rows than one 64-row block; a last block past q's end), and compares out and lse
with an fp32 computation of the definition's math; exits 1 if any differs. Then times, at 128 heads, b128
L4096 / L8192 (one and two query tokens), one request of 32768 keys, b128 with lengths drawn from [64,
8192], one request of 65536 keys beside 31 of 1024, and 4100 requests of 256 keys (with `--any-heads`
also b128 L8192, the drawn lengths and the skewed batch at 16 heads) with `triton.testing.do_bench` (its
own L2 handling, not the harness's), and FlashMLA's SM90 kernel on the same inputs when `flash_mla`
imports; with `--kernels`, also each of our kernels' mean time over ten calls under `torch.profiler`. A
development check: the harness's verdicts and times are `flashbench run`'s.
"""

import math
import sys
import time
from pathlib import Path

import torch

import flashbench as fb

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = "flashmla_decode_causal_h128_ckv512_kpe64_ps64"
SCALE = 1 / math.sqrt(576)


def inputs(batch, s_q, heads, lengths, nan_past_end=True):
    lengths = torch.tensor(lengths, dtype=torch.int32)
    max_blocks = int((lengths.max() + 63) // 64)
    num_blocks = batch * max_blocks + 3
    table = torch.randperm(num_blocks)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    cache = torch.randn(num_blocks, 64, 1, 576, dtype=torch.bfloat16)
    if nan_past_end:
        for b in range(batch):
            for t in range(int(lengths[b]), max_blocks * 64):
                cache[table[b, t // 64], t % 64] = float("nan")
    q = torch.randn(batch, s_q, heads, 576, dtype=torch.bfloat16)
    return [x.cuda() for x in (q, cache, table, lengths)]


def reference(q, cache, table, lengths):
    batch, s_q, heads, _ = q.shape
    out = torch.empty(batch, s_q, heads, 512, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, s_q, dtype=torch.float32, device=q.device)
    for b in range(batch):
        keys = cache[table[b]].reshape(-1, 576)[: int(lengths[b])].float()
        for i in range(s_q):
            visible = int(lengths[b]) - s_q + i + 1
            logits = q[b, i].float() @ keys[:visible].T * SCALE
            lse[b, :, i] = torch.logsumexp(logits, -1)
            out[b, i] = torch.softmax(logits, -1) @ keys[:visible, :512]
    return out, lse


def outputs(q):
    batch, s_q, heads, _ = q.shape
    return (torch.full((batch, s_q, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda"),
            torch.full((batch, heads, s_q), float("nan"), dtype=torch.float32, device="cuda"))


def check(run, name, batch, s_q, heads, lengths) -> bool:
    torch.manual_seed(0)
    q, cache, table, lengths = inputs(batch, s_q, heads, lengths)
    out, lse = outputs(q)
    run(q, cache, table, lengths, SCALE, out, lse)
    torch.cuda.synchronize()
    want_out, want_lse = reference(q, cache, table, lengths)
    out_err = (out.float() - want_out).abs()
    lse_err = (lse - want_lse).abs()
    ok = bool((out_err <= 0.02 + 0.02 * want_out.abs()).all()) and bool((lse_err <= 1e-3).all())
    print(f"{'PASS' if ok else 'FAIL'} {name}: out max error {out_err.nan_to_num(1e9).max():.4g}, "
          f"lse max error {lse_err.nan_to_num(1e9).max():.4g}", flush=True)
    return ok


def kernel_times(call) -> str:
    """Each CUDA kernel's mean time over ten calls (after five), as 'name us; ...'."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    kernels = [row for row in profile.key_averages() if row.self_device_time_total > 0]
    kernels.sort(key=lambda row: -row.self_device_time_total)
    return "; ".join(f"{row.key.split('(')[0]} {row.self_device_time_total / 10:.1f} us" for row in kernels)


def timings(run, cases, kernels=False):
    from triton.testing import do_bench
    try:
        import flash_mla
    except ImportError:
        flash_mla = None
    for name, s_q, heads, lengths in cases:
        torch.manual_seed(0)
        q, cache, table, lengths = inputs(len(lengths), s_q, heads, lengths, nan_past_end=False)
        out, lse = outputs(q)
        ours = do_bench(lambda: run(q, cache, table, lengths, SCALE, out, lse), warmup=50, rep=300)
        flops = s_q * heads * int(lengths.sum()) * (576 + 512) * 2
        line = f"{name}: ours {ours * 1e3:.1f} us ({flops / ours / 1e9:.0f} TFLOP/s)"
        if kernels:
            line += f" [{kernel_times(lambda: run(q, cache, table, lengths, SCALE, out, lse))}]"
        if flash_mla is not None:
            meta, _ = flash_mla.get_mla_metadata()

            def peer():
                return flash_mla.flash_mla_with_kvcache(q, cache, table, lengths, 512, meta, softmax_scale=SCALE,
                                                        causal=s_q > 1, use_legacy=True)
            peer_out, _ = peer()
            theirs = do_bench(peer, warmup=50, rep=300)
            line += (f"; flashmla {theirs * 1e3:.1f} us; ours/flashmla speed {theirs / ours:.2f}x; "
                     f"max difference {(peer_out.float() - out.float()).abs().max():.3g}")
        print(line, flush=True)


def main(argv) -> int:
    any_heads = "--any-heads" in argv
    name = next((arg for arg in argv if not arg.startswith("--")), "cuda_wgmma")
    started = time.time()
    run = fb.load(ROOT).load_solution(DEFINITION, name)
    print(f"built in {time.time() - started:.0f} s", flush=True)
    shapes = [("b1 L64", 1, 1, 64, [64]), ("b1 L128", 1, 1, 64, [128]), ("b1 L100", 1, 1, 64, [100]),
              ("b1 L1 h128", 1, 1, 128, [1]), ("b2 L300 sq2", 2, 2, 128, [300, 77]),
              ("b1 L1000", 1, 1, 128, [1000]), ("b3 L5000 sq2", 3, 2, 128, [5000, 4097, 130]),
              ("b64 L700", 64, 1, 128, [700] * 64),
              ("b200 var", 200, 1, 128, [int(x) for x in torch.randint(1, 3000, (200,))])]
    var = [int(x) for x in torch.randint(64, 8193, (128,), generator=torch.Generator().manual_seed(1))]
    cases = [("b128 L4096 sq1 h128", 1, 128, [4096] * 128), ("b128 L8192 sq1 h128", 1, 128, [8192] * 128),
             ("b128 L4096 sq2 h128", 2, 128, [4096] * 128), ("b1 L32768 sq1 h128", 1, 128, [32768]),
             ("b128 var8192 sq1 h128", 1, 128, var), ("b128 var8192 sq2 h128", 2, 128, var),
             ("b32 skewed sq2 h128", 2, 128, [65536] + [1024] * 31), ("b4100 L256 sq2 h128", 2, 128, [256] * 4100)]
    if any_heads:
        shapes += [("b1 L64 h16", 1, 1, 16, [64]), ("b1 L1 sq2 h16", 1, 2, 16, [2]),
                   ("b3 L300 sq2 h16", 3, 2, 16, [300, 2, 129]),
                   ("b5 L2000 sq3 h48", 5, 3, 48, [2000, 64, 3, 999, 70]),
                   ("b200 var sq2 h16", 200, 2, 16, [int(x) for x in torch.randint(2, 3000, (200,))]),
                   ("b32 skewed sq2 h16", 32, 2, 16, [5000] + [300] * 31),
                   ("b300 L256 sq2 h128", 300, 2, 128, [256] * 300),
                   ("b128 L130 h16", 128, 1, 16, [130] * 128), ("b64 L700 sq2 h16", 64, 2, 16, [700] * 64)]
        cases += [("b128 L8192 sq1 h16", 1, 16, [8192] * 128), ("b128 L8192 sq2 h16", 2, 16, [8192] * 128),
                  ("b128 var8192 sq2 h16", 2, 16, var), ("b32 skewed sq2 h16", 2, 16, [65536] + [1024] * 31)]
    if not all([check(run, *shape) for shape in shapes]):
        return 1
    timings(run, cases, kernels="--kernels" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
