"""Checks the `cuda_wgmma` decode kernel on a GPU against an fp32 reference, then times it beside FlashMLA.

    python benchmarks/flashmla_decode_wgmma_check.py

Builds `solutions/_shared/flashmla_decode_cuda_wgmma` with the folder's own flags (torch's extension
loader, into a temporary folder), runs nine shapes (1 to 200 requests, lengths 1 to 5000, one and two
query tokens, 64 and 128 heads; cache blocks scrambled; NaN in every cache slot past a request's length)
and compares out and lse with an fp32 computation of the definition's math; exits 1 if any differs.
Then times b128 L4096 / L8192 (one and two query tokens) and one request of 32768 keys with
`triton.testing.do_bench` (its own L2 handling, not the harness's), and FlashMLA's SM90 kernel on the same
inputs when `flash_mla` imports. A development check: the harness's verdicts and times are `flashbench run`'s.
"""

import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

SOURCES = Path(__file__).resolve().parents[1] / "solutions" / "_shared" / "flashmla_decode_cuda_wgmma"
FLAGS = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "--use_fast_math", "-lineinfo"]
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


def check(module, name, batch, s_q, heads, lengths) -> bool:
    torch.manual_seed(0)
    q, cache, table, lengths = inputs(batch, s_q, heads, lengths)
    out, lse = outputs(q)
    module.run(q, cache, table, lengths, SCALE, out, lse)
    torch.cuda.synchronize()
    want_out, want_lse = reference(q, cache, table, lengths)
    out_err = (out.float() - want_out).abs()
    lse_err = (lse - want_lse).abs()
    ok = bool((out_err <= 0.02 + 0.02 * want_out.abs()).all()) and bool((lse_err <= 1e-3).all())
    print(f"{'PASS' if ok else 'FAIL'} {name}: out max error {out_err.nan_to_num(1e9).max():.4g}, "
          f"lse max error {lse_err.nan_to_num(1e9).max():.4g}", flush=True)
    return ok


def timings(module):
    from triton.testing import do_bench
    try:
        import flash_mla
    except ImportError:
        flash_mla = None
    for batch, length, s_q in [(128, 4096, 1), (128, 8192, 1), (128, 4096, 2), (1, 32768, 1)]:
        torch.manual_seed(0)
        q, cache, table, lengths = inputs(batch, s_q, 128, [length] * batch, nan_past_end=False)
        out, lse = outputs(q)
        ours = do_bench(lambda: module.run(q, cache, table, lengths, SCALE, out, lse), warmup=50, rep=300)
        flops = batch * s_q * 128 * length * (576 + 512) * 2
        line = f"b{batch} L{length} sq{s_q}: ours {ours * 1e3:.1f} us ({flops / ours / 1e9:.0f} TFLOP/s)"
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


def main() -> int:
    started = time.time()
    with tempfile.TemporaryDirectory() as build:
        module = load(name="flashmla_wgmma_check", sources=[str(SOURCES / "flashmla_decode_wgmma.cu"),
                                                             str(SOURCES / "binding.cpp")],
                      extra_cuda_cflags=FLAGS, build_directory=build)
        print(f"built in {time.time() - started:.0f} s", flush=True)
        shapes = [("b1 L64", 1, 1, 64, [64]), ("b1 L128", 1, 1, 64, [128]), ("b1 L100", 1, 1, 64, [100]),
                  ("b1 L1 h128", 1, 1, 128, [1]), ("b2 L300 sq2", 2, 2, 128, [300, 77]),
                  ("b1 L1000", 1, 1, 128, [1000]), ("b3 L5000 sq2", 3, 2, 128, [5000, 4097, 130]),
                  ("b64 L700", 64, 1, 128, [700] * 64),
                  ("b200 var", 200, 1, 128, [int(x) for x in torch.randint(1, 3000, (200,))])]
        if not all([check(module, *shape) for shape in shapes]):
            return 1
        timings(module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
